#!/usr/bin/env python
"""What the engines' bf16 gradients cost CPU Adam: torch's fused AdamW on fp32 gradients against
``host_adam.adamw`` on bf16 ones (upcast in blocks of UPCAST_BLOCK elements into reused fp32
arrays) at several block sizes, and against upcasting each block into a new array (the engines
before), on all of torch's intra-op threads.

    OMP_WAIT_POLICY=PASSIVE python bench/probes/grad_dtype_probe.py     # N=256M params by default

Prints G params/s per case (median of 5 steps after one warm-up).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from offload_runner.offload import host_adam  # noqa: E402

N = int(float(os.environ.get("N", str(256 * 1024**2))))
HYPER = dict(lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8)


def rate(step, n: int = N) -> float:
    """G params/s of ``step`` over ``n`` params: the median of 5 runs after a warm-up."""
    step()
    times = []
    for _ in range(5):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    return n / statistics.median(times) / 1e9


def main() -> None:
    master, m, v = torch.rand(N), torch.zeros(N), torch.zeros(N)
    grad32 = torch.rand(N) * 1e-3
    grad16 = grad32.bfloat16()
    fused = host_adam.torch_adamw(torch.tensor(10.0), HYPER)
    print(
        f"{os.cpu_count()} CPUs, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"N={N / 1e6:.0f}M params"
    )
    print(f"fp32 gradients, fused AdamW: {rate(lambda: fused([master], [grad32], [m], [v])):.2f}")
    for block in (1 << 20, 1 << 22):
        got = rate(lambda b=block: allocating(master, grad16, m, v, fused, b))
        print(f"bf16 gradients, each block of {block >> 10}K upcast into a new array: {got:.2f}")
    for block in (1 << 20, 1 << 21, 1 << 22, 1 << 23, 1 << 24):
        host_adam.UPCAST_BLOCK = block
        got = rate(lambda: host_adam.adamw([master], [grad16], [m], [v], fused))
        print(f"bf16 gradients, blocks of {block >> 10}K upcast into reused arrays: {got:.2f}")


def allocating(master, grad, m, v, fused, block: int) -> None:
    """The engines' upcast before: each block's fp32 gradients in a new array."""
    for a in range(0, master.numel(), block):
        b = min(a + block, master.numel())
        fused([master[a:b]], [grad[a:b].float()], [m[a:b]], [v[a:b]])


if __name__ == "__main__":
    main()
