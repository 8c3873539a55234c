#!/usr/bin/env python
"""Delayed mode with a GPU share, outside the engine: can one step-late update of N params run
faster than on the CPU alone while the GPU computes? Delayed mode's gradients are on the host
already (they went down during the last backward), so the GPU share streams them up too: 16 B
in per param (master, moments, gradient) and 12 B out, through a window of 4 pieces, Adam on
a side stream, all beside a stand-in for forward+backward (bf16 matmuls on the compute stream);
the CPU runs fused AdamW on the rest in the engine's pieces on a worker thread.

    OMP_WAIT_POLICY=PASSIVE python bench/probes/delayed_share_probe.py   # one GPU; N=1e9 by default

Prints the stand-in alone, the CPU's update alone, then one line per GPU share: the update's
wall time beside the stand-in, the CPU's rate, and how much the stand-in slowed. Needs CUDA.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import torch
from cpu_gpu_split_probe import HYPER, PIECE, SLOTS, Arrays, N, on_cpu

MATMULS = int(os.environ.get("MATMULS", "400"))  # the stand-in: 8192^3 bf16 matmuls


def window_pass(
    a: Arrays,
    lo: int,
    hi: int,
    window: torch.Tensor,
    adam: torch.cuda.Stream,
    done: list[float],
    began: float,
) -> None:
    """Masters, moments and gradients of [lo, hi) in, Adam on ``adam``, masters and moments out
    (issued from this thread; ``done`` gets the seconds from ``began`` until the last copy out)."""
    load, unload = a.streams[2], a.streams[3]
    freed = [None] * SLOTS
    with torch.cuda.device(a.grad.device):
        for i, s in enumerate(range(lo, hi, PIECE)):
            e, slot = min(s + PIECE, hi), window[i % SLOTS]
            n = e - s
            host = (a.master[s:e], a.exp_avg[s:e], a.exp_avg_sq[s:e], a.grad_host[s:e])
            if freed[i % SLOTS] is not None:
                load.wait_event(freed[i % SLOTS])
            with torch.cuda.stream(load):
                for j, array in enumerate(host):
                    slot[j, :n].copy_(array, non_blocking=True)
            adam.wait_stream(load)
            with torch.cuda.stream(adam):
                torch._fused_adamw_(
                    [slot[0, :n]],
                    [slot[3, :n]],
                    [slot[1, :n]],
                    [slot[2, :n]],
                    [],
                    [a.gpu_step],
                    **HYPER,
                )
            unload.wait_stream(adam)
            with torch.cuda.stream(unload):
                for j, array in enumerate(host[:3]):
                    array.copy_(slot[j, :n], non_blocking=True)
                freed[i % SLOTS] = torch.cuda.Event()
                freed[i % SLOTS].record(unload)
        unload.synchronize()
    done.append(time.perf_counter() - began)


def stand_in(x: torch.Tensor) -> float:
    """Seconds of the forward+backward stand-in on the compute stream."""
    began = time.perf_counter()
    for _ in range(MATMULS):
        torch.mm(x, x)
    torch.cuda.current_stream().synchronize()
    return time.perf_counter() - began


def update(a: Arrays, share: float, window, adam, x=None) -> tuple[float, float, float, int]:
    """(update wall seconds, the CPU's Adam seconds, the stand-in's seconds or 0, CPU params) of
    one step-late update with a GPU share of ``share``, beside the stand-in where ``x``."""
    split = N if share <= 0 else int(N * (1 - share)) // PIECE * PIECE
    torch.cuda.synchronize()
    began, busy, gpu_done, cpu_done = time.perf_counter(), [], [], []

    def cpu() -> None:  # the CPU's pieces (their gradients are on the host already)
        on_cpu(a, 0, split, busy, False, False)
        cpu_done.append(time.perf_counter() - began)

    threads = [threading.Thread(target=cpu)]
    if split < N:
        job = (a, split, N, window, adam, gpu_done, began)
        threads.append(threading.Thread(target=window_pass, args=job))
    for t in threads:
        t.start()
    computed = stand_in(x) if x is not None else 0.0
    for t in threads:
        t.join()
    wall = max(cpu_done + gpu_done)  # until the update's last piece is done, not the stand-in
    return wall, busy[0], computed, split


def main() -> None:
    a = Arrays(N, torch.device("cuda"))
    a.grad_host.normal_(0, 1e-3)
    window = torch.empty(SLOTS, 4, PIECE, device="cuda")
    adam = torch.cuda.Stream()
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    alone = statistics.median(stand_in(x) for _ in range(4))
    print(
        f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} "
        f"threads, torch {torch.__version__}, N={N:.3g} params, pieces of {PIECE} params; "
        f"the stand-in alone {alone * 1000:.0f} ms ({MATMULS} bf16 8192^3 matmuls)"
    )
    cpu_alone = None
    for share in [float(s) for s in os.environ.get("SHARES", "0,0,0.3,0.4,0.5,0.6").split(",")]:
        beside = cpu_alone is not None or share > 0  # the first run: the CPU alone, no stand-in
        runs = [update(a, share, window, adam, x if beside else None) for _ in range(4)][1:]
        wall, busy, computed = (statistics.median(r[i] for r in runs) for i in range(3))
        split = runs[0][3]
        rate = split / busy
        if not beside:
            cpu_alone = wall
            print(
                f"CPU alone, no stand-in: update {wall * 1000:6.1f} ms, CPU at {rate / 1e9:.2f} G/s"
            )
            continue
        print(
            f"GPU share {1 - split / N:.2f} beside the stand-in: update {wall * 1000:6.1f} ms "
            f"({cpu_alone / wall:.2f}x faster than the CPU alone), CPU at {rate / 1e9:.2f} G/s; "
            f"the stand-in {computed * 1000:.0f} ms ({computed / alone:.2f}x alone)"
        )


if __name__ == "__main__":
    main()
