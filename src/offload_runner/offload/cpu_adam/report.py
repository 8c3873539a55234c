"""What the CPU-Adam engines of a rank report: summary.json's fields over all of them, and the
log's last word on the fraction delayed mode hides."""

from __future__ import annotations

import logging

from offload_runner.offload.cpu_adam.modes import mode_name
from offload_runner.offload.cpu_adam.wiring import engines
from offload_runner.plan import GiB
from offload_runner.step_cost import copy_seconds_per_param, copy_window, hidden_fraction

log = logging.getLogger("offload_runner")


def metrics(
    optimizer,
    forward_backward_s: float | None = None,
    planner=None,
    copy_micro_batches: int | None = None,
) -> dict:
    """summary.json fields: offloaded params, the CPU Adam rate and host memory over all engines
    of a rank, the mode, and (given the run's median forward+backward) the largest offload
    fraction delayed mode hides at this run's rate (``step_cost.hidden_fraction``): its CPU Adam
    under forward+backward, its copies at ``planner.host_link_gb_per_s`` (``planner``: a
    PlannerConfig; None: copies not counted) beyond the last of ``copy_micro_batches`` backwards
    (None: copies at the step boundary) and the training thread's slowdown beside it within
    ``planner.delayed_max_overhead`` of it.

    Forward+backward without offload is ``planner.forward_backward_s`` where given; a delayed
    run then measures how much its CPU Adam slowed its own (``cpu_adam_launch_slowdown``: seconds
    per second of CPU Adam beside it). Otherwise the run's own, less that slowdown at the
    planner's ``cpu_adam_launch_slowdown``."""
    built = engines(optimizer)
    found = [m for m in (e.metrics() for e in built) if m]
    if not found:
        return {}
    busy = sum(m["cpu_adam_busy_s_median"] for m in found)
    params = sum(m["cpu_offloaded_params"] for m in found)
    on_cpu = sum(m["cpu_adam_params_on_cpu"] for m in found)
    on_gpu = sum(m["cpu_adam_params_on_gpu"] for m in found)
    stream_s = sum(m["cpu_adam_stream_s_median"] for m in found)  # the passes run in turn
    rate = on_cpu / busy if busy else None
    shard = sum(e.shard_numel for e in built)
    forward_wait = sum(m["cpu_adam_forward_wait_s_median"] for m in found)
    if forward_backward_s:  # exact mode landing during the forward: its wait is not its work
        forward_backward_s = max(forward_backward_s - forward_wait, 0.0)
    delayed = any(e.delayed for e in built)
    slowdown, without, measured = launch_slowdown(forward_backward_s, busy, delayed, planner)
    hidden = None
    if without and rate:
        copies = copy_seconds_per_param(planner.host_link_gb_per_s) if planner else 0.0
        overhead = planner.delayed_max_overhead if planner else 1.0
        window = copy_window(without, copy_micro_batches) if copy_micro_batches else 0.0
        hidden = hidden_fraction(without, rate, shard, copies, overhead, window, slowdown)
    return {
        "cpu_offloaded_params": params,  # their masters and moments live on the host
        "cpu_adam_params_on_cpu": on_cpu,  # ... of which Adam ran on the CPU (medians)
        "cpu_adam_params_per_s": rate,
        "cpu_adam_params_on_gpu": on_gpu,  # ... and on the GPU, the states streamed
        "cpu_adam_gpu_share": on_gpu / params if params else 0.0,
        "cpu_adam_stream_s_median": stream_s,  # the GPU share's pass, first Adam to last copy
        "cpu_adam_stream_params_per_s": on_gpu / stream_s if stream_s else None,
        # ... of which the states came in during the last backward
        "cpu_adam_in_backward_params": sum(m["cpu_adam_in_backward_params"] for m in found),
        "cpu_adam_hidden_fraction": hidden,
        "cpu_adam_busy_s_median": busy,
        "cpu_adam_wall_s_median": sum(m["cpu_adam_wall_s_median"] for m in found),
        "cpu_adam_wait_s_median": sum(m["cpu_adam_wait_s_median"] for m in found),
        "cpu_adam_forward_wait_s_median": forward_wait,
        "cpu_adam_boundary_s_median": sum(m["cpu_adam_boundary_s_median"] for m in found),
        "cpu_adam_pieces_in_backward": sum(m["cpu_adam_pieces_in_backward"] for m in found),
        "cpu_adam_copies_in_backward": any(e.mode.copy_during_backward for e in built),
        "cpu_adam_threads": found[0]["cpu_adam_threads"],
        "cpu_adam_pieces": sum(m["cpu_adam_pieces"] for m in found),
        "cpu_adam_host_gb": sum(e.host_bytes for e in built) / GiB,
        "cpu_adam_mode": mode_name(built),
        # ... of the offloaded params, those updated one step late
        "cpu_adam_delayed_params": sum(e.offloaded_numel for e in built if e.delayed),
        "cpu_adam_lands_in_forward": any(e.land_during_forward for e in built),
        # forward+backward less the forward's wait for an exact update
        "cpu_adam_forward_backward_s": forward_backward_s,
        # ... and without offload: what the hidden fraction used
        "cpu_adam_forward_backward_without_s": without,
        "cpu_adam_launch_slowdown": slowdown,
        "cpu_adam_launch_slowdown_measured": measured,  # else the planner's figure
    }


def launch_slowdown(
    forward_backward_s: float | None, busy_s: float, delayed: bool, planner
) -> tuple[float | None, float | None, bool]:
    """(seconds of forward+backward lost per second of CPU Adam beside it, forward+backward
    without offload, whether the first was measured) for a run whose forward+backward was
    ``forward_backward_s`` and CPU Adam ``busy_s``: measured where the planner knows
    forward+backward without offload and the run is delayed (its CPU Adam runs beside
    forward+backward), else the planner's figure."""
    if not forward_backward_s:
        return None, None, False
    without = planner.forward_backward_s if planner else None
    beside = min(busy_s, forward_backward_s) if delayed else 0.0
    if without and beside:
        return max(forward_backward_s - without, 0.0) / beside, without, True
    slowdown = planner.cpu_adam_launch_slowdown if planner else 0.0
    return slowdown, without or max(forward_backward_s - slowdown * beside, 0.0), False


def report_hidden_fraction(found: dict, planner) -> None:
    """The log's last word on the CPU-Adam engine: what delayed mode hides (``planner``: the
    run's PlannerConfig, whose link and overhead the fraction used)."""
    fraction = found.get("cpu_adam_hidden_fraction")
    without = found.get("cpu_adam_forward_backward_without_s")
    if fraction is None or not without:
        return
    slowdown = found.get("cpu_adam_launch_slowdown") or 0.0
    measured = found.get("cpu_adam_launch_slowdown_measured")
    log.info(
        "cpu_adam: %.2fB params at %.2f G/s take %.2f s on the CPU, forward+backward %.2f s "
        "without offload; the training thread loses %.2f s per second of CPU Adam beside "
        "it (%s): delayed mode hides the CPU update, with that slowdown and its copies "
        "(beyond the last backward where they run during it) within %.0f%% of "
        "forward+backward (planner.delayed_max_overhead), up to "
        "optimizer.optimizer_offload_fraction=%.2f (planner.forward_backward_s=%.2f "
        "planner.cpu_adam_launch_slowdown=%.2f let --plan and offload/optimizer=auto use "
        "this)",
        found["cpu_offloaded_params"] / 1e9,
        found["cpu_adam_params_per_s"] / 1e9,
        found["cpu_adam_busy_s_median"],
        without,
        slowdown,
        "measured against planner.forward_backward_s"
        if measured
        else "planner.cpu_adam_launch_slowdown; give planner.forward_backward_s from a run "
        "without offload to measure it",
        100 * planner.delayed_max_overhead,
        fraction,
        without,
        slowdown,
    )
