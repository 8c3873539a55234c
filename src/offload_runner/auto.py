"""``offload/optimizer=auto`` and ``offload/activation=auto``: among the settings the memory
model (plan.py) says fit, the one the step-time model (step_cost.py) says costs least; and
``--plan --largest``, the largest slice of a recipe that fits. Pure arithmetic, no GPU."""

from __future__ import annotations

from dataclasses import dataclass, replace

from offload_runner.config.schema import (
    CpuOffloadEngine,
    OptimizerDtype,
    RecomputeGranularity,
    RecomputeMethod,
    RunConfig,
)
from offload_runner.gpu_time import Predicted, predict
from offload_runner.model_size import count_parameters
from offload_runner.plan import GiB, Layout, Plan, make_plan
from offload_runner.step_cost import step_cost, weight_offload_note

# --- auto: the offload that fits at the least predicted cost ------------------------------------

AUTO_FRACTIONS = (0.25, 0.5, 0.75, 1.0)


def optimizer_ladder(
    engine: CpuOffloadEngine, delayed: bool = False
) -> tuple[tuple[str, dict], ...]:
    """What offload/optimizer=auto tries, least first: nothing, then 25 ... 100% of Adam on the
    CPU with ``engine`` (planner.auto_engine: the CPU-Adam engine by default, in delayed mode
    with planner.auto_delayed)."""
    steps: list[tuple[str, dict]] = [
        (
            "disabled",
            {"optimizer.optimizer_cpu_offload": False, "optimizer.optimizer_offload_fraction": 0.0},
        )
    ]
    for f in AUTO_FRACTIONS:
        common = {
            "optimizer.optimizer_cpu_offload": True,
            "optimizer.optimizer_offload_fraction": f,
            "optimizer.cpu_offload_engine": engine,
            "optimizer.cpu_adam_delayed_update": delayed,
        }
        if engine == CpuOffloadEngine.cpu_adam:
            name = ("cpu_adam_delayed" if delayed else "cpu_adam") + (
                "" if f == 1.0 else f" optimizer.optimizer_offload_fraction={f}"
            )
            late = {"optimizer.cpu_adam_gpu_share": 0.0} if delayed else {}  # as its preset
            steps.append(
                (name, {**common, "optimizer.overlap_cpu_optimizer_d2h_h2d": False, **late})
            )
        else:
            steps.append(
                (
                    f"cpu_{int(f * 100)}",
                    {**common, "optimizer.overlap_cpu_optimizer_d2h_h2d": f == 1.0},
                )
            )
    return tuple(steps)


def with_overrides(run: RunConfig, overrides: dict) -> RunConfig:
    """A copy of ``run`` with dotted keys replaced."""
    sections: dict[str, dict] = {}
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        sections.setdefault(section, {})[name] = value
    return replace(run, **{s: replace(getattr(run, s), **v) for s, v in sections.items()})


@dataclass
class AutoChoice:
    overrides: dict  # dotted key -> value, to apply to the config
    description: str
    plan: Plan


STATES_STEP = (
    "states",
    {
        "optimizer.optimizer_cpu_offload": False,
        "optimizer.optimizer_offload_fraction": 0.0,
        "optimizer.offload_optimizer_states": True,
    },
)
# State offload's fractions auto tries (the rest of the states stays on the GPU).
STATE_FRACTIONS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)
BF16_MOMENTS = {
    "optimizer.exp_avg_dtype": OptimizerDtype.bf16,
    "optimizer.exp_avg_sq_dtype": OptimizerDtype.bf16,
}
BF16_GRADIENTS = {**BF16_MOMENTS, "ddp.grad_reduce_in_fp32": False}
Q8_MOMENTS = {
    **BF16_GRADIENTS,
    "optimizer.exp_avg_dtype": OptimizerDtype.q8,
    "optimizer.exp_avg_sq_dtype": OptimizerDtype.q8,
}
# What auto gives up, in this order, when nothing in the configured precision fits: Adam's
# moments in bf16 (fp32 math), then the gradient buffer in bf16 too (the host engines only);
# then, with state offload of the whole shard only (offload/quantized.py), 8-bit moments, then
# no masters (the bf16 parameters rounded stochastically).
PRECISION_TIERS = (
    ("", {}),
    ("bf16 moments", BF16_MOMENTS),
    ("bf16 moments and gradients", BF16_GRADIENTS),
    ("8bit moments", Q8_MOMENTS),
    (
        "8bit moments, sr bf16 masters",
        {**Q8_MOMENTS, "optimizer.main_params_dtype": OptimizerDtype.bf16},
    ),
)
STATES_ONLY_TIER = 3  # from here on: state offload of the whole shard
# What each tier cost in final validation loss against fp32 training, on real text (bench suite
# `convergence`, the rows of the tiers' names; a test holds these to its results).
MEASURED_LOSS_COST = {
    "bf16 moments": 0.0019,
    "bf16 moments and gradients": 0.0020,
    "8bit moments": 0.0059,
    "8bit moments, sr bf16 masters": 0.0002,
}


def states_ladder() -> list[tuple[str, dict]]:
    """State offload at each of STATE_FRACTIONS."""
    name, overrides = STATES_STEP
    return [
        (
            name + ("" if f == 1.0 else f" optimizer.optimizer_state_offload_fraction={f}"),
            {**overrides, "optimizer.optimizer_state_offload_fraction": f},
        )
        for f in STATE_FRACTIONS
    ]


def auto_candidates(run: RunConfig) -> list[tuple[str, dict, int]]:
    """offload/optimizer=auto's optimizer settings: (name, overrides, precision tier). Tier 0
    keeps the configured precision; the next tiers (PRECISION_TIERS) are the host engines'
    settings again with less precise state, tried only where tier 0 has nothing that fits."""
    p = run.planner
    ladder = optimizer_ladder(p.auto_engine, p.auto_delayed)
    found = [(name, o, 0) for name, o in (*ladder, *states_ladder())]
    host_engines = [
        item
        for item in (*ladder[1:], *states_ladder())
        if p.auto_engine == CpuOffloadEngine.cpu_adam or "states" in item[0]
    ]
    for tier, (what, extra) in enumerate(PRECISION_TIERS[1:], start=1):
        if with_overrides(run, extra) == run:  # configured so already
            continue
        engines = host_engines if tier < STATES_ONLY_TIER else states_ladder()[:1]
        found += [(f"{name}, {what}", {**o, **extra}, tier) for name, o in engines]
    return found


@dataclass
class Fit:
    """A setting that fits: its names, the overrides that make it, the run and plan they give,
    and the precision tier it took (0: as configured)."""

    name: str  # the optimizer setting
    shape: str  # the micro-batch and recompute, where auto chose them ("" otherwise)
    layers: int | None  # activation-offload layers (None: not searched)
    overrides: dict
    run: RunConfig
    plan: Plan
    tier: int


RECOMPUTE_FULL = {
    "model.recompute_granularity": RecomputeGranularity.full,
    "model.recompute_method": RecomputeMethod.uniform,
    "model.recompute_num_layers": 1,
}
NO_RECOMPUTE = dict.fromkeys(RECOMPUTE_FULL)
CHUNKED = "model.chunked_loss"


# Settings predicted within this share of the fastest tie (the model's own error on its suite is
# a few percent): the smallest micro-batch of them wins, then no recompute (_simplest), then the
# fastest, so that auto never buys memory pressure for a gain it cannot see.
TIE_MARGIN = 0.05


def shapes(run: RunConfig, world: int | None = None) -> list[tuple[str, dict]]:
    """The micro-batches and recompute auto tries: the configured micro-batch (with full
    recompute too, unless recompute is configured), or with planner.auto_micro_batch each
    divisor of the rank's batch, without and with full recompute (never where the run offloads
    layers: Megatron-Core refuses recompute beside it). Where the logits may come in chunks
    (TP 1), the most frugal shape of each micro-batch is tried with model.chunked_loss too."""
    layout = Layout.of(run, world)
    if not run.planner.auto_micro_batch:
        if run.model.cpu_offloading or run.model.recompute_granularity is not None:
            found = [("", {})]
        else:
            found = [("", {}), ("full recompute", RECOMPUTE_FULL)]
        return [*found, *_chunked(run, layout, found[-1:])]
    per_rank = max(1, run.train.global_batch_size // layout.dp)
    found = []
    for mb in (d for d in range(1, per_rank + 1) if per_rank % d == 0):
        name = f"train.micro_batch_size={mb}"
        found.append((name, {"train.micro_batch_size": mb, **NO_RECOMPUTE}))
        if not run.model.cpu_offloading:
            full = {"train.micro_batch_size": mb, **RECOMPUTE_FULL}
            found.append((f"{name} with full recompute", full))
        found.extend(_chunked(run, layout, found[-1:]))
    return found


def _chunked(run: RunConfig, layout: Layout, frugal: list) -> list[tuple[str, dict]]:
    """``frugal`` with the logits and loss in chunks, where the run may and does not already."""
    if run.model.chunked_loss or layout.tp > 1:
        return []
    return [
        (", ".join(x for x in (name, "chunked loss") if x), {**ov, CHUNKED: True})
        for name, ov in frugal
    ]


def choose_offload(run: RunConfig, world: int | None = None) -> AutoChoice:
    """Among the settings that fit, the one with the most predicted tokens/s (gpu_time.py's
    forward+backward and GPU Adam, StepCost's offload; ties within TIE_MARGIN go to the
    simplest); for each optimizer setting and shape,
    the fewest activation-offload layers that fit (the model counts them free: they overlap
    compute). offload/optimizer=auto weighs CPU Adam fractions (planner.auto_engine) against
    optimizer-state offload. Raises ValueError when nothing fits."""
    p = run.planner
    last, fitting = _fitting(run, world)
    if not fitting and p.auto_optimizer and not p.auto_activation:
        last, fitting = _weight_offload_fallback(run, world) or (last, fitting)
    if not fitting:
        assert last is not None
        peak = last.worst.gpu_peak / GiB
        raise ValueError(
            f"no offload setting fits: the last one tried needs {peak:.1f} GB + "
            f"{last.gpu_kept_free_gb:.1f} GB kept free of a {last.gpu_capacity_gb:.1f} GB GPU and "
            f"{last.max_node_host_gb:.1f} of {last.host_capacity_gb:.0f} GB host RAM per node"
        )
    o = run.optimizer
    offloading = p.auto_optimizer or o.optimizer_cpu_offload or run.mode.states
    cost = step_cost(run, fitting[0].plan.gpus_per_node) if offloading else None  # times CPU Adam

    def offload_s(fit: Fit) -> float:
        return max(cost.seconds(fit.run, r) for r in fit.plan.ranks) if cost else 0.0

    steps = {id(f): predict(f.run, offload_s(f), world) for f in fitting}  # each once

    def predicted(fit: Fit) -> Predicted:
        return steps[id(fit)]

    fastest = min(step.step_s for step in steps.values())
    best = min(
        (f for f in fitting if predicted(f).step_s <= fastest * (1 + TIE_MARGIN)),
        key=lambda f: (*_simplest(f), predicted(f).step_s),
    )
    ranked = [
        best,
        *sorted((f for f in fitting if f is not best), key=lambda f: predicted(f).step_s),
    ]
    parts = [best.shape] if best.shape else []
    if p.auto_optimizer:
        parts.append(f"offload/optimizer={best.name}")
    if best.layers is not None:
        parts.append(f"activation offload of {best.layers} layer(s)")
    if best.overrides.get("model.cpu_offloading_weights"):
        parts.append(
            f"weight offload of {best.overrides['model.cpu_offloading_num_layers']} layer(s)"
        )
    why = _why(best, cost, predicted(best).offload_s)
    if not best.run.model.deterministic_mode:
        why += f"; {_speed(predicted(best))}"
    if predicted(best).step_s > fastest:
        why += f"; within {TIE_MARGIN:.0%} of the fastest prediction, the simplest shape wins"
    if others := [
        f"{_label(f)} +{predicted(f).offload_s:.2f} s, {_speed(predicted(f))}" for f in ranked[1:3]
    ]:
        why += f"; next: {'; '.join(others)}"
    if (weights := weight_offload_note(best.run, best.plan)) is not None:
        why += f"; {weights}"
    return AutoChoice(best.overrides, f"{', '.join(parts)} ({why})", best.plan)


def _simplest(fit: Fit) -> tuple:
    """What breaks a tie: the smallest micro-batch, then no recompute, then whole logits."""
    recompute = fit.run.model.recompute_granularity is not None
    return (fit.run.train.micro_batch_size, recompute, fit.run.model.chunked_loss)


def _label(fit: Fit) -> str:
    return ", ".join(x for x in (fit.shape, fit.name) if x)


def _speed(predicted: Predicted) -> str:
    return f"predicted {predicted.step_s:.2f} s a step, {predicted.tokens_per_s:,.0f} tokens/s"


def _fitting(run: RunConfig, world: int | None) -> tuple:
    """(the last plan tried, the Fits): for each optimizer setting and shape in turn, the fewest
    activation-offload layers that fit, stopping at the first precision tier where something
    fits. A shape's chunked-loss twin is tried only where the shape itself does not fit (it
    would lose the tie and cost a plan)."""
    p = run.planner
    optimizer_steps = auto_candidates(run) if p.auto_optimizer else [("as configured", {}, 0)]
    last, fitting = None, []
    for opt_name, opt_overrides, tier in optimizer_steps:
        if fitting and tier > fitting[0].tier:
            break  # a more precise setting fits
        fit = None
        for shape, shape_overrides in shapes(run, world):
            if shape_overrides.get(CHUNKED) and fit is not None:
                continue  # its twin, just before it, fits
            base = {**shape_overrides, **opt_overrides}
            if p.auto_optimizer:
                base.setdefault("optimizer.offload_optimizer_states", False)
                base.setdefault("optimizer.optimizer_state_offload_fraction", 1.0)
            last, fit = _fewest_layers(run, world, base, shape_overrides)
            if fit is not None:
                fitting.append(Fit(opt_name, shape, *fit, tier))
    return last, fitting


def _fewest_layers(run: RunConfig, world: int | None, base: dict, shape: dict) -> tuple:
    """(the last plan tried, (layers, overrides, run, plan) of the fewest activation-offload
    layers that fit, or None). Activation offload is not tried beside recompute, which
    Megatron-Core refuses with it."""
    recompute = shape.get("model.recompute_granularity") is not None
    max_layers = run.model.num_layers - 1 if run.model.pipeline_model_parallel_size == 1 else 0
    searched = run.planner.auto_activation and not recompute
    last = None
    for layers in range(0, max_layers + 1) if searched else (None,):
        overrides = dict(base)
        if layers is not None:
            overrides.update(
                {
                    "model.cpu_offloading": layers > 0,
                    "model.cpu_offloading_num_layers": layers,
                    "model.cpu_offloading_activations": True,
                }
            )
        candidate = with_overrides(run, overrides)
        last = make_plan(candidate, world)
        if last.limiting is None:
            return last, (layers, overrides, candidate, last)  # more layers only cost more
    return last, None


def _why(best: Fit, cost, offload_s: float) -> str:
    """Why ``best`` was chosen: its peak and host memory against the capacities, the precision
    tier it took where the configured one fits nowhere, and its offload's predicted cost."""
    plan = best.plan
    peak = plan.worst.gpu_peak / GiB
    why = (
        f"peak {peak:.1f} GB + {plan.gpu_kept_free_gb:.1f} GB kept free fits "
        f"{plan.gpu_capacity_gb:.1f} GB; host {plan.max_node_host_gb:.1f}"
        f" of {plan.host_capacity_gb:.0f} GB per node"
    )
    if best.tier:
        tier = PRECISION_TIERS[best.tier][0]
        loss = MEASURED_LOSS_COST.get(tier)
        measured = (
            "not measured on real text"
            if loss is None
            else f"validation loss {loss:+.2%} on real text, docs/benchmarks/convergence.md"
        )
        why += f"; {tier} ({measured}): nothing in the configured precision fits"
    if cost:
        worst = max(plan.ranks, key=lambda r: cost.seconds(best.run, r))
        why += f"; predicted +{offload_s:.2f} s per step: {cost.explain(best.run, worst)}"
    return why


def _weight_offload_fallback(run: RunConfig, world: int | None) -> tuple | None:
    """Where no optimizer setting fits on one GPU: state offload (each precision tier in turn)
    with the fewest layers of weight offload that fit, as (last plan, [fitting item]); None
    where weight offload cannot run (more than one GPU) or nothing fits even so."""
    if Layout.of(run, world).world != 1:
        return None
    last = None
    for tier, (_, precision) in enumerate(PRECISION_TIERS[:STATES_ONLY_TIER]):
        name, states = STATES_STEP
        for layers in range(1, run.model.num_layers + 1):
            overrides = {
                **states,
                **precision,
                "optimizer.optimizer_state_offload_fraction": 1.0,
                "model.cpu_offloading": True,
                "model.cpu_offloading_weights": True,
                "model.cpu_offloading_activations": False,
                "model.cpu_offloading_num_layers": layers,
            }
            candidate = with_overrides(run, overrides)
            last = make_plan(candidate, world)
            if last.limiting is None:
                return last, [Fit(name, "", None, overrides, candidate, last, tier)]
            if last.host_needed_gb > last.host_capacity_gb:
                break  # more layers only need more host RAM
    return (last, []) if last is not None else None


# --- the largest slice of a recipe that fits ------------------------------------------------------


@dataclass
class Largest:
    layers: int  # model.num_layers of the largest slice that fits (0: none)
    params: int
    plan: Plan | None
    choice: AutoChoice | None  # auto's setting there, where auto is on


def largest_slice(run: RunConfig, world: int | None = None) -> Largest:
    """The most layers of ``run``'s model (up to its own num_layers, in steps of the pipeline
    size) that fit here: as configured, or with auto's choice at each size. Fitting only gets
    harder with more layers, so a bisection finds it."""
    step = run.model.pipeline_model_parallel_size * (
        run.model.virtual_pipeline_model_parallel_size or 1
    )
    auto = run.planner.auto

    def at(layers: int) -> tuple[Plan | None, AutoChoice | None]:
        sliced = with_overrides(run, {"model.num_layers": layers})
        if auto:
            try:
                choice = choose_offload(sliced, world)
            except ValueError:
                return None, None
            return choice.plan, choice
        plan = make_plan(sliced, world)
        return (plan if plan.limiting is None else None), None

    lo, hi = 0, run.model.num_layers // step  # in steps; lo fits (0: trivially), hi unknown
    best: tuple[Plan | None, AutoChoice | None] = (None, None)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        found = at(mid * step)
        if found[0] is not None:
            lo, best = mid, found
        else:
            hi = mid - 1
    layers = lo * step
    sliced = with_overrides(run, {"model.num_layers": layers})
    params = count_parameters(sliced.model).total if layers else 0
    return Largest(layers, params, best[0], best[1])
