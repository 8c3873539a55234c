#!/usr/bin/env python
"""Why CPU Adam with bf16 moments ran slower than with fp32 ones, and what does not: torch's
fused AdamW on fp32 moments against ``host_adam.adamw``'s blocks on bf16 moments (upcast into
reused fp32 blocks of UPCAST_BLOCK elements on all threads) and against host_kernel's compiled
one-pass loop on the same threads' count, with fp32 and bf16 gradients.

    OMP_WAIT_POLICY=PASSIVE python bench/probes/bf16_moments_probe.py   # N=64M params by default

Prints G params/s per case (median of 5 steps after one warm-up). Commit fc543b2's version also
timed an Inductor-compiled kernel and Python threads on small blocks
(docs/evidence/bf16-moments-probe-h200.txt).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import grad_dtype_probe  # noqa: E402

from offload_runner.offload import host_adam, host_kernel  # noqa: E402

N = int(float(os.environ.get("N", str(64 * 1024**2))))
HYPER = grad_dtype_probe.HYPER


def rate(step) -> float:
    return grad_dtype_probe.rate(step, N)


def main() -> None:
    master, grad = torch.rand(N), torch.rand(N) * 1e-3
    m32, v32 = torch.zeros(N), torch.zeros(N)
    m16, v16 = m32.bfloat16(), v32.bfloat16()
    steps = torch.tensor(10.0)
    fused = host_adam.torch_adamw(steps, HYPER)
    threads = torch.get_num_threads()
    print(f"{os.cpu_count()} CPUs, {threads} threads, torch {torch.__version__}, N={N >> 20}M")
    print(f"fp32 moments, fused AdamW: {rate(lambda: fused([master], [grad], [m32], [v32])):.2f}")
    kernel = host_kernel.load()
    host_kernel.load = lambda: None  # the blocks below, not the kernel
    for block in (1 << 22,):
        host_adam.UPCAST_BLOCK = block
        got = rate(lambda: host_adam.adamw([master], [grad], [m16], [v16], steps, HYPER))
        print(f"bf16 moments, all threads on blocks of {block >> 10}K: {got:.2f}")
    for g in (grad, grad.bfloat16()):
        got = rate(lambda g=g: host_kernel.adamw(kernel, master, g, m16, v16, HYPER, 10.0))
        print(f"bf16 moments, host_kernel on {threads} threads, {g.dtype} grads: {got:.2f}")


if __name__ == "__main__":
    main()
