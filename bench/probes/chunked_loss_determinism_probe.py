#!/usr/bin/env python
"""Is the chunked loss bit-for-bit repeatable on the GPU, and if not, which of its operations is
not? The output layer and its cross entropy at the proxy's shapes (16,384 tokens, h 2048,
vocabulary 151,936, bf16), each operation of ``mcore/chunked_loss.py``'s backward run five times
on the same inputs, alone and beside a side stream's matmuls (as state offload's passes run).

    python bench/probes/chunked_loss_determinism_probe.py

Prints per operation how many distinct results its five runs gave (1: repeatable).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from offload_runner.mcore.chunked_loss import ChunkedCrossEntropy, chunk_tokens  # noqa: E402

T, H, V = 16384, 2048, 151936
RUNS = 5


def distinct(results: list[torch.Tensor]) -> int:
    kept: list[torch.Tensor] = []
    for r in results:
        if not any(torch.equal(r, k) for k in kept):
            kept.append(r)
    return len(kept)


def whole_pass(hidden, weight, labels):
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    losses = ChunkedCrossEntropy.apply(h, w, labels, chunk_tokens(V))
    losses.sum().backward()
    return torch.cat([losses.float().flatten(), h.grad.float().flatten(), w.grad.float().flatten()])


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(T, H, device="cuda", generator=g, dtype=torch.bfloat16)
    weight = (torch.randn(V, H, device="cuda", generator=g) * 0.02).bfloat16()
    labels = torch.randint(0, V, (T,), device="cuda", generator=g)
    chunk = chunk_tokens(V)
    part = hidden[:chunk]
    d_logits = (torch.randn(chunk, V, device="cuda", generator=g) * 1e-5).bfloat16()
    ops = {
        "d_logits @ weight (grad of the hidden states)": lambda: d_logits @ weight,
        "d_logits.t() @ part (grad of the weight)": lambda: d_logits.t() @ part,
        "part @ weight.t() (a chunk's logits)": lambda: part @ weight.t(),
        "the whole chunked forward and backward": lambda: whole_pass(hidden, weight, labels),
    }
    side = torch.cuda.Stream()
    busy = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    print(f"chunk {chunk} tokens; {torch.cuda.get_device_name()}; torch {torch.__version__}")
    for beside in (False, True):
        for name, op in ops.items():
            results = []
            for _ in range(RUNS):
                if beside:
                    with torch.cuda.stream(side):
                        for _ in range(4):
                            busy @ busy
                results.append(op())
                torch.cuda.synchronize()
            where = "beside a side stream's matmuls" if beside else "alone"
            print(f"{name}, {where}: {distinct(results)} distinct of {RUNS}", flush=True)


if __name__ == "__main__":
    main()
