#!/usr/bin/env python
"""The memory planner and the step-time model against what every recorded run measured: the
planner's GPU peak for a run's own command line next to its torch.cuda.max_memory_allocated(),
and the model's step for the exact host engines' runs next to their measured step.

    python bench/calibrate_planner.py --report docs/benchmarks/planner.png bench/results/*.json \\
        > docs/benchmarks/planner.md
    python bench/calibrate_planner.py --step-report docs/benchmarks/step-model.png \\
        bench/results/*.json > docs/benchmarks/step-model.md

Runs on any machine (the planner needs no GPU). Runs below ``--min-gb`` are left out of the
planner's report: there fixed allocator and library overheads, not the model, set the peak.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from offload_runner.auto import choose_offload  # noqa: E402
from offload_runner.cli import AUTO_MICRO_BATCH  # noqa: E402
from offload_runner.config.compose import compose_config, to_run_config  # noqa: E402
from offload_runner.config.schema import REMOVED_KEYS  # noqa: E402
from offload_runner.plan import GiB, Plan, make_plan  # noqa: E402
from offload_runner.report import fmt, markdown_table  # noqa: E402

# The runs the activation model was read from (tensor by tensor, see plan.layer_activations and
# plan.recompute_stored_and_rebuilt): every other run is held out, and the test holds those to 10%.
FITTED_ON = frozenset(
    {
        "spread dense MB1 4k",
        "spread dense MB4 4k",
        "spread dense MB1 16k full recompute",
        "spread MoE MB1 32k full recompute, states",
    }
)


@dataclass
class Calibration:
    suite: str
    case: str
    nproc: int
    measured_gb: float
    planned_gb: float
    measured_fwd_bwd_gb: float | None
    planned_fwd_bwd_gb: float
    measured_step_gb: float | None
    planned_step_gb: float
    measured_pinned_gb: float | None = None  # page-locked host memory (offload runs)
    planned_pinned_gb: float = 0.0

    @property
    def held_out(self) -> bool:
        return self.case not in FITTED_ON

    @property
    def error(self) -> float:
        return (self.planned_gb - self.measured_gb) / self.measured_gb


def _retired(arg: str) -> str | None:
    """A recorded override in today's keys (None: nothing the planner reads): the keys removed
    since the run, with the suites that showed their default as good."""
    key, _, value = arg.partition("=")
    if key == "optimizer.offload_states_window_mb":  # states: 4 pieces of a chunk
        return f"optimizer.optimizer_state_offload_chunk_size_mb={int(value) // 4}"
    if key == "optimizer.cpu_adam_land_during_forward" or key in REMOVED_KEYS:  # cpu-adam-landing
        return None
    return arg


def overrides_of(command: list[str]) -> list[str]:
    """Hydra overrides of a recorded `python run_recipe.py --recipe R ...` command."""
    args = command[2:]
    out = []
    while args:
        arg = args.pop(0)
        if arg == "--recipe":
            out.append(f"recipe={args.pop(0)}")
        elif arg == AUTO_MICRO_BATCH:
            out.append("planner.auto_micro_batch=true")
        elif "=" in arg and not arg.startswith("-") and _retired(arg) is not None:
            out.append(_retired(arg))
    return out


def is_whole_states(result: dict) -> bool:
    """A run of the first state offload, since removed, which moved whole tensors: runs of
    offload/optimizer=states from before the windowed engine (their summaries have no
    ``states_offloaded_params``; runs that failed or offloaded weights, which came later, are
    none), and the whole-tensor cases measured beside it."""
    overrides = overrides_of(result["command"])
    if not any(o.startswith("offload/optimizer=states") for o in overrides):
        return False
    summary = result.get("summary") or {}
    later = not summary or "weight_offload_params" in summary
    return "offload/optimizer=states_whole" in overrides or (
        not later and "states_offloaded_params" not in summary
    )


def ran_before_gpu_share(result: dict) -> bool:
    """A CPU-Adam run from before exact mode had a GPU share (optimizer.cpu_adam_gpu_share, on
    by default since): its summary has no ``cpu_adam_params_on_gpu``, all of Adam ran on the
    CPU."""
    summary = result.get("summary") or {}
    return "cpu_offloaded_params" in summary and "cpu_adam_params_on_gpu" not in summary


def ran_with_fp32_masters(result: dict) -> bool:
    """A state-offload run from before its host kept the masters as remainders (2 B/param
    instead of 4 on the host and each way; optimizer.store_param_remainders, on by default
    since): its summary has no ``states_master_bytes``."""
    summary = result.get("summary") or {}
    return "states_offloaded_params" in summary and "states_master_bytes" not in summary


# The recipes' fused kernels (conf/speed/fused.yaml) came with the first throughput-16 call: runs
# before it ran Megatron-Core's plain kernels.
FUSED_SINCE = "2026-11-27T12:10"


def ran_before_speed_settings(result: dict) -> bool:
    """A run recorded before the recipes set the fused kernels (its file's date, which
    ``calibrate`` and the report attach as ``environment``; none: an old run)."""
    date = (result.get("environment") or {}).get("date", "")
    return date < FUSED_SINCE


def as_it_ran(result: dict) -> list[str]:
    """A recorded run's overrides, with what its engine did by default at its commit spelt
    out (``ran_before_gpu_share``, ``ran_with_fp32_masters``, ``ran_before_speed_settings``)."""
    overrides = overrides_of(result["command"])
    if ran_before_speed_settings(result) and not any(o.startswith("speed=") for o in overrides):
        overrides.insert(1, "speed=plain")
    if ran_before_gpu_share(result) and "offload/optimizer=cpu_adam" in overrides:
        overrides.append("optimizer.cpu_adam_gpu_share=0")
    if ran_with_fp32_masters(result):
        overrides.append("optimizer.store_param_remainders=false")
    return overrides


def plan_of(result: dict) -> Plan:
    """The planner's plan for a recorded run's command line, on the run's GPU count (as the run
    behaved at its commit: ``as_it_ran``)."""
    nproc = result["case"].get("nproc", 1)
    overrides = as_it_ran(result)
    chosen = ((result.get("summary") or {}).get("auto") or "").split(" (")[0]
    if chosen and "," not in chosen:  # what auto chose for the run, where its overrides say all
        # (auto times the CPU: here it could choose otherwise)
        overrides = [o for o in overrides if not o.endswith("=auto")] + chosen.split()
    return _plan(tuple(overrides), nproc)


@functools.cache
def _plan(overrides: tuple[str, ...], nproc: int) -> Plan:
    """One command line's plan (the rounds of a suite repeat their command lines: composed once)."""
    run = to_run_config(compose_config(list(overrides)))
    if run.planner.auto:
        return choose_offload(run, nproc).plan  # what auto chooses, as the launcher does
    return make_plan(run, world=nproc, gpus_per_node=nproc)


def calibrate(files: list[Path]) -> list[Calibration]:
    rows = []
    for path in files:
        data = json.loads(path.read_text())
        for result in data["results"]:
            result = {**result, "environment": data["environment"]}
            s = result["summary"]
            if result["status"] != "ok" or not s or is_whole_states(result):
                continue  # the planner knows the offloads that exist
            if "/" in result["case"]["recipe"]:
                continue  # a recipe file --import-hf wrote where the run ran, not kept
            nproc = result["case"].get("nproc", 1)
            worst = plan_of(result).worst
            # every rank's peak where the run recorded them (rank 0's alone before)
            measured = max(s.get("gpu_peak_per_rank_gb") or [s["gpu_peak_allocated_gb"]])
            rows.append(
                Calibration(
                    data["suite"],
                    result["case"]["name"],
                    nproc,
                    measured,
                    worst.gpu_peak / GiB,
                    s.get("gpu_peak_fwd_bwd_gb"),
                    worst.fwd_bwd_peak / GiB,
                    s.get("gpu_peak_step_gb"),
                    worst.step_peak / GiB,
                    s.get("host_pinned_gb_max"),
                    worst.host_pinned / GiB,
                )
            )
    return rows


@dataclass
class StepCalibration:
    suite: str
    case: str
    gpu: str
    baseline_s: float
    measured_s: float
    predicted_s: float
    # the run's forward+backward (less its wait for CPU Adam's landings) less no offload's
    fwd_bwd_drift_s: float = 0.0
    # the step of the call's last no-offload run before this one over its fastest: above 1 the
    # host was slower then (the model's rates are the call's)
    host_slowdown: float = 1.0

    @property
    def error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s

    @property
    def update_error(self) -> float:
        """The error once the model is handed the forward+backward the run itself had: what
        the model prices (the update), apart from the host's drift in forward+backward."""
        return (self.predicted_s + self.fwd_bwd_drift_s - self.measured_s) / self.measured_s


def _exact_engine(overrides: list[str]) -> bool:
    """offload/optimizer=cpu_adam (exact) or states, all of it: what the step-time model prices
    without a forward+backward of its own to hide in."""
    exact = {"offload/optimizer=cpu_adam", "offload/optimizer=states"}
    others = [o for o in overrides if "offload_fraction=" in o or o.startswith("offload/weight")]
    return bool(exact & set(overrides)) and not others


def predicted_step(result: dict, baseline_s: float, reference: dict) -> float:
    """The step-time model's step for a recorded run: its suite's no-offload step, less the
    GPU's own Adam the offload takes off it, plus what step_cost prices the offload at, with the
    suite's fused CPU AdamW rate at the run's thread count (``reference``: the suite's
    cpu_adam_reference_params_per_s) and each rank's share of the node's host link."""
    from offload_runner.auto import with_overrides
    from offload_runner.gpu_time import gpu_adam_seconds
    from offload_runner.hardware import REFERENCE_CPU_ADAM_PARAMS_PER_S, rank_link_gb_per_s
    from offload_runner.step_cost import StepCost

    nproc = result["case"].get("nproc", 1)
    run = to_run_config(compose_config(as_it_ran(result)))
    threads = str(result["summary"].get("cpu_adam_threads"))
    rate = (
        reference.get(threads)
        or max(reference.values(), default=0)
        or (REFERENCE_CPU_ADAM_PARAMS_PER_S)
    )
    cost = StepCost(rate, rank_link_gb_per_s(run.planner.host_link_gb_per_s, nproc))
    worst = max(plan_of(result).ranks, key=lambda r: cost.seconds(run, r))
    off = {"optimizer.optimizer_cpu_offload": False, "optimizer.offload_optimizer_states": False}
    taken = gpu_adam_seconds(with_overrides(run, off), nproc) - gpu_adam_seconds(run, nproc)
    return baseline_s - taken + cost.seconds(run, worst)


def calibrate_steps(files: list[Path]) -> list[StepCalibration]:
    """The exact host engines' runs (all of Adam offloaded) beside the no-offload runs of their
    own suite file (the mean where it repeats them): measured step against the model's."""
    rows = []
    for path in files:
        data = json.loads(path.read_text())
        by_name = {r["case"]["name"]: r for r in data["results"]}
        reference = data["environment"].get("cpu_adam_reference_params_per_s", {})
        parsed = [(overrides_of(r["command"]), r) for r in data["results"] if r["status"] == "ok"]
        for result in data["results"]:
            base = by_name.get(result["case"]["baseline"])
            if result["status"] != "ok" or base is None or base is result or base["status"] != "ok":
                continue
            overrides, shared = overrides_of(result["command"]), overrides_of(base["command"])
            if (
                not _exact_engine(overrides)
                or is_whole_states(result)
                or ran_before_gpu_share(result)
                or any("=" in o and "offload" not in o and o not in shared for o in overrides)
            ):
                continue  # only the offload differs from the baseline
            same = [r["summary"] for o, r in parsed if o == shared]
            base_s = _mean(same, "step_time_s_median")  # the baseline and its repeats
            mine = result["summary"]  # its waits for the update are the engine's, not drift
            drift = (
                mine["fwd_bwd_time_s_median"]
                - forward_wait(mine, same)
                - _mean(same, "fwd_bwd_time_s_median")
            )
            rows.append(
                StepCalibration(
                    data["suite"],
                    result["case"]["name"],
                    data["environment"]["gpu"].replace("NVIDIA ", ""),
                    base_s,
                    result["summary"]["step_time_s_median"],
                    predicted_step(result, base_s, reference),
                    drift,
                    _last_over_fastest(parsed, shared, result),
                )
            )
    return rows


def forward_wait(run: dict, bases: list[dict]) -> float:
    """How long a run's forward waited for its update (part of its forward+backward, but the
    engine's cost, not the host's drift): CPU Adam's landings, state offload's pass beside the
    forward. Runs that ran that pass beside the forward before its wait was timed (commit
    14a2ce5) count the pass less the part of it that fits in their optimizer phase beyond no
    offload's (``bases``), as if the forward overlapped none of it (their pass ended within a
    millisecond of the forward's first wait: states_beside_forward_s)."""
    if run.get("states_forward_wait_s_median") is not None:
        return run["states_forward_wait_s_median"]
    if run.get("states_beside_forward_s") is not None:
        beyond = run["optimizer_time_s_median"] - _mean(bases, "optimizer_time_s_median")
        return max(run["states_stream_s_median"] - beyond, 0.0)
    return run.get("cpu_adam_forward_wait_s_median") or 0.0


def _last_over_fastest(parsed: list, shared: list[str], result: dict) -> float:
    """The step of the last no-offload run (``shared`` overrides) before ``result`` in its call
    over the call's fastest no-offload step."""
    here = next(i for i, (_, r) in enumerate(parsed) if r is result)
    bases = [
        (i, r["summary"]["step_time_s_median"]) for i, (o, r) in enumerate(parsed) if o == shared
    ]
    fastest = min(step for _, step in bases)
    before = [step for i, step in bases if i < here]
    return (before[-1] if before else fastest) / fastest


def _mean(summaries: list[dict], key: str) -> float:
    return sum(s[key] for s in summaries) / len(summaries)


@dataclass
class EngineRate:
    suite: str
    case: str
    gpu: str
    cpu_ratio: float  # the engine's CPU Adam rate over fused AdamW alone at its thread count
    link_gb_per_s: float  # the pass's bytes each way (the GPU share's states, the landings)
    bf16_moments: bool = False


def engine_rates(files: list[Path]) -> list[EngineRate]:
    """Exact CPU Adam with a GPU share (fp32 moments, one GPU): its CPU rate beside the streams
    over its suite's fused CPU AdamW rate, and the link's rate during its pass (the share's 12
    B/param and the CPU part's 4 B/param landings, over the pass's time): the step-time model's
    hardware.CPU_ADAM_RATE_BESIDE_STREAMS and LINK_BESIDE_CPU_ADAM."""
    rows = []
    for path in files:
        data = json.loads(path.read_text())
        reference = data["environment"].get("cpu_adam_reference_params_per_s", {})
        for r in data["results"]:
            s = r.get("summary") or {}
            rate = reference.get(str(s.get("cpu_adam_threads")))
            if (
                s.get("cpu_adam_mode") != "exact"
                or not s.get("cpu_adam_gpu_share")
                or not rate
                or r["case"].get("nproc", 1) != 1
            ):
                continue
            low = any("exp_avg" in o and "bf16" in o for o in overrides_of(r["command"]))
            window = 8 if low else 12  # the GPU share's states each way, per param
            moved = s["cpu_adam_params_on_gpu"] * window + s["cpu_adam_params_on_cpu"] * 4
            rows.append(
                EngineRate(
                    data["suite"],
                    r["case"]["name"],
                    data["environment"]["gpu"].replace("NVIDIA ", ""),
                    s["cpu_adam_params_per_s"] / rate,
                    moved / s["cpu_adam_stream_s_median"] / 1e9,
                    low,
                )
            )
    return rows


def render_engine_rates(rows: list[EngineRate]) -> str:
    import statistics

    table = markdown_table(
        [
            "suite",
            "case",
            "GPU",
            "moments",
            "CPU rate / fused AdamW alone",
            "link during the pass GB/s",
        ],
        [
            [
                r.suite,
                r.case,
                r.gpu,
                "bf16" if r.bf16_moments else "fp32",
                f"{r.cpu_ratio:.2f}",
                f"{r.link_gb_per_s:.1f}",
            ]
            for r in rows
        ],
    )
    lines = [*table, ""]
    for low in (False, True):
        some = [r for r in rows if r.bf16_moments == low]
        if some:
            kind = "bf16" if low else "fp32"
            lines.append(
                f"median, {kind} moments ({len(some)} runs): CPU rate "
                f"{statistics.median(r.cpu_ratio for r in some):.2f} of fused AdamW "
                f"alone, link {statistics.median(r.link_gb_per_s for r in some):.1f} GB/s "
                "each way"
            )
    return "\n".join(lines)


def render_steps(rows: list[StepCalibration]) -> str:
    import statistics

    table = markdown_table(
        [
            "suite",
            "case",
            "GPU",
            "no offload s (mean)",
            "measured s",
            "predicted s",
            "error",
            "fwd+bwd against no offload s",
            "error given the run's fwd+bwd",
            "no offload just before / fastest",
        ],
        [
            [
                r.suite,
                r.case,
                r.gpu,
                f"{r.baseline_s:.3f}",
                f"{r.measured_s:.3f}",
                f"{r.predicted_s:.3f}",
                f"{r.error:+.1%}",
                f"{r.fwd_bwd_drift_s:+.3f}",
                f"{r.update_error:+.1%}",
                f"{r.host_slowdown:.2f}x",
            ]
            for r in rows
        ],
    )
    within = [r for r in rows if abs(r.error) <= 0.10]
    given = [r for r in rows if abs(r.update_error) <= 0.10]
    slowed = [r for r in rows if r.host_slowdown >= 1.3]
    missed = [r for r in rows if abs(r.update_error) > 0.10]
    median = statistics.median(abs(r.error) for r in rows)
    median_given = statistics.median(abs(r.update_error) for r in rows)
    summary = (
        f"Within 10%: {len(within)} of {len(rows)} rows as predicted (median |error| "
        f"{median:.1%}); {len(given)} of {len(rows)} given the run's own forward+backward "
        f"(median {median_given:.1%}). {len(slowed)} rows ran where no offload, just before "
        "them, had slowed 1.3x or more from its fastest in the call (the model prices the call's "
        f"rates); {sum(r in slowed for r in missed)} of the {len(missed)} rows past 10% given "
        "their forward+backward are among them."
    )
    return "\n".join([*table, "", summary])


def render_report(rows: list[Calibration], min_gb: float, plot: Path | None) -> str:
    """docs/benchmarks/planner.md: the planner's error per suite, its worst, and a scatter of
    every run's planned against measured peak."""
    import statistics

    held = [r for r in rows if r.measured_gb >= min_gb]
    out = [r for r in held if r.held_out]
    worst = max(held, key=lambda r: abs(r.error))
    suites: dict[str, list[Calibration]] = {}
    for r in held:
        suites.setdefault(r.suite, []).append(r)
    lines = [
        "# Memory planner against measured peaks",
        "",
        f"Every run of bench/results ({len(rows)}), planned from its own command line by "
        "`--plan`'s arithmetic, against its `torch.cuda.max_memory_allocated()` (the worst "
        f"rank's); runs under {min_gb} GB are left out (fixed allocator and library overheads "
        "set them). The activation model was read from four runs (`FITTED_ON`); every other run "
        "is held out, and tests/test_plan.py holds every run within 10%. GB are GiB. "
        "`python bench/calibrate_planner.py --report docs/benchmarks/planner.png "
        "bench/results/*.json`.",
        "",
        f"- worst: {worst.error:+.1%} ({worst.suite} / {worst.case}); held out: "
        f"{max(abs(r.error) for r in out):.1%} over {len(out)} runs",
        f"- within 5%: {sum(abs(r.error) <= 0.05 for r in held) / len(held):.0%} of "
        f"{len(held)} runs; median |error| {statistics.median(abs(r.error) for r in held):.1%}",
        "",
        "## Each suite\n",
        *markdown_table(
            ["suite", "runs", "GPUs", "largest peak GB", "worst error", "median error"],
            [
                [
                    suite,
                    str(len(group)),
                    ",".join(sorted({str(r.nproc) for r in group})),
                    fmt(max(r.measured_gb for r in group)),
                    f"{max((r.error for r in group), key=abs):+.1%}",
                    f"{statistics.median(r.error for r in group):+.1%}",
                ]
                for suite, group in sorted(suites.items())
            ],
        ),
        "",
    ]
    if plot is not None:
        _draw(held, plot)
        lines += [f"![planned against measured GPU peak]({plot.name})", ""]
    return "\n".join(lines)


def render_step_report(files: list[Path], plot: Path | None) -> str:
    """docs/benchmarks/step-model.md: what --plan and auto price an exact host engine's step at,
    against each recorded run, and the two rates the model takes from the engine's runs."""
    steps = calibrate_steps(files)
    lines = [
        "# Step-time model against measured steps",
        "",
        "What `--plan` and `auto` price an exact host engine at (all of Adam offloaded: "
        "`step_cost.StepCost`), added to the no-offload step of the run's own suite file (less "
        "the GPU's Adam the offload takes off it), with "
        "that suite's fused CPU AdamW rate at the run's thread count and each rank's share of "
        "the node's link. The no-offload step is the mean of the suite's no-offload runs. The "
        "model prices the update and takes forward+backward to be no offload's; the column "
        "\"error given the run's fwd+bwd\" hands it the run's own forward+backward instead (less "
        "the forward's wait for CPU Adam's landings, which is the engine's): what is left is the "
        "model's own error on the update. `python bench/calibrate_planner.py --step-report "
        "docs/benchmarks/step-model.png bench/results/*.json`.",
        "",
        "## Each run\n",
        render_steps(steps),
        "",
        "Exact CPU Adam with a GPU share: its CPU Adam rate over fused AdamW alone at the same "
        "threads, and the link's rate during its pass (the share's states and the CPU part's "
        "landings); the model's hardware.CPU_ADAM_RATE_BESIDE_STREAMS and LINK_BESIDE_CPU_ADAM.",
        "",
        render_engine_rates(engine_rates(files)),
        "",
        *held_out_dense(),
    ]
    if plot is not None:
        _draw_steps(steps, plot)
        lines += [f"![predicted against measured step]({plot.name})", ""]
    return "\n".join(lines)


def held_out_dense() -> list[str]:
    """llama3_8b at seq 8192, GBS 8 under auto (suite llama3-8b-auto): what it measured, and
    what auto plans for the same line now at the 64M-param fused AdamW rate of its host."""
    import re

    from offload_runner.auto import choose_offload

    data = json.loads((ROOT / "bench/results/results-llama3-8b-auto.json").read_text())
    s, env = data["results"][0]["summary"], data["environment"]
    rates = (ROOT / "docs/evidence/fused-adamw-rate-by-size-h200.txt").read_text()
    rate = next(ln.split()[-2] for ln in rates.splitlines() if " 64 M" in ln)
    line = [*data["results"][0]["case"]["overrides"], f"planner.cpu_adam_params_per_s={rate}e9"]
    run = to_run_config(compose_config([f"recipe={data['results'][0]['case']['recipe']}", *line]))
    said = "auto: " + choose_offload(run).description
    planned = re.match(r"auto: [^;]*; [^;]*; predicted [^:]*", said)
    return [
        "## The held-out dense shape: llama3_8b at seq 8192, GBS 8, `offload/optimizer=auto` "
        "(suite `llama3-8b-auto`)",
        "",
        f"One H200 ({env['date'][:10]}, commit {env['commit']}): auto chose "
        f"`{s['auto'].split(' (')[0]}`; {s['iterations']} iterations, loss "
        f"{s['first_loss']:.2f} -> {s['final_loss']:.2f}, step {s['step_time_s_median']:.2f} s "
        f"(forward+backward {s['fwd_bwd_time_s_median']:.2f}, the rest "
        f"{s['optimizer_time_s_median']:.2f}), GPU peak {s['gpu_peak_allocated_gb']:.1f} GB, node "
        f"RAM {s['host_used_gb_max_per_node'][0]:.1f} GB; the engine's CPU Adam ran at "
        f"{s['cpu_adam_params_per_s'] / 1e9:.2f} G/s beside a GPU share that settled at "
        f"{s['cpu_adam_gpu_share']:.2f}. The run planned its update at "
        f"{s['auto'].split('predicted ')[1].split(' per step')[0]} from fused AdamW timed on 16M "
        f"params, which stay in the caches ({re.search(r'at ([0-9.]+) G/s', s['auto'])[1]} G/s "
        "there); the planner now times 64M params (docs/evidence/fused-adamw-rate-by-size-h200.txt)"
        " and prices the engine at its own rates beside the streams. Planned again that way, at "
        "that file's 64M-param rate, by this commit:",
        "",
        "```",
        planned.group(0) if planned else said,
        "```",
        "",
        "against the measured rest of the step and GPU peak above.",
        "",
    ]


def _draw_steps(rows: list[StepCalibration], out: Path) -> None:
    from plots import pyplot, save

    fig, ax = pyplot().subplots(figsize=(6, 5))
    top = max(max(r.measured_s, r.predicted_s) for r in rows) * 1.05
    ax.fill_between([0, top], [0, top * 0.9], [0, top * 1.1], color="0.9", label="within 10%")
    ax.scatter([r.measured_s for r in rows], [r.predicted_s for r in rows], s=12, label="as priced")
    given = [r.predicted_s + r.fwd_bwd_drift_s for r in rows]
    ax.scatter([r.measured_s for r in rows], given, s=8, marker="x", label="given its fwd+bwd")
    ax.set(xlabel="measured step s", ylabel="predicted s", xlim=(0, top), ylim=(0, top))
    ax.legend(fontsize=8)
    save(fig, out)


def _draw(rows: list[Calibration], out: Path) -> None:
    from plots import pyplot, save

    fig, ax = pyplot().subplots(figsize=(6, 5))
    top = max(max(r.measured_gb, r.planned_gb) for r in rows) * 1.05
    ax.fill_between([0, top], [0, top * 0.9], [0, top * 1.1], color="0.9", label="within 10%")
    for held_out, label in ((True, "held out"), (False, "fitted on")):
        chosen = [r for r in rows if r.held_out == held_out]
        ax.scatter(
            [r.measured_gb for r in chosen], [r.planned_gb for r in chosen], s=12, label=label
        )
    ax.set(xlabel="measured GPU peak GB", ylabel="planned GB", xlim=(0, top), ylim=(0, top))
    ax.legend(fontsize=8)
    save(fig, out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--min-gb", type=float, default=0.1)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--report", type=Path, help="the planner's report, with this PNG")
    which.add_argument("--step-report", type=Path, help="the step-time model's, with this PNG")
    args = parser.parse_args()
    if args.step_report:
        print(render_step_report(args.files, args.step_report))
    else:
        print(render_report(calibrate(args.files), args.min_gb, args.report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
