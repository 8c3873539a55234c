"""Our config -> Megatron-Core's config objects (TransformerConfig, OptimizerConfig, DDP config).

One mapping, used twice: validation builds these on the CPU so Megatron-Core's own checks run
before a job starts, and the worker builds the model and optimizer from the same objects. Only
keys the installed megatron-core knows are passed, so 0.16 and 0.19 both work.
"""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Any

from offload_runner.config.megatron_fields import field_default
from offload_runner.config.schema import (
    TORCH_DTYPES,
    ActivationFunc,
    CpuOffloadEngine,
    ModelConfig,
    OptimizerConfig,
    OptimizerDtype,
    RunConfig,
)


def _plain(value: Any) -> Any:
    """A config value as Megatron-Core takes it: our dtype names as torch dtypes, our own enums
    as their strings; Megatron-Core's own enums (e.g. AttnBackend) stay as they are."""
    import torch

    if isinstance(value, OptimizerDtype):
        return getattr(torch, TORCH_DTYPES[value.value])
    if isinstance(value, Enum) and type(value).__module__.startswith("offload_runner."):
        return value.value
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _known_kwargs(target: type, values: dict[str, Any]) -> dict[str, Any]:
    """The values ``target`` has fields for; a null where Megatron-Core's default is something
    else leaves that default (e.g. an object no config file can hold)."""
    defaults = {f.name: field_default(f) for f in dataclasses.fields(target) if f.init}
    return {
        k: _plain(v)
        for k, v in values.items()
        if k in defaults and not (v is None and defaults[k] not in (None, dataclasses.MISSING))
    }


def transformer_config_kwargs(model: ModelConfig) -> dict[str, Any]:
    """TransformerConfig keyword arguments for this model (no defaults of ours left implicit)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if model.bf16 else torch.float32
    values = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
    values.update(
        activation_func={ActivationFunc.silu: F.silu, ActivationFunc.gelu: F.gelu}[
            model.activation_func
        ],
        bf16=model.bf16,
        # The pipeline schedules pass the batch's real shape; keep Megatron's own default here.
        variable_seq_lengths=False,
        # Transformer Engine offloads activations only; weights are offload/weight.py's
        cpu_offloading=model.cpu_offloading and model.cpu_offloading_activations,
        cpu_offloading_weights=False,
    )
    kwargs = _known_kwargs(TransformerConfig, values)
    for key in ("params_dtype", "pipeline_dtype"):  # model.params_dtype=bf16 ..., else model.bf16
        kwargs[key] = kwargs.get(key) or dtype
    return kwargs


def build_transformer_config(model: ModelConfig):  # -> TransformerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**transformer_config_kwargs(model))


def optimizer_config_kwargs(optimizer: OptimizerConfig, model: ModelConfig) -> dict[str, Any]:
    import torch
    from megatron.core.optimizer import OptimizerConfig as MCoreOptimizerConfig

    values = {f.name: getattr(optimizer, f.name) for f in dataclasses.fields(optimizer)}
    values["params_dtype"] = torch.bfloat16 if model.bf16 else torch.float32
    # state offload's bf16 masters and 8-bit moments are its engine's own: Megatron-Core builds
    # its usual fp32 ones, which that engine replaces before they are allocated
    if values["main_params_dtype"] == OptimizerDtype.bf16:
        values["main_params_dtype"] = OptimizerDtype.fp32
    for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        if values[key] == OptimizerDtype.q8:
            values[key] = OptimizerDtype.fp32
    if optimizer.cpu_offload_engine == CpuOffloadEngine.cpu_adam:
        # Megatron-Core builds its precision-aware DistributedOptimizer (no fp32 masters on the
        # GPU); offload/cpu_adam/ then puts its engine in as the inner optimizer.
        values["optimizer_cpu_offload"] = False
    if optimizer.offload_optimizer_states or optimizer.chunked_optimizer_state_offload:
        # ... and offload/optimizer_states.py puts its windowed engine in the same place.
        values["use_precision_aware_optimizer"] = True
    # A Megatron-Core with its own state offload (these keys) leaves it to that engine.
    values.update(
        offload_optimizer_states=False,
        chunked_optimizer_state_offload=False,
        optimizer_state_offload_fraction=1.0,
        optimizer_state_offload_chunk_size_mb=0,
    )
    return _known_kwargs(MCoreOptimizerConfig, values)


def build_optimizer_config(optimizer: OptimizerConfig, model: ModelConfig):
    from megatron.core.optimizer import OptimizerConfig as MCoreOptimizerConfig

    return MCoreOptimizerConfig(**optimizer_config_kwargs(optimizer, model))


def build_ddp_config(run: RunConfig):
    from megatron.core.distributed import DistributedDataParallelConfig

    values = {f.name: getattr(run.ddp, f.name) for f in dataclasses.fields(run.ddp)}
    return DistributedDataParallelConfig(**_known_kwargs(DistributedDataParallelConfig, values))
