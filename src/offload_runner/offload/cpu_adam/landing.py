"""The link of the CPU-Adam engine: a piece's gradients down and its masters up (into a GPU ring,
rounded into its bf16 parameters), and exact mode's landing during the next forward, where a
forward pre-hook on each module waits for the landing of the last piece holding its
parameters."""

from __future__ import annotations

import concurrent.futures
import threading
import time

from offload_runner.offload.cpu_adam.cores import init_thread
from offload_runner.offload.cpu_adam.shard import Shard
from offload_runner.offload.cpu_adam.update import Update
from offload_runner.offload.host_adam import Piece, before_each_forward


class Link:
    """A CpuAdam's copies, owning their streams (down, up), the GPU ring the masters land in,
    the thread that enqueues landings and the exact update landing during the forward; it reads
    the shard's host arrays and pieces."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self.needed = None  # (module, params) -> the last piece holding them: see open()
        self.streams = None  # (down, up) side streams, from the first step, CUDA only
        self.ring: list = []  # two pieces of fp32 masters on the GPU (plan.cpu_adam_ring_bytes)
        self.landings = 0  # so far: which half of the ring the next one takes
        self.lock = threading.Lock()  # the ring: the lander and step() both land
        self.inflight: tuple[Update, concurrent.futures.Future] | None = None  # see watch()
        self.hooks: list = []
        # enqueueing a piece's copies costs the calling thread real time (cudaMemcpyAsync in
        # docs/evidence/profile-gbs4-cpu-adam.txt): a thread of its own enqueues the landings
        # while the worker runs Adam on the next piece
        self.lander = concurrent.futures.ThreadPoolExecutor(
            1,
            thread_name_prefix="cpu-adam-land",
            initializer=init_thread,
            initargs=(None, None, shard.device),
        )

    def allocate(self, ring_numel: int) -> None:
        import torch

        device = self.shard.device
        self.ring = [torch.empty(ring_numel, dtype=torch.float32, device=device) for _ in range(2)]

    def open(self, needed) -> None:
        """At the pieces' planning: the side streams (CUDA only), and ``needed(module, params)``,
        the last piece (in update order) holding any of a module's ``params``."""
        import torch

        self.needed = needed
        self.streams = (torch.cuda.Stream(), torch.cuda.Stream()) if self.shard.on_cuda else None

    def start(self) -> None:
        """The streams wait for the compute stream: clipping wrote the grads there, and the
        backward read the parameters the landings write."""
        import torch

        for stream in self.streams or ():
            stream.wait_stream(torch.cuda.current_stream())

    def fetch(self, piece: Piece, after=None) -> None:
        """A piece's gradients down (on the down stream, after the CUDA event ``after`` where
        given; synchronously without CUDA)."""
        import torch

        target = self.shard.grad[piece.start : piece.stop]
        if self.streams is None:
            target.copy_(piece.grad)
            return
        with torch.cuda.stream(self.streams[0]):
            if after is not None:
                self.streams[0].wait_event(after)
            target.copy_(piece.grad, non_blocking=True)
            piece.fetched = torch.cuda.Event(blocking=True)  # the worker sleeps on it
            piece.fetched.record(self.streams[0])

    def land(self, piece: Piece, guess: bool = False, after=None) -> None:
        """A piece's masters (or, with ``guess``, their extrapolation) up and rounded into its
        bf16 parameters (on the up stream, after the CUDA event ``after`` where given; on the
        CPU, synchronously, without CUDA)."""
        import torch

        shard = self.shard
        source = (shard.guess if guess else shard.master)[piece.start : piece.stop]
        if self.streams is None:
            piece.param.copy_(source)
            return
        with self.lock, torch.cuda.stream(self.streams[1]):  # ring reuse: this stream
            if after is not None:
                self.streams[1].wait_event(after)
            ring = self.ring[self.landings % 2][: piece.numel]
            self.landings += 1
            ring.copy_(source, non_blocking=True)
            piece.param.copy_(ring)
            piece.landed = torch.cuda.Event(blocking=True)
            piece.landed.record(self.streams[1])

    def land_marked(self, piece: Piece, update: Update, index: int) -> None:
        """Exact mode's landing of a piece, then the mark the next forward waits for."""
        try:
            self.land(piece)
        except BaseException:
            update.failed = True
            raise
        finally:
            update.landed[index].set()

    def watch(self, chunks) -> None:
        """Land exact updates during the next forward: a forward pre-hook on every module of
        ``chunks`` (the model chunks) that holds parameters waits for the update of those
        parameters alone, so ``step()`` returns once the update is handed to the worker, which
        runs it in forward order while the forward follows it. Only where nothing reads the
        parameters between the step and the forward (no data-parallel parameter all-gather)."""
        self.hooks += [hook for _, hook in before_each_forward(chunks, self._before_forward)]

    def unwatch(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()

    def _before_forward(self, params: list, module, args) -> None:
        inflight = self.inflight
        if inflight is None:
            return
        index = self.needed(module, params)
        update = inflight[0]
        index = min(index, update.on_cpu - 1)  # the GPU share lands on the compute stream
        if index < update.waited:
            return
        began = time.perf_counter()
        update.landed[index].wait()
        update.forward_wait_s += time.perf_counter() - began
        if update.failed:
            self.complete()  # raises the worker's error
            return
        if self.streams is not None:  # landings run in order on one stream: all before it too
            import torch

            torch.cuda.current_stream().wait_event(self.shard.pieces[index].landed)
        update.waited = index + 1
        if update.waited == update.on_cpu:
            self.complete()

    def complete(self) -> None:
        """Wait for an exact update the forward has not waited for to its end (errors raise
        here), and make the compute stream wait for its landings."""
        inflight, self.inflight = self.inflight, None
        if inflight is None:
            return
        inflight[1].result()
        self.wait_for_landings()

    def wait_for_landings(self) -> None:
        """The compute stream waits for every landing enqueued so far: the bf16 params are back."""
        self._compute_waits(1)

    def downs_done(self) -> None:
        """The compute stream waits for the copies down (the grad buffer may be zeroed)."""
        self._compute_waits(0)

    def _compute_waits(self, side: int) -> None:
        """The compute stream waits for the work enqueued so far on stream ``side`` (0 down,
        1 up); nothing without CUDA."""
        if self.streams is not None:
            import torch

            torch.cuda.current_stream().wait_stream(self.streams[side])

    def close(self) -> None:
        self.unwatch()
        self.lander.shutdown(wait=True)
