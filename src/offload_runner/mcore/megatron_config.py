"""Our config -> Megatron-Core's config objects (TransformerConfig, OptimizerConfig, DDP config).

One mapping, used twice: validation builds these on the CPU so Megatron-Core's own checks run
before a job starts, and the worker builds the model and optimizer from the same objects. Only
keys the installed megatron-core knows are passed, so 0.16 and 0.19 both work.
"""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Any

from offload_runner.config.schema import (
    ActivationFunc,
    CpuOffloadEngine,
    ModelConfig,
    OptimizerConfig,
    RunConfig,
)


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _known_kwargs(target: type, values: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(target) if f.init}
    return {k: _plain(v) for k, v in values.items() if k in names}


def transformer_config_kwargs(model: ModelConfig) -> dict[str, Any]:
    """TransformerConfig keyword arguments for this model (no defaults of ours left implicit)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if model.bf16 else torch.float32
    values = dataclasses.asdict(model)
    values.update(
        activation_func={ActivationFunc.silu: F.silu, ActivationFunc.gelu: F.gelu}[
            model.activation_func
        ],
        bf16=model.bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        # The pipeline schedules pass the batch's real shape; keep Megatron's own default here.
        variable_seq_lengths=False,
    )
    return _known_kwargs(TransformerConfig, values)


def build_transformer_config(model: ModelConfig):  # -> TransformerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**transformer_config_kwargs(model))


def optimizer_config_kwargs(optimizer: OptimizerConfig, model: ModelConfig) -> dict[str, Any]:
    import torch
    from megatron.core.optimizer import OptimizerConfig as MCoreOptimizerConfig

    values = dataclasses.asdict(optimizer)
    values["params_dtype"] = torch.bfloat16 if model.bf16 else torch.float32
    torch_dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    for key in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        values[key] = torch_dtypes[_plain(values[key])]
    if optimizer.cpu_offload_engine == CpuOffloadEngine.cpu_adam:
        # Megatron-Core builds its precision-aware DistributedOptimizer (no fp32 masters on the
        # GPU); offload/cpu_adam.py then puts its engine in as the inner optimizer.
        values["optimizer_cpu_offload"] = False
    if optimizer.offload_optimizer_states:
        # ... and offload/optimizer_states.py puts its windowed engine in the same place.
        values["use_precision_aware_optimizer"] = True
    return _known_kwargs(MCoreOptimizerConfig, values)


def build_optimizer_config(optimizer: OptimizerConfig, model: ModelConfig):
    from megatron.core.optimizer import OptimizerConfig as MCoreOptimizerConfig

    return MCoreOptimizerConfig(**optimizer_config_kwargs(optimizer, model))


def build_ddp_config(run: RunConfig):
    from megatron.core.distributed import DistributedDataParallelConfig

    values = dataclasses.asdict(run.ddp)
    values["use_distributed_optimizer"] = run.optimizer.use_distributed_optimizer
    return DistributedDataParallelConfig(**_known_kwargs(DistributedDataParallelConfig, values))
