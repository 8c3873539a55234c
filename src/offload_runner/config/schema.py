"""The typed schema of a run, registered in Hydra's ConfigStore.

Key names follow Megatron-Bridge (``model.*``, ``optimizer.*``, ``train.*``, ...) so that its
command lines paste unchanged. Every YAML in ``conf/`` and ``recipes/`` is merged onto these
dataclasses, so a misspelt key or a wrong type fails in Hydra with Hydra's own message.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional


class Normalization(str, Enum):
    RMSNorm = "RMSNorm"
    LayerNorm = "LayerNorm"


class ActivationFunc(str, Enum):
    silu = "silu"
    gelu = "gelu"


class PositionEmbeddingType(str, Enum):
    rope = "rope"
    learned_absolute = "learned_absolute"


class RecomputeGranularity(str, Enum):
    full = "full"
    selective = "selective"


class RecomputeMethod(str, Enum):
    uniform = "uniform"
    block = "block"


class CudaGraphImpl(str, Enum):
    none = "none"
    local = "local"
    transformer_engine = "transformer_engine"


class TransformerImpl(str, Enum):
    transformer_engine = "transformer_engine"
    local = "local"


class TokenDispatcher(str, Enum):
    alltoall = "alltoall"
    allgather = "allgather"
    flex = "flex"  # DeepEP / HybridEP (model.moe_flex_dispatcher_backend): the deep_ep package


class OffloadModule(str, Enum):
    """Sub-modules whose input fine-grained activation offloading may move to the CPU."""

    attn_norm = "attn_norm"
    qkv_linear = "qkv_linear"
    core_attn = "core_attn"
    attn_proj = "attn_proj"
    mlp_norm = "mlp_norm"
    expert_fc1 = "expert_fc1"
    moe_act = "moe_act"


class OptimizerType(str, Enum):
    adam = "adam"
    sgd = "sgd"


# Pieces in a state window: one in Adam, one going out, one or two coming in.
WINDOW_PIECES = 4
DEFAULT_WINDOW_MB = 512


# torch's names for OptimizerDtype's values (getattr(torch, TORCH_DTYPES[d.value]))
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class OptimizerDtype(str, Enum):
    """Precision-aware optimizer dtypes (Megatron-Core's torch.dtype fields, by name)."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    # offload/optimizer=states only: moments as 8-bit block-wise codes (offload/quantized.py)
    q8 = "q8"


class CpuOffloadEngine(str, Enum):
    """Who runs the CPU share of Adam when ``optimizer.optimizer_cpu_offload`` is on."""

    hybrid = "hybrid"  # Megatron-Core's HybridDeviceOptimizer
    cpu_adam = "cpu_adam"  # offload-runner's pipelined CPU-Adam engine (offload/cpu_adam/)


class DelayedScope(str, Enum):
    """Which optimizer parts the CPU-Adam engine's delayed mode updates one step late."""

    all = "all"  # every offloaded param
    experts = "experts"  # a MoE model's routed experts; its dense layers and router stay exact


class LRDecayStyle(str, Enum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"
    inverse_square_root = "inverse-square-root"
    WSD = "WSD"  # warmup, stable, decay over scheduler.lr_wsd_decay_iters


class WeightDecayStyle(str, Enum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class WSDDecayStyle(str, Enum):
    exponential = "exponential"
    linear = "linear"
    cosine = "cosine"
    minus_sqrt = "minus_sqrt"


class CheckpointFormat(str, Enum):
    torch_dist = "torch_dist"  # Megatron-Core dist_checkpointing (the one offload-runner writes)
    torch = "torch"
    fsdp_dtensor = "fsdp_dtensor"
    zarr = "zarr"


class DatasetKind(str, Enum):
    mock = "mock"
    indexed = "indexed"
    sft = "sft"  # --prepare's chat output: loss on the answers (mcore/sft.py)


@dataclass
class ModelConfig:
    """Architecture, parallel layout and layer-level offload (Megatron TransformerConfig keys)."""

    num_layers: int = 2
    hidden_size: int = 256
    ffn_hidden_size: int = 1024
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    kv_channels: Optional[int] = None
    seq_length: int = 512
    max_position_embeddings: Optional[int] = None
    vocab_size: int = 32000
    make_vocab_size_divisible_by: int = 128
    normalization: Normalization = Normalization.RMSNorm
    layernorm_epsilon: float = 1e-5
    qk_layernorm: bool = False
    activation_func: ActivationFunc = ActivationFunc.silu
    gated_linear_unit: bool = True
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    position_embedding_type: PositionEmbeddingType = PositionEmbeddingType.rope
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    # Llama 3's RoPE frequency scaling (GPTModel's rope_scaling; Megatron-Core fixes all but the
    # factor: low/high frequency factors 1 and 4, original context 8192)
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    share_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    bf16: bool = "${mixed_precision.bf16}"  # type: ignore[assignment]
    fp8: Optional[str] = "${mixed_precision.fp8}"  # type: ignore[assignment]
    # Bit-reproducible runs: deterministic embedding backward and attention kernels (slower).
    deterministic_mode: bool = False
    transformer_impl: TransformerImpl = TransformerImpl.transformer_engine
    # The output layer and cross entropy over chunks of tokens: the [tokens x vocabulary]
    # logits never exist whole (mcore/chunked_loss.py; TP 1)
    chunked_loss: bool = False

    # Mixture of experts
    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    moe_grouped_gemm: bool = True
    moe_token_dispatcher_type: TokenDispatcher = TokenDispatcher.alltoall
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 1e-3

    # Parallel layout
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    # Interleaved pipeline: each rank holds this many model chunks (layers / (PP x VPP) each)
    virtual_pipeline_model_parallel_size: Optional[int] = None
    # How attention talks across CP ranks (Transformer Engine): p2p, all_gather, a2a or a2a+p2p;
    # None leaves Megatron-Core's default (p2p).
    cp_comm_type: Optional[str] = None
    sequence_parallel: bool = False

    # Recompute and CUDA graphs (both interact with offloading)
    recompute_granularity: Optional[RecomputeGranularity] = None
    recompute_method: Optional[RecomputeMethod] = None
    recompute_num_layers: Optional[int] = None
    # selective recompute's modules (Megatron-Core's default: core_attn); e.g. [mlp], [moe_act]
    recompute_modules: Optional[list[str]] = None
    # Transformer Engine's RNG tracker (rng.te_rng_tracker sets both, as Megatron-Bridge does)
    use_te_rng_tracker: bool = "${rng.te_rng_tracker}"  # type: ignore[assignment]
    cuda_graph_impl: CudaGraphImpl = CudaGraphImpl.none

    # Layer-level activation / weight offload (Transformer Engine's offload context)
    cpu_offloading: bool = False
    cpu_offloading_num_layers: int = 0
    cpu_offloading_activations: bool = True
    cpu_offloading_weights: bool = False
    cpu_offloading_double_buffering: bool = False

    # Module-level activation offload
    fine_grained_activation_offloading: bool = False
    offload_modules: Optional[list[OffloadModule]] = field(default_factory=list)  # null: none
    min_offloaded_tensor_size: int = 1024 * 1024

    @property
    def model_parallel_size(self) -> int:
        """GPUs one replica of the dense layers spans: TP x PP x CP."""
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )

    @property
    def experts_own_optimizer_part(self) -> bool:
        """Megatron-Core gives the routed experts an optimizer part of their own (a distributed
        optimizer over the expert data-parallel group) only where they use the expert process
        groups: expert parallelism, or an expert tensor-parallel size other than TP. Otherwise
        (one GPU, EP=1) their parameters join the dense part, in its buffer order."""
        return bool(self.num_moe_experts) and (
            self.expert_model_parallel_size > 1
            or self.expert_tensor_parallel != self.tensor_model_parallel_size
        )

    @property
    def expert_tensor_parallel(self) -> int:
        """The experts' tensor-parallel size (expert_tensor_parallel_size, else TP's)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def expert_layout_size(self) -> int:
        """GPUs one copy of the experts spans: EP x ETP x PP (ETP defaults to TP)."""
        return (
            self.expert_model_parallel_size
            * self.expert_tensor_parallel
            * self.pipeline_model_parallel_size
        )


@dataclass
class OptimizerConfig:
    """Megatron-Core OptimizerConfig keys, plus ``offload_optimizer_states`` (ours)."""

    optimizer: OptimizerType = OptimizerType.adam
    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    decoupled_weight_decay: bool = True
    clip_grad: float = 1.0
    bf16: bool = "${model.bf16}"  # type: ignore[assignment]
    use_distributed_optimizer: bool = True
    # HybridDeviceOptimizer reuses the precision-aware path, so it follows the offload switch
    # unless set explicitly.
    use_precision_aware_optimizer: bool = "${optimizer.optimizer_cpu_offload}"  # type: ignore[assignment]
    # On the precision-aware path (Transformer Engine's FusedAdam) Adam's tensors may be smaller
    # than fp32: e.g. exp_avg_dtype=bf16 exp_avg_sq_dtype=bf16 saves 4 B per param. State offload
    # also takes q8 moments (8-bit block-wise) and main_params_dtype=bf16 (no master: the bf16
    # parameter rounded stochastically), offload/quantized.py.
    main_grads_dtype: OptimizerDtype = OptimizerDtype.fp32
    main_params_dtype: OptimizerDtype = OptimizerDtype.fp32
    exp_avg_dtype: OptimizerDtype = OptimizerDtype.fp32
    exp_avg_sq_dtype: OptimizerDtype = OptimizerDtype.fp32

    # Megatron-Core HybridDeviceOptimizer: part of Adam on the CPU
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 0.0
    overlap_cpu_optimizer_d2h_h2d: bool = False
    use_torch_optimizer_for_cpu_offload: bool = False
    pin_cpu_grads: bool = True
    pin_cpu_params: bool = True

    # offload-runner's CPU-Adam engine instead of HybridDeviceOptimizer (same fraction key):
    # grads stream to the host in pieces, fused CPU AdamW updates each piece as it lands, the fp32
    # masters stream back and are rounded into the bf16 params on the GPU; the engine owns the
    # host-side masters and Adam states.
    cpu_offload_engine: CpuOffloadEngine = CpuOffloadEngine.hybrid
    # Delayed parameter update (ZeRO-Offload's DPU): step t's CPU update runs during step t+1's
    # forward and backward and lands before step t+2. Only after cpu_adam_exact_steps exact steps
    # (null: scheduler.lr_warmup_iters).
    cpu_adam_delayed_update: bool = False
    cpu_adam_exact_steps: Optional[int] = None
    # Delayed mode: land the weights extrapolated by the last update (w + (w - w_prev): the next
    # update's best guess), so the forward runs on about the weights exact mode would use instead
    # of one update behind. Costs the CPU a copy and an extrapolation per param (about 1.9x the
    # CPU step) and 4 B/param of page-locked host memory; it narrows delayed mode's convergence
    # lag (docs/BENCHMARKS.md, cpu-adam-conv).
    cpu_adam_weight_prediction: bool = False
    # Delayed mode: this share of each 2-D weight's columns (its input features), those whose
    # summed |gradient| is largest, updated exactly on the GPU at every step (ZenFlow's selective
    # update), their masters and moments kept there too (12 B per such param with fp32
    # moments); the CPU still takes every param one step late. Chosen at the first delayed step
    # and every 100 steps after. 0: off.
    cpu_adam_exact_columns: float = 0.0
    # Delayed mode's reach: all (every offloaded param one step late) or experts (a MoE model's
    # routed experts alone; the dense layers and the router, offloaded all the same, update
    # exactly, their update landing during the next forward with exact mode's GPU share, while
    # the experts' runs under forward+backward). Needs expert parallelism (EP >= 2): only then
    # does Megatron-Core give the experts an optimizer part of their own.
    cpu_adam_delayed_scope: DelayedScope = DelayedScope.all
    # Exact mode: this share of the offloaded params has its Adam on the GPU instead, its
    # masters and moments (on the host like the rest) streamed through a GPU window of 4 pieces
    # during the step while the CPU updates the others: the CPU and the link work at once
    # (docs/BENCHMARKS.md). null: balanced over the first steps so both finish together, then fixed
    # and checkpointed (from the config alone under model.deterministic_mode); 0: all on the CPU
    # (the moments stay pageable). Delayed mode (its preset sets 0): the share of each delayed
    # update runs on the GPU under the next forward+backward, its gradients streamed up too.
    cpu_adam_gpu_share: Optional[float] = None

    # offload-runner: states + fp32 master weights live on the CPU, Adam runs on the GPU; they
    # stream through a GPU window of 4 pieces during the step (one updated, one going out, the
    # next coming in). Megatron-Core's own state-offload keys (its dev branch, PR 6244; in no
    # release up to 0.19) drive the same engine: chunked_optimizer_state_offload=true is
    # offload_optimizer_states (its deprecated alias there), pieces of the chunk size's MiB (0,
    # the whole state at once there: the default window here, 512 MiB), and the fraction keeps
    # the rest of the states (1 - fraction of the shard) on the GPU, updated there.
    offload_optimizer_states: bool = False
    chunked_optimizer_state_offload: bool = False
    optimizer_state_offload_chunk_size_mb: int = 0
    optimizer_state_offload_fraction: float = 1.0


@dataclass
class SchedulerConfig:
    """Megatron-Core's OptimizerParamScheduler, with Megatron-Bridge's key names."""

    lr_warmup_iters: int = 0
    lr_warmup_init: float = 0.0  # the learning rate warmup starts from
    lr_decay_style: LRDecayStyle = LRDecayStyle.cosine
    lr_decay_iters: Optional[int] = None
    lr_wsd_decay_iters: Optional[int] = None  # WSD: iterations of its final decay
    lr_wsd_decay_style: WSDDecayStyle = WSDDecayStyle.exponential
    # Weight decay moves from start to end over the decay iterations (null: optimizer.weight_decay)
    start_weight_decay: Optional[float] = None
    end_weight_decay: Optional[float] = None
    weight_decay_incr_style: WeightDecayStyle = WeightDecayStyle.constant
    # On resume: the checkpoint's schedule wins (default); override_opt_param_scheduler=true
    # makes this config's schedule win instead (e.g. after changing train.train_iters).
    use_checkpoint_opt_param_scheduler: bool = True
    override_opt_param_scheduler: bool = False


@dataclass
class DDPConfig:
    """Megatron-Core DistributedDataParallelConfig keys."""

    # Megatron-Bridge sets it in both sections; here it follows optimizer.* unless set (the two
    # must agree: rule distributed_optimizer_sections_differ).
    use_distributed_optimizer: bool = "${optimizer.use_distributed_optimizer}"  # type: ignore[assignment]
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    grad_reduce_in_fp32: bool = "${mixed_precision.grad_reduce_in_fp32}"  # type: ignore[assignment]
    average_in_collective: bool = False
    bucket_size: Optional[int] = None


@dataclass
class TrainConfig:
    train_iters: int = 20
    global_batch_size: int = 8
    micro_batch_size: int = 1
    seed: int = "${rng.seed}"  # type: ignore[assignment]
    exit_on_oom: bool = False
    # Hold the run to this much GPU memory (GB, torch.cuda.set_per_process_memory_fraction): how
    # a smaller GPU is tried on a larger one; the planner takes it as the GPU's size. null: all.
    gpu_memory_cap_gb: Optional[float] = None
    # Megatron-Bridge's manual GC: Python's collector off during training, gc.collect() every
    # manual_gc_interval iterations (0: never), so no rank pauses at its own moment.
    manual_gc: bool = False
    manual_gc_interval: int = 0
    manual_gc_eval: int = 1  # Megatron-Bridge: with manual_gc, a collection after each evaluation


@dataclass
class LoggerConfig:
    log_interval: int = 1
    # Megatron-Bridge's key: TensorBoard event files (loss, lr, grad norm, step time, tokens/s,
    # TFLOP/s, GPU peak, pinned host memory per iteration), written by rank 0. Needs the
    # tensorboard package (pip install 'offload-runner[tensorboard]').
    tensorboard_dir: Optional[str] = None
    # Step, forward-backward and optimizer times go to TensorBoard in any case.
    log_timers_to_tensorboard: bool = False
    # Weights & Biases, from rank 0 (pip install 'offload-runner[wandb]'): the same scalars as
    # TensorBoard, the resolved config, and the summary. WANDB_MODE=offline writes the run under
    # wandb_save_dir (default: the run directory) for a later `wandb sync`, without network.
    wandb_project: Optional[str] = None
    wandb_exp_name: Optional[str] = None  # null: the run directory's name
    wandb_entity: Optional[str] = None
    wandb_save_dir: Optional[str] = None


@dataclass
class CheckpointConfig:
    save: Optional[str] = None
    save_interval: Optional[int] = None
    load: Optional[str] = None
    ckpt_format: CheckpointFormat = CheckpointFormat.torch_dist
    # Each data-parallel rank writes its share of the replicated state (Megatron-Core's
    # FullyParallelSaveStrategyWrapper) instead of DP rank 0 writing it all.
    fully_parallel_save: bool = False
    async_save: bool = False
    # Weights to start from (a fresh optimizer, iteration 0): a --import-hf folder or any saved
    # checkpoint; checkpoint.load, when it holds a checkpoint, resumes instead.
    pretrained_checkpoint: Optional[str] = None
    # false: save the model's weights only (no optimizer, no schedule), for export and for disk
    save_optim: bool = True


@dataclass
class DatasetConfig:
    """``mock``: Megatron-Core's MockGPTDataset; ``indexed``: Megatron .bin/.idx prefixes;
    ``sft``: chat prefixes of --prepare, one conversation a sample, the answers trained."""

    kind: DatasetKind = DatasetKind.mock
    # One prefix, several prefixes, or a blend "weight prefix weight prefix ..."
    data_path: list[str] = field(default_factory=list)
    # Megatron-Bridge's spelling of a blend ([[prefixes], [weights]] or null): give data_path
    blend: Optional[Any] = None
    blend_per_split: Optional[Any] = None
    split: str = "99,1,0"
    seq_length: int = "${model.seq_length}"  # type: ignore[assignment]
    random_seed: int = "${train.seed}"  # type: ignore[assignment]
    num_workers: int = 2
    # Megatron-Bridge's loader keys: offload-runner's loader is already what these ask for
    # (single pass, sharded by data-parallel rank, no attention mask from the data).
    dataloader_type: str = "single"
    data_sharding: bool = True
    skip_getting_attention_mask_from_dataset: bool = True
    num_dataset_builder_threads: int = 1
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False


@dataclass
class TokenizerConfig:
    """The data is token IDs (mock, or .bin/.idx): only the vocabulary size matters for training,
    and it is ``model.vocab_size``."""

    tokenizer_type: str = "NullTokenizer"
    tokenizer_model: Optional[str] = None
    vocab_size: Optional[int] = None  # if set, must equal model.vocab_size
    make_vocab_size_divisible_by: Optional[int] = None  # likewise with model.*
    use_tokenizer_vocab_size: bool = False
    hf_tokenizer_kwargs: Optional[dict[str, Any]] = None


@dataclass
class RNGConfig:
    """Megatron-Bridge's ``rng`` section: the seed of weights, dropout and data."""

    seed: int = 1234
    te_rng_tracker: bool = False


@dataclass
class MixedPrecisionConfig:
    """Megatron-Bridge's ``mixed_precision``: the keys, or a recipe name on the command line
    (``mixed_precision=bf16_mixed``, see cli.py). model.bf16, ddp.grad_reduce_in_fp32 follow it."""

    bf16: bool = True
    fp16: bool = False
    grad_reduce_in_fp32: bool = True
    fp8: Optional[str] = None
    fp8_recipe: str = "tensorwise"
    fp8_param_gather: bool = False
    reuse_grad_buf_for_mxfp8_param_ag: bool = False


# Megatron-Bridge's precision recipes by name (``mixed_precision=bf16_mixed`` on a command line):
# the mixed_precision.* keys each one sets. FP8 and fp16 ones are then refused by validation.
MIXED_PRECISION_RECIPES: dict[str, dict[str, object]] = {
    "bf16_mixed": {"bf16": True, "fp16": False, "fp8": None},
    "fp16_mixed": {"bf16": False, "fp16": True, "fp8": None},
    "bf16_with_fp8_delayed_scaling_mixed": {"bf16": True, "fp8": "hybrid", "fp8_recipe": "delayed"},
    "bf16_with_fp8_current_scaling_mixed": {
        "bf16": True,
        "fp8": "hybrid",
        "fp8_recipe": "tensorwise",
    },
    "bf16_with_fp8_subchannel_scaling_mixed": {
        "bf16": True,
        "fp8": "e4m3",
        "fp8_recipe": "blockwise",
    },
    "bf16_with_mxfp8_mixed": {"bf16": True, "fp8": "e4m3", "fp8_recipe": "mxfp8"},
}


@dataclass
class ValidationConfig:
    """Megatron-Bridge's evaluation keys: the loss over ``eval_iters`` global batches of the
    held-out split (dataset.split's second share; the same batches each time), every
    ``eval_interval`` iterations and after the last; summary.json's final_validation_loss and
    validation_losses. Null or 0: no evaluation."""

    eval_interval: Optional[int] = None  # null: after the last iteration only
    eval_iters: Optional[int] = None


@dataclass
class LauncherConfig:
    """torchrun settings; ``nproc_per_node: null`` means every visible GPU."""

    nproc_per_node: Optional[int] = None
    nnodes: str = "1"
    node_rank: int = 0
    rdzv_backend: str = "c10d"
    rdzv_endpoint: Optional[str] = None
    rdzv_id: str = "offload-runner"
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    max_restarts: int = 0


@dataclass
class PlannerConfig:
    """``--plan`` and ``offload/*=auto``: the machine to plan for and the headroom to keep."""

    gpu_memory_gb: Optional[float] = None  # null: the visible GPU's size (80 when none is visible)
    host_memory_gb: Optional[float] = None  # null: this machine's RAM
    margin_gb: float = 2.0  # GPU memory, and host RAM per node, that a plan keeps free
    auto_optimizer: bool = False  # offload/optimizer=auto
    # ... with which CPU offload engine: cpu_adam (measured 2-3x faster) or hybrid (HDO)
    auto_engine: CpuOffloadEngine = CpuOffloadEngine.cpu_adam
    auto_delayed: bool = False  # ... the CPU-Adam engine in delayed mode (cpu_adam_delayed)
    auto_activation: bool = False  # offload/activation=auto
    # train.micro_batch_size=auto: auto also picks the micro-batch (a divisor of the rank's batch)
    # and full recompute, for the most predicted tokens/s that fits (gpu_time.py)
    auto_micro_batch: bool = False
    # The step-time model auto chooses by, and --plan prints: host<->GPU copies run at
    # host_link_gb_per_s each way (PCIe Gen5 with both directions busy; a Grace-Hopper C2C link
    # is several times faster), and one rank's CPU Adam at cpu_adam_params_per_s (null: torch's
    # fused AdamW measured here at start, with this rank's share of the cores).
    host_link_gb_per_s: float = 50.8
    cpu_adam_params_per_s: Optional[float] = None
    # One step's forward+backward in seconds (a run's fwd_bwd_time_s_median): delayed mode's CPU
    # Adam hides under it (null: counted as not hidden). A cpu_adam run's summary.json gives
    # cpu_adam_hidden_fraction, the largest fraction that hid under its own.
    forward_backward_s: Optional[float] = None
    # What delayed mode adds to forward+backward, kept within this share of it by the hidden
    # fraction: its copies where they outlast the last backward (4 B/param each way), and
    # the training thread slowed by CPU Adam beside it (below).
    delayed_max_overhead: float = 0.1
    # Seconds forward+backward loses per second of CPU Adam running beside it: the CPU step's
    # memory traffic slows the Python thread that launches the kernels (the proxy at micro-batch
    # 1 is bound by that thread). A delayed run given planner.forward_backward_s (without
    # offload) measures it: cpu_adam_launch_slowdown in summary.json. The default is about
    # what the proxy's delayed runs at GBS 4 measured on one H200 (docs/BENCHMARKS.md).
    cpu_adam_launch_slowdown: float = 0.25

    @property
    def auto(self) -> bool:
        """Whether auto chooses anything (offload/*=auto, train.micro_batch_size=auto)."""
        return self.auto_optimizer or self.auto_activation or self.auto_micro_batch


@dataclass
class ProfilingConfig:
    """Megatron-Bridge's ``profiling`` section: profile a window of iterations.

    ``use_pytorch_profiler`` writes ``profile/rank<r>.json.gz`` (a Chrome/Perfetto trace) and
    ``profile/rank<r>-ops.txt`` (ops by GPU and CPU time) into the run directory;
    ``use_nsys_profiler`` calls cudaProfilerStart/Stop around the window for
    ``nsys profile --capture-range=cudaProfilerApi``.
    """

    use_pytorch_profiler: bool = False
    use_nsys_profiler: bool = False
    profile_step_start: int = 10  # first profiled iteration (1-based, as the log counts)
    profile_step_end: int = 12  # last profiled iteration
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    record_shapes: bool = False


@dataclass
class VerifyConfig:
    """``--verify``: the same recipe without and with offload, compared iteration by iteration."""

    iters: int = 10
    loss_tolerance: float = 1e-3  # PASS needs max |delta loss| below this
    deterministic: bool = True  # model.deterministic_mode for both runs
    repeat_baseline: bool = False  # a second baseline run measures the noise floor


# Bytes per parameter: an fp32 master kept as the 16 bits its bf16 parameter lacks (Megatron-
# Core's precision-aware optimizer does so by default, store_param_remainders; measured on the
# proxy: 52.50 against 58.30 GiB, 3.11B params x 2 B; docs/evidence/precision-aware-peak.json),
# state offload too; a moment by its dtype (q8: a code and its block's share of a scale).
REMAINDER_BYTES = 2
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "q8": 1 + 4 / 256}


@dataclass(frozen=True)
class Precision:
    """What a run's optimizer state and gradients take per parameter, resolved once from its
    config (``RunConfig.precision``): the planner, the cost model and the engines read it."""

    exp_avg: str  # fp32, bf16 or q8 (8-bit codes with a scale per 256)
    exp_avg_sq: str
    remainders: bool  # Megatron-Core's optimizer.store_param_remainders (on unless false)
    # state offload keeps each master on the host as its remainder beside the bf16 parameter
    # (offload/remainders.py): a bf16 model, unless store_param_remainders=false
    keeps_remainders: bool
    # state offload with main_params_dtype=bf16: the masters are the bf16 parameters, rounded
    # stochastically (offload/quantized.py)
    bf16_masters: bool
    grad_bytes: int  # DDP's gradient buffer (and weight offload's host gradients)

    @staticmethod
    def of(run: RunConfig) -> Precision:
        o, m = run.optimizer, run.model
        remainders = getattr(o, "store_param_remainders", True) is not False
        bf16_masters = run.mode.states and o.main_params_dtype.value == "bf16"
        return Precision(
            exp_avg=o.exp_avg_dtype.value,
            exp_avg_sq=o.exp_avg_sq_dtype.value,
            remainders=remainders,
            keeps_remainders=run.mode.states and m.bf16 and remainders and not bf16_masters,
            bf16_masters=bf16_masters,
            grad_bytes=4 if run.ddp.grad_reduce_in_fp32 or not m.bf16 else 2,
        )

    @property
    def moment_bytes(self) -> float:
        """exp_avg + exp_avg_sq (8 in fp32, 4 in bf16, 2.03 as 8-bit codes and scales)."""
        return DTYPE_BYTES[self.exp_avg] + DTYPE_BYTES[self.exp_avg_sq]

    @property
    def low_moments(self) -> int:
        """Moments stored below fp32 (a state window holds an fp32 copy of each for the math)."""
        return (self.exp_avg != "fp32") + (self.exp_avg_sq != "fp32")

    @property
    def q8(self) -> bool:
        return "q8" in (self.exp_avg, self.exp_avg_sq)

    @property
    def master_bytes(self) -> int:
        """What a host engine keeps of an fp32 master: state offload's remainder, nothing for
        bf16 masters, else the fp32 master (the CPU-Adam engine's too)."""
        if self.bf16_masters:
            return 0
        return REMAINDER_BYTES if self.keeps_remainders else 4

    @property
    def host_state_bytes(self) -> float:
        """What a host engine keeps, and state offload moves each way, per offloaded param."""
        return self.master_bytes + self.moment_bytes

    @property
    def window_bytes_per_param(self) -> float:
        """GPU bytes a state window takes per param of its pieces: the master (fp32 for bf16
        masters, upcast there), fp32 moments, and the moments stored below fp32 as they travel."""
        low = sum(DTYPE_BYTES[d] for d in (self.exp_avg, self.exp_avg_sq) if d != "fp32")
        return (4 if self.bf16_masters else self.master_bytes) + 8 + low


@dataclass
class RunConfig:
    """The root of a composed run."""

    @functools.cached_property
    def mode(self) -> OffloadMode:
        """What it offloads, resolved on first use (a changed run is a new RunConfig:
        ``dataclasses.replace``, ``auto.with_overrides``)."""
        return OffloadMode.of(self)

    @functools.cached_property
    def precision(self) -> Precision:
        """Its optimizer state's and gradients' bytes per parameter, resolved on first use."""
        return Precision.of(self)

    name: str = "run"
    output_dir: str = "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}-${name}"
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    rng: RNGConfig = field(default_factory=RNGConfig)
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)


@dataclass(frozen=True)
class OffloadMode:
    """What a run offloads, resolved once from its config (``RunConfig.mode``): the planner,
    the cost model, validation and the engines read it instead of asking the keys again."""

    states: bool  # offload/optimizer=states (or Megatron-Core's dev-branch spelling of it)
    weights: bool  # offload/weight=enabled: cpu_offloading_num_layers' weights
    activations: bool  # Transformer Engine's activation offload
    cpu_adam: bool  # offload-runner's CPU-Adam engine runs the CPU share (cpu_adam*)
    delayed: bool  # ... its CPU update under the next step's forward and backward
    delays_dense: bool  # ... the dense layers' and the router's too (delayed_scope=all)
    # ... with a GPU share (cpu_adam_gpu_share null balances it, 0 has none): it streams that
    # share's states through a window, the exact updates' during the step, delayed mode's
    # under the next forward+backward (not with weight prediction, which runs on the CPU)
    streams: bool
    late_share: bool  # ... in delayed mode for every parameter, the share's updates delayed
    one_model_rank: bool  # no tensor, pipeline or context parallelism

    @staticmethod
    def of(run: RunConfig) -> OffloadMode:
        o, m = run.optimizer, run.model
        cpu_adam = o.optimizer_cpu_offload and o.cpu_offload_engine == CpuOffloadEngine.cpu_adam
        delayed = cpu_adam and o.cpu_adam_delayed_update
        delays_dense = delayed and o.cpu_adam_delayed_scope == DelayedScope.all
        share = o.cpu_adam_gpu_share
        predicting = delays_dense and o.cpu_adam_weight_prediction
        streams = cpu_adam and (share is None or share > 0) and not predicting
        sizes = (m.tensor_model_parallel_size, m.pipeline_model_parallel_size)
        return OffloadMode(
            states=o.offload_optimizer_states or o.chunked_optimizer_state_offload,
            weights=m.cpu_offloading and m.cpu_offloading_weights,
            activations=m.cpu_offloading and m.cpu_offloading_activations,
            cpu_adam=cpu_adam,
            delayed=delayed,
            delays_dense=delays_dense,
            streams=streams,
            late_share=streams and delays_dense,
            one_model_rank=sizes == (1, 1) and m.context_parallel_size == 1,
        )

    def backward_copies_allowed(self, data_parallel: int = 1) -> bool:
        """Delayed mode's step-boundary copies (this step's gradients down, the last update's
        masters up, 4 B/param each way) run during the last micro-batch's backward, each piece
        as soon as its gradients are final, the CPU applying the clip factor, wherever no
        gradient of a shard changes after its backward (Megatron-Core's finalize_model_grads
        reduces over data-parallel ranks, all-reduces QK-norm and sequence-parallel grads over
        tensor-parallel ranks and embedding grads over pipeline stages): one GPU. Elsewhere
        they run at step()."""
        return data_parallel == 1 and self.one_model_rank

    def copies_during_backward(self, data_parallel: int = 1) -> bool:
        """The CPU-Adam engine in delayed mode with its boundary copies during the backward."""
        return self.delayed and self.backward_copies_allowed(data_parallel)


# Fused kernels that Megatron-Core takes from Transformer Engine (conf/speed/fused.yaml sets them).
TE_FUSIONS = ("moe_permute_fusion", "moe_router_fusion", "apply_rope_fusion")


def te_fusions(run: RunConfig) -> list[str]:
    """The model.* fusions ``run`` turns on that run inside Transformer Engine."""
    found = [f"model.{name}" for name in TE_FUSIONS if getattr(run.model, name, False)]
    if getattr(run.model, "cross_entropy_loss_fusion", False) and (
        getattr(run.model, "cross_entropy_fusion_impl", None) == "te"
    ):
        found.append("model.cross_entropy_fusion_impl=te")
    return found


def states_window_mb(run: RunConfig) -> int:
    """The state window: 4 pieces of optimizer_state_offload_chunk_size_mb (0: DEFAULT_WINDOW_MB;
    suite states measured 128, 512 and 2048 MiB windows, their optimizer phase the same)."""
    o = run.optimizer
    chunk = o.optimizer_state_offload_chunk_size_mb
    return chunk * WINDOW_PIECES if chunk > 0 else DEFAULT_WINDOW_MB


# Keys that were removed, with why (the bench row that showed the default as good) and the fix.
REMOVED_KEYS = {
    "optimizer.cpu_adam_copy_during_backward": (
        "delayed mode copies during the last backward wherever Megatron-Core leaves the "
        "gradients alone (one GPU), at the step boundary elsewhere: 1.10 s against 1.19 s at "
        "the boundary (suite cpu-adam-4-backward); exact mode never read it",
        "drop it",
    ),
    "optimizer.cpu_adam_threads": (
        "the CPU-Adam team takes the rank's share of the node's cores (in delayed mode less whole "
        "cores for the training thread); over 37 suites fused CPU AdamW at 2 threads fewer ran "
        "0.96x the rate at all of them (median; 0.59-1.26x, the hosts' noise: the reference "
        "rates in bench/results), and no suite set it",
        "drop it (launcher.nproc_per_node and the cores the job is given set the team)",
    ),
    "optimizer.offload_states_window_mb": (
        "the state window is 4 pieces of optimizer.optimizer_state_offload_chunk_size_mb; "
        "windows of 128, 512 and 2048 MiB took the same optimizer phase (suite states)",
        "set optimizer.optimizer_state_offload_chunk_size_mb to a quarter of it, or drop it",
    ),
    "optimizer.cpu_adam_chunk_mb": (
        "the engine's pieces are 64 MiB, smaller only for a part too small to make 16 of them "
        "(hardware.cpu_adam_piece_bytes): 256 MiB pieces were no faster (1.205 against 1.178 s "
        "a step, suite cpu-adam-4-pieces)",
        "drop it",
    ),
}
