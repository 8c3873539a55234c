"""Layer-level activation offload through Transformer Engine's CPU offload context.

Megatron-Core's TransformerBlock wraps the first ``cpu_offloading_num_layers`` layers in TE's
``get_cpu_offload_context``: tensors saved for backward go to pinned host memory in forward and
come back in backward. Megatron-Core passes the TransformerConfig fields straight through, so
switching it on is a matter of the model config (see build.megatron_config).
"""

from __future__ import annotations

from offload_runner.config.schema import RunConfig
from offload_runner.offload.base import OffloadSummary

# The keys that switch this mechanism off (a --verify baseline).
DISABLED = {
    "model.cpu_offloading": False,
    "model.cpu_offloading_num_layers": 0,
    "model.fine_grained_activation_offloading": False,
}


def describe(run: RunConfig) -> OffloadSummary:
    m = run.model
    if m.fine_grained_activation_offloading:
        modules = ", ".join(mod.value for mod in m.offload_modules or []) or "none"
        return OffloadSummary(
            "activations (fine-grained)",
            "model.fine_grained_activation_offloading",
            True,
            f"inputs of {modules} in every layer, in forward; back in backward",
        )
    enabled = m.cpu_offloading and m.cpu_offloading_activations
    return OffloadSummary(
        "activations",
        "offload/activation",
        enabled,
        f"activations of {m.cpu_offloading_num_layers} of {m.num_layers} layers, in forward; "
        "back in backward"
        if enabled
        else "-",
        "double buffering on" if enabled and m.cpu_offloading_double_buffering else "",
    )
