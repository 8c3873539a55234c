"""Optimizer CPU offload: Megatron-Core's HybridDeviceOptimizer.

``get_megatron_optimizer`` builds it when ``optimizer_cpu_offload=True``: the parameters of the
first ``optimizer_offload_fraction`` of the distributed-optimizer shard keep their fp32 master
weights and Adam states on the CPU, where torch's fused AdamW updates them; the rest stays on the
GPU (Transformer Engine FusedAdam). ``overlap_cpu_optimizer_d2h_h2d`` overlaps the gradient D2H and
parameter H2D copies with the CPU step.
"""

from __future__ import annotations

from offload_runner.config.schema import CpuOffloadEngine, RunConfig
from offload_runner.model_size import count_parameters
from offload_runner.offload.base import OffloadSummary, optimizer_parts

DISABLED = {
    "optimizer.optimizer_cpu_offload": False,
    "optimizer.optimizer_offload_fraction": 0.0,
    "optimizer.overlap_cpu_optimizer_d2h_h2d": False,
}


def describe(run: RunConfig) -> OffloadSummary:
    o = run.optimizer
    enabled = (
        o.optimizer_cpu_offload
        and o.optimizer_offload_fraction > 0
        and o.cpu_offload_engine == CpuOffloadEngine.hybrid
    )
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


def hybrid_optimizers(optimizer) -> list:
    """The HybridDeviceOptimizers inside what ``get_megatron_optimizer`` returned (one per part of
    a ChainedOptimizer, e.g. dense and expert parameters); not offload-runner's engines (host_adam),
    which are ones by type only."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    from offload_runner.offload.host_adam import HostAdam

    inner = [getattr(part, "optimizer", None) for part in optimizer_parts(optimizer)]
    return [
        hdo
        for hdo in inner
        if isinstance(hdo, HybridDeviceOptimizer) and not isinstance(hdo, HostAdam)
    ]


def restore_after_load(optimizer) -> None:
    """Hand a loaded checkpoint to HybridDeviceOptimizer's sub-optimizers (Megatron-LM #1842).

    After Megatron-Core's ``dp_reshardable`` load (the layout checkpoint.py saves), three things
    are stale in HybridDeviceOptimizer, each enough to bend the resumed run from its second step:

    - the loaded fp32 masters and Adam states sit in ``HybridDeviceOptimizer.state`` only: its
      other loaders then call ``_sync_hdo_state_to_sub_optimizers``, this one does not, so the
      CPU and GPU Adam would keep stepping their pre-load fp32 copies;
    - the CPU AdamW's per-parameter ``step`` is checkpointed as a local, non-persistent object,
      so it comes back as the value of the throw-away step the loader ran to create the states
      (1), not the saved step: the bias correction restarts;
    - the loaded param groups carry the saved ``step``, which HybridDeviceOptimizer copies into
      the GPU FusedAdam's groups before every step, freezing its bias correction there.

    So: sync the sub-optimizers, give every CPU state the saved step, and leave the GPU counter to
    FusedAdam (which was built from the loaded groups, so it continues from the saved step)."""
    import torch

    for hdo in hybrid_optimizers(optimizer):
        saved_steps = {group.pop("step") for group in hdo.param_groups if "step" in group}
        hdo._sync_hdo_state_to_sub_optimizers()
        if len(saved_steps) != 1:
            continue
        step = float(saved_steps.pop())
        for state in hdo.state.values():
            old = state.get("step")
            if isinstance(old, torch.Tensor):  # one tensor each: fused AdamW adds to it in place
                state["step"] = torch.tensor(step, dtype=old.dtype, device=old.device)
