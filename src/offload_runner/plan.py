"""The memory planner: GPU and host memory per rank before the job starts, and the least offload
that fits (``offload/optimizer=auto``, ``offload/activation=auto``). Pure arithmetic, no GPU.

Per rank (its pipeline stage, its share of TP/EP and its distributed-optimizer shard):

- bf16 weights (2 B/param) and the DDP gradient buffer (4 B/param with grad_reduce_in_fp32);
- fp32 master weights + Adam exp_avg + exp_avg_sq (12 B per parameter of the optimizer shard:
  dense parameters sharded over DP x CP, experts over the expert-data-parallel group);
  HybridDeviceOptimizer keeps (1 - fraction) of them on the GPU; state offload keeps none of
  them on the GPU during forward and backward, all of them during the step;
- activations per layer and micro-batch (the bf16 tensors each op saves for backward with flash
  attention, counted in ``layer_activations``; routed MoE tokens counted top-k times; TP splits
  them, and the norms' share only with sequence parallelism) x the micro-batches in flight (1F1B:
  PP - stage), minus what layer-level activation offload takes; full recompute keeps each
  checkpointed group's input and rebuilds one group in backward, selective recompute of core
  attention keeps as much as none (flash attention stores no score matrix); plus the larger of
  the output layer's logits and loss and the rebuilt group;
- a fixed allowance for workspaces (cuBLAS, NCCL, allocator rounding).

The GPU peak is the larger of the forward/backward phase and the optimizer-step phase (the
optimizer-state offload moves memory from one to the other). Host memory per rank: HDO's CPU
Adam (12 B/param) and pinned transfer buffers, the state-offload arena (12 B/param), activation
offload's pinned buffers; summed per node. The tensor counts were read from four runs of the
calibration spread (bench/calibrate_planner.py FITTED_ON) and hold within 10% on the rest
(tests/test_plan.py); ``bench/calibrate_planner.py`` prints the error for each run.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, replace

from offload_runner.config.schema import (
    CpuOffloadEngine,
    OptimizerDtype,
    RunConfig,
    cpu_adam_copies_during_backward,
    cpu_adam_delayed,
    cpu_adam_delays_dense,
    cpu_adam_late_share,
    cpu_adam_on,
    cpu_adam_streams,
    states_offloaded,
    states_window_mb,
    weights_offloaded,
)
from offload_runner.hardware import (
    ADAM_BYTES,
    CPU_ADAM_COPY_BYTES,
    CPU_ADAM_PINNED_BYTES,
    CPU_ADAM_PREDICTION_BYTES,
    CPU_ADAM_RATE_BESIDE_STREAMS,
    DTYPE_BYTES,
    EXACT,
    HDO_PINNED_BYTES,
    HDO_RATE_SHARE,
    LATE,
    LATE_BYTES,
    REFERENCE_CPU_ADAM_PARAMS_PER_S,
    WEIGHT_PREDICTION_CPU_FACTOR,
    WINDOW_SLOTS,
    host_state_bytes,
    measured_rate,
    moment_bytes,
    rank_cpus,
    window_bytes_per_param,
    worker_cpus,
)
from offload_runner.model_size import count_parameters, kv_channels, padded_vocab_size

GiB = 1024**3
# Megatron-Core's precision-aware optimizer keeps, by default (store_param_remainders), only the
# 16 bits of each fp32 master that its bf16 parameter lacks: 2 B instead of 4 (measured on the
# proxy: 52.50 against 58.30 GiB, 3.11B params x 2 B; docs/evidence/precision-aware-peak.json).
PARAM_REMAINDER_BYTES = 2
# A rank's process beside what it pins or allocates for offload: the node's RAM in use at the
# peak over the planned host bytes, in suites capacity-28 (one H200), profile-8 and cost-32 (one
# H100): 5.7-6.0 GB with the OS's ~2 GB before the run; the planner's margin_gb keeps the OS's.
HOST_PROCESS_BYTES = int(3.7 * GiB)
WORKSPACE_BYTES = int(0.1 * GiB)  # cuBLAS/TE workspaces, allocator slack (fitted: tiny recipe)
# Part of an offloaded layer's saved tensors that TE's offload context actually moves (fitted on
# the MoE proxy: 2 offloaded layers saved 0.61 GiB of 1.12 GiB).
ACTIVATION_OFFLOAD_EFFICIENCY = 0.55
ASSUMED_GPU_GB = 80.0  # when no GPU is visible and planner.gpu_memory_gb is unset


@dataclass(frozen=True)
class Layout:
    """How many ways each parallel dimension splits the model, for ``world`` ranks."""

    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int  # data-parallel size of dense parameters (their optimizer shards over DP x CP)
    edp: int  # expert-data-parallel size (experts' optimizer shard)
    world: int

    @classmethod
    def of(cls, run: RunConfig, world: int | None = None) -> Layout:
        m = run.model
        tp, pp, cp = (
            m.tensor_model_parallel_size,
            m.pipeline_model_parallel_size,
            m.context_parallel_size,
        )
        ep, etp = m.expert_model_parallel_size, m.expert_tensor_parallel
        world = world or minimal_world_size(run)
        return cls(tp, pp, cp, ep, etp, dp=world // m.model_parallel_size,
                   edp=world // m.expert_layout_size, world=world)  # fmt: skip


def minimal_world_size(run: RunConfig) -> int:
    """The fewest ranks the parallel layout needs (data-parallel size 1)."""
    return math.lcm(run.model.model_parallel_size, run.model.expert_layout_size)


@dataclass(frozen=True)
class StageParams:
    """Parameters held by one rank of a pipeline stage."""

    dense: int  # everything but routed experts (split over TP)
    experts: int  # routed experts (split over EP x ETP)


def stage_params(run: RunConfig, layout: Layout, stage: int) -> StageParams:
    m = run.model
    counts = count_parameters(m)
    layers = m.num_layers // layout.pp
    per_layer_dense = (
        counts.attention + counts.dense_mlp + counts.router + counts.norms
    ) / m.num_layers
    dense = layers * per_layer_dense / layout.tp
    embedding = padded_vocab_size(m) * m.hidden_size / layout.tp
    first, last = stage == 0, stage == layout.pp - 1
    if first:
        dense += embedding
    if last and (not m.share_embeddings_and_output_weights or layout.pp > 1):
        dense += embedding  # untied output layer, or the tied copy on the last stage
    experts = layers * (counts.experts / m.num_layers) / (layout.ep * layout.etp)
    return StageParams(int(dense), int(experts))


@dataclass(frozen=True)
class LayerActivations:
    """Bytes per token one transformer layer keeps for backward (bf16, flash attention):
    ``split`` is divided over TP ranks; ``replicated`` (norm inputs and outputs) only with
    sequence parallelism."""

    split: float
    replicated: float

    def per_rank(self, tp: int, sequence_parallel: bool) -> float:
        return self.split / tp + self.replicated / (tp if sequence_parallel else 1)


def layer_activations(run: RunConfig) -> LayerActivations:
    """What one layer saves per token, tensor by tensor (Transformer Engine spec, bf16).

    Attention: the fused QKV output (V stays a view of it), rotary-embedded copies of Q and K,
    the attention output (the projection's input); QK layernorm adds its outputs. The MLP: fc1's
    output (its GLU halves are views), the activation's output, fc2's input; an unfused GLU
    (Megatron-Core's default, bias_activation_fusion off) also keeps silu(x) for the product's
    backward: +2f. MoE: the router's probabilities and, per routed copy, the permuted input and
    the expert MLP (grouped GEMM, fused activation). Norms: input and output, 4h each."""
    m = run.model
    h, kv = m.hidden_size, kv_channels(m)
    q_width = m.num_attention_heads * kv
    kv_width = (m.num_query_groups or m.num_attention_heads) * kv
    up = 2 if m.gated_linear_unit else 1
    attention = 2 * (q_width + 2 * kv_width) + 2 * q_width
    if m.position_embedding_type.value == "rope":
        attention += 2 * (q_width + kv_width)
    if m.qk_layernorm:
        attention += 2 * (q_width + kv_width)
    norms = 4 * h + 4 * h
    if m.num_moe_experts:
        f = m.moe_ffn_hidden_size or m.ffn_hidden_size
        per_copy = 4 * h + 2 * up * f + 2 * f  # permuted input, fc1 out, activation, unpermute
        mlp = 8 * m.num_moe_experts + m.moe_router_topk * per_copy
    else:
        f = m.ffn_hidden_size
        mlp = 2 * up * f + 2 * f + (2 * f if m.gated_linear_unit else 0)
    return LayerActivations(split=attention + mlp, replicated=norms)


# Once per model and token, outside the layers: the embedding's output, the final norm's input
# and output, the output layer's input (bf16, hidden-sized each).
MODEL_ACTIVATION_HIDDEN_COPIES = 4


def recompute_stored_and_rebuilt(run: RunConfig, layers: int, per_layer: float,
                                 layer_input: float) -> tuple[float, float]:  # fmt: skip
    """Full recompute: what a stage keeps per micro-batch in flight (checkpointed layers keep
    only their input), and what backward rebuilds at once (one checkpointed group). Selective
    recompute of core attention saves nothing with flash attention, which keeps no score matrix;
    no recompute keeps every layer."""
    m = run.model
    if m.recompute_granularity is None or m.recompute_granularity.value != "full":
        return layers * per_layer, 0.0
    n = max(1, m.recompute_num_layers or 1)
    if m.recompute_method is not None and m.recompute_method.value == "block":
        checkpointed = min(n, layers)  # the first n layers, one at a time
        return checkpointed * layer_input + (layers - checkpointed) * per_layer, per_layer
    groups = math.ceil(layers / n)  # uniform: every group of n layers keeps its input
    return groups * layer_input, min(n, layers) * per_layer


@dataclass
class RankPlan:
    """Memory of one rank, in bytes."""

    rank: int
    node: int
    stage: int
    weights: int
    grads: int
    optimizer_gpu: int  # masters + Adam states resident on the GPU between steps
    optimizer_step_only: int  # ... brought back only for the step (state offload)
    activations: int  # micro-batches in flight x layers, after activation offload
    activations_offloaded: int
    logits: int
    workspace: int
    host_pinned: int
    host_pageable: int
    host_process: int = 0  # the rank's own process: Python, torch, CUDA context, data
    cpu_adam_params: int = 0  # params this rank updates on the CPU each step
    delayed_params: int = 0  # ... one step late (delayed mode: all, or the routed experts')
    boundary_params: int = 0  # ... whose copies wait for the step boundary (delayed mode)
    states_moved: int = 0  # bytes of optimizer state copied out and back each step (states)
    recomputed: int = 0  # one checkpointed group rebuilt in backward (full recompute)
    weight_offload_params: int = 0  # params whose weights live on the host (offload/weight)

    @property
    def static(self) -> int:
        return self.weights + self.grads + self.optimizer_gpu + self.workspace

    @property
    def fwd_bwd_peak(self) -> int:
        # the logits live at the end of forward, a rebuilt group later in backward
        return self.static + self.activations + max(self.logits, self.recomputed)

    @property
    def step_peak(self) -> int:
        return self.static + self.optimizer_step_only

    @property
    def gpu_peak(self) -> int:
        return max(self.fwd_bwd_peak, self.step_peak)

    @property
    def host(self) -> int:
        return self.host_pinned + self.host_pageable + self.host_process

    def as_dict(self) -> dict:
        counts = ("rank", "node", "stage", "cpu_adam_params", "delayed_params", "boundary_params",
                  "states_moved")  # fmt: skip
        gb = {k: round(v / GiB, 3) for k, v in asdict(self).items() if k not in counts}
        return {
            "rank": self.rank, "node": self.node, "stage": self.stage,
            "gpu_peak_gb": round(self.gpu_peak / GiB, 3),
            "gpu_fwd_bwd_peak_gb": round(self.fwd_bwd_peak / GiB, 3),
            "gpu_step_peak_gb": round(self.step_peak / GiB, 3),
            "host_gb": round(self.host / GiB, 3),
            "breakdown_gb": gb,
        }  # fmt: skip


def adam_bytes_per_param(run: RunConfig) -> int:
    """Optimizer bytes per param of the shard: exp_avg + exp_avg_sq, and the master of a bf16
    model. On the GPU precision-aware path they take their configured dtypes, and an fp32 master
    is kept as its 16-bit remainder only."""
    o = run.optimizer
    if states_offloaded(run) or cpu_adam_on(run):  # offload-runner's host engines
        return host_state_bytes(run) if run.model.bf16 else moment_bytes(run)
    gpu_aware = o.use_precision_aware_optimizer and not o.optimizer_cpu_offload
    moments = moment_bytes(run) if gpu_aware else ADAM_BYTES - 4
    if not run.model.bf16:
        return moments
    if not gpu_aware:
        return moments + 4
    master = DTYPE_BYTES[o.main_params_dtype.value]
    remainders = master == 4 and getattr(o, "store_param_remainders", True) is not False
    return moments + (PARAM_REMAINDER_BYTES if remainders else master)


@dataclass(frozen=True)
class OptimizerMemory:
    """One rank's optimizer bytes, by where they live (``optimizer_memory``)."""

    shard: float  # params of the rank's optimizer shard
    adam: int  # the shard's masters and moments, wherever they live
    hdo: float  # the CPU optimizer's fraction (HybridDeviceOptimizer, CPU Adam)
    delayed: list  # per part, params updated one step late (CPU Adam's delayed mode)
    resident: int  # on the GPU between steps
    step_only: int  # ... and during the step only (state windows)
    pinned: int  # page-locked on the host
    on_cpu: int  # pageable on the host
    states: int  # on the host under state offload (and over the link each way, each step)


def optimizer_memory(run: RunConfig, parts: list[float]) -> OptimizerMemory:
    """Where the optimizer of a rank whose shard has ``parts`` params (dense, experts) keeps its
    bytes. Per offloaded param, HybridDeviceOptimizer keeps 12 B pageable (fp32 master + Adam)
    and pins 6 (fp32 grads, bf16 params); the CPU-Adam engine pins the master and the gradients'
    copy and keeps the moments pageable (pinned where a GPU share streams them); state offload
    pins master and moments, and the step holds its window."""
    o = run.optimizer
    shard = sum(parts)
    adam = int(shard * adam_bytes_per_param(run))
    hdo = o.optimizer_offload_fraction if o.optimizer_cpu_offload else 0.0
    on_cpu = int(adam * hdo)
    resident, step_only = adam - on_cpu, 0
    offloaded, delayed = offloaded_parts(run, parts, hdo)
    if o.cpu_offload_engine == CpuOffloadEngine.cpu_adam:
        staging = 4 if run.ddp.grad_reduce_in_fp32 else 2  # the gradients' host copy
        pinned = shard * hdo * (CPU_ADAM_PINNED_BYTES - 4 + staging)
        pinned += sum(delayed) * (CPU_ADAM_PREDICTION_BYTES if predicting_weights(run) else 0)
        on_cpu = int(shard * hdo * moment_bytes(run))
        resident += cpu_adam_ring_bytes(parts, hdo, o.cpu_adam_chunk_mb)
        if cpu_adam_late_share(run):  # every moment pinned; forward+backward hold the window
            pinned += sum(offloaded) * moment_bytes(run)
            on_cpu = 0
            resident += cpu_adam_window_bytes(offloaded, 1.0, o.cpu_adam_chunk_mb, LATE_BYTES)
        elif cpu_adam_streams(run):  # the exact parts' moments pinned; the step holds the window
            exact = [n - d for n, d in zip(offloaded, delayed, strict=True)]
            pinned += sum(exact) * moment_bytes(run)
            on_cpu = int(sum(delayed) * moment_bytes(run))
            step_only = cpu_adam_window_bytes(exact, 1.0, o.cpu_adam_chunk_mb)
    else:
        pinned = shard * hdo * HDO_PINNED_BYTES
    states = 0
    if states_offloaded(run):
        share = o.optimizer_state_offload_fraction
        states = int(shard * share * host_state_bytes(run))
        # the window: its MiB of fp32 arrays, and the bf16 moments' copies beside them
        window = states_window_mb(run) * 1024**2 * window_bytes_per_param(run) // ADAM_BYTES
        whole = int(shard * share * window_bytes_per_param(run))  # a window as large as it
        resident, step_only = adam - states, min(whole, window)
    return OptimizerMemory(shard, adam, hdo, delayed, resident, step_only, int(pinned), on_cpu,
                           states)  # fmt: skip


@dataclass(frozen=True)
class WeightOffloadMemory:
    """What offload/weight moves off one rank's GPU (offload/weight.py): the offloaded layers'
    params leave DDP's weight and gradient buffers and the optimizer; the GPU keeps a ring of
    two layers (bf16 weights + fp32 gradients) and, during the step, one update piece."""

    dense: float  # offloaded params, outside the routed experts
    experts: float
    ring: int  # GPU bytes, always
    step_only: int  # GPU bytes, during the step (the update piece)
    pinned: int  # host bytes: weights, gradients, masters, moments, staging

    @property
    def params(self) -> float:
        return self.dense + self.experts


WEIGHT_OFFLOAD_PIECE = 1 << 24  # params per update piece (offload/weight.UPDATE_PIECE)


def weight_offload_memory(run: RunConfig, layout: Layout) -> WeightOffloadMemory:
    m = run.model
    if not (weights_offloaded(run) and m.cpu_offloading_num_layers > 0):
        return WeightOffloadMemory(0.0, 0.0, 0, 0, 0)
    counts, n = count_parameters(m), min(m.cpu_offloading_num_layers, m.num_layers)
    dense = (counts.attention + counts.dense_mlp + counts.router + counts.norms) / m.num_layers
    experts = counts.experts / m.num_layers
    layer = dense + experts
    ring = int(layer * (2 * 2 + 4))  # two bf16 weight slots, 4 B of gradient slots
    step_only = int(3 * min(layer, WEIGHT_OFFLOAD_PIECE) * (4 * 4 + 2))  # 3 pieces in flight
    pinned = int(n * layer * (2 + 4 + 4 + moment_bytes(run)) + 2 * layer * 4)
    return WeightOffloadMemory(n * dense, n * experts, ring, step_only, pinned)


def weight_offload_link_bytes(run: RunConfig, params: float,
                              micro_batches: int) -> tuple[float, float]:  # fmt: skip
    """Bytes weight offload moves per step, (up, down): its bf16 weights up twice per
    micro-batch (forward, backward) and the gradients' slot down once, then at the step the
    gradients, masters and moments up and the masters, moments and rounded weights down."""
    grads = 4 if run.ddp.grad_reduce_in_fp32 or not run.model.bf16 else 2
    states = 4 + moment_bytes(run)
    up = params * (2 * 2 * micro_batches + 4 + states)
    down = params * (grads * micro_batches + states + 2)
    return up, down


def weight_offload_note(run: RunConfig, plan: Plan) -> str | None:
    """--plan's line on the link time weight offload adds (its bound: both directions at once)."""
    params = max(r.weight_offload_params for r in plan.ranks)
    if not params:
        return None
    t = run.train
    micro_batches = max(1, t.global_batch_size // t.micro_batch_size)
    up, down = weight_offload_link_bytes(run, params, micro_batches)
    rate = run.planner.host_link_gb_per_s * 1e9
    return (
        f"weight offload: {param_count(params)} params on the host move {up / 1e9:.1f} GB up "
        f"and {down / 1e9:.1f} GB down per step, at least +{max(up, down) / rate:.2f} s over "
        f"{run.planner.host_link_gb_per_s:.0f} GB/s where compute does not hide them"
    )


def plan_rank(run: RunConfig, layout: Layout, rank: int, gpus_per_node: int) -> RankPlan:
    m, o, t = run.model, run.optimizer, run.train
    stage = rank // (layout.world // layout.pp)
    params = stage_params(run, layout, stage)
    ring = weight_offload_memory(run, layout)  # its layers leave DDP's buffers and optimizer
    params = replace(params, dense=params.dense - ring.dense, experts=params.experts - ring.experts)
    total = params.dense + params.experts
    weights = total * (2 if m.bf16 else 4)
    grads = total * (4 if run.ddp.grad_reduce_in_fp32 or not m.bf16 else 2)
    if o.use_distributed_optimizer:  # one optimizer part for the dense shard, one for experts'
        parts = [params.dense / (layout.dp * layout.cp), params.experts / layout.edp]
    else:
        parts = [total]
    opt = optimizer_memory(run, parts)

    tokens = t.micro_batch_size * m.seq_length / layout.cp
    layers = m.num_layers // layout.pp
    micro_batches = max(1, t.global_batch_size // (t.micro_batch_size * layout.dp))
    in_flight = min(layout.pp - stage, micro_batches)
    per_layer = layer_activations(run).per_rank(layout.tp, m.sequence_parallel) * tokens
    hidden = 2 * m.hidden_size * tokens / (layout.tp if m.sequence_parallel else 1)
    stored, rebuilt = recompute_stored_and_rebuilt(run, layers, per_layer, hidden)
    offloaded_layers = (
        m.cpu_offloading_num_layers if m.cpu_offloading and m.cpu_offloading_activations else 0
    )
    offloaded = int(offloaded_layers * per_layer * ACTIVATION_OFFLOAD_EFFICIENCY)
    model_level = MODEL_ACTIVATION_HIDDEN_COPIES * hidden
    vpp = m.virtual_pipeline_model_parallel_size or 1
    if vpp > 1:  # interleaved 1F1B: stage s warms up 2(PP-s-1) + (VPP-1)PP chunks of L/(PP VPP)
        chunks = min(2 * (layout.pp - stage - 1) + (vpp - 1) * layout.pp + 1, micro_batches * vpp)
        activations = int(chunks * (stored + model_level) / vpp) - offloaded
    else:
        activations = int(in_flight * (stored + model_level)) - offloaded
    last = stage == layout.pp - 1
    copies_at_boundary = cpu_adam_delayed(run) and not cpu_adam_copies_during_backward(
        run, max(layout.dp, layout.edp)
    )
    logits = int(6 * padded_vocab_size(m) / layout.tp * tokens) if last else 0

    return RankPlan(
        rank=rank, node=rank // gpus_per_node, stage=stage, weights=int(weights) + ring.ring,
        grads=int(grads), optimizer_gpu=opt.resident,
        optimizer_step_only=opt.step_only + ring.step_only,
        activations=activations, activations_offloaded=offloaded, logits=logits,
        recomputed=int(rebuilt),
        workspace=WORKSPACE_BYTES,
        host_pinned=opt.pinned
        + opt.states
        + ring.pinned
        + int(offloaded_layers * per_layer),
        host_pageable=opt.on_cpu,
        host_process=HOST_PROCESS_BYTES,
        cpu_adam_params=int(opt.shard * opt.hdo),
        delayed_params=int(sum(opt.delayed)),
        boundary_params=int(sum(opt.delayed)) if copies_at_boundary else 0,
        states_moved=opt.states,
        weight_offload_params=int(ring.params),
    )  # fmt: skip


def part_fractions(sizes: list[float], experts: list[bool], fraction: float,
                   experts_first: bool) -> list[float]:  # fmt: skip
    """The fraction of each optimizer part that the CPU-Adam engine keeps on the host:
    ``fraction`` of each, or, with ``experts_first`` (delayed mode), the expert parts filled
    before the dense ones."""
    if not experts_first:
        return [fraction] * len(sizes)
    budget = fraction * sum(sizes)
    fractions = [0.0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: not experts[i]):
        take = min(budget, sizes[i])
        fractions[i] = take / sizes[i] if sizes[i] else 0.0
        budget -= take
    return fractions


def part_delays(run: RunConfig, experts: list[bool]) -> list[bool]:
    """Which optimizer parts update one step late: all in delayed mode, or only the routed
    experts' with ``optimizer.cpu_adam_delayed_scope=experts``."""
    if not cpu_adam_delayed(run):
        return [False] * len(experts)
    if not (cpu_adam_delays_dense(run) or any(experts)):  # validation rejects it before here
        raise RuntimeError(
            "cpu_adam: optimizer.cpu_adam_delayed_scope=experts found no optimizer part of "
            "routed experts (Megatron-Core builds one with expert parallelism only)"
        )
    return [cpu_adam_delays_dense(run) or e for e in experts]


def offloaded_parts(run: RunConfig, parts: list[float],
                    fraction: float) -> tuple[list[float], list[float]]:  # fmt: skip
    """Per optimizer part (dense, then experts'): the params the CPU-Adam engine keeps on the
    host, and of them those it updates one step late, as the engine decides them
    (``part_fractions``, ``part_delays``)."""
    experts = [i == 1 for i in range(len(parts))]
    fractions = part_fractions(parts, experts, fraction, cpu_adam_delayed(run))
    offloaded = [n * f for n, f in zip(parts, fractions, strict=True)]
    delays = part_delays(run, experts)
    return offloaded, [n if d else 0.0 for n, d in zip(offloaded, delays, strict=True)]


def cpu_adam_ring_bytes(parts: list[float], fraction: float, chunk_mb: int) -> int:
    """The CPU-Adam engine's GPU ring, per optimizer part with params on the CPU: two pieces of
    fp32 masters on their way into the bf16 parameters."""
    chunk = chunk_mb * 1024**2 // 4
    return sum(2 * 4 * int(min(chunk, n * fraction)) for n in parts if n * fraction >= 1)


def cpu_adam_window_bytes(parts: list[float], fraction: float, chunk_mb: int,
                          per_param: int = ADAM_BYTES) -> int:  # fmt: skip
    """The CPU-Adam engine's GPU share: per optimizer part with params on the host, a window of
    up to WINDOW_SLOTS pieces of masters and moments (``per_param`` bytes; LATE_BYTES with the
    gradients of delayed mode's late passes), at most: the share is balanced at run time."""
    chunk = chunk_mb * 1024**2 // 4
    return sum(min(WINDOW_SLOTS, math.ceil(n * fraction / chunk)) * per_param
               * int(min(chunk, n * fraction)) for n in parts if n * fraction >= 1)  # fmt: skip


@dataclass
class Plan:
    """Every rank's plan, the capacities it was compared with, and the verdict."""

    ranks: list[RankPlan]
    gpu_capacity_gb: float
    gpu_capacity_source: str
    host_capacity_gb: float
    gpus_per_node: int
    margin_gb: float
    notes: list[str] = field(default_factory=list)

    @property
    def worst(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.gpu_peak)

    def node_host_gb(self) -> dict[int, float]:
        nodes: dict[int, float] = {}
        for r in self.ranks:
            nodes[r.node] = nodes.get(r.node, 0.0) + r.host / GiB
        return nodes

    @property
    def max_node_host_gb(self) -> float:
        return max(self.node_host_gb().values())

    @property
    def host_needed_gb(self) -> float:
        """The busiest node's host RAM with the margin kept free."""
        return self.max_node_host_gb + self.margin_gb

    @property
    def limiting(self) -> str | None:
        """Which resource runs out first (None: both fit)."""
        gpu_use = (self.worst.gpu_peak / GiB + self.margin_gb) / self.gpu_capacity_gb
        host_use = self.host_needed_gb / self.host_capacity_gb
        if gpu_use <= 1 and host_use <= 1:
            return None
        return "gpu" if gpu_use >= host_use else "host"

    def as_dict(self) -> dict:
        return {
            "world_size": len(self.ranks),
            "gpus_per_node": self.gpus_per_node,
            "gpu_capacity_gb": self.gpu_capacity_gb,
            "gpu_capacity_source": self.gpu_capacity_source,
            "gpu_margin_gb": self.margin_gb,
            "host_capacity_gb": self.host_capacity_gb,
            "fits": self.limiting is None,
            "limiting": self.limiting,
            "ranks": [r.as_dict() for r in self.ranks],
            "nodes": [{"node": n, "host_gb": round(v, 3)} for n, v in self.node_host_gb().items()],
            "notes": self.notes,
        }


def detect_gpu_gb() -> float | None:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / GiB
    except Exception:  # noqa: BLE001 - no usable CUDA runtime means "not detected"
        return None
    return None


def detect_host_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB


def make_plan(run: RunConfig, world: int | None = None, gpus_per_node: int | None = None) -> Plan:
    """Plan every rank of ``run`` on ``world`` ranks (default: the smallest world it allows)."""
    notes = []
    layout = Layout.of(run, world)
    per_node = gpus_per_node or run.launcher.nproc_per_node or min(layout.world, 8)
    if run.planner.gpu_memory_gb:
        capacity, source = run.planner.gpu_memory_gb, "planner.gpu_memory_gb"
    elif run.train.gpu_memory_cap_gb:
        capacity, source = run.train.gpu_memory_cap_gb, "train.gpu_memory_cap_gb"
    elif (detected := detect_gpu_gb()) is not None:
        capacity, source = detected, "detected"
    else:
        capacity, source = ASSUMED_GPU_GB, "assumed"
        notes.append(
            f"no GPU visible: assuming {ASSUMED_GPU_GB:.0f} GB per GPU (set planner.gpu_memory_gb)"
        )
    host = run.planner.host_memory_gb or detect_host_gb()
    ranks = [plan_rank(run, layout, r, per_node) for r in range(layout.world)]
    return Plan(
        ranks, round(capacity, 2), source, round(host, 1), per_node, run.planner.margin_gb, notes
    )


# --- step time: what an optimizer offload adds to each step ---------------------------------


def balanced_gpu_share(cpu_params_per_s: float, host_link_gb_per_s: float,
                       bytes_moved: tuple[int, int, int] = EXACT) -> float:  # fmt: skip
    """The GPU share x of the offloaded Adam at which the CPU and the link finish together: the
    CPU's share at its rate beside the streams (a = 1 / (rate k)), the link (l = 1 / link)
    carrying ``bytes_moved`` = (W, C, E), EXACT for exact updates, LATE for delayed ones:
    (1 - x) a = (W x + C (1 - x) + E) l, so x = (a - (C + E) l) / (a + (W - C) l)."""
    window, copies, every = bytes_moved
    cpu = 1 / (cpu_params_per_s * CPU_ADAM_RATE_BESIDE_STREAMS)
    link = 1 / (host_link_gb_per_s * 1e9)
    share = (cpu - (copies + every) * link) / (cpu + (window - copies) * link)
    return min(max(share, 0.0), 1.0)


def exact_update_seconds(params: float, cpu_params_per_s: float, host_link_gb_per_s: float,
                         gpu_share: float,
                         bytes_moved: tuple[int, int, int] = EXACT) -> float:  # fmt: skip
    """The update of ``params`` offloaded params with ``gpu_share`` of them on the GPU (exact,
    or with LATE ``bytes_moved`` a delayed one): the CPU's share at its rate (beside the
    streams where there are any) or the link, whichever takes longer."""
    if gpu_share <= 0:
        return params / cpu_params_per_s
    window, copies, every = bytes_moved
    cpu = (1 - gpu_share) * params / (cpu_params_per_s * CPU_ADAM_RATE_BESIDE_STREAMS)
    moved = window * gpu_share + copies * (1 - gpu_share) + every
    return max(cpu, moved * params / (host_link_gb_per_s * 1e9))


def param_count(n: float) -> str:
    """3.11B, 42.5M, 900K."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def hidden_fraction(forward_backward_s: float, params_per_s: float, shard_params: float,
                    copy_s_per_param: float = 0.0, max_overhead: float = 1.0,
                    copy_window_s: float = 0.0, launch_slowdown: float = 0.0) -> float:  # fmt: skip
    """The largest optimizer_offload_fraction of a rank's Adam shard (``shard_params``) that
    delayed mode hides: CPU Adam at ``params_per_s`` finishes within one forward+backward
    (``forward_backward_s``, without offload), and what the step gains beside it stays within
    ``max_overhead`` of it: forward+backward slowed by ``launch_slowdown`` per second of CPU Adam
    (see PlannerConfig.cpu_adam_launch_slowdown), and the copies (``copy_s_per_param``, each way
    at once) beyond ``copy_window_s`` (the last micro-batch's backward where they run during it,
    see ``copy_window``; 0 at the step boundary)."""
    if not shard_params:
        return 1.0
    cpu = forward_backward_s * params_per_s / shard_params
    budget = max_overhead * forward_backward_s
    slowdown = launch_slowdown * shard_params / params_per_s  # seconds per unit of fraction
    copies = copy_s_per_param * shard_params
    knee = copy_window_s / copies if copies else math.inf  # where the copies outlast the window
    if not (slowdown or copies):
        gained = math.inf
    elif slowdown and slowdown * knee >= budget:  # the slowdown alone uses the budget up first
        gained = budget / slowdown
    else:
        gained = (budget + copy_window_s) / (slowdown + copies)
    return min(1.0, cpu, gained)


# Of a micro-batch's forward+backward, the backward's share (twice the forward's matmul FLOPs).
BACKWARD_SHARE = 2 / 3


def copy_window(forward_backward_s: float, micro_batches: int) -> float:
    """Delayed mode copying during the backward: the time its copies have before the step ends,
    about the last micro-batch's backward (gradients are final only there)."""
    return forward_backward_s / max(micro_batches, 1) * BACKWARD_SHARE


def copy_seconds_per_param(host_link_gb_per_s: float) -> float:
    """Delayed mode's boundary copies per offloaded param (CPU_ADAM_COPY_BYTES each way at once)."""
    return CPU_ADAM_COPY_BYTES / (host_link_gb_per_s * 1e9)


def predicting_weights(run: RunConfig) -> bool:
    """Delayed mode landing extrapolated weights (optimizer.cpu_adam_weight_prediction)."""
    return cpu_adam_delayed(run) and run.optimizer.cpu_adam_weight_prediction


@dataclass(frozen=True)
class StepCost:
    """The model: CPU Adam runs at ``cpu_adam_params_per_s`` per rank (HybridDeviceOptimizer at
    HDO_RATE_SHARE of it) and is not hidden in exact mode; in delayed mode it hides under
    ``forward_backward_s`` (when known), and the copies at the step boundary (4 B/param each way,
    both at once) are what remains where they cannot run during the backward
    (``RankPlan.boundary_params``). State offload streams its 12 B/param through the GPU window
    both ways at once, at ``host_link_gb_per_s`` each way."""

    cpu_adam_params_per_s: float
    host_link_gb_per_s: float
    forward_backward_s: float | None = None
    delayed_max_overhead: float = 0.1  # planner.delayed_max_overhead
    launch_slowdown: float = 0.0  # planner.cpu_adam_launch_slowdown

    def exact_rate(self, run: RunConfig) -> float:
        """Params/s of the CPU part of Adam with ``run``'s engine, its updates exact."""
        engine = run.optimizer.cpu_offload_engine == CpuOffloadEngine.cpu_adam
        return self.cpu_adam_params_per_s * (1.0 if engine else HDO_RATE_SHARE)

    def cpu_rate(self, run: RunConfig) -> float:
        """... its delayed updates (weight prediction adds CPU work), the CPU's alone."""
        slower = WEIGHT_PREDICTION_CPU_FACTOR if predicting_weights(run) else 1.0
        return self.exact_rate(run) / slower

    def delayed_rate(self, run: RunConfig) -> float:
        """... and with their GPU share (delayed mode's late passes), where there is one."""
        share = self.gpu_share(run) if cpu_adam_late_share(run) else 0.0
        if not share:
            return self.cpu_rate(run)
        return 1.0 / exact_update_seconds(1.0, self.cpu_rate(run), self.host_link_gb_per_s,
                                          share, LATE)  # fmt: skip

    def gpu_share(self, run: RunConfig) -> float:
        """The GPU share (0: none; null in the config: the balanced one), of the exact updates,
        or of the delayed ones in delayed mode for every parameter."""
        if not cpu_adam_streams(run):
            return 0.0
        share = run.optimizer.cpu_adam_gpu_share
        if share is None:
            moved = LATE if cpu_adam_late_share(run) else EXACT
            return balanced_gpu_share(self.exact_rate(run), self.host_link_gb_per_s, moved)
        return share

    def seconds(self, run: RunConfig, rank: RankPlan) -> float:
        link = rank.states_moved / (self.host_link_gb_per_s * 1e9)
        return link + self.exact_seconds(run, rank) + self.delayed_seconds(run, rank)

    def exact_seconds(self, run: RunConfig, rank: RankPlan) -> float:
        """The step's wait for the exact updates (with their GPU share, where it streams)."""
        exact = rank.cpu_adam_params - rank.delayed_params
        if cpu_adam_streams(run) and exact:
            return exact_update_seconds(exact, self.exact_rate(run), self.host_link_gb_per_s,
                                        self.gpu_share(run))  # fmt: skip
        return exact / self.exact_rate(run)

    def delayed_seconds(self, run: RunConfig, rank: RankPlan) -> float:
        """What the delayed updates add to the step: their CPU Adam beyond forward+backward,
        the training thread's slowdown beside it, their copies the step waits for."""
        if not rank.delayed_params:
            return 0.0
        cpu = rank.delayed_params / self.delayed_rate(run)
        copies = rank.delayed_params * copy_seconds_per_param(self.host_link_gb_per_s)
        tail = max(copies - self._copy_window(run, rank), 0.0)  # what the step waits for
        beside = min(cpu, self.forward_backward_s or 0.0)  # CPU Adam beside the training
        return cpu - beside + self.launch_slowdown * beside + tail

    def _copy_window(self, run: RunConfig, rank: RankPlan) -> float:
        """The time delayed mode's copies hide in: the last micro-batch's backward where they
        run during it (one GPU, so one micro-batch per sample), else none."""
        if rank.boundary_params or not self.forward_backward_s:
            return 0.0
        t = run.train
        return copy_window(self.forward_backward_s, t.global_batch_size // t.micro_batch_size)

    def hidden_fraction(self, run: RunConfig, rank: RankPlan) -> float | None:
        """Delayed mode: the largest optimizer_offload_fraction whose CPU Adam fits under
        forward_backward_s and whose copies the step waits for add at most delayed_max_overhead
        of it (None when that is unknown or nothing is on the CPU)."""
        fraction = run.optimizer.optimizer_offload_fraction
        if not (self.forward_backward_s and rank.cpu_adam_params and fraction):
            return None
        return hidden_fraction(self.forward_backward_s, self.delayed_rate(run),
                               rank.cpu_adam_params / fraction,
                               copy_seconds_per_param(self.host_link_gb_per_s),
                               self.delayed_max_overhead, self._copy_window(run, rank),
                               self.launch_slowdown)  # fmt: skip

    def explain(self, run: RunConfig, rank: RankPlan) -> str:
        parts = []
        exact, delayed = rank.cpu_adam_params - rank.delayed_params, rank.delayed_params
        share = self.gpu_share(run)
        dense = " (the dense part, exact)" if exact and delayed else ""
        if exact and share:
            how = "balanced, then fixed" if run.optimizer.cpu_adam_gpu_share is None else "fixed"
            parts.append(f"the states of {param_count(exact)} params{dense} on the host, "
                         f"Adam on {1 - share:.0%} of them on the CPU at "
                         f"{self.exact_rate(run) / 1e9:.2f} G/s ({CPU_ADAM_RATE_BESIDE_STREAMS:g}x "
                         f"beside the streams) and on {share:.0%} on the GPU, their states "
                         f"streamed at {self.host_link_gb_per_s:.0f} GB/s each way "
                         f"({self.exact_seconds(run, rank):.2f} s; the share {how})")  # fmt: skip
        elif exact:
            parts.append(f"{param_count(exact)} params{dense} of Adam on the CPU at "
                         f"{self.exact_rate(run) / 1e9:.2f} G/s "
                         f"({self.exact_seconds(run, rank):.2f} s)")  # fmt: skip
        if delayed and cpu_adam_late_share(run):
            how = "balanced, then fixed" if run.optimizer.cpu_adam_gpu_share is None else "fixed"
            parts.append(f"{param_count(delayed)} params of Adam a step late, {1 - share:.0%} of "
                         f"them on the CPU at {self.cpu_rate(run) / 1e9:.2f} G/s "
                         f"({CPU_ADAM_RATE_BESIDE_STREAMS:g}x beside the streams) and {share:.0%} "
                         f"on the GPU, their states and gradients streamed at "
                         f"{self.host_link_gb_per_s:.0f} GB/s under the next forward+backward "
                         f"({delayed / self.delayed_rate(run):.2f} s; the share {how})"
                         )  # fmt: skip
        elif delayed:
            experts = " (the routed experts)" if exact else ""
            parts.append(f"{param_count(delayed)} params{experts} of Adam on the CPU at "
                         f"{self.cpu_rate(run) / 1e9:.2f} G/s "
                         f"({delayed / self.cpu_rate(run):.2f} s)")  # fmt: skip
            hidden = self.hidden_fraction(run, rank)
            at_boundary = bool(rank.boundary_params)
            limited = "boundary copies" if at_boundary else "copies beyond the last backward"
            where = "at the step boundary" if at_boundary else (
                "during the last micro-batch's backward"
            )  # fmt: skip
            if self.launch_slowdown:
                limited += " and the training thread's slowdown beside CPU Adam"
            parts.append(
                "delayed: hidden under forward+backward of "
                f"{self.forward_backward_s:.2f} s up to a fraction of {hidden:.2f} "
                f"({limited} within {self.delayed_max_overhead:.0%} of it), "
                if hidden is not None
                else "delayed: not counted as hidden (set planner.forward_backward_s), "
            )
            parts[-1] += f"{CPU_ADAM_COPY_BYTES} B/param each way {where}"
        if rank.states_moved:
            parts.append(f"{rank.states_moved / 1e9:.1f} GB of states each way at once over "
                         f"{self.host_link_gb_per_s:.0f} GB/s")  # fmt: skip
        return ", ".join(parts) or "nothing offloaded from the optimizer"


def step_cost(run: RunConfig, gpus_per_node: int = 1) -> StepCost:
    """The step-time model for ``run``: the configured CPU Adam rate, else torch's fused AdamW
    measured on this machine with the cores the engine gives one rank (once per process; under
    model.deterministic_mode REFERENCE_CPU_ADAM_PARAMS_PER_S, so nothing timed steers a run)."""
    p = run.planner
    rate = p.cpu_adam_params_per_s
    if not rate:
        rate = REFERENCE_CPU_ADAM_PARAMS_PER_S if run.model.deterministic_mode else measured_rate(
            len(worker_cpus(run, rank_cpus(0, max(1, gpus_per_node))))
        )  # fmt: skip
    return StepCost(
        rate,
        p.host_link_gb_per_s,
        p.forward_backward_s,
        p.delayed_max_overhead,
        p.cpu_adam_launch_slowdown,
    )


def cost_note(run: RunConfig, plan: Plan) -> str | None:
    """--plan's line on what the optimizer offload adds to a step (None: nothing offloaded)."""
    if not any(r.cpu_adam_params or r.states_moved for r in plan.ranks):
        return None
    cost = step_cost(run, plan.gpus_per_node)
    worst = max(plan.ranks, key=lambda r: cost.seconds(run, r))
    return f"predicted +{cost.seconds(run, worst):.2f} s per step: {cost.explain(run, worst)}"


# --- auto: the offload that fits at the least predicted cost ------------------------------------

AUTO_FRACTIONS = (0.25, 0.5, 0.75, 1.0)


def optimizer_ladder(engine: CpuOffloadEngine,
                     delayed: bool = False) -> tuple[tuple[str, dict], ...]:  # fmt: skip
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
    return tuple(steps)  # fmt: skip


def _with(run: RunConfig, overrides: dict) -> RunConfig:
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


STATES_STEP = ("states", {"optimizer.optimizer_cpu_offload": False,
                          "optimizer.optimizer_offload_fraction": 0.0,
                          "optimizer.offload_optimizer_states": True})  # fmt: skip
# State offload's fractions auto tries (the rest of the states stays on the GPU).
STATE_FRACTIONS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)
BF16_MOMENTS = {"optimizer.exp_avg_dtype": OptimizerDtype.bf16,
                "optimizer.exp_avg_sq_dtype": OptimizerDtype.bf16}  # fmt: skip
# What auto gives up, in this order, when nothing in the configured precision fits: Adam's
# moments in bf16 (fp32 math), then the gradient buffer in bf16 too; the host engines only.
PRECISION_TIERS = (
    ("", {}),
    ("bf16 moments", BF16_MOMENTS),
    ("bf16 moments and gradients", {**BF16_MOMENTS, "ddp.grad_reduce_in_fp32": False}),
)


def states_ladder() -> list[tuple[str, dict]]:
    """State offload at each of STATE_FRACTIONS."""
    name, overrides = STATES_STEP
    return [(name + ("" if f == 1.0 else f" optimizer.optimizer_state_offload_fraction={f}"),
             {**overrides, "optimizer.optimizer_state_offload_fraction": f})
            for f in STATE_FRACTIONS]  # fmt: skip


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
        if _with(run, extra) == run:  # configured so already
            continue
        found += [(f"{name}, {what}", {**o, **extra}, tier) for name, o in host_engines]
    return found


def choose_offload(run: RunConfig, world: int | None = None) -> AutoChoice:
    """Among the settings that fit, the one the step-time model (StepCost) says costs least;
    for each optimizer setting, the fewest activation-offload layers that fit (the model counts
    them free: they overlap compute). offload/optimizer=auto weighs CPU Adam fractions
    (planner.auto_engine) against optimizer-state offload. Raises ValueError when nothing fits."""
    p = run.planner
    optimizer_steps = auto_candidates(run) if p.auto_optimizer else [("as configured", {}, 0)]
    max_layers = run.model.num_layers - 1 if run.model.pipeline_model_parallel_size == 1 else 0
    layer_counts = range(0, max_layers + 1) if p.auto_activation else (None,)
    last, fitting = None, []
    for opt_name, opt_overrides, tier in optimizer_steps:
        if fitting and tier > fitting[0][5]:
            break  # a more precise setting fits
        for layers in layer_counts:
            overrides = dict(opt_overrides)
            if p.auto_optimizer:
                overrides.setdefault("optimizer.offload_optimizer_states", False)
                overrides.setdefault("optimizer.optimizer_state_offload_fraction", 1.0)
            if layers is not None:
                overrides.update({"model.cpu_offloading": layers > 0,
                                  "model.cpu_offloading_num_layers": layers,
                                  "model.cpu_offloading_activations": True})  # fmt: skip
            candidate = _with(run, overrides)
            plan = make_plan(candidate, world)
            last = plan
            if plan.limiting is None:
                fitting.append((opt_name, layers, overrides, candidate, plan, tier))
                break  # more layers of this optimizer setting only cost more
    if not fitting and p.auto_optimizer and not p.auto_activation:
        last, fitting = _weight_offload_fallback(run, world) or (last, fitting)
    if not fitting:
        assert last is not None
        peak = last.worst.gpu_peak / GiB
        raise ValueError(
            f"no offload setting fits: the last one tried needs {peak:.1f} GB + "
            f"{last.margin_gb:.1f} GB margin of a {last.gpu_capacity_gb:.1f} GB GPU and "
            f"{last.max_node_host_gb:.1f} of {last.host_capacity_gb:.0f} GB host RAM per node"
        )
    cost = step_cost(run, fitting[0][4].gpus_per_node) if p.auto_optimizer else None

    def seconds(item) -> float:
        _, _, _, candidate, plan, _ = item
        return max(cost.seconds(candidate, r) for r in plan.ranks) if cost else 0.0

    best = min(fitting, key=seconds)  # ties: the earlier, smaller offload
    opt_name, layers, overrides, candidate, plan, tier = best
    parts = []
    if p.auto_optimizer:
        parts.append(f"offload/optimizer={opt_name}")
    if layers is not None:
        parts.append(f"activation offload of {layers} layer(s)")
    if overrides.get("model.cpu_offloading_weights"):
        parts.append(f"weight offload of {overrides['model.cpu_offloading_num_layers']} layer(s)")
    peak = plan.worst.gpu_peak / GiB
    why = (f"peak {peak:.1f} GB + {plan.margin_gb:.1f} GB margin fits "
           f"{plan.gpu_capacity_gb:.1f} GB; host {plan.max_node_host_gb:.1f}"
           f" of {plan.host_capacity_gb:.0f} GB per node")  # fmt: skip
    if tier:
        why += f"; {PRECISION_TIERS[tier][0]}: nothing in the configured precision fits"
    if cost:
        worst = max(plan.ranks, key=lambda r: cost.seconds(candidate, r))
        why += (f"; predicted +{seconds(best):.2f} s per step: "
                f"{cost.explain(candidate, worst)}")  # fmt: skip
        others = [f"{item[0]} +{seconds(item):.2f} s" for item in fitting if item is not best]
        if others:
            why += f"; also fits: {', '.join(others)}"
    if (weights := weight_offload_note(candidate, plan)) is not None:
        why += f"; {weights}"
    return AutoChoice(overrides, f"{', '.join(parts)} ({why})", plan)


def _weight_offload_fallback(run: RunConfig, world: int | None) -> tuple | None:
    """Where no optimizer setting fits on one GPU: state offload (each precision tier in turn)
    with the fewest layers of weight offload that fit, as (last plan, [fitting item]); None
    where weight offload cannot run (more than one GPU) or nothing fits even so."""
    if Layout.of(run, world).world != 1:
        return None
    last = None
    for tier, (_, precision) in enumerate(PRECISION_TIERS):
        name, states = STATES_STEP
        for layers in range(1, run.model.num_layers + 1):
            overrides = {**states, **precision, "optimizer.optimizer_state_offload_fraction": 1.0,
                         "model.cpu_offloading": True, "model.cpu_offloading_weights": True,
                         "model.cpu_offloading_activations": False,
                         "model.cpu_offloading_num_layers": layers}  # fmt: skip
            candidate = _with(run, overrides)
            last = make_plan(candidate, world)
            if last.limiting is None:
                return last, [(name, None, overrides, candidate, last, tier)]
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
    step = run.model.pipeline_model_parallel_size * (run.model.virtual_pipeline_model_parallel_size
                                                     or 1)  # fmt: skip
    auto = run.planner.auto_optimizer or run.planner.auto_activation

    def at(layers: int) -> tuple[Plan | None, AutoChoice | None]:
        sliced = _with(run, {"model.num_layers": layers})
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
    params = count_parameters(_with(run, {"model.num_layers": layers}).model).total if layers else 0
    return Largest(layers, params, best[0], best[1])
