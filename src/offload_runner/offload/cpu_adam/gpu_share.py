"""The GPU share of the CPU-Adam engine: the last pieces of an update have their Adam on the GPU
over their masters and moments streamed through a state window, while the CPU updates the
others (exact mode: during the step; delayed mode: under the next forward+backward, their
gradients streamed up too). Balanced from measured rates for BALANCE_STEPS steps, then fixed
and checkpointed."""

from __future__ import annotations

import logging

from offload_runner.config.schema import RunConfig
from offload_runner.hardware import LATE
from offload_runner.offload.cpu_adam.update import Update

log = logging.getLogger("offload_runner")

GPU_SHARE = "cpu_adam_gpu_share"  # param-group key: the fixed GPU share, for a resume
BALANCE_STEPS = 6  # a balanced GPU share moves at the steps up to this one, then stays fixed


def balanced_share(run: RunConfig) -> bool:
    """The GPU share follows the measured rates for BALANCE_STEPS steps: unset
    (optimizer.cpu_adam_gpu_share=null), and not under model.deterministic_mode, where the
    planner's balance from the config's rates stays fixed from the first step."""
    share = run.optimizer.cpu_adam_gpu_share
    return run.mode.streams and share is None and not run.model.deterministic_mode


class GpuShare:
    """CpuAdam's GPU share (the engine's state lives in CpuAdam)."""

    @property
    def streams_states(self) -> bool:
        return self._window is not None

    @property
    def window_bytes(self) -> int:
        return self._window.nbytes if self._window is not None else 0

    def _arm_window(self) -> None:
        """Exact mode's GPU share, before the last micro-batch: this step's split, and its pass
        begun, so the backward may bring in its states (``grow``)."""
        if self._exact_share_comes() and not self._window.prefetched:
            self._split()
            self._window.begin(self._streamed, growing=True)

    def grow(self, reserve: int = 0) -> None:
        """During the armed backward: the GPU share's states into the memory it has freed
        (StatesWindow.grow)."""
        if self._window is not None:
            self._window.grow(reserve=reserve)

    def prefetch(self) -> None:
        """Exact mode's GPU share: its split (unless armed), and its first states coming in (at
        the tail of backward, through optimizer_states' hook; ``step()`` does it where nothing
        did)."""
        if not self._exact_share_comes():
            return  # none, or a late pass: the worker splits the update (_update_pieces)
        if not self._window.prefetched:
            self._split()
        self._window.prefetch(self._streamed)

    def _exact_share_comes(self) -> bool:
        """The coming step is exact and has a GPU share (its pieces planned)."""
        return (
            self._window is not None
            and self._pieces is not None
            and not self.mode.delayed_at(self.steps_taken + 1)
        )

    def _split(self) -> None:
        """Where the split between the CPU and the GPU falls this step (``_rebalance``)."""
        self._window.finish()  # pieces the last pass streamed may go to the CPU now
        self._rebalance()
        self._on_cpu = self._cpu_pieces(self._share)
        self._streamed = self._pieces[self._on_cpu :]

    def _cpu_pieces(self, gpu_share: float, order: list[int] | None = None) -> int:
        """How many leading pieces (of ``order``, default their own) hold about ``1 -
        gpu_share`` of the offloaded params (while balancing, at least one on each side, so both
        rates stay measured)."""
        target, taken, count = (1.0 - gpu_share) * self.offloaded_numel, 0, 0
        for i in order if order is not None else range(len(self._pieces)):
            piece = self._pieces[i]
            if taken + piece.numel / 2 > target:
                break
            taken += piece.numel
            count += 1
        if self.balance and len(self._pieces) > 1:
            count = min(max(count, 1), len(self._pieces) - 1)
        return count

    def _rebalance(self) -> None:
        """Move the split so that the CPU's share and the GPU's take as long: at the last exact
        step, both running at once, the CPU updated ``params`` in its wall time and the window
        passed its share in its own; the new GPU share is half way from the current one to where
        those two rates would finish together (``optimizer.cpu_adam_gpu_share=null``). After
        step BALANCE_STEPS the share stays where it is, so the numerics stop depending on timing
        (and a resume, which loads it, splits as the saved run did)."""
        passes = self._window.timing() if not self._fixed else []
        last = self.history[-1] if self.history else None
        if not (passes and last) or last.step < 2 or last.step <= self._balanced_at:
            return  # the first step's timing includes its allocations
        self._balanced_at = last.step
        gpu_s, gpu_params = passes[-1]
        if gpu_s and last.wall_s and last.params and gpu_params:
            cpu_s, gpu_s = last.wall_s / last.params, gpu_s / gpu_params  # per param
            share = gpu_params / (gpu_params + last.params)
            # a late pass's link also carries every piece's landing, LATE's E per its W bytes
            every = LATE[2] / LATE[0] * gpu_s if last.late_share else 0.0
            target = min(max((cpu_s - every) / (cpu_s + gpu_s), 0.0), 1.0)
            self._share = share + 0.5 * (target - share)
        if last.step >= BALANCE_STEPS:  # from here on the split depends on nothing timed
            self._fixed = True
            log.info(
                "cpu_adam: the GPU share is fixed at %.3f from step %d on (checkpointed)",
                self._share,
                last.step + 1,
            )

    def _late_pieces(self, order: list[int]) -> list[int]:
        """Delayed mode's GPU share: the pieces at the end of ``order`` (the update's, the order
        the next backward lands them in), holding about the share of the params: the CPU takes
        those the next backward needs first, the window those it needs last."""
        return order[self._cpu_pieces(self._share, order) :]

    def _late_pass(self, update: Update) -> None:
        """Delayed mode's GPU share of ``update``, from its own thread beside the worker: the
        pieces' states and gradients up as their gradients are down, Adam on a side stream
        under the next forward+backward, the states back; each piece ``done`` once they are on
        the host (the next landing reads its masters from there)."""
        pieces = [self._pieces[i] for i in update.on_gpu]

        def before_load(index: int):
            i = update.on_gpu[index]
            update.ready[i].wait()
            if update.cancelled:
                raise RuntimeError("cpu_adam: the step failed before its gradients went down")
            return self._pieces[i].fetched

        on_device: list = []  # the clip factor's inverse on the GPU, copied once per pass

        def scale_of(index: int):
            if not update.unclipped[update.on_gpu[index]]:
                return None
            update.scaled.wait()
            if update.grad_scale is None:
                return None
            if not on_device:
                on_device.append(update.grad_scale.to(self.device, non_blocking=True))
            return on_device[0]

        freed = self._window.run_late(
            pieces, update.step, update.hyper, self._late_stream, before_load, scale_of
        )
        for i, event in zip(update.on_gpu, freed, strict=True):
            if event is not None:
                event.synchronize()
            update.done[i].set()
