"""Optimizer-state offload on the CPU: the windowed engine's update and checkpoints, and the
whole-tensor offloader's bookkeeping.

The windowed engine is driven as Megatron-Core's precision-aware DistributedOptimizer drives it
(the harness of tests/test_cpu_adam.py: bf16 views of one parameter buffer, fp32 gradients in
``decoupled_grad``, a changing lr, two param groups, clipped gradients) and must give torch's
AdamW(fused=True) on the CPU, whichever piece of the window each element passes through.

For the whole-tensor offloader, a small stand-in for Megatron-Core's DistributedOptimizer (bf16
model weights, fp32 master shards in ``shard_fp32_from_float16_groups``, an inner torch Adam) runs
the same steps with and without the offloader: the weights must be bit-identical and the
optimizer tensors must really leave (storage size 0) between steps. The CUDA streams are
exercised by the GPU tests.
"""

from __future__ import annotations

import copy

import pytest
import torch

from offload_runner.offload.cpu_adam import CpuAdam
from offload_runner.offload.optimizer_states import (
    BYTES_PER_PARAM,
    SLOTS,
    OptimizerStateOffloader,
    WindowedStates,
    resident,
)
from tests.test_cpu_adam import (
    BETAS,
    EPS,
    STEPS,
    Buffers,
    Reference,
    assert_matches,
    drive,
    engine,
    lr_at,
    masters,
)
from tests.test_cpu_adam import SIZES as ENGINE_SIZES

PIECE = 1500  # params per piece of the window: the shard spans several pieces and windows


def windowed(buffers: Buffers, piece: int = PIECE) -> WindowedStates:
    return WindowedStates(buffers.groups(lr_at(1)), lr=1e-3, weight_decay=0.1, betas=BETAS,
                          eps=EPS, window_bytes=SLOTS * BYTES_PER_PARAM * piece)  # fmt: skip


def test_windowed_update_is_bit_identical_to_torch_fused_adamw() -> None:
    buffers = Buffers()
    eng, ref = windowed(buffers), Reference(buffers)
    for step in range(1, STEPS + 1):
        ref.step(step, drive(eng, buffers, step))
        assert_matches(masters(eng, buffers), ref.params, step)
        for mine, view in zip(masters(eng, buffers), buffers.views, strict=True):
            assert torch.equal(view, mine.to(torch.bfloat16))
    assert len(eng._pieces) == -(-sum(ENGINE_SIZES) // PIECE) > SLOTS  # more pieces than slots
    assert eng.offloaded_numel == sum(ENGINE_SIZES)
    assert eng.window_bytes == SLOTS * BYTES_PER_PARAM * PIECE
    assert eng.host_bytes >= BYTES_PER_PARAM * sum(ENGINE_SIZES)
    assert eng.metrics() == {}  # no CUDA: nothing timed
    eng.close()


def test_window_of_one_piece_per_slot_covers_a_shard_smaller_than_the_window() -> None:
    buffers = Buffers()
    eng, ref = windowed(buffers, piece=10 * sum(ENGINE_SIZES)), Reference(buffers)
    for step in range(1, 4):
        ref.step(step, drive(eng, buffers, step))
    assert len(eng._pieces) == 1
    assert eng.window_bytes == SLOTS * BYTES_PER_PARAM * sum(ENGINE_SIZES)
    assert_matches(masters(eng, buffers), ref.params, 3)
    eng.close()


def test_windowed_checkpoint_continues_the_run_and_moves_to_cpu_adam() -> None:
    """Its state dict has HybridDeviceOptimizer's layout, like the CPU-Adam engine's: loaded into
    a fresh windowed engine, or into a CpuAdam, over the saved bf16 weights, both continue the
    original run (the CPU engine within the fused kernel's one-ulp tail differences)."""
    a_buf = Buffers()
    a = windowed(a_buf)
    for step in range(1, 7):
        drive(a, a_buf, step)
    a.finish()
    saved = copy.deepcopy(a.state_dict())
    copies = {}
    for name, build in (("windowed", windowed), ("cpu_adam", lambda b: engine(b, 1.0))):
        buf = Buffers(seed=1)
        buf.param.copy_(a_buf.param)  # the model's own checkpoint: the bf16 weights as they are
        eng = build(buf)
        eng.load_state_dict(copy.deepcopy(saved))
        eng.restore_after_load()
        copies[name] = (eng, buf)
    for step in range(7, 12):
        drive(a, a_buf, step)
        for eng, buf in copies.values():
            drive(eng, buf, step)
        assert torch.equal(a_buf.param, copies["windowed"][1].param), f"step {step}"
    eng, buf = copies["cpu_adam"]
    assert_matches(masters(eng, buf), masters(a, a_buf), 11)
    assert copies["windowed"][0].param_groups[0]["step"] == 11
    for eng, _ in copies.values():
        assert isinstance(eng, CpuAdam) or eng.state_dict()["state"].keys() == saved["state"].keys()
        eng.close()
    a.close()


class MiniDistributedOptimizer:
    """bf16 params, fp32 masters, Adam on the masters: Megatron's step in four lines."""

    def __init__(self, sizes: list[int], seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.model = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
        masters = [p.detach().clone().float() for p in self.model]
        self.shard_fp32_from_float16_groups = [masters[:1], masters[1:]]
        self.optimizer = torch.optim.Adam(
            [{"params": g} for g in self.shard_fp32_from_float16_groups], lr=1e-2
        )

    @property
    def masters(self) -> list[torch.Tensor]:
        return [m for g in self.shard_fp32_from_float16_groups for m in g]

    def step(self, grads: list[torch.Tensor]) -> None:
        for master, grad in zip(self.masters, grads, strict=True):
            master.grad = grad.float()  # what _copy_model_grads_to_main_grads does
        self.optimizer.step()
        for param, master in zip(self.model, self.masters, strict=True):
            param.copy_(master)


class MiniChained:
    def __init__(self, *parts: MiniDistributedOptimizer) -> None:
        self.chained_optimizers = list(parts)


def _grads(step: int, sizes: list[int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(n, generator=gen) for n in sizes]


SIZES = [64, 128, 32]


def _train(
    steps: int, offload: bool, chunk_bytes: int = 0
) -> tuple[list[torch.Tensor], MiniDistributedOptimizer]:
    opt = MiniDistributedOptimizer(SIZES)
    offloader = OptimizerStateOffloader(opt, chunk_bytes) if offload else None
    if offloader:
        offloader.offload()
    for step in range(steps):
        if offloader:
            offloader.start_reload()  # what the finalize_model_grads wrapper does
        opt.step(_grads(step, SIZES))
        if offloader:
            offloader.offload()
            for master in opt.masters:
                assert master.untyped_storage().size() == 0
            for state in opt.optimizer.state.values():
                assert state["exp_avg"].untyped_storage().size() == 0
                assert state["exp_avg_sq"].untyped_storage().size() == 0
    if offloader:
        offloader.remove()
    return [p.clone() for p in opt.model], opt


@pytest.mark.parametrize("chunk_bytes", [0, 100], ids=["whole-tensors", "100-byte-pieces"])
def test_offloaded_training_is_bit_identical(chunk_bytes: int) -> None:
    reference, _ = _train(5, offload=False)
    offloaded, opt = _train(5, offload=True, chunk_bytes=chunk_bytes)
    for a, b in zip(reference, offloaded, strict=True):
        assert torch.equal(a, b)
    assert all(m.untyped_storage().size() == m.numel() * 4 for m in opt.masters)


def test_first_offload_moves_masters_only_then_states_join() -> None:
    opt = MiniDistributedOptimizer(SIZES)
    offloader = OptimizerStateOffloader(opt)
    offloader.offload()
    master_bytes = sum(n * 4 for n in SIZES)
    assert offloader.offloaded_bytes == master_bytes  # Adam has no states before its first step
    opt.step(_grads(0, SIZES))  # the pre-hook brings the masters back without start_reload
    offloader.offload()
    assert offloader.offloaded_bytes == 3 * master_bytes  # masters + exp_avg + exp_avg_sq
    assert len(offloader._arenas) == 2  # the masters' arena, then one for Adam's new states


def test_host_buffers_are_allocated_once() -> None:
    opt = MiniDistributedOptimizer(SIZES)
    offloader = OptimizerStateOffloader(opt)
    opt.step(_grads(0, SIZES))
    offloader.offload()
    buffers = {key: buf.data_ptr() for key, buf in offloader._host.items()}
    for step in range(1, 4):
        opt.step(_grads(step, SIZES))
        offloader.offload()
    assert {key: buf.data_ptr() for key, buf in offloader._host.items()} == buffers
    assert sum(buf.numel() for buf in offloader._host.values()) == 3 * sum(n * 4 for n in SIZES)
    assert len(offloader._arenas) == 1  # first offload after the first step: one arena
    assert offloader.host_bytes >= 3 * sum(n * 4 for n in SIZES)


def test_resident_brings_everything_back_for_checkpoints() -> None:
    opt = MiniDistributedOptimizer(SIZES)
    offloader = OptimizerStateOffloader(opt)
    opt.step(_grads(0, SIZES))
    expected = [m.clone() for m in opt.masters]
    offloader.offload()
    with resident(offloader):
        for master, value in zip(opt.masters, expected, strict=True):
            assert torch.equal(master, value)
        saved = {id(p): s["exp_avg"].clone() for p, s in opt.optimizer.state.items()}
    assert offloader.offloaded_bytes > 0
    with resident(offloader):
        for p, s in opt.optimizer.state.items():
            assert torch.equal(s["exp_avg"], saved[id(p)])


def test_chained_optimizers_are_all_covered() -> None:
    dense, experts = MiniDistributedOptimizer([16, 8]), MiniDistributedOptimizer([32], seed=1)
    offloader = OptimizerStateOffloader(MiniChained(dense, experts))
    offloader.offload()
    assert offloader.offloaded_bytes == (16 + 8 + 32) * 4


def test_rejects_optimizers_without_master_shards() -> None:
    with pytest.raises(TypeError, match="needs Megatron-Core's DistributedOptimizer"):
        OptimizerStateOffloader(torch.optim.Adam([torch.zeros(2, requires_grad=True)]))


def test_resident_without_offloader_is_a_no_op() -> None:
    with resident(None):
        pass
