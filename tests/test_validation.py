"""Every rule: the illegal combination fails with its documented message; its neighbour passes."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from conftest import PROJECT_ROOT, compose_run

from offload_runner.validation import (
    RULES,
    Environment,
    Level,
    check_rules,
    errors,
    megatron_checks,
    validate,
)

WITH_TE = Environment(te_available=True, launching=True)
# metadata --prepare wrote for the shipped sample (4096 and 2048 ids; .bin/.idx not kept)
PREPARED = PROJECT_ROOT / "tests/data/prepared"
LOAD = f"checkpoint.load={PREPARED}"
SOTU_PREPARED = PREPARED / "sotu"  # --prepare's metadata alone: the rules read nothing else
CHAT_PREPARED = PREPARED / "chat"
WEIGHTS_ONLY = PROJECT_ROOT / "tests/data/weights_only"  # an import's files, no tensors
ACT = ("offload/activation=enabled",)
WEIGHT = ("offload/weight=enabled",)


@dataclass(frozen=True)
class Case:
    rule: str
    bad: tuple[str, ...]
    good: tuple[str, ...]
    message: str
    env: Environment = WITH_TE


RECIPE_TINY = ("recipe=tiny",)
CASES = [
    Case(
        "cpu_offloading_needs_pp1",
        ("recipe=tiny", *ACT, "model.pipeline_model_parallel_size=2"),
        ("recipe=tiny", *ACT),
        "Currently there is no support for Pipeline parallelism with CPU offloading",
    ),
    Case(
        "cpu_offloading_without_recompute",
        (
            "recipe=tiny",
            *ACT,
            "model.recompute_granularity=full",
            "model.recompute_method=uniform",
            "model.recompute_num_layers=1",
        ),
        (
            "recipe=tiny",
            "model.recompute_granularity=full",
            "model.recompute_method=uniform",
            "model.recompute_num_layers=1",
        ),
        "CPU offloading does not work when activation recomputation is enabled",
    ),
    Case(
        "cpu_offloading_xor_fine_grained",
        (
            "recipe=tiny",
            *ACT,
            "model.fine_grained_activation_offloading=true",
            "model.offload_modules=[core_attn]",
        ),
        (
            "recipe=tiny",
            "model.fine_grained_activation_offloading=true",
            "model.offload_modules=[core_attn]",
        ),
        "fine_grained_activation_offloading cannot be enabled with cpu_offloading.",
    ),
    Case(
        "cpu_offloading_without_cuda_graphs",
        ("recipe=tiny", *ACT, "model.cuda_graph_impl=local"),
        ("recipe=tiny", "model.cuda_graph_impl=local"),
        "CUDA graphs not supported with CPU offloading.",
    ),
    Case(
        "cpu_offloading_layer_range",
        ("recipe=tiny", *ACT, "model.cpu_offloading_num_layers=4"),
        ("recipe=tiny", *ACT, "model.cpu_offloading_num_layers=3"),
        "CPU offloading can be done only for layers less than 4",
    ),
    Case(
        "expert_offload_needs_grouped_experts",
        (
            "recipe=tiny",
            "model.fine_grained_activation_offloading=true",
            "model.offload_modules=[core_attn,expert_fc1]",
        ),
        (
            "recipe=tiny",
            "model.fine_grained_activation_offloading=true",
            "model.offload_modules=[core_attn]",
        ),
        "model.offload_modules names expert_fc1 / moe_act",
    ),
    Case(
        "cpu_offloading_what",
        (
            "recipe=tiny",
            "model.cpu_offloading=true",
            "model.cpu_offloading_num_layers=1",
            "model.cpu_offloading_activations=false",
        ),
        ("recipe=tiny", "model.cpu_offloading=true", "model.cpu_offloading_num_layers=1"),
        "CPU Offloading is enabled while it is not mentioned what to offload (weights/activations)",
    ),
    Case(
        "deprecated_cuda_graph_flag_with_impl",
        ("recipe=tiny", "model.enable_cuda_graph=true", "model.cuda_graph_impl=local"),
        ("recipe=tiny", "model.cuda_graph_impl=local"),
        "Do not use enable_cuda_graph or external_cuda_graph with cuda_graph_impl.",
    ),
    Case(
        "deprecated_cuda_graph_flag",
        ("recipe=tiny", "model.external_cuda_graph=true"),
        ("recipe=tiny", "model.cuda_graph_impl=transformer_engine"),
        "model.external_cuda_graph is deprecated in Megatron-Core",
    ),
    Case(
        "weight_offload_needs_a_host_engine",
        ("recipe=tiny", *WEIGHT),
        ("recipe=tiny", *WEIGHT, "offload/optimizer=states"),
        "weight offload keeps its layers' masters and Adam moments on the host",
    ),
    Case(
        "weight_offload_not_delayed",
        ("recipe=tiny", *WEIGHT, "offload/optimizer=cpu_adam_delayed"),
        ("recipe=tiny", *WEIGHT, "offload/optimizer=cpu_adam"),
        "weight offload updates its layers exactly",
    ),
    Case(
        "weight_offload_one_gpu",
        ("recipe=tiny", *WEIGHT, "offload/optimizer=states", "launcher.nproc_per_node=2"),
        ("recipe=tiny", *WEIGHT, "offload/optimizer=states", "launcher.nproc_per_node=1"),
        "weight offload runs on one GPU for now",
    ),
    Case(
        "weight_offload_bf16",
        (
            "recipe=tiny",
            *WEIGHT,
            "offload/optimizer=cpu_adam",
            "model.bf16=false",
            "optimizer.bf16=false",
        ),
        ("recipe=tiny", *WEIGHT, "offload/optimizer=states"),
        "weight offload streams bf16 weights",
    ),
    Case(
        "weight_offload_layer_range",
        ("recipe=tiny", *WEIGHT, "offload/optimizer=states", "model.cpu_offloading_num_layers=5"),
        ("recipe=tiny", *WEIGHT, "offload/optimizer=states", "model.cpu_offloading_num_layers=4"),
        "weight offload can move at most the model's 4 layers",
    ),
    Case(
        "cpu_offloading_zero_layers",
        ("recipe=tiny", *ACT, "model.cpu_offloading_num_layers=0"),
        ("recipe=tiny", *ACT, "model.cpu_offloading_num_layers=1"),
        "model.cpu_offloading=true with model.cpu_offloading_num_layers=0 offloads no layer",
    ),
    Case(
        "cpu_offloading_num_layers_unused",
        ("recipe=tiny", "model.cpu_offloading_num_layers=2"),
        ("recipe=tiny", *ACT, "model.cpu_offloading_num_layers=2"),
        "model.cpu_offloading_num_layers=2 has no effect while model.cpu_offloading=false",
    ),
    Case(
        "layer_offload_needs_te",
        ("recipe=tiny", *ACT),
        ("recipe=tiny",),
        "CPU offloading (model.cpu_offloading) runs inside Transformer Engine, which is not "
        "installed here",
        Environment(te_available=False, launching=True),
    ),
    Case(
        "fine_grained_needs_modules",
        ("recipe=tiny", "model.fine_grained_activation_offloading=true"),
        (
            "recipe=tiny",
            "model.fine_grained_activation_offloading=true",
            "model.offload_modules=[expert_fc1]",
        ),
        "fine_grained_activation_offloading needs at least one module in model.offload_modules",
    ),
    Case(
        "fine_grained_attn_proj_needs_core_attn",
        (
            "recipe=tiny",
            "model.fine_grained_activation_offloading=true",
            "model.offload_modules=[attn_proj]",
        ),
        (
            "recipe=tiny",
            "model.fine_grained_activation_offloading=true",
            "model.offload_modules=[core_attn,attn_proj]",
        ),
        "attn_proj cannot be set to offload_modules alone without core_attn",
    ),
    Case(
        "offload_modules_unused",
        ("recipe=tiny", "model.offload_modules=[core_attn]"),
        (
            "recipe=tiny",
            "model.fine_grained_activation_offloading=true",
            "model.offload_modules=[core_attn]",
        ),
        "model.offload_modules has no effect while model.fine_grained_activation_offloading=false",
    ),
    Case(
        "fine_grained_needs_te",
        (
            "recipe=tiny",
            "model.fine_grained_activation_offloading=true",
            "model.offload_modules=[core_attn]",
        ),
        ("recipe=tiny",),
        "fine_grained_activation_offloading needs Transformer Engine, which is not installed here",
        Environment(te_available=False, launching=True),
    ),
    Case(
        "offload_fraction_range",
        ("recipe=tiny", "offload/optimizer=cpu_50", "optimizer.optimizer_offload_fraction=1.5"),
        ("recipe=tiny", "offload/optimizer=cpu_50", "optimizer.optimizer_offload_fraction=1.0"),
        "optimizer_offload_fraction must be in [0.0, 1.0]",
    ),
    Case(
        "cpu_offload_needs_distributed_optimizer",
        ("recipe=tiny", "offload/optimizer=cpu_50", "optimizer.use_distributed_optimizer=false"),
        ("recipe=tiny", "offload/optimizer=cpu_50"),
        "optimizer_cpu_offload requires the distributed optimizer",
    ),
    Case(
        "cpu_offload_needs_adamw",
        ("recipe=tiny", "offload/optimizer=cpu_50", "optimizer.decoupled_weight_decay=false"),
        ("recipe=tiny", "optimizer.decoupled_weight_decay=false"),
        "CPU offloading only supported with decoupled_weight_decay enabled (AdamW mode).",
    ),
    Case(
        "cpu_offload_needs_precision_aware",
        (
            "recipe=tiny",
            "offload/optimizer=cpu_50",
            "optimizer.use_precision_aware_optimizer=false",
        ),
        ("recipe=tiny", "offload/optimizer=cpu_50"),
        "optimizer_cpu_offload runs on Megatron-Core's precision-aware optimizer path",
    ),
    Case(
        "cpu_offload_nothing_offloaded",
        ("recipe=tiny", "optimizer.optimizer_cpu_offload=true"),
        (
            "recipe=tiny",
            "optimizer.optimizer_cpu_offload=true",
            "optimizer.optimizer_offload_fraction=0.25",
        ),
        "optimizer_cpu_offload=true with optimizer_offload_fraction=0.0 offloads nothing",
    ),
    Case(
        "overlap_needs_cpu_offload",
        ("recipe=tiny", "optimizer.overlap_cpu_optimizer_d2h_h2d=true"),
        ("recipe=tiny", "offload/optimizer=cpu_100"),
        "optimizer.overlap_cpu_optimizer_d2h_h2d has no effect while optimizer_cpu_offload=false",
    ),
    Case(
        "torch_optimizer_for_cpu_offload_ignored",
        (
            "recipe=tiny",
            "offload/optimizer=cpu_50",
            "optimizer.use_torch_optimizer_for_cpu_offload=true",
        ),
        ("recipe=tiny", "offload/optimizer=cpu_50"),
        "optimizer.use_torch_optimizer_for_cpu_offload has no effect with adam",
    ),
    Case(
        "precision_aware_needs_adam",
        ("recipe=tiny", "optimizer.use_precision_aware_optimizer=true", "optimizer.optimizer=sgd"),
        ("recipe=tiny", "optimizer.use_precision_aware_optimizer=true"),
        "--use-precision-aware-optimizer only supported with adam",
    ),
    Case(
        "precision_aware_needs_distributed_optimizer",
        (
            "recipe=tiny",
            "optimizer.use_precision_aware_optimizer=true",
            "optimizer.use_distributed_optimizer=false",
        ),
        ("recipe=tiny", "optimizer.use_precision_aware_optimizer=true"),
        "--use-precision-aware-optimizer only supported with distributed optimizer",
    ),
    Case(
        "precision_aware_needs_te",
        ("recipe=tiny", "offload/optimizer=cpu_50"),
        ("recipe=tiny", "offload/optimizer=disabled"),
        "the precision-aware optimizer (needed by optimizer_cpu_offload and "
        "offload/optimizer=states) uses Transformer Engine's FusedAdam",
        Environment(te_available=False, launching=True),
    ),
    Case(
        "states_xor_cpu_offload",
        (
            "recipe=tiny",
            "offload/optimizer=states",
            "optimizer.optimizer_cpu_offload=true",
            "optimizer.optimizer_offload_fraction=0.5",
        ),
        ("recipe=tiny", "offload/optimizer=states"),
        "offload_optimizer_states can not be used with optimizer_cpu_offload.",
    ),
    Case(
        "states_need_distributed_optimizer",
        ("recipe=tiny", "offload/optimizer=states", "optimizer.use_distributed_optimizer=false"),
        ("recipe=tiny", "offload/optimizer=states"),
        "offload_optimizer_states requires the distributed optimizer",
    ),
    Case(
        "cpu_adam_needs_cpu_offload",
        ("recipe=tiny", "optimizer.cpu_offload_engine=cpu_adam"),
        ("recipe=tiny", "offload/optimizer=cpu_adam"),
        "optimizer.cpu_offload_engine=cpu_adam has no effect while optimizer_cpu_offload=false",
    ),
    Case(
        "dataset_split_unreadable",
        ("recipe=tiny", "data=indexed", "dataset.data_path=[/d/text]", "dataset.split='1,-1,0'"),
        ("recipe=tiny", "data=indexed", "dataset.data_path=[/d/text]", "dataset.split='98/2'"),
        "dataset.split=1,-1,0 is not up to three non-negative shares",
    ),
    Case(
        "delayed_updates_learn_slower",
        ("recipe=tiny", "offload/optimizer=cpu_adam_delayed"),
        ("recipe=tiny", "offload/optimizer=cpu_adam"),
        "delayed CPU-Adam updates learn slower",
    ),
    Case(
        "delayed_update_needs_cpu_adam",
        ("recipe=tiny", "offload/optimizer=cpu_50", "optimizer.cpu_adam_delayed_update=true"),
        ("recipe=tiny", "offload/optimizer=cpu_adam_delayed"),
        "optimizer.cpu_adam_delayed_update needs offload-runner's CPU-Adam engine",
    ),
    Case(
        "cpu_adam_needs_bf16",
        ("recipe=tiny", "offload/optimizer=cpu_adam", "model.bf16=false", "optimizer.bf16=false"),
        ("recipe=tiny", "offload/optimizer=cpu_100", "model.bf16=false", "optimizer.bf16=false"),
        "the CPU-Adam engine rounds its fp32 masters into bf16 parameters",
    ),
    Case(
        "cpu_adam_overlap_flag_unused",
        (
            "recipe=tiny",
            "offload/optimizer=cpu_adam",
            "optimizer.overlap_cpu_optimizer_d2h_h2d=true",
        ),
        ("recipe=tiny", "offload/optimizer=cpu_adam"),
        "optimizer.overlap_cpu_optimizer_d2h_h2d is HybridDeviceOptimizer's",
    ),
    Case(
        "weight_prediction_needs_delayed_mode",
        ("recipe=tiny", "offload/optimizer=cpu_adam", "optimizer.cpu_adam_weight_prediction=true"),
        (
            "recipe=tiny",
            "offload/optimizer=cpu_adam_delayed",
            "optimizer.cpu_adam_weight_prediction=true",
        ),
        "optimizer.cpu_adam_weight_prediction only acts",
    ),
    Case(
        "exact_columns_need_delayed_mode",
        ("recipe=tiny", "offload/optimizer=cpu_adam", "optimizer.cpu_adam_exact_columns=0.1"),
        (
            "recipe=tiny",
            "offload/optimizer=cpu_adam_delayed",
            "optimizer.cpu_adam_exact_columns=0.1",
        ),
        "optimizer.cpu_adam_exact_columns updates columns exactly",
    ),
    Case(
        "gpu_share_needs_cpu_adam",
        ("recipe=tiny", "offload/optimizer=cpu_50", "optimizer.cpu_adam_gpu_share=0.5"),
        ("recipe=tiny", "offload/optimizer=cpu_adam_delayed", "optimizer.cpu_adam_gpu_share=0.5"),
        "optimizer.cpu_adam_gpu_share splits",
    ),
    Case(
        "gpu_share_not_with_weight_prediction",
        (
            "recipe=tiny",
            "offload/optimizer=cpu_adam_delayed",
            "optimizer.cpu_adam_gpu_share=0.5",
            "optimizer.cpu_adam_weight_prediction=true",
        ),
        (
            "recipe=tiny_moe",
            "parallel=ep2",
            "offload/optimizer=cpu_adam_delayed_experts",
            "optimizer.cpu_adam_gpu_share=0.5",
            "optimizer.cpu_adam_weight_prediction=true",
        ),
        "optimizer.cpu_adam_weight_prediction extrapolates",
    ),
    Case(
        "delayed_scope_needs_delayed_mode",
        (
            "recipe=tiny_moe",
            "offload/optimizer=cpu_adam",
            "optimizer.cpu_adam_delayed_scope=experts",
        ),
        ("recipe=tiny_moe", "parallel=ep2", "offload/optimizer=cpu_adam_delayed_experts"),
        "optimizer.cpu_adam_delayed_scope=experts only acts",
    ),
    Case(
        "delayed_experts_need_their_own_optimizer_part",
        ("recipe=tiny_moe", "offload/optimizer=cpu_adam_delayed_experts"),
        ("recipe=tiny_moe", "parallel=ep2", "offload/optimizer=cpu_adam_delayed_experts"),
        "optimizer.cpu_adam_delayed_scope=experts needs the routed experts",
    ),
    Case(
        "delayed_experts_need_moe",
        ("recipe=tiny", "offload/optimizer=cpu_adam_delayed_experts"),
        ("recipe=tiny", "offload/optimizer=cpu_adam_delayed"),
        "optimizer.cpu_adam_delayed_scope=experts delays a MoE",
    ),
    Case(
        "auto_delayed_needs_auto",
        ("recipe=tiny", "planner.auto_delayed=true"),
        ("recipe=tiny", "planner.auto_delayed=true", "planner.auto_optimizer=true"),
        "planner.auto_delayed only acts when offload/optimizer=auto",
    ),
    Case(
        "forward_backward_time_for_delayed_mode",
        ("recipe=tiny", "offload/optimizer=cpu_adam", "planner.forward_backward_s=0.5"),
        ("recipe=tiny", "offload/optimizer=cpu_adam_delayed", "planner.forward_backward_s=0.5"),
        "planner.forward_backward_s only prices delayed mode",
    ),
    Case(
        "auto_delayed_needs_cpu_adam",
        ("recipe=tiny", "planner.auto_delayed=true", "planner.auto_engine=hybrid"),
        ("recipe=tiny", "planner.auto_delayed=true"),
        "planner.auto_delayed picks offload-runner's CPU-Adam engine in delayed mode",
    ),
    Case(
        "cpu_adam_exact_steps_non_negative",
        ("recipe=tiny", "offload/optimizer=cpu_adam_delayed", "optimizer.cpu_adam_exact_steps=-1"),
        ("recipe=tiny", "offload/optimizer=cpu_adam_delayed", "optimizer.cpu_adam_exact_steps=0"),
        "optimizer.cpu_adam_exact_steps must be >= 0",
    ),
    Case(
        "states_need_adam",
        ("recipe=tiny", "offload/optimizer=states", "optimizer.optimizer=sgd"),
        ("recipe=tiny", "optimizer.optimizer=sgd"),
        "offload_optimizer_states requires optimizer.optimizer=adam",
    ),
    Case(
        "states_need_bf16",
        ("recipe=tiny", "offload/optimizer=states", "model.bf16=false"),
        ("recipe=tiny", "model.bf16=false"),
        "offload/optimizer=states streams the fp32 masters of bf16 parameters",
    ),
    Case(
        "states_need_adamw",
        ("recipe=tiny", "offload/optimizer=states", "optimizer.decoupled_weight_decay=false"),
        ("recipe=tiny", "optimizer.decoupled_weight_decay=false"),
        "offload/optimizer=states runs AdamW",
    ),
    Case(
        "states_need_fp32_masters",
        ("recipe=tiny", "offload/optimizer=states", "optimizer.main_params_dtype=fp16"),
        (
            "recipe=tiny",
            "offload/optimizer=states",
            "optimizer.exp_avg_dtype=bf16",
            "optimizer.exp_avg_sq_dtype=q8",
            "optimizer.main_params_dtype=bf16",
        ),
        "optimizer state offload keeps fp32 or bf16 master weights and fp32, bf16 or 8-bit",
    ),
    Case(
        "lowest_precision_needs_state_offload",
        (
            "recipe=tiny",
            "optimizer.use_precision_aware_optimizer=true",
            "optimizer.exp_avg_dtype=q8",
        ),
        ("recipe=tiny", "offload/optimizer=states", "optimizer.exp_avg_dtype=q8"),
        "8-bit moments (q8) and bf16 masters are state offload's",
    ),
    Case(
        "lowest_precision_whole_shard",
        (
            "recipe=tiny",
            "offload/optimizer=states",
            "optimizer.main_params_dtype=bf16",
            "optimizer.optimizer_state_offload_fraction=0.5",
        ),
        ("recipe=tiny", "offload/optimizer=states", "optimizer.main_params_dtype=bf16"),
        "8-bit moments and bf16 masters live on the host only",
    ),
    Case(
        "lowest_precision_beside_weight_offload",
        (
            "recipe=tiny",
            "offload/optimizer=states",
            "optimizer.exp_avg_dtype=q8",
            "offload/weight=enabled",
            "model.cpu_offloading_num_layers=1",
        ),
        ("recipe=tiny", "offload/optimizer=states", "optimizer.exp_avg_dtype=q8"),
        "weight offload keeps its layers' masters and moments in fp32 or bf16",
    ),
    Case(  # a folder with files in it and no precision file: an fp32-layout checkpoint
        "checkpoint_precision_differs",
        ("recipe=tiny", "offload/optimizer=states", "optimizer.exp_avg_sq_dtype=q8", LOAD),
        ("recipe=tiny", "offload/optimizer=states", LOAD),
        f"checkpoint.load={PREPARED} holds the optimizer states as Megatron-Core's layout with "
        "fp32 masters, which every engine loads, this run keeps exp_avg fp32, exp_avg_sq q8, "
        "2 B masters",
        Environment(te_available=True, launching=True),
    ),
    Case(
        "adam_beta_below_one",
        ("recipe=tiny", "optimizer.adam_beta2=1"),
        ("recipe=tiny", "optimizer.adam_beta2=0.999"),
        "optimizer.adam_beta1=0.9, adam_beta2=1.0: Adam's betas must be below 1",
    ),
    Case(
        "min_lr_above_lr",
        ("recipe=tiny", "optimizer.min_lr=0.01"),
        ("recipe=tiny", "optimizer.min_lr=0.0001"),
        "optimizer.min_lr=0.01 is above optimizer.lr=0.001",
    ),
    Case(
        "warmup_init_above_lr",
        ("recipe=tiny", "scheduler.lr_warmup_init=0.01"),
        ("recipe=tiny", "scheduler.lr_warmup_init=0.0001"),
        "scheduler.lr_warmup_init=0.01 is above optimizer.lr=0.001",
    ),
    Case(
        "weight_decay_ramp_falls",
        (
            "recipe=tiny",
            "scheduler.start_weight_decay=0.1",
            "scheduler.end_weight_decay=0.01",
            "scheduler.weight_decay_incr_style=linear",
        ),
        (
            "recipe=tiny",
            "scheduler.start_weight_decay=0.01",
            "scheduler.end_weight_decay=0.1",
            "scheduler.weight_decay_incr_style=linear",
        ),
        "scheduler.start_weight_decay is above end_weight_decay",
    ),
    Case(
        "q8_moments_need_torchao",
        ("recipe=tiny", "offload/optimizer=states", "optimizer.exp_avg_dtype=q8"),
        ("recipe=tiny", "offload/optimizer=states", "optimizer.exp_avg_dtype=bf16"),
        "8-bit moments (optimizer.exp_avg_dtype / exp_avg_sq_dtype=q8, or auto's last step) "
        "quantize with torchao",
        Environment(te_available=True, launching=True, torchao_available=False),
    ),
    Case(
        "chunked_loss_needs_tp1",
        ("recipe=tiny", "model.chunked_loss=true", "parallel=tp2"),
        ("recipe=tiny", "model.chunked_loss=true"),
        "model.chunked_loss keeps the whole vocabulary on one GPU",
    ),
    Case(
        "pretrained_checkpoint_missing",
        ("recipe=tiny", "checkpoint.pretrained_checkpoint=tests/data/sotu"),
        ("recipe=tiny", f"checkpoint.pretrained_checkpoint={WEIGHTS_ONLY}", "model.num_layers=2"),
        "checkpoint.pretrained_checkpoint=tests/data/sotu holds no checkpoint",
    ),
    Case(
        "load_weights_only",
        ("recipe=tiny", f"checkpoint.load={WEIGHTS_ONLY}"),
        ("recipe=tiny", f"checkpoint.pretrained_checkpoint={WEIGHTS_ONLY}", "model.num_layers=2"),
        f"checkpoint.load={WEIGHTS_ONLY} holds weights only",
    ),
    Case(
        "pretrained_architecture_differs",
        ("recipe=tiny", f"checkpoint.pretrained_checkpoint={WEIGHTS_ONLY}"),
        ("recipe=tiny", f"checkpoint.pretrained_checkpoint={WEIGHTS_ONLY}", "model.num_layers=2"),
        f"checkpoint.pretrained_checkpoint={WEIGHTS_ONLY} holds a model with num_layers=2 "
        "(this run: 4)",
    ),
    Case(
        "prepared_metadata_foreign",
        ("recipe=tiny", "data=indexed", f"dataset.data_path=[{PREPARED / 'foreign'}]"),
        ("recipe=tiny", "data=indexed", f"dataset.data_path=[{SOTU_PREPARED}]"),
        f"{PREPARED / 'foreign'}.json beside dataset.data_path's prefix is not --prepare's",
    ),
    Case(
        "sft_needs_chat_data",
        ("recipe=tiny", "data=sft", f"dataset.data_path=[{SOTU_PREPARED}]"),
        ("recipe=tiny", "data=sft", f"dataset.data_path=[{CHAT_PREPARED}]"),
        "data=sft trains on chat data's answers",
    ),
    Case(
        "chat_data_without_sft",
        ("recipe=tiny", "data=indexed", f"dataset.data_path=[{CHAT_PREPARED}]"),
        ("recipe=tiny", "data=sft", f"dataset.data_path=[{CHAT_PREPARED}]"),
        "data=indexed on chat data trains on every token",
    ),
    Case(
        "states_fraction_range",
        ("recipe=tiny", "offload/optimizer=states", "optimizer.optimizer_state_offload_fraction=0"),
        (
            "recipe=tiny",
            "offload/optimizer=states",
            "optimizer.optimizer_state_offload_fraction=0.25",
        ),
        "optimizer_state_offload_fraction must be in (0, 1]",
    ),
    Case(
        "states_fraction_needs_state_offload",
        ("recipe=tiny", "optimizer.optimizer_state_offload_fraction=0.5"),
        (
            "recipe=tiny",
            "optimizer.chunked_optimizer_state_offload=true",
            "optimizer.optimizer_state_offload_fraction=0.5",
        ),
        "optimizer.optimizer_state_offload_fraction acts on optimizer state offload",
    ),
    Case(
        "states_chunk_size_non_negative",
        (
            "recipe=tiny",
            "offload/optimizer=states",
            "optimizer.optimizer_state_offload_chunk_size_mb=-1",
        ),
        (
            "recipe=tiny",
            "offload/optimizer=states",
            "optimizer.optimizer_state_offload_chunk_size_mb=16",
        ),
        "optimizer_state_offload_chunk_size_mb must be >= 0",
    ),
    Case(
        "states_not_with_megatron_fsdp",
        (
            "recipe=tiny",
            "optimizer.chunked_optimizer_state_offload=true",
            "ddp.use_megatron_fsdp=true",
        ),
        ("recipe=tiny", "ddp.use_megatron_fsdp=true"),
        "Optimizer state offload is not supported with Megatron-FSDP.",
    ),
    Case(
        "cpu_adam_dtypes",
        ("recipe=tiny", "offload/optimizer=cpu_adam", "optimizer.exp_avg_dtype=q8"),
        (
            "recipe=tiny",
            "offload/optimizer=cpu_adam",
            "optimizer.exp_avg_dtype=bf16",
            "optimizer.exp_avg_sq_dtype=bf16",
        ),
        "the CPU-Adam engine keeps fp32 master weights and fp32 or bf16 moments",
    ),
    Case(
        "heads_divisible_by_tp",
        ("recipe=tiny", "model.num_attention_heads=5", "parallel=tp2", "model.num_query_groups=2"),
        ("recipe=tiny", "parallel=tp2"),
        "num_attention_heads (5) must be divisible by tensor_model_parallel_size (2)",
    ),
    Case(
        "query_groups_divisible_by_tp",
        ("recipe=tiny", "model.num_query_groups=1", "parallel=tp2"),
        ("recipe=tiny", "model.num_query_groups=2", "parallel=tp2"),
        "num_query_groups (1) must be divisible by tensor_model_parallel_size (2)",
    ),
    Case(
        "layers_divisible_by_pp",
        ("recipe=tiny", "model.pipeline_model_parallel_size=3"),
        ("recipe=tiny", "model.pipeline_model_parallel_size=2"),
        "num_layers (4) must be divisible by pipeline_model_parallel_size (3)",
    ),
    Case(
        "ep_needs_moe",
        ("recipe=tiny", "parallel=ep2"),
        ("recipe=tiny_moe", "parallel=ep2"),
        "expert_model_parallel_size=2 needs a MoE model",
    ),
    Case(
        "experts_divisible_by_ep",
        ("recipe=tiny_moe", "model.expert_model_parallel_size=3"),
        ("recipe=tiny_moe", "model.expert_model_parallel_size=4"),
        "num_moe_experts (8) must be divisible by expert_model_parallel_size (3)",
    ),
    Case(
        "topk_at_most_experts",
        ("recipe=tiny_moe", "model.moe_router_topk=9"),
        ("recipe=tiny_moe", "model.moe_router_topk=8"),
        "moe_router_topk (9) exceeds num_moe_experts (8)",
    ),
    Case(
        "batch_divisible_by_micro_batch",
        ("recipe=tiny", "train.global_batch_size=5"),
        ("recipe=tiny", "train.global_batch_size=6"),
        "global_batch_size (5) must be a multiple of micro_batch_size (2)",
    ),
    Case(
        "world_fits_model_parallel",
        ("recipe=tiny", "parallel=tp2"),
        ("recipe=tiny",),
        "3 GPUs can not be split into TP2 x PP1 x CP1 model replicas",
        Environment(te_available=True, launching=True, world_size=3),
    ),
    Case(
        "world_fits_expert_parallel",
        ("recipe=tiny_moe", "model.expert_model_parallel_size=4"),
        ("recipe=tiny_moe", "parallel=ep2"),
        "2 GPUs can not hold EP4 x PP1 expert groups",
        Environment(te_available=True, launching=True, world_size=2),
    ),
    Case(
        "batch_divisible_by_data_parallel",
        ("recipe=tiny", "train.global_batch_size=6"),
        ("recipe=tiny", "train.global_batch_size=8"),
        "global_batch_size (6) must be a multiple of micro_batch_size x data-parallel size on 2",
        Environment(te_available=True, launching=True, world_size=2),
    ),
    Case(
        "multinode_needs_rendezvous",
        ("recipe=tiny", "launcher=multinode"),
        ("recipe=tiny", "launcher=multinode", "launcher.rdzv_endpoint=node0:29400"),
        "launcher.nnodes=2 needs launcher.rdzv_endpoint",
    ),
    Case(
        "context_parallel_sequence_split",
        ("recipe=tiny", "parallel=cp2", "model.seq_length=250"),
        ("recipe=tiny", "parallel=cp2"),
        "seq_length (250) must be divisible by 2 x context_parallel_size (2)",
    ),
    Case(
        "context_parallel_needs_te_spec",
        ("recipe=tiny", "parallel=cp2", "model.transformer_impl=local"),
        ("recipe=tiny", "model.transformer_impl=local"),
        "Context parallelism is only supported by TEDotProductAttention!",
    ),
    Case(
        "context_parallel_needs_te",
        ("recipe=tiny", "parallel=cp2"),
        ("recipe=tiny",),
        "Context parallelism is only supported by TEDotProductAttention! (Transformer Engine",
        Environment(te_available=False, launching=True),
    ),
    Case(
        "cp_comm_type_known",
        ("recipe=tiny", "parallel=cp2", "model.cp_comm_type=a2a+p2p"),
        ("recipe=tiny", "parallel=cp2", "model.cp_comm_type=all_gather"),
        "model.cp_comm_type=a2a+p2p is not one of p2p, all_gather, a2a",
    ),
    Case(
        "cp_a2a_heads_divisible",
        ("recipe=tiny", "parallel=cp2", "model.cp_comm_type=a2a", "model.num_query_groups=1"),
        ("recipe=tiny", "parallel=cp2", "model.cp_comm_type=a2a"),
        "cp_comm_type=a2a splits attention heads over CP ranks",
    ),
    Case(
        "cp_comm_type_unused",
        ("recipe=tiny", "model.cp_comm_type=p2p"),
        ("recipe=tiny", "parallel=cp2", "model.cp_comm_type=p2p"),
        "model.cp_comm_type=p2p has no effect while context_parallel_size=1",
    ),
    Case(
        "save_interval_without_save",
        ("recipe=tiny", "checkpoint.save_interval=10"),
        ("recipe=tiny", "checkpoint.save_interval=10", "checkpoint.save=/tmp/ckpt"),
        "checkpoint.save_interval is set but checkpoint.save (the folder) is not",
    ),
    Case(
        "indexed_needs_data_path",
        ("recipe=tiny", "data=indexed"),
        ("recipe=tiny", "data=indexed", "dataset.data_path=[/data/a_text_document]"),
        "dataset.kind=indexed needs dataset.data_path",
    ),
    Case(
        "data_path_missing",
        ("recipe=tiny", "data=indexed", "dataset.data_path=[0.5,/nowhere/a,0.5,/nowhere/b]"),
        ("recipe=tiny", "data=mock"),  # a prepared prefix: test_a_prepared_prefix_is_found
        "dataset.data_path: no .bin/.idx here for /nowhere/a, /nowhere/b",
        Environment(te_available=True, launching=True),
    ),
    Case(
        "optimizer_dtypes_with_cpu_offload",
        ("recipe=tiny", "offload/optimizer=cpu_100", "optimizer.exp_avg_dtype=bf16"),
        (
            "recipe=tiny",
            "optimizer.use_precision_aware_optimizer=true",
            "optimizer.exp_avg_dtype=bf16",
        ),
        "optimizer_cpu_offload keeps Adam's states and masters in fp32 on the host",
    ),
    Case(
        "tensorboard_needs_package",
        ("recipe=tiny", "logger.tensorboard_dir=/tmp/tb"),
        ("recipe=tiny",),
        "logger.tensorboard_dir is set, and the tensorboard package is not installed here",
        Environment(te_available=True, launching=True, tensorboard_available=False),
    ),
    Case(
        "manual_gc_interval_unused",
        ("recipe=tiny", "train.manual_gc_interval=10"),
        ("recipe=tiny", "train.manual_gc_interval=10", "train.manual_gc=true"),
        "train.manual_gc_interval=10 has no effect while train.manual_gc=false",
    ),
    Case(
        "profile_one_tool",
        ("recipe=tiny", "profiling.use_pytorch_profiler=true", "profiling.use_nsys_profiler=true"),
        ("recipe=tiny", "profiling.use_pytorch_profiler=true"),
        "profiling.use_pytorch_profiler and profiling.use_nsys_profiler are exclusive",
    ),
    Case(
        "profile_window",
        (
            "recipe=tiny",
            "profiling.use_pytorch_profiler=true",
            "profiling.profile_step_start=5",
            "profiling.profile_step_end=4",
        ),
        (
            "recipe=tiny",
            "profiling.use_pytorch_profiler=true",
            "profiling.profile_step_start=4",
            "profiling.profile_step_end=4",
        ),
        "profiling window 5..4 is empty",
    ),
    Case(
        "profile_window_after_end",
        (
            "recipe=tiny",
            "profiling.use_nsys_profiler=true",
            "profiling.profile_step_start=50",
            "profiling.profile_step_end=60",
        ),
        (
            "recipe=tiny",
            "profiling.use_nsys_profiler=true",
            "profiling.profile_step_start=20",
            "profiling.profile_step_end=60",
        ),
        "profiling starts at iteration 50, after the last one (20)",
    ),
    # Megatron-Bridge's sections
    Case(
        "distributed_optimizer_sections_differ",
        ("recipe=tiny", "ddp.use_distributed_optimizer=false"),
        (
            "recipe=tiny",
            "ddp.use_distributed_optimizer=false",
            "optimizer.use_distributed_optimizer=false",
        ),
        "ddp.use_distributed_optimizer=False and optimizer.use_distributed_optimizer=True differ",
    ),
    Case(
        "dataset_seq_length_differs",
        ("recipe=tiny", "dataset.seq_length=128"),
        ("recipe=tiny", "model.seq_length=128"),
        "dataset.seq_length=128 and model.seq_length=256 differ",
    ),
    Case(
        "tokenizer_vocab_differs",
        ("recipe=tiny", "tokenizer.vocab_size=1000"),
        ("recipe=tiny", "tokenizer.vocab_size=1000", "model.vocab_size=1000"),
        "tokenizer.vocab_size=1000 and model.vocab_size=",
    ),
    Case(
        "tokenizer_vocab_divisor_differs",
        ("recipe=tiny", "tokenizer.make_vocab_size_divisible_by=64"),
        ("recipe=tiny", "tokenizer.make_vocab_size_divisible_by=128"),
        "tokenizer.make_vocab_size_divisible_by=64 and",
    ),
    Case(
        "dataset_blend_spelling",
        ("recipe=tiny", "dataset.blend=[[/d/a],[1.0]]"),
        RECIPE_TINY,
        "dataset.blend / dataset.blend_per_split are Megatron-Bridge's Python spelling",
    ),
    Case(
        "checkpoint_format",
        ("recipe=tiny", "checkpoint.ckpt_format=fsdp_dtensor"),
        ("recipe=tiny", "checkpoint.ckpt_format=torch_dist"),
        "checkpoint.ckpt_format=fsdp_dtensor: offload-runner saves and loads",
    ),
    Case(
        "fp16_not_supported",
        ("recipe=tiny", "mixed_precision.fp16=true"),
        RECIPE_TINY,
        "fp16 mixed precision is not supported",
    ),
    Case(
        "fp8_not_supported",
        ("recipe=tiny", "mixed_precision.fp8=hybrid"),
        RECIPE_TINY,
        "FP8 training (model.fp8=hybrid) is not supported",
    ),
    Case(
        "virtual_pipeline_needs_pipeline",
        ("recipe=tiny", "model.virtual_pipeline_model_parallel_size=2"),
        (
            "recipe=tiny",
            "model.num_layers=4",
            "model.pipeline_model_parallel_size=2",
            "model.virtual_pipeline_model_parallel_size=2",
        ),
        "virtual_pipeline_model_parallel_size=2 needs pipeline parallelism",
    ),
    Case(
        "wsd_needs_decay_iters",
        ("recipe=tiny", "scheduler.lr_decay_style=WSD"),
        ("recipe=tiny", "scheduler.lr_decay_style=WSD", "scheduler.lr_wsd_decay_iters=2"),
        "scheduler.lr_decay_style=WSD needs the length of its final decay",
    ),
    Case(
        "flex_dispatcher_needs_deep_ep",
        ("recipe=qwen3_30b_a3b_proxy", "model.moe_token_dispatcher_type=flex"),
        ("recipe=qwen3_30b_a3b_proxy",),
        "model.moe_token_dispatcher_type=flex needs DeepEP",
        Environment(te_available=True, launching=True, deep_ep_available=False),
    ),
    Case(
        "wandb_needs_package",
        ("recipe=tiny", "logger.wandb_project=p"),
        RECIPE_TINY,
        "logger.wandb_project is set, and the wandb package is not installed here",
        Environment(te_available=True, launching=True, wandb_available=False),
    ),
    Case(
        "evaluation_without_validation_split",
        ("recipe=tiny", "validation.eval_iters=2", "dataset.split='100,0,0'"),
        ("recipe=tiny", "validation.eval_iters=2"),
        "validation.eval_iters=2 evaluates on the validation split, and dataset.split=100,0,0",
    ),
    Case(
        "evaluation_beside_weight_offload",
        (
            "recipe=tiny",
            "offload/weight=enabled",
            "offload/optimizer=states",
            "validation.eval_iters=2",
        ),
        ("recipe=tiny", "offload/weight=enabled", "offload/optimizer=states"),
        "validation.eval_iters evaluates with forwards of its own, and weight offload's ring",
    ),
    Case(
        "evaluation_interval_without_iters",
        ("recipe=tiny", "validation.eval_interval=500"),
        ("recipe=tiny", "validation.eval_interval=500", "validation.eval_iters=2"),
        "validation.eval_interval=500 has no effect without validation.eval_iters",
    ),
    Case(
        "dataloader_keys_unused",
        ("recipe=tiny", "dataset.dataloader_type=cyclic"),
        ("recipe=tiny", "dataset.dataloader_type=single"),
        "dataset.dataloader_type / data_sharding",
    ),
    Case(
        "tokenizer_not_loaded",
        ("recipe=tiny", "tokenizer.tokenizer_type=HuggingFaceTokenizer"),
        RECIPE_TINY,
        "tokenizer.HuggingFaceTokenizer is not loaded",
    ),
    Case(
        "async_save_not_run",
        ("recipe=tiny", "checkpoint.async_save=true"),
        RECIPE_TINY,
        "checkpoint.async_save=true has no effect",
    ),
    Case(
        "fusions_need_te",
        ("recipe=qwen3_30b_a3b_proxy",),
        ("recipe=qwen3_30b_a3b_proxy", "speed=plain"),
        "model.moe_permute_fusion, model.moe_router_fusion, model.apply_rope_fusion, "
        "model.cross_entropy_fusion_impl=te run inside Transformer Engine",
        Environment(te_available=False, launching=True),
    ),
    Case(
        "te_cuda_graphs_not_captured",
        ("recipe=tiny", "model.cuda_graph_impl=transformer_engine"),
        ("recipe=tiny", "model.cuda_graph_impl=local"),
        "model.cuda_graph_impl=transformer_engine is captured by the training loop's",
    ),
    Case(
        "gradient_accumulation_fusion_needs_apex",
        ("recipe=tiny", "model.gradient_accumulation_fusion=true"),
        RECIPE_TINY,
        "model.gradient_accumulation_fusion needs APEX's fused_weight_gradient_mlp_cuda",
        Environment(te_available=True, launching=True, fused_wgrad_available=False),
    ),
    Case(
        "prepared_vocab_exceeds_model",
        (
            "recipe=tiny",
            "data=indexed",
            f"dataset.data_path=[{PREPARED}/sotu]",
            "model.vocab_size=1000",
        ),
        (
            "recipe=tiny",
            "data=indexed",
            f"dataset.data_path=[{PREPARED}/sotu]",
            "model.vocab_size=4096",
        ),
        "dataset.data_path was prepared with a tokenizer of 4096 ids",
    ),
    Case(
        "prepared_eods_differ",
        (
            "recipe=tiny",
            "data=indexed",
            f"dataset.data_path=[0.5,{PREPARED}/sotu,0.5,{PREPARED}/small]",
        ),
        ("recipe=tiny", "data=indexed", f"dataset.data_path=[{PREPARED}/sotu]"),
        "dataset.data_path blends prefixes prepared with different end-of-document ids",
    ),
    Case(
        "query_groups_divide_heads",
        ("recipe=tiny", "model.num_attention_heads=8", "model.num_query_groups=3"),
        ("recipe=tiny", "model.num_attention_heads=8", "model.num_query_groups=4"),
        "model.num_attention_heads=8 is not a multiple of model.num_query_groups=3",
    ),
    Case(
        "mxfp8_buffer_reuse_unused",
        ("recipe=tiny", "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=true"),
        RECIPE_TINY,
        "mixed_precision.fp8_param_gather / reuse_grad_buf_for_mxfp8_param_ag have no effect",
    ),
]


def test_every_rule_has_a_case() -> None:
    assert sorted(c.rule for c in CASES) == sorted(r.name for r in RULES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.rule)
def test_rule(case: Case) -> None:
    bad = [v for v in check_rules(compose_run(*case.bad), case.env) if v.rule == case.rule]
    assert len(bad) == 1, f"{case.rule} did not fire"
    assert bad[0].message.startswith(case.message)
    assert bad[0].fix
    good = check_rules(compose_run(*case.good), case.env)
    assert case.rule not in {v.rule for v in good}


def test_all_violations_are_reported_at_once() -> None:
    run = compose_run(
        "recipe=qwen3_30b_a3b",
        *ACT,
        "model.recompute_granularity=full",
        "model.recompute_method=uniform",
        "model.recompute_num_layers=1",
        "model.cuda_graph_impl=local",
        "optimizer.optimizer_offload_fraction=2",
    )
    found = {v.rule for v in errors(validate(run, WITH_TE))}
    assert {
        "cpu_offloading_needs_pp1",
        "cpu_offloading_without_recompute",
        "cpu_offloading_without_cuda_graphs",
        "offload_fraction_range",
    } <= found


def test_environment_rules_are_warnings_for_a_dry_run() -> None:
    run = compose_run("recipe=tiny", *ACT)
    dry = check_rules(run, Environment(te_available=False, launching=False))
    assert [v.level for v in dry if v.rule == "layer_offload_needs_te"] == [Level.warning]
    launch = check_rules(run, Environment(te_available=False, launching=True))
    assert [v.level for v in launch if v.rule == "layer_offload_needs_te"] == [Level.error]


@pytest.mark.parametrize(
    "recipe", ["tiny", "tiny_moe", "qwen3_30b_a3b_proxy", "qwen3_30b_a3b", "llama3_8b"]
)
@pytest.mark.parametrize(
    "choice", ["offload/optimizer=disabled", "offload/optimizer=cpu_50", "offload/optimizer=states"]
)
def test_recipes_pass_megatron_core_checks(recipe: str, choice: str) -> None:
    run = compose_run(f"recipe={recipe}", choice)
    assert megatron_checks(run, Environment(te_available=False)) == []


def test_the_recipes_carry_the_speed_settings_and_speed_plain_drops_them() -> None:
    """The Qwen3 and Llama recipes run the NVIDIA recipes' fused kernels (conf/speed/fused.yaml);
    speed=plain is Megatron-Core's defaults; the test recipes keep the defaults."""
    for recipe in ("qwen3_30b_a3b", "qwen3_30b_a3b_proxy", "llama3_8b"):
        run = compose_run(f"recipe={recipe}")
        assert run.model.apply_rope_fusion and run.model.cross_entropy_fusion_impl == "te"
        assert run.model.moe_router_dtype == "fp32" and run.train.manual_gc
        plain = compose_run(f"recipe={recipe}", "speed=plain")
        assert not plain.model.apply_rope_fusion and not plain.train.manual_gc
    assert not compose_run("recipe=tiny_moe").model.moe_permute_fusion


def test_without_te_the_fusions_are_left_to_their_row_not_to_megatron_core() -> None:
    """Megatron-Core raises 'Please install TE' for a fusion it cannot import; without TE the
    fusions_need_te row says it (a warning for --dry-run) and the rest of its checks still run."""
    run = compose_run("recipe=qwen3_30b_a3b_proxy", "model.sequence_parallel=true")
    found = megatron_checks(run, Environment(te_available=False))
    assert [v.message for v in found] == [
        "Cannot use sequence parallelism without tensor parallelism"
    ]


def test_megatron_core_checks_are_reported_in_the_same_format() -> None:
    run = compose_run("recipe=tiny", "model.sequence_parallel=true")
    found = megatron_checks(run, WITH_TE)
    assert [v.rule for v in found] == ["megatron_core.model"]
    assert found[0].message == "Cannot use sequence parallelism without tensor parallelism"
    assert found[0].level == Level.error and found[0].fix


def test_documented_messages_are_not_repeated_by_megatron_core() -> None:
    run = compose_run("recipe=tiny", *ACT, "model.pipeline_model_parallel_size=2")
    messages = [v.message for v in validate(run, WITH_TE)]
    assert (
        messages.count("Currently there is no support for Pipeline parallelism with CPU offloading")
        == 1
    )


def test_a_bare_megatron_core_assert_is_named_or_left_to_our_own_error() -> None:
    """Megatron-Core's ``assert`` without a message (an empty offload_modules list under
    fine-grained offload): our rule's error alone, not a second, empty ``error: AssertionError``;
    where no rule of ours speaks, its own source line."""
    run = compose_run(
        "recipe=tiny", "model.fine_grained_activation_offloading=true", "model.offload_modules=[]"
    )
    found = errors(validate(run, WITH_TE))
    assert [v.message for v in found] == [
        "fine_grained_activation_offloading needs at least one module in model.offload_modules"
    ]
    bare = megatron_checks(run, WITH_TE)
    assert len(bare) == 1 and bare[0].message.startswith("Megatron-Core's check failed (")
    assert "transformer_config.py:" in bare[0].message and "offload_modules" in bare[0].message


@pytest.mark.parametrize(
    "override",
    [
        "train.global_batch_size=-8",
        "train.micro_batch_size=-1",
        "train.micro_batch_size=0",
        "model.seq_length=0",
        "train.train_iters=0",
        "optimizer.lr=-1",
        "model.num_layers=0",
        "model.num_layers=-4",
        "model.num_layers=99999999999999999999",  # planned a 1.9e18 GB peak
        "model.hidden_size=10000000",
        "optimizer.optimizer_offload_fraction=1.5",
        "optimizer.adam_beta2=2",
        "optimizer.lr=inf",
        "optimizer.lr=1e309",
        "planner.gpu_memory_gb=inf",
        "optimizer.lr=nan",
    ],
)
def test_out_of_range_values_are_refused(override: str, tmp_path, capsys) -> None:
    from offload_runner.cli import EXIT_USAGE, main

    for mode in ("--dry-run", "--plan"):
        assert main(["--recipe", "tiny", override, mode, f"output_dir={tmp_path}/x"]) == EXIT_USAGE
    captured = capsys.readouterr()
    out = " ".join((captured.out + captured.err).split())
    assert f"{override.partition('=')[0]}=" in out
    assert "is out of range" in out or "offload_fraction" in out or "not a finite number" in out
    assert not (tmp_path / "x").exists()


def test_ranges_name_real_numeric_fields_and_every_recipe_is_in_range() -> None:
    from dataclasses import fields

    from offload_runner.config.compose import recipe_paths
    from offload_runner.config.schema import RunConfig
    from offload_runner.validation import RANGES, range_violations

    run = RunConfig()
    for section, key in RANGES:
        names = {f.name for f in fields(getattr(run, section))}
        assert key in names, f"{section}.{key} is not a schema field"
    for recipe in recipe_paths():
        assert range_violations(compose_run(f"recipe={recipe}")) == [], recipe


def test_moe_layer_recompute_does_not_walk_around_the_offload_recompute_rule() -> None:
    """model.moe_layer_recompute=true makes Megatron-Core set selective recompute after its own
    offload check has run: the rule judges the config as it finally is."""
    run = compose_run(
        "recipe=tiny_moe",
        "model.cpu_offloading=true",
        "model.cpu_offloading_num_layers=1",
        "model.moe_layer_recompute=true",
    )
    assert "cpu_offloading_without_recompute" in {v.rule for v in check_rules(run, WITH_TE)}


def test_a_one_layer_model_is_told_there_is_no_layer_to_offload() -> None:
    """Not 'a value from 1 to 0'."""
    run = compose_run("recipe=tiny", *ACT, "model.num_layers=1")
    (found,) = [v for v in check_rules(run, WITH_TE) if v.rule == "cpu_offloading_layer_range"]
    assert "no layer to offload" in found.fix and "1 to 0" not in found.fix


def test_the_deprecated_cuda_graph_flag_is_named_in_the_fix() -> None:
    """Megatron-Core's message names both flags; the fix names the one the user set."""
    found = [
        v
        for v in check_rules(
            compose_run(
                "recipe=tiny", "model.enable_cuda_graph=true", "model.cuda_graph_impl=local"
            ),
            WITH_TE,
        )
        if v.rule == "deprecated_cuda_graph_flag_with_impl"
    ]
    assert found and found[0].fix.startswith(
        "drop model.enable_cuda_graph (the deprecated spelling of model.cuda_graph_impl=local)"
    )


@pytest.mark.parametrize("split", ["abc", "0,0,0", "1,-1,0", "99,1,0,0", ""])
def test_a_split_megatron_would_misread_is_refused(split: str) -> None:
    """Megatron-Core's parser takes whatever digits it finds: 'abc' and '0,0,0' end in a
    division by zero at dataset build, '1,-1,0' reads as 1,1,0."""
    run = compose_run("recipe=tiny", "data=indexed", "dataset.data_path=[/d/text]")
    run = replace(run, dataset=replace(run.dataset, split=split))
    assert "dataset_split_unreadable" in {v.rule for v in errors(validate(run, WITH_TE))}


def test_a_prepared_prefix_is_found(prepared) -> None:
    launching = Environment(te_available=True, launching=True)
    run = compose_run("recipe=tiny", "data=indexed", f"dataset.data_path=[{prepared}]")
    assert "data_path_missing" not in {v.rule for v in check_rules(run, launching)}
