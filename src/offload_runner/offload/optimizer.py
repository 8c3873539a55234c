"""Optimizer CPU offload: Megatron-Core's HybridDeviceOptimizer.

``get_megatron_optimizer`` builds it when ``optimizer_cpu_offload=True``: the parameters of the
first ``optimizer_offload_fraction`` of the distributed-optimizer shard keep their fp32 master
weights and Adam states on the CPU, where torch's fused AdamW updates them; the rest stays on the
GPU (Transformer Engine FusedAdam). ``overlap_cpu_optimizer_d2h_h2d`` overlaps the gradient D2H and
parameter H2D copies with the CPU step.
"""

from __future__ import annotations

from offload_runner.config.schema import RunConfig
from offload_runner.model_size import count_parameters
from offload_runner.offload import OffloadSummary

DISABLED = {
    "optimizer.optimizer_cpu_offload": False,
    "optimizer.optimizer_offload_fraction": 0.0,
    "optimizer.overlap_cpu_optimizer_d2h_h2d": False,
}


def describe(run: RunConfig) -> OffloadSummary:
    o = run.optimizer
    enabled = o.optimizer_cpu_offload and o.optimizer_offload_fraction > 0
    if not enabled:
        return OffloadSummary("optimizer (hybrid)", "offload/optimizer=cpu_*", False, "-")
    params = count_parameters(run.model).total * o.optimizer_offload_fraction
    return OffloadSummary(
        "optimizer (hybrid)",
        "offload/optimizer=cpu_*",
        True,
        f"{o.optimizer_offload_fraction:.0%} of the Adam step: fp32 master + exp_avg + exp_avg_sq "
        f"of ~{params / 1e9:.2f}B params (model total, before DP sharding), updated on the CPU",
        "D2H/H2D overlapped with the CPU step" if o.overlap_cpu_optimizer_d2h_h2d else "no overlap",
    )
