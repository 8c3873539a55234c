"""What every offload mechanism module shares: its row of the offload summary, and the optimizer
parts Megatron-Core built."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OffloadSummary:
    """One row of the offload summary table."""

    mechanism: str
    group: str  # the Hydra group that selects it
    enabled: bool
    moves: str  # what goes to the CPU, and when
    note: str = ""


def optimizer_parts(optimizer) -> list:
    """The optimizers inside what ``get_megatron_optimizer`` returned: the parts of a
    ChainedOptimizer (e.g. dense and expert parameters), or the optimizer itself."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))
