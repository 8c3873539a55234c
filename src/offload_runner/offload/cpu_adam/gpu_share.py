"""The GPU share of the CPU-Adam engine: the last pieces of an update have their Adam on the GPU
over their masters and moments streamed through a state window, while the CPU updates the
others (exact mode: during the step; delayed mode: under the next forward+backward, their
gradients streamed up too). Balanced from measured rates for BALANCE_STEPS steps, then fixed
and checkpointed."""

from __future__ import annotations

import concurrent.futures
import logging

from offload_runner.config.schema import RunConfig
from offload_runner.hardware import LATE
from offload_runner.offload.cpu_adam.cores import init_thread
from offload_runner.offload.cpu_adam.shard import Shard
from offload_runner.offload.cpu_adam.update import Update
from offload_runner.offload.window import StatesWindow

log = logging.getLogger("offload_runner")

GPU_SHARE = "cpu_adam_gpu_share"  # param-group key: the fixed GPU share, for a resume
BALANCE_STEPS = 6  # a balanced GPU share moves at the steps up to this one, then stays fixed


def balanced_share(run: RunConfig) -> bool:
    """The GPU share follows the measured rates for BALANCE_STEPS steps: unset
    (optimizer.cpu_adam_gpu_share=null), and not under model.deterministic_mode, where the
    planner's balance from the config's rates stays fixed from the first step."""
    share = run.optimizer.cpu_adam_gpu_share
    return run.mode.streams and share is None and not run.model.deterministic_mode


class Share:
    """A CpuAdam's GPU share, owning its split (the share, balanced or fixed, and the pieces on
    each side), its state window and delayed mode's late passes (their thread and stream); it
    reads the shard's pieces, host arrays and update history."""

    def __init__(self, shard: Shard, gpu_share: float, balance: bool) -> None:
        self.shard = shard
        self.gpu_share = gpu_share
        self.balance = balance
        self.share = self.gpu_share  # the share now (the balance moves it)
        self.fixed = not self.balance  # the share moves no more (BALANCE_STEPS, or loaded)
        self.balanced_at = 0  # the step whose timing last moved the split
        self.window: StatesWindow | None = None
        self.late: concurrent.futures.ThreadPoolExecutor | None = None  # issues late passes
        self.late_stream = None  # ... on this side stream
        self.on_cpu = 0  # exact: pieces [0, on_cpu) run on the CPU, the rest through the window
        self.streamed: list = []  # this step's GPU share: the pieces from on_cpu on

    @property
    def wanted(self) -> bool:
        """A share to stream (set, or balanced), and params to take it from."""
        return bool(self.gpu_share or self.balance) and self.shard.numel > 0

    def allocate(self, delayed: bool) -> None:
        """In the worker, after the host arrays: the window over the masters and moments (and,
        in delayed mode, the gradients: a late pass streams them up), delayed mode's thread and
        side stream for late passes."""
        import torch

        s = self.shard
        self.window = StatesWindow(
            (s.master, s.exp_avg, s.exp_avg_sq),
            s.device,
            s.chunk_numel,
            host_grad=s.grad if delayed else None,
        )
        if delayed:
            self.late = concurrent.futures.ThreadPoolExecutor(
                1,
                thread_name_prefix="cpu-adam-late",
                initializer=init_thread,
                initargs=(None, None, s.device),
            )
            self.late_stream = torch.cuda.Stream() if s.on_cuda else None

    def first_split(self) -> None:
        """At the pieces' planning: the CPU's share of them (all without a window)."""
        pieces = self.shard.pieces
        self.on_cpu = self.cpu_pieces(self.share) if self.window else len(pieces)

    def arm(self, exact: bool) -> None:
        """Exact mode's GPU share, before the last micro-batch (of an ``exact`` step): this
        step's split, and its pass begun, so the backward may bring in its states (``grow``)."""
        if self._exact_share_comes(exact) and not self.window.prefetched:
            self._split()
            self.window.begin(self.streamed, growing=True)

    def grow(self, reserve: int = 0) -> None:
        """During the armed backward: the GPU share's states into the memory it has freed
        (StatesWindow.grow)."""
        if self.window is not None:
            self.window.grow(reserve=reserve)

    def prefetch(self, exact: bool) -> None:
        """Exact mode's GPU share (of an ``exact`` step): its split (unless armed), and its
        first states coming in (at the tail of backward, through optimizer_states' hook;
        ``step()`` does it where nothing did)."""
        if not self._exact_share_comes(exact):
            return  # none, or a late pass: the worker splits the update (split_late)
        if not self.window.prefetched:
            self._split()
        self.window.prefetch(self.streamed)

    def _exact_share_comes(self, exact: bool) -> bool:
        """The coming step is ``exact`` and has a GPU share (its pieces planned)."""
        return exact and self.window is not None and self.shard.pieces is not None

    def _split(self) -> None:
        """Where the split between the CPU and the GPU falls this step (``rebalance``)."""
        self.window.finish()  # pieces the last pass streamed may go to the CPU now
        self.rebalance()
        self.on_cpu = self.cpu_pieces(self.share)
        self.streamed = self.shard.pieces[self.on_cpu :]

    def cpu_pieces(self, gpu_share: float, order: list[int] | None = None) -> int:
        """How many leading pieces (of ``order``, default their own) hold about ``1 -
        gpu_share`` of the offloaded params (while balancing, at least one on each side, so both
        rates stay measured)."""
        pieces = self.shard.pieces
        target, taken, count = (1.0 - gpu_share) * self.shard.numel, 0, 0
        for i in order if order is not None else range(len(pieces)):
            if taken + pieces[i].numel / 2 > target:
                break
            taken += pieces[i].numel
            count += 1
        if self.balance and len(pieces) > 1:
            count = min(max(count, 1), len(pieces) - 1)
        return count

    def rebalance(self) -> None:
        """Move the split so that the CPU's share and the GPU's take as long: at the last exact
        step, both running at once, the CPU updated ``params`` in its wall time and the window
        passed its share in its own; the new GPU share is half way from the current one to where
        those two rates would finish together (``optimizer.cpu_adam_gpu_share=null``). After
        step BALANCE_STEPS the share stays where it is, so the numerics stop depending on timing
        (and a resume, which loads it, splits as the saved run did)."""
        passes = self.window.timing() if not self.fixed else []
        history = self.shard.history
        last = history[-1] if history else None
        if not (passes and last) or last.step < 2 or last.step <= self.balanced_at:
            return  # the first step's timing includes its allocations
        self.balanced_at = last.step
        gpu_s, gpu_params = passes[-1]
        if gpu_s and last.wall_s and last.params and gpu_params:
            cpu_s, gpu_s = last.wall_s / last.params, gpu_s / gpu_params  # per param
            share = gpu_params / (gpu_params + last.params)
            # a late pass's link also carries every piece's landing, LATE's E per its W bytes
            every = LATE[2] / LATE[0] * gpu_s if last.late_share else 0.0
            target = min(max((cpu_s - every) / (cpu_s + gpu_s), 0.0), 1.0)
            self.share = share + 0.5 * (target - share)
        if last.step >= BALANCE_STEPS:  # from here on the split depends on nothing timed
            self.fixed = True
            log.info(
                "cpu_adam: the GPU share is fixed at %.3f from step %d on (checkpointed)",
                self.share,
                last.step + 1,
            )

    def split_late(self, update: Update):
        """Delayed mode's GPU share, in the worker: once the last update and its pass are done,
        this update's split (rebalanced), the pieces at the end of its order (those the next
        backward lands last) handed to a late pass; that pass's future (None where the GPU
        takes none)."""
        self.window.finish()
        self.rebalance()
        pieces = self.shard.pieces
        update.on_gpu = update.order[self.cpu_pieces(self.share, update.order) :]
        update.params -= sum(pieces[i].numel for i in update.on_gpu)
        return self.late.submit(self._late_pass, update) if update.on_gpu else None

    def _late_pass(self, update: Update) -> None:
        """Delayed mode's GPU share of ``update``, from its own thread beside the worker: the
        pieces' states and gradients up as their gradients are down, Adam on a side stream
        under the next forward+backward, the states back; each piece ``done`` once they are on
        the host (the next landing reads its masters from there)."""
        all_pieces = self.shard.pieces
        pieces = [all_pieces[i] for i in update.on_gpu]

        def before_load(index: int):
            i = update.on_gpu[index]
            update.ready[i].wait()
            if update.cancelled:
                raise RuntimeError("cpu_adam: the step failed before its gradients went down")
            return all_pieces[i].fetched

        on_device: list = []  # the clip factor's inverse on the GPU, copied once per pass

        def scale_of(index: int):
            if not update.unclipped[update.on_gpu[index]]:
                return None
            update.scaled.wait()
            if update.grad_scale is None:
                return None
            if not on_device:
                on_device.append(update.grad_scale.to(self.shard.device, non_blocking=True))
            return on_device[0]

        freed = self.window.run_late(
            pieces, update.step, update.hyper, self.late_stream, before_load, scale_of
        )
        for i, event in zip(update.on_gpu, freed, strict=True):
            if event is not None:
                event.synchronize()
            update.done[i].set()

    def checkpointed(self, param_groups: list) -> None:
        """A fixed share into the param groups, so a resume splits as this run did."""
        for group in param_groups if self.window is not None and self.fixed else ():
            group[GPU_SHARE] = self.share

    def restore(self, param_groups: list) -> None:
        """The share a saved run had fixed, where it had one."""
        saved = param_groups[0].get(GPU_SHARE) if param_groups else None
        if saved is not None and self.window is not None:
            self.share, self.fixed = float(saved), True

    def close(self) -> None:
        """After the engine's ``finish`` (the window's copies out): the late passes' thread."""
        if self.late is not None:
            self.late.shutdown(wait=True)
