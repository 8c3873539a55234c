#!/usr/bin/env python
"""Delayed parameter updates on a toy, on the CPU: why the CPU-Adam engine predicts weights.

A 2-layer transformer (torch only, no Megatron-Core) learns the mock dataset's rule (each token
is the previous one plus one) with AdamW, a 20-step warmup and global-norm clipping, three ways:

- ``exact``: each update lands before the next forward;
- ``dpu``: after the warmup the forward runs on the weights before the newest update
  (ZeRO-Offload's delayed parameter update: one update stale);
- ``predict``: the same, but the forward runs on those weights extrapolated by their own last
  change, w + (w - w_prev), as offload/optimizer=cpu_adam_delayed lands them.

    python bench/probes/delayed_update_toy.py         # two seeds each, ~3 minutes on 2 cores
    python bench/probes/delayed_update_toy.py --cost  # what prediction adds to the CPU step

Prints the mean loss of each 20-iteration window; ``--cost`` times torch's fused AdamW alone and
with the engine's weight prediction around it (a copy before, an extrapolation after, in
GUESS_BLOCK blocks) on 64 Mi params with this machine's cores.
"""

from __future__ import annotations

import math
import statistics
import sys

import torch

VOCAB, SEQ, WIDTH, LAYERS, BATCH, STEPS, WARMUP, LR = 2048, 64, 128, 2, 4, 300, 20, 1e-3


def build(seed: int) -> torch.nn.ModuleDict:
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(
        WIDTH, 4, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True
    )
    return torch.nn.ModuleDict(
        {
            "embed": torch.nn.Embedding(VOCAB, WIDTH),
            "position": torch.nn.Embedding(SEQ, WIDTH),
            "layers": torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False),
            "out": torch.nn.Linear(WIDTH, VOCAB),
        }
    )


def loss_of(model: torch.nn.ModuleDict, tokens: torch.Tensor) -> torch.Tensor:
    mask = torch.nn.Transformer.generate_square_subsequent_mask(SEQ - 1)
    h = model["embed"](tokens[:, :-1]) + model["position"](torch.arange(SEQ - 1))
    h = model["layers"](h, mask=mask, is_causal=True)
    logits = model["out"](h).reshape(-1, VOCAB)
    return torch.nn.functional.cross_entropy(logits, tokens[:, 1:].reshape(-1))


def train(mode: str, seed: int) -> list[float]:
    model = build(seed)
    weights = list(model.parameters())  # what the forward runs on
    masters = [torch.nn.Parameter(w.detach().clone()) for w in weights]  # what Adam updates
    adam = torch.optim.AdamW(masters, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    data = torch.Generator().manual_seed(seed + 100)
    before_last: list[torch.Tensor] | None = None
    losses = []
    for step in range(1, STEPS + 1):
        tokens = torch.randint(1, VOCAB - SEQ, (BATCH, 1), generator=data) + torch.arange(SEQ)
        loss = loss_of(model, tokens)
        losses.append(loss.item())
        grads = torch.autograd.grad(loss, weights)
        norm = torch.sqrt(sum((g**2).sum() for g in grads)).item()
        for m, g in zip(masters, grads, strict=True):
            m.grad = g * min(1.0, 1.0 / (norm + 1e-6))
        adam.param_groups[0]["lr"] = (
            LR * min(1.0, step / WARMUP) * (0.55 + 0.45 * math.cos(math.pi * step / STEPS))
        )
        before = [m.detach().clone() for m in masters]
        adam.step()
        with torch.no_grad():
            for i, w in enumerate(weights):
                if mode == "exact" or step <= WARMUP:
                    w.copy_(masters[i])
                elif mode == "dpu":  # the newest update has not landed
                    w.copy_(before[i])
                else:  # ... and what landed is extrapolated by its own last change
                    w.copy_(2 * before[i] - before_last[i])
        before_last = before
    return losses


def prediction_cost(numel: int = 64 * 1024**2, repeats: int = 3) -> None:
    import time

    from offload_runner.offload.cpu_adam import GUESS_BLOCK

    master, grad, exp_avg, exp_avg_sq, guess = (torch.randn(numel) for _ in range(5))
    exp_avg_sq.abs_()
    steps = torch.tensor(10.0)

    def adam(a: int, b: int) -> None:
        torch._fused_adamw_(
            [master[a:b]],
            [grad[a:b]],
            [exp_avg[a:b]],
            [exp_avg_sq[a:b]],
            [],
            [steps],
            lr=1e-4,
            beta1=0.9,
            beta2=0.95,
            weight_decay=0.1,
            eps=1e-8,
            amsgrad=False,
            maximize=False,
        )

    def alone() -> None:
        adam(0, numel)

    def predicting() -> None:
        for a in range(0, numel, GUESS_BLOCK):
            b = min(a + GUESS_BLOCK, numel)
            guess[a:b].copy_(master[a:b])
            adam(a, b)
            guess[a:b].lerp_(master[a:b], 2.0)

    times = {}
    for name, step in (("fused AdamW alone", alone), ("with weight prediction", predicting)):
        step()
        began = time.perf_counter()
        for _ in range(repeats):
            step()
        times[name] = (time.perf_counter() - began) / repeats
        print(
            f"{name}: {numel / times[name] / 1e9:.2f} G params/s ({torch.get_num_threads()} "
            "threads)"
        )
    print(f"prediction costs {times['with weight prediction'] / times['fused AdamW alone']:.2f}x")


def main() -> None:
    if sys.argv[1:] == ["--cost"]:
        prediction_cost()
        return
    torch.set_num_threads(2)
    for mode in sys.argv[1:] or ("exact", "dpu", "predict"):
        for seed in (1, 2):
            losses = train(mode, seed)
            windows = [statistics.fmean(losses[i : i + 20]) for i in range(0, STEPS, 20)]
            print(f"{mode:8s} seed {seed}: " + " ".join(f"{x:.2f}" for x in windows), flush=True)


if __name__ == "__main__":
    main()
