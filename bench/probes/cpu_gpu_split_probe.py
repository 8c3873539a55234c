#!/usr/bin/env python
"""Exact CPU Adam with a GPU share, outside the engine: how long one update of N params takes
when the CPU runs fused AdamW on a share of them (gradients down and masters up per piece, as
the engine moves them) while the other share's masters and moments stream through a GPU window
of 4 pieces for GPU Adam (12 B/param each way), both at once.

    OMP_WAIT_POLICY=PASSIVE python bench/probes/cpu_gpu_split_probe.py   # one GPU; N=1e9 by default

Prints one line per CPU share: the update's wall time, the CPU's rate on its share against its
rate alone (the planner's CPU_ADAM_RATE_BESIDE_STREAMS is read from the balanced rows), and the
link's rate each way. Needs CUDA.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import torch

N = int(float(os.environ.get("N", "1e9")))
PIECE = 16 * 1024**2  # the engine's 64 MiB pieces of fp32
SLOTS = 4
HYPER = dict(
    lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False
)


class Arrays:
    """The host arrays (page-locked) and the GPU's gradient and bf16 parameter buffers."""

    def __init__(self, n: int, device: torch.device) -> None:
        def pinned() -> torch.Tensor:
            return torch.empty(n, dtype=torch.float32, pin_memory=True)

        self.grad = torch.randn(n, device=device) * 1e-3
        self.param = torch.empty(n, device=device, dtype=torch.bfloat16)
        self.master, self.grad_host = pinned().normal_(0, 0.02), pinned()
        self.exp_avg, self.exp_avg_sq = pinned().zero_(), pinned().zero_()
        self.window = torch.empty(SLOTS, 3, PIECE, device=device)
        self.ring = [torch.empty(PIECE, device=device) for _ in range(2)]
        self.streams = [torch.cuda.Stream() for _ in range(4)]  # down, up, window in, window out
        self.gpu_step = torch.tensor(10.0, device=device)
        self.cpu_step = torch.tensor(10.0)


def on_cpu(
    a: Arrays, lo: int, hi: int, out: list[float], copy_down: bool = True, copy_up: bool = True
) -> None:
    """Gradients down per piece, fused AdamW on the CPU as each arrives, masters up behind it
    (without the copies down or up where told: the gradients are already on the host)."""
    down, up = a.streams[0], a.streams[1]
    arrived = []
    with torch.cuda.stream(down):
        for s in range(lo, hi, PIECE):
            e = min(s + PIECE, hi)
            event = None
            if copy_down:
                a.grad_host[s:e].copy_(a.grad[s:e], non_blocking=True)
                event = torch.cuda.Event(blocking=True)
                event.record(down)
            arrived.append((s, e, event))
    busy = 0.0
    for i, (s, e, event) in enumerate(arrived):
        if event is not None:
            event.synchronize()
        began = time.perf_counter()
        torch._fused_adamw_(
            [a.master[s:e]],
            [a.grad_host[s:e]],
            [a.exp_avg[s:e]],
            [a.exp_avg_sq[s:e]],
            [],
            [a.cpu_step],
            **HYPER,
        )
        busy += time.perf_counter() - began
        if not copy_up:
            continue
        with torch.cuda.stream(up):
            ring = a.ring[i % 2][: e - s]
            ring.copy_(a.master[s:e], non_blocking=True)
            a.param[s:e].copy_(ring)
    out.append(busy)


def on_gpu(a: Arrays, lo: int, hi: int) -> None:
    """Masters and moments in through the window, GPU Adam, back out (state offload's pass)."""
    load, unload = a.streams[2], a.streams[3]
    compute = torch.cuda.current_stream()
    freed = [None] * SLOTS
    for i, s in enumerate(range(lo, hi, PIECE)):
        e, slot = min(s + PIECE, hi), a.window[i % SLOTS]
        n, host = e - s, (a.master[s:e], a.exp_avg[s:e], a.exp_avg_sq[s:e])
        if freed[i % SLOTS] is not None:
            load.wait_event(freed[i % SLOTS])
        with torch.cuda.stream(load):
            for j, array in enumerate(host):
                slot[j, :n].copy_(array, non_blocking=True)
        compute.wait_stream(load)
        torch._fused_adamw_(
            [slot[0, :n]], [a.grad[s:e]], [slot[1, :n]], [slot[2, :n]], [], [a.gpu_step], **HYPER
        )
        a.param[s:e].copy_(slot[0, :n])
        unload.wait_stream(compute)
        with torch.cuda.stream(unload):
            for j, array in enumerate(host):
                array.copy_(slot[j, :n], non_blocking=True)
            freed[i % SLOTS] = torch.cuda.Event()
            freed[i % SLOTS].record(unload)


def update(a: Arrays, cpu_share: float) -> tuple[float, float, int]:
    """(wall seconds, the CPU's Adam seconds, params on the CPU) of one update."""
    split = N if cpu_share >= 1 else int(N * cpu_share) // PIECE * PIECE
    torch.cuda.synchronize()
    began, busy = time.perf_counter(), []
    worker = threading.Thread(target=on_cpu, args=(a, 0, split, busy)) if split else None
    if worker:
        worker.start()
    if split < N:
        on_gpu(a, split, N)
    if worker:
        worker.join()
    torch.cuda.synchronize()
    return time.perf_counter() - began, (busy[0] if busy else 0.0), split


def main() -> None:
    a = Arrays(N, torch.device("cuda"))
    shares = [float(x) for x in os.environ.get("SHARES", "1,0,0.6,0.5,0.4,0.3,0.2").split(",")]
    print(
        f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} "
        f"threads, torch {torch.__version__}, N={N:.3g} params, pieces of {PIECE} params"
    )
    alone = None
    for share in shares:
        runs = [update(a, share) for _ in range(4)][1:]  # the first warms up
        wall = statistics.median(r[0] for r in runs)
        busy = statistics.median(r[1] for r in runs)
        split = runs[0][2]
        rate = split / busy if busy else None
        if share >= 1:
            alone = rate
        link = (12 * (N - split) + 4 * split) / wall / 1e9
        beside = f", {rate / alone:.2f}x its rate alone" if rate and alone and share < 1 else ""
        print(
            f"CPU share {split / N:.2f}: update {wall * 1000:6.1f} ms = {N / wall / 1e9:.2f} G "
            f"params/s; CPU {busy * 1000:6.1f} ms at "
            f"{(rate or 0) / 1e9:.2f} G/s{beside}; link {link:.1f} GB/s each way"
        )


if __name__ == "__main__":
    main()
