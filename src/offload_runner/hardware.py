"""What the planner and the offload engines both need to know of the hardware: the bytes each
engine keeps per parameter, the rates CPU Adam and the host link reach (measured, with the suite
that measured them), and which host cores a rank's CPU Adam runs on. No engine and no planner
code here: both import this module, it imports neither.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import cache

from offload_runner.config.schema import (
    WINDOW_PIECES,
    RunConfig,
    states_window_mb,
)

# --- bytes per parameter ------------------------------------------------------------------------

ADAM_BYTES = 12  # fp32 master + exp_avg + exp_avg_sq
HDO_PINNED_BYTES = 6  # HybridDeviceOptimizer's pinned fp32 grad + bf16 param copies per param
CPU_ADAM_PINNED_BYTES = 8  # the CPU-Adam engine's pinned fp32 master + grad staging per param
CPU_ADAM_PREDICTION_BYTES = 4  # ... and, predicting weights in delayed mode, the landed guess
CPU_ADAM_PAGEABLE_BYTES = 8  # ... and its pageable exp_avg + exp_avg_sq (pinned where the
# exact mode's GPU share streams them: OffloadMode.streams)
WINDOW_SLOTS = WINDOW_PIECES  # pieces in a state window
# weight offload's update: params per piece (18 B each on the GPU: fp32 gradient, master and two
# moments up, the bf16 rounding), and pieces holding GPU memory at once (coming up, in Adam,
# going down)
# model.chunked_loss (mcore/chunked_loss.py): one chunk's fp32 logits; at its peak, backward
# holds them, their softmax and the output weight's fp32 gradient
LOSS_CHUNK_BYTES = 1 << 30
WEIGHT_OFFLOAD_PIECE = 1 << 24
WEIGHT_OFFLOAD_IN_FLIGHT = 3


# weight offload's gradient slots by the DDP gradient dtype's bytes: one fp32 slot of the widest
# module (a module's backward waits for the last one's gradients to have gone down), or two bf16
# ones as the weight slots
WEIGHT_GRAD_SLOTS = {4: 1, 2: 2}


# The CPU-Adam engine's piece (fp32 gradient bytes that go down, are updated and come back as
# one): 64 MiB; 256 MiB pieces were no faster (delayed mode on the proxy, 1.205 against 1.178 s
# a step: suite cpu-adam-4-pieces). A part too small for 16 of them takes smaller ones, so its
# copies, its CPU Adam and its GPU share still overlap.
CPU_ADAM_PIECE_MB = 64
CPU_ADAM_MIN_PIECES = 16


def cpu_adam_piece_bytes(params: float) -> int:
    """Bytes of one CPU-Adam piece for an optimizer part with ``params`` on the host: 64 MiB, or
    the largest power-of-two MiB (at least 1) that still cuts the part into 16 pieces."""
    mib = params * 4 / CPU_ADAM_MIN_PIECES / 1024**2
    return 1024**2 * min(CPU_ADAM_PIECE_MB, 1 << max(0, math.floor(math.log2(max(mib, 1.0)))))


def weight_ring_sizes(layers: list[list[int]], grad_bytes: int) -> tuple[int, int]:
    """Elements of weight offload's GPU ring (offload/weight.py): its weight array and its
    gradient array, for layers of streamed modules of these sizes. The two weight slots grow
    from either end of one array as wide as a layer's two widest modules, so any two modules of
    a layer fit side by side; fp32 gradients take one slot of the widest, bf16 ones two slots
    as the weights do."""
    pair = max(sum(sorted(sizes, reverse=True)[:2]) for sizes in layers)
    widest = max(max(sizes) for sizes in layers)
    return pair, widest if WEIGHT_GRAD_SLOTS[grad_bytes] == 1 else pair


# 8-bit moments: what quantizing one piece allocates beside it on the GPU, per element (the
# scaled input, the int64 codes, the dequantized map values): fitted to the convergence suite's
# 8bit row, whose peak stood 0.57 GB above the plan without it. That row ran torchao's binary
# search, whose int64 temporaries bucketize (quantized.quantize) no longer makes: an upper bound
# until a GPU run measures it again.
Q8_WORKSPACE_BYTES = 51


def quantize_workspace_bytes(run: RunConfig, offloaded: float) -> int:
    """GPU bytes 8-bit moments' quantization takes during the step: Q8_WORKSPACE_BYTES for each
    element of a window piece (at most the ``offloaded`` params)."""
    if not (run.mode.states and run.precision.q8):
        return 0
    piece = states_window_mb(run) * 1024**2 / (WINDOW_SLOTS * run.precision.window_bytes_per_param)
    return int(Q8_WORKSPACE_BYTES * min(piece, offloaded))


# --- rates --------------------------------------------------------------------------------------

# HybridDeviceOptimizer 100% + overlap spent 2657 ms in its optimizer phase where the CPU-Adam
# engine's Adam took 727 ms for the same 3.11B params (docs/BENCHMARKS.md, suite cpu-adam, GBS 1).
HDO_RATE_SHARE = 0.27


# The GPUs of one node share its host memory's bandwidth: while every rank copies at once, the
# node moves this many single links' worth each way (planner.host_link_gb_per_s one GPU's link).
# State offload's pass streamed 40.0 and 37.1-37.5 GB/s per rank on two H200 (suites
# two-gpu-full-2, two-gpu-engines) where one alone streamed 49.3 (capacity-auto-31): 78 GB/s
# over the 50.8 of one link. Four H200 of another host streamed 23.6 per rank (full-4gpu-2).
NODE_HOST_LINKS = 78.0 / 50.8


def rank_link_gb_per_s(gpu_link_gb_per_s: float, ranks_per_node: int) -> float:
    """One rank's host link each way while every rank of its node copies at once."""
    return gpu_link_gb_per_s * min(1.0, NODE_HOST_LINKS / max(1, ranks_per_node))


CPU_ADAM_COPY_BYTES = 4  # fp32 gradients down and fp32 masters up, per offloaded param, each way
# The engine's CPU Adam while the link streams states both ways, over fused CPU AdamW alone at the
# same threads, and the link's rate beside it over its rate alone: the two share the host's memory
# bandwidth, and the engine upcasts bf16 gradients block by block. Medians of nine exact runs with a
# GPU share on H100 and H200 hosts (docs/benchmarks/step-model.md: 0.58 and 44.5 of 50.8 GB/s);
# fused AdamW alone beside a probe's streams kept 0.73 (docs/evidence/cpu-gpu-split-probe.txt).
CPU_ADAM_RATE_BESIDE_STREAMS = 0.58
LINK_BESIDE_CPU_ADAM = 0.88
# ... and with bf16 moments the CPU rate over the fp32 moments': host_kernel's one pass ran at
# 1.38x fused AdamW's on fp32 moments on an H200 host (docs/evidence/bf16-moments-kernel-h200.txt)
# and 1.02x on the 2-core CI machine; priced at par (the blocks it replaced ran at 0.38 inside
# the engine: suite bf16-moments)
BF16_MOMENTS_CPU_FACTOR = 1.0


# Delayed mode's late passes bring each piece's fp32 gradients up with its states (they went
# down during the backward), and every piece's landing (its masters up, 4 B/param) rides the same
# link under the same forward+backward. Bytes per param each way, the busier way: (W) for the
# GPU's share, (C) for the CPU's, (E) for every offloaded param.
LATE_BYTES = ADAM_BYTES + 4
EXACT = (ADAM_BYTES, CPU_ADAM_COPY_BYTES, 0)
LATE = (LATE_BYTES, 0, CPU_ADAM_COPY_BYTES)

# A copy and an extrapolation per param beside fused AdamW: the CPU step's time with weight
# prediction over its time without (`python bench/probes/delayed_update_toy.py --cost`, in
# docs/evidence/delayed-update-toy.txt).
WEIGHT_PREDICTION_CPU_FACTOR = 1.84


@cache
def measured_rate(threads: int) -> float:
    """fused_adamw_rate on a shard past the caches (1 GiB of states), once per process: the
    planner's CPU Adam rate where planner.cpu_adam_params_per_s is unset. A 16M-param shard
    stayed in the caches and read 9.39 G/s on an H200 host where the engine ran at 2.68 beside
    its streams (suite llama3-8b-auto; 512M params: 4.3-4.8 G/s there)."""
    return fused_adamw_rate(threads, numel=64 * 1024**2, repeats=3)


# fused AdamW at 16 threads on the GPU machines' hosts (2026-11: 4.05 G/s on one H100 host,
# docs/evidence; 5.6-6.1 on H200 hosts): the planner's rate where a run must not depend on a
# timing (model.deterministic_mode) and planner.cpu_adam_params_per_s is unset
REFERENCE_CPU_ADAM_PARAMS_PER_S = 4.0e9


# --- the GPU's forward+backward (gpu_time.py) ----------------------------------------------------


@dataclass(frozen=True)
class GpuRates:
    """One GPU's forward+backward: the matrix work's FLOP/s, and a layer's fixed seconds per
    micro-batch (``dense_layer_s``, plus ``expert_s`` for each local expert of a MoE layer)."""

    flops: float
    dense_layer_s: float
    expert_s: float


# Fitted on the Qwen3-30B-A3B proxy (4 MoE layers of 128 experts, GBS 16) at micro-batch 1 and 4,
# each kernel set, on one H200 (suite throughput-16, three interleaved calls:
# `python bench/throughput.py fit bench/results/results-throughput-16-r[1-3].json`; later
# calls test them). The fused kernels raise the matrix work's rate (272 -> 416 TFLOP/s), not
# the fixed time (0.029 s a layer per micro-batch), which is the launching host's and moves
# with it from call to call. The dense layer's fixed time is not separable on that model: about
# a hundred launches of ~10 us each (an estimate).
GPU_RATES = {
    "plain": GpuRates(flops=271e12, dense_layer_s=1e-3, expert_s=2.25e-4),
    "fused": GpuRates(flops=416e12, dense_layer_s=1e-3, expert_s=2.29e-4),
}
# Adam on the GPU per param of a rank's shard where no offload takes it off the GPU (the same
# suite's no-offload rows: the optimizer phase's median over their params).
GPU_ADAM_S_PER_PARAM = 2.56e-11


def te_available() -> bool:
    """Whether Transformer Engine is installed here (found, not imported: that takes seconds)."""
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


# --- host cores ---------------------------------------------------------------------------------

RESERVED_CORES_DELAYED = 2  # the training thread and data loading, while the worker runs


def rank_cpus(local_rank: int, local_world: int) -> list[int]:
    """This rank's share of the cores it may run on: the cores of its GPU's NUMA node where the
    machine has several (split among the ranks on that node), else an equal slice of all."""
    cpus = sorted(os.sched_getaffinity(0))
    nodes = _numa_nodes()
    if len(nodes) > 1:
        node = _gpu_numa_node(local_rank)
        if node in nodes:
            peers = [r for r in range(local_world) if _gpu_numa_node(r) == node] or [local_rank]
            cpus = [c for c in nodes[node] if c in set(cpus)] or cpus
            return _slice(cpus, peers.index(local_rank) if local_rank in peers else 0, len(peers))
    return _slice(cpus, local_rank, local_world)


def _slice(cpus: list[int], index: int, parts: int) -> list[int]:
    share = max(1, len(cpus) // max(parts, 1))
    return cpus[index * share : (index + 1) * share] or cpus


def _numa_nodes() -> dict[int, list[int]]:
    from pathlib import Path

    nodes = {}
    for path in Path("/sys/devices/system/node").glob("node[0-9]*"):
        try:
            nodes[int(path.name[4:])] = _parse_cpulist((path / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    return nodes


def _parse_cpulist(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


def _gpu_numa_node(local_rank: int) -> int | None:
    try:
        import torch

        bus = torch.cuda.get_device_properties(local_rank).pci_bus_id.lower()
        with open(f"/sys/bus/pci/devices/{bus}/numa_node") as f:
            return int(f.read())
    except Exception:  # noqa: BLE001 - no CUDA, no sysfs entry: no NUMA preference
        return None


def worker_cpus(run: RunConfig, cpus: list[int]) -> list[int]:
    """The cores the CPU-Adam team runs on. Exact mode: all of the rank's (the training thread
    waits for the update). Delayed mode: the team runs during forward and backward, whose kernel
    launches come from one Python thread (on the MoE proxy the GPU waits for them over half of
    forward+backward), so whole physical cores (every SMT sibling) are kept out of the team for
    that thread and data loading: at least RESERVED_CORES_DELAYED logical CPUs."""
    if not run.optimizer.cpu_adam_delayed_update or len(cpus) <= RESERVED_CORES_DELAYED:
        return cpus
    reserved: set[int] = set()
    for cpu in cpus:
        if len(reserved) >= RESERVED_CORES_DELAYED:
            break
        reserved |= _thread_siblings(cpu) & set(cpus) | {cpu}
    return [c for c in cpus if c not in reserved] or cpus


def _thread_siblings(cpu: int) -> set[int]:
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            return set(_parse_cpulist(f.read()))
    except (OSError, ValueError):
        return {cpu}


def fused_adamw_rate(threads: int, numel: int = 512 * 1024**2, repeats: int = 5) -> float:
    """torch.optim.AdamW(fused=True) alone on the CPU: params/s at ``threads`` threads (median of
    ``repeats`` steps on ``numel`` fp32 params, far past the caches). The bench's reference for
    the engine's rate, and the planner's when planner.cpu_adam_params_per_s is unset."""
    import statistics
    import time

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        param = torch.nn.Parameter(torch.randn(numel) * 0.02)
        param.grad = torch.randn(numel) * 1e-3
        opt = torch.optim.AdamW([param], lr=1e-4, weight_decay=0.1, fused=True)
        times = []
        for i in range(repeats + 2):
            began = time.perf_counter()
            opt.step()
            if i >= 2:
                times.append(time.perf_counter() - began)
        return numel / statistics.median(times)
    finally:
        torch.set_num_threads(before)
