"""The output layer and its cross entropy over chunks of tokens (``model.chunked_loss``): the
[tokens x vocabulary] logits never exist whole, forward or backward.

Each chunk's logits are computed, reduced to its tokens' losses and log-sum-exps, and dropped;
backward computes them again chunk by chunk for the gradients of the hidden states and of the
output weight (summed in fp32). What stays is one chunk of fp32 logits and its softmax
(hardware.LOSS_CHUNK_BYTES each) and the weight's fp32 gradient, against whole logits in bf16
plus the loss's own copies (10 GB and more for Qwen3-30B-A3B at micro-batch 8). Exact: the same
sums in another order. The whole vocabulary on one GPU: tensor parallelism already splits the
logits over its ranks (Megatron-Core's vocab-parallel cross entropy), so validation asks TP 1.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel

from offload_runner.hardware import LOSS_CHUNK_BYTES


def chunk_tokens(vocab: int) -> int:
    """Tokens per chunk: LOSS_CHUNK_BYTES of fp32 logits."""
    return max(1, LOSS_CHUNK_BYTES // (4 * vocab))


class ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of ``hidden @ weight.T`` against ``labels``, ``chunk`` tokens of
    logits at a time. hidden [N, h], weight [V, h], labels [N] -> losses [N], in fp32 (fp64
    for fp64 inputs)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int):
        exact = torch.promote_types(hidden.dtype, torch.float32)
        losses = torch.empty(hidden.shape[0], dtype=exact, device=hidden.device)
        lse = torch.empty_like(losses)
        for s in range(0, hidden.shape[0], chunk):
            logits = (hidden[s : s + chunk] @ weight.t()).to(exact)
            lse[s : s + chunk] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, labels[s : s + chunk, None]).squeeze(1)
            losses[s : s + chunk] = lse[s : s + chunk] - picked
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk = chunk
        return losses

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, labels, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)
        for s in range(0, hidden.shape[0], ctx.chunk):
            part = hidden[s : s + ctx.chunk]
            logits = (part @ weight.t()).to(lse.dtype)
            # d loss / d logits = softmax - one-hot of the label, times the token's grad
            probs = torch.exp(logits - lse[s : s + ctx.chunk, None])
            rows = torch.arange(part.shape[0], device=part.device)
            probs[rows, labels[s : s + ctx.chunk]] -= 1
            probs *= grad[s : s + ctx.chunk, None]
            d_logits = probs.to(hidden.dtype)
            grad_hidden[s : s + ctx.chunk] = d_logits @ weight
            grad_weight += (d_logits.t() @ part).to(lse.dtype)
        return grad_hidden, _into_main_grad(weight, grad_weight), None, None


def _into_main_grad(weight, grad_weight):
    """The weight's gradient where Megatron-Core's DDP wants it: added to its fp32 ``main_grad``
    as its fused linear layers add theirs (a dummy gradient returned, the flag set so DDP's hook
    does not add it again), else returned in the weight's dtype."""
    if getattr(weight, "main_grad", None) is None or not hasattr(weight, "grad_added_to_main_grad"):
        return grad_weight.to(weight.dtype)
    weight.main_grad.add_(grad_weight)
    weight.grad_added_to_main_grad = True
    return torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)


def chunked_losses(hidden, weight, labels, chunk: int):
    """Megatron-Core's layouts: hidden [s, b, h], labels [b, s] -> losses [b, s]."""
    s, b, h = hidden.shape
    flat = hidden.transpose(0, 1).reshape(b * s, h)
    losses = ChunkedCrossEntropy.apply(flat, weight, labels.reshape(-1), chunk)
    return losses.view(b, s)


class ChunkedLossGPTModel(GPTModel):
    """GPTModel whose training loss comes from ``chunked_losses``; everything else (logits for
    inference, multi-token prediction) is GPTModel's own."""

    def _postprocess(self, hidden_states, **kwargs):
        labels = kwargs.get("labels")
        if labels is None or kwargs.get("mtp_in_postprocess"):
            return super()._postprocess(hidden_states, **kwargs)
        if self.share_embeddings_and_output_weights:
            weight = self.shared_embedding_or_output_weight()
        else:
            weight = self.output_layer.weight
        return chunked_losses(hidden_states, weight, labels, chunk_tokens(weight.shape[0]))
