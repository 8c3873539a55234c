"""The windowed optimizer-state offload on the CPU: its update and checkpoints.

The engine is driven as Megatron-Core's precision-aware DistributedOptimizer drives it (the
harness of tests/test_cpu_adam.py: bf16 views of one parameter buffer, fp32 gradients in
``decoupled_grad``, a changing lr, two param groups, clipped gradients) and must give torch's
AdamW(fused=True) on the CPU, whichever piece of the window each element passes through. Without
CUDA the copies are synchronous; the streams are exercised by the GPU tests.
"""

from __future__ import annotations

import copy

import torch

from offload_runner.offload.cpu_adam import CpuAdam
from offload_runner.offload.optimizer_states import (
    BYTES_PER_PARAM,
    SLOTS,
    WindowedStates,
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
