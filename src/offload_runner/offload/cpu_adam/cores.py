"""The host cores of a rank's CPU Adam: the worker thread that runs it, pinned to the rank's
cores with an OpenMP team of its own, and the environment that team needs."""

from __future__ import annotations

import concurrent.futures
import os

from offload_runner.config.schema import RunConfig


def runtime_environment(run: RunConfig) -> dict[str, str]:
    """OpenMP threads that sleep when idle: the worker's thread team would otherwise spin on every
    core between its Adam calls and starve the training thread's kernel launches (measured: the
    proxy's forward and backward took seconds instead of 0.3). Set before torch is imported
    (torchrun's workers inherit it); a value the user exported wins."""
    if not run.mode.cpu_adam or "OMP_WAIT_POLICY" in os.environ:
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


def cpu_worker(cpus: list[int] | None, threads: int | None, device=None):
    """The thread that runs CPU Adam, pinned to ``cpus`` with an OpenMP team of ``threads``. One
    per rank, shared by its engines (a MoE model's dense and expert shards): their updates take
    the cores in turn instead of splitting them."""
    return concurrent.futures.ThreadPoolExecutor(
        1,
        thread_name_prefix="cpu-adam",
        initializer=init_thread,
        initargs=(cpus, threads, device),
    )


def init_thread(cpus: list[int] | None, threads: int | None, device) -> None:
    """An engine thread: its cores (its OpenMP team inherits the mask), its team's size, and its
    CUDA calls on the engine's GPU."""
    import torch

    if cpus:
        os.sched_setaffinity(0, cpus)
    if threads:
        torch.set_num_threads(threads)
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


def cpu_ranges(cpus: list[int]) -> str:
    """``0-3,6-7`` for [0, 1, 2, 3, 6, 7]."""
    spans: list[list[int]] = []
    for c in cpus:
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans) or "?"
