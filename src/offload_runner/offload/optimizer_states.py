"""Optimizer-state offload: Adam on the GPU, its fp32 masters and moments in host memory.

Not in any megatron-core release. ``WindowedStates`` is the inner optimizer of Megatron-Core's
precision-aware DistributedOptimizer (host_adam.HostAdam: layout, checkpoints), so the GPU never
holds the states and masters whole. They live in page-locked host arrays (10 B/param: each master
as the 16-bit remainder its bf16 parameter lacks, as Megatron-Core's precision-aware optimizer
keeps it, remainders.py; 12 with fp32 masters, optimizer.store_param_remainders=false) and the Adam
step streams them through a GPU window (512 MiB, or 4 pieces of
``optimizer_state_offload_chunk_size_mb``), ``SLOTS`` slots of one piece each:

1. the last micro-batch's backward brings in the first pieces (masters, exp_avg, exp_avg_sq: three
   copies, one per host array) on the side stream ``h2d``, each into a slot of its own taken from
   the memory the backward has freed (never above the step's peak so far, less two SLOTS-slot
   windows: ``StatesWindow.grow``, armed at ``no_sync``'s exit, looked at every 1/GROW_CHECKS of
   the parameters' gradients), which goes back to the allocator as soon as its piece is out; at
   its tail (Megatron-Core's gradient finalize, before the data-parallel reduction) the window's
   ``SLOTS`` slots come, which carry the other pieces in turn, each going once its last is out;
2. ``step()`` (after Megatron-Core's norm and clipping): on the compute stream, Adam on piece i as
   soon as it is in (Transformer Engine's multi-tensor Adam, the kernel of Megatron-Core's own GPU
   Adam, so the run is bit-identical to the baseline; its remainder variant, which updates the
   bf16 parameters and remainders in place, to the precision-aware baseline; torch's fused AdamW
   without TE), fp32 masters rounded into the bf16 parameters; the side stream ``d2h`` takes
   piece i out, and as soon as it has, ``h2d`` brings piece i + slots into the same slot: both
   directions run at once;
3. ``step()`` returns when the last Adam call is queued: the last pieces' copies out finish under
   the next forward (``finish()`` waits for them: checkpoints). Where no data-parallel all-gather
   reads the parameters after the step (``BesideForward``: one rank's whole shard), the whole pass
   runs there instead: its Adam calls on a side stream of their own, the pieces in the order the
   forward needs them, each module's forward pre-hook making the compute stream wait for the
   pieces holding its parameters. A thread of its own issues the pass as its pieces come in (a
   copy in once its slot is free, Adam and the copies out once it is in): copies issued ahead
   would sit in the copy engines' queues, and the compute stream's own copies (the loss's
   ``.item()``, the next batch) would wait behind all of them (616 ms: suite ``beside-probe``). The
   gradient buffers are zeroed behind the pass on that stream, and the first forward of a step
   ends waiting for it, before any backward writes a gradient.

The first step plans the pieces (the gradients' places in the DDP buffer are known then) and has
no prefetch. The SLOTS-slot window comes from the allocator's pool of the ``h2d`` stream each
step (so the backward never sees it allocated; beside the forward, the first micro-batch's
forward does); slots grown during the backward come from the compute stream's, where its
activations were. Pieces are cut as the CPU-Adam engine cuts them
(host_adam.HostAdam._plan): contiguous in the host arrays, the gradient buffer and the parameter
buffer, so each array of a piece moves with one copy.

Cost: 10 B/param each way (12 with fp32 masters), the two directions concurrently, at about
50 GB/s on PCIe Gen5 (0.63-0.66 s for the 3.11B-param proxy on one H100, 0.83-0.84 with fp32
masters: suites remainders-4/8); the peak is forward+backward's own plus the window.

Whole tensors, the first design (every state parked on the host between steps and all brought
back before Adam, copies out under the next forward and back under the tail of backward), was
measured beside the window in one suite and removed: it held every state again at the step (peak
52.45 GB where the window's is 23.49 GB on the proxy) and cost more at GBS 4 (2121 ms against
1514 ms) and at a 32k sequence (2035 ms against 1396 ms), where forward and backward are longest
(docs/BENCHMARKS.md, suites ``states`` and ``states-long``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import statistics
import threading
import time
from dataclasses import dataclass, field

from offload_runner.config.schema import (
    TORCH_DTYPES,
    RunConfig,
    states_offloaded,
    states_window_mb,
)
from offload_runner.hardware import ADAM_BYTES, WINDOW_SLOTS, host_state_bytes, keeps_remainders
from offload_runner.model_size import count_parameters
from offload_runner.offload import host_adam, remainders
from offload_runner.offload.base import OffloadSummary
from offload_runner.offload.host_adam import HostAdam, Piece, PieceSpans, torch_adamw

log = logging.getLogger("offload_runner")

BYTES_PER_PARAM = ADAM_BYTES  # fp32 master + exp_avg + exp_avg_sq
SLOTS = WINDOW_SLOTS  # pieces in the window: one in Adam, one going out, one or two coming in
HISTORY = 500  # steps kept for the metrics
GROW_CHECKS = 32  # times per backward the windows look for memory it has freed


DISABLED = {"optimizer.offload_optimizer_states": False}


def describe(run: RunConfig) -> OffloadSummary:
    o = run.optimizer
    if not states_offloaded(run):
        return OffloadSummary("optimizer states", "offload/optimizer=states", False, "-")
    share = o.optimizer_state_offload_fraction
    params = count_parameters(run.model).total * share
    per_param = host_state_bytes(run)
    return OffloadSummary(
        "optimizer states",
        "offload/optimizer=states",
        True,
        f"{share:.0%} of the fp32 masters"
        f"{' (their 16-bit remainders)' if keeps_remainders(run) else ''}"
        f" + {o.exp_avg_dtype.value} exp_avg + "
        f"{o.exp_avg_sq_dtype.value} exp_avg_sq ({per_param} B/param, ~"
        f"{params * per_param / 1e9:.1f} GB for the whole model before DP sharding) live on "
        "the host; Adam runs on the GPU",
        f"streamed through a {states_window_mb(run)} MiB GPU window during the step, both "
        "directions at once (beside the next forward where one rank holds its whole shard)",
    )


# --- windowed: the states stream through a small GPU window during the step --------------------


@dataclass
class _Pass:
    """One step's pass of some pieces' states through the window: its events and timing."""

    pieces: list[Piece]
    # the window's slots, each the arrays of one piece (2 to 4 x piece_numel fp32: the master
    # unless it travels as a remainder, the moments, a late pass's gradients; the bf16 ones the
    # moments stored in bf16 travel in, in ``low``; the int16 remainder, in ``rem``); piece i
    # passes through slot i % len(slots), the slots fixed once the Adam calls are issued
    slots: list = field(default_factory=list)
    low: list = field(default_factory=list)
    rem: list = field(default_factory=list)
    loaded: list = field(default_factory=list)  # per piece: event, its copy in has finished
    freed: list = field(default_factory=list)  # per slot: event, the copy out of its last piece
    # a step-late pass (StatesWindow.run_late): per piece, before its copy in, what it waits
    # for (its gradients on the host: a CUDA event or None); its gradients' scale (or None)
    before_load: object = None
    scale_of: object = None
    began: object = None  # event on the compute stream when the Adam calls start
    ended: object = None  # event after the last copy out
    queued: int = 0  # pieces whose copy in is queued
    grown: int = 0  # slots added during the last micro-batch's backward (``grow``)
    growing: bool = False  # ``grow`` may add slots (armed, until the pass is issued)


class StatesWindow:
    """Adam on the GPU for pieces whose fp32 masters and moments live in page-locked host arrays:
    each step's pass brings them through a window of SLOTS slots of ``piece_numel`` params, on
    two side streams (module doc, steps 1-3). ``WindowedStates`` passes its whole shard through
    one; the CPU-Adam engine passes its GPU share (``cpu_adam.CpuAdam``, exact mode)."""

    def __init__(self, host: tuple, device, piece_numel: int, adam=None, host_grad=None) -> None:
        import torch

        self.host = host  # (masters, exp_avg, exp_avg_sq), flat host arrays; the masters
        # as int16 remainders of the bf16 parameters (remainders.py) or fp32
        # the gradients on the host (CPU-Adam's delayed mode): a step-late pass streams them up
        # too, in a fourth array per slot
        self.host_grad = host_grad
        self.device = device
        self.piece_numel = piece_numel
        on_cuda = device.type == "cuda"
        # h2d, d2h; high priority: their only kernels are the gaps between copies (_copy_all)
        self.streams = (
            (torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=-1)) if on_cuda else None
        )
        self._gaps = [torch.zeros(1, device=device) for _ in range(2)] if on_cuda else None
        self._adam = adam  # Transformer Engine's multi-tensor Adam (_te_adam), else torch's
        self._remainders = host[0].dtype == torch.int16
        # the moments kept in bf16 on the host: they travel at 2 B and are upcast for Adam
        self._low = [i for i, array in enumerate(host) if i and array.dtype != torch.float32]
        self._low_dtype = host[self._low[0]].dtype if self._low else None
        self._pass: _Pass | None = None  # the current step's pass (from the prefetch on)
        self._timed: list[_Pass] = []  # the passes whose events are not read yet
        self._job = None  # a paced pass being issued by a BesideForward's thread (run)
        self.history: list[tuple[float, int]] = []  # per pass: seconds (Adam to last copy out),
        # params
        self.grown: list[int] = []  # per pass: params that came in during the last backward

    @property
    def nbytes(self) -> int:
        """The window a pass always holds: SLOTS slots (fewer where it passes fewer pieces)."""
        return SLOTS * self.slot_bytes

    @property
    def slot_bytes(self) -> int:
        return (self._arrays * 4 + len(self._low) * 2 + self._remainders * 2) * self.piece_numel

    @property
    def _arrays(self) -> int:
        """fp32 arrays per slot: the master (unless a remainder), exp_avg, exp_avg_sq (and the
        gradient for late passes)."""
        return BYTES_PER_PARAM // 4 - self._remainders + (self.host_grad is not None)

    @property
    def prefetched(self) -> bool:
        """This step's pass has begun (armed, or its first pieces are coming in)."""
        return self._pass is not None

    def begin(self, pieces: list[Piece], growing: bool = False) -> None:
        """Start the pass of ``pieces``, no slot yet (``growing``: ``grow`` may add them)."""
        self._issued()
        if self._pass is not None or not pieces:
            return
        self._collect_timing(wait=False)
        if self.streams is not None:
            self.streams[0].wait_stream(self.streams[1])  # the last copies out wrote the host
        self._pass = _Pass(pieces, loaded=[None] * len(pieces), growing=growing)

    def grow(self, budget: int | None = None) -> int:
        """During the last micro-batch's backward (the pass armed by ``begin(growing=True)``):
        slots for the next pieces, each loaded at once, in the memory the backward has freed:
        ``budget`` bytes, by default ``_freed_bytes`` (room left for the rest of the backward
        and the step's own allocations), so the peak does not grow. The slots come from the current
        stream's pool (the activations just freed) and their copies in wait for what is queued
        there. Returns the slots added."""
        import torch

        p = self._pass
        if p is None or not p.growing:
            return 0
        if budget is None:
            budget = self._freed_bytes()
        added = 0
        while p.queued < len(p.pieces) and budget >= self.slot_bytes * (added + 1):
            try:
                self._add_slot(on_h2d=False)
            except torch.cuda.OutOfMemoryError:  # the pool's free blocks are too small: stop here
                p.growing = False
                break
            p.grown += 1
            self._load_next()
            added += 1
        return added

    def _freed_bytes(self) -> int:
        """This step's peak so far less what is allocated, less two SLOTS-slot windows (what
        the rest of the backward and the step allocate beyond what the check sees: one window
        left the proxy's peak 0.28 GB higher, suite grow-4-ab); none without CUDA; no more than
        the allocator holds free plus what the device has left, so it need not give back its
        cache (a device-wide synchronisation) to find it."""
        import torch

        if self.streams is None:
            return 0
        stats = torch.cuda.memory_stats(self.device)
        allocated = stats["allocated_bytes.all.current"]
        free_on_device, _ = torch.cuda.mem_get_info(self.device)
        room = min(
            stats["allocated_bytes.all.peak"], stats["reserved_bytes.all.current"] + free_on_device
        )
        return room - allocated - 2 * self.nbytes

    def prefetch(self, pieces: list[Piece], late: bool = False) -> None:
        """Start the pass of ``pieces`` (unless armed), the window's SLOTS slots beside those
        the backward grew, their pieces coming in (at the tail of backward; ``run`` does it if
        nothing did; a late pass brings them in itself)."""
        self.begin(pieces)
        p = self._pass
        if p is None:
            return
        if p.growing:  # the tail of the armed backward: whatever else it freed
            self.grow()
            p.growing = False
        while len(p.slots) - p.grown < min(SLOTS, len(pieces) - p.grown):
            self._add_slot(on_h2d=True)  # from (and back to) h2d's pool: never the backward's
            if not late:
                self._load_next()

    def _add_slot(self, on_h2d: bool) -> None:
        """One more slot at the end of the window (on the current stream's pool, its copies in
        after what is queued there, unless ``on_h2d``)."""
        import torch

        shape, streams = (self._arrays, self.piece_numel), self.streams
        with torch.cuda.stream(streams[0]) if streams and on_h2d else contextlib.nullcontext():
            slot = torch.empty(shape, dtype=torch.float32, device=self.device)
            low = (
                torch.empty((len(self._low), shape[1]), dtype=self._low_dtype, device=self.device)
                if self._low
                else None
            )
            rem = (
                torch.empty(shape[1], dtype=torch.int16, device=self.device)
                if self._remainders
                else None
            )
        if streams is not None and not on_h2d:
            streams[0].wait_stream(torch.cuda.current_stream())  # the memory's last readers
        self._pass.slots.append(slot)
        self._pass.low.append(low)
        self._pass.rem.append(rem)
        self._pass.freed.append(None)

    def run(self, pieces: list[Piece], step: int, hypers: list[dict], beside=None) -> list:
        """The pass of ``pieces``: Adam on each as soon as it is in, its masters rounded into
        its bf16 parameters, then out on ``d2h``. On the current stream, returning once queued;
        or, with ``beside`` (a ``BesideForward``), on its stream, behind what the current one
        has queued (the clipped gradients), issued by its thread as the pieces come in (paced),
        returning at once a ``_Mark`` per piece: the event after its Adam call, once issued."""
        import torch

        self.prefetch(pieces)
        if self._pass is None:
            return []
        assert self._pass.pieces is pieces, "prefetched another set of pieces"
        if beside is None:
            self._issue(step, hypers)
            return []
        if self.streams is not None:
            beside.stream.wait_stream(torch.cuda.current_stream())
        marks = [_Mark() for _ in pieces]
        self._job = beside.submit(self._paced, step, hypers, marks, beside.stream)
        return marks

    def _paced(self, step: int, hypers: list[dict], marks: list, stream) -> None:
        """``_issue_paced`` on ``stream``, on the thread of a ``BesideForward`` (every mark set
        at the end, so no forward waits for one a failure left unissued)."""
        import torch

        try:
            with torch.cuda.stream(stream), torch.profiler.record_function("states: pass"):
                self._issue_paced(step, hypers, marks)
        finally:
            for mark in marks:
                mark.ready.set()

    def run_late(
        self, pieces: list[Piece], step: int, hypers: list[dict], stream, before_load, scale_of
    ) -> list:
        """A step-late pass (CPU-Adam's delayed mode) of ``pieces`` on ``stream`` (a side
        stream beside the next forward+backward; None without CUDA): their gradients come up
        from ``host_grad`` with the states, each piece's once ``before_load(index)`` returned
        (the CUDA event its gradients' copy down recorded, or None), scaled by
        ``scale_of(index)`` (a GPU tensor, or None); the bf16 parameters are left alone (they
        land later). Returns, per piece, the event after its copy out (None without CUDA)."""
        import torch

        assert self.host_grad is not None and self._adam is None and self._pass is None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self.prefetch(pieces, late=True)
            if self._pass is None:
                return []
            self._pass.before_load, self._pass.scale_of = before_load, scale_of
            for _ in range(len(self._pass.slots) - self._pass.grown):
                self._load_next()
            freed = self._issue(step, hypers)
        return freed

    def _issue(self, step: int, hypers: list[dict]) -> list:
        """The pass's Adam calls on the current stream, each as soon as its piece is in, and its
        copies out behind them, all queued at once; returns, per piece, the event after its copy
        out."""
        steps, compute = self._begin_issue(step)
        pieces, out = self._pass.pieces, []
        for index in range(len(pieces)):
            if compute is not None:
                compute.wait_event(self._pass.loaded[index])
            out.append(self._through(index, step, steps, hypers)[1])
            if not self._last_in_slot(index) and self._pass.queued < len(pieces):
                self._load_next()
        self._end_pass()
        return out

    def _issue_paced(self, step: int, hypers: list[dict], marks: list) -> None:
        """``_issue`` paced (``run`` beside the forward): each Adam call and copy is issued only
        once the copies it follows are done, so the copy engines never hold a long queue of
        them, and each piece's mark gets the event after its Adam call, then is set."""
        steps, compute = self._begin_issue(step)
        for index, mark in enumerate(marks):
            self._load_through(index)
            if compute is not None:
                self._pass.loaded[index].synchronize()
                compute.wait_event(self._pass.loaded[index])
            adam, _ = self._through(index, step, steps, hypers, mark_on=compute)
            mark.event = adam if compute is not None else index
            mark.ready.set()  # after the release: the forward that follows allocates
        self._end_pass()

    def _begin_issue(self, step: int) -> tuple:
        """(the step count as a tensor for torch's fused AdamW, once per step, or None with TE's
        Adam; the compute stream, None without CUDA), the pass's start recorded on it."""
        import torch

        steps = None if self._adam else torch.tensor(float(step), device=self.device)
        compute = torch.cuda.current_stream() if self.streams else None
        if compute is not None:
            self._pass.began = _record(compute)
        return steps, compute

    def _through(self, index: int, step: int, steps, hypers: list[dict], mark_on=None) -> tuple:
        """Piece ``index`` through the window once in: its Adam call, its copy out, its slot
        released if it is the slot's last. Returns (the event after the Adam call, recorded on
        stream ``mark_on``, or None; the event after the copy out)."""
        self._update(self._pass.pieces[index], self._slot(index), step, steps, hypers, index)
        adam = _record(mark_on) if mark_on is not None else None
        out = self._unload(index)
        if self._last_in_slot(index):
            self._release(self._at(index))
        return adam, out

    def _at(self, index: int) -> int:
        """The slot of the pass's piece ``index``: a slot the backward grew carries its one piece,
        the window's SLOTS carry the rest in turn (each slot goes once its last piece is out:
        ``_release``)."""
        p = self._pass
        if index < p.grown:
            return index
        return p.grown + (index - p.grown) % (len(p.slots) - p.grown)

    def _last_in_slot(self, index: int) -> bool:
        """Piece ``index`` is the last its slot carries (a grown slot's one, or one of the
        window's last SLOTS)."""
        p = self._pass
        return index < p.grown or index + len(p.slots) - p.grown >= len(p.pieces)

    def _release(self, at: int) -> None:
        """Slot ``at`` goes back to the allocator once the streams that use it are past it."""
        import torch

        p = self._pass
        arrays = [t for t in (p.slots[at], p.low[at], p.rem[at]) if t is not None]
        if self.streams is not None:
            for stream in {torch.cuda.current_stream(), *self.streams}:
                for array in arrays:
                    array.record_stream(stream)
        p.slots[at] = p.low[at] = p.rem[at] = None

    def _load_through(self, index: int) -> None:
        """A paced pass, before piece ``index``'s Adam call: its copy in issued (after the copy
        out of its slot's last piece, waited for here), and the next pieces' whose slots are
        free already."""
        p = self._pass
        while p.queued < len(p.pieces) and p.queued < index + len(p.slots) - p.grown:
            freed = p.freed[self._at(p.queued)]
            if p.queued > index and freed is not None and not freed.query():
                return
            if freed is not None:
                freed.synchronize()
            self._load_next()

    def _slot(self, index: int) -> tuple:
        """The window's fp32 (master, exp_avg, exp_avg_sq) arrays for the pass's piece ``index``
        (no master where it travels as a remainder)."""
        n = self._pass.pieces[index].numel
        rows = self._pass.slots[self._at(index)][:, :n]
        return (None, rows[0], rows[1]) if self._remainders else (rows[0], rows[1], rows[2])

    def _staged(self, index: int) -> tuple:
        """What travels for piece ``index``: its fp32 slot arrays, the remainder of its masters
        where they travel so, a bf16 array for each moment stored in bf16."""
        n, at = self._pass.pieces[index].numel, self._at(index)
        arrays = list(self._slot(index))
        if self._remainders:
            arrays[0] = self._pass.rem[at][:n]
        for k, i in enumerate(self._low):
            arrays[i] = self._pass.low[at][k, :n]
        return tuple(arrays)

    def _slot_grad(self, index: int):
        """A late pass's gradient array in the slot of its piece ``index``."""
        n = self._pass.pieces[index].numel
        return self._pass.slots[self._at(index)][self._arrays - 1, :n]

    def _on_host(self, piece: Piece) -> tuple:
        return tuple(array[piece.start : piece.stop] for array in self.host)

    def _load_next(self) -> None:
        """The next piece's masters and moments into its slot (on ``h2d``, after the slot's
        last piece has gone out)."""
        import torch

        index = self._pass.queued
        self._pass.queued += 1
        piece = self._pass.pieces[index]
        pairs = list(zip(self._staged(index), self._on_host(piece), strict=True))
        grads_down = None
        if self._pass.before_load is not None:  # a late pass: the gradients come up too
            grads_down = self._pass.before_load(index)
            pairs.append((self._slot_grad(index), self.host_grad[piece.start : piece.stop]))
        if self.streams is None:
            for gpu, host in pairs:
                gpu.copy_(host)
            return
        h2d = self.streams[0]
        freed = self._pass.freed[self._at(index)]
        if freed is not None:
            h2d.wait_event(freed)
        if grads_down is not None:
            h2d.wait_event(grads_down)
        with torch.cuda.stream(h2d):
            _copy_all(pairs, self._gaps[0])
        self._pass.loaded[index] = _record(h2d)

    def _unload(self, index: int):
        """The pass's piece ``index``: updated masters and moments back to the host (on ``d2h``,
        after its Adam call on the compute stream); returns the event after it (None without
        CUDA)."""
        import torch

        piece = self._pass.pieces[index]
        pairs = zip(self._on_host(piece), self._staged(index), strict=True)
        if self.streams is None:
            for host, gpu in pairs:
                host.copy_(gpu)
            return None
        d2h = self.streams[1]
        d2h.wait_stream(torch.cuda.current_stream())
        if piece.landed is not None:  # the last landing has read the host masters
            d2h.wait_event(piece.landed)
        with torch.cuda.stream(d2h):
            _copy_all(pairs, self._gaps[1])
        freed = self._pass.freed[self._at(index)] = _record(d2h)
        return freed

    def _update(
        self, piece: Piece, slot: tuple, step: int, steps, hypers: list[dict], index: int
    ) -> None:
        """Adam on one piece in the window; its masters rounded into the bf16 parameters (a late
        pass: its gradients from the window, scaled, and the parameters left alone)."""
        master, exp_avg, exp_avg_sq = slot
        staged = self._staged(index)
        for i in self._low:  # moments stored in bf16: fp32 for the math
            slot[i].copy_(staged[i])
        late = self._pass.before_load is not None
        grads = self._slot_grad(index) if late else None
        scale = self._pass.scale_of(index) if late else None
        for a, b, gi in piece.groups:
            h, span = hypers[gi], slice(a - piece.start, b - piece.start)
            grad = (grads[span] if late else piece.grad[span]).float()  # a bf16 buffer's: fp32
            moments = [exp_avg[span]], [exp_avg_sq[span]]
            if self._remainders:  # the master is its bf16 parameter and remainder (updated)
                _remainder_adam(
                    self._adam, steps, step, h, grad, piece.param[span], staged[0][span], moments
                )
            elif self._adam is not None:
                self._adam([[grad], [master[span]], *moments], step, h)
            else:
                torch_adamw(steps, h, scale)([master[span]], [grad], *moments)
        for i in self._low:  # ... rounded back to nearest even, as TE's FusedAdam rounds them
            staged[i].copy_(slot[i])
        if not (late or self._remainders):
            piece.param.copy_(master)

    def _end_pass(self) -> None:
        done, self._pass = self._pass, None
        self.grown.append(sum(p.numel for p in done.pieces[: done.grown]))
        if len(self.grown) > 2 * HISTORY:
            del self.grown[2:-HISTORY]
        if self.streams is None:
            return
        done.ended = _record(self.streams[1])
        self._timed.append(done)

    def _collect_timing(self, wait: bool = True) -> None:
        """The timing of the passes that have ended (``wait``: of all, waiting for them)."""
        while self._timed and (wait or self._timed[0].ended.query()):
            done = self._timed.pop(0)
            done.ended.synchronize()
            seconds = done.began.elapsed_time(done.ended) / 1000
            self.history.append((seconds, sum(p.numel for p in done.pieces)))
            if len(self.history) > 2 * HISTORY:
                del self.history[2:-HISTORY]

    def _issued(self) -> None:
        """A paced pass is all issued (its thread's errors raise here)."""
        import torch

        job, self._job = self._job, None
        if job is not None:
            with torch.profiler.record_function("states: waits until the pass is issued"):
                job.result()

    def finish(self) -> None:
        """The copies out have finished: the host arrays hold the newest states."""
        self._issued()
        if self.streams is not None:
            self.streams[1].synchronize()

    def timing(self) -> list[tuple[float, int]]:
        """(seconds, params) of every pass so far (the last one waited for)."""
        self.finish()
        self._collect_timing()
        return self.history


class WindowedStates(HostAdam):
    """Adam on the GPU for one DistributedOptimizer's shard whose masters and moments live in
    page-locked host arrays and pass through a GPU window of ``window_bytes`` (module doc)."""

    def __init__(
        self,
        params,
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        window_bytes: int = 512 * 1024**2,
        order_key=None,
        fraction: float = 1.0,
        moment_dtypes: tuple = (),
        remainders: bool = False,
        beside_forward: bool = False,
    ) -> None:
        import torch

        # a piece of n params takes 12 n bytes of the window (fp32 master and moments; 10 with
        # the master as a remainder), 2 n more per moment stored in bf16 (it travels as such):
        # chunk_bytes counts 4 B per param
        per_param = 12 - 2 * remainders + 2 * sum(d != torch.float32 for d in moment_dtypes)
        super().__init__(
            params,
            fraction=fraction,
            lr=lr,
            weight_decay=weight_decay,
            betas=betas,
            eps=eps,
            chunk_bytes=window_bytes * 4 // (SLOTS * per_param),
            order_key=order_key,
            moment_dtypes=moment_dtypes,
        )
        self._allocate_states(
            pin_moments=True, what="offload/optimizer=states", remainders=remainders
        )
        self._window = StatesWindow(
            (self.host_master, self.host_exp_avg, self.host_exp_avg_sq),
            self.device,
            min(self.chunk_numel, self.offloaded_numel),
            _te_adam(self.device, remainders) if self.on_cuda else None,
        )
        # beside the next forward (``watch``): the side stream of the passes, the modules that
        # hold parameters (in the order the forward calls them), their forward pre-hooks
        self.beside_forward = beside_forward  # nothing reads the parameters before the forward
        self._beside = None
        self._held: list[list] = []  # each watched module's parameters, in forward order
        self._hooks: list = []
        self._marks: list = []  # the pass in flight: per piece, the event after its Adam call
        self._waited = 0  # ... pieces the forward has waited for
        self._overlaps: list[tuple] = []  # per pass: (the forward's first wait, its last mark)

    @property
    def window_bytes(self) -> int:
        return self._window.nbytes

    @property
    def streams_states(self) -> bool:
        return True

    def arm(self) -> None:
        """The last micro-batch follows: its backward may bring in pieces (``grow``)."""
        if self._pieces is not None:
            self._window.begin(self._pieces, growing=True)

    def grow(self) -> None:
        """During the armed backward: pieces into the memory it has freed (StatesWindow.grow)."""
        self._window.grow()

    def prefetch(self) -> None:
        """Start bringing in the first pieces (at the tail of backward; ``step()`` does it if
        nothing did, e.g. at the first step, whose gradients' places are known only then)."""
        if self._pieces is not None:
            self._window.prefetch(self._pieces)

    def step(self, closure=None):
        step, hypers = self._next_step()
        if self._pieces is None and self.offloaded:
            self._pieces = self._in_forward_order(self._plan())
        if self._pieces:
            self._marks = self._window.run(self._pieces, step, hypers, self._beside)
            self._waited = 0
        self._gpu_step(step, hypers)
        self._end_step(step)
        return None

    # -- beside the next forward -------------------------------------------------------------
    def watch(self, chunks, beside: BesideForward | None) -> None:
        """Run each pass beside the next forward (on ``beside``'s stream and thread), in the
        order the forward needs the pieces: a forward pre-hook on each module of ``chunks`` (the
        model chunks) that holds parameters makes the compute stream wait for the pieces holding
        them (``beside`` waits for the rest before the backward). Only where nothing reads the
        parameters between the step and the forward (no data-parallel parameter all-gather)."""
        self._beside = beside
        for params, hook in host_adam.before_each_forward(chunks, self._before_forward):
            self._held.append(params)
            self._hooks.append(hook)

    def _in_forward_order(self, pieces: list[Piece]) -> list[Piece]:
        """``pieces`` in the order the watched modules need them (unchanged if none)."""
        if not self._held:
            return pieces
        spans, first = PieceSpans(pieces), {}
        for position, params in enumerate(self._held):
            for i in spans.holding(params):
                first.setdefault(i, position)
        order = sorted(range(len(pieces)), key=lambda i: (first.get(i, len(self._held)), i))
        return [pieces[i] for i in order]

    def _before_forward(self, params: list, module, args) -> None:
        """A watched module's forward pre-hook: while a pass runs beside the forward, the host
        waits until the last piece holding ``params`` is issued, the compute stream until it
        is updated (a failed pass raises its error here)."""
        import torch

        marks = self._marks
        if not marks:
            return
        index = self._last_piece_needed(module, params)
        if index < self._waited:
            return
        stream = torch.cuda.current_stream() if self.on_cuda else None
        if self._waited == 0 and stream is not None:  # how far the pass runs into the forward
            self._overlaps.append((_record(stream), marks[-1]))
            del self._overlaps[:-HISTORY]
        if not marks[index].ready.is_set():
            with self._beside.waiting("states: the forward waits for its pieces"):
                marks[index].ready.wait()
        if marks[index].event is None:  # the pass failed before this piece: its error
            self._window.finish()
        if stream is not None:
            stream.wait_event(marks[index].event)  # it follows every mark before it
        self._waited = index + 1
        if self._waited == len(marks):
            self._marks = []

    # -- around the step ---------------------------------------------------------------------
    def finish(self) -> None:
        """The copies out have finished: the host arrays hold the newest states (and the compute
        stream waits for the bf16 parameters a pass beside the forward updates)."""
        self._window.finish()
        if self._beside is not None and self.on_cuda:
            import torch

            torch.cuda.current_stream().wait_stream(self._beside.stream)
            self._marks = []

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        super().close()

    def _beside_forward_s(self, skip: int) -> float | None:
        """How far the pass ran into the next forward (median; from its first wait)."""
        runs = []
        for began, last in self._overlaps[skip:] or self._overlaps:
            if last.event is not None:
                last.event.synchronize()
                began.synchronize()
                runs.append(max(0.0, began.elapsed_time(last.event) / 1000))
        return statistics.median(runs) if runs else None

    def _forward_wait_s(self, skip: int) -> float | None:
        """How long the forward's thread waited for the passes a step (median; None where they
        run within the step), from the second step on (the first has no pass to wait for)."""
        if self._beside is None:
            return None
        waits = self._beside.waits[1:]
        return statistics.median(waits[skip:] or waits) if waits else None

    def metrics(self, skip: int = 2) -> dict:
        history = self._window.timing()
        steady = history[skip:] or history
        if not steady:
            return {}
        seconds = statistics.median(s for s, _ in steady)
        moved = self.state_bytes_per_param * self.offloaded_numel
        grown = self._window.grown[skip:] or self._window.grown
        return {
            "states_offloaded_params": self.offloaded_numel,
            "states_moved_gb": moved / 1e9,
            "states_master_bytes": self.host_master.element_size(),
            "states_in_backward_gb": statistics.median(grown) * self.state_bytes_per_param / 1e9,
            "states_stream_s_median": seconds,
            "states_beside_forward_s": self._beside_forward_s(skip),
            "states_forward_wait_s_median": self._forward_wait_s(skip),
            "states_link_gb_per_s": moved / seconds / 1e9 if seconds else None,
            "states_window_gb": self.window_bytes / 1024**3,
        }


def _copy_all(pairs, gap) -> None:
    """Each (destination, source) of ``pairs`` copied on the current stream, a one-element
    kernel on ``gap`` after each. A copy engine runs one stream's ready copies back to back, so
    without a kernel between them the training stream's copies in the same direction (a batch
    up, a layer's tokens per expert down) wait for all of them; at each kernel the engine yields
    and those slip in (bench/copy_queue_probe.py measures both; torchrec's copy-engine studies
    found the same)."""
    for dst, src in pairs:
        dst.copy_(src, non_blocking=True)
        gap.neg_()


@dataclass
class _Mark:
    """A paced pass's piece: ``event`` follows its Adam call (without CUDA: the piece's index),
    set once issued (``ready``; left None where the pass failed before it)."""

    ready: threading.Event = field(default_factory=threading.Event)
    event: object = None


def _record(stream):
    import torch

    event = torch.cuda.Event(enable_timing=True, blocking=True)
    event.record(stream)
    return event


def _te_adam(device, remainders: bool = False):
    """Transformer Engine's multi-tensor Adam (AdamW mode, bias correction), as its FusedAdam
    calls it: on fp32 masters ``[grads, masters, exp_avgs, exp_avg_sqs]``, or with
    ``remainders`` on ``[grads, bf16 params, exp_avgs, exp_avg_sqs, int16 remainders]``: the
    kernels Megatron-Core's GPU Adam runs (the second on its precision-aware path), so the
    windowed step gives their numbers bit for bit. None without TE (torch's fused AdamW then)."""
    try:
        import torch
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.optimizers.multi_tensor_apply import multi_tensor_applier
    except ImportError:
        return None
    kernel = getattr(
        tex, "multi_tensor_adam_param_remainder" if remainders else "multi_tensor_adam", None
    )
    if kernel is None:  # a TE before 2.1: no remainder kernel
        return None
    noop = torch.zeros(1, dtype=torch.int, device=device)

    def adam(lists: list, step: int, h: dict) -> None:
        multi_tensor_applier(
            kernel,
            noop,
            lists,
            h["lr"],
            h["beta1"],
            h["beta2"],
            h["eps"],
            step,
            1,
            1,
            h["weight_decay"],
        )

    return adam


def _remainder_adam(
    adam, steps, step: int, h: dict, grad, param, remainder, moments: tuple
) -> None:
    """Adam on masters held as bf16 ``param`` + int16 ``remainder``, both updated in place:
    Transformer Engine's remainder kernel (``adam``), else torch's fused AdamW on the rebuilt
    fp32 masters, split again as that kernel splits them (remainders.py)."""
    if adam is not None:
        adam([[grad], [param], *moments, [remainder]], step, h)
        return
    master = remainders.rebuild(param, remainder)
    torch_adamw(steps, h)([master], [grad], *moments)
    remainders.split(master, param, remainder)


def moment_dtypes(run: RunConfig) -> tuple:
    """exp_avg's and exp_avg_sq's torch dtypes (optimizer.exp_avg_dtype, exp_avg_sq_dtype)."""
    import torch

    o = run.optimizer
    return tuple(
        getattr(torch, TORCH_DTYPES[d.value]) for d in (o.exp_avg_dtype, o.exp_avg_sq_dtype)
    )


def windowed_engines(optimizer) -> list[WindowedStates]:
    return host_adam.engines(optimizer, WindowedStates)


def metrics(optimizer) -> dict:
    """summary.json fields of the windowed engines of a rank: params, the pass's time and the
    link rate it reached (10 B/param each way, 12 with fp32 masters, 4 less with bf16 moments),
    how far it ran into the next forward and how long that forward's thread waited for it, the
    window, the master's bytes on the host, host memory."""
    built = windowed_engines(optimizer)
    found = [m for m in (e.metrics() for e in built) if m]
    if not found:
        return {}
    seconds = sum(m["states_stream_s_median"] for m in found)
    params = sum(m["states_offloaded_params"] for m in found)
    beside, waits = (
        [m[k] for m in found if m[k] is not None]
        for k in ("states_beside_forward_s", "states_forward_wait_s_median")
    )
    return {
        "states_offloaded_params": params,
        "states_stream_s_median": seconds,
        "states_link_gb_per_s": sum(m["states_moved_gb"] for m in found) / seconds
        if seconds
        else None,
        "states_window_gb": max(m["states_window_gb"] for m in found),
        "states_beside_forward_s": max(beside, default=None),
        "states_forward_wait_s_median": max(waits, default=None),
        "states_master_bytes": max(m["states_master_bytes"] for m in found),
        "states_in_backward_gb": sum(m["states_in_backward_gb"] for m in found),
        "states_host_gb": sum(e.host_bytes for e in built) / 1024**3,
    }


def _prefetching(engines: list[HostAdam], finalize):
    """Megatron-Core's finalize_model_grads, the first window's copies in started before it."""

    def finalize_and_prefetch(*args, **kwargs):
        for engine in engines:
            engine.prefetch()
        return finalize(*args, **kwargs)

    return finalize_and_prefetch


# --- wiring ---------------------------------------------------------------------------------------


def install(run: RunConfig, optimizer) -> list[WindowedStates]:
    """Make a WindowedStates the inner optimizer of every DistributedOptimizer of ``optimizer``
    (built on Megatron-Core's precision-aware path: no fp32 masters on the GPU)."""
    o = run.optimizer
    built = host_adam.install(
        optimizer,
        lambda part, _: WindowedStates(
            part.optimizer.param_groups,
            lr=o.lr,
            weight_decay=o.weight_decay,
            betas=(o.adam_beta1, o.adam_beta2),
            eps=o.adam_eps,
            window_bytes=states_window_mb(run) * 1024**2,
            fraction=o.optimizer_state_offload_fraction,
            moment_dtypes=moment_dtypes(run),
            remainders=keeps_remainders(run),
            beside_forward=not host_adam.gathers_params(part),
        ),
    )
    numel = sum(e.offloaded_numel for e in built)
    shard = sum(e.shard_numel for e in built)
    log.info(
        "optimizer states: %.3fB of %.3fB params of this rank's shard on the host (%.1f GB "
        "page-locked, masters %s, moments in %s), streamed through a %.0f MiB GPU window; "
        "the rest stays on the GPU",
        numel / 1e9,
        shard / 1e9,
        sum(e.host_bytes for e in built) / 1e9,
        "as remainders of the bf16 params" if keeps_remainders(run) else "in fp32",
        run.optimizer.exp_avg_dtype.value,
        max((e.window_bytes for e in built), default=0) / 1024**2,
    )
    return built


def attach(optimizer, transformer_config, chunks) -> Attached:
    """Wire the engines that stream states through a window (this module's, and the CPU-Adam
    engine's GPU share) into the backward of the model ``chunks``, where the last micro-batch's
    lets them grow into the memory it frees (every 1/GROW_CHECKS of its parameters'
    gradients), and into Megatron-Core's gradient finalize hook, where they prefetch their
    first pieces; this module's engines whose parameters no data-parallel all-gather reads
    after the step run their passes beside the next forward (``BesideForward``)."""
    engines = [e for e in host_adam.engines(optimizer) if e.streams_states]
    if not engines:
        return Attached([], None)
    transformer_config.finalize_model_grads_func = _prefetching(
        engines, transformer_config.finalize_model_grads_func
    )
    params = sum(p.requires_grad for chunk in chunks for p in chunk.parameters())
    hooks = host_adam.after_each_grad(chunks, _Growth(engines, params))
    windowed = windowed_engines(optimizer)
    beside = [e for e in windowed if e.beside_forward and e.on_cuda]
    if beside:
        log.info(
            "optimizer states: %d of %d shard(s) are this rank's alone: their pass runs "
            "beside the next forward, which waits module by module for the pieces it "
            "needs",
            len(beside),
            len(windowed),
        )
    return Attached(hooks, BesideForward(beside, chunks) if beside else None)


@dataclass
class Attached:
    """What ``attach`` wired: the backward hooks' (node, handle) pairs, the passes beside the
    forward (or None)."""

    hooks: list
    beside: BesideForward | None

    def remove(self) -> None:
        for _, hook in self.hooks:
            hook.remove()
        self.hooks = []
        if self.beside is not None:
            self.beside.remove()


class BesideForward:
    """The windowed engines' passes beside the next forward (each engine's ``watch``), on one
    side stream, issued by one thread of their own as their pieces come in (so the copy engines
    hold no queue of them: ``StatesWindow._issue_paced``); the gradient buffers are zeroed on that
    stream behind them by that thread, and each step's first forward of a chunk ends waiting for
    it, so no backward writes a gradient (or reads a parameter) before the passes are through."""

    def __init__(self, engines: list[WindowedStates], chunks) -> None:
        import torch

        self.stream = torch.cuda.Stream()
        self.chunks = chunks
        self._thread = concurrent.futures.ThreadPoolExecutor(
            1,
            thread_name_prefix="states-pass",
            initializer=torch.cuda.set_device,
            initargs=(torch.cuda.current_device(),),
        )
        self._zeroed: concurrent.futures.Future | None = None
        self.waits: list[float] = []  # per step: seconds the forward's thread waited for passes
        for engine in engines:
            engine.watch(chunks, self)
        self._hooks = [chunk.register_forward_hook(self._after_forward) for chunk in chunks]

    def submit(self, fn, *args) -> concurrent.futures.Future:
        return self._thread.submit(fn, *args)

    def zero_grad_buffers(self) -> None:
        """Megatron-Core DDP's ``zero_grad_buffer`` of every chunk, behind the passes (on the
        thread, after the compute stream's own readers of the gradients so far)."""
        import torch

        self.waits.append(0.0)
        if len(self.waits) > 2 * HISTORY:
            del self.waits[1:-HISTORY]
        self._zeroed = self.submit(self._zero, _record(torch.cuda.current_stream()))

    @contextlib.contextmanager
    def waiting(self, what: str):
        """The forward's thread waits for the passes here: timed (``waits``) and named in
        profiles."""
        import torch

        began = time.perf_counter()
        with torch.profiler.record_function(what):
            yield
        if self.waits:
            self.waits[-1] += time.perf_counter() - began

    def _zero(self, after) -> None:
        import torch

        self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            for chunk in self.chunks:
                chunk.zero_grad_buffer()

    def _after_forward(self, module, args, output) -> None:
        import torch

        zeroed, self._zeroed = self._zeroed, None
        if zeroed is not None:
            with self.waiting("states: the forward waits for the pass"):
                zeroed.result()
            torch.cuda.current_stream().wait_stream(self.stream)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._thread.shutdown(wait=True)


class _Growth:
    """After each parameter's gradient accumulation: every ``stride``-th lets the windows
    grow (a pass armed for the last backward only; the others return at once)."""

    def __init__(self, engines: list[HostAdam], params: int) -> None:
        self.engines, self.stride, self.seen = engines, max(1, -(-params // GROW_CHECKS)), 0

    def __call__(self, param) -> None:
        self.seen += 1
        if self.seen % self.stride == 0:
            for engine in self.engines:
                engine.grow()
