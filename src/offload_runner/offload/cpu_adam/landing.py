"""The link of the CPU-Adam engine: a piece's gradients down and its masters up (into a GPU ring,
rounded into its bf16 parameters), and exact mode's landing during the next forward, where a
forward pre-hook on each module waits for the landing of the last piece holding its
parameters."""

from __future__ import annotations

import time

from offload_runner.offload.cpu_adam.update import Update
from offload_runner.offload.host_adam import Piece, before_each_forward


class Landing:
    """CpuAdam's copies and its forward hooks (the engine's state lives in CpuAdam)."""

    def _start_fetch(self) -> None:
        import torch

        if self._streams is not None:  # clipping wrote the grads on the compute stream, and
            for stream in self._streams:  # the backward read the parameters the landings write
                stream.wait_stream(torch.cuda.current_stream())

    def _fetch(self, piece: Piece, after=None) -> None:
        """A piece's gradients down (on ``d2h``, after the CUDA event ``after`` where given;
        synchronously without CUDA)."""
        import torch

        target = self.host_grad[piece.start : piece.stop]
        if self._streams is None:
            target.copy_(piece.grad)
            return
        with torch.cuda.stream(self._streams[0]):
            if after is not None:
                self._streams[0].wait_event(after)
            target.copy_(piece.grad, non_blocking=True)
            piece.fetched = torch.cuda.Event(blocking=True)  # the worker sleeps on it
            piece.fetched.record(self._streams[0])

    def _land(self, piece: Piece, guess: bool = False, after=None) -> None:
        """A piece's masters (or, with ``guess``, their extrapolation) up and rounded into its
        bf16 parameters (on ``h2d``, after the CUDA event ``after`` where given; on the CPU,
        synchronously, without CUDA)."""
        import torch

        source = (self.host_guess if guess else self.host_master)[piece.start : piece.stop]
        if self._streams is None:
            piece.param.copy_(source)
            return
        with self._land_lock, torch.cuda.stream(self._streams[1]):  # ring reuse: this stream
            if after is not None:
                self._streams[1].wait_event(after)
            ring = self._ring[self._landings % 2][: piece.numel]
            self._landings += 1
            ring.copy_(source, non_blocking=True)
            piece.param.copy_(ring)
            piece.landed = torch.cuda.Event(blocking=True)
            piece.landed.record(self._streams[1])

    def _land_marked(self, piece: Piece, update: Update, index: int) -> None:
        """Exact mode's landing of a piece, then the mark the next forward waits for."""
        try:
            self._land(piece)
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
        self._hooks += [hook for _, hook in before_each_forward(chunks, self._before_forward)]

    def _unwatch(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _before_forward(self, params: list, module, args) -> None:
        inflight = self._inflight
        if inflight is None:
            return
        index = self._last_piece_needed(module, params)
        update = inflight[0]
        index = min(index, update.on_cpu - 1)  # the GPU share lands on the compute stream
        if index < update.waited:
            return
        began = time.perf_counter()
        update.landed[index].wait()
        update.forward_wait_s += time.perf_counter() - began
        if update.failed:
            self._complete()  # raises the worker's error
            return
        if self._streams is not None:  # landings run in order on one stream: all before it too
            import torch

            torch.cuda.current_stream().wait_event(self._pieces[index].landed)
        update.waited = index + 1
        if update.waited == update.on_cpu:
            self._complete()

    def _pieces_of(self, param) -> list[int]:
        """The pieces (indices in update order) holding any of ``param``'s elements."""
        return self._piece_spans().holding([param])

    def _complete(self) -> None:
        """Wait for an exact update the forward has not waited for to its end (errors raise
        here), and make the compute stream wait for its landings."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        inflight[1].result()
        self._wait_for_landings()

    def _wait_for_landings(self) -> None:
        """The compute stream waits for every landing enqueued so far: the bf16 params are back."""
        if self._streams is not None:
            import torch

            torch.cuda.current_stream().wait_stream(self._streams[1])
