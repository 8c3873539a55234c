"""The memory model: GPU and host memory per rank before the job starts. Pure arithmetic, no GPU.
What an offload adds to a step is step_cost.py's; the least offload that fits (``auto``), auto.py's.

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
Adam (12 B/param) and pinned transfer buffers, the state-offload arena (10 B/param, the masters
as remainders), activation offload's pinned buffers; summed per node. The tensor counts were
read from four runs of the calibration spread (bench/calibrate_planner.py FITTED_ON) and hold
within 10% on the rest
(tests/test_plan.py); ``bench/calibrate_planner.py --report`` reports the error of each suite.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, replace

from offload_runner.config.schema import (
    DTYPE_BYTES,
    REMAINDER_BYTES,
    RunConfig,
    states_window_mb,
)
from offload_runner.hardware import (
    ADAM_BYTES,
    CPU_ADAM_PINNED_BYTES,
    CPU_ADAM_PREDICTION_BYTES,
    HDO_PINNED_BYTES,
    LATE_BYTES,
    LOSS_CHUNK_BYTES,
    WEIGHT_OFFLOAD_IN_FLIGHT,
    WEIGHT_OFFLOAD_PIECE,
    WINDOW_SLOTS,
    cpu_adam_piece_bytes,
    quantize_workspace_bytes,
    weight_ring_sizes,
)
from offload_runner.model_size import (
    count_parameters,
    kv_channels,
    largest_modules,
    padded_vocab_size,
)

GiB = 1024**3
# A rank's process beside what it pins or allocates for offload: the node's RAM in use at the
# peak over the planned host bytes, in suites capacity-28 (one H200), profile-8 and cost-32 (one
# H100): 5.7-6.0 GB with the OS's ~2 GB before the run; the planner's margin_gb keeps the OS's.
HOST_PROCESS_BYTES = int(3.7 * GiB)
WORKSPACE_BYTES = int(0.1 * GiB)  # cuBLAS/TE workspaces, allocator slack (fitted: tiny recipe)
# Part of an offloaded layer's saved tensors that TE's offload context actually moves, by layer
# type: a MoE layer keeps its router's and token permutation's tensors (fitted on the MoE proxy: 2
# offloaded layers saved 0.61 GiB of 1.12 GiB), a dense one mostly TE modules' (fitted on
# llama3_8b at seq 8192 with 31 layers offloaded: 36.28 GB peak, suite weight-offload-caps).
ACTIVATION_OFFLOAD_EFFICIENCY = {"moe": 0.55, "dense": 0.65}
# GPU memory a rank of a multi-GPU job holds outside torch's allocator (NCCL's communicators and
# buffers beside the CUDA context), kept free beside planner.margin_gb (sized on one GPU): 3.9 GiB
# per rank on two H200, EP2, the full Qwen3-30B-A3B (suite two-gpu-full-2, first try: out of
# memory at 130.2 GiB allocated + 3.4 cached + 3.9 outside torch of 139.8).
COMMUNICATOR_GB = 4.0
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
        return cls(
            tp,
            pp,
            cp,
            ep,
            etp,
            dp=world // m.model_parallel_size,
            edp=world // m.expert_layout_size,
            world=world,
        )


def rank_micro_batches(run: RunConfig, layout: Layout) -> int:
    """Micro-batches one rank runs per step."""
    t = run.train
    return max(1, t.global_batch_size // (t.micro_batch_size * layout.dp))


def minimal_world_size(run: RunConfig) -> int:
    """The fewest ranks the parallel layout needs (data-parallel size 1)."""
    return math.lcm(run.model.model_parallel_size, run.model.expert_layout_size)


@dataclass(frozen=True)
class StageParams:
    """Parameters held by one rank of a pipeline stage."""

    dense: int  # everything but routed experts (split over TP)
    experts: int  # routed experts (split over EP x ETP)


def layer_params(m) -> tuple[float, float]:
    """One transformer layer's params (the model's average): outside the routed experts, and
    the routed experts'."""
    counts = count_parameters(m)
    dense = counts.attention + counts.dense_mlp + counts.router + counts.norms
    return dense / m.num_layers, counts.experts / m.num_layers


def stage_params(run: RunConfig, layout: Layout, stage: int) -> StageParams:
    m = run.model
    layers = m.num_layers // layout.pp
    per_layer_dense, per_layer_experts = layer_params(m)
    dense = layers * per_layer_dense / layout.tp
    embedding = padded_vocab_size(m) * m.hidden_size / layout.tp
    first, last = stage == 0, stage == layout.pp - 1
    if first:
        dense += embedding
    if last and (not m.share_embeddings_and_output_weights or layout.pp > 1):
        dense += embedding  # untied output layer, or the tied copy on the last stage
    experts = layers * per_layer_experts / (layout.ep * layout.etp)
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


# What full recompute keeps per checkpointed group and token: two hidden-sized bf16 copies
# (suite whole-model-mb, the whole Qwen3-30B-A3B under full recompute: the peak grew 871 KiB a
# token from MB 1 to 4; with one copy the plan fell 2.4% and 3.1% short at MB 4 and 8, with two
# it holds within 1.3% at MB 1, 2, 4 and 8).
CHECKPOINTED_COPIES = 2


# A rebuilt group's activations and, while its backward runs, their gradients: about two
# copies at once (suite throughput-16, MB 4 with full recompute: 62.19 GB measured, 59.77
# planned with one copy, 62.16 with two).
REBUILT_COPIES = 2


def rebuilt_bytes(run: RunConfig, rank: int = 0, world: int | None = None) -> int:
    """What the backward of ``rank`` allocates at once to rebuild a checkpointed group (0
    without full recompute): room a state window growing into the freed memory leaves."""
    layout = Layout.of(run, world)
    return plan_rank(run, layout, rank, planned_gpus_per_node(run, layout.world)).recomputed


def recompute_stored_and_rebuilt(
    run: RunConfig, layers: int, per_layer: float, layer_input: float
) -> tuple[float, float]:
    """Full recompute: what a stage keeps per micro-batch in flight (checkpointed groups keep
    CHECKPOINTED_COPIES of their input's size), and what backward holds at once to rebuild one
    checkpointed group. Selective recompute of core attention saves nothing with flash
    attention, which keeps no score matrix; no recompute keeps every layer."""
    m = run.model
    if m.recompute_granularity is None or m.recompute_granularity.value != "full":
        return layers * per_layer, 0.0
    n = max(1, m.recompute_num_layers or 1)
    if m.recompute_method is not None and m.recompute_method.value == "block":
        checkpointed = min(n, layers)  # the first n layers, one at a time
        rebuilt = REBUILT_COPIES * per_layer
        return checkpointed * layer_input + (layers - checkpointed) * per_layer, rebuilt
    groups = math.ceil(layers / n)  # uniform: every group of n layers keeps its input
    return groups * CHECKPOINTED_COPIES * layer_input, REBUILT_COPIES * min(n, layers) * per_layer


# Bytes per vocabulary entry and token that the output layer and its loss hold at the peak: the
# bf16 logits and the loss's fp32 copy; Transformer Engine's fused cross entropy
# (model.cross_entropy_loss_fusion with cross_entropy_fusion_impl=te) keeps 3 (suite
# throughput-16: 450 KB a token less at MB 1, 2 and 4 against Megatron-Core's plain kernels).
LOGIT_BYTES = 6
LOGIT_BYTES_TE_FUSED = 3


def logits_and_loss_bytes(m, tokens: int, tp: int) -> int:
    """What the output layer and its loss hold at their peak, for ``tokens`` of a micro-batch:
    the whole logits, or with model.chunked_loss a chunk's fp32 logits and softmax and the
    output weight's fp32 gradient."""
    vocab = padded_vocab_size(m)
    if m.chunked_loss:
        return 2 * min(LOSS_CHUNK_BYTES, 4 * vocab * tokens) + 4 * vocab * m.hidden_size
    return int(logit_bytes(m) * vocab / tp * tokens)


def logit_bytes(m) -> int:
    fused = getattr(m, "cross_entropy_loss_fusion", False)
    return LOGIT_BYTES_TE_FUSED if fused and m.cross_entropy_fusion_impl == "te" else LOGIT_BYTES


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
    # 8-bit moments' quantization workspace, in the phase their pass runs in: beside the next
    # forward where one rank holds its whole shard (measured there: suite convergence), else
    # in the step
    quantizing: int = 0
    quantizing_beside_forward: bool = False

    @property
    def static(self) -> int:
        return self.weights + self.grads + self.optimizer_gpu + self.workspace

    @property
    def fwd_bwd_peak(self) -> int:
        # the logits live at the end of forward, a rebuilt group later in backward
        beside = self.quantizing if self.quantizing_beside_forward else 0
        return self.static + self.activations + max(self.logits, self.recomputed) + beside

    @property
    def ddp_build(self) -> int:
        """GPU bytes while Megatron-Core's DDP allocates its buffers beside a model built on the
        GPU: the weights twice and the gradients (mcore/model.py's through_host)."""
        return 2 * self.weights + self.grads

    @property
    def step_peak(self) -> int:
        return self.static + self.optimizer_step_only + self.quantizing

    @property
    def gpu_peak(self) -> int:
        return max(self.fwd_bwd_peak, self.step_peak)

    @property
    def host(self) -> int:
        return self.host_pinned + self.host_pageable + self.host_process

    def as_dict(self) -> dict:
        counts = (
            "rank",
            "node",
            "stage",
            "cpu_adam_params",
            "delayed_params",
            "boundary_params",
            "states_moved",
        )
        gb = {k: round(v / GiB, 3) for k, v in asdict(self).items() if k not in counts}
        return {
            "rank": self.rank,
            "node": self.node,
            "stage": self.stage,
            "gpu_peak_gb": round(self.gpu_peak / GiB, 3),
            "gpu_fwd_bwd_peak_gb": round(self.fwd_bwd_peak / GiB, 3),
            "gpu_step_peak_gb": round(self.step_peak / GiB, 3),
            "host_gb": round(self.host / GiB, 3),
            "breakdown_gb": gb,
        }


def adam_bytes_per_param(run: RunConfig) -> int:
    """Optimizer bytes per param of the shard: exp_avg + exp_avg_sq, and the master of a bf16
    model. On the GPU precision-aware path they take their configured dtypes, and an fp32 master
    is kept as its 16-bit remainder only."""
    o = run.optimizer
    if run.mode.states or run.mode.cpu_adam:  # offload-runner's host engines: fp32 masters
        # where they keep them on the GPU (host_state_bytes: on the host)
        return 4 + run.precision.moment_bytes if run.model.bf16 else run.precision.moment_bytes
    gpu_aware = o.use_precision_aware_optimizer and not o.optimizer_cpu_offload
    moments = run.precision.moment_bytes if gpu_aware else ADAM_BYTES - 4
    if not run.model.bf16:
        return moments
    if not gpu_aware:
        return moments + 4
    master = DTYPE_BYTES[o.main_params_dtype.value]
    remainders = master == 4 and run.precision.remainders
    return moments + (REMAINDER_BYTES if remainders else master)


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
    if run.mode.cpu_adam:
        staging = run.precision.grad_bytes  # the gradients' host copy, in the DDP buffer's dtype
        pinned = shard * hdo * (CPU_ADAM_PINNED_BYTES - 4 + staging)
        pinned += sum(delayed) * (CPU_ADAM_PREDICTION_BYTES if predicting_weights(run) else 0)
        on_cpu = int(shard * hdo * run.precision.moment_bytes)
        resident += cpu_adam_ring_bytes(parts, hdo)
        # delayed mode's exact columns: their fp32 masters and their moments on the GPU
        columns = sum(delayed) * o.cpu_adam_exact_columns
        resident += int(columns * (4 + 2 * run.precision.moment_bytes))
        if run.mode.late_share:  # every moment pinned; forward+backward hold the window
            pinned += sum(offloaded) * run.precision.moment_bytes
            on_cpu = 0
            resident += cpu_adam_window_bytes(offloaded, 1.0, LATE_BYTES)
        elif run.mode.streams:  # the exact parts' moments pinned; the step holds the window
            exact = [n - d for n, d in zip(offloaded, delayed, strict=True)]
            pinned += sum(exact) * run.precision.moment_bytes
            on_cpu = int(sum(delayed) * run.precision.moment_bytes)
            step_only = cpu_adam_window_bytes(exact, 1.0)
    else:
        pinned = shard * hdo * HDO_PINNED_BYTES
    states = 0
    if run.mode.states:
        share = o.optimizer_state_offload_fraction
        states = int(shard * share * run.precision.host_state_bytes)
        # the window: its MiB, SLOTS pieces of window_bytes_per_param each
        window = states_window_mb(run) * 1024**2
        whole = int(shard * share * run.precision.window_bytes_per_param)  # a window as large as it
        resident, step_only = int(adam * (1 - share)), min(whole, window)
    return OptimizerMemory(
        shard, adam, hdo, delayed, resident, step_only, int(pinned), on_cpu, states
    )


@dataclass(frozen=True)
class WeightOffloadMemory:
    """What offload/weight moves off one rank's GPU (offload/weight.py): the offloaded layers'
    params leave DDP's weight and gradient buffers and the optimizer; the GPU keeps a ring of
    modules (hardware.weight_ring_sizes: bf16 weights, gradients) and, during the step, the update
    pieces in flight."""

    dense: float  # offloaded params, outside the routed experts
    experts: float
    ring: int  # GPU bytes, always
    step_only: int  # GPU bytes, during the step (the update piece)
    pinned: int  # host bytes: weights, gradients, masters, moments

    @property
    def params(self) -> float:
        return self.dense + self.experts


def weight_offload_memory(run: RunConfig) -> WeightOffloadMemory:
    m = run.model
    if not (run.mode.weights and m.cpu_offloading_num_layers > 0):
        return WeightOffloadMemory(0.0, 0.0, 0, 0, 0)
    n = min(m.cpu_offloading_num_layers, m.num_layers)
    dense, experts = layer_params(m)
    layer = dense + experts
    modules = largest_modules(m)  # the ring streams modules, widest first
    widest = modules[0]
    grads = run.precision.grad_bytes
    weight_slots, grad_slots = weight_ring_sizes([modules], grads)
    ring = 2 * weight_slots + grads * grad_slots
    piece = min(widest, WEIGHT_OFFLOAD_PIECE) * (4 * 4 + 2)
    step_only = int(WEIGHT_OFFLOAD_IN_FLIGHT * piece)
    pinned = int(n * layer * (2 + grads + 4 + run.precision.moment_bytes))
    return WeightOffloadMemory(n * dense, n * experts, ring, step_only, pinned)


def plan_rank(run: RunConfig, layout: Layout, rank: int, gpus_per_node: int) -> RankPlan:
    m, o, t = run.model, run.optimizer, run.train
    stage = rank // (layout.world // layout.pp)
    params = stage_params(run, layout, stage)
    ring = weight_offload_memory(run)  # its layers leave DDP's buffers and optimizer
    params = replace(params, dense=params.dense - ring.dense, experts=params.experts - ring.experts)
    total = params.dense + params.experts
    weights = total * (2 if m.bf16 else 4)
    grads = total * run.precision.grad_bytes
    if o.use_distributed_optimizer:  # one optimizer part for the dense shard, one for experts'
        parts = [params.dense / (layout.dp * layout.cp), params.experts / layout.edp]
    else:
        parts = [total]
    opt = optimizer_memory(run, parts)

    tokens = t.micro_batch_size * m.seq_length / layout.cp
    layers = m.num_layers // layout.pp
    micro_batches = rank_micro_batches(run, layout)
    in_flight = min(layout.pp - stage, micro_batches)
    per_layer = layer_activations(run).per_rank(layout.tp, m.sequence_parallel) * tokens
    hidden = 2 * m.hidden_size * tokens / (layout.tp if m.sequence_parallel else 1)
    stored, rebuilt = recompute_stored_and_rebuilt(run, layers, per_layer, hidden)
    offloaded_layers = (
        m.cpu_offloading_num_layers if m.cpu_offloading and m.cpu_offloading_activations else 0
    )
    moved = ACTIVATION_OFFLOAD_EFFICIENCY["moe" if m.num_moe_experts else "dense"]
    offloaded = int(offloaded_layers * per_layer * moved)
    model_level = MODEL_ACTIVATION_HIDDEN_COPIES * hidden
    vpp = m.virtual_pipeline_model_parallel_size or 1
    if vpp > 1:  # interleaved 1F1B: stage s warms up 2(PP-s-1) + (VPP-1)PP chunks of L/(PP VPP)
        chunks = min(2 * (layout.pp - stage - 1) + (vpp - 1) * layout.pp + 1, micro_batches * vpp)
        activations = int(chunks * (stored + model_level) / vpp) - offloaded
    else:
        activations = int(in_flight * (stored + model_level)) - offloaded
    last = stage == layout.pp - 1
    copies_at_boundary = run.mode.delayed and not run.mode.copies_during_backward(
        max(layout.dp, layout.edp)
    )
    logits = logits_and_loss_bytes(m, tokens, layout.tp) if last else 0

    return RankPlan(
        rank=rank,
        node=rank // gpus_per_node,
        stage=stage,
        weights=int(weights) + ring.ring,
        grads=int(grads),
        optimizer_gpu=opt.resident,
        optimizer_step_only=opt.step_only + ring.step_only,
        quantizing=quantize_workspace_bytes(run, opt.shard),
        quantizing_beside_forward=layout.dp == 1,
        activations=activations,
        activations_offloaded=offloaded,
        logits=logits,
        recomputed=int(rebuilt),
        workspace=WORKSPACE_BYTES,
        host_pinned=opt.pinned + opt.states + ring.pinned + int(offloaded_layers * per_layer),
        host_pageable=opt.on_cpu,
        host_process=HOST_PROCESS_BYTES,
        cpu_adam_params=int(opt.shard * opt.hdo),
        delayed_params=int(sum(opt.delayed)),
        boundary_params=int(sum(opt.delayed)) if copies_at_boundary else 0,
        states_moved=opt.states,
        weight_offload_params=int(ring.params),
    )


def part_fractions(
    sizes: list[float], experts: list[bool], fraction: float, experts_first: bool
) -> list[float]:
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
    if not run.mode.delayed:
        return [False] * len(experts)
    if not (run.mode.delays_dense or any(experts)):  # validation rejects it before here
        raise RuntimeError(
            "cpu_adam: optimizer.cpu_adam_delayed_scope=experts found no optimizer part of "
            "routed experts (Megatron-Core builds one with expert parallelism only)"
        )
    return [run.mode.delays_dense or e for e in experts]


def offloaded_parts(
    run: RunConfig, parts: list[float], fraction: float
) -> tuple[list[float], list[float]]:
    """Per optimizer part (dense, then experts'): the params the CPU-Adam engine keeps on the
    host, and of them those it updates one step late, as the engine decides them
    (``part_fractions``, ``part_delays``)."""
    experts = [i == 1 for i in range(len(parts))]
    fractions = part_fractions(parts, experts, fraction, run.mode.delayed)
    offloaded = [n * f for n, f in zip(parts, fractions, strict=True)]
    delays = part_delays(run, experts)
    return offloaded, [n if d else 0.0 for n, d in zip(offloaded, delays, strict=True)]


def cpu_adam_ring_bytes(parts: list[float], fraction: float) -> int:
    """The CPU-Adam engine's GPU ring, per optimizer part with params on the CPU: two pieces
    (hardware.cpu_adam_piece_bytes) of fp32 masters on their way into the bf16 parameters."""
    return sum(2 * 4 * piece for _, piece in _pieces(parts, fraction))


def cpu_adam_window_bytes(parts: list[float], fraction: float, per_param: int = ADAM_BYTES) -> int:
    """The CPU-Adam engine's GPU share: per optimizer part with params on the host, a window of
    up to WINDOW_SLOTS pieces of masters and moments (``per_param`` bytes; LATE_BYTES with the
    gradients of delayed mode's late passes), at most: the share is balanced at run time."""
    return sum(
        min(WINDOW_SLOTS, count) * per_param * piece for count, piece in _pieces(parts, fraction)
    )


def _pieces(parts: list[float], fraction: float):
    """Per optimizer part with params on the host: (how many CPU-Adam pieces it makes, the
    params of one, at most all of them)."""
    for n in parts:
        on_host = n * fraction
        if on_host >= 1:
            piece = cpu_adam_piece_bytes(on_host) // 4
            yield math.ceil(on_host / piece), int(min(piece, on_host))


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
    host_capacity_source: str = "planner.host_memory_gb"

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
    def gpu_kept_free_gb(self) -> float:
        """GPU memory kept free beside the planned peak: the margin, and NCCL's (several ranks)."""
        return self.margin_gb + (COMMUNICATOR_GB if len(self.ranks) > 1 else 0.0)

    @property
    def limiting(self) -> str | None:
        """Which resource runs out first (None: both fit)."""
        gpu_use = (self.worst.gpu_peak / GiB + self.gpu_kept_free_gb) / self.gpu_capacity_gb
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
            "gpu_kept_free_gb": self.gpu_kept_free_gb,
            "host_capacity_gb": self.host_capacity_gb,
            "host_capacity_source": self.host_capacity_source,
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


def planned_gpus_per_node(run: RunConfig, world: int | None = None) -> int:
    """Ranks per node: launcher.nproc_per_node, else the job's ranks up to a node of 8."""
    return run.launcher.nproc_per_node or min(Layout.of(run, world).world, 8)


def planned_peaks(run: RunConfig, world: int | None = None) -> dict:
    """The plan's GPU peak (busiest rank) and host RAM (busiest node), GB, for summary.json and
    the out-of-memory line beside what the run measured."""
    plan = make_plan(run, world)
    return {
        "planned_gpu_peak_gb": round(plan.worst.gpu_peak / GiB, 3),
        "planned_host_gb": round(plan.max_node_host_gb, 3),
    }


def make_plan(run: RunConfig, world: int | None = None, gpus_per_node: int | None = None) -> Plan:
    """Plan every rank of ``run`` on ``world`` ranks (default: the smallest world it allows)."""
    notes = []
    layout = Layout.of(run, world)
    per_node = gpus_per_node or planned_gpus_per_node(run, layout.world)
    given = {
        "planner.gpu_memory_gb": run.planner.gpu_memory_gb,
        "train.gpu_memory_cap_gb": run.train.gpu_memory_cap_gb,  # the run enforces it
    }
    if given := {k: v for k, v in given.items() if v}:
        source = min(given, key=given.get)
        capacity = given[source]
    elif (detected := detect_gpu_gb()) is not None:
        capacity, source = detected, "detected"
    else:
        capacity, source = ASSUMED_GPU_GB, "assumed"
        notes.append(
            f"no GPU visible: assuming {ASSUMED_GPU_GB:.0f} GB per GPU (set planner.gpu_memory_gb)"
        )
    host = run.planner.host_memory_gb or detect_host_gb()
    host_source = "planner.host_memory_gb" if run.planner.host_memory_gb else "this machine's RAM"
    ranks = [plan_rank(run, layout, r, per_node) for r in range(layout.world)]
    parked = max(ranks, key=lambda r: r.ddp_build)
    through_host = not run.model.cpu_offloading_weights  # mcore/model.py's through_host
    if through_host and parked.ddp_build > capacity * GiB:
        notes.append(
            f"the model goes through host memory into DDP's buffers (twice its weights and its "
            f"gradients, {parked.ddp_build / GiB:.1f} GB, exceed the GPU): "
            f"{parked.weights / GiB:.1f} GB of pageable host memory per rank while it starts"
        )
    return Plan(
        ranks,
        round(capacity, 2),
        source,
        round(host, 1),
        per_node,
        run.planner.margin_gb,
        notes,
        host_source,
    )


def predicting_weights(run: RunConfig) -> bool:
    """Delayed mode landing extrapolated weights (optimizer.cpu_adam_weight_prediction)."""
    return run.mode.delayed and run.optimizer.cpu_adam_weight_prediction
