#!/usr/bin/env python
"""Throughput suites (``throughput-16``, ``throughput-37``, ``engines-4``/``-8``): each row's
median over its interleaved rounds, the GPU step-time model fitted on the calibration rows of
``throughput-16`` and held to the rest, and the report.

    python bench/throughput.py fit bench/results/results-throughput-16-r[1-3].json
    python bench/throughput.py report bench/results/results-{throughput,engines,mb8}-*-r*.json \\
        --plots docs/benchmarks > docs/benchmarks/throughput.md

``fit`` prints the rates hardware.GPU_RATES and GPU_ADAM_S_PER_PARAM take (least squares over
the calibration rows' forward+backward medians); ``report`` writes the Markdown report, a
section and a PNG per suite (each round's step a point, the model's a cross). Runs on any
machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from calibrate_planner import as_it_ran  # noqa: E402

from offload_runner.auto import choose_offload, with_overrides  # noqa: E402
from offload_runner.config.compose import compose_config, to_run_config  # noqa: E402
from offload_runner.config.schema import RunConfig  # noqa: E402
from offload_runner.gpu_time import Predicted, kernels, predict  # noqa: E402
from offload_runner.hardware import GPU_RATES, GpuRates  # noqa: E402
from offload_runner.model_size import count_parameters, training_flops_per_token  # noqa: E402
from offload_runner.plan import Layout, make_plan, rank_micro_batches  # noqa: E402
from offload_runner.report import markdown_table  # noqa: E402
from offload_runner.step_cost import step_cost  # noqa: E402

# The rows the model's rates were fitted on; every other row is held out.
FITTED_ON = frozenset({"MB1 plain", "MB4 plain", "MB1 fused", "MB4 fused"})
TOLERANCE = 0.15  # the bar for a predicted step


@dataclass
class Row:
    """One case of a suite over its rounds."""

    name: str
    runs: list[dict] = field(default_factory=list)  # results, in round order
    # per call (results file) that ran two fitted rows of its kernels: their rates refit there
    call_rates: dict[str, GpuRates] = field(default_factory=dict)

    def values(self, key: str, sources: set[str] | None = None) -> list[float]:
        """``key`` of its ok runs (of the calls, files, ``sources`` only where given)."""
        return [
            r["summary"][key]
            for r in self.runs
            if r["status"] == "ok"
            and key in r["summary"]
            and (sources is None or r["source"] in sources)
        ]

    def median(self, key: str) -> float:
        return statistics.median(self.values(key))

    def spread(self, key: str = "step_time_s_median") -> tuple[float, float]:
        found = self.values(key)
        return min(found), max(found)

    @property
    def sources(self) -> set[str]:
        return {r["source"] for r in self.runs}

    def call_errors(self) -> list[tuple[float, float]]:
        """Per call that refit the rates: the model's step at that call's rates, and the
        median step of this row's runs there (the host's launch speed moved 25% between
        calls; the model's shape is what a call holds it to)."""
        out = []
        for source, gpu in sorted(self.call_rates.items()):
            found = self.values("step_time_s_median", {source})
            if found:
                out.append((predicted(self.run, gpu).step_s, statistics.median(found)))
        return out

    @property
    def held_out(self) -> bool:
        return self.name not in FITTED_ON

    @functools.cached_property
    def run(self) -> RunConfig:
        """The config its first run trained with (composed once: seconds)."""
        return run_of(self.runs[0])

    @functools.cached_property
    def model_step_s(self) -> float:
        """The model's step for it."""
        return predicted(self.run).step_s


def load(files: list[Path]) -> tuple[list[Row], dict]:
    """The suite's rows in their order, each with its runs over the files (rounds), and the
    first file's environment."""
    rows: dict[str, Row] = {}
    env: dict = {}
    for path in sorted(files):
        data = json.loads(path.read_text())
        commits = [*env.get("commits", []), data["environment"]["commit"]]
        dates = sorted({*env.get("dates", []), data["environment"]["date"][:10]})
        env = {
            **(env or data["environment"]),
            "commits": list(dict.fromkeys(commits)),
            "dates": dates,
        }
        for result in data["results"]:
            result = {**result, "environment": data["environment"], "source": path.name}
            rows.setdefault(result["case"]["name"], Row(result["case"]["name"])).runs.append(result)
    first = json.loads(sorted(files)[0].read_text())["results"]
    order = list(dict.fromkeys(c["case"]["name"] for c in first))
    ordered = [rows[n] for n in order if n in rows] + [r for n, r in rows.items() if n not in order]
    per_call = {
        source: fit(ordered, {source})["rates"]
        for source in {r["source"] for row in ordered for r in row.runs}
    }
    for row in ordered:
        own = kernels(row.run)
        row.call_rates = {
            source: gpu_rates(rates[own])
            for source, rates in per_call.items()
            if own in rates and source in row.sources
        }
    return ordered, env


def run_of(result: dict) -> RunConfig:
    """The config a recorded run trained with: its command line and its host's CPU Adam rate,
    with what auto chose there (auto chooses again here, from the same plan; the choice is
    printed in the report)."""
    overrides = as_it_ran(result)
    threads = result.get("summary", {}).get("cpu_adam_threads")
    rates = result["environment"].get("cpu_adam_reference_params_per_s") or {}
    if str(threads) in rates:  # the host's CPU Adam rate, not this machine's
        overrides.append(f"planner.cpu_adam_params_per_s={rates[str(threads)]:.4g}")
    run = to_run_config(compose_config(overrides))
    if run.planner.auto:
        run = with_overrides(run, choose_offload(run).overrides)
    return run


def predicted(run: RunConfig, gpu: GpuRates | None = None) -> Predicted:
    """The model's step for a recorded run's config (its offload's cost from StepCost), at
    ``gpu``'s rates (default hardware.GPU_RATES)."""
    plan = make_plan(run)
    cost = step_cost(run)
    return predict(run, max(cost.seconds(run, r) for r in plan.ranks), gpu=gpu)


def gpu_rates(fitted: dict) -> GpuRates:
    """A fit's rates as the model takes them (the dense layer's fixed time is not fitted)."""
    dense = GPU_RATES["plain"].dense_layer_s
    return GpuRates(flops=fitted["flops"], dense_layer_s=dense, expert_s=fitted["expert_s"])


# --- the fit --------------------------------------------------------------------------------------


def fit(rows: list[Row], sources: set[str] | None = None) -> dict:
    """Least squares over the calibration rows (their runs in the calls ``sources``, default
    all), per kernel set with two of them or more: forward+backward = expert_s x
    (micro-batches x layers x local experts) + step FLOPs / flops, after each layer's dense
    fixed time; and the GPU's Adam seconds per param from every no-offload row's optimizer
    phase."""
    samples: dict[str, list[tuple[float, float, float]]] = {}
    adam = []
    for row in rows:
        run, fwd_bwd = row.run, row.values("fwd_bwd_time_s_median", sources)
        if not row.held_out and fwd_bwd:
            layout = Layout.of(run)
            n, m = rank_micro_batches(run, layout), run.model
            dense = n * m.num_layers * GPU_RATES["plain"].dense_layer_s
            experts = n * m.num_layers * (m.num_moe_experts or 0) / layout.ep
            flops = training_flops_per_token(m) * run.train.global_batch_size * m.seq_length
            samples.setdefault(kernels(run), []).append(
                (experts, flops, statistics.median(fwd_bwd) - dense)
            )
        if not (run.optimizer.optimizer_cpu_offload or run.optimizer.offload_optimizer_states):
            params = count_parameters(run.model).total
            adam += [s / params for s in row.values("optimizer_time_s_median", sources)]
    rates = {k: _least_squares(v) for k, v in samples.items() if len(v) > 1}
    return {"rates": rates, "gpu_adam_s_per_param": statistics.median(adam) if adam else None}


def _least_squares(samples: list[tuple[float, float, float]]) -> dict:
    """y = a x1 + b x2 over (x1, x2, y): a (expert_s) and 1 / b (flops)."""
    s11 = sum(x1 * x1 for x1, _, _ in samples)
    s12 = sum(x1 * x2 for x1, x2, _ in samples)
    s22 = sum(x2 * x2 for _, x2, _ in samples)
    s1y = sum(x1 * y for x1, _, y in samples)
    s2y = sum(x2 * y for _, x2, y in samples)
    det = s11 * s22 - s12 * s12
    a = (s1y * s22 - s2y * s12) / det
    b = (s11 * s2y - s12 * s1y) / det
    return {"expert_s": a, "flops": 1 / b}


# --- the report -----------------------------------------------------------------------------------


def table(rows: list[Row]) -> list[list[str]]:
    """Each row: its rounds' median step and spread, tokens/s, TFLOP/s, peak, the model's step
    and its error, and whether it was fitted on."""
    out = []
    for row in rows:
        step = row.median("step_time_s_median")
        low, high = row.spread()
        errors = [f"{(model - ran) / ran:+.0%}" for model, ran in row.call_errors()]
        out.append(
            [
                row.name,
                f"{len(row.values('step_time_s_median'))}",
                f"{step:.3f}",
                f"{low:.3f}-{high:.3f}",
                f"{row.median('tokens_per_s_median'):,.0f}",
                f"{row.median('tflops_per_gpu_median'):.0f}",
                f"{row.median('gpu_peak_allocated_gb'):.1f}",
                f"{row.model_step_s:.3f}",
                ", ".join(errors) if row.held_out else "",
                "fitted" if not row.held_out else "held out",
            ]
        )
    return out


def inside_spread(a: list[float], b: list[float]) -> bool:
    """Whether two rows' step times overlap: a difference between them is then within the
    host's noise."""
    return min(a) <= max(b) and min(b) <= max(a)


# Per suite: its title, what it ran, and its comparisons (row, against row, what it says).
SUITES = {
    "throughput-16": (
        "Kernels, micro-batch and auto on the proxy",
        "The Qwen3-30B-A3B proxy (4 layers, 3.11B params), GBS 16, seq 4096, under a 79 GB cap. "
        "`plain`: Megatron-Core's defaults (`speed=plain`); `fused`: the NVIDIA recipes' "
        "settings (`speed=fused`, the recipes' default).",
        [
            ("MB1 fused", "MB1 plain", "the fusions at MB 1"),
            ("MB4 fused", "MB4 plain", "the fusions at MB 4"),
            ("MB4 plain", "MB1 plain", "MB 4 over MB 1, plain kernels"),
            ("MB4 fused", "MB1 fused", "MB 4 over MB 1, fused kernels"),
            ("auto", "MB1 plain", "auto over today's line (MB 1, plain, no offload)"),
        ],
    ),
    "throughput-37": (
        "The 37-layer slice on one H200: today's line against auto",
        "37 of Qwen3-30B-A3B's 48 layers (23.7B params), GBS 8, seq 4096, planned for a 139 GB "
        "GPU and 125 GB of host memory. `today`: MB 1, plain kernels, `offload/optimizer=auto` "
        "(the line of 473614f); `auto`: `train.micro_batch_size=auto offload/optimizer=auto` "
        "with the recipe's fused kernels.",
        [("auto", "today", "auto over today's line")],
    ),
    **{
        f"engines-{gbs}": (
            f"The CPU-Adam engine's modes at GBS {gbs}",
            f"The proxy, GBS {gbs}, MB 1, fused kernels: exact `cpu_adam`, `cpu_adam_delayed` "
            "(delayed after two exact steps) and exact `cpu_adam` with bf16 moments (from "
            "commit c8d7f82 on, their CPU Adam one pass of host_kernel's compiled loop, not "
            "fp32 blocks upcast and rounded back).",
            [
                (f"GBS{gbs} cpu_adam_delayed", f"GBS{gbs} cpu_adam", "delayed over exact"),
                (
                    f"GBS{gbs} cpu_adam bf16 moments",
                    f"GBS{gbs} cpu_adam",
                    "bf16 moments over fp32 moments",
                ),
            ],
        )
        for gbs in (4, 8)
    },
    "whole-model-fast": (
        "The whole model on one H200: today's line against auto",
        "All 48 layers of Qwen3-30B-A3B (30.5B params), GBS 16, planned for 139 GB and 125 GB "
        "of RAM, `offload/optimizer=auto`; `today` MB 1, `auto` `train.micro_batch_size=auto`. "
        "Each row ran in a device call of its own (a pair took 560 s of the 600 a call may "
        "run), so no ratio is taken.",
        [],
    ),
    "whole-model-mb": (
        "The whole model on one H200 at each micro-batch (the planner's suite)",
        "All 48 layers, GBS 16, full recompute, `offload/optimizer=auto`, 3 iterations (one "
        "steady step: memory, not speed); MB 8 with `model.chunked_loss`.",
        [],
    ),
    "mb8-states": (
        "State offload at MB 8: its stream against the same shape without offload",
        "The proxy, GBS 16, MB 8, fused kernels: no offload (no cap: it takes 85 GB) and "
        "`offload/optimizer=states` (under the 79 GB cap, as in `throughput-16`).",
        [("MB8 fused", "MB8 fused states", "no offload over state offload")],
    ),
}


def comparisons(rows: list[Row], pairs: list[tuple[str, str, str]]) -> list[str]:
    """The suite's ratios, each over the calls that ran both rows and said to be outside or
    inside their spread; then, where the calls were several, each that ran both rows twice (each
    call an interleaved comparison of its own, perhaps of other code), each such call's."""
    by = {r.name: r for r in rows}
    lines = []
    for fast, slow, what in pairs:
        if fast in by and slow in by:
            both = by[fast].sources & by[slow].sources
            a, b = (by[n].values("step_time_s_median", both) for n in (fast, slow))
            if not a or not b:
                continue
            ratio = statistics.median(a) / statistics.median(b)
            line = f"- {what}: {1 / ratio:.2f}x tokens/s, {ratio:.2f}x the step ({_noise(a, b)})"
            calls = [_call_ratio(by[fast], by[slow], c) for c in sorted(both)]
            calls = [c for c in calls if c]
            spans = len(both) > 1 and calls
            lines.append(line + ("; by call: " + ", ".join(calls) if spans else ""))
    return lines


def streams(rows: list[Row]) -> list[str]:
    """Where state offload ran: its stream's median time and rate, and the next forward's wait
    for the pieces the stream had not brought back."""
    lines = []
    for row in rows:
        if row.values("states_stream_s_median"):
            lines.append(
                f"- {row.name}: the state stream took {row.median('states_stream_s_median'):.2f} s "
                f"({row.median('states_link_gb_per_s'):.0f} GB/s each way, "
                f"{row.median('states_in_backward_gb'):.0f} GB during the last backward); the "
                f"next forward waited {row.median('states_forward_wait_s_median'):.2f} s for it"
            )
    return lines


def _noise(a: list[float], b: list[float]) -> str:
    return "inside the spread" if inside_spread(a, b) else "outside it"


def _call_ratio(fast: Row, slow: Row, source: str) -> str:
    """``r5 (commit) 0.85x (outside it)``: one call's ratio of the step, where it ran each row
    at least twice; else empty."""
    a, b = (r.values("step_time_s_median", {source}) for r in (fast, slow))
    if len(a) < 2 or len(b) < 2:
        return ""
    commit = next(r["environment"].get("commit", "?") for r in fast.runs if r["source"] == source)
    name = source.removesuffix(".json").rsplit("-", 1)[-1]
    ratio = statistics.median(a) / statistics.median(b)
    return f"{name} ({commit[:7]}) {ratio:.2f}x ({_noise(a, b)})"


def misses(rows: list[Row]) -> list[str]:
    """The held-out rows the model misses by more than TOLERANCE, with what their runs show."""
    lines, judged = [], 0
    for row in rows:
        found = row.call_errors()
        if not row.held_out or not found:
            continue
        judged += 1
        if abs(median_error(found)) < TOLERANCE:
            continue
        said = ", ".join(f"{model:.2f} s against {ran:.2f} s" for model, ran in found)
        lines.append(f"- {row.name}: at each call's rates the model said {said}")
    if lines:
        return [f"Held-out rows the model misses by more than {TOLERANCE:.0%}:", *lines, ""]
    if judged:
        return [
            f"Every held-out row is within {TOLERANCE:.0%} (the median of its calls' errors).",
            "",
        ]
    return []


def median_error(found: list[tuple[float, float]]) -> float:
    """The median over calls of (model - measured) / measured."""
    return statistics.median((model - ran) / ran for model, ran in found)


HEADER = [
    "row",
    "runs",
    "step s",
    "spread s",
    "tokens/s",
    "TFLOP/s/GPU",
    "GPU peak GB",
    "model s",
    "error at each call's rates",
    "",
]


def section(suite: str, files: list[Path], plots: Path | None) -> list[str]:
    """One suite's section: what ran, its table, comparisons, misses and plot."""
    rows, env = load(files)
    title, what, pairs = SUITES[suite]
    best = max(rows, key=lambda r: r.median("tokens_per_s_median"))
    auto = next((r for r in rows if r.name == "auto"), None)
    chose = (auto.runs[0]["summary"].get("auto", "") if auto else "").split(" (")[0]
    lines = [
        f"## {title} (suite `{suite}`)",
        "",
        f"{what} One {env['gpu']}; megatron-core {env['megatron.core']}, transformer-engine "
        f"{env['transformer_engine']}; commits {', '.join(env['commits'])}; "
        f"{', '.join(env['dates'])}.",
        "",
        *markdown_table(HEADER, table(rows)),
        "",
        *comparisons(rows, pairs),
        *streams(rows),
        f"- best row: {best.name}" + (f"; auto chose `{chose}`" if chose else ""),
        "",
        *misses(rows),
    ]
    if plots is not None:
        out = plots / f"{suite}.png"
        draw(rows, out, title)
        lines += [f"![{title}]({out.name})", ""]
    return lines


def render(files: list[Path], plots: Path | None) -> str:
    """The report: a section per suite among ``files`` (each suite's rounds together)."""
    by_suite: dict[str, list[Path]] = {}
    for path in files:
        by_suite.setdefault(json.loads(path.read_text())["suite"], []).append(path)
    lines = [
        "# Throughput",
        "",
        "Each row ran once per round, rounds interleaved (A B C ... A B C ...) within a device "
        "call or across calls; step is the median over rounds of each run's median step, with "
        "the rounds' spread; a ratio is inside the spread where the two rows' runs overlap. The "
        "model column is gpu_time.py's step for the same command line (hardware.GPU_RATES, "
        "fitted on four rows of `throughput-16` in its first three calls; every other row held "
        "out). Identical runs moved 25% between calls, and with them the launch-bound fixed "
        "time: each call that ran two fitted rows of a kernel set refits the rates on those "
        "alone, and a held-out row's error is the model at that call's rates against its runs "
        "there, one figure per call; a row misses where the median of its calls' errors is over "
        f"{TOLERANCE:.0%}. `python bench/throughput.py report`.",
        "",
    ]
    for suite in SUITES:
        if suite in by_suite:
            lines += section(suite, by_suite[suite], plots)
    return "\n".join(lines)


def draw(rows: list[Row], out: Path, title: str) -> None:
    """Each row's step in each round, one point a run, rows top to bottom."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.2))
    for i, row in enumerate(rows):
        steps = row.values("step_time_s_median")
        ax.scatter(steps, [i] * len(steps), color="tab:blue", alpha=0.7)
        ax.scatter([row.model_step_s], [i], marker="x", color="tab:red")
    ax.set_yticks(range(len(rows)), [r.name for r in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # the first row on top
    ax.set_xlim(left=0)
    ax.set_xlabel("step s (dots: each round; x: the model)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("fit", "report"))
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--plots", type=Path, default=None, help="folder for a PNG per suite")
    args = parser.parse_args()
    if args.command == "fit":
        print(json.dumps(fit(load(args.files)[0]), indent=1))
    else:
        print(render(args.files, args.plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
