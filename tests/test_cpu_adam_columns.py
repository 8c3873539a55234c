"""Delayed mode's exact columns (offload/cpu_adam/columns.py) on the CPU: the selected columns
follow exact Adam, the rest one step late, a selection takes the columns whose gradients weigh
most, moving columns between the two sides loses nothing, and a checkpoint resumes bit for bit.
The gradients here do not depend on the weights, so an exact run's masters are the reference
for every element (the CPU's delayed masters included)."""

from __future__ import annotations

import copy

import pytest
import torch

from offload_runner.offload.cpu_adam import columns as columns_module
from tests.test_cpu_adam import SIZES, STEPS, Buffers, Reference, drive, engine, gradients

WIDTH = 100  # the weights of SIZES are [n / WIDTH, WIDTH]; the norms stay 1-D
EXACT = 3  # exact steps before the delayed ones


def model_params(buffers: Buffers) -> list[torch.Tensor]:
    """The model's own parameters over the buffer: 2-D weights, 1-D norms."""
    return [v.view(-1, WIDTH) if v.numel() % WIDTH == 0 else v for v in buffers.views]


def columns_engine(buffers: Buffers, fraction: float = 0.1, share: float = 0.0):
    eng = engine(buffers, 1.0, delayed=True, exact_steps=EXACT, columns=fraction, gpu_share=share)
    eng.watch_columns(model_params(buffers))
    return eng


def flat(ref: Reference) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in ref.params]).clone()


def test_blocks_are_the_2d_weights_whole_rows() -> None:
    buffers = Buffers()
    eng = columns_engine(buffers)
    weights = [n for n in SIZES if n % WIDTH == 0]
    assert [b.rows * b.width for b in eng.columns.blocks] == weights
    assert all(b.width == WIDTH for b in eng.columns.blocks)
    # a shard holding part of a weight (data parallelism) keeps its whole rows only
    weight = buffers.param[: SIZES[0]].view(-1, WIDTH)
    shard = buffers.param[150:2950]
    (block,) = columns_module.blocks_of([(0, shard)], [weight], 0.1, lambda p: 0)
    assert (block.offset, block.rows, block.start) == (50, 27, 50)
    eng.close()


@pytest.mark.parametrize("share", [0.0, 0.4])
def test_selected_columns_follow_exact_adam_and_the_rest_land_one_step_late(share) -> None:
    """After each delayed step the selected columns' parameters are their exact masters, those
    the exact run has, and every other column holds the last step's; the selection is the
    columns with the largest summed |gradient| at its step; with a GPU share beside it too."""
    buffers = Buffers()
    eng, ref = columns_engine(buffers, share=share), Reference(buffers)
    history = [flat(ref)]
    for step in range(1, STEPS + 1):
        grads = drive(eng, buffers, step)
        ref.step(step, grads)
        history.append(flat(ref))
        if step == EXACT + 1:
            for b in eng.columns.blocks:
                score = b.of(grads).abs().sum(0)
                assert set(b.index.tolist()) == set(torch.topk(score, 10).indices.tolist())
        if step <= EXACT:
            assert eng.columns.selected_at == 0
            continue
        for b in eng.columns.blocks:
            param, chosen = b.in_param(b.param).float(), b.index
            rest = torch.ones(b.width, dtype=torch.bool)
            rest[chosen] = False
            exact = b.of(history[step])[:, chosen]
            assert torch.allclose(b.master, exact, rtol=0, atol=1e-6 * exact.abs().max())
            assert torch.equal(param[:, chosen], b.master.bfloat16().float())
            late = b.of(history[step - 1])[:, rest].bfloat16().float()
            assert (param[:, rest] - late).abs().max() <= late.abs().max() * 2**-7, step
    eng.close()


def test_columns_moving_between_the_gpu_and_the_cpu_lose_nothing(monkeypatch) -> None:
    """Selections every 4 steps move columns both ways; at the end every master and moment on
    the host is the exact run's (each column's state followed it across)."""
    monkeypatch.setattr(columns_module, "SELECT_EVERY", 4)
    buffers = Buffers()
    eng, ref = columns_engine(buffers, fraction=0.3), Reference(buffers)
    chosen = []
    for step in range(1, STEPS + 1):
        ref.step(step, drive(eng, buffers, step))
        if eng.columns.selected_at == step:
            chosen.append([set(b.index.tolist()) for b in eng.columns.blocks])
    assert len(chosen) == 5 and chosen[0] != chosen[1]  # steps 4, 8, 12, 16, 20
    eng.finish()
    expected = flat(ref)
    assert (eng.host_master - expected).abs().max() <= 1e-6 * expected.abs().max()
    state = [ref.opt.state[p] for p in ref.params]
    for name, host in (("exp_avg", eng.host_exp_avg), ("exp_avg_sq", eng.host_exp_avg_sq)):
        want = torch.cat([s[name].flatten() for s in state])
        assert (host - want).abs().max() <= 1e-5 * want.abs().max(), name
    eng.close()


def test_a_checkpoint_of_the_columns_resumes_bit_for_bit(monkeypatch) -> None:
    """Saved after step 6 (a selection at 4, the next at 8), loaded into a fresh engine over the
    saved bf16 weights: both continue identically through a selection."""
    monkeypatch.setattr(columns_module, "SELECT_EVERY", 4)
    a_buf = Buffers()
    a = columns_engine(a_buf)
    for step in range(1, 7):
        drive(a, a_buf, step)
    a.finish()
    saved = copy.deepcopy(a.state_dict())
    b_buf = Buffers(seed=1)
    b_buf.param.copy_(a_buf.param)
    b = columns_engine(b_buf)
    b.load_state_dict(saved)
    b.restore_after_load()
    assert [x.index.tolist() for x in b.columns.blocks] == [
        x.index.tolist() for x in a.columns.blocks
    ]
    for step in range(7, 12):
        drive(a, a_buf, step)
        drive(b, b_buf, step)
        assert torch.equal(a_buf.param, b_buf.param), step
    a.finish(), b.finish()
    assert torch.equal(a.host_master, b.host_master)
    assert torch.equal(a.host_exp_avg_sq, b.host_exp_avg_sq)
    a.close(), b.close()


def test_no_selection_without_2d_weights_or_before_the_delayed_steps() -> None:
    """Norms alone give no block; the exact steps select nothing."""
    buffers = Buffers()
    eng = engine(buffers, 1.0, delayed=True, exact_steps=EXACT, columns=0.1)
    eng.watch_columns(list(buffers.views))  # all 1-D
    for step in range(1, EXACT + 3):
        drive(eng, buffers, step)
    assert not eng.columns.blocks and eng.columns.selected_at == 0
    assert gradients(1).numel() == sum(SIZES)
    eng.close()


def test_a_selection_hands_the_leaving_columns_gpu_state_to_the_host() -> None:
    """The GPU's masters and moments of the selected columns (not the CPU's copies, which on a
    GPU round differently) are what the host arrays hold after a selection: a resumed run,
    whose host got them from its checkpoint, and the uninterrupted one continue alike."""
    buffers = Buffers()
    eng = columns_engine(buffers)
    for step in range(1, EXACT + 2):
        drive(eng, buffers, step)
    eng.finish()
    marked = []
    for b in eng.columns.blocks:
        b.master.add_(1.0), b.exp_avg_sq.add_(2.0)
        marked.append((b, b.index.clone(), b.master.clone(), b.exp_avg_sq.clone()))
    eng.columns.select(EXACT + 2, eng._grad)
    for b, index, master, exp_avg_sq in marked:
        assert torch.equal(b.of(eng.host_master)[:, index], master)
        assert torch.equal(b.of(eng.host_exp_avg_sq)[:, index], exp_avg_sq)
    eng.close()


def test_a_run_resumed_without_a_selection_selects_at_once() -> None:
    """Loaded from an exact-columns-free checkpoint of delayed steps: the first step selects."""
    a_buf = Buffers()
    a = engine(a_buf, 1.0, delayed=True, exact_steps=EXACT)
    for step in range(1, EXACT + 3):
        drive(a, a_buf, step)
    a.finish()
    b_buf = Buffers(seed=1)
    b_buf.param.copy_(a_buf.param)
    b = columns_engine(b_buf)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    b.restore_after_load()
    assert b.columns.selected_at == 0
    drive(b, b_buf, EXACT + 3)
    assert b.columns.selected_at == EXACT + 3
    a.close(), b.close()


def test_the_dry_run_says_the_exact_columns() -> None:
    from offload_runner.offload.cpu_adam import wiring
    from tests.conftest import compose_run

    run = compose_run(
        "recipe=tiny", "offload/optimizer=cpu_adam_delayed", "optimizer.cpu_adam_exact_columns=0.1"
    )
    assert "10% of each weight's columns exact on the GPU" in str(wiring.describe(run))
