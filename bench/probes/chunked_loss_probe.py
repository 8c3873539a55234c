#!/usr/bin/env python
"""Where the chunked loss's time goes: the output layer and its cross entropy for T tokens of
Qwen3-30B-A3B's shapes (h 2048, vocab 151,936, bf16), forward and backward, whole logits with
Transformer Engine's fused cross entropy (Megatron-Core's fused path) against
``mcore/chunked_loss.py``, interleaved; then the torch profiler's top CUDA kernels of one
chunked pass.

    python bench/probes/chunked_loss_probe.py [T ...]      # default 16384 32768

Prints per T: the median time of 5 passes and the peak memory above the inputs, each path.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from offload_runner.mcore.chunked_loss import ChunkedCrossEntropy, chunk_tokens  # noqa: E402

H, V = 2048, 151936


def whole(hidden, weight, labels):
    from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy

    logits = hidden @ weight.t()
    return parallel_cross_entropy(logits[None], labels[None], 0.0, False, None)


def chunked(hidden, weight, labels):
    return ChunkedCrossEntropy.apply(hidden, weight, labels, chunk_tokens(V))


def timed(path, hidden, weight, labels) -> tuple[float, float]:
    """(seconds, GB above the inputs) of one forward and backward."""
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    path(hidden, weight, labels).float().sum().backward()
    torch.cuda.synchronize()
    return time.perf_counter() - began, (torch.cuda.max_memory_allocated() - base) / 1e9


def main(sizes: list[int]) -> None:
    torch.manual_seed(0)
    weight = (torch.randn(V, H, device="cuda") * 0.02).bfloat16().requires_grad_()
    for tokens in sizes:
        hidden = torch.randn(tokens, H, device="cuda").bfloat16().requires_grad_()
        labels = torch.randint(0, V, (tokens,), device="cuda")
        runs: dict[str, list] = {"whole": [], "chunked": []}
        for _ in range(6):  # the first pass of each warms up
            for name, path in (("whole", whole), ("chunked", chunked)):
                runs[name].append(timed(path, hidden, weight, labels))
        for name, rows in runs.items():
            seconds = statistics.median(r[0] for r in rows[1:])
            print(f"T {tokens} {name}: {seconds * 1e3:.1f} ms, peak +{rows[-1][1]:.2f} GB")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        timed(chunked, hidden, weight, labels)
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60)
    )


if __name__ == "__main__":
    main([int(t) for t in sys.argv[1:]] or [16384, 32768])
