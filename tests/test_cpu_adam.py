"""The CPU-Adam engine on the CPU: the same update as torch's AdamW(fused=True).

The engine calls the same fused kernel on pieces of the flat shard, the reference on whole
tensors; the kernel's vector loop and its scalar tail round one multiply-add differently, so an
element that is a tail in one split and not in the other may differ by one ulp. Everything else is
bit-identical, and the bf16 parameters are exactly the rounded masters.

The engine is driven as Megatron-Core's DistributedOptimizer drives it: its parameters are bf16
views of one flat parameter buffer, their gradients (already clipped) fp32 views of one flat grad
buffer in ``decoupled_grad``, and the scheduler writes ``lr`` into the param groups between steps.
Without CUDA every copy is synchronous, so the pieces, groups, delays and state handling are what
is tested here; the streams and timing are tested on the GPU (tests/test_gpu_training.py).
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from offload_runner.offload import host_adam
from offload_runner.offload.cpu_adam import (
    HOST_BYTES_PER_PARAM,
    CpuAdam,
    CpuSettings,
    Delayed,
    Exact,
    part_fractions,
)
from offload_runner.offload.host_adam import AdamSettings
from tests.conftest import compose_run

BETAS, EPS = (0.9, 0.95), 1e-8
SIZES = [3000, 64, 5000, 64, 2500, 700, 64, 4100]  # weights and norms, interleaved
DECAY = [0.1, 0.0, 0.1, 0.0, 0.1, 0.1, 0.0, 0.1]
STEPS = 20
CLIP = 1.0


class Buffers:
    """A DDP-like parameter buffer (bf16) and grad buffer (fp32), with 1-D views as params."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        total = sum(SIZES)
        self.param = (torch.randn(total, generator=g) * 0.02).to(torch.bfloat16)
        self.grad = torch.zeros(total, dtype=torch.float32)
        self.views, start = [], 0
        for n in SIZES:
            self.views.append(self.param[start : start + n])
            start += n

    def groups(self, lr: float) -> list[dict]:
        decay = [v for v, wd in zip(self.views, DECAY, strict=True) if wd]
        no_decay = [v for v, wd in zip(self.views, DECAY, strict=True) if not wd]
        return [
            {"params": decay, "lr": lr, "weight_decay": 0.1, "betas": BETAS, "eps": EPS},
            {"params": no_decay, "lr": lr, "weight_decay": 0.0, "betas": BETAS, "eps": EPS},
        ]

    def set_grads(self, values: torch.Tensor) -> None:
        self.grad.copy_(values)
        self.bind_grads()

    def bind_grads(self) -> None:
        """The optimizer's params' gradients, views of the grad buffer (Megatron-Core's step
        binds them; its zero_grad unbinds them: ``unbind_grads``)."""
        start = 0
        for view, n in zip(self.views, SIZES, strict=True):
            view.decoupled_grad = self.grad[start : start + n]
            start += n

    def unbind_grads(self) -> None:
        for view in self.views:
            view.decoupled_grad = None


def gradients(step: int) -> torch.Tensor:
    """Step ``step``'s gradients, clipped to global norm CLIP as Megatron-Core clips them."""
    g = torch.randn(sum(SIZES), generator=torch.Generator().manual_seed(100 + step))
    norm = g.norm().item()
    coeff = CLIP / (norm + 1e-6)
    return g * coeff if coeff < 1 else g


def lr_at(step: int) -> float:
    return 1e-3 * (0.5 + 0.5 * step / STEPS)  # a changing learning rate


def engine(
    buffers: Buffers,
    fraction: float,
    kind: type = CpuAdam,
    *,
    delayed: bool = False,
    exact_steps: int = 0,
    predict: bool = False,
    copy_during_backward: bool = False,
    columns: float = 0.0,
    **kwargs,
) -> CpuAdam:
    """A CpuAdam over ``buffers``' groups, its mode from the flags (Delayed where ``delayed``);
    ``kwargs``: fields of AdamSettings or CpuSettings, and ``worker``."""
    mode = Delayed(exact_steps, predict, copy_during_backward, columns) if delayed else Exact()
    worker = kwargs.pop("worker", None)
    adam = {k: kwargs.pop(k) for k in ("chunk_bytes", "order_key", "moment_dtypes") if k in kwargs}
    adam = AdamSettings(1e-3, 0.1, BETAS, EPS, fraction, **{"chunk_bytes": 4 * 1500, **adam})
    return kind(buffers.groups(lr_at(1)), adam, CpuSettings(mode=mode, **kwargs), worker)


class Reference:
    """torch.optim.AdamW(fused=True) on fp32 copies of the same parameters and gradients."""

    def __init__(self, buffers: Buffers) -> None:
        self.params = [torch.nn.Parameter(v.float().clone()) for v in buffers.views]
        decay = [p for p, wd in zip(self.params, DECAY, strict=True) if wd]
        no_decay = [p for p, wd in zip(self.params, DECAY, strict=True) if not wd]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=1e-3,
            betas=BETAS,
            eps=EPS,
            fused=True,
        )

    def step(self, step: int, grads: torch.Tensor) -> None:
        start = 0
        for p, n in zip(self.params, SIZES, strict=True):
            p.grad = grads[start : start + n].clone()
            start += n
        for group in self.opt.param_groups:
            group["lr"] = lr_at(step)
        self.opt.step()


def drive(eng: CpuAdam, buffers: Buffers, step: int) -> torch.Tensor:
    grads = gradients(step)
    buffers.set_grads(grads)
    for group in eng.param_groups:
        group["lr"] = lr_at(step)
    eng.step()
    return grads


def masters(eng: CpuAdam, buffers: Buffers) -> list[torch.Tensor]:
    return [eng.state[v]["master_param"] for v in buffers.views]


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.0])
def test_exact_mode_is_bit_identical_to_torch_fused_adamw(fraction: float) -> None:
    buffers = Buffers()
    eng, ref = engine(buffers, fraction), Reference(buffers)
    assert len(eng.offloaded) > 0 or fraction == 0
    for step in range(1, STEPS + 1):
        ref.step(step, drive(eng, buffers, step))
        assert_matches(masters(eng, buffers), ref.params, step)
        for mine, view in zip(masters(eng, buffers), buffers.views, strict=True):
            assert torch.equal(view, mine.to(torch.bfloat16))
    eng.close()


def assert_matches(mine: list[torch.Tensor], reference: list, step: int) -> None:
    """Within 1e-6 relative, and bit-identical but for at most one in a thousand elements."""
    a, b = torch.cat(list(mine)), torch.cat([p.detach() for p in reference])
    assert (a - b).abs().max() <= 1e-6 * b.abs().max(), f"step {step}"
    assert (a != b).sum() <= a.numel() // 1000, f"step {step}"


def test_pieces_respect_the_chunk_size_and_the_param_groups() -> None:
    buffers = Buffers()
    eng = engine(buffers, 1.0)
    drive(eng, buffers, 1)
    assert all(p.stop - p.start <= eng.chunk_numel for p in eng._pieces)
    assert sum(p.stop - p.start for p in eng._pieces) == sum(SIZES)
    assert len(eng._pieces) == -(-sum(SIZES) // eng.chunk_numel)  # one contiguous run
    groups = {gi for p in eng._pieces for _, _, gi in p.groups}
    assert groups == {0, 1}
    eng.close()


def test_fraction_takes_whole_shards_in_buffer_order() -> None:
    buffers = Buffers()
    eng = engine(buffers, 0.5)
    offloaded = [p for _, p in eng.offloaded]
    assert offloaded == buffers.views[: len(offloaded)]  # a prefix of the buffer
    assert abs(eng.offloaded_numel / sum(SIZES) - 0.5) < 0.2
    assert eng.host_bytes >= eng.offloaded_numel * HOST_BYTES_PER_PARAM
    eng.close()


@pytest.mark.parametrize("share", [0.0, 0.4, 1.0])
def test_delayed_mode_lands_each_update_one_step_late(share: float) -> None:
    """Each delayed update lands one step late and its masters follow torch's AdamW; with a
    GPU share the last pieces of each update's order pass through the state window (on the CPU
    here, with the same fused kernel, from the host gradients) beside the worker."""
    exact = 3
    buffers = Buffers()
    eng = engine(buffers, 1.0, delayed=True, exact_steps=exact, gpu_share=share)
    ref = Reference(buffers)
    previous = [v.clone() for v in buffers.views]
    for step in range(1, STEPS + 1):
        before = [v.clone() for v in buffers.views]
        ref.step(step, drive(eng, buffers, step))
        eng.finish()
        now = [m.to(torch.bfloat16) for m in masters(eng, buffers)]
        if step <= exact:
            assert all(torch.equal(v, n) for v, n in zip(buffers.views, now, strict=True))
        elif step == exact + 1:  # the first delayed update is still on the CPU
            assert all(torch.equal(v, b) for v, b in zip(buffers.views, before, strict=True))
        else:  # the update of step - 1 has landed, not this step's
            assert all(torch.equal(v, p) for v, p in zip(buffers.views, previous, strict=True))
            assert not all(torch.equal(v, n) for v, n in zip(buffers.views, now, strict=True))
        previous = [m.to(torch.bfloat16) for m in masters(eng, buffers)]
        assert_matches(masters(eng, buffers), ref.params, step)
    eng.finish()  # masters are current even before they land
    assert_matches(masters(eng, buffers), ref.params, STEPS)
    eng.flush()
    assert all(torch.equal(v, p) for v, p in zip(buffers.views, previous, strict=True))
    found, last = eng.metrics(), eng.history[-1]
    assert found["cpu_offloaded_params"] == sum(SIZES)
    on_gpu = sum(eng._pieces[i].numel for i in last.on_gpu)
    assert on_gpu / sum(SIZES) == pytest.approx(share, abs=1500 / sum(SIZES))
    assert last.on_gpu == last.order[len(last.order) - len(last.on_gpu) :]  # the order's tail
    assert last.params == sum(SIZES) - on_gpu and eng.streams_states == (share > 0)
    # the history keeps timings; the per-piece events go two updates later
    assert all(not (u.ready or u.done or u.landed) for u in eng.history[:-2])
    assert len(last.done) == len(eng._pieces)
    eng.close()


def test_weight_prediction_lands_the_masters_extrapolated_by_their_last_update() -> None:
    """Delayed mode with weight prediction: from the first delayed step on, the forward sees
    2 w_t - w_(t-1) (w: the masters after update t, the newest that has landed), exact mode's
    weights of the next step up to the change between two updates; before that, exact mode's."""
    exact = 3
    buffers = Buffers()
    eng = engine(buffers, 1.0, delayed=True, exact_steps=exact, predict=True)
    ref = Reference(buffers)
    history = [torch.cat([p.detach() for p in ref.params]).clone()]  # w_0
    for step in range(1, STEPS + 1):
        ref.step(step, drive(eng, buffers, step))
        eng.finish()
        history.append(torch.cat([p.detach() for p in ref.params]).clone())
        newest = step if step <= exact else step - 1  # the update that has landed
        expected = history[newest] if step <= exact else 2 * history[newest] - history[newest - 1]
        assert (buffers.param.float() - expected.to(torch.bfloat16).float()).abs().max() <= (
            expected.abs().max() * 2**-7
        ), f"step {step}"
        assert_matches(masters(eng, buffers), ref.params, step)  # the masters stay exact DPU
    eng.flush()  # the end of training lands the masters themselves
    assert torch.equal(buffers.param, history[-1].to(torch.bfloat16))
    eng.close()


def test_extrapolation_from_adam_state_repeats_the_last_update() -> None:
    """After a load the masters before the last update are gone: the guess recomputed from
    exp_avg, exp_avg_sq and the step equals the one the worker made from the masters (the
    weight-decay term apart, lr wd times smaller)."""
    buffers = Buffers()
    eng = engine(buffers, 1.0, delayed=True, exact_steps=2, predict=True)
    for step in range(1, 6):
        drive(eng, buffers, step)
    eng.finish()
    made = eng.host_guess.clone()
    eng._worker.submit(eng._guess_from_states).result()
    change = (made - eng.host_master).abs().max()
    assert (eng.host_guess - made).abs().max() <= 1e-3 * change
    eng.close()


@pytest.mark.parametrize(
    ("delayed", "predict"),
    [(False, False), (True, False), (True, True)],
    ids=["exact", "delayed", "delayed-predicting"],
)
def test_state_dict_round_trip_continues_the_same_run(delayed: bool, predict: bool) -> None:
    """A checkpoint (masters and moments current, a delayed update not landed) loaded into a
    fresh engine over the saved bf16 weights continues exactly as the original. Predicting, the
    first landing after the load extrapolates from Adam's state instead of the lost masters
    before the last update: the same weights but for bf16 rounding."""
    kwargs = {"delayed": delayed, "exact_steps": 2, "predict": predict}
    a_buf = Buffers()
    a = engine(a_buf, 0.6, **kwargs)
    for step in range(1, 7):
        drive(a, a_buf, step)
    a.finish()
    saved = copy.deepcopy(a.state_dict())
    b_buf = Buffers(seed=1)
    b_buf.param.copy_(a_buf.param)  # the model's own checkpoint: the bf16 weights as they are
    b = engine(b_buf, 0.6, **kwargs)
    b.load_state_dict(saved)
    b.restore_after_load()
    for step in range(7, 12):
        drive(a, a_buf, step)
        drive(b, b_buf, step)
        if predict and step == 7:
            ulp = a_buf.param.float().abs().max().item() * 2**-7
            assert (a_buf.param.float() - b_buf.param.float()).abs().max() <= ulp
            assert (a_buf.param != b_buf.param).sum() <= a_buf.param.numel() // 100
        else:
            assert torch.equal(a_buf.param, b_buf.param), f"step {step}"
    a.finish()
    b.finish()
    assert all(torch.equal(x, y) for x, y in zip(masters(a, a_buf), masters(b, b_buf), strict=True))
    assert b.param_groups[0]["step"] == 11
    a.close()
    b.close()


def test_state_has_hybrid_device_optimizer_layout() -> None:
    buffers = Buffers()
    eng = engine(buffers, 0.5)
    for view in buffers.views:
        assert set(eng.state[view]) == {"master_param", "exp_avg", "exp_avg_sq"}
        assert eng.state[view]["master_param"].dtype == torch.float32
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    assert isinstance(eng, HybridDeviceOptimizer)  # Megatron-Core checkpoints it as one
    eng.close()


def test_delayed_mode_offloads_experts_before_dense_parameters() -> None:
    assert part_fractions([100, 300], [False, True], 0.5, experts_first=True) == [
        0.0,
        pytest.approx(200 / 300),
    ]
    assert part_fractions([100, 300], [False, True], 0.9, experts_first=True) == [
        pytest.approx(60 / 100),
        1.0,
    ]
    assert part_fractions([100, 300], [False, True], 1.0, experts_first=True) == [1.0, 1.0]
    assert part_fractions([100, 300], [False, True], 0.5, experts_first=False) == [0.5, 0.5]


def test_host_arrays_are_not_inherited_by_forked_processes() -> None:
    """Data loader workers fork after the engine allocated: its arrays must not follow them
    (page-locked pages would be copied into every child, the rest doubled copy-on-write)."""
    import ctypes
    import os
    import signal

    buffers = Buffers()
    eng = engine(buffers, 1.0)
    address = eng.host_exp_avg.data_ptr() + 8192
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: reading a page it did not inherit faults
        import faulthandler

        faulthandler.disable()
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # the expected fault prints nothing
        os.write(write_end, b"forked")  # the fork itself went well
        ctypes.string_at(address, 1)
        os._exit(0)
    os.close(write_end)
    said = os.read(read_end, 16)
    _, status = os.waitpid(pid, 0)
    assert said == b"forked"
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV
    eng.close()


@pytest.mark.parametrize(
    ("siblings", "expected"),
    [
        ({}, list(range(2, 8))),  # no SMT: two cores kept for the training thread
        ({0: {0, 4}, 4: {0, 4}}, [1, 2, 3, 5, 6, 7]),  # SMT: a whole core, both its siblings
    ],
    ids=["no-smt", "smt"],
)
def test_delayed_mode_keeps_whole_cores_for_the_training_thread(
    monkeypatch: pytest.MonkeyPatch, siblings: dict[int, set[int]], expected: list[int]
) -> None:
    from offload_runner import hardware
    from offload_runner.config.schema import RunConfig
    from offload_runner.offload import cpu_adam

    monkeypatch.setattr(hardware, "_thread_siblings", lambda c: siblings.get(c, {c}))
    run = RunConfig()
    cpus = list(range(8))
    assert hardware.worker_cpus(run, cpus) == cpus  # exact mode: the training thread waits
    run.optimizer.cpu_adam_delayed_update = True
    kept = hardware.worker_cpus(run, cpus)
    assert kept == expected
    assert cpu_adam.cpu_ranges(kept) == ("1-3,5-7" if siblings else "2-7")


def test_metrics_give_the_fraction_that_hides_under_forward_backward() -> None:
    """summary.json's cpu_adam_hidden_fraction: at the rate the CPU step reached, the share of
    the rank's shard that one forward+backward covers (capped at 1), and no more than keeps the
    boundary copies within planner.delayed_max_overhead of it at planner.host_link_gb_per_s."""
    from types import SimpleNamespace

    from offload_runner.config.schema import PlannerConfig
    from offload_runner.offload import cpu_adam

    buffers = Buffers()
    eng = engine(buffers, 0.5)
    for step in range(1, 5):
        drive(eng, buffers, step)
    optimizer = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=eng)])
    found = cpu_adam.metrics(optimizer, forward_backward_s=None)
    assert found["cpu_adam_hidden_fraction"] is None
    rate = found["cpu_adam_params_per_s"]
    fb = 0.25 * sum(SIZES) / rate
    assert eng.shard_numel == sum(SIZES)
    hidden = cpu_adam.metrics(optimizer, forward_backward_s=fb)["cpu_adam_hidden_fraction"]
    assert hidden == pytest.approx(0.25)
    assert cpu_adam.metrics(optimizer, forward_backward_s=1e6)["cpu_adam_hidden_fraction"] == 1.0
    # a link at which the copies of the whole shard take 20x the overhead allowed: 0.125
    planner = PlannerConfig(
        host_link_gb_per_s=20 * rate / 1e9, delayed_max_overhead=0.1, cpu_adam_launch_slowdown=0.0
    )
    found = cpu_adam.metrics(optimizer, forward_backward_s=fb, planner=planner)
    assert found["cpu_adam_hidden_fraction"] == pytest.approx(0.125)
    # a link at which the whole shard's copies take 3.2 forward+backwards: at the boundary 0.1
    # of it, copying during the last of 2 backwards (a third of forward+backward at
    # BACKWARD_SHARE) a third more
    slow = replace(planner, host_link_gb_per_s=5 * rate / 1e9)
    found = cpu_adam.metrics(optimizer, forward_backward_s=fb, planner=slow)
    assert found["cpu_adam_hidden_fraction"] == pytest.approx(0.1 / 3.2)
    found = cpu_adam.metrics(optimizer, forward_backward_s=fb, planner=slow, copy_micro_batches=2)
    assert found["cpu_adam_hidden_fraction"] == pytest.approx((0.1 + 1 / 3) / 3.2)
    # exact mode landing during the forward: the forward's wait for the update is not its work
    for update in eng.history:
        update.forward_wait_s = 3 * fb
    found = cpu_adam.metrics(optimizer, forward_backward_s=4 * fb)
    assert found["cpu_adam_forward_wait_s_median"] == pytest.approx(3 * fb)
    assert found["cpu_adam_forward_backward_s"] == pytest.approx(fb)
    assert found["cpu_adam_hidden_fraction"] == pytest.approx(0.25)
    # CPU Adam slowing the training thread (no copies): 0.2 s per second beside it uses up the
    # 0.1 of forward+backward allowed at half the CPU's limit
    quick = replace(planner, host_link_gb_per_s=1e9, cpu_adam_launch_slowdown=0.2)
    found = cpu_adam.metrics(optimizer, forward_backward_s=4 * fb, planner=quick)
    assert found["cpu_adam_hidden_fraction"] == pytest.approx(0.125)
    eng.close()


def test_a_delayed_run_measures_how_much_its_cpu_adam_slowed_forward_backward() -> None:
    """Given forward+backward without offload (planner.forward_backward_s), a delayed run
    measures the slowdown per second of CPU Adam beside it and prices the hidden fraction with
    it; without, it takes the planner's figure and its own forward+backward less that."""
    from types import SimpleNamespace

    from offload_runner.config.schema import PlannerConfig
    from offload_runner.offload import cpu_adam

    buffers = Buffers()
    eng = engine(buffers, 1.0, delayed=True, exact_steps=1)
    for step in range(1, 6):
        drive(eng, buffers, step)
    eng.finish()
    optimizer = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=eng)])
    busy = cpu_adam.metrics(optimizer)["cpu_adam_busy_s_median"]
    no_copies = PlannerConfig(host_link_gb_per_s=1e9, delayed_max_overhead=0.1)
    # forward+backward 2 busy with the CPU, 1.7 busy without: 0.3 s lost per second beside it
    found = cpu_adam.metrics(
        optimizer,
        forward_backward_s=2 * busy,
        planner=replace(no_copies, forward_backward_s=1.7 * busy),
    )
    assert found["cpu_adam_launch_slowdown"] == pytest.approx(0.3)
    assert found["cpu_adam_launch_slowdown_measured"] is True
    assert found["cpu_adam_forward_backward_without_s"] == pytest.approx(1.7 * busy)
    # the 0.1 * 1.7 busy allowed buys 0.17 / 0.3 of the shard's busy second
    assert found["cpu_adam_hidden_fraction"] == pytest.approx(0.17 / 0.3, rel=1e-3)
    # without it: the planner's slowdown (0.25 by default), the run's own less that
    found = cpu_adam.metrics(optimizer, forward_backward_s=2 * busy, planner=no_copies)
    assert found["cpu_adam_launch_slowdown"] == 0.25
    assert found["cpu_adam_launch_slowdown_measured"] is False
    assert found["cpu_adam_forward_backward_without_s"] == pytest.approx(1.75 * busy)
    assert found["cpu_adam_hidden_fraction"] == pytest.approx(0.175 / 0.25, rel=1e-3)
    eng.close()


def test_a_step_that_fails_while_copying_leaves_no_worker_waiting() -> None:
    """The worker is handed the update before the copies are enqueued; when enqueueing fails,
    the error reaches the caller and the worker gives the update up (close() returns)."""
    buffers = Buffers()
    eng = engine(buffers, 1.0)
    drive(eng, buffers, 1)
    fetch, calls = eng.link.fetch, []

    def failing_fetch(piece, after=None) -> None:
        calls.append(piece)
        if len(calls) == 2:
            raise RuntimeError("copy failed")
        fetch(piece, after)

    eng.link.fetch = failing_fetch
    with pytest.raises(RuntimeError, match="copy failed"):
        drive(eng, buffers, 2)
    closer = threading.Thread(target=eng.close)
    closer.start()
    closer.join(timeout=10)
    assert not closer.is_alive()
    assert len(eng.history) == 1  # the given-up update is not counted


class Layer(torch.nn.Module):
    """A module whose weight is one of the buffer's views (as Megatron-Core's DDP lays out the
    parameters); its forward reads the weight."""

    def __init__(self, view: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(view, requires_grad=False)  # shares the buffer

    def forward(self) -> torch.Tensor:
        return self.weight.detach().clone()


def model_of(buffers: Buffers) -> torch.nn.Sequential:
    """Forward order is the buffer's reverse (DDP lays parameters out in backward order)."""
    return torch.nn.Sequential(*[Layer(v) for v in reversed(buffers.views)])


def test_landing_during_the_forward_gives_each_module_its_exact_update() -> None:
    """Exact mode landing during the forward: step() returns with the update on the CPU; each
    module's forward sees its parameters updated exactly as torch's fused AdamW updates them."""
    buffers = Buffers()
    eng, ref = engine(buffers, 1.0, land_during_forward=True), Reference(buffers)
    model = model_of(buffers)
    eng.watch([model])
    for step in range(1, 6):
        ref.step(step, drive(eng, buffers, step))
        seen = [layer() for layer in model]  # the next forward
        assert eng.link.inflight is None  # it waited for every piece
        assert eng.history[-1].forward_wait_s >= 0.0
        rounded = [m.to(torch.bfloat16) for m in reversed(masters(eng, buffers))]
        assert all(torch.equal(a, b) for a, b in zip(seen, rounded, strict=True))
        assert_matches(masters(eng, buffers), ref.params, step)
    assert [p.start for p in eng._pieces] == sorted((p.start for p in eng._pieces), reverse=True)
    eng.close()


class GatedAdam(CpuAdam):
    """Holds Adam of the pieces at the buffer's start (the last layers in forward order) until
    ``gate`` is set."""

    gate: threading.Event
    hold_below: int = 0

    def _adam(self, a: int, b: int, h: dict, steps, grad_scale=None) -> None:
        if a < self.hold_below:
            assert self.gate.wait(timeout=30)
        super()._adam(a, b, h, steps, grad_scale)


def test_the_forward_waits_for_its_own_parameters_only() -> None:
    """The first layer's forward goes on while the CPU still updates the last layer's
    parameters; the last layer's forward waits for them."""
    buffers = Buffers()
    eng = engine(buffers, 1.0, GatedAdam, land_during_forward=True)
    eng.gate, eng.hold_below = threading.Event(), SIZES[0]  # the buffer's first view
    model = model_of(buffers)
    eng.watch([model])
    eng.gate.set()
    drive(eng, buffers, 1)
    first_before = [layer() for layer in model][0]
    eng.gate.clear()
    drive(eng, buffers, 2)  # returns with the update on the CPU
    first = model[0]()  # the buffer's last view: updated first
    assert not torch.equal(first, first_before)
    assert eng.link.inflight is not None and not eng.link.inflight[1].done()
    last_before = buffers.views[0].clone()
    finished = []
    waiter = threading.Thread(target=lambda: finished.append(model[-1]()))
    waiter.start()
    waiter.join(timeout=0.5)
    assert waiter.is_alive() and not finished  # waiting for the held pieces
    eng.gate.set()
    waiter.join(timeout=30)
    assert finished and not torch.equal(finished[0], last_before)
    assert torch.equal(finished[0], eng.state[buffers.views[0]]["master_param"].to(torch.bfloat16))
    eng.close()


def test_delayed_mode_stops_watching_the_forward_when_its_delayed_steps_begin() -> None:
    """Delayed mode's exact steps land during the forward; its delayed steps need no hooks."""
    buffers = Buffers()
    eng = engine(buffers, 1.0, delayed=True, exact_steps=2, land_during_forward=True)
    model = model_of(buffers)
    eng.watch([model])
    for step in (1, 2):
        drive(eng, buffers, step)
        [layer() for layer in model]
        assert eng.link.hooks and eng.link.inflight is None
    drive(eng, buffers, 3)
    assert not eng.link.hooks and not any(layer._forward_pre_hooks for layer in model)
    eng.close()


def test_an_update_that_fails_raises_in_the_forward() -> None:
    """A worker error reaches the training thread at the first module that waits for it."""
    buffers = Buffers()
    eng = engine(buffers, 1.0, land_during_forward=True)
    model = model_of(buffers)
    eng.watch([model])
    drive(eng, buffers, 1)
    [layer() for layer in model]

    def failing(a, b, h, steps, grad_scale=None) -> None:
        raise RuntimeError("adam failed")

    eng._adam = failing
    drive(eng, buffers, 2)
    with pytest.raises(RuntimeError, match="adam failed"):
        model[0]()
    assert eng.link.inflight is None
    eng.close()


def test_delayed_mode_past_the_experts_is_named_with_the_fraction_that_stops_there() -> None:
    """A MoE rank in delayed mode: a fraction beyond its experts' share draws a warning naming
    that share (rounded down, so the dense part stays whole on the GPU); within it, in exact
    mode, or without experts: nothing."""
    from offload_runner.offload.cpu_adam import delayed_dense_warning

    sizes, experts = [2000, 7756], [False, True]  # a dense part, then the experts
    warning = delayed_dense_warning(sizes, experts, 1.0, delayed=True)
    assert warning and "optimizer.optimizer_offload_fraction=0.7949 keeps them exact" in warning
    assert part_fractions(sizes, experts, 0.7949, experts_first=True)[0] == 0.0
    assert delayed_dense_warning(sizes, experts, 0.7949, delayed=True) is None
    assert delayed_dense_warning(sizes, experts, 1.0, delayed=False) is None
    assert delayed_dense_warning([100], [False], 1.0, delayed=True) is None


def test_delayed_experts_scope_delays_the_expert_part_alone() -> None:
    """optimizer.cpu_adam_delayed_scope=experts (with expert parallelism: the experts' own
    optimizer part): the expert part's engine delayed, the dense part's exact (its states on
    the host all the same); delayed mode delays both; exact mode neither. The summary names the
    mix."""
    from offload_runner.offload.cpu_adam import mode_name, part_delays

    experts = [False, True]
    for option, expected in (
        ("cpu_adam", [False, False]),
        ("cpu_adam_delayed", [True, True]),
        ("cpu_adam_delayed_experts", [False, True]),
    ):
        run = compose_run("recipe=tiny_moe", "parallel=ep2", f"offload/optimizer={option}")
        assert part_delays(run, experts) == expected, option
    with pytest.raises(RuntimeError, match="found no optimizer part of routed experts"):
        part_delays(run, [False])  # expert parameters inside the dense part (EP=1)
    engines = [SimpleNamespace(delayed=d, offloaded_numel=n) for d, n in ((False, 10), (True, 30))]
    assert mode_name(engines) == "delayed experts"
    assert mode_name(engines[1:]) == "delayed" and mode_name(engines[:1]) == "exact"
    assert mode_name([engines[0], SimpleNamespace(delayed=True, offloaded_numel=0)]) == "exact"


class Trainable(torch.nn.Module):
    """The buffer's views as trainable weights: a backward runs their gradient accumulation, and
    the engine's hooks after it (Megatron-Core's DDP has filled the grad buffer by then)."""

    def __init__(self, buffers: Buffers) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(v, requires_grad=True) for v in reversed(buffers.views)
        )
        start = 0
        for w in reversed(self.weights):  # DDP's: each parameter's view of the grad buffer
            w.main_grad = buffers.grad[start : start + w.numel()]
            start += w.numel()

    def forward(self) -> torch.Tensor:
        return sum(w.float().sum() for w in self.weights)


def unclipped(step: int) -> torch.Tensor:
    return torch.randn(sum(SIZES), generator=torch.Generator().manual_seed(100 + step)) * 3


def assert_same_weights(a: torch.Tensor, b: torch.Tensor, step: int) -> None:
    """bf16 weights rounded from masters within 1e-6 of each other: equal but where the two
    masters straddle a rounding boundary (one in a thousand here), there one bf16 ulp apart.
    (The CPU divides by the inverse of the clip factor; Megatron-Core multiplies by it.)"""
    differ = a != b
    assert differ.sum() <= a.numel() // 1000, f"step {step}"
    assert ((a.float() - b.float()).abs() <= a.float().abs() * 2**-7).all(), f"step {step}"


@pytest.mark.parametrize("share", [0.0, 0.5])
def test_delayed_mode_copies_during_the_last_backward_and_clips_on_the_cpu(share: float) -> None:
    """Delayed steps copy during the last micro-batch's backward: once every parameter of a
    piece has its gradient, the last update lands in it and its (unclipped) gradients go down;
    the worker applies Megatron-Core's clip factor. The weights each forward sees are those of
    the copies at the step boundary (up to rounding), the masters torch's fused AdamW's within
    1e-6. Megatron-Core's clipping (in place) waits for the copies (``before_clip``): without
    that, the landing thread's late copies read clipped gradients (thousands of the 15,492
    weights off by step 6, in some runs)."""
    from offload_runner.offload import cpu_adam

    exact = 2
    buffers, twin = Buffers(), Buffers()
    eng = engine(
        buffers,
        1.0,
        delayed=True,
        exact_steps=exact,
        copy_during_backward=True,
        clip_grad=CLIP,
        gpu_share=share,
    )
    at_boundary, ref = engine(twin, 1.0, delayed=True, exact_steps=exact), Reference(buffers)
    model = Trainable(buffers)
    eng.watch_backward([model])
    no_sync = host_adam.arming(contextlib.nullcontext, [eng])
    assert host_adam.arming(contextlib.nullcontext, [at_boundary]) is contextlib.nullcontext
    for step in range(1, STEPS + 1):
        raw = unclipped(step)
        buffers.set_grads(raw)  # what the backward accumulates into the grad buffer
        before = buffers.param.clone()
        with no_sync():
            model().backward()  # an earlier micro-batch: nothing moves
            assert not eng.delay.early
        model().backward()  # the last
        copied = dict(eng.delay.early)
        cpu_adam.before_clip([eng])
        assert all(job.done() for job in copied.values())
        norm = raw.norm().item()
        clipped = raw * (CLIP / (norm + 1e-6))
        twin.set_grads(clipped)
        for group in eng.param_groups + at_boundary.param_groups:
            group["lr"] = lr_at(step)
        at_boundary.step()
        if step > exact + 1:  # the update of step - 2 landed during the backward
            assert not torch.equal(buffers.param, before)
            assert_same_weights(buffers.param, twin.param, step)
        buffers.grad.mul_(CLIP / (norm + 1e-6))  # Megatron-Core clips the GPU gradients
        eng.step()
        cpu_adam.grads_clipped([eng], norm)
        ref.step(step, clipped)
        assert len(copied) == (len(eng._pieces) if step > exact else 0), f"step {step}"
        for job in eng.delay.jobs:  # the worker's update (not landed)
            job.result()
        a, b = torch.cat(masters(eng, buffers)), torch.cat([p.detach() for p in ref.params])
        assert (a - b).abs().max() <= 1e-6 * b.abs().max(), f"step {step}"
    eng.flush()
    at_boundary.flush()
    assert_same_weights(buffers.param, twin.param, STEPS)
    found = eng.metrics()
    assert found["cpu_adam_pieces_in_backward"] == len(eng._pieces)
    eng.close()
    at_boundary.close()


def test_before_clip_waits_for_the_workers_last_update_and_the_step_counts_that_wait() -> None:
    """A backward that ends while the worker still runs the last update: each piece's copy waits
    for that update of its piece, so ``before_clip`` returns once the worker is done with all of
    them, and the step's boundary time (summary.json) includes that wait."""
    from offload_runner.offload import cpu_adam

    buffers = Buffers()
    eng = engine(
        buffers, 1.0, delayed=True, exact_steps=1, copy_during_backward=True, clip_grad=CLIP
    )
    adam = eng._adam
    eng._adam = lambda *args: (time.sleep(0.02), adam(*args))  # ~0.3 s an update
    model = Trainable(buffers)
    eng.watch_backward([model])
    no_sync = host_adam.arming(contextlib.nullcontext, [eng])
    for step in (1, 2, 3):  # step 2's update runs on the worker during step 3's backward
        raw = unclipped(step)
        buffers.set_grads(raw)
        with no_sync():
            model().backward()
        model().backward()
        began = time.perf_counter()
        cpu_adam.before_clip([eng])
        waited = time.perf_counter() - began
        buffers.grad.mul_(CLIP / (raw.norm().item() + 1e-6))
        eng.step()
        cpu_adam.grads_clipped([eng], raw.norm().item())
    assert waited > 0.1
    eng.finish()
    assert eng.history[-1].step == 3 and eng.history[-1].boundary_s >= waited
    eng.close()


def test_a_run_resumed_into_a_delayed_step_copies_during_its_first_backward() -> None:
    """Resumed at a delayed step, the first backward after the load copies during the backward
    as the uninterrupted run does (its pieces are planned there, not at the first step()), so
    the worker divides the same unclipped gradients and the masters stay the uninterrupted run's
    bit for bit (the first landing, predicted from Adam's state, within bf16 rounding)."""
    from offload_runner.offload import cpu_adam

    def build(buffers: Buffers):
        eng = engine(
            buffers,
            1.0,
            delayed=True,
            exact_steps=2,
            predict=True,
            copy_during_backward=True,
            clip_grad=CLIP,
        )
        model = Trainable(buffers)
        eng.watch_backward([model])
        return eng, model, host_adam.arming(contextlib.nullcontext, [eng])

    def train_step(eng, model, no_sync, buffers: Buffers, step: int) -> int:
        """One step; how many pieces crossed during its last backward. As under Megatron-Core,
        the optimizer's params have no gradient bound during the backward (zero_grad unbinds
        them, its step binds them): a resumed run plans from the model's main_grad views."""
        raw = unclipped(step)
        buffers.grad.copy_(raw)
        buffers.unbind_grads()
        with no_sync():
            model().backward()
        model().backward()
        crossed = dict(eng.delay.early)
        cpu_adam.before_clip([eng])
        for group in eng.param_groups:
            group["lr"] = lr_at(step)
        buffers.grad.mul_(CLIP / (raw.norm().item() + 1e-6))
        buffers.bind_grads()
        eng.step()
        cpu_adam.grads_clipped([eng], raw.norm().item())
        return len(crossed)

    a_buf = Buffers()
    a = build(a_buf)
    for step in range(1, 7):
        train_step(*a, a_buf, step)
    a[0].finish()
    b_buf = Buffers(seed=1)
    b_buf.param.copy_(a_buf.param)
    b = build(b_buf)
    b[0].load_state_dict(copy.deepcopy(a[0].state_dict()))
    b[0].restore_after_load()
    for step in range(7, 12):
        train_step(*a, a_buf, step)
        crossed = train_step(*b, b_buf, step)
        assert crossed == len(b[0]._pieces), f"step {step}: copied at the boundary"
    a[0].finish()
    b[0].finish()
    assert all(
        torch.equal(x, y) for x, y in zip(masters(a[0], a_buf), masters(b[0], b_buf), strict=True)
    )
    assert torch.equal(a_buf.param, b_buf.param)
    a[0].close()
    b[0].close()


def test_an_update_copied_during_the_backward_waits_for_the_clip_factor() -> None:
    """Without grads_clipped the worker must not run: finish() says what is missing instead of
    hanging, and close() gives the update up."""

    buffers = Buffers()
    eng = engine(
        buffers, 1.0, delayed=True, exact_steps=1, copy_during_backward=True, clip_grad=CLIP
    )
    model = Trainable(buffers)
    eng.watch_backward([model])
    no_sync = host_adam.arming(contextlib.nullcontext, [eng])
    for step in (1, 2):
        buffers.set_grads(gradients(step))
        with no_sync():
            pass
        model().backward()
        eng.step()
    assert any(eng.delay.pending.unclipped) and not eng.delay.pending.scaled.is_set()
    with pytest.raises(RuntimeError, match="grads_clipped"):
        eng.finish()
    closer = threading.Thread(target=eng.close)
    closer.start()
    closer.join(timeout=10)
    assert not closer.is_alive()


def pieces_in_worker_order(eng: CpuAdam, steps: range, step_once) -> list:
    """Per step of ``steps``: the pieces (indices) in the order the worker ran Adam on them."""
    seen: list[int] = []
    adam = eng._adam

    def spy(a: int, b: int, *args) -> None:
        piece = next(i for i, q in enumerate(eng._pieces) if q.start <= a < q.stop)
        if not seen or seen[-1] != piece:
            seen.append(piece)
        adam(a, b, *args)

    eng._adam = spy
    orders = []
    for step in steps:
        seen.clear()
        step_once(step)
        eng.finish()
        orders.append(list(seen))
    return orders


def test_delayed_updates_run_in_the_order_the_gradients_came_down() -> None:
    """Delayed mode's worker starts on the gradients that are down first: those copied during
    the backward, in the order they went down; at the step boundary the DDP buffer's
    (backward-ready) order, also where exact steps run in forward order (landing during the
    forward). Exact steps keep the forward order."""
    from offload_runner.offload import cpu_adam

    buffers = Buffers()
    eng = engine(
        buffers,
        1.0,
        delayed=True,
        exact_steps=2,
        copy_during_backward=True,
        land_during_forward=True,
    )
    model = Trainable(buffers)
    eng.watch([model])
    eng.watch_backward([model])
    no_sync = host_adam.arming(contextlib.nullcontext, [eng])
    crossed: list[list[int]] = []

    def backward_and_step(step: int) -> None:
        buffers.set_grads(gradients(step))
        with no_sync():
            pass
        model().backward()
        crossed.append(list(eng.delay.early))
        eng.step()
        cpu_adam.grads_clipped([eng], None)

    orders = pieces_in_worker_order(eng, range(1, 6), backward_and_step)
    forward = list(range(len(eng._pieces)))
    starts = [q.start for q in eng._pieces]
    assert starts == sorted(starts, reverse=True)  # forward order: the buffer's reverse
    assert orders[:2] == [forward, forward]  # exact steps
    for step in (3, 4, 5):
        assert crossed[step - 1], f"step {step}"
        assert orders[step - 1] == crossed[step - 1], f"step {step}"
    eng.close()

    twin = Buffers()
    at_boundary = engine(twin, 1.0, delayed=True, exact_steps=1, land_during_forward=True)
    orders = pieces_in_worker_order(
        at_boundary, range(1, 4), lambda step: drive(at_boundary, twin, step)
    )
    backward = forward[::-1]
    assert orders == [forward, backward, backward]
    at_boundary.close()


@pytest.mark.parametrize(("fraction", "share"), [(1.0, 0.4), (0.5, 0.6), (1.0, 1.0)])
def test_a_gpu_share_through_the_window_is_bit_identical_too(fraction: float, share: float) -> None:
    """Exact mode with a GPU share: the last pieces in forward order pass through the state
    window (on the CPU here, with the same fused kernel), the first run on the CPU; each
    module's forward still sees its exact update, and the masters follow torch's AdamW."""
    from offload_runner.offload.window import SLOTS

    buffers = Buffers()
    eng = engine(buffers, fraction, land_during_forward=True, gpu_share=share)
    ref = Reference(buffers)
    model = model_of(buffers)
    eng.watch([model])
    for step in range(1, STEPS + 1):
        ref.step(step, drive(eng, buffers, step))
        seen = [layer() for layer in model]  # the next forward
        assert eng.link.inflight is None or share == 1.0
        kept = len(buffers.views) - len(eng.offloaded)  # Adam on the GPU as before
        rounded = [m.to(torch.bfloat16) for m in reversed(masters(eng, buffers))]
        assert all(torch.equal(a, b) for a, b in zip(seen, rounded, strict=True)), kept
        assert_matches(masters(eng, buffers), ref.params, step)
    pieces, on_cpu = len(eng._pieces), eng.share.on_cpu
    on_gpu = sum(p.numel for p in eng._pieces[on_cpu:])
    assert on_gpu / eng.offloaded_numel == pytest.approx(share, abs=1500 / eng.offloaded_numel)
    assert eng.share.streamed == eng._pieces[on_cpu:] and (on_cpu == 0) == (share == 1.0)
    assert pieces > on_cpu > 0 or share == 1.0
    assert eng.history[-1].params == eng.offloaded_numel - on_gpu
    assert eng.streams_states and eng.window_bytes == SLOTS * 12 * 1500
    metrics = eng.metrics()
    assert metrics["cpu_adam_params_on_cpu"] == eng.offloaded_numel - on_gpu
    eng.close()


def test_an_armed_gpu_share_splits_before_the_last_backward_and_stays_exact() -> None:
    """Exact mode with a GPU share, armed for the last micro-batch: the split is made then (the
    backward may bring the share's states in) and the step keeps it; the masters follow torch's
    AdamW whatever the backward brought in."""
    buffers = Buffers()
    eng = engine(buffers, 1.0, land_during_forward=True, gpu_share=0.5, balance=True)
    ref, model = Reference(buffers), model_of(buffers)
    eng.watch([model])
    no_sync = host_adam.arming(contextlib.nullcontext, [eng])
    for step in range(1, STEPS + 1):
        with no_sync():
            pass
        window = eng.share.window
        if step > 1:
            assert window.prefetched and window._pass.pieces is eng.share.streamed
            split = eng.share.on_cpu
            assert window.grow(step % 3 * window.slot_bytes) == step % 3
        ref.step(step, drive(eng, buffers, step))
        assert step == 1 or eng.history[-1].on_cpu == split
        [layer() for layer in model]  # the next forward
        assert_matches(masters(eng, buffers), ref.params, step)
    assert sum(n > 0 for n in eng.share.window.grown) == sum(s % 3 > 0 for s in range(2, STEPS + 1))
    eng.close()


def test_no_gpu_share_with_weight_prediction_nor_at_zero() -> None:
    buffers = Buffers()
    for kwargs in (
        {"delayed": True, "predict": True, "gpu_share": 0.5, "balance": True},
        {"gpu_share": 0.0},
        {"delayed": True, "gpu_share": 0.0},
    ):
        eng = engine(buffers, 1.0, **kwargs)
        drive(eng, buffers, 1)
        assert not eng.streams_states and eng.share.on_cpu == len(eng._pieces)
        eng.close()


def test_the_balance_moves_the_split_half_way_to_where_both_finish_together() -> None:
    """``optimizer.cpu_adam_gpu_share=null``: after each exact step the engine sets its GPU
    share half way to where the measured CPU and window rates would finish together."""
    buffers = Buffers()
    eng = engine(buffers, 1.0, gpu_share=0.5, balance=True, chunk_bytes=4 * 500)
    total = eng.offloaded_numel
    for step in range(1, 4):
        drive(eng, buffers, step)
    on_gpu = sum(p.numel for p in eng._pieces[eng.share.on_cpu :])
    assert on_gpu / total == pytest.approx(0.5, abs=500 / total)  # no timing on the CPU: kept
    # the CPU updated its share at half the rate the window passed its own: 2/3 should go to the
    # GPU, so the next split takes the GPU share half way there
    last = eng.history[-1]
    last.wall_s = 2.0 * last.params / total
    eng.share.window.history.append((1.0 * on_gpu / total, on_gpu))
    eng.share.rebalance()
    share = on_gpu / total
    assert eng.share.share == pytest.approx(share + 0.5 * (2 / 3 - share))
    moved = sum(p.numel for p in eng._pieces[eng.share.cpu_pieces(eng.share.share) :]) / total
    assert moved == pytest.approx(eng.share.share, abs=500 / total)
    eng.share.rebalance()  # the same step's timing moves it once
    assert eng.share.share == pytest.approx(share + 0.5 * (2 / 3 - share))
    # a delayed update's late pass: its link also carries every piece's landing (4 B per 16 of
    # the window's), so the CPU keeps more: (2 - 1/4) / 3 goes to the GPU
    last.late_share, eng.share.balanced_at = True, 0
    eng.share.rebalance()
    assert eng.share.share == pytest.approx(share + 0.5 * ((2 - 0.25) / 3 - share))
    # far from balance it keeps a piece on each side, so both rates stay measured
    assert eng.share.cpu_pieces(1.0) == 1 and eng.share.cpu_pieces(0.0) == len(eng._pieces) - 1
    eng.close()
    # the run stays exact while the split moves between steps
    buffers = Buffers()
    eng2 = engine(buffers, 1.0, gpu_share=0.5, balance=True, chunk_bytes=4 * 500)
    ref = Reference(buffers)
    for step in range(1, 8):
        ref.step(step, drive(eng2, buffers, step))
        eng2.share.share = [0.9, 0.1, 0.6, 0.8, 0.3, 0.5, 0.2][step - 1]  # moved between every step
        eng2.share.window.finish()
    assert_matches(masters(eng2, buffers), ref.params, 7)
    eng2.close()


def test_a_balanced_gpu_share_is_fixed_after_the_balance_steps_and_checkpointed() -> None:
    """Numerics that do not depend on timing: the balance moves the share up to BALANCE_STEPS,
    then it stays, the param groups carry it, and an engine loaded from them splits the same
    way from its first step (a resume gives the uninterrupted run's numbers)."""
    from offload_runner.offload.cpu_adam import BALANCE_STEPS, GPU_SHARE

    buffers = Buffers()
    eng = engine(buffers, 1.0, gpu_share=0.5, balance=True, chunk_bytes=4 * 500)
    total, shares = eng.offloaded_numel, []
    for step in range(1, BALANCE_STEPS + 4):
        drive(eng, buffers, step)
        last = eng.history[-1]  # the CPU twice as slow per param as the window: 2/3 to the GPU
        last.wall_s = 2.0 * last.params / total
        on_gpu = total - last.params
        eng.share.window.history.append((1.0 * on_gpu / total, on_gpu))
        shares.append(eng.share.share)
    moving, fixed = shares[1:BALANCE_STEPS], shares[BALANCE_STEPS:]
    assert len(set(moving)) == len(moving)  # balanced: it moved at every step up to there
    assert len(set(fixed)) == 1 and eng.share.fixed
    assert eng.param_groups[0][GPU_SHARE] == fixed[0]
    eng.finish()
    saved = copy.deepcopy(eng.state_dict())
    b_buf = Buffers(seed=1)
    b_buf.param.copy_(buffers.param)
    b = engine(b_buf, 1.0, gpu_share=0.5, balance=True, chunk_bytes=4 * 500)
    b.load_state_dict(saved)
    b.restore_after_load()
    assert b.share.share == fixed[0] and b.share.fixed
    for step in range(BALANCE_STEPS + 4, BALANCE_STEPS + 7):
        drive(eng, buffers, step)
        drive(b, b_buf, step)
        assert b.share.on_cpu == eng.share.on_cpu
        assert torch.equal(buffers.param, b_buf.param), f"step {step}"
    eng.close()
    b.close()


def test_deterministic_mode_takes_the_gpu_share_from_the_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under model.deterministic_mode nothing timed steers the split: no balance, and the
    planner's share from its configured rates (the reference CPU rate where none is set)
    instead of a rate measured on this machine."""
    from offload_runner import hardware, step_cost
    from offload_runner.offload.cpu_adam import balanced_share

    def measured(threads: int) -> float:
        raise AssertionError("measured a rate")

    monkeypatch.setattr(step_cost, "measured_rate", measured)
    run = compose_run("recipe=tiny", "offload/optimizer=cpu_adam", "model.deterministic_mode=true")
    assert not balanced_share(run)
    cost = step_cost.step_cost(run)
    assert cost.cpu_adam_params_per_s == hardware.REFERENCE_CPU_ADAM_PARAMS_PER_S
    assert 0 < cost.gpu_share(run) < 1
    run = compose_run("recipe=tiny", "offload/optimizer=cpu_adam")
    assert balanced_share(run)
    run = compose_run(
        "recipe=tiny",
        "offload/optimizer=cpu_adam",
        "model.deterministic_mode=true",
        "planner.cpu_adam_params_per_s=2e9",
    )
    assert step_cost.step_cost(run).cpu_adam_params_per_s == 2e9


def test_bf16_gradients_go_down_as_bf16_and_update_in_fp32() -> None:
    """ddp.grad_reduce_in_fp32=false: the DDP buffer's bf16 gradients go down as they are (2 B
    per param) and Adam upcasts them; the update is the reference's on the same bf16-rounded
    gradients."""
    buffers = Buffers()
    eng = engine(buffers, 1.0, grad_dtype=torch.bfloat16)
    ref = Reference(buffers)
    assert eng.host_grad.dtype == torch.bfloat16
    bf16_grad = torch.zeros(sum(SIZES), dtype=torch.bfloat16)
    for step in range(1, 6):
        grads = gradients(step).to(torch.bfloat16)
        bf16_grad.copy_(grads)
        start = 0
        for view, n in zip(buffers.views, SIZES, strict=True):
            view.decoupled_grad = bf16_grad[start : start + n]
            start += n
        for group in eng.param_groups:
            group["lr"] = lr_at(step)
        eng.step()
        ref.step(step, grads.float())
        assert_matches(masters(eng, buffers), ref.params, step)
    eng.close()


def test_the_train_step_lets_the_backwards_copies_finish_before_the_clipping() -> None:
    """Engines.step: the copies the last backward started (delayed mode) have read the
    gradients before Megatron-Core's step clips them in place, and the engines get its norm
    after it."""
    from offload_runner.offload.engines import Engines

    calls: list[str] = []
    engine = SimpleNamespace(
        copies_taken=lambda: calls.append("copies taken"),
        grads_clipped=lambda norm: calls.append(f"clipped by {norm}"),
    )
    optimizer = SimpleNamespace(step=lambda: calls.append("optimizer.step") or (True, 2.5, 0))
    engines = Engines.__new__(Engines)
    engines.run, engines.model, engines.optimizer = compose_run("recipe=tiny"), [], optimizer
    engines.cpu_adam, engines.weights = [engine], []
    assert engines.step() == 2.5
    assert calls == ["copies taken", "optimizer.step", "clipped by 2.5"]


def _adam_case(n: int, grad_dtype, moment_dtype):
    g = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=g)
    grad = (torch.randn(n, generator=g) * 1e-3).to(grad_dtype)
    m = (torch.randn(n, generator=g) * 1e-3).to(moment_dtype)
    v = (torch.rand(n, generator=g) * 1e-6).to(moment_dtype)
    return master, grad, m, v


HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8)


def test_upcast_blocks_reuse_the_threads_arrays_and_match_fp32_adam(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """host_adam.adamw without the host kernel, on bf16 gradients and moments in blocks smaller
    than the tensor: the update is fused AdamW's on their fp32 upcasts, across the blocks'
    edges, and every block upcasts into the same three fp32 arrays of the thread."""
    from offload_runner.offload import host_adam, host_kernel

    monkeypatch.setattr(host_adam, "UPCAST_BLOCK", 1024)
    monkeypatch.setattr(host_kernel, "load", lambda: None)
    master, grad, m, v = _adam_case(4500, torch.bfloat16, torch.bfloat16)  # 4 blocks and a part
    ref_master, ref_m, ref_v = master.clone(), m.float(), v.float()
    steps = torch.tensor(3.0)
    host_adam.torch_adamw(steps, HYPER)([ref_master], [grad.float()], [ref_m], [ref_v])
    host_adam.adamw([master], [grad], [m], [v], steps, HYPER)
    assert torch.equal(master, ref_master)
    assert torch.equal(m, ref_m.bfloat16()) and torch.equal(v, ref_v.bfloat16())
    arrays = host_adam._SCRATCH.arrays
    ptrs = [a.data_ptr() for a in arrays]
    host_adam.adamw([master], [grad], [m], [v], steps, HYPER)
    assert host_adam._SCRATCH.arrays is arrays and [a.data_ptr() for a in arrays] == ptrs


@pytest.mark.parametrize(
    "grad_dtype, moment_dtype",
    [
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],
)
def test_host_kernel_matches_fused_adamw_on_upcasts(grad_dtype, moment_dtype) -> None:
    """The compiled one-pass kernel (split over threads) against torch's fused AdamW on fp32
    upcasts, a clip factor included: masters and moments bit for bit (as the engines' tests
    hold, <= 0.1% of elements may differ: torch's tail loop rounds otherwise), fp32 gradients
    unscaled in place as torch's kernel leaves them."""
    from offload_runner.offload import host_adam, host_kernel

    kernel = host_kernel.load()
    assert kernel is not None, "the CI machine has a C compiler: the kernel must build"
    master, grad, m, v = _adam_case(100_003, grad_dtype, moment_dtype)
    ref_master, ref_grad, ref_m, ref_v = (t.float().clone() for t in (master, grad, m, v))
    steps, scale = torch.tensor(7.0), torch.tensor(2.0)
    host_adam.torch_adamw(steps, HYPER, scale)([ref_master], [ref_grad], [ref_m], [ref_v])
    assert host_kernel.supports(master, grad, m, v)
    with torch.inference_mode():
        torch.set_num_threads(2)
        host_adam.adamw([master], [grad], [m], [v], steps, HYPER, scale)
    for got, want in ((master, ref_master), (m, ref_m), (v, ref_v)):
        assert (got != want.to(got.dtype)).sum() <= got.numel() // 1000
    if grad_dtype == torch.float32:
        assert torch.equal(grad, ref_grad)


def test_attach_says_what_it_built(caplog: pytest.LogCaptureFixture) -> None:
    """attach's log lines (``wiring._announce``): the params on the CPU out of the rank's shard,
    the cores, the mode; the GPU share and its window where there is one; where exact updates
    land when a shard is all-gathered; when delayed steps copy."""
    import logging

    from offload_runner.config.schema import RunConfig
    from offload_runner.offload.cpu_adam import wiring

    run = RunConfig()
    run.optimizer.cpu_adam_delayed_update = True
    built = [
        SimpleNamespace(offloaded_numel=15 * 10**8, delayed=True, window_bytes=2**29),
        SimpleNamespace(offloaded_numel=5 * 10**8, delayed=False, window_bytes=0),
    ]
    with caplog.at_level(logging.INFO, logger=wiring.log.name):
        wiring._announce(run, built, 3_000_000_000, [0, 1, 2, 3], 0.5, [True, False], [True, True])
    text = caplog.text
    assert (
        "2.000B of 3.000B params of this rank's shard on the CPU (4 threads on cores 0-3), "
        "delayed experts" in text
    )
    assert "Adam on 50% of them on the GPU instead" in text and "512 MiB window" in text
    assert "land within step()" in text
    assert "delayed steps copy during the last micro-batch's backward" in text
