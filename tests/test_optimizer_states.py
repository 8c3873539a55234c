"""The optimizer-state offloader's bookkeeping, on the CPU.

A small stand-in for Megatron-Core's DistributedOptimizer (bf16 model weights, fp32 master shards
in ``shard_fp32_from_float16_groups``, an inner torch Adam) runs the same steps with and without
the offloader: the weights must be bit-identical and the optimizer tensors must really leave
(storage size 0) between steps. The CUDA streams are exercised by the GPU tests.
"""

from __future__ import annotations

import pytest
import torch

from offload_runner.offload.optimizer_states import OptimizerStateOffloader, resident


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
