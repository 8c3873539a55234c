"""The chunked output layer and cross entropy (mcore/chunked_loss.py) against the plain one."""

from __future__ import annotations

import pytest
import torch

from offload_runner.mcore.chunked_loss import ChunkedCrossEntropy, chunk_tokens, chunked_losses
from tests.conftest import compose_run


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_loss_and_gradients_equal_the_plain_ones_in_fp32(chunk: int) -> None:
    torch.manual_seed(0)
    s, b, h, vocab = 37, 3, 16, 301  # chunks that do not divide the tokens
    hidden = torch.randn(s, b, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, h, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (b, s))
    mask = (torch.rand(b, s) > 0.3).double()

    plain = torch.nn.functional.cross_entropy(
        (hidden @ weight.t()).transpose(0, 1).reshape(-1, vocab),
        labels.reshape(-1),
        reduction="none",
    ).view(b, s)
    (plain * mask).sum().backward()
    want = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    ours = chunked_losses(hidden.float(), weight.float(), labels, chunk)
    assert ours.shape == (b, s) and ours.dtype == torch.float32
    (ours * mask).sum().backward()
    torch.testing.assert_close(ours.double(), plain.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(hidden.grad, want[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(weight.grad, want[1], rtol=0, atol=1e-5)


def test_chunked_loss_passes_gradcheck() -> None:
    torch.manual_seed(1)
    hidden = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 4, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (9,))
    assert torch.autograd.gradcheck(
        lambda h, w: ChunkedCrossEntropy.apply(h, w, labels, 4).double(), (hidden, weight)
    )


def test_a_chunk_holds_a_gib_of_fp32_logits_and_the_plan_drops_the_whole_logits() -> None:
    from offload_runner.plan import make_plan

    assert chunk_tokens(151936) == (1 << 30) // (4 * 151936)
    common = ("recipe=qwen3_30b_a3b", "parallel=single", "train.micro_batch_size=8")
    whole = make_plan(compose_run(*common), 1).worst
    chunked = make_plan(compose_run(*common, "model.chunked_loss=true"), 1).worst
    assert whole.logits > 9 * 1024**3  # MB 8 x 4,096 tokens x 151,936 entries
    assert chunked.logits < 4 * 1024**3 and chunked.gpu_peak < whole.gpu_peak


def test_the_weight_gradient_goes_into_main_grad_as_megatron_fused_layers_put_it() -> None:
    """With a DDP main_grad (fp32) on the weight, the gradient is added there unrounded and
    flagged, and the returned one is a dummy."""
    torch.manual_seed(2)
    hidden = torch.randn(12, 8, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(20, 8))
    labels = torch.randint(0, 20, (12,))
    ChunkedCrossEntropy.apply(hidden, weight, labels, 5).sum().backward()
    want = weight.grad.clone()
    weight.grad = None
    weight.main_grad = torch.ones(20, 8)
    weight.grad_added_to_main_grad = False
    ChunkedCrossEntropy.apply(hidden, weight, labels, 5).sum().backward()
    torch.testing.assert_close(weight.main_grad, want + 1)
    assert weight.grad_added_to_main_grad and not weight.grad.any()
