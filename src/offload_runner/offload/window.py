"""The state window: a pass of optimizer-state pieces through a few GPU slots (up, Adam on
the GPU, down), paced beside the training stream. State offload (optimizer_states.py) runs
every step's update through one; CPU Adam (cpu_adam/) streams its GPU share through one; weight
offload takes its Adam kernel (te_adam)."""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field

from offload_runner.hardware import ADAM_BYTES, WINDOW_SLOTS
from offload_runner.offload import quantized, remainders
from offload_runner.offload.host_adam import Piece, torch_adamw

log = logging.getLogger("offload_runner")

BYTES_PER_PARAM = ADAM_BYTES  # fp32 master + exp_avg + exp_avg_sq
SLOTS = WINDOW_SLOTS  # pieces in the window: one in Adam, one going out, one or two coming in
HISTORY = 500  # steps kept for the metrics
ROUNDING_SEED = 0x5EED  # bf16 masters' rounding noise: the same on every rank (their own shards)


def _copy_all(pairs, gap) -> None:
    """Each (destination, source) of ``pairs`` copied on the current stream, a one-element
    kernel on ``gap`` after each. A copy engine runs one stream's ready copies back to back, so
    without a kernel between them the training stream's copies in the same direction (a batch
    up, a layer's tokens per expert down) wait for all of them; at each kernel the engine yields
    and those slip in (bench/probes/copy_queue_probe.py measures both; torchrec's copy-engine
    studies found the same)."""
    for dst, src in pairs:
        dst.copy_(src, non_blocking=True)
        gap.neg_()


@dataclass
class _Mark:
    """A paced pass's piece: ``event`` follows its Adam call (without CUDA: the piece's index),
    set once issued (``ready``; left None where the pass failed before it)."""

    ready: threading.Event = field(default_factory=threading.Event)
    event: object = None


def record_event(stream):
    import torch

    event = torch.cuda.Event(enable_timing=True, blocking=True)
    event.record(stream)
    return event


def te_adam(device, remainders: bool = False):
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
    codes: list = field(default_factory=list)  # 8-bit moments: (uint8 codes, fp32 block scales)
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

    def __init__(
        self, host: tuple, device, piece_numel: int, adam=None, host_grad=None, scales=()
    ) -> None:
        import torch

        self.host = host  # (masters, exp_avg, exp_avg_sq), flat host arrays; the masters
        # as int16 remainders of the bf16 parameters (remainders.py), fp32, or None (bf16
        # masters: the parameters, rounded stochastically); a moment in uint8 is 8-bit codes
        # whose blocks' scales are in ``scales`` (per moment, by block: quantized.py)
        self.scales = dict(enumerate(scales))
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
        self._adam = adam  # Transformer Engine's multi-tensor Adam (te_adam), else torch's
        self._bf16_masters = host[0] is None
        # bf16 masters round stochastically from this generator (a checkpoint keeps its state)
        self.rounding = None
        if self._bf16_masters:
            self.rounding = torch.Generator(device).manual_seed(ROUNDING_SEED)
        self._remainders = not self._bf16_masters and host[0].dtype == torch.int16
        # the moments kept in bf16 on the host: they travel at 2 B and are upcast for Adam; those
        # kept as 8-bit codes travel with their scales and are dequantized for Adam
        self._low = [i for i in (1, 2) if host[i].dtype in (torch.bfloat16, torch.float16)]
        self._low_dtype = host[self._low[0]].dtype if self._low else None
        self._q8 = [i for i in (1, 2) if host[i].dtype == torch.uint8]
        if self._q8:
            assert piece_numel % quantized.BLOCK == 0, "8-bit moments move in whole blocks"
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
        q8 = len(self._q8) * (1 + 4 / quantized.BLOCK)
        per_param = self._arrays * 4 + len(self._low) * 2 + self._remainders * 2 + q8
        return int(per_param * self.piece_numel)

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

    def grow(self, budget: int | None = None, reserve: int = 0) -> int:
        """During the last micro-batch's backward (the pass armed by ``begin(growing=True)``):
        slots for the next pieces, each loaded at once, in the memory the backward has freed:
        ``budget`` bytes, by default ``_freed_bytes`` (room left for the rest of the backward
        and the step's own allocations) less ``reserve`` (what the rest of the backward
        allocates above today's level: a group full recompute rebuilds), so the peak does not
        grow. The slots come from the current
        stream's pool (the activations just freed) and their copies in wait for what is queued
        there. Returns the slots added."""
        import torch

        p = self._pass
        if p is None or not p.growing:
            return 0
        if budget is None:
            budget = self._freed_bytes() - reserve
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
            codes = (
                (
                    torch.empty((len(self._q8), shape[1]), dtype=torch.uint8, device=self.device),
                    torch.empty(
                        (len(self._q8), shape[1] // quantized.BLOCK),
                        dtype=torch.float32,
                        device=self.device,
                    ),
                )
                if self._q8
                else None
            )
        if streams is not None and not on_h2d:
            streams[0].wait_stream(torch.cuda.current_stream())  # the memory's last readers
        self._pass.slots.append(slot)
        self._pass.low.append(low)
        self._pass.rem.append(rem)
        self._pass.codes.append(codes)
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
            self._pass.began = record_event(compute)
        return steps, compute

    def _through(self, index: int, step: int, steps, hypers: list[dict], mark_on=None) -> tuple:
        """Piece ``index`` through the window once in: its Adam call, its copy out, its slot
        released if it is the slot's last. Returns (the event after the Adam call, recorded on
        stream ``mark_on``, or None; the event after the copy out)."""
        self._update(self._pass.pieces[index], self._slot(index), step, steps, hypers, index)
        adam = record_event(mark_on) if mark_on is not None else None
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
        arrays = [
            t for t in (p.slots[at], p.low[at], p.rem[at], *(p.codes[at] or ())) if t is not None
        ]
        if self.streams is not None:
            for stream in {torch.cuda.current_stream(), *self.streams}:
                for array in arrays:
                    array.record_stream(stream)
        p.slots[at] = p.low[at] = p.rem[at] = p.codes[at] = None

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
        where they travel so (nothing for bf16 masters), a bf16 array for each moment stored in
        bf16, the codes of each stored in 8 bits; then those moments' block scales."""
        n, at = self._pass.pieces[index].numel, self._at(index)
        arrays = list(self._slot(index))
        if self._remainders:
            arrays[0] = self._pass.rem[at][:n]
        if self._bf16_masters:
            arrays[0] = None
        for k, i in enumerate(self._low):
            arrays[i] = self._pass.low[at][k, :n]
        if self._q8:
            codes, scales = self._pass.codes[at]
            for k, i in enumerate(self._q8):
                arrays[i] = codes[k, :n]
            arrays += [scales[k, : quantized.blocks(n)] for k in range(len(self._q8))]
        return tuple(arrays)

    def _slot_grad(self, index: int):
        """A late pass's gradient array in the slot of its piece ``index``."""
        n = self._pass.pieces[index].numel
        return self._pass.slots[self._at(index)][self._arrays - 1, :n]

    def _on_host(self, piece: Piece) -> tuple:
        """Piece's places in the host arrays, as ``_staged`` lists them."""
        arrays = [None if a is None else a[piece.start : piece.stop] for a in self.host]
        first = piece.block
        return (
            *arrays,
            *(self.scales[i][first : first + quantized.blocks(piece.numel)] for i in self._q8),
        )

    def _pairs(self, index: int) -> list:
        """(staged, on the host) for each array piece ``index`` moves."""
        both = zip(self._staged(index), self._on_host(self._pass.pieces[index]), strict=True)
        return [(gpu, host) for gpu, host in both if gpu is not None]

    def _load_next(self) -> None:
        """The next piece's masters and moments into its slot (on ``h2d``, after the slot's
        last piece has gone out)."""
        import torch

        index = self._pass.queued
        self._pass.queued += 1
        piece = self._pass.pieces[index]
        pairs = self._pairs(index)
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
        self._pass.loaded[index] = record_event(h2d)

    def _unload(self, index: int):
        """The pass's piece ``index``: updated masters and moments back to the host (on ``d2h``,
        after its Adam call on the compute stream); returns the event after it (None without
        CUDA)."""
        import torch

        piece = self._pass.pieces[index]
        pairs = [(host, gpu) for gpu, host in self._pairs(index)]
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
        freed = self._pass.freed[self._at(index)] = record_event(d2h)
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
        self._dequantize(index)
        if self._bf16_masters:
            master.copy_(piece.param)
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
        self._quantize(index)
        if self._bf16_masters:
            quantized.round_stochastically(master, piece.param, self.rounding)
        elif not (late or self._remainders):
            piece.param.copy_(master)

    def _q8_rows(self, index: int) -> list[tuple]:
        """Per 8-bit moment of piece ``index``: (its fp32 slot row over whole blocks, codes,
        scales, signed)."""
        if not self._q8:
            return []
        n, at = self._pass.pieces[index].numel, self._at(index)
        whole = quantized.blocks(n) * quantized.BLOCK
        codes, scales = self._pass.codes[at]
        rows = self._pass.slots[at]
        return [
            (
                rows[i - self._remainders, :whole],
                codes[k, :whole],
                scales[k, : whole // quantized.BLOCK],
                i == 1,
            )
            for k, i in enumerate(self._q8)
        ]

    def _dequantize(self, index: int) -> None:
        for row, codes, scales, signed in self._q8_rows(index):
            quantized.dequantize(codes, scales, row, signed)

    def _quantize(self, index: int) -> None:
        """The 8-bit moments back into codes, the tail of a last block past the piece zero."""
        n = self._pass.pieces[index].numel
        for row, codes, scales, signed in self._q8_rows(index):
            row[n:].zero_()
            quantized.quantize(row, codes, scales, signed)

    def _end_pass(self) -> None:
        done, self._pass = self._pass, None
        self.grown.append(sum(p.numel for p in done.pieces[: done.grown]))
        if len(self.grown) > 2 * HISTORY:
            del self.grown[2:-HISTORY]
        if self.streams is None:
            return
        done.ended = record_event(self.streams[1])
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
