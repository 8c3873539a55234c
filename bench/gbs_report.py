#!/usr/bin/env python
"""docs/benchmarks/optimizer-offload.md: exact offload against the global batch, from ``gbs-N``
(H200: no offload twice, the exact engines, HDO and delayed mode), ``gbs-N-pairs`` (no
offload and the exact engines in turn), ``gbs-N-grown`` and ``gbs-N-beside`` (gbs-N's rows
again, one H100, as the state windows grew and the pass moved beside the next forward):

    python bench/gbs_report.py --plot docs/benchmarks/optimizer-offload.png \\
        > docs/benchmarks/optimizer-offload.md
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from fill import SHARED_PARTS, fill  # src/ on the path too

from offload_runner.report import folded

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
    return "\n".join(folded(lines))


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
    return "\n".join(lines)


PARTS = {"cost": cost, "asks": asks}


def report(plot: Path | None = None) -> str:
    """The template's words with each ``{{part}}`` filled in; the plot drawn where asked."""
    text = fill("optimizer-offload.md", {**PARTS, **SHARED_PARTS})
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
    plot = Path(sys.argv[2]) if sys.argv[1:2] == ["--plot"] else None
    print(report(plot))
