#!/usr/bin/env python
"""What slows fused CPU AdamW inside exact mode's update: the same N params in the engine's
64 MiB pieces on page-locked arrays with no copy, with the gradients coming down per piece, with
the masters going up behind it, with both (the engine's exact update), and with both while one
more Python thread stays busy (the training thread); against one call on pageable arrays (how
the bench's reference, ``cpu_adam.fused_adamw_rate``, runs). At each OpenMP team size given.

    # one GPU; N=1e9, THREADS=16,14
    OMP_WAIT_POLICY=PASSIVE python bench/probes/cpu_adam_copy_probe.py

Prints one line per case: the CPU's Adam seconds and its rate against the pageable reference.
Needs CUDA.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import torch
from cpu_gpu_split_probe import HYPER, Arrays, N, on_cpu


def one_call(arrays: tuple[torch.Tensor, ...], step: torch.Tensor) -> float:
    """Seconds of one fused AdamW call over whole arrays (master, grad, exp_avg, exp_avg_sq)."""
    master, grad, exp_avg, exp_avg_sq = arrays
    began = time.perf_counter()
    torch._fused_adamw_([master], [grad], [exp_avg], [exp_avg_sq], [], [step], **HYPER)
    return time.perf_counter() - began


def in_pieces(a: Arrays, copy_down: bool, copy_up: bool, busy_thread: bool) -> float:
    """Seconds of the CPU's Adam calls over all N params in pieces, with the copies told."""
    stop = threading.Event()

    def spin() -> None:  # a Python thread that never sleeps, like one launching kernels
        x = 0
        while not stop.is_set():
            x += 1

    spinner = threading.Thread(target=spin) if busy_thread else None
    if spinner:
        spinner.start()
    out: list[float] = []
    try:
        on_cpu(a, 0, N, out, copy_down, copy_up)
        torch.cuda.synchronize()
    finally:
        stop.set()
        if spinner:
            spinner.join()
    return out[0]


def median_of(fn, repeats: int = 4) -> float:
    return statistics.median([fn() for _ in range(repeats + 1)][1:])  # the first warms up


def main() -> None:
    a = Arrays(N, torch.device("cuda"))
    a.grad_host.copy_(a.grad)
    pageable = (a.master.clone(), a.grad_host.clone(), a.exp_avg.clone(), a.exp_avg_sq.clone())
    cases = {
        "one call, pageable (the bench's reference)": lambda: one_call(pageable, a.cpu_step),
        "pieces, page-locked, no copies": lambda: in_pieces(a, False, False, False),
        "pieces, gradients down": lambda: in_pieces(a, True, False, False),
        "pieces, masters up": lambda: in_pieces(a, False, True, False),
        "pieces, both (exact mode's update)": lambda: in_pieces(a, True, True, False),
        "pieces, both, one busy Python thread": lambda: in_pieces(a, True, True, True),
    }
    print(
        f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"N={N:.3g} params, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '')}"
    )
    for threads in (int(t) for t in os.environ.get("THREADS", "16,14").split(",")):
        torch.set_num_threads(threads)
        reference = None
        for name, fn in cases.items():
            seconds = median_of(fn)
            rate = N / seconds
            reference = reference or rate
            print(
                f"{threads} threads, {name}: {seconds * 1000:6.1f} ms = {rate / 1e9:.2f} G "
                f"params/s, {rate / reference:.2f}x the reference"
            )


if __name__ == "__main__":
    main()
