"""offload-runner: a Hydra recipe runner that trains Megatron-Core LLMs with CPU offloading."""

from __future__ import annotations

import warnings
from importlib.metadata import PackageNotFoundError, version

# Megatron-Core warns at import, once per module, that Transformer Engine and Apex are missing (on
# a CPU machine, always). Where TE matters (training, TE-only options) validation says so in one
# line with its fix; the import warnings would only come first.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
# Two more at import on the GPU machine (Megatron-Core 0.19.2, TE 2.x): Python compiling a
# docstring of Megatron-Core's inference code (and of torchao's quantization API, imported for
# 8-bit moments), and TE finding JAX but not its JAX extension. None concerns the run; each
# printed in the terminal twice (the launcher and each rank).
warnings.filterwarnings(
    "ignore", message="invalid escape sequence", module=r".*(megatron|torchao)[/\\.]"
)
warnings.filterwarnings("ignore", message="Detected a Jax installation", category=RuntimeWarning)


def package_version(name: str = "offload-runner") -> str:
    """The installed version of a distribution, or "not installed"."""
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


__version__ = package_version()
