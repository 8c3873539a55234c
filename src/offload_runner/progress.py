"""Long start-up phases said on the terminal: a line with the size before, the time and rate
after, on global rank 0 (whose stdout is the terminal) and only where the phase is large enough
to keep a user waiting (page-locking the engines' host arrays, loading a checkpoint, indexing a
corpus)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping

SAY_GB = 10  # a phase over this much is said: it keeps the terminal silent for a while


def in_torchrun(environ: Mapping[str, str] = os.environ) -> bool:
    """True when torchrun (alone or under Slurm) started this process as a rank: RANK and
    WORLD_SIZE beside torchrun's own LOCAL_RANK or TORCHELASTIC_RUN_ID (a RANK / WORLD_SIZE left
    in a shell is no launcher: --dry-run, --plan and --prepare answer a person there)."""
    launched = "LOCAL_RANK" in environ or "TORCHELASTIC_RUN_ID" in environ
    return "RANK" in environ and "WORLD_SIZE" in environ and launched


def on_terminal() -> bool:
    """This process is global rank 0 (whose stdout is the terminal), or no torchrun rank."""
    return not in_torchrun() or os.environ["RANK"] == "0"


def timed_line(
    doing: str, done: str, nbytes: int, least_gb: float | None = None
) -> Callable[[], None]:
    """Print ``doing`` (its ``{size}`` filled in) and return a function that prints how long
    it took as ``done``; nothing for under ``least_gb`` (default SAY_GB) or off rank 0."""
    if nbytes < (SAY_GB if least_gb is None else least_gb) * 1e9 or not on_terminal():
        return lambda: None
    print(doing.format(size=f"{nbytes / 1e9:.1f} GB") + " ...", flush=True)
    began = time.perf_counter()

    def finished() -> None:
        seconds = time.perf_counter() - began
        rate = nbytes / 1e9 / max(seconds, 1e-9)
        print(f"  ... {done} in {seconds:.1f} s ({rate:.1f} GB/s)", flush=True)

    return finished
