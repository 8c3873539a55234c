#!/usr/bin/env python
"""docs/benchmarks/optimizer-offload.md: exact offload against the global batch, from ``gbs-N``
(H200: no offload twice, the exact engines, HDO and delayed mode), ``gbs-N-pairs`` (no
offload and the exact engines in turn) and ``gbs-N-grown`` (gbs-N's rows again, one H100, after
the state windows grow during the last backward):

    python bench/gbs_report.py cost    # each engine run against its suite's no-offload runs
    python bench/gbs_report.py ends    # where exact CPU Adam's update ends (suites gbs-N)
    python bench/gbs_report.py asks    # what the bars ask of the update, beside the machine
    python bench/gbs_report.py pairs   # forward+backward against no offload at its moment
    python bench/gbs_report.py host    # what the host could give the update, and the engine's gap
    python bench/gbs_report.py remainders  # state offload's masters as remainders (remainders-N)
    python bench/gbs_report.py beside  # state offload's pass beside the next forward
    python bench/gbs_report.py share   # exact CPU Adam's GPU share started with the step
    python bench/gbs_report.py report --plot docs/benchmarks/optimizer-offload.png \\
        > docs/benchmarks/optimizer-offload.md   # all of these in bench/templates' report
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

BARS = {4: 1.6, 8: 1.35, 32: 1.08}  # the step bars, against no offload's step
PEAK_BAR = 0.45  # and its GPU-peak bar
RESULTS = Path(__file__).resolve().parent / "results"
EVIDENCE = Path(__file__).resolve().parent.parent / "docs/evidence"
SPLIT_PROBE = EVIDENCE / "cpu-gpu-split-probe.txt"
EXACT = ("cpu_adam 100%", "states")
ENGINES = (*EXACT, "HDO 100% + overlap", "cpu_adam_delayed 100%")


@dataclass
class Suite:
    """One call's runs at one global batch: its no-offload runs and each engine's, in order."""

    name: str
    gbs: int
    gpu: str
    bases: list[dict]
    runs: list[tuple[str, dict]]  # (engine, summary)
    alone: float  # fused CPU AdamW alone, params/s (the suite's best thread count)
    commit: str = ""

    @property
    def label(self) -> str:
        """The suite's name and the commit it ran (two calls of one suite tell apart by it)."""
        return f"{self.name} @ {self.commit[:7]}" if self.commit else self.name

    @property
    def base(self) -> float:
        return statistics.mean(b["step_time_s_median"] for b in self.bases)

    @property
    def fwd_bwd(self) -> float:
        return statistics.mean(b["fwd_bwd_time_s_median"] for b in self.bases)

    def first(self, engine: str) -> dict:
        return next(s for name, s in self.runs if name == engine)

    def left(self, bar: float) -> float:
        """The time the step bar leaves the update: the bar's step less no offload's
        forward+backward, plus the first micro-batch's forward (a third of one micro-batch's)."""
        return bar * self.base - self.fwd_bwd + self.fwd_bwd / self.gbs / 3


def update_rate(cpu_adam: dict) -> float:
    """A CPU-Adam run's whole update in params/s: its offloaded params over the later end of its
    CPU part and its GPU share's pass."""
    ends = max(cpu_adam["cpu_adam_wall_s_median"], cpu_adam["cpu_adam_stream_s_median"])
    return cpu_adam["cpu_offloaded_params"] / ends


def forward_wait(r: dict) -> float:
    """How long a run's forward+backward waited for its update (state offload's pass beside the
    next forward, CPU Adam's landings): 0 where the run's engine does not say."""
    return r.get("states_forward_wait_s_median", r.get("cpu_adam_forward_wait_s_median", 0.0))


def engine_of(case_name: str) -> str:
    """A cost case's engine: its name less the suite's prefix, run number and repeat mark."""
    return re.sub(r"^cost GBS\d+ | #\d+$| \(repeat\)$", "", case_name)


def load(path: Path, gbs: int) -> Suite:
    data = json.loads(path.read_text())
    bases, runs = [], []
    for r in data["results"]:
        name = engine_of(r["case"]["name"])
        if name == "no offload":
            bases.append(r["summary"])
        else:
            runs.append((name, r["summary"]))
    env = data["environment"]
    alone = max(env.get("cpu_adam_reference_params_per_s", {}).values(), default=0.0)
    return Suite(
        data["suite"],
        gbs,
        env["gpu"].replace("NVIDIA ", ""),
        bases,
        runs,
        alone,
        env.get("commit", ""),
    )


def suites(gbs: int, pairs: bool = True) -> list[Suite]:
    """Suite gbs-N, then (``pairs``) every later call at that batch (gbs-N-pairs*, gbs-N-grown),
    in the order they ran."""
    paths = [RESULTS / f"results-gbs-{gbs}.json"]
    if pairs:
        paths += sorted(RESULTS.glob(f"results-gbs-{gbs}-*.json"), key=_date)
    return [load(path, gbs) for path in paths if path.exists()]


def _date(path: Path) -> str:
    return json.loads(path.read_text())["environment"]["date"]


def floors(s: Suite) -> dict[str, float]:
    """What the measured rates allow each exact engine's step, over no offload's step. State
    offload's pass moves every state down after the global norm (its measured pass is that
    copy out at the link's rate): the next forward reaches its peak once they are out, but for
    what the room under the 0.45x peak bar can hold, and its first micro-batch's forward can
    run beside the pass where the pass runs beside it."""
    ca, st = s.first("cpu_adam 100%"), s.first("states")
    link = st["states_link_gb_per_s"] * 1e9
    params, rate = ca["cpu_offloaded_params"], ca["cpu_adam_params_per_s"]
    share = (1 / rate - 4 / link) / (1 / rate + 8 / link)  # the balanced GPU share
    cover = s.fwd_bwd / s.gbs / 3  # the first micro-batch's forward
    return {
        "cpu_adam 100%": (s.base + (1 - share) * params / rate - cover) / s.base,
        "states": states_floor(s, st),
    }


def states_floor(s: Suite, st: dict) -> float:
    """State offload's floor (``floors``) for its run ``st`` in ``s``."""
    link = st["states_link_gb_per_s"] * 1e9
    room = max(PEAK_BAR * s.bases[0]["gpu_peak_allocated_gb"] - st["gpu_peak_allocated_gb"], 0)
    # beside the next forward (suites gbs-N-beside) the pass may also run under its first
    # micro-batch's forward
    beside = s.fwd_bwd / s.gbs / 3 if st.get("states_beside_forward_s") is not None else 0.0
    return (s.base + st["states_stream_s_median"] - room * 2**30 / link - beside) / s.base


def cost() -> str:
    lines = [
        "| GBS | suite | GPU | no offload s (runs) | engine | step s | step | fwd+bwd | fwd+bwd "
        "less its wait for the update | GPU peak | floor | bar |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for gbs, bar in BARS.items():
        for s in suites(gbs):
            floor = floors(s)
            bases = ", ".join(f"{b['step_time_s_median']:.3f}" for b in s.bases)
            peak = s.bases[0]["gpu_peak_allocated_gb"]
            for engine, r in s.runs:
                exact = engine in floor
                lines.append(
                    f"| {gbs} | `{s.label}` | {s.gpu} | {bases} | {engine} | "
                    f"{r['step_time_s_median']:.3f} | {r['step_time_s_median'] / s.base:.2f}x | "
                    f"{r['fwd_bwd_time_s_median'] / s.fwd_bwd:.2f}x | "
                    f"{(r['fwd_bwd_time_s_median'] - forward_wait(r)) / s.fwd_bwd:.2f}x | "
                    f"{r['gpu_peak_allocated_gb'] / peak:.2f}x | "
                    f"{f'{floor[engine]:.2f}x' if exact else '-'} | {f'{bar}x' if exact else '-'} |"
                )
    return "\n".join(lines)


def ends() -> str:
    parts = []
    for gbs in BARS:
        s = suites(gbs, pairs=False)[0]
        ca = s.first("cpu_adam 100%")
        parts.append(
            f"GBS {gbs}: CPU {ca['cpu_adam_wall_s_median']:.2f} s, GPU share "
            f"{ca['cpu_adam_stream_s_median']:.2f} s, optimizer phase "
            f"{ca['optimizer_time_s_median']:.2f} s, the forward's wait "
            f"{ca['cpu_adam_forward_wait_s_median'] * 1000:.0f} ms, the floor's cover "
            f"{s.bases[0]['fwd_bwd_time_s_median'] / gbs / 3 * 1000:.0f} ms"
        )
    return (
        "Where exact CPU Adam's update ends in suites `gbs-N` (the CPU's part, landing during "
        "the next forward, and the GPU share's pass on the compute stream, which the step "
        "waits for; balanced to end together): " + "; ".join(parts) + ". The forward never "
        "waited: both parts end inside the step, and the cover a balance tilted towards the "
        "CPU could use is the floor's, tens of ms."
    )


def asks() -> str:
    probe = SPLIT_PROBE.read_text()
    beside = max(float(x) for x in re.findall(r"([\d.]+)x its rate alone", probe))
    best = max(float(x) for x in re.findall(r"= ([\d.]+) G params/s", probe))
    lines = [
        "What the bars ask of the update. A bar leaves the update its step less no offload's "
        "forward+backward, plus the cover of the first micro-batch's forward (a third of one "
        "micro-batch's forward+backward). Exact CPU Adam must then update every param at the rate "
        "below; the most any split between the CPU and the GPU share could give is (link + 8 x "
        "CPU rate) / 12 params/s (the share moves 12 B/param each way, the CPU part 4), taken "
        "here with the link at state offload's measured rate and the CPU at fused AdamW's rate "
        "alone, as if the copies took none of the host's memory bandwidth (outside the engine "
        "they took a fifth or more: docs/evidence/cpu-gpu-split-probe.txt). State offload must "
        "move 12 B/param each way in that time (suites up to gbs-8-pairs-2; 10 since its masters "
        "travel as remainders, section below), less what came in during the last backward "
        "(suites gbs-N-grown on):",
        "",
        "| GBS | suite | GPU | time the bar leaves s | cpu_adam needs G params/s | at most, CPU "
        f"undisturbed | at most, CPU at {beside:.2f}x | best split outside the engine | the engine "
        "reached | states needs GB/s each way | the link ran GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios, reached = [], []
    for gbs, bar in BARS.items():
        for s in suites(gbs):
            ca, st = s.first("cpu_adam 100%"), s.first("states")
            params, link = ca["cpu_offloaded_params"], st["states_link_gb_per_s"]
            left, rate = s.left(bar), update_rate(ca)
            per = 8 + st.get("states_master_bytes", 4)  # 12 B/param, 10 with remainders
            moved = params * per - st.get("states_in_backward_gb", 0.0) * 1e9  # in the step
            ratios.append(moved / left / 1e9 / link)
            reached.append(rate / 1e9)
            lines.append(
                f"| {gbs} | `{s.label}` | {s.gpu} | {left:.3f} | {params / left / 1e9:.2f} | "
                f"{(link * 1e9 + 8 * s.alone) / 12 / 1e9:.2f} | "
                f"{(link * 1e9 + 8 * beside * s.alone) / 12 / 1e9:.2f} | {best:.2f} | "
                f"{rate / 1e9:.2f} | {moved / left / 1e9:.0f} | {link:.1f} |"
            )
    lines += [
        "",
        (
            f"State offload's bars ask the link for {min(ratios):.1f}-{max(ratios):.1f} times what it "
            "carries. Where exact CPU Adam's ask is above what an undisturbed CPU beside a full link "
            f"could give, or above the same with the CPU at {beside:.2f}x its rate alone (the best it "
            "kept beside the copies outside the engine: split probe, one H200, 1e9 params), no "
            f"overlap meets the bar with fp32 moments. That probe's best split updated {best:.2f} G "
            "params/s in all (the CPU never kept that rate while the link ran full); the engine "
            f"reached {min(reached):.1f}-{max(reached):.1f}."
        ),
    ]
    return "\n".join([*lines, "", met()])


def met() -> str:
    """Which exact runs met their bar, and with what forward+backward beside no offload's."""
    hits, runs = [], 0
    for gbs, bar in BARS.items():
        for s in suites(gbs):
            for engine, r in s.runs:
                if engine not in EXACT:
                    continue
                runs += 1
                step = r["step_time_s_median"] / s.base
                if step <= bar:
                    hits.append(
                        f"{engine} at GBS {gbs} in `{s.label}` ({s.gpu}): {step:.3f}x, its "
                        f"forward+backward {r['fwd_bwd_time_s_median'] / s.fwd_bwd:.2f}x "
                        "no offload's"
                    )
    return (
        f"{len(hits)} of the {runs} exact runs above met their step bar: "
        + "; ".join(hits)
        + ". A run meets it only where no offload's step is slow beside the update (the "
        "H100's at GBS 32) and its own forward+backward came out no slower than no offload's; "
        "each engine's update costs about the same at every batch."
    )


def pairs() -> str:
    """Each gbs-N-pairs call: every engine run's forward+backward against no offload's at its
    moment in the call (the no-offload runs around it, interpolated; after the last, the last)."""
    out = []
    for path in sorted(RESULTS.glob("results-gbs-*-pairs*.json")):
        data = json.loads(path.read_text())
        env, rows = data["environment"], data["results"]
        fb = [r["summary"]["fwd_bwd_time_s_median"] for r in rows]
        base = [i for i, r in enumerate(rows) if "no offload" in r["case"]["name"]]
        out += [
            f"Suite `{data['suite']}` ({env['gpu']}, {env['date'][:10]}, commit "
            f"{env['commit']}) ran no offload, cpu_adam and states in turn, in one call. Each "
            "engine run's forward+backward against no offload's at its moment in the call "
            "(the two no-offload runs around it, interpolated; after the last, the last):",
            "",
            "| run | forward+backward s | no offload then s | ratio |",
            "|---|---|---|---|",
        ]
        ratios: dict[str, list[float]] = {}
        for i, r in enumerate(rows):
            if i in base:
                out.append(f"| {r['case']['name']} | {fb[i]:.3f} | | |")
                continue
            before = max(b for b in base if b < i)
            after = min((b for b in base if b > i), default=None)
            then = (
                fb[before]
                if after is None
                else (fb[before] + (fb[after] - fb[before]) * (i - before) / (after - before))
            )
            ratios.setdefault(engine_of(r["case"]["name"]), []).append(fb[i] / then)
            out.append(f"| {r['case']['name']} | {fb[i]:.3f} | {then:.3f} | {fb[i] / then:.2f}x |")
        spread = max(fb[b] for b in base) / min(fb[b] for b in base)
        medians = ", ".join(f"{e} {sorted(v)[len(v) // 2]:.2f}x" for e, v in ratios.items())
        out += [
            "",
            f"Median ratio: {medians}; no offload itself moved {spread:.2f}x within the call.",
            "",
        ]
    return "\n".join(out)


def host() -> str:
    """What one H100 machine's host could give exact CPU Adam's update (host-memory probe), what
    the engine reached in the gbs suites on H100s, and the two gaps found between them."""
    mem = (EVIDENCE / "host-memory-probe-h100.txt").read_text()
    adam = re.search(r"CPU Adam: ([\d.]+) G params/s alone, ([\d.]+) beside", mem)
    link = re.search(r"CPU Adam: alone.*the link then ([\d.]+) GB/s each way", mem)
    alone = re.search(r"link alone: ([\d.]+) GB/s", mem)
    cpu, beside, up = float(adam[1]), float(adam[2]), float(link[1])
    # the CPU part at its rate beside the link; the link up carries the window's 12 B/param and
    # the CPU part's landings, 4 B/param: params/s = beside + (up - 4 beside) / 12
    bound = beside + (up - 4 * beside) / 12
    probe = (EVIDENCE / "grad-dtype-probe-h100.txt").read_text()
    grads = dict(re.findall(r"^(.*): ([\d.]+)$", probe, re.M))
    runs, asked = [], []
    for gbs, bar in BARS.items():
        for st in (st for st in suites(gbs) if "H100" in st.gpu):
            r = st.first("cpu_adam 100%")
            runs.append(r)
            asked.append(r["cpu_offloaded_params"] / st.left(bar) / 1e9)
    adam_rates = [r["cpu_adam_params_per_s"] / 1e9 for r in runs]
    window = [r["cpu_adam_stream_params_per_s"] / 1e9 for r in runs]
    excess = [
        r["cpu_adam_wall_s_median"] - r["cpu_adam_busy_s_median"] - r["cpu_adam_wait_s_median"]
        for r in runs
    ]
    whole = [update_rate(r) / 1e9 for r in runs]
    ab_text = (EVIDENCE / "balance-adam-ab-h100.txt").read_text()
    ab = dict(re.findall(r"^([AB]\d): step ([\d.]+) s", ab_text, re.M))
    span = lambda v: f"{min(v):.2f}-{max(v):.2f}"  # noqa: E731
    upcast = next(st for st in suites(4) if st.name == "gbs-4-pairs-2")  # after that change
    later = [r for name, r in upcast.runs if name == "cpu_adam 100%"]
    after = [r["cpu_adam_params_per_s"] / 1e9 for r in later]
    pinned = statistics.median(
        r["host_pinned_gb_max"] * 1024**3 / r["cpu_offloaded_params"] for r in later
    )
    split = json.loads((RESULTS / "results-share-4.json").read_text())["results"]
    steps = {r["case"]["name"]: r["summary"]["step_time_s_median"] for r in split}
    share = {"sb": f"{steps['cost GBS4 cpu_adam 100%']:.3f}"}
    for x in ("0.45", "0.5"):
        share[x], share[f"s{x}"] = x, f"{steps[f'cost GBS4 cpu_adam 100%, GPU share {x}']:.3f}"
    trial = (EVIDENCE / "exact-landing-bf16-ab-h100.txt").read_text()
    landing = {
        "rounding": re.search(r"^b1 .*? rounding ([\d.]+) s", trial, re.M)[1],
        "b_window": re.search(r"^b1 .*?\(([\d.]+) G params/s\)", trial, re.M)[1],
        "a_window": re.search(r"^a1 .*?\(([\d.]+) G params/s\)", trial, re.M)[1],
    }
    ab_grow = (EVIDENCE / "grow-4-ab-h100.txt").read_text()
    fell = re.search(r"fell ([\d.]+) s under cpu_adam and ([\d.]+) s under states", ab_grow)
    came = re.search(r"\(([\d.]+) GB and ([\d.]+) GB of states\)", ab_grow)
    grown = {"ca": fell[1], "st": fell[2], "in": came[1], "in_states": came[2]}
    return (
        "What the host could give the update (`python bench/probes/host_memory_probe.py`, "
        "docs/evidence/host-memory-probe-h100.txt, one H100 machine): fused AdamW on fp32 "
        f"arrays ran {cpu:.2f} G params/s alone and {beside:.2f} while the link copied both ways, "
        f"the link then {up:.1f} GB/s each way ({alone[1]} alone). With the CPU part at that rate "
        "and the link up carrying the window's 12 B/param and the CPU part's landings, 4 B/param, "
        f"exact CPU Adam could update {bound:.2f} G params/s on that host; the H100 suites' bars "
        f"asked {span(asked)}, and the engine reached {span(whole)}: its CPU part's Adam ran at "
        f"{span(adam_rates)} G params/s, its window at {span(window)}. What the profiles "
        "found between the two:\n\n"
        "- Where DDP's gradient buffer is bf16 (ddp.grad_reduce_in_fp32=false, as the capacity "
        "rows and auto's bf16 rung set it), torch's fused AdamW does not take it, so the engine "
        "upcasts it in blocks. Upcast into a new array per 1M-element block (two parallel regions "
        "a block, the passive team woken for each, and a fresh array's pages), CPU Adam ran "
        f"{grads['bf16 gradients, upcast in blocks of 1024K']} G params/s against "
        f"{grads['fp32 gradients, fused AdamW']} on fp32 gradients and "
        f"{grads['bf16 gradients, upcast in blocks of 4096K']} in 4M blocks "
        "(`python bench/probes/grad_dtype_probe.py`, docs/evidence/grad-dtype-probe-h100.txt); the "
        "engines now upcast 4M-element blocks into arrays each thread reuses. The proxy's rows "
        f"keep fp32 gradients (the default: {pinned:.0f} B/param page-locked, master, gradients "
        "and both moments), so this is not their gap: at that change `gbs-4-pairs-2` ran the CPU "
        f"part at {span(after)} G params/s.\n"
        f"- The CPU part's wall time exceeds its Adam and its wait for gradients by {span(excess)} "
        "s a step: its landings (each piece's fp32 masters up, then rounded) queue behind the "
        "window's copies on the link, and the thread that enqueues them blocks in a launch for "
        "118-141 ms a step (docs/evidence/profile-threads-cpu-adam-h100.txt; the interpreter's "
        "switch interval and two cores kept from the team changed nothing: "
        "docs/evidence/cpu-adam-wall-gap-h100.txt). Balancing the split on the CPU's Adam alone "
        f"moved params to the CPU and made the step slower, {ab['B1']} and {ab['B2']} s against "
        f"{ab['A1']} and {ab['A2']} (docs/evidence/balance-adam-ab-h100.txt): the CPU part's "
        "landings then slow the next forward+backward. The balance stays on the wall time. "
        "Landing bf16 masters rounded on the CPU (2 B/param up) was tried and reverted: rounding "
        f"took the worker {landing['rounding']} s a step and the window's rate did not move "
        f"({landing['b_window']} against {landing['a_window']} G params/s): the proxy's fp32 "
        "gradients keep the down link as busy as the up link "
        "(docs/evidence/exact-landing-bf16-ab-h100.txt). 32 hardware queues changed nothing "
        "(CUDA_DEVICE_MAX_CONNECTIONS; docs/evidence/device-max-connections-h100.txt), nor did a "
        f"GPU share away from the balance: at {share['0.45']} and {share['0.5']} the step ran "
        f"{share['s0.45']} and {share['s0.5']} s against {share['sb']} s balanced, the optimizer "
        "phase shorter and the next forward+backward longer by about as much "
        "(docs/evidence/share-4-h100.txt). On these hosts the exact update is where its link and "
        "its CPU put it, less the cover the last micro-batch's backward gives: the window's first "
        f"pieces now come in during it ({grown['in']} GB of states under cpu_adam, "
        f"{grown['in_states']} GB under states), the optimizer phase {grown['ca']} s and "
        f"{grown['st']} s shorter in one A/B call (docs/evidence/grow-4-ab-h100.txt). The CPU "
        "part's gradients (the first layers, final last) cannot use that backward."
    )


def remainders() -> str:
    """Suites remainders-N: state offload with its masters as remainders (the default) and as
    fp32 masters (optimizer.store_param_remainders=false), between two no-offload runs."""
    lines = [
        "| GBS | suite | GPU | no offload s (runs) | masters | B/param each way | step s | step | "
        "bar | optimizer phase s | pass s | link GB/s | host GB | GPU peak GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    phases, links = {}, {}
    for gbs in sorted(BARS):
        path = RESULTS / f"results-remainders-{gbs}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        gpu = data["environment"]["gpu"].replace("NVIDIA ", "")
        rows = [(r["case"]["name"], r["summary"]) for r in data["results"]]
        bases = [s for name, s in rows if "no offload" in name]
        base = statistics.mean(b["step_time_s_median"] for b in bases)
        runs = ", ".join(f"{b['step_time_s_median']:.3f}" for b in bases)
        for name, r in rows:
            if "states" not in name:
                continue
            kind = "fp32" if "fp32" in name else "remainders"
            phases.setdefault(gbs, {})[kind] = r["optimizer_time_s_median"]
            links.setdefault(kind, []).append(r["states_link_gb_per_s"])
            lines.append(
                f"| {gbs} | `remainders-{gbs}` | {gpu} | {runs} | {kind} | "
                f"{8 + r['states_master_bytes']} | {r['step_time_s_median']:.3f} | "
                f"{r['step_time_s_median'] / base:.2f}x | {BARS[gbs]}x | "
                f"{r['optimizer_time_s_median']:.3f} | {r['states_stream_s_median']:.3f} | "
                f"{r['states_link_gb_per_s']:.1f} | {r['states_host_gb']:.1f} | "
                f"{r['gpu_peak_allocated_gb']:.2f} |"
            )
    cut = [1 - p["remainders"] / p["fp32"] for p in phases.values() if len(p) == 2]
    span = "-".join(dict.fromkeys(f"{x:.0%}" for x in (min(cut), max(cut)))) if cut else ""
    lines += (
        [
            "",
            (
                f"The remainders took {span} off the optimizer phase, where they take 2 of 12 "
                f"B/param (17%) off the link, which ran {min(links['remainders']):.1f}-"
                f"{max(links['remainders']):.1f} GB/s with them against {min(links['fp32']):.1f}-"
                f"{max(links['fp32']):.1f} with fp32 masters."
            ),
        ]
        if cut
        else []
    )
    return "\n".join(lines)


def beside() -> str:
    """State offload's pass beside the next forward: the acceptance suites gbs-N-beside."""
    return "\n".join(_beside_suites())


def _beside_suites() -> list[str]:
    """State offload in suites gbs-N-beside (before and after the window copies' gaps): where
    its pass's time went, against each call's no-offload runs."""
    lines = [
        "`gbs-4-beside`, `gbs-8-beside`, `gbs-32-beside`, one call each before and after a "
        "one-element kernel followed each copy of the window (its gaps let the forward's own "
        "copies through; `bench/probes/copy_queue_probe.py`), against the mean of each call's "
        "no-offload runs:",
        "",
        "| GBS | suite | commit | no offload s | states step | floor | forward+backward "
        "more s | optimizer phase more s | pass s | pass after the forward's first wait s | "
        "the forward's thread waited s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    calls = sorted(
        (int(path.name.split("-")[2]), _date(path), path)
        for path in RESULTS.glob("results-gbs-*-beside*.json")
    )
    found = [load(path, gbs) for gbs, _, path in calls]
    for s in found:
        st = s.first("states")
        lines.append(
            f"| {s.gbs} | `{s.name}` | {s.commit[:7]} | {s.base:.3f} | "
            f"{st['step_time_s_median'] / s.base:.2f}x | {states_floor(s, st):.2f}x | "
            f"{st['fwd_bwd_time_s_median'] - s.fwd_bwd:+.3f} | {_phase_held(s, st):+.3f} | "
            f"{st['states_stream_s_median']:.3f} | {st['states_beside_forward_s']:.3f} | "
            f"{forward_wait(st):.3f} |"
        )
    before = [s for s in found if s.first("states")["states_beside_forward_s"] < 0.01]
    after = [s for s in found if s not in before]
    return [*lines, "", *_before_gaps(before), "", *_after_gaps(after)]


def _phase_held(s: Suite, st: dict) -> float:
    """The part of state offload's pass in its optimizer phase: that phase less no offload's."""
    return st["optimizer_time_s_median"] - statistics.mean(
        b["optimizer_time_s_median"] for b in s.bases
    )


def _before_gaps(found: list[Suite]) -> list[str]:
    """What the gbs-N-beside calls before the gaps found: no overlap, and why."""
    runs = [s.first("states") for s in found]
    held = [_phase_held(s, r) for r, s in zip(runs, found, strict=True)]
    return [
        (
            f"Before the gaps (commit {found[0].commit[:7]}) the pass did not overlap the forward: "
            "in every suite its last Adam call ended "
            f"within {max(r['states_beside_forward_s'] for r in runs) * 1000:.1f} ms of the event "
            "the next forward records on the compute stream at its "
            "first wait, and forward+backward grew by about the pass, the optimizer phase holding "
            f"only {min(held):.2f}-{max(held):.2f} s of it. That event follows the first "
            "micro-batch's batch copy up on the "
            "compute stream; whether that copy waited behind the pass's copies, or the forward's "
            "thread waited elsewhere, is for the profile of device step `beside-probe` (iterations "
            "6-7, the forward's waits annotated, the copies' waits listed) and for "
            "bench/probes/copy_queue_probe.py to say. They said the copy: a copy engine runs one stream's "
            "ready copies back to back and yields to other streams' copies in the same direction "
            "only where a kernel stands between them (torchrec's copy-engine studies found that "
            "too). Since commit 5336bf0 each copy of the window is followed by a one-element kernel "
            "on its stream (below: what that changed)."
        )
    ]


def _span(values: list[float]) -> str:
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return low if low == high else f"{low}-{high}"


def _after_gaps(found: list[Suite]) -> list[str]:
    """What the calls after the gaps found, and the floor that holds either way."""
    if not found:
        return []
    runs = [s.first("states") for s in found]
    over = [
        r["step_time_s_median"] / s.base - states_floor(s, r)
        for r, s in zip(runs, found, strict=True)
    ]
    beside = [r["states_beside_forward_s"] for r in runs]
    wait = [r["states_forward_wait_s_median"] for r in runs]
    return [
        (
            f"With the gaps (commit {found[0].commit[:7]}) the pass ran "
            f"{_span(beside)} s into the next forward and the forward's thread "
            f"waited {_span(wait)} s of it for its pieces; the states rows came "
            f"in {min(over):+.2f}x to {max(over):+.2f}x off their floors. The column "
            '"fwd+bwd less its wait for the update" of the table in "Exact offload against '
            'the global batch" takes that wait out: the '
            "forward+backward that remains is the engine's cost to the forward beside the pass (its "
            "thread's issue work and Adam kernels, and the compute stream's own waits on the "
            "pieces after the host has moved on)."
        ),
        "",
        (
            "Even overlapped in full it would not meet every bar. Every state goes down again after "
            "the global norm, and the next forward reaches its peak only once they are down, but for "
            "what the room under the 0.45x peak bar holds (state offload's floor in the table "
            "above): here "
            f"{min(r['states_host_gb'] for r in runs):.1f} GiB each way at "
            f"{min(r['states_link_gb_per_s'] for r in runs):.1f}-"
            f"{max(r['states_link_gb_per_s'] for r in runs):.1f} GB/s, a floor of "
            + " / ".join(f"{states_floor(s, r):.2f}x" for s, r in zip(found, runs, strict=True))
            + " against bars of "
            + " / ".join(f"{BARS[s.gbs]}x" for s in found)
            + " at GBS "
            + " / ".join(str(s.gbs) for s in found)
            + ". Where the floor is above the "
            "bar, only fewer bytes meet it: bf16 moments (6 B/param each way) or less than all of "
            "the states offloaded."
        ),
    ]


def share() -> str:
    """Suite exact-4-ab's calls ``first`` and ``thread``: the GPU share's pass queued before the
    CPU part's hand-over, then by a thread of its own, each beside the commit before (run a*)."""
    lines = [
        "| call | run | commit | no offload s | cpu_adam step s | step | optimizer phase s | "
        "CPU part s | share pass s | hand-over s | GB down | down GB/s over the phase |",
        "|---" * 12 + "|",
    ]
    phase = {}
    for call in ("first", "thread"):
        for run in ("b1", "a1", "b2"):
            c = load(RESULTS / f"results-exact-4-ab-{call}-{run}.json", 4)
            ca = c.first("cpu_adam 100%")
            down = (12 * ca["cpu_adam_params_on_gpu"] + 4 * ca["cpu_adam_params_on_cpu"]) / 1e9
            opt = ca["optimizer_time_s_median"]
            phase.setdefault((call, run[0]), []).append(
                (opt, ca["cpu_adam_stream_s_median"], ca["cpu_adam_boundary_s_median"], down)
            )
            lines.append(
                f"| {call} | {run} | {c.commit[:7]} | {c.base:.3f} | "
                f"{ca['step_time_s_median']:.3f} | {ca['step_time_s_median'] / c.base:.2f}x | "
                f"{opt:.3f} | "
                f"{ca['cpu_adam_wall_s_median']:.3f} | {ca['cpu_adam_stream_s_median']:.3f} | "
                f"{ca['cpu_adam_boundary_s_median']:.3f} | {down:.1f} | {down / opt:.1f} |"
            )
    mean = {k: [statistics.mean(x) for x in zip(*v, strict=True)] for k, v in phase.items()}
    f = lambda call, ab, i: f"{mean[(call, ab)][i]:.3f}"  # noqa: E731
    d = lambda call, i: f"{mean[(call, 'b')][i] - mean[(call, 'a')][i]:+.3f}"  # noqa: E731
    return "\n".join(lines) + (
        "\n\nQueued on the training thread before the hand-over (call `first`), the share's pass "
        f"started with the step, but queuing it took that thread {f('first', 'b', 2)} s (the "
        f"hand-over column, against {f('first', 'a', 2)} s before), and the CPU part started "
        "after it. Queued by a thread of its own (call `thread`), both parts started with the "
        f"step. The optimizer phase moved by {d('first', 0)} and {d('thread', 0)} s (the mean of "
        "each call's B runs against its A run), where the pass's start moved up by the A runs' "
        f"hand-over, {f('first', 'a', 2)} and {f('thread', 'a', 2)} s: the pass itself got "
        f"longer by {d('first', 1)} and {d('thread', 1)} s. It shares the link down with the CPU "
        "part's gradients (and the link up with its landings), so the update ends when its bytes "
        "are through, whichever part starts first. Both changes were reverted: the pass is queued "
        "after the hand-over, as before."
    )


PARTS = {
    "cost": cost,
    "ends": ends,
    "asks": asks,
    "pairs": pairs,
    "host": host,
    "remainders": remainders,
    "beside": beside,
    "share": share,
}


def report(plot: Path | None = None) -> str:
    """The template's words with each ``{{part}}`` filled in; the plot drawn where asked."""
    from fill import EVIDENCE_PARTS, fill

    text = fill("optimizer-offload.md", {**PARTS, **EVIDENCE_PARTS})
    if plot is not None:
        draw(plot)
    return text


def draw(out: Path) -> None:
    """Each exact engine's step over its call's no-offload step, against the global batch (a
    point per run), beside the issue's bars."""
    from plots import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for engine, colour in (("cpu_adam 100%", "tab:blue"), ("states", "tab:orange")):
        points = [
            (gbs, r["step_time_s_median"] / s.base)
            for gbs in BARS
            for s in suites(gbs)
            for name, r in s.runs
            if name == engine
        ]
        ax.scatter(*zip(*points, strict=True), color=colour, alpha=0.6, label=engine)
    ax.plot(list(BARS), list(BARS.values()), "k--", label="the bar")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(BARS), [str(g) for g in BARS])
    ax.set_xlabel("global batch (micro-batch 1)")
    ax.set_ylabel("step over no offload's")
    ax.legend(fontsize=8)
    save(fig, out)


if __name__ == "__main__":
    if sys.argv[1] == "report":
        plot = Path(sys.argv[3]) if sys.argv[2:3] == ["--plot"] else None
        print(report(plot))
    else:
        print(PARTS[sys.argv[1]]())
