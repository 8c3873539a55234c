#!/usr/bin/env python
"""docs/BENCHMARKS.md from the results files: the reports' index, the headline and a line per
suite no report holds; with ``--suite`` that suite's runs in full (run_benchmarks.py report)."""

from __future__ import annotations

import functools
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import throughput  # noqa: E402
from calibrate_planner import is_whole_states, plan_of  # noqa: E402
from suites import CONVERGENCE_TAIL  # noqa: E402

from offload_runner.hardware import rank_link_gb_per_s  # noqa: E402
from offload_runner.report import fmt, markdown_table, max_abs_delta, ratio, saved  # noqa: E402


def _families(files: list[Path]) -> dict[str, list[tuple[Path, dict]]]:
    """Suites split over several calls (proxy-1, proxy-2) render as one table."""
    families: dict[str, list[tuple[Path, dict]]] = {}
    for path in files:
        data = json.loads(path.read_text())
        family = re.sub(r"-\d+$", "", data["suite"])
        families.setdefault(family, []).append((path, data))
    return families


HOST_LINK_GB_PER_S = 55.0  # pinned host<->GPU copies on the benchmark host (PCIe Gen5), one way
BOTH_WAYS_GB_PER_S = 50.8  # ... each way, when both directions run at once (an H200 host)
EVIDENCE = Path(__file__).resolve().parent.parent / "docs/evidence"
H100_LINK_PROBE = EVIDENCE / "host-memory-probe-h100.txt"  # an H100 host's link, both ways


@functools.cache
def both_ways_gb_per_s(gpu: str) -> float:
    """The link each way with both directions at once, on the host of ``gpu``: an H100 host's
    from its host-memory probe (its link alone), else the H200 host's."""
    if "H100" in gpu:
        found = re.search(r"^link alone: ([\d.]+) GB/s", H100_LINK_PROBE.read_text(), re.M)
        return float(found[1])
    return BOTH_WAYS_GB_PER_S


def _states_line(r: dict, base: dict) -> str | None:
    """One state-offload run against its transfer bound and its baseline's peak. Windowed: its
    host arrays each way (10 B/param with the masters as remainders, 12 with fp32 masters; 12
    where a run did not record them), both directions at once; whole tensors: the same bytes
    out, then back."""
    s = r["summary"]
    if not (s.get("fwd_bwd_time_s_median") and base.get("fwd_bwd_time_s_median")):
        return None
    whole = is_whole_states(r)
    if whole:  # the pinned host arena is the 12 B/param moved
        moved = s["host_pinned_gb_max"] * 1024**3 / 1e9
        bound = 2 * moved / HOST_LINK_GB_PER_S * 1000
        how = f"2 x {moved:.1f} GB / {HOST_LINK_GB_PER_S:.0f} GB/s"
    else:
        moved = (
            s["states_host_gb"] * 1024**3
            if s.get("states_host_gb")
            else 12 * s["states_offloaded_params"]
        ) / 1e9
        link = rank_link_gb_per_s(
            both_ways_gb_per_s(r["environment"]["gpu"]), r["case"].get("nproc", 1)
        )
        bound = moved / link * 1000
        how = f"{moved:.1f} GB each way at once / {link:.1f} GB/s"
    overhead = (s["step_time_s_median"] - base["step_time_s_median"]) * 1000
    fwd_bwd = (s["fwd_bwd_time_s_median"] - base["fwd_bwd_time_s_median"]) * 1000
    rest = (s["optimizer_time_s_median"] - base["optimizer_time_s_median"]) * 1000
    peak = s["gpu_peak_allocated_gb"] / base["gpu_peak_allocated_gb"]
    line = (
        f"- {case_label(r)}: transfer bound {how} = {bound:.0f} ms; overhead "
        f"{overhead:.0f} ms ({overhead / bound:.2f}x the bound): forward+backward "
        f"{fwd_bwd:+.0f} ms, rest of the step {rest:+.0f} ms; peak {peak:.2f}x the "
        f"baseline's"
    )
    if not whole:
        line += (
            f"; the pass (step() to the last copy out) "
            f"{s['states_stream_s_median'] * 1000:.0f} ms, "
            f"{s['states_link_gb_per_s']:.1f} GB/s each way; window "
            f"{s['states_window_gb'] * 1024:.0f} MiB"
        )
    if s.get("states_in_backward_gb"):  # those came in before the pass: its rate counts them
        line += f", {s['states_in_backward_gb']:.1f} GB in during the last backward"
    if s.get("states_beside_forward_s") is not None:
        line += (
            f"; beside the next forward, its last Adam call "
            f"{s['states_beside_forward_s'] * 1000:.0f} ms after that forward's first "
            "wait for it"
        )
    if s.get("states_forward_wait_s_median") is not None:
        line += (
            f", that forward's thread waiting "
            f"{s['states_forward_wait_s_median'] * 1000:.0f} ms for it"
        )
    return line


def _transfer_bound_lines(results: list[dict], by_name: dict[str, dict]) -> list[str]:
    """For each optimizer-state offload case: its overhead against its transfer bound, split
    into forward+backward (whole tensors: copies out overlap it) and the rest of the step."""
    lines = []
    for r in results:
        base = _baseline(r, by_name)
        states = any(o.startswith("offload/optimizer=states") for o in r["case"]["overrides"])
        if states and r["status"] == "ok" and (line := _states_line(r, base)):
            lines.append(line)
    if lines:
        lines = [
            "",
            "Optimizer-state offload against the transfer bound (vs this suite's "
            "baseline; phases timed with CUDA events):",
            "",
            *lines,
        ]
    return lines


def _weight_offload_lines(results: list[dict], by_name: dict[str, dict]) -> list[str]:
    """For each weight-offload case: its overhead against its baseline beside the link bound
    (step_cost.weight_offload_link_bytes: both directions at once at planner.host_link_gb_per_s)."""
    from offload_runner.config.compose import compose_config, to_run_config
    from offload_runner.plan import grad_bytes
    from offload_runner.step_cost import (
        weight_offload_link_bytes,
        weight_offload_sum_bytes,
        weight_offload_update_bytes,
    )

    lines = []
    for r in results:
        s = r["summary"]
        base = _baseline(r, by_name)
        if r["status"] != "ok" or not s.get("weight_offload_params") or not base:
            continue
        run = to_run_config(
            compose_config([f"recipe={r['case']['recipe']}", *r["case"]["overrides"]])
        )
        up, down = weight_offload_link_bytes(run, s["weight_offload_params"])
        bound = max(up, down) / (run.planner.host_link_gb_per_s * 1e9)
        overhead = s["step_time_s_median"] - base["step_time_s_median"]
        sums = weight_offload_sum_bytes(run, s["weight_offload_params"])
        least = max(up - sums, down) / (run.planner.host_link_gb_per_s * 1e9)
        lines.append(
            f"- {case_label(r)}: {s['weight_offload_params'] / 1e9:.2f}B params on "
            f"the host, {up / 1e9:.1f} GB up and {down / 1e9:.1f} GB down per step: link "
            f"bound {_ms(bound)} ms ({_ms(least)} ms without the gradients' sums coming "
            f"back up); overhead {_ms(overhead)} ms ({overhead / bound:.2f}x the bound, "
            f"{overhead / least:.2f}x the one without the sums)"
        )
        held = s["weight_offload_params"] * (2 + grad_bytes(run)) / 1024**3  # bf16 + DDP's grads
        drop = base["gpu_peak_allocated_gb"] - s["gpu_peak_allocated_gb"]
        lines.append(
            f"  - GPU peak {base['gpu_peak_allocated_gb']:.2f} -> "
            f"{s['gpu_peak_allocated_gb']:.2f} GB: {drop:.2f} GB less, {drop / held:.3f}x "
            f"the offloaded layers' weights and gradients ({held:.2f} GB)"
        )
        if "weight_offload_up_gb" in s:  # what the engine counted, less the update's
            update, _ = weight_offload_update_bytes(run, s["weight_offload_params"])
            moved = s["weight_offload_up_gb"] * 1e9 - update
            ahead = moved / (run.planner.host_link_gb_per_s * 1e9)
            extra = s["fwd_bwd_time_s_median"] - base["fwd_bwd_time_s_median"]
            lines.append(
                f"  - forward+backward alone: {moved / 1e9:.1f} GB up (weights, the "
                f"gradients' sums; counted by the engine): {_ms(ahead)} ms at the link; "
                f"forward+backward {_ms(extra)} ms over the baseline's "
                f"({extra / ahead:.2f}x)"
            )
    if lines:
        lines = [
            "",
            "Weight offload against its link bound (all it moves, the offloaded "
            "params' states included, which the baseline's state offload moves too; vs "
            "the same run with its weights on the GPU):",
            "",
            *lines,
        ]
    return lines


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


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


def _delayed_experts_bound(name: str, s: dict, base_step: float, rated: str, ref: float | None):
    """The routed experts one step late, the dense part exact (with its GPU share) first:
    max(baseline step, the experts' CPU Adam) + the dense part's exact update."""
    offloaded, rate, late = (
        s["cpu_offloaded_params"],
        s["cpu_adam_params_per_s"],
        s.get("cpu_adam_delayed_params") or 0,
    )
    on_gpu, gpu_rate = s.get("cpu_adam_params_on_gpu"), s.get("cpu_adam_stream_params_per_s")
    now = offloaded - late
    exact_s = now / (rate + gpu_rate) if on_gpu and gpu_rate else now / rate
    bound = max(base_step, late / rate) + exact_s
    gpu = (
        f" and on {on_gpu / 1e9:.2f}B of the dense part's on the GPU, their states "
        f"through the window at {gpu_rate / 1e9:.2f} G/s"
        if on_gpu and gpu_rate
        else ""
    )
    return bound, [
        f"- {name}: the states of {offloaded / 1e9:.2f}B params on the host, {late / 1e9:.2f}B "
        f"(the routed experts) updated one step late and {now / 1e9:.2f}B (the dense part) "
        f"exactly; Adam on the CPU at {rated}{gpu}",
        f"bound max({_ms(base_step)}, {_ms(late / rate)}) + the exact part {_ms(exact_s)} = "
        f"{_ms(bound)} ms, step {_ms(s['step_time_s_median'])} ms = "
        f"{s['step_time_s_median'] / bound:.2f}x the bound",
    ]


def _gpu_share_bound(name: str, s: dict, base_step: float, rated: str, ref: float | None):
    """Exact mode with a GPU share: the CPU and the window at once, baseline step + offloaded /
    (both rates); beside it the CPU's alone at its rate, and the whole update's rate (its
    params over the longer of the CPU worker and the window's pass) against fused AdamW."""
    offloaded, rate = s["cpu_offloaded_params"], s["cpu_adam_params_per_s"]
    gpu_rate = s["cpu_adam_stream_params_per_s"]
    step, both = s["step_time_s_median"], offloaded / (rate + gpu_rate)
    cpu_alone = base_step + offloaded / rate
    return base_step + both, [
        f"- {name}: the states of {offloaded / 1e9:.2f}B params on the host; "
        + _split(s, rated, "states")
        + f" ({12 * gpu_rate / 1e9:.1f} GB/s each way)",
        f"bound at both rates sum({_ms(base_step)}, {_ms(both)}) = {_ms(base_step + both)} ms, "
        f"step {_ms(step)} ms = {step / (base_step + both):.2f}x that bound and "
        f"{step / cpu_alone:.2f}x the CPU's alone at its rate, sum({_ms(base_step)}, "
        f"{_ms(offloaded / rate)}) = {_ms(cpu_alone)} ms",
        _whole_update(s, ref),
    ]


def _split(s: dict, rated: str, what: str) -> str:
    """Where a GPU share run's Adam ran: the CPU's params at ``rated``, the GPU's share and the
    rate ``what`` (its states, with or without gradients) came through the window at."""
    return (
        f"Adam on {s['cpu_adam_params_on_cpu'] / 1e9:.2f}B on the CPU at {rated} and on "
        f"{s['cpu_adam_params_on_gpu'] / 1e9:.2f}B (a GPU share of "
        f"{s['cpu_adam_gpu_share']:.2f}) on the GPU, their {what} through the window at "
        f"{s['cpu_adam_stream_params_per_s'] / 1e9:.2f} G/s"
    )


def _whole_update(s: dict, ref: float | None) -> str:
    """A GPU share run's update as a whole (the longer of the CPU worker and the window's
    pass) against torch's fused AdamW alone on every offloaded param."""
    update_s = max(s["cpu_adam_wall_s_median"], s["cpu_adam_stream_s_median"])
    whole = s["cpu_offloaded_params"] / update_s
    return f"the whole update {_ms(update_s)} ms = {whole / 1e9:.2f} G params/s" + (
        f", {whole / ref:.2f}x torch's fused AdamW alone" if ref else ""
    )


def _late_share_bound(name: str, s: dict, base_step: float, rated: str, ref: float | None):
    """Delayed mode with a GPU share: the CPU and the window at once under the next
    forward+backward, max(baseline step, offloaded / (both rates)); beside it the CPU's alone."""
    offloaded, rate = s["cpu_offloaded_params"], s["cpu_adam_params_per_s"]
    step = s["step_time_s_median"]
    both = offloaded / (rate + s["cpu_adam_stream_params_per_s"])
    bound = max(base_step, both)
    return bound, [
        f"- {name}: {offloaded / 1e9:.2f}B params updated one step late; "
        + _split(s, rated, "states and gradients"),
        f"bound max({_ms(base_step)}, {_ms(both)}) = {_ms(bound)} ms, step {_ms(step)} ms = "
        f"{step / bound:.2f}x the bound",
        _whole_update(s, ref),
    ]


def _cpu_bound(name: str, s: dict, base_step: float, rated: str, ref: float | None):
    """Every offloaded param's Adam on the CPU: exact, baseline step + CPU Adam; delayed, the
    larger of the two."""
    cpu = s["cpu_offloaded_params"] / s["cpu_adam_params_per_s"]
    delayed = s.get("cpu_adam_mode") == "delayed"
    bound, step = (max if delayed else sum)((base_step, cpu)), s["step_time_s_median"]
    return bound, [
        f"- {name}: {s['cpu_offloaded_params'] / 1e9:.2f}B params on the CPU at {rated}",
        f"bound {'max' if delayed else 'sum'}({_ms(base_step)}, {_ms(cpu)}) = {_ms(bound)} ms, "
        f"step {_ms(step)} ms = {step / bound:.2f}x the bound",
    ]


def _cpu_adam_lines(results: list[dict], by_name: dict[str, dict]) -> list[str]:
    """Each CPU-Adam run against its bound (``_*_bound`` per mode), its rate against torch's
    fused AdamW alone, where the rest of its time goes, and its speed-up over
    HybridDeviceOptimizer 100% of the same batch."""
    lines = []
    for r in results:
        reference = r["environment"].get("cpu_adam_reference_params_per_s", {})
        s = r["summary"]
        if r["status"] != "ok" or not s.get("cpu_adam_params_per_s"):
            continue
        base = _baseline(r, by_name)
        base_step = base.get("step_time_s_median")
        if not base_step or base.get("cpu_adam_params_per_s"):  # no bound without a no-offload run
            continue
        rate, step = s["cpu_adam_params_per_s"], s["step_time_s_median"]
        delayed = s.get("cpu_adam_mode") in ("delayed", "delayed experts")
        ref = reference.get(str(s.get("cpu_adam_threads")))
        hdo_name = r["case"]["baseline"].replace("no offload", "HDO 100% + overlap")
        hdo = _of_call(r, hdo_name, results, by_name).get("summary", {}).get("step_time_s_median")
        hdo = hdo if hdo_name != r["case"]["baseline"] else None
        rated = f"{rate / 1e9:.2f} G/s ({s['cpu_adam_threads']} threads" + (
            f"; {rate / ref:.2f}x torch's fused AdamW alone, {ref / 1e9:.2f} G/s)" if ref else ")"
        )
        if s.get("cpu_adam_mode") == "delayed experts":
            bounded = _delayed_experts_bound
        elif s.get("cpu_adam_params_on_gpu") and s.get("cpu_adam_stream_params_per_s"):
            bounded = _late_share_bound if delayed else _gpu_share_bound
        else:
            bounded = _cpu_bound
        _, parts = bounded(case_label(r), s, base_step, rated, ref)
        parts.append(
            f"CPU worker {_ms(s['cpu_adam_wall_s_median'])} ms (Adam "
            f"{_ms(s['cpu_adam_busy_s_median'])}, waiting for gradients "
            f"{_ms(s['cpu_adam_wait_s_median'])})"
            + (
                f", the window's pass {_ms(s['cpu_adam_stream_s_median'])} ms"
                if s.get("cpu_adam_params_on_gpu")
                else ""
            )
            + (
                f" (the states of {s['cpu_adam_in_backward_params'] / 1e9:.2f}B params in "
                "during the last backward)"
                if s.get("cpu_adam_in_backward_params")
                else ""
            )
        )
        if s.get("cpu_adam_lands_in_forward") and not delayed:
            waited = s.get("cpu_adam_forward_wait_s_median")
            parts.append(
                "landing during the next forward"
                + (f" (which waited {_ms(waited)} ms for it)" if waited is not None else "")
            )
        if delayed and "cpu_adam_copies_in_backward" in s:
            parts.append(
                (
                    "copies during the last backward"
                    if s["cpu_adam_copies_in_backward"]
                    else "copies at the step boundary"
                )
                + f" (step() {_ms(s['cpu_adam_boundary_s_median'])} ms until "
                "the update was handed over)"
            )
        if hdo and r["case"]["name"] != hdo_name:
            parts.append(f"{hdo / step:.2f}x faster than HDO 100% + overlap")
        lines.append("; ".join(parts))
    if lines:
        lines = [
            "",
            "CPU-Adam engine against its bounds (this suite's baseline; CPU rate from "
            "the engine's own timing of its Adam calls):",
            "",
            *lines,
        ]
    return lines


def tail_mean(losses: list[float], n: int = CONVERGENCE_TAIL) -> float:
    return statistics.fmean(losses[-n:])


def convergence(results: list[dict]) -> dict | None:
    """Runs named ``... seed N``: each configuration's final loss (the mean of the last
    CONVERGENCE_TAIL iterations) per seed, set against the baseline's spread across seeds.
    ``within_noise``: every configuration's mean over seeds is within that spread of the
    baseline's mean."""
    finals: dict[str, dict[int, float]] = {}
    baseline = None
    for r in results:
        match = re.fullmatch(r"(.*) seed (\d+)", r["case"]["name"])
        if not match or r["status"] != "ok":
            continue
        finals.setdefault(match[1], {})[int(match[2])] = tail_mean(r["summary"]["losses"])
        if r["case"]["name"] == r["case"]["baseline"]:
            baseline = match[1]
    if baseline is None or len(finals.get(baseline, {})) < 2:
        return None
    base = finals[baseline]
    spread = max(base.values()) - min(base.values())
    rows = {}
    for name, by_seed in finals.items():
        if name == baseline:
            continue
        gap = statistics.fmean(by_seed.values()) - statistics.fmean(base.values())
        paired = {seed: v - base[seed] for seed, v in by_seed.items() if seed in base}
        rows[name] = {
            "final": by_seed,
            "gap": gap,
            "paired": paired,
            "within_noise": abs(gap) <= spread,
        }
    return {"baseline": baseline, "baseline_final": base, "spread": spread, "runs": rows}


def _convergence_lines(results: list[dict]) -> list[str]:
    found = convergence(results)
    if found is None:
        return []
    base = found["baseline_final"]
    lines = [
        "",
        f"Final loss (mean of the last {CONVERGENCE_TAIL} iterations) per seed; the "
        f"baseline ({found['baseline']}) spreads {found['spread']:.3f} across seeds "
        f"({', '.join(f'{s}: {v:.3f}' for s, v in base.items())}):",
        "",
    ]
    for name, row in found["runs"].items():
        finals = ", ".join(f"{s}: {v:.3f}" for s, v in row["final"].items())
        paired = ", ".join(f"{s}: {d:+.3f}" for s, d in row["paired"].items())
        verdict = "within" if row["within_noise"] else "outside"
        lines.append(
            f"- {name}: {finals}; against the same seed's baseline {paired}; mean "
            f"{row['gap']:+.3f} against the baseline's, {verdict} its spread"
        )
    return lines


def _scale_lines(results: list[dict]) -> list[str]:
    """Multi-GPU runs: the planner's verdict and prediction beside time to first step, every
    rank's GPU peak and the node's RAM (the run's own, over what the node used before)."""
    rows = []
    for r in results:
        if not any(arg.startswith("planner.gpu_memory_gb=") for arg in r["command"]):
            continue  # planned for the machine it names, as --plan would be
        plan, s = plan_of(r), r["summary"]
        ranks = [rank.gpu_peak / 2**30 for rank in plan.ranks]
        planned_host = plan.max_node_host_gb
        verdict = "fits" if plan.limiting is None else f"does not fit ({plan.limiting})"
        measured = s.get("gpu_peak_per_rank_gb")
        before, peak = s.get("host_used_gb_before_per_node"), s.get("host_used_gb_max_per_node")
        startup = s.get("startup_s") or {}
        rows.append(
            [
                case_label(r),
                verdict,
                r["status"],
                fmt(s.get("time_to_first_step_s"), ".0f")
                + (
                    f" ({', '.join(f'{k} {v:.0f}' for k, v in startup.items())})" if startup else ""
                ),
                f"{min(measured):.1f}-{max(measured):.1f}" if measured else "-",
                f"{min(ranks):.1f}-{max(ranks):.1f}",
                fmt(max(p - b for p, b in zip(peak, before, strict=True)), ".1f") if peak else "-",
                f"{planned_host:.1f}",
            ]
        )
    if not rows:
        return []
    return [
        "",
        "Per rank and per node, beside `--plan` on the same command line:",
        "",
        *markdown_table(
            [
                "config",
                "--plan",
                "status",
                "time to first step s (phases s)",
                "GPU peak per rank GB",
                "planned GB",
                "node RAM used by the run GB",
                "planned host GB",
            ],
            rows,
        ),
    ]


# The headline: per offload mode and batch, its latest suite's row against that suite's
# baseline (suite, case); the suite tables below hold everything else.
HEADLINE = [
    # throughput: today's line (MB 1, Megatron-Core's kernels), the fused kernels at MB 4, auto
    ("throughput-16", "MB1 plain"),
    ("throughput-16", "MB4 fused"),
    ("throughput-16", "auto"),
    # the 37-layer slice on one H200: today's line against auto (micro-batch included)
    ("throughput-37", "today"),
    ("throughput-37", "auto"),
    # the CPU-Adam engine's modes with the fused kernels
    *[
        (f"engines-{gbs}", f"GBS{gbs} {name}")
        for gbs in (4, 8)
        for name in ("cpu_adam", "cpu_adam_delayed", "cpu_adam bf16 moments")
    ],
    ("weight-offload", "dense 8 layers, states + weights of 8"),
    ("weight-offload", "proxy, states + weights of 4"),
    ("weight-offload-caps", "llama3_8b under 48 GB, weights of 31 layers"),
    ("weight-offload-caps-proxy", "proxy under 12 GB, weights of 4 layers"),
    ("capacity-auto-28", "28 layers, no offload"),
    ("capacity-auto-28", "28 layers, auto"),
    ("capacity-auto-31", "31 layers, auto"),
    ("capacity-auto-37", "37 layers, auto"),
    ("whole-model", "whole model, no offload"),
    ("whole-model", "whole model auto"),
    ("two-gpu-full-1", "full EP2 no offload"),
    ("two-gpu-full-2", "full EP2 auto"),
    ("two-gpu-engines", "proxy DP2 GBS8 cpu_adam"),
    ("two-gpu-engines", "proxy DP2 GBS8 states"),
    ("two-gpu-engines", "proxy EP2 GBS8 cpu_adam"),
    ("two-gpu-engines-2", "proxy EP2 GBS8 states"),
    ("cpu-adam-split-1", "GBS1 cpu_adam 100%"),
    # exact offload's cost at each batch: the latest suites (one H100)
    *[
        (f"gbs-{gbs}-beside", f"cost GBS{gbs} {name}")
        for gbs in (4, 8, 32)
        for name in ("cpu_adam 100%", "states", "HDO 100% + overlap", "cpu_adam_delayed 100%")
    ],
    ("llama3-8b-auto", "llama3_8b seq 8192 GBS 8, auto"),
    ("bf16-moments", "states, bf16 moments"),
    ("bf16-moments", "cpu_adam, bf16 moments"),
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
    rows = []
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
        rows.append(
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
    if not rows:
        return []
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
        *markdown_table(
            [
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
            ],
            rows,
        ),
        "",
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
# gpu_tests.py's.
CAPACITY = {"capacity-28", "capacity-auto-28", "capacity-auto-31", "capacity-auto-37"}
GBS_CALLS = ("", "-beside", "-grown", "-pairs", "-pairs-2", "-pairs-3", "-pairs-4")
OPTIMIZER_OFFLOAD = {  # gbs_report.py's
    "beside-4-ab",
    "exact-4-ab",
    *(f"remainders-{n}" for n in (4, 8, 32)),
    *(f"gbs-{n}{call}" for n in (4, 8, 32) for call in GBS_CALLS),
}
IN_REPORTS = {
    *OPTIMIZER_OFFLOAD,
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
    lines += _transfer_bound_lines(results, by_name)
    lines += _weight_offload_lines(results, by_name)
    lines += _cpu_adam_lines(results, by_name)
    lines += _scale_lines(results)
    lines += _convergence_lines(results)
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
