"""Optimizer-state offload: Adam on the GPU, its states and fp32 master weights wait on the CPU.

Not in any megatron-core release. Between steps exp_avg, exp_avg_sq and the fp32 master weights
of the distributed-optimizer shard live in pinned host buffers; they return to the GPU before the
next step, overlapped with the end of backward.
"""

from __future__ import annotations

from offload_runner.config.schema import RunConfig
from offload_runner.model_size import count_parameters
from offload_runner.offload import OffloadSummary


def describe(run: RunConfig) -> OffloadSummary:
    enabled = run.optimizer.offload_optimizer_states
    if not enabled:
        return OffloadSummary("optimizer states", "offload/optimizer=states", False, "-")
    params = count_parameters(run.model).total
    return OffloadSummary(
        "optimizer states",
        "offload/optimizer=states",
        True,
        f"fp32 master + exp_avg + exp_avg_sq (12 B/param, ~{params * 12 / 1e9:.1f} GB for the "
        "whole model before DP sharding) between steps; Adam runs on the GPU",
    )
