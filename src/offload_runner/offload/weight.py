"""Layer-level weight offload through Transformer Engine: a no-op in every supported release.

Transformer Engine >= 2.4 (both its default path and the V1 path, ``NVTE_CPU_OFFLOAD_V1=1``)
warns "Offloading weights is deprecated. Using offload_weights=True does not have any effect."
With weights alone it returns a ``nullcontext`` that Megatron-Core's output layer cannot use
(``'nullcontext' object has no attribute 'inside_context'``, measured on megatron-core 0.19.2 with
TE 2.20.2). Validation therefore refuses weights alone and warns when weights ride along with
activations (rules ``weight_offload_*``). The option stays so Megatron-Bridge command lines parse.
The V1 path is still selected for double buffering, which only it implements.
"""

from __future__ import annotations

from offload_runner.config.schema import RunConfig
from offload_runner.offload.base import OffloadSummary

TE_V1_ENV = "NVTE_CPU_OFFLOAD_V1"


DISABLED = {"model.cpu_offloading_weights": False}


def needs_te_v1_path(run: RunConfig) -> bool:
    """Weight offload and double buffering exist only on TE's V1 offload path."""
    m = run.model
    return m.cpu_offloading and (m.cpu_offloading_weights or m.cpu_offloading_double_buffering)


def describe(run: RunConfig) -> OffloadSummary:
    m = run.model
    enabled = m.cpu_offloading and m.cpu_offloading_weights
    return OffloadSummary(
        "weights",
        "offload/weight",
        enabled,
        f"weights of {m.cpu_offloading_num_layers} of {m.num_layers} layers between their uses"
        if enabled
        else "-",
        f"Transformer Engine V1 offload path ({TE_V1_ENV}=1)" if needs_te_v1_path(run) else "",
    )
