"""The offload mechanisms, one module each (matching the conf/offload/* groups).

- ``activation``: layer-level activation offload (Transformer Engine's CPU offload context).
- ``weight``: layer-level weight offload (offload-runner's: a GPU ring of host-resident layers).
- ``optimizer``: Megatron-Core's HybridDeviceOptimizer (a fraction of Adam on the CPU).
- ``cpu_adam``: offload-runner's CPU-Adam engine (the same fraction, pipelined; exact or delayed).
- ``optimizer_states``: Adam on the GPU, states and fp32 master weights parked on the CPU.

Each module describes what it moves for the offload summary, and holds what the worker needs to
switch it on.
"""

from __future__ import annotations

from offload_runner.config.schema import RunConfig
from offload_runner.offload.base import OffloadSummary, optimizer_parts

__all__ = ["OffloadSummary", "optimizer_parts"]

TE_V1_ENV = "NVTE_CPU_OFFLOAD_V1"


def summarize(run: RunConfig) -> list[OffloadSummary]:
    from offload_runner.offload import activation, cpu_adam, optimizer, optimizer_states, weight

    return [
        activation.describe(run),
        weight.describe(run),
        optimizer.describe(run),
        cpu_adam.describe(run),
        optimizer_states.describe(run),
    ]


def any_enabled(run: RunConfig) -> bool:
    return any(row.enabled for row in summarize(run))


def disabled_overrides() -> dict[str, object]:
    """Dotted keys that switch every offload mechanism off: the --verify baseline."""
    from offload_runner.offload import activation, cpu_adam, optimizer, optimizer_states, weight

    return {
        **activation.DISABLED,
        **weight.DISABLED,
        **optimizer.DISABLED,
        **cpu_adam.DISABLED,
        **optimizer_states.DISABLED,
    }


def te_offload_environment(run: RunConfig) -> dict[str, str]:
    """Environment variables Transformer Engine must see before it is imported: its V1 offload
    path for double buffering (only it implements that), which Megatron-LM also requires for
    fine-grained activation offloading with TE >= 2.10."""
    m = run.model
    double = m.cpu_offloading and m.cpu_offloading_activations and m.cpu_offloading_double_buffering
    return {TE_V1_ENV: "1"} if double or m.fine_grained_activation_offloading else {}


def runtime_environment(run: RunConfig) -> dict[str, str]:
    """Everything the config asks of the environment before TE/torch kernels are loaded:
    the TE offload path, idle OpenMP threads that sleep (CPU-Adam engine), and deterministic
    kernels for ``model.deterministic_mode``."""
    from offload_runner.offload import cpu_adam

    env = te_offload_environment(run)
    env.update(cpu_adam.runtime_environment(run))
    if run.model.deterministic_mode:
        env.update(NVTE_ALLOW_NONDETERMINISTIC_ALGO="0", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    return env


def apply_runtime_environment(run: RunConfig) -> dict[str, str]:
    """Set runtime_environment in os.environ (torchrun's workers inherit it)."""
    import os

    env = runtime_environment(run)
    os.environ.update(env)
    return env
