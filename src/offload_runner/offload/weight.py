"""Layer-level weight offload through Transformer Engine.

Transformer Engine >= 2.5 ignores ``offload_weights`` on its default (V2) offload path; only the
V1 path (``NVTE_CPU_OFFLOAD_V1=1``) still offloads weights and honours double buffering. The
launcher sets that variable for every rank when either is requested (``needs_te_v1_path``).
"""

from __future__ import annotations

from offload_runner.config.schema import RunConfig
from offload_runner.offload import OffloadSummary

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
