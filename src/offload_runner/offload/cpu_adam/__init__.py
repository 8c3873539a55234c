"""CPU-Adam optimizer offload (``offload/optimizer=cpu_adam``, ``cpu_adam_delayed``): the engine
for ``optimizer_offload_fraction`` of Adam, the inner optimizer of each Megatron-Core
DistributedOptimizer (which keeps the reduce-scatter, norm, clipping and all-gather, and
checkpoints it in HybridDeviceOptimizer's layout).

What lives where, per rank: the GPU keeps the bf16 parameters and the gradient buffer; the host
keeps the offloaded part's fp32 masters and a gradient staging array (page-locked) and its Adam
moments (pageable, page-locked where the GPU share streams them).

One exact step, in pieces (``hardware.cpu_adam_piece_bytes``):
1. a piece's gradients go down on a side stream;
2. the worker thread runs fused CPU AdamW on it as soon as they land;
3. its masters go up and are rounded into its bf16 parameters, during the next forward (a
   pre-hook waits for the pieces each module needs) or within the step under data parallelism;
4. the GPU share's pieces meanwhile run Adam on the GPU over states streamed through a window.
Delayed mode hands the update over and lands it at the next step. How and why, with the
measurements: docs/ARCHITECTURE.md ("The CPU-Adam engine").

Modules: ``engine`` (CpuAdam and its step), ``modes`` (Exact, Delayed), ``landing`` (the link and
landing during the forward), ``gpu_share``, ``delayed``, ``columns`` (delayed mode's exact
columns), ``cores`` (the worker and its cores),
``update`` (one update's record), ``shard`` (all the link, the GPU share and delayed mode read
of the engine: host arrays, pieces, history), ``wiring`` (into Megatron-Core's optimizer),
``report``.
"""

from offload_runner.offload.cpu_adam.cores import (
    cpu_ranges,
    cpu_worker,
    runtime_environment,
)
from offload_runner.offload.cpu_adam.delayed import (
    GUESS_BLOCK,
    LAST_LR,
    before_clip,
    grads_clipped,
)
from offload_runner.offload.cpu_adam.engine import HOST_BYTES_PER_PARAM, CpuAdam, CpuSettings
from offload_runner.offload.cpu_adam.gpu_share import BALANCE_STEPS, GPU_SHARE, balanced_share
from offload_runner.offload.cpu_adam.modes import (
    Delayed,
    Exact,
    delayed_dense_warning,
    exact_steps,
    mode_name,
    mode_of,
)
from offload_runner.offload.cpu_adam.report import (
    launch_slowdown,
    metrics,
    report_hidden_fraction,
)
from offload_runner.offload.cpu_adam.wiring import DISABLED, attach, describe, engines
from offload_runner.plan import part_delays, part_fractions

__all__ = [
    "BALANCE_STEPS",
    "DISABLED",
    "GPU_SHARE",
    "GUESS_BLOCK",
    "HOST_BYTES_PER_PARAM",
    "LAST_LR",
    "CpuAdam",
    "CpuSettings",
    "Delayed",
    "Exact",
    "attach",
    "balanced_share",
    "before_clip",
    "cpu_ranges",
    "cpu_worker",
    "delayed_dense_warning",
    "describe",
    "engines",
    "exact_steps",
    "grads_clipped",
    "launch_slowdown",
    "metrics",
    "mode_name",
    "mode_of",
    "part_delays",
    "part_fractions",
    "report_hidden_fraction",
    "runtime_environment",
]
