"""The validation layer: every rule in one table, run after composition and before anything starts.

A rule is a row (name, condition, message, fix, level). ``validate`` runs every row, then builds
Megatron-Core's own config objects on the CPU so its checks run too, and returns every violation at
once. Messages are the documented ones (Megatron-Core, Transformer Engine) where they exist, so a
user can search for them; each comes with a one-line fix.

Rules marked ``environment=True`` depend on this machine (is Transformer Engine installed?). They
are errors when the job is about to start here, and warnings for --dry-run / --plan, which are
often run on a login node without the GPU stack.
"""

from __future__ import annotations

import importlib.util
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from offload_runner.checkpoint import (
    has_checkpoint,
    holds_checkpoint,
    precision,
    saved_architecture,
    saved_precision,
    weights_only,
)
from offload_runner.config.checks import Level, Violation
from offload_runner.config.schema import (
    TE_FUSIONS,
    CpuOffloadEngine,
    CudaGraphImpl,
    DatasetKind,
    DelayedScope,
    OffloadModule,
    OptimizerType,
    RunConfig,
    TransformerImpl,
    te_fusions,
)
from offload_runner.hardware import te_available
from offload_runner.hf.families import SHAPE_KEYS
from offload_runner.mcore.data import (
    data_prefixes,
    prepared_eods,
    prepared_metadata,
    split_readable,
    validation_documents,
)


@dataclass(frozen=True)
class Environment:
    """What validation may know about where the job runs."""

    te_available: bool
    launching: bool = False  # True right before training starts on this machine
    world_size: int | None = None  # known once torchrun's world is known
    tensorboard_available: bool = True
    wandb_available: bool = True
    deep_ep_available: bool = True
    # APEX's CUDA extension, which Megatron-Core's gradient_accumulation_fusion calls
    fused_wgrad_available: bool = True
    torchao_available: bool = True  # 8-bit moments quantize with its helpers

    @staticmethod
    def detect(launching: bool = False, world_size: int | None = None) -> Environment:
        def installed(name: str) -> bool:
            return importlib.util.find_spec(name) is not None

        return Environment(
            te_available(),
            launching,
            world_size,
            installed("tensorboard"),
            installed("wandb"),
            installed("deep_ep"),
            installed("fused_weight_gradient_mlp_cuda"),
            installed("torchao"),
        )


@dataclass(frozen=True)
class Rule:
    name: str
    violated: Callable[[RunConfig, Environment], bool]
    message: str  # str.format'ed with m=model, o=optimizer, t=train, c=run, env=environment
    fix: str  # likewise
    level: Level = Level.error
    environment: bool = False


def _cpu_adam_selected(c: RunConfig) -> bool:
    return c.optimizer.cpu_offload_engine == CpuOffloadEngine.cpu_adam


def _precision_aware(c: RunConfig) -> bool:
    """Megatron-Core builds its precision-aware DistributedOptimizer (TE's FusedAdam inside)."""
    return c.optimizer.use_precision_aware_optimizer or c.mode.states


def missing_prefixes(c: RunConfig) -> str:
    """dataset.data_path's prefixes without their .bin and .idx on this machine ("" where all
    are there, for mock data, or where the blend does not parse: another rule's)."""
    return ", ".join(
        p for p in data_prefixes(c) if not all(Path(f"{p}{s}").is_file() for s in (".bin", ".idx"))
    )


def _weight_decay(c: RunConfig, end: str) -> float:
    """scheduler.{start,end}_weight_decay, optimizer.weight_decay where unset."""
    found = getattr(c.scheduler, f"{end}_weight_decay")
    return c.optimizer.weight_decay if found is None else found


def foreign_metadata_of(c: RunConfig) -> str:
    """The first PREFIX.json beside dataset.data_path that is not --prepare's ("": none)."""
    from offload_runner.prepare import foreign_metadata

    found = (foreign_metadata(p) for p in data_prefixes(c))
    return str(next((f for f in found if f is not None), ""))


def pretrained_differs(c: RunConfig) -> str:
    """The first shape keys where checkpoint.pretrained_checkpoint's model.yaml and this run
    disagree, as "key=saved (this run: ours)" ("" where they agree or nothing says)."""
    saved = saved_architecture(c.checkpoint.pretrained_checkpoint)
    if not saved or has_checkpoint(c.checkpoint.load):
        return ""
    differ = [
        f"{k}={saved[k]} (this run: {getattr(c.model, k)})"
        for k in SHAPE_KEYS
        if k in saved and saved[k] != getattr(c.model, k)
    ]
    return ", ".join(differ[:3])


def loaded_precision(c: RunConfig) -> str:
    """The precision of checkpoint.load's optimizer states, as ``run_precision`` says it."""
    return saved_precision(c.checkpoint.load) or FP32_LAYOUT


def run_precision(c: RunConfig) -> str:
    return precision(c) or FP32_LAYOUT


def prepared_vocab(c: RunConfig) -> int:
    """The largest vocabulary among dataset.data_path's prefixes that --prepare wrote (0: none
    of them, or mock data)."""
    return max((m["vocab_size"] for m in prepared_metadata(c)), default=0)


def _low_precision_adam(c: RunConfig) -> bool:
    o = c.optimizer
    dtypes = (o.main_params_dtype, o.exp_avg_dtype, o.exp_avg_sq_dtype)
    return any(d.value != "fp32" for d in dtypes)


def _host_engine_dtypes_unsupported(c: RunConfig) -> bool:
    """offload-runner's host engines keep fp32 masters and fp32 or bf16 moments (Megatron-Core's
    own state offload allows the same); state offload also bf16 masters and 8-bit moments."""
    o = c.optimizer
    masters = ("fp32", "bf16") if c.mode.states else ("fp32",)
    moments = ("fp32", "bf16", "q8") if c.mode.states else ("fp32", "bf16")
    return o.main_params_dtype.value not in masters or not {
        o.exp_avg_dtype.value,
        o.exp_avg_sq_dtype.value,
    } <= set(moments)


def _lowest_precision(c: RunConfig) -> bool:
    """8-bit moments or bf16 masters (state offload's own: offload/quantized.py)."""
    o = c.optimizer
    return c.precision.q8 or (o.main_params_dtype.value == "bf16" and c.model.bf16)


FP32_LAYOUT = "Megatron-Core's layout with fp32 masters, which every engine loads"
DEPRECATED_CUDA_GRAPH_FLAGS = {
    "enable_cuda_graph": "local",
    "external_cuda_graph": "transformer_engine",
}


def _deprecated_cuda_graph_flag(c: RunConfig) -> str | None:
    """The deprecated CUDA-graph switch the user set (Megatron-Core maps it onto
    cuda_graph_impl in TransformerConfig.__post_init__), or None."""
    return next((f for f in DEPRECATED_CUDA_GRAPH_FLAGS if getattr(c.model, f, False)), None)


def _graph_impl(c: RunConfig) -> str:
    """The CUDA-graph implementation Megatron-Core runs: the deprecated switch's, where set."""
    return DEPRECATED_CUDA_GRAPH_FLAGS.get(
        _deprecated_cuda_graph_flag(c), c.model.cuda_graph_impl.value
    )


def _profiling_on(c: RunConfig) -> bool:
    return c.profiling.use_pytorch_profiler or c.profiling.use_nsys_profiler


def _data_parallel_size(c: RunConfig, env: Environment) -> int | None:
    per_replica = c.model.model_parallel_size
    if env.world_size is None or env.world_size % per_replica:
        return None
    return env.world_size // per_replica


CP_COMM_TYPES = (None, "p2p", "all_gather", "a2a")


def _heads_per_tp_rank(c: RunConfig) -> tuple[int, int]:
    """Attention heads and query groups on one TP rank."""
    m = c.model
    groups = m.num_query_groups or m.num_attention_heads
    return (
        m.num_attention_heads // m.tensor_model_parallel_size,
        groups // m.tensor_model_parallel_size,
    )


TE_INSTALL = "install Transformer Engine where the job runs: pip install 'offload-runner[te]'"

RULES: tuple[Rule, ...] = (
    # --- layer-level activation / weight offload (Megatron TransformerConfig, TE) -------------
    Rule(
        "cpu_offloading_needs_pp1",
        lambda c, e: c.mode.activations and c.model.pipeline_model_parallel_size > 1,
        "Currently there is no support for Pipeline parallelism with CPU offloading",
        "set model.pipeline_model_parallel_size=1, or offload the optimizer instead "
        "(offload/activation=disabled offload/weight=disabled offload/optimizer=cpu_50)",
    ),
    Rule(
        "cpu_offloading_without_recompute",
        # judged as Megatron-Core finally sees it: moe_layer_recompute turns on selective
        # recompute in TransformerConfig's own __post_init__, after its offload check ran
        lambda c, e: (
            c.mode.activations
            and (
                c.model.recompute_granularity is not None
                or getattr(c.model, "moe_layer_recompute", False)
            )
        ),
        "CPU offloading does not work when activation recomputation is enabled",
        "set model.recompute_granularity=null (and model.moe_layer_recompute=false), or "
        "offload/activation=disabled",
    ),
    Rule(
        "cpu_offloading_xor_fine_grained",
        lambda c, e: c.model.cpu_offloading and c.model.fine_grained_activation_offloading,
        "fine_grained_activation_offloading cannot be enabled with cpu_offloading.",
        "pick one: model.fine_grained_activation_offloading=false, or "
        "offload/activation=disabled offload/weight=disabled",
    ),
    Rule(
        "cpu_offloading_without_cuda_graphs",
        lambda c, e: c.model.cpu_offloading and c.model.cuda_graph_impl != CudaGraphImpl.none,
        "CUDA graphs not supported with CPU offloading.",
        "set model.cuda_graph_impl=none, or offload/activation=disabled offload/weight=disabled",
    ),
    Rule(
        "cpu_offloading_layer_range",
        lambda c, e: (
            c.mode.activations and not 0 <= c.model.cpu_offloading_num_layers < c.model.num_layers
        ),
        "CPU offloading can be done only for layers less than {m.num_layers}",
        "{offloadable_layers}",
    ),
    Rule(
        "cpu_offloading_what",
        lambda c, e: (
            c.model.cpu_offloading
            and not (c.model.cpu_offloading_activations or c.model.cpu_offloading_weights)
        ),
        "CPU Offloading is enabled while it is not mentioned what to offload (weights/activations)",
        "add offload/activation=enabled or offload/weight=enabled "
        "(model.cpu_offloading_activations=true / model.cpu_offloading_weights=true)",
    ),
    Rule(
        "deprecated_cuda_graph_flag_with_impl",
        lambda c, e: (
            _deprecated_cuda_graph_flag(c) is not None
            and c.model.cuda_graph_impl != CudaGraphImpl.none
        ),
        "Do not use enable_cuda_graph or external_cuda_graph with cuda_graph_impl.",
        "drop model.{deprecated_cuda_graph_flag} (the deprecated spelling of "
        "model.cuda_graph_impl={deprecated_cuda_graph_impl}) and keep model.cuda_graph_impl",
    ),
    Rule(
        "deprecated_cuda_graph_flag",
        lambda c, e: (
            _deprecated_cuda_graph_flag(c) is not None
            and c.model.cuda_graph_impl == CudaGraphImpl.none
        ),
        "model.{deprecated_cuda_graph_flag} is deprecated in Megatron-Core",
        "set model.cuda_graph_impl={deprecated_cuda_graph_impl} instead of "
        "model.{deprecated_cuda_graph_flag}",
        Level.warning,
    ),
    Rule(
        "weight_offload_needs_a_host_engine",
        lambda c, e: c.mode.weights and not (c.mode.states or c.mode.cpu_adam),
        "weight offload keeps its layers' masters and Adam moments on the host beside their "
        "weights, and the rest of the model's optimizer state must not pin the GPU either",
        "add offload/optimizer=states (or offload/optimizer=cpu_adam)",
    ),
    Rule(
        "weight_offload_not_delayed",
        lambda c, e: c.mode.weights and c.mode.delayed,
        "weight offload updates its layers exactly, after the step's gradient norm; the CPU-Adam "
        "engine's delayed mode would leave the rest of the model one step behind them",
        "use offload/optimizer=cpu_adam (exact) or offload/optimizer=states",
    ),
    Rule(
        "weight_offload_one_gpu",
        lambda c, e: (
            c.mode.weights
            and (
                c.model.model_parallel_size > 1
                or (e.world_size or 1) > 1
                or (c.launcher.nproc_per_node or 1) > 1
                or c.launcher.nnodes not in ("1", "1:1")
            )
        ),
        "weight offload runs on one GPU for now: the offloaded layers' gradients live outside "
        "Megatron-Core's DDP buffers, and no data-, tensor-, pipeline-, expert- or "
        "context-parallel reduction of them is built yet",
        "run on one GPU (launcher.nproc_per_node=1, parallel=single), or offload/weight=disabled",
    ),
    Rule(
        "weight_offload_bf16",
        lambda c, e: c.mode.weights and (not c.model.bf16 or c.model.fp8 is not None),
        "weight offload streams bf16 weights (no fp16 or fp32 model, no fp8 weight caches)",
        "set model.bf16=true (mixed_precision=bf16_mixed) and model.fp8=null",
    ),
    Rule(
        "weight_offload_layer_range",
        lambda c, e: c.mode.weights and c.model.cpu_offloading_num_layers > c.model.num_layers,
        "weight offload can move at most the model's {m.num_layers} layers",
        "set model.cpu_offloading_num_layers to 1..{m.num_layers}",
    ),
    Rule(
        "cpu_offloading_zero_layers",
        lambda c, e: c.model.cpu_offloading and c.model.cpu_offloading_num_layers == 0,
        "model.cpu_offloading=true with model.cpu_offloading_num_layers=0 offloads no layer "
        "(Megatron-Core accepts it and offloads nothing)",
        "set model.cpu_offloading_num_layers=K with 1 <= K <= {last_layer}, "
        "or model.cpu_offloading=false",
        Level.warning,  # a Megatron-Bridge command line that ran there must run here
    ),
    Rule(
        "cpu_offloading_num_layers_unused",
        lambda c, e: not c.model.cpu_offloading and c.model.cpu_offloading_num_layers > 0,
        "model.cpu_offloading_num_layers={m.cpu_offloading_num_layers} has no effect while "
        "model.cpu_offloading=false",
        "add offload/activation=enabled (or model.cpu_offloading=true)",
        Level.warning,
    ),
    Rule(
        "layer_offload_needs_te",
        lambda c, e: c.model.cpu_offloading and not e.te_available,
        "CPU offloading (model.cpu_offloading) runs inside Transformer Engine, which is not "
        "installed here",
        TE_INSTALL,
        environment=True,
    ),
    # --- module-level (fine-grained) activation offload ----------------------------------------
    Rule(
        "fine_grained_needs_modules",
        lambda c, e: c.model.fine_grained_activation_offloading and not c.model.offload_modules,
        "fine_grained_activation_offloading needs at least one module in model.offload_modules",
        "e.g. model.offload_modules=[core_attn,attn_proj,expert_fc1]",
    ),
    Rule(
        "fine_grained_attn_proj_needs_core_attn",
        lambda c, e: (
            c.model.fine_grained_activation_offloading
            and OffloadModule.attn_proj in (c.model.offload_modules or [])
            and OffloadModule.core_attn not in (c.model.offload_modules or [])
        ),
        "attn_proj cannot be set to offload_modules alone without core_attn because the input of "
        "attn_proj is the output of core_attn, which is needed in core_attn.backward().",
        "add core_attn to model.offload_modules",
    ),
    Rule(
        "offload_modules_unused",
        lambda c, e: (
            bool(c.model.offload_modules) and not c.model.fine_grained_activation_offloading
        ),
        "model.offload_modules has no effect while model.fine_grained_activation_offloading=false",
        "set model.fine_grained_activation_offloading=true, or model.offload_modules=[]",
        Level.warning,
    ),
    Rule(
        "expert_offload_needs_grouped_experts",
        lambda c, e: (
            c.model.fine_grained_activation_offloading
            and bool(
                {OffloadModule.expert_fc1, OffloadModule.moe_act}
                & set(c.model.offload_modules or [])
            )
            and not (c.model.num_moe_experts and c.model.moe_grouped_gemm)
        ),
        "model.offload_modules names expert_fc1 / moe_act, which only a MoE model's grouped-GEMM "
        "experts offload: here they move nothing (num_moe_experts={m.num_moe_experts}, "
        "moe_grouped_gemm={m.moe_grouped_gemm})",
        "drop expert_fc1 and moe_act from model.offload_modules (or set model.moe_grouped_gemm="
        "true on a MoE model)",
        Level.warning,
    ),
    Rule(
        "fine_grained_needs_te",
        lambda c, e: c.model.fine_grained_activation_offloading and not e.te_available,
        "fine_grained_activation_offloading needs Transformer Engine, which is not installed here",
        TE_INSTALL,
        environment=True,
    ),
    # --- optimizer CPU offload (Megatron-Core HybridDeviceOptimizer) ---------------------------
    Rule(
        "offload_fraction_range",
        lambda c, e: not 0.0 <= c.optimizer.optimizer_offload_fraction <= 1.0,
        "optimizer_offload_fraction must be in [0.0, 1.0]",
        "e.g. optimizer.optimizer_offload_fraction=0.5 (or offload/optimizer=cpu_50)",
    ),
    Rule(
        "cpu_offload_needs_distributed_optimizer",
        lambda c, e: (
            c.optimizer.optimizer_cpu_offload and not c.optimizer.use_distributed_optimizer
        ),
        "optimizer_cpu_offload requires the distributed optimizer",
        "set optimizer.use_distributed_optimizer=true",
    ),
    Rule(
        "cpu_offload_needs_adamw",
        lambda c, e: c.optimizer.optimizer_cpu_offload and not c.optimizer.decoupled_weight_decay,
        "CPU offloading only supported with decoupled_weight_decay enabled (AdamW mode).",
        "set optimizer.decoupled_weight_decay=true",
    ),
    Rule(
        "cpu_offload_needs_precision_aware",
        lambda c, e: (
            c.optimizer.optimizer_cpu_offload and not c.optimizer.use_precision_aware_optimizer
        ),
        "optimizer_cpu_offload runs on Megatron-Core's precision-aware optimizer path "
        "(use_precision_aware_optimizer=false was set)",
        "remove optimizer.use_precision_aware_optimizer=false (it follows optimizer_cpu_offload)",
    ),
    Rule(
        "cpu_offload_nothing_offloaded",
        lambda c, e: (
            c.optimizer.optimizer_cpu_offload and c.optimizer.optimizer_offload_fraction == 0.0
        ),
        "optimizer_cpu_offload=true with optimizer_offload_fraction=0.0 offloads nothing, and the "
        "precision-aware path it switches on costs GPU memory",
        "set optimizer.optimizer_offload_fraction (e.g. 0.5, or offload/optimizer=cpu_50), or "
        "offload/optimizer=disabled",
        Level.warning,
    ),
    Rule(
        "overlap_needs_cpu_offload",
        lambda c, e: (
            c.optimizer.overlap_cpu_optimizer_d2h_h2d and not c.optimizer.optimizer_cpu_offload
        ),
        "optimizer.overlap_cpu_optimizer_d2h_h2d has no effect while optimizer_cpu_offload=false",
        "add offload/optimizer=cpu_100 (or optimizer.optimizer_cpu_offload=true)",
        Level.warning,
    ),
    Rule(
        "torch_optimizer_for_cpu_offload_ignored",
        lambda c, e: (
            c.optimizer.use_torch_optimizer_for_cpu_offload
            and c.optimizer.optimizer == OptimizerType.adam
        ),
        "optimizer.use_torch_optimizer_for_cpu_offload has no effect with adam: Megatron-Core "
        "overwrites the GPU optimizer class right after reading it",
        "remove it; the CPU side always uses torch.optim.AdamW(fused=True)",
        Level.warning,
    ),
    Rule(
        "precision_aware_needs_adam",
        lambda c, e: (
            c.optimizer.use_precision_aware_optimizer
            and c.optimizer.optimizer != OptimizerType.adam
        ),
        "--use-precision-aware-optimizer only supported with adam",
        "set optimizer.optimizer=adam",
    ),
    Rule(
        "precision_aware_needs_distributed_optimizer",
        lambda c, e: (
            c.optimizer.use_precision_aware_optimizer and not c.optimizer.use_distributed_optimizer
        ),
        "--use-precision-aware-optimizer only supported with distributed optimizer",
        "set optimizer.use_distributed_optimizer=true",
    ),
    Rule(
        "precision_aware_needs_te",
        lambda c, e: _precision_aware(c) and not e.te_available,
        "the precision-aware optimizer (needed by optimizer_cpu_offload and "
        "offload/optimizer=states) uses Transformer Engine's FusedAdam, which is not installed "
        "here",
        TE_INSTALL,
        environment=True,
    ),
    # --- speed settings (conf/speed) -----------------------------------------------------------
    Rule(
        "fusions_need_te",
        lambda c, e: bool(te_fusions(c)) and not e.te_available,
        "{te_fusions} run inside Transformer Engine, which is not installed here",
        TE_INSTALL + ", or add speed=plain (Megatron-Core's unfused defaults)",
        environment=True,
    ),
    Rule(
        "query_groups_divide_heads",
        lambda c, e: (
            bool(c.model.num_query_groups)
            and c.model.num_attention_heads % c.model.num_query_groups != 0
        ),
        "model.num_attention_heads={m.num_attention_heads} is not a multiple of "
        "model.num_query_groups={m.num_query_groups}: each query group shares its key and value "
        "among the same number of heads",
        "set model.num_query_groups to a divisor of {m.num_attention_heads} (1 for one group)",
    ),
    Rule(
        "te_cuda_graphs_not_captured",
        lambda c, e: _graph_impl(c) == CudaGraphImpl.transformer_engine.value,
        "model.cuda_graph_impl=transformer_engine is captured by the training loop's "
        "TECudaGraphHelper, which offload-runner's loop does not run: the layers would run eagerly",
        "set model.cuda_graph_impl=local (Megatron-Core's schedules capture it) or none",
    ),
    Rule(
        "gradient_accumulation_fusion_needs_apex",
        lambda c, e: (
            getattr(c.model, "gradient_accumulation_fusion", False) and not e.fused_wgrad_available
        ),
        "model.gradient_accumulation_fusion needs APEX's fused_weight_gradient_mlp_cuda extension "
        "(Megatron-Core's output layer calls it at build), which is not installed here",
        "set model.gradient_accumulation_fusion=false, or install APEX with its CUDA extensions "
        "where the job runs",
        environment=True,
    ),
    # --- CPU-Adam engine (offload-runner; the optimizer_cpu_offload rules above apply too) ------
    Rule(
        "cpu_adam_needs_cpu_offload",
        lambda c, e: _cpu_adam_selected(c) and not c.optimizer.optimizer_cpu_offload,
        "optimizer.cpu_offload_engine=cpu_adam has no effect while optimizer_cpu_offload=false",
        "add offload/optimizer=cpu_adam (or optimizer.optimizer_cpu_offload=true)",
        Level.warning,
    ),
    Rule(
        "delayed_update_needs_cpu_adam",
        lambda c, e: c.optimizer.cpu_adam_delayed_update and not _cpu_adam_selected(c),
        "optimizer.cpu_adam_delayed_update needs offload-runner's CPU-Adam engine "
        "(HybridDeviceOptimizer has no delayed update)",
        "use offload/optimizer=cpu_adam_delayed (or optimizer.cpu_offload_engine=cpu_adam)",
    ),
    Rule(
        "cpu_adam_needs_bf16",
        lambda c, e: c.mode.cpu_adam and not c.model.bf16,
        "the CPU-Adam engine rounds its fp32 masters into bf16 parameters; model.bf16=false "
        "trains in fp32",
        "set model.bf16=true, or use offload/optimizer=cpu_100 (HybridDeviceOptimizer)",
    ),
    Rule(
        "cpu_adam_overlap_flag_unused",
        lambda c, e: c.mode.cpu_adam and c.optimizer.overlap_cpu_optimizer_d2h_h2d,
        "optimizer.overlap_cpu_optimizer_d2h_h2d is HybridDeviceOptimizer's: the CPU-Adam engine "
        "always overlaps its copies with the CPU step",
        "remove optimizer.overlap_cpu_optimizer_d2h_h2d",
        Level.warning,
    ),
    Rule(
        "cpu_adam_exact_steps_non_negative",
        lambda c, e: (
            c.optimizer.cpu_adam_exact_steps is not None and c.optimizer.cpu_adam_exact_steps < 0
        ),
        "optimizer.cpu_adam_exact_steps must be >= 0 (exact steps before delayed updates start)",
        "e.g. optimizer.cpu_adam_exact_steps=100, or null for the end of the learning-rate warmup",
    ),
    Rule(
        "weight_prediction_needs_delayed_mode",
        lambda c, e: c.optimizer.cpu_adam_weight_prediction and not c.mode.delayed,
        "optimizer.cpu_adam_weight_prediction only acts in the CPU-Adam engine's delayed mode "
        "(exact mode lands every update before the next forward)",
        "drop the key, or offload/optimizer=cpu_adam_delayed",
        Level.warning,
    ),
    Rule(
        "exact_columns_need_delayed_mode",
        lambda c, e: bool(c.optimizer.cpu_adam_exact_columns) and not c.mode.delayed,
        "optimizer.cpu_adam_exact_columns updates columns exactly beside the CPU-Adam engine's "
        "delayed updates, and no update is delayed here",
        "drop the key, or offload/optimizer=cpu_adam_delayed",
    ),
    Rule(
        "gpu_share_needs_cpu_adam",
        lambda c, e: bool(c.optimizer.cpu_adam_gpu_share) and not c.mode.cpu_adam,
        "optimizer.cpu_adam_gpu_share splits the CPU-Adam engine's update between the CPU and "
        "the GPU, and that engine is off",
        "drop the key, or use offload/optimizer=cpu_adam (or cpu_adam_delayed)",
    ),
    Rule(
        "gpu_share_not_with_weight_prediction",
        lambda c, e: (
            bool(c.optimizer.cpu_adam_gpu_share) and c.mode.cpu_adam and not c.mode.streams
        ),
        "optimizer.cpu_adam_weight_prediction extrapolates every delayed update on the CPU, and "
        "optimizer.cpu_adam_gpu_share would run part of them on the GPU",
        "set optimizer.cpu_adam_gpu_share=0, or optimizer.cpu_adam_weight_prediction=false",
    ),
    Rule(
        "delayed_scope_needs_delayed_mode",
        lambda c, e: c.optimizer.cpu_adam_delayed_scope != DelayedScope.all and not c.mode.delayed,
        "optimizer.cpu_adam_delayed_scope={o.cpu_adam_delayed_scope.value} only acts in the "
        "CPU-Adam engine's delayed mode",
        "use offload/optimizer=cpu_adam_delayed_experts, or drop the key",
    ),
    Rule(
        "delayed_experts_need_moe",
        lambda c, e: (
            c.optimizer.cpu_adam_delayed_scope == DelayedScope.experts
            and c.mode.delayed
            and not c.model.num_moe_experts
        ),
        "optimizer.cpu_adam_delayed_scope=experts delays a MoE model's routed experts, and this "
        "model has none (model.num_moe_experts is not set): every update would be exact",
        "use offload/optimizer=cpu_adam (exact), or optimizer.cpu_adam_delayed_scope=all",
    ),
    Rule(
        "delayed_experts_need_their_own_optimizer_part",
        lambda c, e: (
            c.optimizer.cpu_adam_delayed_scope == DelayedScope.experts
            and c.mode.delayed
            and bool(c.model.num_moe_experts)
            and not c.model.experts_own_optimizer_part
        ),
        "optimizer.cpu_adam_delayed_scope=experts needs the routed experts in an optimizer part "
        "of their own, which Megatron-Core builds only with expert parallelism "
        "(expert_model_parallel_size={m.expert_model_parallel_size}: they join the dense part)",
        "set model.expert_model_parallel_size=2 or more (e.g. parallel=ep2), or use "
        "offload/optimizer=cpu_adam (exact) or cpu_adam_delayed",
    ),
    Rule(
        "delayed_updates_learn_slower",
        lambda c, e: c.mode.delayed or c.planner.auto_delayed,
        "delayed CPU-Adam updates learn slower: on real text (suite convergence, "
        "docs/benchmarks/convergence.md) every delayed row ended outside 2% of exact training's "
        "validation loss, weight prediction and delaying the routed experts alone included",
        "use offload/optimizer=cpu_adam or states (exact) where the step allows; delayed mode "
        "trades loss for step time",
        Level.warning,
    ),
    Rule(
        "auto_delayed_needs_auto",
        lambda c, e: c.planner.auto_delayed and not c.planner.auto_optimizer,
        "planner.auto_delayed only acts when offload/optimizer=auto chooses the optimizer offload",
        "add offload/optimizer=auto, or drop planner.auto_delayed",
        Level.warning,
    ),
    Rule(
        "forward_backward_time_for_delayed_mode",
        lambda c, e: (
            c.planner.forward_backward_s is not None
            and not c.planner.auto_delayed
            and not c.mode.delayed
        ),
        "planner.forward_backward_s only prices delayed mode (its CPU update hides under "
        "forward+backward); exact offloads and state offload do not overlap with it",
        "drop it, or use offload/optimizer=cpu_adam_delayed (or planner.auto_delayed=true)",
        Level.warning,
    ),
    Rule(
        "auto_delayed_needs_cpu_adam",
        lambda c, e: c.planner.auto_delayed and c.planner.auto_engine != CpuOffloadEngine.cpu_adam,
        "planner.auto_delayed picks offload-runner's CPU-Adam engine in delayed mode; "
        "HybridDeviceOptimizer has no delayed mode",
        "set planner.auto_engine=cpu_adam, or planner.auto_delayed=false",
    ),
    Rule(
        "optimizer_dtypes_with_cpu_offload",
        lambda c, e: (
            c.optimizer.optimizer_cpu_offload
            and not _cpu_adam_selected(c)
            and _low_precision_adam(c)
        ),
        "optimizer_cpu_offload keeps Adam's states and masters in fp32 on the host; "
        "main_params_dtype / exp_avg_dtype / exp_avg_sq_dtype other than fp32 are not supported",
        "use offload/optimizer=cpu_adam (bf16 moments on the host), or drop the optimizer.*_dtype "
        "keys",
    ),
    Rule(
        "lowest_precision_needs_state_offload",
        lambda c, e: (
            _lowest_precision(c) and not c.mode.states and not c.optimizer.optimizer_cpu_offload
        ),
        "8-bit moments (q8) and bf16 masters are state offload's: its engine quantizes them in "
        "the window (exp_avg_dtype={o.exp_avg_dtype.value}, exp_avg_sq_dtype="
        "{o.exp_avg_sq_dtype.value}, main_params_dtype={o.main_params_dtype.value})",
        "add offload/optimizer=states, or use bf16 moments",
    ),
    Rule(
        "cpu_adam_dtypes",
        lambda c, e: c.mode.cpu_adam and _host_engine_dtypes_unsupported(c),
        "the CPU-Adam engine keeps fp32 master weights and fp32 or bf16 moments on the host "
        "(main_params_dtype={o.main_params_dtype.value}, exp_avg_dtype={o.exp_avg_dtype.value}, "
        "exp_avg_sq_dtype={o.exp_avg_sq_dtype.value})",
        "set optimizer.main_params_dtype=fp32 and exp_avg_dtype / exp_avg_sq_dtype to fp32 or bf16",
    ),
    # --- optimizer-state offload (offload-runner) ----------------------------------------------
    Rule(
        "states_xor_cpu_offload",
        lambda c, e: c.mode.states and c.optimizer.optimizer_cpu_offload,
        "offload_optimizer_states can not be used with optimizer_cpu_offload.",
        "pick one: offload/optimizer=states, or offload/optimizer=cpu_adam (or cpu_25 ... cpu_100)",
    ),
    Rule(
        "states_need_distributed_optimizer",
        lambda c, e: c.mode.states and not c.optimizer.use_distributed_optimizer,
        "offload_optimizer_states requires the distributed optimizer",
        "set optimizer.use_distributed_optimizer=true",
    ),
    Rule(
        "states_need_bf16",
        lambda c, e: c.mode.states and not c.model.bf16,
        "offload/optimizer=states streams the fp32 masters of bf16 parameters, and model.bf16="
        "false has none: nothing would leave the GPU",
        "set model.bf16=true",
    ),
    Rule(
        "states_need_adamw",
        lambda c, e: c.mode.states and not c.optimizer.decoupled_weight_decay,
        "offload/optimizer=states runs AdamW (decoupled weight decay) on the window",
        "set optimizer.decoupled_weight_decay=true",
    ),
    Rule(
        "states_need_fp32_masters",
        lambda c, e: c.mode.states and _host_engine_dtypes_unsupported(c),
        "optimizer state offload keeps fp32 or bf16 master weights and fp32, bf16 or 8-bit (q8) "
        "moments (main_params_dtype={o.main_params_dtype.value}, exp_avg_dtype="
        "{o.exp_avg_dtype.value}, exp_avg_sq_dtype={o.exp_avg_sq_dtype.value})",
        "set optimizer.main_params_dtype=fp32 (or bf16) and exp_avg_dtype / exp_avg_sq_dtype to "
        "fp32, bf16 or q8",
    ),
    Rule(
        "lowest_precision_whole_shard",
        lambda c, e: (
            c.mode.states
            and _lowest_precision(c)
            and c.optimizer.optimizer_state_offload_fraction < 1.0
        ),
        "8-bit moments and bf16 masters live on the host only; a GPU share "
        "(optimizer_state_offload_fraction={o.optimizer_state_offload_fraction}) would keep "
        "its own in another precision",
        "set optimizer.optimizer_state_offload_fraction=1.0, or use bf16 moments",
    ),
    Rule(
        "lowest_precision_beside_weight_offload",
        lambda c, e: _lowest_precision(c) and c.model.cpu_offloading_weights,
        "weight offload keeps its layers' masters and moments in fp32 or bf16: 8-bit moments and "
        "bf16 masters are state offload's alone",
        "use bf16 moments beside offload/weight, or drop offload/weight",
    ),
    Rule(
        "checkpoint_precision_differs",
        lambda c, e: has_checkpoint(c.checkpoint.load) and loaded_precision(c) != run_precision(c),
        "checkpoint.load={c.checkpoint.load} holds the optimizer states as {loaded_precision}, "
        "this run keeps {run_precision}: 8-bit moments and bf16 masters are saved as they are "
        "and load into the same precision only",
        "resume with the optimizer.exp_avg_dtype, exp_avg_sq_dtype and main_params_dtype it was "
        "saved with",
        environment=True,
    ),
    Rule(
        "states_fraction_range",
        lambda c, e: not 0.0 < c.optimizer.optimizer_state_offload_fraction <= 1.0,
        "optimizer_state_offload_fraction must be in (0, 1]: the share of each rank's optimizer "
        "shard whose states live on the host (got {o.optimizer_state_offload_fraction})",
        "e.g. optimizer.optimizer_state_offload_fraction=0.5",
    ),
    Rule(
        "states_fraction_needs_state_offload",
        lambda c, e: c.optimizer.optimizer_state_offload_fraction != 1.0 and not c.mode.states,
        "optimizer.optimizer_state_offload_fraction acts on optimizer state offload, which is off",
        "add offload/optimizer=states (or optimizer.chunked_optimizer_state_offload=true)",
    ),
    Rule(
        "states_chunk_size_non_negative",
        lambda c, e: c.optimizer.optimizer_state_offload_chunk_size_mb < 0,
        "optimizer_state_offload_chunk_size_mb must be >= 0 (0: the default window)",
        "e.g. optimizer.optimizer_state_offload_chunk_size_mb=128",
    ),
    Rule(
        "states_not_with_megatron_fsdp",
        lambda c, e: c.mode.states and (c.ddp.use_megatron_fsdp or c.ddp.use_custom_fsdp),
        "Optimizer state offload is not supported with Megatron-FSDP.",
        "set ddp.use_megatron_fsdp=false, or offload/optimizer=disabled",
    ),
    Rule(
        "states_need_adam",
        lambda c, e: c.mode.states and c.optimizer.optimizer != OptimizerType.adam,
        "offload_optimizer_states requires optimizer.optimizer=adam",
        "set optimizer.optimizer=adam",
    ),
    # --- shapes and parallel layout (these otherwise fail deep inside a rank) -----------------
    Rule(
        "heads_divisible_by_tp",
        lambda c, e: c.model.num_attention_heads % c.model.tensor_model_parallel_size != 0,
        "num_attention_heads ({m.num_attention_heads}) must be divisible by "
        "tensor_model_parallel_size ({m.tensor_model_parallel_size})",
        "choose model.tensor_model_parallel_size among the divisors of {m.num_attention_heads}",
    ),
    Rule(
        "query_groups_divisible_by_tp",
        lambda c, e: (
            c.model.num_query_groups is not None
            and c.model.num_query_groups % c.model.tensor_model_parallel_size != 0
        ),
        "num_query_groups ({m.num_query_groups}) must be divisible by "
        "tensor_model_parallel_size ({m.tensor_model_parallel_size})",
        "choose model.tensor_model_parallel_size among the divisors of {m.num_query_groups}",
    ),
    Rule(
        "layers_divisible_by_pp",
        lambda c, e: c.model.num_layers % c.model.pipeline_model_parallel_size != 0,
        "num_layers ({m.num_layers}) must be divisible by pipeline_model_parallel_size "
        "({m.pipeline_model_parallel_size})",
        "choose model.pipeline_model_parallel_size among the divisors of {m.num_layers}",
    ),
    Rule(
        "ep_needs_moe",
        lambda c, e: c.model.expert_model_parallel_size > 1 and not c.model.num_moe_experts,
        "expert_model_parallel_size={m.expert_model_parallel_size} needs a MoE model "
        "(model.num_moe_experts is not set)",
        "set model.expert_model_parallel_size=1 (parallel=single) for a dense model",
    ),
    Rule(
        "experts_divisible_by_ep",
        lambda c, e: (
            bool(c.model.num_moe_experts)
            and c.model.num_moe_experts % c.model.expert_model_parallel_size != 0
        ),
        "num_moe_experts ({m.num_moe_experts}) must be divisible by expert_model_parallel_size "
        "({m.expert_model_parallel_size})",
        "choose model.expert_model_parallel_size among the divisors of {m.num_moe_experts}",
    ),
    Rule(
        "topk_at_most_experts",
        lambda c, e: (
            bool(c.model.num_moe_experts) and c.model.moe_router_topk > c.model.num_moe_experts
        ),
        "moe_router_topk ({m.moe_router_topk}) exceeds num_moe_experts ({m.num_moe_experts})",
        "set model.moe_router_topk <= {m.num_moe_experts}",
    ),
    Rule(
        "batch_divisible_by_micro_batch",
        lambda c, e: c.train.global_batch_size % c.train.micro_batch_size != 0,
        "global_batch_size ({t.global_batch_size}) must be a multiple of micro_batch_size "
        "({t.micro_batch_size})",
        "change train.global_batch_size or train.micro_batch_size",
    ),
    Rule(
        "world_fits_model_parallel",
        lambda c, e: e.world_size is not None and _data_parallel_size(c, e) is None,
        "{env.world_size} GPUs can not be split into TP{m.tensor_model_parallel_size} x "
        "PP{m.pipeline_model_parallel_size} x CP{m.context_parallel_size} model replicas",
        "use a multiple of TP*PP*CP GPUs (launcher.nproc_per_node / launcher.nnodes), or change "
        "the parallel layout (parallel=...)",
    ),
    Rule(
        "world_fits_expert_parallel",
        lambda c, e: (
            e.world_size is not None
            and bool(c.model.num_moe_experts)
            and e.world_size % c.model.expert_layout_size != 0
        ),
        "{env.world_size} GPUs can not hold EP{m.expert_model_parallel_size} x "
        "PP{m.pipeline_model_parallel_size} expert groups",
        "use a multiple of EP*ETP*PP GPUs, or change model.expert_model_parallel_size",
    ),
    Rule(
        "batch_divisible_by_data_parallel",
        lambda c, e: (
            (dp := _data_parallel_size(c, e)) is not None
            and c.train.global_batch_size % (c.train.micro_batch_size * dp) != 0
        ),
        "global_batch_size ({t.global_batch_size}) must be a multiple of micro_batch_size x "
        "data-parallel size on {env.world_size} GPUs",
        "change train.global_batch_size, train.micro_batch_size or the GPU count",
    ),
    Rule(
        "multinode_needs_rendezvous",
        lambda c, e: c.launcher.nnodes not in ("1", "1:1") and not c.launcher.rdzv_endpoint,
        "launcher.nnodes={c.launcher.nnodes} needs launcher.rdzv_endpoint (host:port on node 0)",
        "add launcher.rdzv_endpoint=node0:29400 (the same on every node)",
    ),
    # --- context parallelism (the sequence split over CP ranks; attention in Transformer Engine)
    Rule(
        "context_parallel_sequence_split",
        lambda c, e: c.model.seq_length % (2 * c.model.context_parallel_size) != 0,
        "seq_length ({m.seq_length}) must be divisible by 2 x context_parallel_size "
        "({m.context_parallel_size}): each CP rank takes 2 of 2 x CP equal chunks",
        "change model.seq_length or model.context_parallel_size",
    ),
    Rule(
        "context_parallel_needs_te_spec",
        lambda c, e: (
            c.model.context_parallel_size > 1 and c.model.transformer_impl == TransformerImpl.local
        ),
        "Context parallelism is only supported by TEDotProductAttention!",
        "set model.transformer_impl=transformer_engine, or model.context_parallel_size=1",
    ),
    Rule(
        "context_parallel_needs_te",
        lambda c, e: c.model.context_parallel_size > 1 and not e.te_available,
        "Context parallelism is only supported by TEDotProductAttention! (Transformer Engine is "
        "not installed here)",
        TE_INSTALL,
        environment=True,
    ),
    Rule(
        "cp_comm_type_known",
        lambda c, e: c.model.cp_comm_type not in CP_COMM_TYPES,
        "model.cp_comm_type={m.cp_comm_type} is not one of p2p, all_gather, a2a (a2a+p2p needs "
        "hierarchical CP groups, which offload-runner does not build)",
        "set model.cp_comm_type=p2p (Megatron-Core's default), all_gather or a2a",
    ),
    Rule(
        "cp_a2a_heads_divisible",
        lambda c, e: (
            c.model.context_parallel_size > 1
            and c.model.cp_comm_type == "a2a"
            and any(h % c.model.context_parallel_size for h in _heads_per_tp_rank(c))
        ),
        "cp_comm_type=a2a splits attention heads over CP ranks: the heads ({m.num_attention_heads})"
        " and query groups ({m.num_query_groups}) per TP rank must be divisible by "
        "context_parallel_size ({m.context_parallel_size})",
        "set model.cp_comm_type=p2p, or a context_parallel_size that divides the head counts",
    ),
    Rule(
        "cp_comm_type_unused",
        lambda c, e: c.model.cp_comm_type is not None and c.model.context_parallel_size == 1,
        "model.cp_comm_type={m.cp_comm_type} has no effect while context_parallel_size=1",
        "set model.context_parallel_size (e.g. parallel=cp2), or remove model.cp_comm_type",
        Level.warning,
    ),
    # --- run-level -------------------------------------------------------------------------------
    Rule(
        "adam_beta_below_one",
        lambda c, e: c.optimizer.adam_beta1 >= 1 or c.optimizer.adam_beta2 >= 1,
        "optimizer.adam_beta1={o.adam_beta1}, adam_beta2={o.adam_beta2}: Adam's betas must be "
        "below 1 (torch refuses 1: the moments would never move)",
        "e.g. optimizer.adam_beta1=0.9 optimizer.adam_beta2=0.95",
    ),
    Rule(
        "min_lr_above_lr",
        lambda c, e: c.optimizer.min_lr > c.optimizer.lr,
        "optimizer.min_lr={o.min_lr} is above optimizer.lr={o.lr}: the schedule would decay "
        "upwards",
        "set optimizer.min_lr at or below optimizer.lr (e.g. a tenth of it)",
    ),
    Rule(
        "warmup_init_above_lr",
        lambda c, e: c.scheduler.lr_warmup_init > c.optimizer.lr,
        "scheduler.lr_warmup_init={c.scheduler.lr_warmup_init} is above optimizer.lr={o.lr}: "
        "the warm-up would lower the learning rate",
        "set scheduler.lr_warmup_init below optimizer.lr (0 is the usual start)",
    ),
    Rule(
        "weight_decay_ramp_falls",
        lambda c, e: (
            c.scheduler.weight_decay_incr_style.value != "constant"
            and _weight_decay(c, "start") > _weight_decay(c, "end")
        ),
        "scheduler.start_weight_decay is above end_weight_decay: Megatron-Core's weight-decay "
        "schedule ({c.scheduler.weight_decay_incr_style.value}) only rises",
        "swap them, or set scheduler.weight_decay_incr_style=constant",
    ),
    Rule(
        "q8_moments_need_torchao",
        lambda c, e: c.precision.q8 and not e.torchao_available,
        "8-bit moments (optimizer.exp_avg_dtype / exp_avg_sq_dtype=q8, or auto's last step) "
        "quantize with torchao, which is not installed here",
        "pip install 'torchao>=0.10' where the job runs, or use bf16 moments",
        environment=True,
    ),
    Rule(
        "chunked_loss_needs_tp1",
        lambda c, e: c.model.chunked_loss and c.model.tensor_model_parallel_size > 1,
        "model.chunked_loss keeps the whole vocabulary on one GPU; at "
        "tensor_model_parallel_size={m.tensor_model_parallel_size} Megatron-Core's vocab-parallel "
        "cross entropy already splits the logits over the TP ranks",
        "drop model.chunked_loss, or use tensor_model_parallel_size=1",
    ),
    Rule(
        "pretrained_checkpoint_missing",
        lambda c, e: (
            bool(c.checkpoint.pretrained_checkpoint)
            and not holds_checkpoint(c.checkpoint.pretrained_checkpoint)
        ),
        "checkpoint.pretrained_checkpoint={c.checkpoint.pretrained_checkpoint} holds no checkpoint",
        "point it at an --import-hf output or a saved run's checkpoint folder",
    ),
    Rule(
        "load_weights_only",
        lambda c, e: weights_only(c.checkpoint.load),
        "checkpoint.load={c.checkpoint.load} holds weights only (an --import-hf output or a "
        "checkpoint.save_optim=false save): there is no optimizer or schedule to resume",
        "start from its weights with checkpoint.pretrained_checkpoint={c.checkpoint.load}",
    ),
    Rule(
        "pretrained_architecture_differs",
        lambda c, e: bool(pretrained_differs(c)),
        "checkpoint.pretrained_checkpoint={c.checkpoint.pretrained_checkpoint} holds a model with "
        "{pretrained_differs}",
        "train it with the recipe beside it (--recipe {c.checkpoint.pretrained_checkpoint}/"
        "recipe.yaml) or with model.* set to match",
    ),
    Rule(
        "prepared_metadata_foreign",
        lambda c, e: bool(foreign_metadata_of(c)),
        "{foreign_metadata} beside dataset.data_path's prefix is not --prepare's metadata (a JSON "
        "object with vocab_size and eod_id)",
        "move that file away, or prepare the text again with --prepare",
    ),
    Rule(
        "sft_needs_chat_data",
        lambda c, e: (
            c.dataset.kind == DatasetKind.sft
            and any(not m.get("chat") for m in prepared_metadata(c))
        ),
        "data=sft trains on chat data's answers: dataset.data_path holds a prefix --prepare made "
        "from plain text (no loss mask)",
        "prepare chat jsonl with --prepare FILE.jsonl --tokenizer HF_DIR, or use data=indexed",
    ),
    Rule(
        "chat_data_without_sft",
        lambda c, e: (
            c.dataset.kind == DatasetKind.indexed
            and any(m.get("chat") for m in prepared_metadata(c))
        ),
        "data=indexed on chat data trains on every token, prompts and role headers too",
        "use data=sft to train on the answers only",
        Level.warning,
    ),
    Rule(
        "save_interval_without_save",
        lambda c, e: c.checkpoint.save_interval is not None and not c.checkpoint.save,
        "checkpoint.save_interval is set but checkpoint.save (the folder) is not: nothing is saved",
        "add checkpoint.save=/path/to/checkpoints",
        Level.warning,
    ),
    Rule(
        "indexed_needs_data_path",
        lambda c, e: c.dataset.kind != DatasetKind.mock and not c.dataset.data_path,
        "dataset.kind={c.dataset.kind.value} needs dataset.data_path (a .bin/.idx prefix or a "
        "blend)",
        "add dataset.data_path=[/data/my_text_document], or data=mock",
    ),
    Rule(
        "data_path_missing",
        lambda c, e: bool(missing_prefixes(c)),
        "dataset.data_path: no .bin/.idx here for {missing_prefixes}",
        "prepare it (python run_recipe.py --prepare TEXT --output PREFIX), or fix the path",
        environment=True,
    ),
    Rule(
        "prepared_vocab_exceeds_model",
        lambda c, e: prepared_vocab(c) > c.model.vocab_size,
        "dataset.data_path was prepared with a tokenizer of {prepared_vocab} ids, more than "
        "model.vocab_size={m.vocab_size}",
        "set model.vocab_size={prepared_vocab}",
    ),
    Rule(
        "prepared_eods_differ",
        lambda c, e: len(prepared_eods(c)) > 1,
        "dataset.data_path blends prefixes prepared with different end-of-document ids "
        "({prepared_eods})",
        "prepare every prefix with one tokenizer: --prepare ... --tokenizer A.tokenizer.json",
    ),
    Rule(
        "manual_gc_interval_unused",
        lambda c, e: c.train.manual_gc_interval > 0 and not c.train.manual_gc,
        "train.manual_gc_interval={t.manual_gc_interval} has no effect while train.manual_gc=false",
        "add train.manual_gc=true (or drop train.manual_gc_interval)",
        Level.warning,
    ),
    Rule(
        "tensorboard_needs_package",
        lambda c, e: bool(c.logger.tensorboard_dir) and not e.tensorboard_available,
        "logger.tensorboard_dir is set, and the tensorboard package is not installed here",
        "pip install 'offload-runner[tensorboard]' where the job runs, or drop "
        "logger.tensorboard_dir",
        environment=True,
    ),
    # --- profiling -------------------------------------------------------------------------------
    Rule(
        "profile_one_tool",
        lambda c, e: c.profiling.use_pytorch_profiler and c.profiling.use_nsys_profiler,
        "profiling.use_pytorch_profiler and profiling.use_nsys_profiler are exclusive",
        "keep one: profiling.use_nsys_profiler=false (or use_pytorch_profiler=false)",
    ),
    Rule(
        "profile_window",
        lambda c, e: (
            _profiling_on(c)
            and not 1 <= c.profiling.profile_step_start <= c.profiling.profile_step_end
        ),
        "profiling window {c.profiling.profile_step_start}..{c.profiling.profile_step_end} is "
        "empty (iterations count from 1)",
        "set 1 <= profiling.profile_step_start <= profiling.profile_step_end",
    ),
    Rule(
        "profile_window_after_end",
        lambda c, e: (
            _profiling_on(c)
            and c.train.train_iters < c.profiling.profile_step_start <= c.profiling.profile_step_end
        ),
        "profiling starts at iteration {c.profiling.profile_step_start}, after the last one "
        "({t.train_iters}): nothing would be profiled",
        "set profiling.profile_step_start to at most {t.train_iters}",
    ),
    # --- Megatron-Bridge's sections: keys that must agree, values not supported here ---------
    Rule(
        "distributed_optimizer_sections_differ",
        lambda c, e: c.ddp.use_distributed_optimizer != c.optimizer.use_distributed_optimizer,
        "ddp.use_distributed_optimizer={c.ddp.use_distributed_optimizer} and "
        "optimizer.use_distributed_optimizer={o.use_distributed_optimizer} differ",
        "set both to the same value (ddp.* follows optimizer.* when only that one is set)",
    ),
    Rule(
        "dataset_seq_length_differs",
        lambda c, e: c.dataset.seq_length != c.model.seq_length,
        "dataset.seq_length={c.dataset.seq_length} and model.seq_length={m.seq_length} differ",
        "set both to the same value (dataset.* follows model.* when only that one is set)",
    ),
    Rule(
        "tokenizer_vocab_differs",
        lambda c, e: c.tokenizer.vocab_size not in (None, c.model.vocab_size),
        "tokenizer.vocab_size={c.tokenizer.vocab_size} and model.vocab_size={m.vocab_size} "
        "differ (the model's embedding is sized by model.vocab_size)",
        "set model.vocab_size={c.tokenizer.vocab_size}",
    ),
    Rule(
        "tokenizer_vocab_divisor_differs",
        lambda c, e: (
            c.tokenizer.make_vocab_size_divisible_by
            not in (None, c.model.make_vocab_size_divisible_by)
        ),
        "tokenizer.make_vocab_size_divisible_by={c.tokenizer.make_vocab_size_divisible_by} and "
        "model.make_vocab_size_divisible_by={m.make_vocab_size_divisible_by} differ",
        "set model.make_vocab_size_divisible_by={c.tokenizer.make_vocab_size_divisible_by}",
    ),
    Rule(
        "dataset_blend_spelling",
        lambda c, e: c.dataset.blend is not None or c.dataset.blend_per_split is not None,
        "dataset.blend / dataset.blend_per_split are Megatron-Bridge's Python spelling of a blend",
        "give the prefixes as data=indexed dataset.data_path=[0.7,/data/a,0.3,/data/b]",
    ),
    Rule(
        "checkpoint_format",
        lambda c, e: c.checkpoint.ckpt_format.value != "torch_dist",
        "checkpoint.ckpt_format={c.checkpoint.ckpt_format.value}: offload-runner saves and loads "
        "Megatron-Core dist_checkpointing (torch_dist) checkpoints only",
        "set checkpoint.ckpt_format=torch_dist",
    ),
    Rule(
        "fp16_not_supported",
        lambda c, e: c.mixed_precision.fp16,
        "fp16 mixed precision is not supported by offload-runner (bf16 or fp32 only)",
        "use mixed_precision=bf16_mixed (or mixed_precision.fp16=false)",
    ),
    Rule(
        "fp8_not_supported",
        lambda c, e: c.model.fp8 is not None,
        "FP8 training (model.fp8={m.fp8}) is not supported by offload-runner: its offload engines "
        "keep bf16 parameters and fp32 masters, and FP8 runs are not tested with them",
        "use mixed_precision=bf16_mixed (or mixed_precision.fp8=null)",
    ),
    Rule(
        "virtual_pipeline_needs_pipeline",
        lambda c, e: (
            (c.model.virtual_pipeline_model_parallel_size or 1) > 1
            and c.model.pipeline_model_parallel_size == 1
        ),
        "virtual_pipeline_model_parallel_size={m.virtual_pipeline_model_parallel_size} needs "
        "pipeline parallelism (model.pipeline_model_parallel_size > 1)",
        "set model.pipeline_model_parallel_size=2 or more, or "
        "model.virtual_pipeline_model_parallel_size=null",
    ),
    Rule(
        "wsd_needs_decay_iters",
        lambda c, e: (
            c.scheduler.lr_decay_style.value == "WSD" and not c.scheduler.lr_wsd_decay_iters
        ),
        "scheduler.lr_decay_style=WSD needs the length of its final decay",
        "set scheduler.lr_wsd_decay_iters=N (e.g. a tenth of train.train_iters)",
    ),
    Rule(
        "flex_dispatcher_needs_deep_ep",
        lambda c, e: c.model.moe_token_dispatcher_type.value == "flex" and not e.deep_ep_available,
        "model.moe_token_dispatcher_type=flex needs DeepEP (or HybridEP), and the deep_ep "
        "package is not installed here",
        "install DeepEP where the job runs, or set model.moe_token_dispatcher_type=alltoall",
        environment=True,
    ),
    Rule(
        "wandb_needs_package",
        lambda c, e: c.logger.wandb_project is not None and not e.wandb_available,
        "logger.wandb_project is set, and the wandb package is not installed here",
        "pip install 'offload-runner[wandb]', or drop logger.wandb_project",
        environment=True,
    ),
    # --- evaluation on the held-out split (validation.eval_iters)
    Rule(
        "dataset_split_unreadable",
        lambda c, e: c.dataset.kind != DatasetKind.mock and not split_readable(c.dataset.split),
        "dataset.split={c.dataset.split} is not up to three non-negative shares with a "
        "positive sum (train, validation, test)",
        "write it as dataset.split='99,1,0'",
    ),
    Rule(
        "evaluation_without_validation_split",
        lambda c, e: bool(c.validation.eval_iters) and validation_documents(c) == 0,
        "validation.eval_iters={c.validation.eval_iters} evaluates on the validation split, and "
        "dataset.split={c.dataset.split} gives it no document (Megatron-Core would loop forever)",
        "set dataset.split='99,1,0' (with at least 100 documents), or drop validation.eval_iters",
    ),
    Rule(
        "evaluation_beside_weight_offload",
        lambda c, e: bool(c.validation.eval_iters) and c.mode.weights,
        "validation.eval_iters evaluates with forwards of its own, and weight offload's ring "
        "streams a training step's forwards and backwards only",
        "drop validation.eval_iters, or use offload/weight=disabled",
    ),
    Rule(
        "evaluation_interval_without_iters",
        lambda c, e: bool(c.validation.eval_interval) and not c.validation.eval_iters,
        "validation.eval_interval={c.validation.eval_interval} has no effect without "
        "validation.eval_iters",
        "add validation.eval_iters=10 (global batches per evaluation)",
        Level.warning,
    ),
    # --- accepted for Megatron-Bridge's command lines, with nothing to act on here: warnings --
    Rule(
        "dataloader_keys_unused",
        lambda c, e: (
            c.dataset.dataloader_type != "single"
            or not c.dataset.data_sharding
            or not c.dataset.skip_getting_attention_mask_from_dataset
            or c.dataset.num_dataset_builder_threads != 1
        ),
        "dataset.dataloader_type / data_sharding / skip_getting_attention_mask_from_dataset / "
        "num_dataset_builder_threads have no effect: offload-runner's loader reads each global "
        "batch once, sharded by data-parallel rank, with causal masks from the attention kernel",
        "drop those dataset.* keys",
        Level.warning,
    ),
    Rule(
        "tokenizer_not_loaded",
        lambda c, e: (
            c.tokenizer.tokenizer_type != "NullTokenizer"
            or c.tokenizer.tokenizer_model is not None
            or c.tokenizer.use_tokenizer_vocab_size
            or c.tokenizer.hf_tokenizer_kwargs is not None
        ),
        "tokenizer.{c.tokenizer.tokenizer_type} is not loaded: the data is token IDs (mock, or "
        ".bin/.idx made by Megatron's preprocessing) and the vocabulary is "
        "model.vocab_size={m.vocab_size}",
        "set model.vocab_size to the tokenizer's vocabulary size; drop tokenizer.*",
        Level.warning,
    ),
    Rule(
        "async_save_not_run",
        lambda c, e: c.checkpoint.async_save,
        "checkpoint.async_save=true has no effect: checkpoints are saved synchronously",
        "drop checkpoint.async_save",
        Level.warning,
    ),
    Rule(
        "mxfp8_buffer_reuse_unused",
        lambda c, e: (
            c.model.fp8 is None
            and (
                c.mixed_precision.fp8_param_gather
                or c.mixed_precision.reuse_grad_buf_for_mxfp8_param_ag
            )
        ),
        "mixed_precision.fp8_param_gather / reuse_grad_buf_for_mxfp8_param_ag have no effect "
        "without FP8",
        "drop them",
        Level.warning,
    ),
)


def _format(template: str, run: RunConfig, env: Environment) -> str:
    flag = _deprecated_cuda_graph_flag(run)
    return template.format(
        deprecated_cuda_graph_flag=flag,
        deprecated_cuda_graph_impl=DEPRECATED_CUDA_GRAPH_FLAGS.get(flag),
        m=run.model,
        o=run.optimizer,
        te_fusions=", ".join(te_fusions(run)),
        prepared_vocab=prepared_vocab(run),
        loaded_precision=loaded_precision(run),
        pretrained_differs=pretrained_differs(run),
        foreign_metadata=foreign_metadata_of(run),
        run_precision=run_precision(run),
        missing_prefixes=missing_prefixes(run),
        prepared_eods=", ".join(map(str, prepared_eods(run))),
        t=run.train,
        c=run,
        env=env,
        last_layer=run.model.num_layers - 1,
        offloadable_layers=(
            f"set model.cpu_offloading_num_layers to a value from 1 to {run.model.num_layers - 1}"
            if run.model.num_layers > 1
            else "a one-layer model has no layer to offload (the last layer's activations stay): "
            "use offload/activation=disabled, or more layers"
        ),
    )


def check_rules(run: RunConfig, env: Environment) -> list[Violation]:
    """Every row of RULES that the config violates."""
    found = []
    for rule in RULES:
        if not rule.violated(run, env):
            continue
        level = rule.level
        if rule.environment and not env.launching:
            level = Level.warning
        found.append(
            Violation(
                rule.name,
                level,
                _format(rule.message, run, env),
                _format(rule.fix, run, env),
                rule.environment,
            )
        )
    return found


def megatron_checks(run: RunConfig, env: Environment) -> list[Violation]:
    """Build Megatron-Core's config objects on the CPU and report what their own checks raise.

    The precision-aware optimizer's checks import Transformer Engine; without TE they are left to
    the table above (precision_aware_* rows), which holds the same conditions.
    """
    from offload_runner.mcore.megatron_config import (
        build_ddp_config,
        build_optimizer_config,
        build_transformer_config,
    )

    optimizer = run.optimizer
    if not env.te_available and _precision_aware(run):
        from offload_runner.config.schema import OptimizerDtype

        dtypes = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
        optimizer = replace(
            optimizer,
            use_precision_aware_optimizer=False,
            offload_optimizer_states=False,
            chunked_optimizer_state_offload=False,
            **dict.fromkeys(dtypes, OptimizerDtype.fp32),
        )
    model = run.model
    if not env.te_available and te_fusions(run):  # left to the fusions_need_te row
        model = replace(
            model, **dict.fromkeys(TE_FUSIONS, False), cross_entropy_fusion_impl="native"
        )
    builders: list[tuple[str, Callable[[], object]]] = [
        ("model", lambda: build_transformer_config(model)),
        ("optimizer", lambda: build_optimizer_config(optimizer, run.model)),
        ("ddp", lambda: build_ddp_config(run)),
    ]
    found = []
    for section, build in builders:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                build()
        except (AssertionError, ValueError, TypeError, RuntimeError) as err:
            message = str(err) or _failed_check(err)
            found.append(
                Violation(
                    f"megatron_core.{section}",
                    Level.error,
                    message,
                    f"Megatron-Core rejects the {section}.* settings; change the key it names",
                )
            )
    return found


BARE = "Megatron-Core's check failed"  # how a check without a message of its own is reported


def _failed_check(err: BaseException) -> str:
    """A check Megatron-Core raised without a message (a bare ``assert``): its own source line,
    where it stands."""
    import linecache
    import traceback

    frame = traceback.extract_tb(err.__traceback__)[-1]
    line = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
    where = f"{Path(frame.filename).name}:{frame.lineno}"
    return f"{BARE} ({where}): {line or type(err).__name__}"


# --- value ranges: (section, key) -> (lowest, highest); None leaves that side open ------------
# A model's shape and batch have ceilings far above any published model's (100x and more): past
# them a value is a typo, and the planner's arithmetic would print an absurd plan (1e20 layers).
# Fields whose range has a row of its own in RULES, with a message of its own, are left out:
# optimizer.optimizer_offload_fraction, cpu_adam_exact_steps,
# optimizer_state_offload_chunk_size_mb.
RANGES: dict[tuple[str, str], tuple[float | None, float | None]] = {
    ("model", "num_layers"): (1, 10_000),
    ("model", "hidden_size"): (1, 1 << 20),
    ("model", "ffn_hidden_size"): (1, 1 << 22),
    ("model", "num_attention_heads"): (1, 1 << 16),
    ("model", "num_query_groups"): (1, 1 << 16),
    ("model", "kv_channels"): (1, 1 << 16),
    ("model", "seq_length"): (1, 1 << 24),
    ("model", "max_position_embeddings"): (1, 1 << 24),
    ("model", "vocab_size"): (1, 1 << 24),
    ("model", "make_vocab_size_divisible_by"): (1, None),
    ("model", "layernorm_epsilon"): (0, None),
    ("model", "hidden_dropout"): (0, 1),
    ("model", "attention_dropout"): (0, 1),
    ("model", "init_method_std"): (0, None),
    ("model", "num_moe_experts"): (1, 1 << 16),
    ("model", "moe_router_topk"): (1, None),
    ("model", "moe_ffn_hidden_size"): (1, 1 << 22),
    ("model", "moe_aux_loss_coeff"): (0, None),
    ("model", "tensor_model_parallel_size"): (1, None),
    ("model", "pipeline_model_parallel_size"): (1, None),
    ("model", "expert_model_parallel_size"): (1, None),
    ("model", "expert_tensor_parallel_size"): (1, None),
    ("model", "context_parallel_size"): (1, None),
    ("model", "virtual_pipeline_model_parallel_size"): (1, None),
    ("model", "recompute_num_layers"): (1, None),
    ("model", "cpu_offloading_num_layers"): (0, None),
    ("model", "min_offloaded_tensor_size"): (0, None),
    ("optimizer", "lr"): (0, None),
    ("optimizer", "min_lr"): (0, None),
    ("optimizer", "weight_decay"): (0, None),
    ("optimizer", "adam_beta1"): (0, 1),
    ("optimizer", "adam_beta2"): (0, 1),
    ("optimizer", "adam_eps"): (0, None),
    ("optimizer", "clip_grad"): (0, None),
    ("optimizer", "cpu_adam_gpu_share"): (0, 1),
    ("optimizer", "cpu_adam_exact_columns"): (0, 1),
    ("scheduler", "lr_warmup_iters"): (0, None),
    ("scheduler", "lr_decay_iters"): (1, None),
    ("scheduler", "lr_wsd_decay_iters"): (1, None),
    ("scheduler", "lr_warmup_init"): (0, None),
    ("scheduler", "start_weight_decay"): (0, None),
    ("scheduler", "end_weight_decay"): (0, None),
    ("ddp", "bucket_size"): (1, None),
    ("train", "train_iters"): (1, None),
    ("train", "global_batch_size"): (1, 1 << 24),
    ("train", "micro_batch_size"): (1, 1 << 24),
    ("train", "manual_gc_interval"): (0, None),
    ("logger", "log_interval"): (1, None),
    ("checkpoint", "save_interval"): (1, None),
    ("dataset", "num_workers"): (0, None),
    ("launcher", "nproc_per_node"): (1, None),
    ("launcher", "node_rank"): (0, None),
    ("launcher", "master_port"): (1, 65535),
    ("launcher", "max_restarts"): (0, None),
    ("planner", "gpu_memory_gb"): (0.001, None),  # 0 would read as unset
    ("train", "gpu_memory_cap_gb"): (0.001, None),
    ("planner", "host_memory_gb"): (0.001, None),
    ("planner", "margin_gb"): (0, None),
    ("planner", "host_link_gb_per_s"): (0.001, None),
    ("planner", "cpu_adam_params_per_s"): (1, None),
    ("planner", "forward_backward_s"): (0, None),
    ("planner", "delayed_max_overhead"): (0, None),
    ("planner", "cpu_adam_launch_slowdown"): (0, None),
    ("verify", "iters"): (1, None),
    ("verify", "loss_tolerance"): (0, None),
}


def range_violations(run: RunConfig) -> list[Violation]:
    """Every numeric value outside its range (RANGES); None means "unset" and passes."""
    found = []
    for (section, key), (low, high) in RANGES.items():
        value = getattr(getattr(run, section), key)
        if isinstance(value, float) and not math.isfinite(value):
            found.append(_not_finite(section, key, value))
            continue
        if value is None or ((low is None or value >= low) and (high is None or value <= high)):
            continue
        if low is not None and high is not None:
            span = f"between {low} and {high}"
        else:
            span = f">= {low}" if low is not None else f"<= {high}"
        found.append(
            Violation(
                f"range_{section}_{key}",
                Level.error,
                f"{section}.{key}={value} is out of range: it must be {span}",
                f"set {section}.{key} to a value {span}",
            )
        )
    return found


def _not_finite(section: str, key: str, value: float) -> Violation:
    return Violation(
        f"range_{section}_{key}",
        Level.error,
        f"{section}.{key}={value} is not a finite number",
        f"set {section}.{key} to a number (1e309 and beyond read as inf)",
    )


def choice_violations(run: RunConfig) -> list[Violation]:
    """Every Megatron-Core field typed ``Literal[...]`` whose value is not one of its choices
    (such a field is a str key here; see config/megatron_fields.py)."""
    from offload_runner.config.megatron_fields import literal_choices

    found = []
    for key, choices in literal_choices().items():
        section, _, name = key.partition(".")
        value = getattr(getattr(run, section), name, None)
        if value is None or value in choices:
            continue
        shown = ", ".join(map(str, choices))
        found.append(
            Violation(
                f"choice_{section}_{name}",
                Level.error,
                f"{key}={value} is not one of Megatron-Core's choices: {shown}",
                f"set {key} to one of: {shown}",
            )
        )
    return found


def value_violations(run: RunConfig) -> list[Violation]:
    """Values outside their range or their Megatron-Core choices: nothing else (the planner,
    the table's rows) is meaningful while there are any."""
    return range_violations(run) + choice_violations(run)


def validate(run: RunConfig, env: Environment) -> list[Violation]:
    """All violations: value ranges and choices first (nothing else is meaningful without
    them), then the table's rows, then Megatron-Core's own checks (without repeats)."""
    ranges = value_violations(run)
    if ranges:
        return ranges
    found = check_rules(run, env)
    seen = {v.message for v in found}
    ours = bool(errors(found))  # a bare assert of Megatron-Core's adds nothing to our own error
    found += [
        v
        for v in megatron_checks(run, env)
        if v.message not in seen and not (ours and v.message.startswith(BARE))
    ]
    return found


def errors(violations: list[Violation]) -> list[Violation]:
    return [v for v in violations if v.level == Level.error]
