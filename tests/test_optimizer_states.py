"""The windowed optimizer-state offload on the CPU: its update and checkpoints.

The engine is driven as Megatron-Core's precision-aware DistributedOptimizer drives it (the
harness of tests/test_cpu_adam.py: bf16 views of one parameter buffer, fp32 gradients in
``decoupled_grad``, a changing lr, two param groups, clipped gradients) and must give torch's
AdamW(fused=True) on the CPU, whichever piece of the window each element passes through. Without
CUDA the copies are synchronous; the streams are exercised by the GPU tests.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from offload_runner.offload import host_adam, remainders
from offload_runner.offload.cpu_adam import CpuAdam
from offload_runner.offload.host_adam import AdamSettings
from offload_runner.offload.optimizer_states import BesideForward, Window, WindowedStates
from offload_runner.offload.window import BYTES_PER_PARAM, SLOTS
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


def windowed(
    buffers: Buffers, piece: int = PIECE, rem: bool = False, low: int = 0, **precision
) -> WindowedStates:
    """The engine on ``buffers``, its window ``piece`` params a slot (``low``: bytes per param
    its moments below fp32 add there; ``precision``: its moment dtypes, bf16 masters)."""
    moments = precision.pop("moment_dtypes", ())
    adam = AdamSettings(1e-3, 0.1, BETAS, EPS, moment_dtypes=moments)
    window = Window(SLOTS * (per_param(rem) + low) * piece, rem, **precision)
    return WindowedStates(buffers.groups(lr_at(1)), adam, window)


def per_param(rem: bool) -> int:
    """Window and host bytes per param: fp32 master and moments, or the master's remainder."""
    return BYTES_PER_PARAM - 2 * rem


def fp32_masters(eng: WindowedStates, buffers: Buffers) -> list[torch.Tensor]:
    """The engine's masters, rebuilt from the parameters where it keeps remainders."""
    found = masters(eng, buffers)
    if not eng.remainders:
        return found
    return [remainders.rebuild(view, rem) for view, rem in zip(buffers.views, found, strict=True)]


def assert_params_round_masters(eng: WindowedStates, buffers: Buffers) -> None:
    """The bf16 parameters are the masters rounded: to nearest even (fp32 masters), or as
    Transformer Engine's remainder kernel splits them (ties away from zero)."""
    for mine, view in zip(fp32_masters(eng, buffers), buffers.views, strict=True):
        if eng.remainders:
            param, rem = torch.empty_like(view), torch.empty(view.shape, dtype=torch.int16)
            remainders.split(mine, param, rem)
            assert torch.equal(view, param)
        else:
            assert torch.equal(view, mine.to(torch.bfloat16))


@pytest.mark.parametrize("rem", [False, True], ids=["fp32-masters", "remainders"])
def test_windowed_update_is_bit_identical_to_torch_fused_adamw(rem: bool) -> None:
    """The masters follow torch's fused AdamW whether they travel whole or as the remainders
    beside the bf16 parameters (2 B/param less each way and on the host)."""
    buffers = Buffers()
    eng, ref = windowed(buffers, rem=rem), Reference(buffers)
    for step in range(1, STEPS + 1):
        ref.step(step, drive(eng, buffers, step))
        assert_matches(fp32_masters(eng, buffers), ref.params, step)
        assert_params_round_masters(eng, buffers)
    assert len(eng._pieces) == -(-sum(ENGINE_SIZES) // PIECE) > SLOTS  # more pieces than slots
    assert eng.offloaded_numel == sum(ENGINE_SIZES)
    assert eng.window_bytes == SLOTS * per_param(rem) * PIECE
    assert eng.state_bytes_per_param == per_param(rem)
    assert eng.host_master.dtype == (torch.int16 if rem else torch.float32)
    assert eng.host_bytes >= per_param(rem) * sum(ENGINE_SIZES)
    assert eng.metrics() == {}  # no CUDA: nothing timed
    eng.close()


@pytest.mark.parametrize(
    ("grown", "rem"),
    [(0, False), (1, False), (SLOTS + 2, False), (10**6, False), (SLOTS + 2, True)],
)
def test_pieces_the_last_backward_brought_in_pass_bit_identically(grown: int, rem: bool) -> None:
    """Armed for the last micro-batch (``host_adam.arming``), the pass grows slots into the
    memory the backward frees, each loaded at once (``grown`` of them the budget allows, up to
    every piece), then the step adds the window's SLOTS slots: each grown slot carries its one
    piece and goes once that is out (its memory back to the allocator before the pass ends),
    the window's carry the rest in turn; the update is the same. Nothing grows unarmed or after
    the prefetch."""
    buffers = Buffers()
    eng, ref = windowed(buffers, rem=rem), Reference(buffers)
    window = eng._window
    no_sync = host_adam.arming(contextlib.nullcontext, [eng])
    released, updated = [], []  # (slot, pieces updated by then); the pieces updated
    release, update = window._release, window._update
    window._release = lambda at: (released.append((at, len(updated))), release(at))[1]
    window._update = lambda *args: (updated.append(1), update(*args))[1]
    ref.step(1, drive(eng, buffers, 1))  # plans the pieces
    pieces = len(eng._pieces)
    for step in range(2, STEPS + 1):
        assert window.grow(10**9) == 0  # not armed
        with no_sync():
            pass
        assert window.grow(grown * window.slot_bytes) == min(grown, pieces)
        assert len(window._pass.slots) == window._pass.queued == min(grown, pieces)
        eng.prefetch()  # the tail of backward
        assert window.grow(10**9) == 0
        # the window's SLOTS beside the grown slots, each of which carries one piece
        came = min(grown, pieces)
        assert len(window._pass.slots) == came + min(SLOTS, pieces - came)
        released.clear()
        updated.clear()
        ref.step(step, drive(eng, buffers, step))
        assert window.grown[-1] == sum(p.numel for p in eng._pieces[: min(grown, pieces)])
        # each slot as soon as its last piece is out: a grown slot's one, the window's last
        rest = min(SLOTS, pieces - came)  # the window's slots
        assert released == [(i, i + 1) for i in range(came)] + [
            (came + (j - came) % rest, j + 1) for j in range(max(came, pieces - rest), pieces)
        ]
        assert_matches(fp32_masters(eng, buffers), ref.params, step)
        assert_params_round_masters(eng, buffers)
    eng.close()


def test_growth_hooks_look_for_memory_every_stride_of_the_backward() -> None:
    """One hook per trainable parameter after its gradient accumulation; every
    ceil(params / GROW_CHECKS)-th calls the engines' ``grow`` (each returns at once unless
    armed)."""
    from offload_runner.offload.optimizer_states import GROW_CHECKS, _Growth

    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(2 * GROW_CHECKS)])
    calls = []
    engine_ = SimpleNamespace(grow=calls.append)
    params = sum(1 for _ in model.parameters())
    hooks = host_adam.after_each_grad([model], _Growth([engine_], params, reserve=123))
    assert len(hooks) == params == 4 * GROW_CHECKS
    model(torch.ones(1, 2)).sum().backward()
    assert calls == [123] * GROW_CHECKS  # each leaves room for a group full recompute rebuilds


def test_growth_leaves_the_reserve_to_the_rest_of_the_backward() -> None:
    """Without a budget the window takes what the backward freed less ``reserve`` (the group
    full recompute rebuilds later in the backward: auto's MB 8 pick ran out of memory without
    it on the 37-layer slice)."""
    buffers = Buffers()
    eng = windowed(buffers)
    window = eng._window
    drive(eng, buffers, 1)  # plans the pieces
    assert len(eng._pieces) > 3
    window._freed_bytes = lambda: 5 * window.slot_bytes
    with host_adam.arming(contextlib.nullcontext, [eng])():
        pass
    assert window.grow(reserve=3 * window.slot_bytes) == 2
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


@pytest.mark.parametrize("rem", [False, True], ids=["fp32-masters", "remainders"])
def test_windowed_checkpoint_continues_the_run_and_moves_to_cpu_adam(rem: bool) -> None:
    """Its state dict has HybridDeviceOptimizer's layout, like the CPU-Adam engine's (fp32
    masters: rebuilt from the remainders for the checkpoint, ``fp32_masters``): loaded into a
    fresh windowed engine, or into a CpuAdam, over the saved bf16 weights, both continue the
    original run (the CPU engine within the fused kernel's one-ulp tail differences)."""
    a_buf = Buffers()
    a = windowed(a_buf, rem=rem)
    for step in range(1, 7):
        drive(a, a_buf, step)
    with host_adam.fp32_masters(SimpleNamespace(optimizer=a)):  # as checkpoint.py saves
        saved = copy.deepcopy(a.state_dict())
    assert all(s["master_param"].dtype == torch.float32 for s in saved["state"].values())
    assert a.state[a_buf.views[0]]["master_param"].dtype == a.host_master.dtype  # views again
    copies = {}
    for name, build in (
        ("windowed", lambda b: windowed(b, rem=rem)),
        ("cpu_adam", lambda b: engine(b, 1.0)),
    ):
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
    assert_matches(masters(eng, buf), fp32_masters(a, a_buf), 11)
    assert copies["windowed"][0].param_groups[0]["step"] == 11
    for eng, _ in copies.values():
        assert isinstance(eng, CpuAdam) or eng.state_dict()["state"].keys() == saved["state"].keys()
        eng.close()
    a.close()


class Bf16MomentsReference(Reference):
    """torch's fused AdamW in fp32 on moments stored in bf16: upcast before each step, rounded
    to nearest even after it (Transformer Engine's FusedAdam with exp_avg_dtype=bf16)."""

    def __init__(self, buffers: Buffers) -> None:
        super().__init__(buffers)
        self.moments = [
            (
                torch.zeros(p.numel(), dtype=torch.bfloat16),
                torch.zeros(p.numel(), dtype=torch.bfloat16),
            )
            for p in self.params
        ]

    def step(self, step: int, grads: torch.Tensor) -> None:
        start = 0
        for p, (m, v), n, group in zip(
            self.params, self.moments, ENGINE_SIZES, self._groups(), strict=True
        ):
            m32, v32 = m.float(), v.float()
            torch._fused_adamw_(
                [p.data.view(-1)],
                [grads[start : start + n].clone()],
                [m32],
                [v32],
                [],
                [torch.tensor(float(step))],
                lr=lr_at(step),
                beta1=BETAS[0],
                beta2=BETAS[1],
                weight_decay=group,
                eps=EPS,
                amsgrad=False,
                maximize=False,
            )
            m.copy_(m32)
            v.copy_(v32)
            start += n

    def _groups(self) -> list[float]:
        decay = {id(p) for p in self.opt.param_groups[0]["params"]}
        return [0.1 if id(p) in decay else 0.0 for p in self.params]


BF16 = (torch.bfloat16, torch.bfloat16)


def test_bf16_moments_on_the_host_are_fp32_math_and_bf16_storage() -> None:
    """optimizer.exp_avg_dtype=bf16 exp_avg_sq_dtype=bf16 in both host engines (the CPU's Adam,
    and the window's, here on the CPU too): the moments stored in bf16 and each step the
    reference's (fp32 Adam on the upcast moments, rounded back), the masters likewise, but for
    the fused kernel's one-ulp tail elements; 8 B per param on the host instead of 12."""
    for build in (
        lambda b: engine(b, 1.0, moment_dtypes=BF16),
        lambda b: WindowedStates(
            b.groups(lr_at(1)),
            AdamSettings(1e-3, 0.1, BETAS, EPS, moment_dtypes=BF16),
            Window(SLOTS * 16 * PIECE),
        ),
    ):
        buffers = Buffers()
        eng, ref = build(buffers), Bf16MomentsReference(buffers)
        for step in range(1, 8):
            ref.step(step, drive(eng, buffers, step))
            assert_matches(masters(eng, buffers), ref.params, step)
            for i, view in enumerate(buffers.views):
                for key, mine in zip(("exp_avg", "exp_avg_sq"), ref.moments[i], strict=True):
                    got = eng.state[view][key]
                    assert got.dtype == torch.bfloat16
                    assert (got != mine).sum() <= max(1, got.numel() // 1000), (step, key)
        assert eng.state_bytes_per_param == 8
        assert eng.host_exp_avg.dtype == eng.host_exp_avg_sq.dtype == torch.bfloat16
        if isinstance(eng, WindowedStates):
            assert len(eng._pieces) > SLOTS  # the bf16 moments passed through the window
        eng.close()


def test_state_offload_fraction_keeps_the_rest_of_the_states_on_the_gpu() -> None:
    """optimizer.optimizer_state_offload_fraction: that share of the shard's states on the host
    (whole parameters, in the buffer's order), the rest updated where they are; the run is
    still torch's AdamW."""
    buffers = Buffers()
    eng = WindowedStates(
        buffers.groups(lr_at(1)),
        AdamSettings(1e-3, 0.1, BETAS, EPS, fraction=0.5),
        Window(SLOTS * BYTES_PER_PARAM * PIECE),
    )
    ref = Reference(buffers)
    total = sum(ENGINE_SIZES)
    assert 0.3 * total < eng.offloaded_numel < 0.7 * total and eng.kept
    for step in range(1, 6):
        ref.step(step, drive(eng, buffers, step))
        assert_matches(masters(eng, buffers), ref.params, step)
    assert eng.host_bytes < BYTES_PER_PARAM * 0.8 * total
    eng.close()


def _mapping_of(address: int) -> tuple[int, set[str]]:
    """The resident KiB and the VmFlags of the mapping of this process that holds ``address``."""
    rss, flags, inside = 0, set(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            rss = int(line.split()[1])
        elif inside and head == "VmFlags:":
            flags = set(line.split()[1:])
    return rss, flags


def test_host_arrays_come_zeroed_faulted_in_and_advised_huge_pages_before_pinning() -> None:
    """cudaHostRegister faults untouched pages in on one thread, 4 KiB at a time (3.1 s for
    8 GB against 0.37 s): the arena's pages are resident before it is registered, advised huge
    pages, and kept out of forked children."""
    if not Path("/proc/self/smaps").exists():
        pytest.skip("needs Linux's /proc")
    from offload_runner.offload.host_memory import HostArenas

    arenas = HostArenas()
    arena = arenas.allocate(64 * 2**20, pin=False)
    rss_kib, flags = _mapping_of(arena.data_ptr())
    assert rss_kib >= 64 * 1024
    assert {"dc", "hg"} <= flags  # MADV_DONTFORK, MADV_HUGEPAGE
    assert int(arena.count_nonzero()) == 0
    assert arenas.allocate(0, pin=False).numel() == 0 and len(arenas) == 2


@pytest.mark.gpu
def test_park_moves_a_models_tensors_to_page_locked_host_memory_and_back() -> None:
    """mcore.model's way to DDP for a model the GPU cannot hold twice: parameters (of two
    dtypes, one of them odd-sized) and buffers land on the host, page-locked, values intact,
    and come back as ``module.cuda()`` brings them."""
    from offload_runner.offload.host_memory import park

    module = torch.nn.Sequential(torch.nn.Linear(7, 3), torch.nn.BatchNorm1d(3)).cuda()
    module[0].bfloat16()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    arenas = park(module)
    tensors = [*module.parameters(), *module.buffers()]
    assert all(not t.is_cuda and t.is_pinned() for t in tensors)
    assert arenas.pinned_bytes >= sum(t.numel() * t.element_size() for t in tensors)
    module.cuda()
    arenas.release()
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k]) and after[k].is_cuda for k in before)


def forward_chunk(buffers: Buffers) -> torch.nn.Module:
    """A model chunk whose modules hold the buffer's parameters as DDP lays them out: the
    forward calls them in the reverse of their order in the buffer (a module per view, one
    holding two, registered in the order the forward calls them)."""
    chunk, views = torch.nn.Module(), buffers.views[::-1]
    groups = [views[:1], views[1:3], *([v] for v in views[3:])]
    for i, held in enumerate(groups):
        module = torch.nn.Module()
        for k, view in enumerate(held):
            module.register_parameter(f"w{k}", torch.nn.Parameter(view, requires_grad=False))
        chunk.add_module(f"m{i}", module)
    return chunk


def test_piece_spans_find_the_pieces_holding_each_parameter() -> None:
    """Against the pieces' and the parameters' element ranges, for each parameter and for all
    of them at once."""
    buffers = Buffers()
    eng = windowed(buffers, piece=700)
    drive(eng, buffers, 1)
    spans = host_adam.PieceSpans(eng._pieces)
    base = buffers.param.data_ptr() // buffers.param.element_size()

    def brute(view) -> set:
        lo = view.data_ptr() // view.element_size() - base
        return {
            i
            for i, q in enumerate(eng._pieces)
            if q.param.data_ptr() // 2 - base < lo + view.numel()
            and lo < q.param.data_ptr() // 2 - base + q.numel
        }

    for view in buffers.views:
        assert spans.holding([view]) == sorted(brute(view))
    assert spans.holding(buffers.views) == list(range(len(eng._pieces)))
    eng.close()


@pytest.mark.parametrize("rem", [False, True], ids=["fp32-masters", "remainders"])
def test_watched_passes_run_in_the_order_the_forward_needs_the_pieces(rem: bool) -> None:
    """Watching a chunk (the pass beside the next forward, ``watch``), the pieces pass in the
    order the chunk's modules, registered in forward order, first hold them, the reverse of
    the buffer's here, and the update is still torch's fused AdamW's."""
    buffers = Buffers()
    eng, ref = windowed(buffers, rem=rem), Reference(buffers)
    chunk = forward_chunk(buffers)
    eng.watch([chunk], None)  # no CUDA: no side stream, the order alone
    for step in range(1, 4):
        ref.step(step, drive(eng, buffers, step))
        assert_matches(fp32_masters(eng, buffers), ref.params, step)
    modules = [list(m.parameters(recurse=False)) for m in chunk.children()]
    spans = host_adam.PieceSpans(eng._pieces)
    first = [
        min(k for k, held in enumerate(modules) if i in spans.holding(held))
        for i in range(len(eng._pieces))
    ]
    assert first == sorted(first) and first[0] == 0 and first[-1] == len(modules) - 1
    starts = [p.start for p in eng._pieces]
    assert starts != sorted(starts)  # not the buffer's order
    assert len(eng._hooks) == len(modules)
    eng.close()
    assert not eng._hooks


class ThreadOnly:
    """A BesideForward without CUDA: its thread, no stream (the pass's order and pacing alone)."""

    stream = None

    def __init__(self) -> None:
        import concurrent.futures

        self.thread = concurrent.futures.ThreadPoolExecutor(1)

    def submit(self, fn, *args):
        return self.thread.submit(fn, *args)


@pytest.mark.parametrize("grown", [0, SLOTS + 2])
def test_a_paced_pass_on_its_thread_loads_each_piece_once_and_updates_bit_identically(
    grown: int,
) -> None:
    """Beside the forward the pass is issued by a thread of its own, each piece's copy in only
    once its slot's last piece has gone out (``_load_through``), pieces the last backward
    brought in among them: every piece comes in once, in pass order, each mark is set, and the
    update is torch's fused AdamW's."""
    buffers = Buffers()
    eng, ref = windowed(buffers, rem=True), Reference(buffers)
    beside = ThreadOnly()
    eng.watch([forward_chunk(buffers)], beside)
    window, loads = eng._window, []
    load_next = window._load_next
    window._load_next = lambda: (loads.append(window._pass.queued), load_next())[1]
    no_sync = host_adam.arming(contextlib.nullcontext, [eng])
    for step in range(1, STEPS + 1):
        loads.clear()
        if step > 1:
            with no_sync():
                pass
            window.grow(grown * window.slot_bytes)
            eng.prefetch()
        ref.step(step, drive(eng, buffers, step))
        eng.finish()
        assert loads == list(range(len(eng._pieces)))
        assert [m.event for m in eng._marks] == list(range(len(eng._pieces)))
        assert_matches(fp32_masters(eng, buffers), ref.params, step)
    eng.close()
    beside.thread.shutdown()


def test_the_forward_waits_for_the_pieces_it_needs_and_the_wait_is_timed() -> None:
    """Beside the forward, a watched module's forward pre-hook waits until the pass has issued
    the pieces holding its parameters, and ``BesideForward.waiting`` adds that wait to the step's
    (summary: states_forward_wait_s_median): a pass that starts 0.3 s late makes the first module
    wait that long, and the modules after it none."""
    buffers = Buffers()
    eng = windowed(buffers, rem=True)
    beside = ThreadOnly()
    beside.waits = [0.0]
    beside.waiting = functools.partial(BesideForward.waiting, beside)
    chunk = forward_chunk(buffers)
    eng.watch([chunk], beside)
    drive(eng, buffers, 1)
    eng.finish()
    beside.waits.append(0.0)  # the next step begins (BesideForward.zero_grad_buffers)
    beside.submit(time.sleep, 0.3)  # the thread is busy: the pass starts late
    drive(eng, buffers, 2)
    waited = []
    for module in chunk.children():
        began = time.perf_counter()
        for hook in module._forward_pre_hooks.values():
            hook(module, ())
        waited.append(time.perf_counter() - began)
    assert waited[0] >= 0.25 and max(waited[1:]) < 0.1
    assert beside.waits[-1] == pytest.approx(sum(waited), abs=0.02)
    eng.finish()
    assert eng._forward_wait_s(0) == beside.waits[-1]
    eng.close()
    beside.thread.shutdown()


def test_each_window_copy_is_followed_by_a_gap_kernel() -> None:
    """``_copy_all`` copies every pair and puts the one-element gap op (a sign flip) after each
    copy, where a copy engine yields to other streams: two copies leave the gap's sign as it
    was, three flip it."""
    from offload_runner.offload.window import _copy_all

    for count, sign in ((2, 1.0), (3, -1.0)):
        sources = [torch.arange(5, dtype=torch.float32) + i for i in range(count)]
        targets = [torch.zeros(5) for _ in sources]
        gap = torch.ones(1)
        _copy_all(list(zip(targets, sources, strict=True)), gap)
        assert all(torch.equal(t, s) for t, s in zip(targets, sources, strict=True))
        assert gap.item() == sign
