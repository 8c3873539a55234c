"""The CPU-Adam engine put into Megatron-Core's optimizer: one CpuAdam as the inner optimizer of
each DistributedOptimizer part, on one worker per rank, watching the model where its mode lands
or copies during forward and backward."""

from __future__ import annotations

import logging

from offload_runner.config.schema import RunConfig
from offload_runner.hardware import cpu_adam_piece_bytes, rank_cpus, worker_cpus
from offload_runner.model_size import count_parameters
from offload_runner.offload import host_adam, optimizer_states
from offload_runner.offload.base import OffloadSummary
from offload_runner.offload.cpu_adam.cores import cpu_ranges, cpu_worker
from offload_runner.offload.cpu_adam.engine import CpuAdam, CpuSettings
from offload_runner.offload.cpu_adam.gpu_share import BALANCE_STEPS, balanced_share
from offload_runner.offload.cpu_adam.modes import (
    delayed_dense_warning,
    exact_steps,
    mode_name,
    mode_of,
)
from offload_runner.offload.host_adam import AdamSettings
from offload_runner.plan import part_delays, part_fractions
from offload_runner.step_cost import param_count, step_cost

log = logging.getLogger("offload_runner")

DISABLED = {"optimizer.cpu_offload_engine": "hybrid", "optimizer.cpu_adam_delayed_update": False}


def describe(run: RunConfig) -> OffloadSummary:
    group = "offload/optimizer=cpu_adam*"
    if not run.mode.cpu_adam:
        return OffloadSummary("optimizer (cpu adam)", group, False, "-")
    o = run.optimizer
    params = count_parameters(run.model).total * o.optimizer_offload_fraction
    mode = (
        f"delayed parameter update after {exact_steps(run)} exact steps"
        + (", weight prediction" if o.cpu_adam_weight_prediction else "")
        + (
            f", {o.cpu_adam_exact_columns:.0%} of each weight's columns exact on the GPU"
            if o.cpu_adam_exact_columns
            else ""
        )
        + ("" if run.mode.delays_dense else " for the routed experts; the dense part exact")
        if run.mode.delayed
        else "exact: each update lands before the next forward needs it"
    )
    return OffloadSummary(
        "optimizer (cpu adam)",
        group,
        True,
        f"{o.optimizer_offload_fraction:.0%} of Adam: fp32 master + states of "
        f"~{param_count(params)} params on the host, updated in pieces of up to "
        f"{cpu_adam_piece_bytes(params) // 1024**2} MiB",
        mode,
    )


def engines(optimizer) -> list[CpuAdam]:
    """The CpuAdam engines inside what ``get_megatron_optimizer`` returned."""
    return host_adam.engines(optimizer, CpuAdam)


def _is_expert_part(part) -> bool:
    return any(g.get("is_expert_parallel", False) for g in part.optimizer.param_groups)


def attach(run: RunConfig, optimizer, local_rank: int = 0, local_world: int = 1) -> list[CpuAdam]:
    """Make a CpuAdam the inner optimizer of every DistributedOptimizer of ``optimizer`` (built on
    Megatron-Core's precision-aware path, so no fp32 masters were allocated on the GPU)."""
    o = run.optimizer
    parts = host_adam.inner_parts(optimizer)
    sizes = [sum(q.numel() for g in p.optimizer.param_groups for q in g["params"]) for p in parts]
    experts = [_is_expert_part(p) for p in parts]
    fractions = part_fractions(
        sizes, experts, o.optimizer_offload_fraction, o.cpu_adam_delayed_update
    )
    delayed = part_delays(run, experts)
    warning = delayed_dense_warning(
        sizes, experts, o.optimizer_offload_fraction, run.mode.delays_dense
    )
    if warning:
        log.warning(warning)
    cpus = worker_cpus(run, rank_cpus(local_rank, local_world))
    threads = len(cpus)  # one OpenMP thread per core the team may use
    # exact updates land during the next forward, module by module, where no data-parallel
    # parameter all-gather follows the step (suite cpu-adam-landing: faster than within the step)
    in_forward = [not host_adam.gathers_params(p) for p in parts]
    # DDP scales every gradient, the experts' too, by 1 / data-parallel size after the backward
    in_backward = [run.mode.copies_during_backward(_data_parallel_size())] * len(parts)
    # One worker runs every part's update in the order their step() hands them over: Megatron-
    # Core's ChainedOptimizer steps the dense part before the experts', so with delayed experts
    # the dense part's exact update (the next forward waits for it) runs first.
    worker = cpu_worker(cpus, threads, _current_device())
    share = step_cost(run, local_world).gpu_share(run) if run.mode.streams else 0.0
    # the exact updates' share, and delayed mode's for every parameter (delayed experts beside
    # an exact dense part run on the CPU alone)
    shared = [not d or run.mode.delays_dense for d in delayed]
    built = host_adam.install(
        optimizer,
        lambda part, i: CpuAdam(
            part.optimizer.param_groups,
            AdamSettings.of(
                run,
                fraction=fractions[i],
                chunk_bytes=cpu_adam_piece_bytes(sizes[i] * fractions[i]),
                moment_dtypes=optimizer_states.moment_dtypes(run),
            ),
            CpuSettings(
                mode=mode_of(run, delayed[i], in_backward[i]),
                threads=threads,
                cpus=cpus,
                land_during_forward=in_forward[i],
                clip_grad=o.clip_grad,
                gpu_share=share if shared[i] else 0.0,
                balance=shared[i] and balanced_share(run),
                grad_dtype=host_adam.grad_dtype(run),
            ),
            worker,
        ),
    )
    for part, engine in zip(parts, built, strict=True):
        if engine.land_during_forward:
            engine.watch(part.model_chunks)
        if engine.mode.copy_during_backward:
            engine.watch_backward(part.model_chunks)
        engine.watch_columns([q for chunk in part.model_chunks for q in chunk.parameters()])
    _announce(run, built, sum(sizes), cpus, share, in_forward, in_backward)
    return built


def _announce(
    run: RunConfig,
    built: list[CpuAdam],
    shard: int,
    cpus: list[int],
    share: float,
    in_forward: list[bool],
    in_backward: list[bool],
) -> None:
    """The log lines that say what ``attach`` built: where the params went, the GPU share,
    where exact updates land and when delayed steps copy."""
    o, threads = run.optimizer, len(cpus)
    numel = sum(e.offloaded_numel for e in built)
    log.info(
        "cpu_adam: %.3fB of %.3fB params of this rank's shard on the CPU (%d threads on cores "
        "%s), %s",
        numel / 1e9,
        shard / 1e9,
        threads,
        cpu_ranges(cpus),
        mode_name(built),
    )
    if share:
        log.info(
            "cpu_adam: Adam on %.0f%% of them on the GPU instead, their states streamed "
            "through a %.0f MiB window %s while the CPU updates the rest (%s)",
            100 * share,
            max(e.window_bytes for e in built) / 1024**2,
            "with their gradients under the next forward+backward (delayed steps) or during "
            "the step (exact steps)"
            if run.mode.late_share
            else "during the step",
            f"the share starts at the planner's balance and follows the measured one "
            f"up to step {BALANCE_STEPS}, then stays"
            if balanced_share(run)
            else "the planner's balance, fixed: model.deterministic_mode"
            if o.cpu_adam_gpu_share is None
            else "optimizer.cpu_adam_gpu_share",
        )
    if not all(in_forward):
        log.info(
            "cpu_adam: the exact updates of a shard that data-parallel ranks all-gather "
            "after the step land within step() (the all-gather needs them whole); "
            "the others land during the next forward"
        )
    if o.cpu_adam_delayed_update:
        log.info(
            "cpu_adam: delayed steps copy %s",
            "during the last micro-batch's backward (the CPU applies the clip factor)"
            if all(in_backward)
            else "at the step "
            "boundary: Megatron-Core edits gradients after the backward here (data, tensor, "
            "pipeline or context parallelism)",
        )


def _data_parallel_size() -> int:
    """Data-parallel ranks (with context parallelism) of the dense part: Megatron-Core's DDP
    scales every gradient, the experts' too, by their inverse after the backward."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_data_parallel_world_size(with_context_parallel=True)


def _current_device():
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
