"""GPTModel with Transformer Engine (or local) layer specs, bf16 via Float16Module, Megatron DDP."""

from __future__ import annotations

import logging
import warnings

from offload_runner.config.schema import RunConfig, TransformerImpl
from offload_runner.hardware import te_available
from offload_runner.model_size import padded_vocab_size

log = logging.getLogger("offload_runner")


def use_transformer_engine(run: RunConfig) -> bool:
    """TE spec unless local is asked for, or TE is absent and no TE-only feature is on."""
    if run.model.transformer_impl == TransformerImpl.local:
        return False
    if not te_available():
        warnings.warn(
            "Transformer Engine is not installed: using Megatron-Core's local layer spec",
            stacklevel=2,
        )
        return False
    return True


def layer_spec(run: RunConfig):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    m = run.model
    kwargs = dict(
        num_experts=m.num_moe_experts,
        moe_grouped_gemm=m.moe_grouped_gemm,
        qk_layernorm=m.qk_layernorm,
    )
    if use_transformer_engine(run):
        return get_gpt_layer_with_transformer_engine_spec(**kwargs)
    return get_gpt_layer_local_spec(**kwargs, normalization=m.normalization.value)


def through_host(run: RunConfig) -> bool:
    """Whether the model goes to host memory between its initialization and DDP. Megatron-Core's
    DDP allocates its parameter and gradient buffers while each parameter still holds its own
    memory, so a model built on the GPU holds its weights twice beside the gradient buffer (the
    whole Qwen3-30B-A3B: out of memory asking for its 56.9 GB gradient buffer with 113.8 GB held,
    suite whole-model). Parked on the host, DDP copies each parameter up into its buffer and the
    GPU holds the buffers alone. Taken only where the GPU could not hold both copies: the hop
    costs a copy each way (Megatron-Core's CPU initialization, the other way to get there, is
    slow: the 3.1B-param proxy reached its first iteration some 150 s into its call,
    docs/evidence/cpu-init-proxy-16gb-h200.txt). Never beside weight offload, whose layers'
    weights leave the GPU by its own ring."""
    import torch

    from offload_runner.plan import make_plan

    if not torch.cuda.is_available() or run.model.cpu_offloading_weights:
        return False
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    try:
        plan = make_plan(run, world)
    except Exception as err:  # noqa: BLE001 - the plan only chooses the route; never fatal
        log.warning("no plan for the model's build (%s): built on the GPU", err)
        return False
    mine = next((r for r in plan.ranks if r.rank == rank), plan.worst)
    free, _ = torch.cuda.mem_get_info()
    if run.train.gpu_memory_cap_gb:  # the allocator's cap (train.initialize)
        free = min(free, run.train.gpu_memory_cap_gb * 1024**3)
    return mine.ddp_build > free


def gpt_model_kwargs(run: RunConfig) -> dict:
    """GPTModel's arguments besides its config and pipeline stage."""
    m = run.model
    return dict(
        transformer_layer_spec=layer_spec(run),
        vocab_size=padded_vocab_size(m),
        max_sequence_length=m.max_position_embeddings or m.seq_length,
        parallel_output=True,
        share_embeddings_and_output_weights=m.share_embeddings_and_output_weights,
        position_embedding_type=m.position_embedding_type.value,
        rotary_percent=m.rotary_percent,
        rotary_base=int(m.rotary_base),
        rope_scaling=m.rope_scaling,
        rope_scaling_factor=m.rope_scaling_factor,
    )


def model_class(run: RunConfig) -> type:
    """GPTModel, or with model.chunked_loss its subclass whose loss never holds whole logits."""
    from megatron.core.models.gpt import GPTModel

    if run.model.chunked_loss:
        from offload_runner.mcore.chunked_loss import ChunkedLossGPTModel

        return ChunkedLossGPTModel
    return GPTModel


def build_model(run: RunConfig, transformer_config):  # -> list[DistributedDataParallel]
    """This rank's model chunks (one per virtual pipeline stage, else one), on the GPU, each
    wrapped as Megatron-LM does."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    from offload_runner.mcore.megatron_config import build_ddp_config
    from offload_runner.offload import host_memory, weight

    m = run.model
    chunks = []
    ddp_config = build_ddp_config(run)
    parked = through_host(run)
    vpp = m.virtual_pipeline_model_parallel_size
    for vp_stage in range(vpp or 1):
        stage = {"ignore_virtual": False, "vp_stage": vp_stage} if vpp else {}
        model = model_class(run)(
            config=transformer_config,
            pre_process=parallel_state.is_pipeline_first_stage(**stage),
            post_process=parallel_state.is_pipeline_last_stage(**stage),
            **gpt_model_kwargs(run),
            **({"vp_stage": vp_stage} if vpp else {}),
        )
        model.cuda(torch.cuda.current_device())
        if m.bf16:
            model = Float16Module(transformer_config, model)
        if parked:  # DDP's buffers are whole blocks: the parameters' cached ones go back
            on_host = host_memory.park(model)
            torch.cuda.empty_cache()
        offloaded = weight.exclude(run, model)
        ddp = DistributedDataParallel(
            config=transformer_config,
            ddp_config=ddp_config,
            module=model,
            # Megatron-LM: only the first chunk's buckets overlap the param all-gather
            disable_bucketing=vp_stage > 0,
        )
        if parked:  # DDP has copied the parameters into its GPU buffers: the rest follows
            ddp.module.cuda(torch.cuda.current_device())
            on_host.release()
        ddp.broadcast_params()  # identical start on every data-parallel replica
        ddp.weight_offload = weight.take(run, offloaded, torch.device("cuda"))
        chunks.append(ddp)
    return chunks
