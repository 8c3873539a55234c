#!/usr/bin/env python
"""Why CPU Adam with bf16 moments runs slower than with fp32 ones, and what would not: torch's
fused AdamW on fp32 moments against ``host_adam.adamw`` on bf16 moments (upcast into reused fp32
blocks of UPCAST_BLOCK elements on all threads) at several block sizes, and against the same
upcast done by THREADS Python threads each on its own contiguous share, in blocks small enough
to stay in the caches, every op single-threaded (torch.set_num_threads(1): each op's block is
one thread's).

    OMP_WAIT_POLICY=PASSIVE python bench/probes/bf16_moments_probe.py   # N=64M params by default

Prints G params/s per case (median of 5 steps after one warm-up). fp32 gradients, as the
engines get them with ddp.grad_reduce_in_fp32 (the default).
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import grad_dtype_probe  # noqa: E402

from offload_runner.offload import host_adam  # noqa: E402

N = int(float(os.environ.get("N", str(64 * 1024**2))))
HYPER = grad_dtype_probe.HYPER


def rate(step) -> float:
    return grad_dtype_probe.rate(step, N)


def threaded(pool, threads: int, block: int, master, grad, m, v, fused) -> None:
    """Each thread its contiguous share, block by block into its own fp32 arrays."""
    share = -(-N // threads)

    def run(t: int) -> None:
        m32, v32 = torch.empty(block), torch.empty(block)
        for a in range(t * share, min((t + 1) * share, N), block):
            b = min(a + block, N, (t + 1) * share)
            mm, vv = m32[: b - a].copy_(m[a:b]), v32[: b - a].copy_(v[a:b])
            fused([master[a:b]], [grad[a:b]], [mm], [vv])
            m[a:b].copy_(mm)
            v[a:b].copy_(vv)

    list(pool.map(run, range(threads)))


def compiled_adam(block: int):
    """AdamW on fp32 masters and bf16 moments as one Inductor-compiled CPU kernel per block of
    ``block`` elements (fp32 math; the hyperparameters 0-d tensors, so no recompile when the
    learning rate moves), and its compile time."""
    h = {k: torch.tensor(float(x)) for k, x in HYPER.items()}
    step = torch.tensor(10.0)

    @torch.compile(dynamic=False)
    def kernel(master, grad, m16, v16, lr, beta1, beta2, wd, eps, step):
        m = m16.float().lerp(grad, 1 - beta1)
        v = v16.float() * beta2 + (1 - beta2) * grad * grad
        denom = (v / (1 - beta2**step)).sqrt() + eps
        master.mul_(1 - lr * wd).sub_(lr / (1 - beta1**step) * m / denom)
        m16.copy_(m)
        v16.copy_(v)

    def run(master, grad, m16, v16) -> None:
        for a in range(0, N, block):
            args = (master[a : a + block], grad[a : a + block], m16[a : a + block])
            kernel(
                *args,
                v16[a : a + block],
                h["lr"],
                h["beta1"],
                h["beta2"],
                h["weight_decay"],
                h["eps"],
                step,
            )

    return run


def main() -> None:
    master, grad = torch.rand(N), torch.rand(N) * 1e-3
    m32, v32 = torch.zeros(N), torch.zeros(N)
    m16, v16 = m32.bfloat16(), v32.bfloat16()
    fused = host_adam.torch_adamw(torch.tensor(10.0), HYPER)
    threads = torch.get_num_threads()
    print(f"{os.cpu_count()} CPUs, {threads} threads, torch {torch.__version__}, N={N >> 20}M")
    print(f"fp32 moments, fused AdamW: {rate(lambda: fused([master], [grad], [m32], [v32])):.2f}")
    for block in (1 << 20, 1 << 22, 1 << 24):
        host_adam.UPCAST_BLOCK = block
        got = rate(lambda: host_adam.adamw([master], [grad], [m16], [v16], fused))
        print(f"bf16 moments, all threads on blocks of {block >> 10}K: {got:.2f}")
    for block in (1 << 20, 1 << 22):
        run = compiled_adam(block)
        began = time.perf_counter()
        run(master, grad, m16, v16)
        compiled = time.perf_counter() - began
        got = rate(lambda r=run: r(master, grad, m16, v16))
        print(
            f"bf16 moments, compiled kernel, blocks of {block >> 10}K: {got:.2f} "
            f"(compiled in {compiled:.0f} s)"
        )
    torch.set_num_threads(1)
    with ThreadPoolExecutor(threads) as pool:
        for block in (1 << 15, 1 << 16, 1 << 18, 1 << 20):
            got = rate(lambda b=block: threaded(pool, threads, b, master, grad, m16, v16, fused))
            print(f"bf16 moments, {threads} Python threads, blocks of {block >> 10}K: {got:.2f}")


if __name__ == "__main__":
    main()
