#!/usr/bin/env python
"""docs/BENCHMARKS.md from the results files: the reports' index, the headline and a line per
suite no report holds; with ``--suite`` that suite's runs in full (run_benchmarks.py report)."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import throughput  # noqa: E402
from calibrate_planner import is_whole_states  # noqa: E402

from offload_runner.report import fmt, markdown_table, max_abs_delta, ratio, saved  # noqa: E402


def _families(files: list[Path]) -> dict[str, list[tuple[Path, dict]]]:
    """Suites split over several calls (proxy-1, proxy-2) render as one table."""
    families: dict[str, list[tuple[Path, dict]]] = {}
    for path in files:
        data = json.loads(path.read_text())
        family = re.sub(r"-\d+$", "", data["suite"])
        families.setdefault(family, []).append((path, data))
    return families


def _baseline(r: dict, by_name: dict) -> dict:
    """The summary of ``r``'s baseline run: of its own call where render found one."""
    return (r.get("base") or by_name.get(r["case"]["baseline"], {})).get("summary", {})


def _of_call(r: dict, name: str, results: list[dict], by_name: dict) -> dict:
    """Case ``name``'s run from ``r``'s own call where it ran there, else the family's."""
    mine = [o for o in results if o["source"] == r["source"] and o["case"]["name"] == name]
    return mine[0] if mine else by_name.get(name, {})


def case_label(r: dict) -> str:
    """The case name; state-offload runs that moved whole tensors under the old meaning of
    offload/optimizer=states say so."""
    name = r["case"]["name"]
    name += r.get("call", "")  # which call, where a family's calls share a case
    if is_whole_states(r) and "whole" not in name:
        return f"{name} [whole tensors]"
    return name


# The headline: per offload mode and batch, its latest suite's row against that suite's
# baseline (suite, case); the suite tables below hold everything else.
HEADLINE = [
    # throughput: today's line (MB 1, Megatron-Core's kernels), the fused kernels at MB 4, auto
    ("throughput-16", "MB1 plain"),
    ("throughput-16", "MB4 fused"),
    ("throughput-16", "auto"),
    # the 37-layer slice, then the whole model, on one H200: today's line against auto
    ("throughput-37", "today"),
    ("throughput-37", "auto"),
    ("whole-model", "whole model, no offload"),
    ("whole-model-mb", "MB 1"),
    ("whole-model-fast", "auto"),
    # the CPU-Adam engine's modes with the fused kernels
    *[
        ("engines-8", f"GBS8 {n}")
        for n in ("cpu_adam", "cpu_adam_delayed", "cpu_adam bf16 moments")
    ],
    ("two-gpu-full-2", "full EP2 auto"),
    ("two-gpu-engines", "proxy DP2 GBS8 states"),
    ("two-gpu-engines-2", "proxy EP2 GBS8 states"),
    ("llama3-8b-auto", "llama3_8b seq 8192 GBS 8, auto"),
    ("weight-offload", "dense 8 layers, states + weights of 8"),
    ("weight-offload", "proxy, states + weights of 4"),
    ("weight-offload-caps", "llama3_8b under 48 GB, weights of 31 layers"),
    ("weight-offload-caps-proxy", "proxy under 12 GB, weights of 4 layers"),
    ("cpu-adam-split-1", "GBS1 cpu_adam 100%"),
    # exact offload's cost at each batch: the latest suites (one H100)
    *[
        (f"gbs-{gbs}-beside", f"cost GBS{gbs} {name}")
        for gbs in (4, 8, 32)
        for name in ("cpu_adam 100%", "states")
    ],
]


HEADLINE_COLUMNS = [
    "run",
    "suite, commit",
    "GPU",
    "status",
    "step ms",
    "step vs baseline",
    "fwd+bwd vs baseline",
    "tokens/s",
    "TFLOP/s/GPU",
    "GPU peak GB",
    "host RAM GB",
]


# Suites run in interleaved rounds over several calls: the headline takes each row's medians.
INTERLEAVED = {"throughput-16", "throughput-37", "engines-4", "engines-8", "mb8-states"}
MEDIAN_KEYS = (
    "step_time_s_median",
    "fwd_bwd_time_s_median",
    "tokens_per_s_median",
    "tflops_per_gpu_median",
    "gpu_peak_allocated_gb",
)


def _medians(calls: list[dict], key: tuple[str, str]) -> dict:
    """A row's summary with MEDIAN_KEYS as medians over every call's ok run of it."""
    runs = [
        r["summary"]
        for d in calls
        if d["suite"] == key[0]
        for r in d["results"]
        if r["case"]["name"] == key[1] and r["status"] == "ok"
    ]
    return {**runs[-1], **{k: statistics.median(s[k] for s in runs) for k in MEDIAN_KEYS}}


def _gpu_label(call: dict, result: dict) -> str:
    """The GPU a run used, and how many where more than one ("H200 x2")."""
    n = result["case"].get("nproc", 1)
    return call["environment"]["gpu"].replace("NVIDIA ", "") + (f" x{n}" if n > 1 else "")


def _headline(files: list[Path]) -> list[str]:
    """The HEADLINE rows found among ``files``: what each offload mode costs, as measured."""
    calls = sorted(
        (json.loads(p.read_text()) for p in files), key=lambda d: d["environment"]["date"]
    )
    found = {(d["suite"], r["case"]["name"]): (r, d) for d in calls for r in d["results"]}  # latest
    kinds: dict[str, list] = {}  # a table per GPU kind
    for key in HEADLINE:
        if key not in found:
            continue
        r, d = found[key]
        s = r["summary"]
        base = next(
            (
                b["summary"]
                for b in d["results"]
                if b["case"]["name"] == r["case"]["baseline"] != r["case"]["name"]
            ),
            {},
        )
        if key[0] in INTERLEAVED:  # the medians over the suite's calls, its rounds
            s = _medians(calls, key)
            base = _medians(calls, (key[0], r["case"]["baseline"])) if base else {}
        step = s.get("step_time_s_median")
        fb, base_fb = s.get("fwd_bwd_time_s_median"), base.get("fwd_bwd_time_s_median")
        kinds.setdefault(d["environment"]["gpu"], []).append(
            [
                r["case"]["name"],
                f"`{key[0]}` {d['environment']['commit'][:7]}",
                _gpu_label(d, r),
                r["status"],
                fmt(step * 1000 if step else None, ".0f"),
                fmt(ratio(step, base.get("step_time_s_median")), ".2f", "x"),
                fmt(ratio(fb, base_fb), ".2f", "x"),
                fmt(s.get("tokens_per_s_median"), ",.0f"),
                fmt(s.get("tflops_per_gpu_median"), ".0f"),
                fmt(s.get("gpu_peak_allocated_gb")),
                fmt(s.get("host_used_gb_max_per_node", [None])[0]),
            ]
        )
    if not kinds:
        return []
    tables = [
        [f"### {gpu}", "", *markdown_table(HEADLINE_COLUMNS, rows), ""]
        for gpu, rows in kinds.items()
    ]
    return [
        "## Headline",
        "",
        "What each offload mode costs, from its latest suite (ratios against that suite's own",
        "baseline on the same machine: its no-offload run, or for weight offload the same run",
        "with its weights on the GPU; the proxy at micro-batch 1 is launch-bound, so a suite's",
        "baseline wanders with the host: compare within a suite). Rows of suites run in",
        f"interleaved rounds ({', '.join(f'`{x}`' for x in sorted(INTERLEAVED))}) are medians over "
        "their calls.",
        "",
        *(line for table in tables for line in table),
    ]


REPORTS = ROOT / "docs/benchmarks"


def _reports() -> list[str]:
    """A line per topic report in docs/benchmarks/ (its title)."""
    found = sorted(REPORTS.glob("*.md"))
    lines = [
        f"- [{p.read_text().splitlines()[0].lstrip('# ')}](benchmarks/{p.name})" for p in found
    ]
    return ["## Reports", "", *lines, ""] if lines else []


def render(files: list[Path], suite: str | None = None) -> str:
    """docs/BENCHMARKS.md: the reports, the headline and a line per suite; with ``suite``, that
    suite's runs in full instead (their tables, bounds, commands and loss curves)."""
    families = _families(files)
    if suite is not None:
        return "\n".join(_suite_section(suite, families[suite]))
    lines = [
        "# Benchmarks",
        "",
        "Real training runs, recorded by `bench/run_benchmarks.py` in `bench/results/` and read",
        "here (never edited by hand). Step time is the median over iterations 3..N; peak GPU",
        "memory is `torch.cuda.max_memory_allocated()`; GB are GiB.",
        "",
        "    python bench/run_benchmarks.py run --suite SUITE --out results-SUITE.json   # GPU",
        "    python bench/run_benchmarks.py report bench/results/*.json > docs/BENCHMARKS.md",
        "    python bench/run_benchmarks.py report --suite SUITE bench/results/*.json  # its runs",
        "",
        *_reports(),
        *_headline(files),
        *_suite_index(families),
    ]
    return "\n".join(lines)


def _suite_index(families: dict[str, list[tuple[Path, dict]]]) -> list[str]:
    """A row per suite whose findings no report holds: its calls, GPU, rows and dates (its runs
    in full: ``report --suite``)."""
    rows = []
    for suite, group in sorted(families.items()):
        if all(d["suite"] in IN_REPORTS for _, d in group):
            continue
        gpus = sorted({_gpu_label(d, r) for _, d in group for r in d["results"]})
        dates = sorted(d["environment"]["date"][:10] for _, d in group)
        cases = {r["case"]["name"] for _, d in group for r in d["results"]}
        span = dates[0] if dates[0] == dates[-1] else f"{dates[0]}..{dates[-1][5:]}"
        rows.append([f"`{suite}`", str(len(group)), ", ".join(gpus), str(len(cases)), span])
    head = ["suite", "calls", "GPU", "rows", "dates"]
    return ["## Every other suite", "", *markdown_table(head, rows), ""] if rows else []


# Suites whose findings live in a topic report of docs/benchmarks (once, there):
# bench/throughput.py's, convergence.py's, capacity.py's, weight_offload.py's, gbs_report.py's,
# gpu_tests.py's, templates/cpu-adam.md's.
CAPACITY = {"capacity-28", "capacity-auto-28", "capacity-auto-31", "capacity-auto-37"}
GBS_CALLS = ("", "-beside", "-grown", "-pairs", "-pairs-2", "-pairs-3", "-pairs-4")
OPTIMIZER_OFFLOAD = {  # gbs_report.py's
    "beside-4-ab",
    "exact-4-ab",
    *(f"remainders-{n}" for n in (4, 8, 32)),
    *(f"gbs-{n}{call}" for n in (4, 8, 32) for call in GBS_CALLS),
}
CPU_ADAM = {  # templates/cpu-adam.md's
    "adam-parity",
    "cpu-adam-landing",
    "cpu-adam-experts-ep2",
    *(f"cpu-adam-{name}" for name in ("4", "4-backward", "4-delayed", "4-pieces")),
    *(f"cpu-adam-split-{n}" for n in (1, 4)),
    *(f"cpu-adam-late-share-{n}" for n in (1, 4)),
    *(f"cpu-adam-conv-{n}" for n in (1, 2, 3, 4, 7, 8)),
    *(f"cpu-adam-ep2-conv-{n}" for n in (1, 2, 3)),
    "cpu-adam-long",
    *(f"cpu-adam-long-{n}" for n in range(2, 6)),
}
IN_REPORTS = {
    *OPTIMIZER_OFFLOAD,
    *CPU_ADAM,
    *throughput.SUITES,
    "convergence",
    "convergence-ep2",
    *CAPACITY,
    "whole-model",
    "full-4gpu",
    "two-gpu-full-1",
    "two-gpu-full-2",
    "weight-offload",
    "weight-offload-caps",
    "weight-offload-caps-proxy",
    "weight-offload-caps-reference",
    "hf-finetune",  # hf_finetune.py's
}


def _suite_section(suite: str, group: list[tuple[Path, dict]]) -> list[str]:
    """One suite family's section: the machine of each call, its rows' table, the lines set
    against bounds, the commands and the loss curves."""
    results = [
        {**r, "environment": d["environment"], "source": path.name}
        for path, d in group
        for r in d["results"]
    ]
    by_name = {r["case"]["name"]: r for r in results}
    names = [r["case"]["name"] for r in results]
    for r in results:  # the baseline of its own call where it has one, else the family's
        r["base"] = _of_call(r, r["case"]["baseline"], results, by_name)
        if len(set(names)) < len(names):  # calls share a case: each row says its call
            r["call"] = f" ({r['source'].removeprefix('results-').removesuffix('.json')})"
    iters = sorted({d["iters"] for _, d in group})
    lines = [f"## Suite `{suite}` ({' / '.join(map(str, iters))} iterations)", ""]
    for path, d in group:  # a family's files may come from different calls or machines
        e = d["environment"]
        lines += [
            f"GPU: {e['gpu']} x{e['gpu_count']} · torch {e['torch']} (CUDA {e['cuda']}) · "
            f"megatron-core {e['megatron.core']} · transformer-engine "
            f"{e['transformer_engine']} · Python {e['python']} · {e['date']} · "
            f"commit {e['commit']} · {d['iters']} iterations · "
            f"{', '.join(r['case']['name'] for r in d['results'])} · source `{path.name}`",
            "",
        ]
    lines += markdown_table(
        [
            "config",
            "status",
            "step ms (fwd+bwd / rest)",
            "slowdown",
            "peak GPU GB",
            "saved GB",
            "peak fwd+bwd / step GB",
            "pinned host GB",
            "final loss",
            "max abs Δloss vs baseline",
        ],
        [_row(r, by_name) for r in results],
    )
    lines += [
        f"- {r['case']['name']}: auto chose {r['summary']['auto']}"
        for r in results
        if r["summary"].get("auto")
    ]
    lines += ["", "Commands:", ""]
    lines += [f"- {case_label(r)}: `{' '.join(r['command'])}`" for r in results]
    lines += _loss_curves(results)
    for r in results:
        if r["status"] != "ok":
            lines += [
                "",
                f"`{r['case']['name']}` ended:",
                "",
                "```",
                failure_lines(r["error_tail"]),
                "```",
            ]
    return [*lines, ""]


def _row(r: dict, by_name: dict) -> list[str]:
    """A run's row of its suite's table, against its baseline."""
    s = r["summary"]
    base = _baseline(r, by_name)
    step, peak = s.get("step_time_s_median"), s.get("gpu_peak_allocated_gb")
    same = r["case"]["name"] == r["case"]["baseline"]
    phases = (
        f" ({s['fwd_bwd_time_s_median'] * 1000:.0f} / {s['optimizer_time_s_median'] * 1000:.0f})"
        if s.get("fwd_bwd_time_s_median")
        else ""
    )
    delta = max_abs_delta(s.get("losses", []), base.get("losses", []))
    return [
        case_label(r),
        r["status"],
        fmt(step * 1000 if step else None, ".1f") + phases,
        fmt(ratio(step, base.get("step_time_s_median")), ".2f", "x"),
        fmt(peak),
        fmt(None if same else saved(peak, base.get("gpu_peak_allocated_gb")), "+.2f"),
        f"{s['gpu_peak_fwd_bwd_gb']:.2f} / {s['gpu_peak_step_gb']:.2f}"
        if s.get("gpu_peak_step_gb")
        else "-",
        fmt(s.get("host_pinned_gb_max")),
        fmt(s.get("final_loss"), ".4f"),
        "(baseline)" if same else fmt(delta, ".2e"),
    ]


def _loss_curves(results: list[dict]) -> list[str]:
    """Every run's per-iteration loss, a column each, folded away."""
    losses = {case_label(r): r["summary"].get("losses", []) for r in results}
    longest = max((len(v) for v in losses.values()), default=0)
    if not longest:
        return []
    curves = [
        [f"{v[i]:.4f}" if i < len(v) else "" for v in losses.values()] for i in range(longest)
    ]
    return [
        "",
        "<details><summary>loss curves</summary>",
        "",
        *markdown_table(["iter", *losses], [[str(i + 1), *row] for i, row in enumerate(curves)]),
        "",
        "</details>",
    ]


def failure_lines(tail: str) -> str:
    """What the user saw of a failed run (our error and fix lines) and the rank log's exception
    line; the whole tail where neither is there."""
    lines = tail.splitlines()
    said = [line for line in lines if line.startswith(("error:", "  fix:"))]
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b", line)]
    return "\n".join([*said, *raised[-1:]]) if said else tail[-1500:]
