"""offload-runner: a Hydra recipe runner that trains Megatron-Core LLMs with CPU offloading."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def package_version(name: str = "offload-runner") -> str:
    """The installed version of a distribution, or "not installed"."""
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


__version__ = package_version()
