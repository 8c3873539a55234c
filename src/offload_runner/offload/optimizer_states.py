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
import time
from dataclasses import dataclass, replace

from offload_runner.config.schema import (
    TORCH_DTYPES,
    OptimizerDtype,
    RunConfig,
    states_window_mb,
)
from offload_runner.model_size import count_parameters
from offload_runner.offload import host_adam
from offload_runner.offload.base import OffloadSummary
from offload_runner.offload.host_adam import AdamSettings, HostAdam, Piece, PieceSpans
from offload_runner.offload.quantized import BLOCK, blocks
from offload_runner.offload.window import (
    HISTORY,
    SLOTS,
    StatesWindow,
    record_event,
    te_adam,
)

log = logging.getLogger("offload_runner")

GROW_CHECKS = 32  # times per backward the windows look for memory it has freed


DISABLED = {"optimizer.offload_optimizer_states": False}


def describe(run: RunConfig) -> OffloadSummary:
    o = run.optimizer
    if not run.mode.states:
        return OffloadSummary("optimizer states", "offload/optimizer=states", False, "-")
    share = o.optimizer_state_offload_fraction
    params = count_parameters(run.model).total * share
    per_param = run.precision.host_state_bytes
    return OffloadSummary(
        "optimizer states",
        "offload/optimizer=states",
        True,
        f"{share:.0%} of the masters ({masters_said(run)})"
        f" + {o.exp_avg_dtype.value} exp_avg + "
        f"{o.exp_avg_sq_dtype.value} exp_avg_sq ({per_param:.3g} B/param, ~"
        f"{params * per_param / 1e9:.1f} GB for the whole model before DP sharding) live on "
        "the host; Adam runs on the GPU",
        f"streamed through a {states_window_mb(run)} MiB GPU window during the step, both "
        "directions at once (beside the next forward where one rank holds its whole shard)",
    )


# --- windowed: the states stream through a small GPU window during the step --------------------


@dataclass(frozen=True)
class Window:
    """State offload's own settings: the GPU window's size, the masters as 16-bit remainders or
    as the bf16 parameters themselves, and whether the pass runs beside the next forward."""

    nbytes: int = 512 * 1024**2
    remainders: bool = False
    bf16_masters: bool = False
    beside_forward: bool = False


class WindowedStates(HostAdam):
    """Adam on the GPU for one DistributedOptimizer's shard whose masters and moments live in
    page-locked host arrays and pass through a GPU window of ``window.nbytes`` (module doc)."""

    def __init__(self, params, adam: AdamSettings, window: Window = Window()) -> None:
        import torch

        # a piece of n params takes 12 n bytes of the window (fp32 master and moments; 10 with
        # the master as a remainder), 2 n (1 n) more per moment stored in bf16 (in 8 bits: it
        # travels as such): chunk_bytes counts 4 B per param
        low = sum(d.itemsize for d in adam.moment_dtypes if d != torch.float32)
        per_param = 12 - 2 * window.remainders + low
        chunk_bytes = window.nbytes * 4 // (SLOTS * per_param)
        super().__init__(params, replace(adam, chunk_bytes=chunk_bytes))
        remainders, bf16_masters = window.remainders, window.bf16_masters
        self._allocate_states(
            pin_moments=True,
            what="offload/optimizer=states",
            remainders=remainders,
            bf16_masters=bf16_masters,
        )
        piece_numel = min(self.chunk_numel, self.offloaded_numel)
        if torch.uint8 in self.moment_dtypes:  # 8-bit moments: pieces of whole blocks
            self.chunk_numel = max(BLOCK, self.chunk_numel // BLOCK * BLOCK)
            piece_numel = blocks(min(self.chunk_numel, self.offloaded_numel)) * BLOCK
        self._window = StatesWindow(
            (self.host_master, self.host_exp_avg, self.host_exp_avg_sq),
            self.device,
            piece_numel,
            te_adam(self.device, remainders) if self.on_cuda else None,
            scales=self.host_scales,
        )
        # beside the next forward (``watch``): the side stream of the passes, the modules that
        # hold parameters (in the order the forward calls them), their forward pre-hooks
        self.beside_forward = window.beside_forward  # nothing reads the parameters before it
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

    def grow(self, reserve: int = 0) -> None:
        """During the armed backward: pieces into the memory it has freed (StatesWindow.grow)."""
        self._window.grow(reserve=reserve)

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
        index = self.last_piece_needed(module, params)
        if index < self._waited:
            return
        stream = torch.cuda.current_stream() if self.on_cuda else None
        if self._waited == 0 and stream is not None:  # how far the pass runs into the forward
            self._overlaps.append((record_event(stream), marks[-1]))
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
            "states_master_bytes": (
                0 if self.host_master is None else self.host_master.element_size()
            ),
            "states_in_backward_gb": statistics.median(grown) * self.state_bytes_per_param / 1e9,
            "states_stream_s_median": seconds,
            "states_beside_forward_s": self._beside_forward_s(skip),
            "states_forward_wait_s_median": self._forward_wait_s(skip),
            "states_link_gb_per_s": moved / seconds / 1e9 if seconds else None,
            "states_window_gb": self.window_bytes / 1024**3,
        }


def moment_dtypes(run: RunConfig) -> tuple:
    """exp_avg's and exp_avg_sq's torch dtypes (optimizer.exp_avg_dtype, exp_avg_sq_dtype)."""
    import torch

    o = run.optimizer
    return tuple(
        torch.uint8 if d == OptimizerDtype.q8 else getattr(torch, TORCH_DTYPES[d.value])
        for d in (o.exp_avg_dtype, o.exp_avg_sq_dtype)
    )


def masters_said(run: RunConfig) -> str:
    if run.precision.bf16_masters:
        return "none: the bf16 params, rounded stochastically"
    if run.precision.keeps_remainders:
        return "as 16-bit remainders of the bf16 params"
    return "in fp32"


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
            AdamSettings.of(
                run,
                fraction=o.optimizer_state_offload_fraction,
                moment_dtypes=moment_dtypes(run),
            ),
            Window(
                states_window_mb(run) * 1024**2,
                run.precision.keeps_remainders,
                run.precision.bf16_masters,
                beside_forward=not host_adam.gathers_params(part),
            ),
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
        masters_said(run),
        run.optimizer.exp_avg_dtype.value,
        max((e.window_bytes for e in built), default=0) / 1024**2,
    )
    return built


def attach(optimizer, transformer_config, chunks, reserve: int = 0) -> Attached:
    """Wire the engines that stream states through a window (this module's, and the CPU-Adam
    engine's GPU share) into the backward of the model ``chunks``, where the last micro-batch's
    lets them grow into the memory it frees (every 1/GROW_CHECKS of its parameters'
    gradients; ``reserve`` bytes left for a group full recompute rebuilds), and into
    Megatron-Core's gradient finalize hook, where they prefetch their first pieces; this
    module's engines whose parameters no data-parallel all-gather reads after the step run
    their passes beside the next forward (``BesideForward``)."""
    engines = [e for e in host_adam.engines(optimizer) if e.streams_states]
    if not engines:
        return Attached([], None)
    transformer_config.finalize_model_grads_func = _prefetching(
        engines, transformer_config.finalize_model_grads_func
    )
    params = sum(p.requires_grad for chunk in chunks for p in chunk.parameters())
    hooks = host_adam.after_each_grad(chunks, _Growth(engines, params, reserve))
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
    stream behind them by that thread, and each step's first forward of a chunk waits for it
    before its final norm (else at its end), so no backward writes a gradient (or reads a
    parameter) before the passes are through, and the loss allocates with their slots back."""

    def __init__(self, engines: list[WindowedStates], chunks) -> None:
        import torch

        # high priority: the next forward waits for the passes, so their kernels go first
        self.stream = torch.cuda.Stream(priority=-1)
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
        # ... before the final norm where a chunk has one: the loss's logits (1 GiB chunks at
        # MB 8) never meet slots the pass has not given back yet (the whole Qwen3-30B-A3B ran
        # out of memory there once, its pass's thread slowed by a sampler)
        self._hooks += [
            module.register_forward_pre_hook(lambda m, a: self._after_forward(m, a, None))
            for chunk in chunks
            for name, module in chunk.named_modules()
            if name.endswith("decoder.final_layernorm")
        ]

    def submit(self, fn, *args) -> concurrent.futures.Future:
        return self._thread.submit(fn, *args)

    def zero_grad_buffers(self) -> None:
        """Megatron-Core DDP's ``zero_grad_buffer`` of every chunk, behind the passes (on the
        thread, after the compute stream's own readers of the gradients so far)."""
        import torch

        self.waits.append(0.0)
        if len(self.waits) > 2 * HISTORY:
            del self.waits[1:-HISTORY]
        self._zeroed = self.submit(self._zero, record_event(torch.cuda.current_stream()))

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
    grow (a pass armed for the last backward only; the others return at once), leaving
    ``reserve`` bytes for what the rest of the backward allocates."""

    def __init__(self, engines: list[HostAdam], params: int, reserve: int) -> None:
        self.engines, self.stride, self.seen = engines, max(1, -(-params // GROW_CHECKS)), 0
        self.reserve = reserve

    def __call__(self, param) -> None:
        self.seen += 1
        if self.seen % self.stride == 0:
            for engine in self.engines:
                engine.grow(self.reserve)
