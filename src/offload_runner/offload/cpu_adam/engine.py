"""The CPU-Adam engine: Adam for one DistributedOptimizer's shard, a fraction of it on the CPU
(the package's docstring says what lives where). It owns three parts, each with its own state:
its link and landing during the forward (``Link``, landing.py), its GPU share (``Share``,
gpu_share.py) and delayed mode's update in flight (``Delay``, delayed.py); its mode is an
object (modes.py)."""

from __future__ import annotations

import concurrent.futures
import logging
import statistics
import threading
import time
from dataclasses import dataclass

from offload_runner.hardware import CPU_ADAM_PAGEABLE_BYTES, CPU_ADAM_PINNED_BYTES
from offload_runner.offload.cpu_adam.columns import ExactColumns
from offload_runner.offload.cpu_adam.cores import cpu_worker
from offload_runner.offload.cpu_adam.delayed import GUESS_BLOCK, LAST_LR, Delay
from offload_runner.offload.cpu_adam.gpu_share import Share
from offload_runner.offload.cpu_adam.landing import Link
from offload_runner.offload.cpu_adam.modes import Delayed, Exact, Mode
from offload_runner.offload.cpu_adam.shard import Shard
from offload_runner.offload.cpu_adam.update import Update
from offload_runner.offload.host_adam import (
    AdamSettings,
    HostAdam,
    Piece,
    adamw,
    grad_of,
    hyper,
    main_grad_views,
)

log = logging.getLogger("offload_runner")

HOST_BYTES_PER_PARAM = CPU_ADAM_PINNED_BYTES + CPU_ADAM_PAGEABLE_BYTES  # the planner's figures
HISTORY = 500  # CPU updates kept for the metrics
EXACT = Exact()


@dataclass(frozen=True)
class CpuSettings:
    """The CPU-Adam engine's own settings: its mode, the CPU team (threads, the cores they may
    use), where exact updates land, gradient clipping's norm, the GPU share (and whether it is
    balanced each step), the gradient buffer's dtype (None: fp32)."""

    mode: Mode = EXACT
    threads: int | None = None
    cpus: list[int] | None = None
    land_during_forward: bool = False
    clip_grad: float = 0.0
    gpu_share: float = 0.0
    balance: bool = False
    grad_dtype: object = None


class CpuAdam(HostAdam):
    """Adam for one DistributedOptimizer's shard, ``fraction`` of it on the CPU, in ``mode``
    (see the package's docstring and host_adam.HostAdam for the layout and checkpoints)."""

    def __init__(
        self,
        params,
        adam: AdamSettings,
        cpu: CpuSettings = CpuSettings(),
        worker: concurrent.futures.ThreadPoolExecutor | None = None,
    ) -> None:
        import torch

        # the DDP buffer's: bf16 with ddp.grad_reduce_in_fp32=false (2 B/param down, upcast here)
        self.grad_dtype = cpu.grad_dtype or torch.float32
        super().__init__(params, adam)
        mode, threads = cpu.mode, cpu.threads
        self.mode = mode
        self.threads = threads
        self.land_during_forward = cpu.land_during_forward
        self.clip_grad = cpu.clip_grad
        self._unlanded = False  # the host masters are newer than the bf16 params
        self._announced_delay = False
        self._unbound: dict | None = None  # see _grad
        numel = self.offloaded_numel
        self.shard = Shard(self.device, self.on_cuda, numel, min(self.chunk_numel, numel))
        self.history: list[Update] = self.shard.history
        self.link = Link(self.shard)
        on_gpu = not mode.predict  # weight prediction extrapolates on the CPU: no GPU share
        self.share = Share(self.shard, cpu.gpu_share * on_gpu, cpu.balance and on_gpu)
        self.delay = Delay(self.shard, self.link, self.clip_grad)
        self.columns = ExactColumns(self.shard, mode.columns)
        self._worker = worker or cpu_worker(cpu.cpus, threads, self.device)
        self._worker.submit(self._allocate).result()

    def _allocate(self) -> None:
        """In the worker, so its own threads touch the host pages first (NUMA placement): the
        masters and a gradient staging array page-locked (the copy engines read and write them),
        the moments pageable where only the CPU touches them (page-locked, and a state window,
        with a GPU share), with weight prediction the page-locked guess the landings read; a
        ring of two pieces of fp32 masters on the GPU, rounded into the bf16 params there."""
        import torch

        streams, s = self.share.wanted, self.shard
        self._allocate_states(pin_moments=streams, what="cpu_adam")
        self.host_grad = self._host_array(self.grad_dtype, self.on_cuda, "cpu_adam")
        s.grad, s.master = self.host_grad, self.host_master
        s.exp_avg, s.exp_avg_sq = self.host_exp_avg, self.host_exp_avg_sq
        if streams:  # the copy engines read and write the moments of the GPU share
            self.share.allocate(self.delayed)
        if self.mode.predict:  # delayed mode lands the masters extrapolated by their last update
            self.host_guess = s.guess = self._host_array(torch.float32, self.on_cuda, "cpu_adam")
        self.link.allocate(s.chunk_numel if self.on_cuda else 0)

    def step(self, closure=None):
        began = time.perf_counter()
        link, share, delay = self.link, self.share, self.delay
        link.complete()  # the last exact update, where the forward did not wait for all of it
        early, delay.early, delay.remaining = delay.early, {}, None  # copied during the backward
        self.ensure_pieces()
        share.prefetch(self._exact_next)
        step, hypers = self._next_step()
        delayed = self.mode.delayed_at(step)
        order = delay.order(delayed, list(early), share.on_cpu, self.land_during_forward)
        if delayed:
            self._enter_delayed(step)
            self._select_columns(step)
        link.start()
        if delayed and self.mode.predict and self._unlanded and not delay.guessed:
            self._worker.submit(self._guess_from_states).result()  # after a checkpoint load
        # Delayed mode lands the guess from the first delayed step on (the last exact update
        # made one); masters loaded or finished without a guess land as they are.
        guess = delayed and delay.guessed
        update = self._new_update(step, hypers, order, delayed)
        in_forward = self.land_during_forward and not delayed
        job = self._worker.submit(self._run_update, update)
        previous, delay.pending = delay.pending, None  # a delayed update: it lands piece by piece
        self._hand_over(update, early, previous, guess, began)
        self._unlanded = False
        if share.window is not None and not delayed:  # the GPU share, on the compute stream
            share.window.run(share.streamed, step, hypers)
        self._gpu_step(step, hypers)
        if delayed:
            delay.pending = update
            delay.jobs.append(job)
        elif in_forward:
            link.inflight = (update, job)  # the forward waits for it, module by module
        else:
            job.result()
        if not in_forward:
            link.wait_for_landings()
        if delayed:  # after the landings: the last update's masters of these columns are older
            self.columns.step(step, hypers, self._grad)
        link.downs_done()  # the grad buffer may be zeroed
        self._end_step(step)
        self._checkpointed(hypers)
        return None

    def _enter_delayed(self, step: int) -> None:
        """A delayed step: nothing lands during the forward any more (only exact steps do), and
        the switch is said once."""
        if self.link.hooks:
            self.link.unwatch()
        if not self._announced_delay:
            self._announced_delay = True
            log.info(
                "cpu_adam: delayed parameter updates from step %d on (the first %d steps "
                "were exact): the CPU update of step t lands before step t+2%s",
                step,
                step - 1,
                ", extrapolated by its own change (weight prediction)" if self.mode.predict else "",
            )

    def _select_columns(self, step: int) -> None:
        """Where update ``step`` selects the exact columns anew: once the CPU has finished the
        last update (it reads and writes the host arrays a selection reads and writes)."""
        if not self.columns.due(step, self.mode.exact_steps + 1):
            return
        for job in self.delay.jobs:
            job.result()
        self.columns.select(step, self._grad)

    def watch_columns(self, model_params: list) -> None:
        """Exact columns (delayed mode): their 2-D weights among ``model_params``."""
        if self.mode.columns:
            self.columns.watch(self.offloaded, model_params, self.flat_start)

    def _new_update(self, step: int, hypers: list[dict], order: list[int], delayed: bool) -> Update:
        """This step's update for the worker. The worker extrapolates in delayed mode, and at
        the last exact step for the first delayed one; it is handed the update first and takes
        each piece as soon as its copy is enqueued (enqueueing hundreds of copies takes the
        training thread a while)."""
        guess_next = self.mode.predict and self.mode.delayed_at(step + 1)
        return Update(
            step,
            hypers,
            land_in_worker=not delayed,
            guess=guess_next,
            on_cpu=self.share.on_cpu,
            params=sum(self._pieces[i].numel for i in order),
            order=order,
            late_share=delayed and self.share.window is not None,
            ready=[threading.Event() for _ in self._pieces],
            done=[threading.Event() for _ in self._pieces],
            landed=[threading.Event() for _ in self._pieces],
            unclipped=[False] * len(self._pieces),
        )

    def _checkpointed(self, hypers: list[dict]) -> None:
        """What a checkpoint keeps in the param groups: each group's last learning rate (for
        ``Delay.guess_from_states``) and the fixed GPU share (a resume keeps the same split)."""
        for group, h in zip(self.param_groups, hypers, strict=True) if self.mode.predict else ():
            group[LAST_LR] = h["lr"]
        self.share.checkpointed(self.param_groups)

    def ensure_pieces(self) -> None:
        """The pieces (forward order where updates land during the forward), the side streams
        and the CPU's share of the pieces, at the first step or the first armed backward."""
        if self._pieces is not None:
            return
        self._pieces = self._plan()
        if self.land_during_forward:  # forward order: the buffer is in backward order
            self._pieces.reverse()
        self.shard.pieces = self._pieces
        self.link.open(self.last_piece_needed)
        self.share.first_split()

    def _guess_from_states(self) -> None:
        """Weight prediction's guess after a checkpoint load (``Delay.guess_from_states``):
        each offloaded parameter's elements with its group's hyperparameters at the last
        update (the scheduler has moved the groups' learning rate since)."""
        hypers = [{**hyper(g), "lr": g.get(LAST_LR, g["lr"])} for g in self.param_groups]
        ranges = []
        for gi, p in self.offloaded:
            a = self.flat_start(p)
            ranges.append((a, a + p.numel(), hypers[gi]))
        self.delay.guess_from_states(self.steps_taken, ranges)

    @property
    def _exact_next(self) -> bool:
        """The coming step is exact."""
        return not self.mode.delayed_at(self.steps_taken + 1)

    def _grad(self, p):
        """... or, before the first ``step()`` bound it (a run resumed into a delayed step plans
        its pieces at its first backward), its model parameter's ``main_grad`` view."""
        grad = grad_of(p)
        hooked = self.delay.hooked
        if grad is None and hooked:
            if self._unbound is None:
                self._unbound = main_grad_views([q for _, q in self.offloaded], hooked.values())
            grad = self._unbound.get(id(p))
        return grad

    def _hand_over(
        self, update: Update, early: dict, previous: Update | None, guess: bool, began: float
    ) -> None:
        """Each piece of this step's update to the worker, in its order: its gradients down
        (unless they went during the backward: ``early``), the last delayed update's masters
        up as the worker finishes them (``previous``, whose errors raise here), or loaded
        masters landed first. A failure here cancels the update, so no worker waits for what
        will not come."""
        try:
            for i in update.order:
                piece, copied = self._pieces[i], early.pop(i, None)
                if copied is not None:  # down (and the last update up) during the backward
                    copied.result()
                    update.unclipped[i] = True
                if previous is None and (self._unlanded or guess):
                    self.link.land(piece, guess)
                if copied is None:  # as the worker finishes the last update, fetching behind it
                    self.delay.cross(i, previous)
                update.ready[i].set()
            if not any(update.unclipped):
                update.scaled.set()  # every gradient went down clipped
            update.boundary_s = time.perf_counter() - began + self.delay.taken_s  # + before_clip's
            self.delay.taken_s = 0.0
            if previous is not None:
                self.delay.jobs.pop(0).result()
        except BaseException:
            update.cancelled = True
            update.scaled.set()
            for ready in update.ready:
                ready.set()
            raise

    def _run_update(self, update: Update) -> None:
        """The worker: Adam on each piece as its gradients arrive (landed from here in exact
        mode; by ``step()`` in delayed mode, as each piece's ``done`` is set)."""
        try:
            self._update_pieces(update)
        except BaseException:
            update.failed = True
            for event in update.landed + update.done:  # nothing waits for what will not come
                event.set()
            raise

    def _update_pieces(self, update: Update) -> None:
        import torch

        began = time.perf_counter()
        late = self.share.split_late(update) if update.late_share else None
        steps = torch.tensor(float(update.step))
        landings: list[concurrent.futures.Future] = []
        on_gpu = set(update.on_gpu)
        for i in update.order:
            if i in on_gpu:
                continue
            t0 = time.perf_counter()
            scale = self._piece_ready(update, i)
            if update.cancelled:
                return
            t1 = time.perf_counter()
            self._adam_piece(self._pieces[i], update, steps, scale)
            update.wait_s += t1 - t0
            update.busy_s += time.perf_counter() - t1
            if update.land_in_worker:
                piece = self._pieces[i]
                landings.append(self.link.lander.submit(self.link.land_marked, piece, update, i))
            update.done[i].set()
        for landing in landings:  # enqueued (and errors raised) before step() waits on them
            landing.result()
        update.wall_s = time.perf_counter() - began  # the CPU's part (the balance compares it)
        if late is not None:
            late.result()
        self._keep(update)

    def _piece_ready(self, update: Update, i: int):
        """Wait until piece ``i``'s gradients are on the host and its last masters have gone
        up; returns the gradients' scale where they were taken before the clipping
        (Megatron-Core's factor), else None. The caller checks ``update.cancelled`` after."""
        piece = self._pieces[i]
        update.ready[i].wait()
        if update.cancelled:
            return None
        if piece.fetched is not None:
            piece.fetched.synchronize()
        if piece.landed is not None:
            piece.landed.synchronize()  # the last update's masters have gone up
        if not update.unclipped[i]:
            return None
        update.scaled.wait()
        return update.grad_scale

    def _adam_piece(self, piece: Piece, update: Update, steps, scale) -> None:
        """CPU Adam on one piece's groups; with a guess (delayed mode's extrapolation), in
        blocks whose arrays stay in the caches between the three passes."""
        for a, b, gi in piece.groups:
            if not update.guess:
                self._adam(a, b, update.hyper[gi], steps, scale)
                continue
            for c in range(a, b, GUESS_BLOCK):
                d = min(c + GUESS_BLOCK, b)
                self.host_guess[c:d].copy_(self.host_master[c:d])
                self._adam(c, d, update.hyper[gi], steps, scale)
                self.host_guess[c:d].lerp_(self.host_master[c:d], 2.0)  # 2 new - old
        if update.guess:
            self.delay.guessed = True

    def _keep(self, update: Update) -> None:
        """``update`` into the history the metrics read (the first two, warm-up, and the
        recent ones)."""
        self.history.append(update)
        if len(self.history) > 2:  # its per-piece events were last read during the last step
            self.history[-3].settle()
        if len(self.history) > 2 * HISTORY:
            del self.history[2:-HISTORY]

    def _adam(self, a: int, b: int, h: dict, steps, grad_scale=None) -> None:
        """AdamW on elements [a, b) of the host arrays (the gradients divided by
        ``grad_scale`` first, where given)."""
        adamw(
            [self.host_master[a:b]],
            [self.host_grad[a:b]],
            [self.host_exp_avg[a:b]],
            [self.host_exp_avg_sq[a:b]],
            steps,
            h,
            grad_scale,
        )

    def finish(self) -> None:
        """Wait for a delayed update (checkpoints: masters and states consistent; not landed)
        or an exact one landing during the forward, and the GPU share's copies out."""
        delay = self.delay
        self.link.complete()
        if self.share.window is not None:
            self.share.window.finish()
        if delay.pending is not None and not delay.pending.scaled.is_set():
            raise RuntimeError(
                "cpu_adam: an update whose gradients went down during the "
                "backward waits for grads_clipped(grad_norm) after the step"
            )
        while delay.jobs:
            delay.jobs.pop(0).result()
        if delay.pending is not None:
            delay.pending = None
            self._unlanded = True
        self.columns.write_back()  # the host arrays whole: the GPU's exact columns in them
        self.columns.checkpointed(self.param_groups)

    def flush(self) -> None:
        """Wait for and land a delayed update: the bf16 parameters are the newest."""
        self.finish()
        if self._pieces is None or not self._unlanded:
            return
        for piece in self._pieces:
            self.link.land(piece)
        self._unlanded = False
        self.link.wait_for_landings()

    def restore_after_load(self) -> None:
        """... and a GPU share the saved run had fixed: the resumed run splits as it did."""
        super().restore_after_load()
        self.share.restore(self.param_groups)
        self.columns.restore(self.param_groups)

    def _land_loaded_masters(self) -> None:
        """Delayed mode lands the loaded masters (or their extrapolation) at the next step, as
        the uninterrupted run would."""
        if self.delayed:
            self._unlanded, self.delay.guessed = True, False
            return
        super()._land_loaded_masters()
        self._unlanded = False

    def close(self) -> None:
        pending = self.delay.pending
        if pending is not None and not pending.scaled.is_set():
            pending.cancelled = True  # a run that stopped between step and clip factor
            pending.scaled.set()
        self.finish()
        self.delay.close()
        self._worker.shutdown(wait=True)  # shared by a rank's engines: the first close waits
        self.link.close()  # after the worker: it hands the lander exact mode's landings
        self.share.close()
        self._arenas.release()

    def metrics(self, skip: int = 2) -> dict:
        steady = self.history[skip:] or self.history
        if not steady:
            return {}
        busy = statistics.median(u.busy_s for u in steady)
        on_cpu = statistics.median(u.params for u in steady)
        window = self.share.window
        passes = window.timing()[skip:] if window is not None else []
        return {
            "cpu_offloaded_params": self.offloaded_numel,
            "cpu_adam_params_on_cpu": on_cpu,
            "cpu_adam_params_per_s": on_cpu / busy if busy else None,
            "cpu_adam_busy_s_median": busy,
            "cpu_adam_params_on_gpu": statistics.median(n for _, n in passes) if passes else 0,
            "cpu_adam_stream_s_median": statistics.median(t for t, _ in passes) if passes else 0.0,
            # the GPU share's params whose states came in during the last backward
            "cpu_adam_in_backward_params": statistics.median(window.grown[skip:])
            if passes and window.grown[skip:]
            else 0,
            "cpu_adam_wall_s_median": statistics.median(u.wall_s for u in steady),
            "cpu_adam_wait_s_median": statistics.median(u.wait_s for u in steady),
            "cpu_adam_forward_wait_s_median": statistics.median(u.forward_wait_s for u in steady),
            "cpu_adam_boundary_s_median": statistics.median(u.boundary_s for u in steady),
            "cpu_adam_pieces_in_backward": statistics.median(sum(u.unclipped) for u in steady),
            "cpu_adam_threads": self.threads,
            "cpu_adam_pieces": len(self._pieces or []),
        }

    @property
    def arms(self) -> bool:
        """Copies during the last backward (delayed mode), or a GPU share's states coming in."""
        return self.mode.copy_during_backward or self.streams_states

    @property
    def delayed(self) -> bool:
        """Delayed mode (its first exact steps included)."""
        return isinstance(self.mode, Delayed)

    # What the engines' callers ask (host_adam.HostAdam's hooks), answered by the parts.
    @property
    def streams_states(self) -> bool:
        return self.share.window is not None

    @property
    def window_bytes(self) -> int:
        return self.share.window.nbytes if self.share.window is not None else 0

    def arm(self) -> None:
        """The last micro-batch's backward follows: the GPU share's states may come in during
        it (exact steps), this step's gradients go down during it (delayed steps: a run resumed
        into one plans its pieces here, at its first backward)."""
        exact = self._exact_next
        self.share.arm(exact)
        copies = not exact and bool(self.delay.grad_hooks)
        if copies:
            self.ensure_pieces()
        self.delay.arm(self.piece_spans() if copies else None)

    def grow(self, reserve: int = 0) -> None:
        self.share.grow(reserve)

    def prefetch(self) -> None:
        self.share.prefetch(self._exact_next)

    def watch(self, chunks) -> None:
        self.link.watch(chunks)

    def watch_backward(self, chunks) -> None:
        self.delay.watch_backward(chunks)

    def copies_taken(self) -> None:
        self.delay.copies_taken()

    def grads_clipped(self, grad_norm: float | None) -> None:
        self.delay.grads_clipped(grad_norm)
