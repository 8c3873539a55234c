"""State offload's lowest precision steps on the CPU (offload/quantized.py): 8-bit moments and bf16
masters rounded stochastically, driven as tests/test_optimizer_states.py drives the engine."""

from __future__ import annotations

import pytest
import torch

from offload_runner.offload import quantized, window
from offload_runner.offload.optimizer_states import WindowedStates
from offload_runner.offload.window import SLOTS
from tests.test_cpu_adam import (
    SIZES,
    STEPS,
    Buffers,
    Reference,
    assert_matches,
    drive,
    masters,
)
from tests.test_optimizer_states import fp32_masters, windowed

PIECE = 6 * quantized.BLOCK  # params per piece: the shard spans several pieces and windows
Q8 = (torch.uint8, torch.uint8)


def q8_engine(buffers: Buffers, rem: bool = False, bf16_masters: bool = False) -> WindowedStates:
    return windowed(buffers, PIECE, rem, low=2, moment_dtypes=Q8, bf16_masters=bf16_masters)


def test_quantize_and_dequantize_are_torchao_8bit_optimizer_states() -> None:
    """Codes and scales as torchao's OptimState8bit keeps them (signed map for exp_avg,
    unsigned for exp_avg_sq), and its dequantization."""
    from torchao.optim.subclass_8bit import OptimState8bit

    g = torch.Generator().manual_seed(0)
    moments = (torch.randn(1 << 16, generator=g), torch.rand(1 << 16, generator=g) ** 4)
    for signed, values in zip((True, False), moments, strict=True):
        theirs = OptimState8bit.zeros(values.shape, signed=signed, block_size=quantized.BLOCK)
        theirs.copy_(values)
        codes = torch.empty(values.numel(), dtype=torch.uint8)
        scales = torch.empty(values.numel() // quantized.BLOCK)
        quantized.quantize(values, codes, scales, signed)
        assert torch.equal(codes, theirs.codes) and torch.equal(scales, theirs.scale)
        back = torch.empty(values.numel())
        quantized.dequantize(codes, scales, back, signed)
        assert torch.equal(back, theirs.dequantize())
        assert (back - values).abs().max() < 0.02 * values.abs().max()


@pytest.mark.gpu
def test_the_triton_kernels_give_the_torch_paths_codes_bit_for_bit(monkeypatch) -> None:
    """q8_triton.py against the torch path on the GPU: codes, scales and dequantized values
    equal over values spanning ten decades, an all-zero block and a partial last program."""
    pytest.importorskip("triton")
    g = torch.Generator(device="cuda").manual_seed(0)
    n = 1001 * quantized.BLOCK
    spread = torch.logspace(-8, 2, n, device="cuda")
    moments = (
        torch.randn(n, device="cuda", generator=g) * spread,
        torch.rand(n, device="cuda", generator=g) * spread,
    )
    results = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(quantized, "_fused", lambda: None)
        for signed, values in zip((True, False), moments, strict=True):
            values[: quantized.BLOCK] = 0
            codes = torch.empty(n, dtype=torch.uint8, device="cuda")
            scales = torch.empty(n // quantized.BLOCK, device="cuda")
            quantized.quantize(values, codes, scales, signed)
            back = torch.empty(n, device="cuda")
            quantized.dequantize(codes, scales, back, signed)
            results[fused, signed] = (codes, scales, back)
    for signed in (True, False):
        for ours, theirs in zip(results[True, signed], results[False, signed], strict=True):
            assert torch.equal(ours, theirs)


class RoundTripReference(Reference):
    """torch's fused AdamW whose moments, after each step, are what 8-bit storage gives back:
    quantized and dequantized over the engine's blocks (each piece's, from its start, its last
    block's tail zero)."""

    pieces: list = []  # the engine's, once planned

    def step(self, step: int, grads: torch.Tensor) -> None:
        super().step(step, grads)
        for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            flat = torch.cat([self.opt.state[p][key] for p in self.params])
            for piece in self.pieces:
                whole = quantized.blocks(piece.numel) * quantized.BLOCK
                row = torch.zeros(whole)
                row[: piece.numel] = flat[piece.start : piece.stop]
                codes = torch.empty(whole, dtype=torch.uint8)
                scales = torch.empty(whole // quantized.BLOCK)
                quantized.quantize(row, codes, scales, signed)
                quantized.dequantize(codes, scales, row, signed)
                flat[piece.start : piece.stop] = row[: piece.numel]
            start = 0
            for p, n in zip(self.params, SIZES, strict=True):
                self.opt.state[p][key].copy_(flat[start : start + n])
                start += n


@pytest.mark.parametrize("rem", [False, True], ids=["fp32-masters", "remainders"])
def test_8bit_moment_update_equals_adamw_over_8bit_stored_moments(rem: bool) -> None:
    """Through the window the update is torch's fused AdamW on the moments the 8-bit codes
    held, bit for bit, pieces cut mid-parameter included; 1 B per moment and its block's
    scale on the host."""
    buffers = Buffers()
    eng, ref = q8_engine(buffers, rem=rem), RoundTripReference(buffers)
    grads = drive(eng, buffers, 1)  # plans the pieces
    ref.pieces = eng._pieces
    ref.step(1, grads)
    assert_matches(fp32_masters(eng, buffers), ref.params, 1)
    for step in range(2, STEPS + 1):
        ref.step(step, drive(eng, buffers, step))
        assert_matches(fp32_masters(eng, buffers), ref.params, step)
    assert len(eng._pieces) > SLOTS and any(p.numel % quantized.BLOCK for p in eng._pieces)
    assert eng.host_exp_avg.dtype == eng.host_exp_avg_sq.dtype == torch.uint8
    assert eng.state_bytes_per_param == (2 if rem else 4) + 2 * (1 + 4 / quantized.BLOCK)
    eng.close()


def test_8bit_moments_learn_what_fp32_moments_learn() -> None:
    """Over STEPS steps the masters stay within a small distance of fp32 AdamW's."""
    buffers = Buffers()
    eng, ref = q8_engine(buffers), Reference(buffers)
    for step in range(1, STEPS + 1):
        ref.step(step, drive(eng, buffers, step))
    for mine, theirs in zip(masters(eng, buffers), ref.params, strict=True):
        moved = (theirs.detach() - buffers.views[0].float().mean()).abs().mean()
        assert (mine - theirs.detach()).abs().mean() < 0.05 * moved
    eng.close()


def test_stochastic_rounding_is_unbiased_and_lands_on_neighbours() -> None:
    value = torch.full((200_000,), 1.0 + 2**-10)  # a quarter of the way to the next bf16
    out = torch.empty(value.shape, dtype=torch.bfloat16)
    quantized.round_stochastically(value, out, torch.Generator().manual_seed(0))
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(out.float().mean().item() - value[0].item()) < 2e-5


def test_bf16_masters_are_the_fp32_update_rounded_stochastically() -> None:
    """No master on the host (with 8-bit moments: 2.03 B/param in all): each step upcasts the
    bf16 parameters, updates them in fp32 and rounds them stochastically, piece by piece: the
    first step gives AdamW's fp32 masters rounded with the same random bits: the engine's own
    generator's, whatever the default generator draws meanwhile."""
    buffers, reference = Buffers(), Buffers()
    eng, ref = q8_engine(buffers, bf16_masters=True), Reference(reference)
    torch.manual_seed(7)
    ref.step(1, drive(eng, buffers, 1))
    assert eng.host_master is None and "master_param" not in eng.state[buffers.views[0]]
    assert eng.state_bytes_per_param == 2 * (1 + 4 / quantized.BLOCK)
    flat = torch.cat([p.detach() for p in ref.params])
    rounding = torch.Generator().manual_seed(window.ROUNDING_SEED)
    for piece in eng._pieces:
        quantized.round_stochastically(
            flat[piece.start : piece.stop], reference.param[piece.start : piece.stop], rounding
        )
    assert torch.equal(buffers.param, reference.param)
    assert not torch.equal(buffers.param, flat.to(torch.bfloat16))  # not to nearest
    for step in range(2, STEPS + 1):  # then within a few bf16 ulps of fp32 AdamW
        ref.step(step, drive(eng, buffers, step))
    for view, theirs in zip(buffers.views, ref.params, strict=True):
        ulp = theirs.detach().abs().clamp(min=1e-3) * 2**-7
        assert ((view.float() - theirs.detach()).abs() / ulp).mean() < 3.0
    eng.close()


@pytest.mark.parametrize("masters", ["remainders", "bf16"])
def test_a_resumed_engine_continues_the_uninterrupted_one_bit_for_bit(masters: str) -> None:
    """A checkpoint of 8-bit moments holds the host arrays as they are (codes, remainders; the
    parameters stand in for bf16 masters) in Megatron-Core's keys, the blocks' scales and the
    random states beside them (checkpoint.py; bf16 masters' rounding generator too): an engine
    loaded from them on other buffers, the parameters copied as the model's checkpoint would,
    steps as the uninterrupted one does."""
    import copy

    from offload_runner import checkpoint

    bf16 = masters == "bf16"
    buffers = Buffers()
    eng = q8_engine(buffers, rem=not bf16, bf16_masters=bf16)
    for step in range(1, 4):
        drive(eng, buffers, step)
    with eng.fp32_masters():  # what checkpoint.save_checkpoint hands Megatron-Core
        saved = copy.deepcopy(eng.state_dict())
    scales, rng = copy.deepcopy(eng.quantized_state()), torch.get_rng_state()
    rounding = eng.rounding_state()  # bf16 masters' own generator (None with remainders)
    assert (rounding is None) != bf16
    params = buffers.param.clone()  # the model's checkpoint
    assert checkpoint._engine_precision(eng) == (
        f"exp_avg q8, exp_avg_sq q8, {0 if bf16 else 2} B masters"
    )
    assert saved["state"][0]["exp_avg"].dtype == torch.uint8 and len(scales) == 2
    assert "master_param" in saved["state"][0]  # outside the context bf16 masters keep none:
    assert ("master_param" in eng.state[buffers.views[0]]) != bf16
    for step in range(4, 7):
        drive(eng, buffers, step)
    resumed_buffers = Buffers(seed=1)
    resumed_buffers.param.copy_(params)
    resumed = q8_engine(resumed_buffers, rem=not bf16, bf16_masters=bf16)
    with resumed.fp32_masters():
        # DistributedOptimizer.sharded_state_dict(is_loading=True) reloads the engine's own
        # state before it lays out the checkpoint's: the masters' key must survive that
        resumed.load_state_dict(resumed.state_dict())
        assert "master_param" in resumed.state[resumed_buffers.views[0]]
        resumed.load_state_dict(saved)
        resumed.restore_after_load()
    resumed.load_quantized_state(scales)
    resumed.load_rounding_state(rounding)
    torch.set_rng_state(rng)
    assert torch.equal(resumed_buffers.param, params)
    for step in range(4, 7):
        drive(resumed, resumed_buffers, step)
    assert torch.equal(resumed_buffers.param, buffers.param)
    assert torch.equal(resumed.host_exp_avg, eng.host_exp_avg)
    assert torch.equal(resumed.host_exp_avg_sq, eng.host_exp_avg_sq)
    mine, theirs = resumed.quantized_state(), eng.quantized_state()
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    eng.close()
    resumed.close()
