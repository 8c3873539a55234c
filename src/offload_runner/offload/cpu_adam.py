"""CPU-Adam optimizer offload: offload-runner's engine for ``optimizer_offload_fraction`` of Adam.

``offload/optimizer=cpu_adam`` (exact) and ``offload/optimizer=cpu_adam_delayed`` (delayed parameter
update, ZeRO-Offload's DPU). The engine is the inner optimizer of each Megatron-Core
DistributedOptimizer (built by ``get_megatron_optimizer`` on its precision-aware path, where the
inner optimizer owns the fp32 masters): a HybridDeviceOptimizer by type, so Megatron-Core keeps
every other duty (gradient reduce-scatter, norm and clipping, zero_grad, scheduler, parameter
all-gather) and checkpoints it with HybridDeviceOptimizer's layout (``state[param]`` holds
``master_param``, ``exp_avg``, ``exp_avg_sq``; the step count lives in the param groups).

What lives where, per rank: the GPU keeps the bf16 parameters and the fp32 gradient buffer. For
the offloaded part the host keeps exp_avg and exp_avg_sq (8 B/param, pageable: only the CPU touches
them), and, page-locked because the copy engines read or write them, the fp32 masters and a
gradient staging buffer (8 B/param). The rest of Adam stays on the GPU (torch's fused AdamW on fp32
masters, the same kernel the CPU runs).

One step, exact mode (Megatron-Core calls ``step()`` after the norm and clipping):

1. the side stream ``d2h`` copies the clipped gradients of the offloaded shard to the host in
   pieces of ``chunk_mb`` (one copy per piece: the shard is contiguous in the DDP buffer);
2. a CPU worker thread takes the pieces in order as their copies complete and runs
   ``torch._fused_adamw_`` on each (with the lr, weight decay and step captured when ``step()``
   was called);
3. each finished piece's fp32 masters go up (enqueued by a landing thread, so the worker goes
   straight on to the next piece) on the side stream ``h2d`` into a small GPU ring
   buffer and are rounded to bf16 into the parameter buffer there (the same round-to-nearest-even
   as on the CPU, but the CPU spends its memory bandwidth on Adam alone; the link carries 4 B/param
   up instead of 2, and it is idle otherwise);
4. meanwhile the GPU part of Adam runs on the compute stream;
5. landing during the forward (where no data-parallel
   parameter all-gather follows the step): ``step()`` returns once every piece is handed over;
   the pieces run in forward order (the DDP buffer's reverse), and a forward pre-hook on each
   module that holds parameters makes the compute stream wait for the landing of the last piece
   holding them (landings run in order on one stream), so the next forward starts with the
   embedding's update and follows the CPU layer by layer. Otherwise (DP > 1) the compute stream
   waits for the last copy back before Megatron-Core's parameter all-gather.

So the CPU step overlaps both copies and, landing during the forward, the next forward; the cost
over GPU Adam is about the CPU Adam time, ``offloaded params / rate`` (fused CPU AdamW: 4-6 G
params/s on 16 cores), less the forward that runs behind it. A rank's engines (a MoE model's
dense and expert shards) share one worker thread, so their updates take the cores in turn.

Exact mode's GPU share (``optimizer.cpu_adam_gpu_share``): the CPU's 4 B/param each way leave
the link mostly idle during the update, and fused CPU AdamW is bound by the host's memory
bandwidth, which the copy engines share without taking much of the CPU's rate. So the last
pieces in forward order (``_streamed``) are updated by the GPU instead, over their masters and
moments streamed through a state window (optimizer_states.StatesWindow, 12 B/param each way, on
the compute stream ahead of the next forward), while the worker updates the first ones: the
update takes about max(CPU share / CPU rate, link time) instead of all params / CPU rate. Every
state still lives on the host (its moments page-locked then); the step holds the window of up
to 4 pieces. With the share unset (null) each exact step moves the split half way to where the
CPU and the window, at the rates they just reached side by side, finish together
(``_rebalance``), starting from the planner's balance (step_cost.balanced_gpu_share).

Delayed mode's GPU share (the same key; its preset sets 0): the worker, once the last update is
done, splits each delayed update along its order (``_late_pieces``): the CPU takes the pieces the
next backward lands first, the window the last ones. A thread of its own (``_late_pass``) streams
their masters, moments and gradients (down during the backward already) up through the window
on a side stream under the next forward+backward (StatesWindow.run_late, 16 B/param up, 12
back), runs Adam there and marks each piece done once its states are back on the host, where the
next landing reads its masters as it reads the CPU's. The balance counts the link's whole load:
every piece's landing rides it too. It pays where the update outlasts forward+backward several
times (docs/BENCHMARKS.md, cpu-adam-late-share); not with weight prediction (validation).

Delayed mode (after ``exact_steps`` exact steps): ``step()`` lands the previous update piece by
piece as the worker finishes each (its masters go up while this step's gradients of the same
piece go down, both directions at once), hands this step's update to the worker and returns: the
worker runs during the next forward and backward, and its result lands at the next ``step()``: the
forward of step t+1 sees the update of step t-1. The worker takes a delayed update's pieces in
the order their gradients came down (``_update_order``: backward-ready, the last layers first),
and the next step lands them in that order, so each landing waits for its own piece only. The
GPU share of Adam stays exact. This step's
gradients must be down before the grad buffer is zeroed and the last update up before the next
forward (4 B/param each way, both at once). On one GPU (``backward_copies_allowed``,
``watch_backward``) both run during the last micro-batch's backward, each piece as soon as its
gradients are final (they are unclipped then: the worker applies Megatron-Core's clip factor,
``grads_clipped``), so ``step()`` only hands the update over; elsewhere at ``step()``. The
fraction delayed mode hides (``cpu_adam_hidden_fraction``) keeps what the copies add to the step
(beyond the last backward, or all of them at the boundary) and the training thread's slowdown
beside CPU Adam (``launch_slowdown``) within ``planner.delayed_max_overhead``. Checkpoints are
taken with the worker finished but its result not landed, so the saved masters are one update
ahead of the saved bf16 weights; after a load the first step lands them, which resumes the
uninterrupted run exactly.

Weight prediction (delayed mode, ``optimizer.cpu_adam_weight_prediction=true``): what
lands at step t is not the masters w_(t-1) but w_(t-1) + (w_(t-1) - w_(t-2)), the last update
applied once more, so step t+1's forward runs on about the weights exact mode would give it
(Adam's momentum makes consecutive updates close) instead of one update behind: the gradient that
update t+1 applies to w_t is taken near w_t. The masters and moments stay exact DPU. The worker
copies each block of masters aside before Adam and extrapolates after it (``lerp`` with weight 2)
into a page-locked array the landing reads, while the block is still in the caches; after a
checkpoint load, where w_(t-1) is gone, the guess is the last update recomputed from exp_avg,
exp_avg_sq and the step (the learning rate of that update is kept in the param groups). The end of
training lands the masters themselves. The cost is the CPU's: about 1.9x the CPU step (a copy
and an extrapolation per param beside Adam), so it suits fractions whose CPU work hides with room
to spare. Measured (docs/BENCHMARKS.md, suite cpu-adam-conv): on the MoE proxy at GBS 4, delayed
updates fall behind no-offload training where the loss falls fastest, and prediction recovers
part of that lag, not all; on a toy transformer (bench/delayed_update_toy.py) it recovers exact
mode's curve.

Which parameters go to the CPU at a fraction < 1: whole parameter shards, in the order of the DDP
buffer, which is backward-ready order (the output layer and last layers first): their gradients
are final first, and the next forward needs them last. In delayed mode the expert part of a MoE
model is offloaded before the dense part: routed experts see a fraction of the tokens each step,
so one step of staleness should cost them least (``attach`` warns when the fraction reaches past
the experts). Megatron-Core gives the experts a part of their own only with expert parallelism;
at EP=1 they sit in the dense part, in its buffer order. On the proxy at EP=1 (suite
cpu-adam-conv in docs/BENCHMARKS.md) delayed updates of every parameter ended outside the
seeds' noise, and of the buffer's first 79% (the embedding and first layers exact) within it.
``optimizer.cpu_adam_delayed_scope=experts`` keeps every state on the host all the same: the
expert part's engine is delayed, the dense part's exact (its update lands during the next forward,
with the GPU share); the one worker runs the dense part's update first, as Megatron-Core's
ChainedOptimizer steps it first, then the experts' under the next forward+backward. On the
proxy at EP2 over 200 iterations (suite cpu-adam-ep2-conv) it ended within the seeds' noise.

The cost model: exact step = GPU step + params/rate (the copies hide behind the CPU work: 4 B/param
each way against 50 GB/s), with a GPU share the larger of its CPU part and its link time
(step_cost.exact_update_seconds); delayed step = max(GPU step + copy time not hidden,
params/rate); measured (docs/BENCHMARKS.md, "Delayed mode's step boundary"), the CPU update also
slows the kernel-launching training thread on a launch-bound model. State offload
(offload/optimizer=states) moves 12 B/param each way instead and keeps
Adam on the GPU: on a PCIe host the CPU engine usually wins; on a link several times faster
(Grace-Hopper class C2C) state offload does.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import math
import os
import statistics
import threading
import time
from dataclasses import dataclass, field

from offload_runner.config.schema import (
    RunConfig,
    cpu_adam_copies_during_backward,
    cpu_adam_delays_dense,
    cpu_adam_late_share,
    cpu_adam_on,
    cpu_adam_streams,
)
from offload_runner.hardware import (
    CPU_ADAM_PAGEABLE_BYTES,
    CPU_ADAM_PINNED_BYTES,
    LATE,
    rank_cpus,
    worker_cpus,
)
from offload_runner.model_size import count_parameters
from offload_runner.offload import host_adam, optimizer_states
from offload_runner.offload.base import OffloadSummary
from offload_runner.offload.host_adam import HostAdam, Piece, adamw, hyper, torch_adamw
from offload_runner.offload.optimizer_states import StatesWindow
from offload_runner.plan import GiB, part_delays, part_fractions
from offload_runner.step_cost import (
    copy_seconds_per_param,
    copy_window,
    hidden_fraction,
    param_count,
    step_cost,
)

log = logging.getLogger("offload_runner")

HOST_BYTES_PER_PARAM = CPU_ADAM_PINNED_BYTES + CPU_ADAM_PAGEABLE_BYTES  # the planner's figures
LAST_LR = "last_update_lr"  # param-group key: the learning rate of the last update
GPU_SHARE = "cpu_adam_gpu_share"  # param-group key: the fixed GPU share, for a resume
BALANCE_STEPS = 6  # a balanced GPU share moves at the steps up to this one, then stays fixed
GUESS_BLOCK = 4 * 1024**2  # elements: weight prediction's copy, Adam and extrapolation in turn
HISTORY = 500  # CPU updates kept for the metrics


DISABLED = {"optimizer.cpu_offload_engine": "hybrid", "optimizer.cpu_adam_delayed_update": False}


def exact_steps(run: RunConfig) -> int:
    o = run.optimizer
    return o.cpu_adam_exact_steps if o.cpu_adam_exact_steps is not None else (
        run.scheduler.lr_warmup_iters
    )  # fmt: skip


def runtime_environment(run: RunConfig) -> dict[str, str]:
    """OpenMP threads that sleep when idle: the worker's thread team would otherwise spin on every
    core between its Adam calls and starve the training thread's kernel launches (measured: the
    proxy's forward and backward took seconds instead of 0.3). Set before torch is imported
    (torchrun's workers inherit it); a value the user exported wins."""
    if not cpu_adam_on(run) or "OMP_WAIT_POLICY" in os.environ:
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


def describe(run: RunConfig) -> OffloadSummary:
    group = "offload/optimizer=cpu_adam*"
    if not cpu_adam_on(run):
        return OffloadSummary("optimizer (cpu adam)", group, False, "-")
    o = run.optimizer
    params = count_parameters(run.model).total * o.optimizer_offload_fraction
    mode = (
        f"delayed parameter update after {exact_steps(run)} exact steps"
        + (", weight prediction" if o.cpu_adam_weight_prediction else "")
        + ("" if cpu_adam_delays_dense(run) else " for the routed experts; the dense part exact")
        if o.cpu_adam_delayed_update
        else "exact: each update lands before the next forward needs it"
    )
    return OffloadSummary(
        "optimizer (cpu adam)",
        group,
        True,
        f"{o.optimizer_offload_fraction:.0%} of Adam: fp32 master + states of "
        f"~{param_count(params)} params on the host, updated in {o.cpu_adam_chunk_mb} MiB pieces",
        mode,
    )


def default_threads(run: RunConfig, cpus: list[int]) -> int:
    """One OpenMP thread per core the team may use (``worker_cpus``), unless configured."""
    return run.optimizer.cpu_adam_threads or len(cpus)


def cpu_worker(cpus: list[int] | None, threads: int | None, device=None):
    """The thread that runs CPU Adam, pinned to ``cpus`` with an OpenMP team of ``threads``. One
    per rank, shared by its engines (a MoE model's dense and expert shards): their updates take
    the cores in turn instead of splitting them."""
    return concurrent.futures.ThreadPoolExecutor(
        1, thread_name_prefix="cpu-adam", initializer=_init_thread,
        initargs=(cpus, threads, device),
    )  # fmt: skip


def _init_thread(cpus: list[int] | None, threads: int | None, device) -> None:
    """An engine thread: its cores (its OpenMP team inherits the mask), its team's size, and its
    CUDA calls on the engine's GPU."""
    import torch

    if cpus:
        os.sched_setaffinity(0, cpus)
    if threads:
        torch.set_num_threads(threads)
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


# --- the engine ----------------------------------------------------------------------------------


@dataclass
class _Update:
    """One CPU update: the hyperparameters captured at ``step()`` and what the worker measured."""

    step: int
    hyper: list[dict]  # per param group: lr, weight_decay, beta1, beta2, eps
    land_in_worker: bool
    on_cpu: int = 0  # pieces [0, on_cpu) run on the CPU (exact mode's GPU share follows them)
    params: int = 0  # ... holding this many params
    guess: bool = False  # also extrapolate the updated masters into host_guess
    # threading.Event per piece: its gradients' copy (and any landing before it) is enqueued
    ready: list = field(default_factory=list)
    order: list = field(default_factory=list)  # the pieces' indices in the order the worker takes
    # delayed mode's GPU share: the worker splits ``order`` (``late_share``), the pieces that
    # pass through the window instead of the CPU (``on_gpu``)
    late_share: bool = False
    on_gpu: list = field(default_factory=list)
    done: list = field(default_factory=list)  # threading.Event per piece: Adam has run on it
    # threading.Event per piece, exact mode: its landing is enqueued (or the update failed)
    landed: list = field(default_factory=list)
    waited: int = 0  # landing during the forward: the pieces before this one are waited for
    # delayed mode copying during the backward: per piece, its gradients went down before the
    # clipping; the worker divides them by grad_scale (1 / Megatron-Core's clip factor, None:
    # no clipping) once ``scaled`` is set (grads_clipped, after the step's grad norm is known)
    unclipped: list = field(default_factory=list)
    scaled: threading.Event = field(default_factory=threading.Event)
    grad_scale: object = None
    boundary_s: float = 0.0  # step(): from its start until every piece was handed to the worker
    failed: bool = False  # the worker or a landing raised: job.result() says what
    cancelled: bool = False  # step() failed before every piece was ready: the worker stops
    busy_s: float = 0.0  # the worker's own work: its Adam calls
    wait_s: float = 0.0  # waiting for gradient copies
    forward_wait_s: float = 0.0  # landing during the forward: the forward waiting for it
    wall_s: float = 0.0


class CpuAdam(HostAdam):
    """Adam for one DistributedOptimizer's shard, ``fraction`` of it on the CPU (see module doc
    and host_adam.HostAdam for the layout and checkpoints)."""

    def __init__(
        self,
        params,
        *,
        fraction: float,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        delayed: bool = False,
        exact_steps: int = 0,
        predict: bool = False,
        threads: int | None = None,
        cpus: list[int] | None = None,
        chunk_bytes: int = 64 * 1024**2,
        order_key=None,
        land_during_forward: bool = False,
        copy_during_backward: bool = False,
        clip_grad: float = 0.0,
        gpu_share: float = 0.0,
        balance: bool = False,
        worker: concurrent.futures.ThreadPoolExecutor | None = None,
        moment_dtypes: tuple = (),
        grad_dtype=None,
    ) -> None:
        import torch

        # the DDP buffer's: bf16 with ddp.grad_reduce_in_fp32=false (2 B/param down, upcast here)
        self.grad_dtype = grad_dtype or torch.float32
        super().__init__(params, fraction=fraction, lr=lr, weight_decay=weight_decay,
                         betas=betas, eps=eps, chunk_bytes=chunk_bytes,
                         order_key=order_key, moment_dtypes=moment_dtypes)  # fmt: skip
        self.delayed = delayed
        self.exact_steps = exact_steps
        self.predict = delayed and predict
        self._guessed = False  # host_guess holds the next weights' extrapolation
        self.threads = threads
        self.land_during_forward = land_during_forward
        self._inflight: tuple[_Update, concurrent.futures.Future] | None = None  # see watch()
        self._needs: dict[int, int] = {}  # id(module) -> the last piece its parameters touch
        self._spans: list[tuple[int, int]] | None = None  # see _pieces_of
        self._hooks: list = []
        # delayed mode, copies during the backward (see watch_backward)
        self.copy_during_backward = delayed and copy_during_backward
        self.clip_grad = clip_grad
        # the GPU share (see prefetch and _late_pass): Adam on the GPU, the states streamed
        # (weight prediction extrapolates on the CPU: none there)
        self.gpu_share = 0.0 if self.predict else gpu_share
        self.balance = balance and not self.predict
        self._share = self.gpu_share  # the share now (the balance moves it)
        self._fixed = not self.balance  # the share moves no more (BALANCE_STEPS, or loaded)
        self._window: StatesWindow | None = None
        self._late: concurrent.futures.ThreadPoolExecutor | None = None  # issues late passes
        self._late_stream = None  # ... on this side stream
        self._on_cpu = 0  # exact: pieces [0, _on_cpu) run on the CPU, the rest through the window
        self._streamed: list[Piece] = []  # this step's GPU share: _pieces[_on_cpu:]
        self._balanced_at = 0  # the step whose timing last moved the split
        self._grad_hooks: list = []
        self._hooked: dict[int, object] = {}  # id(param) -> param, the backward hooks' params
        self._param_pieces: dict[int, list[int]] | None = None  # id(param) -> pieces it touches
        self._piece_params: list[int] = []  # per piece: how many hooked params touch it
        self._remaining: list[int] | None = None  # armed: per piece, params not yet final
        self._previous: _Update | None = None  # armed: the update the backward lands
        self._early: dict[int, concurrent.futures.Future] = {}  # piece -> its copies' job
        self._pending: _Update | None = None  # a delayed update, not landed
        self._jobs: list[concurrent.futures.Future] = []
        self._unlanded = False  # the host masters are newer than the bf16 params
        self._announced_delay = False
        self.history: list[_Update] = []
        self._land_lock = threading.Lock()  # the GPU ring: the worker and step() both land
        self._worker = worker or cpu_worker(cpus, threads, self.device)
        self._worker.submit(self._allocate).result()
        # Exact mode's landings: enqueueing a piece's copies costs the calling thread real time
        # (cudaMemcpyAsync in docs/evidence/profile-gbs4-cpu-adam.txt), so a thread of its own
        # enqueues them while the worker runs Adam on the next piece.
        self._lander = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="cpu-adam-land", initializer=_init_thread,
            initargs=(None, None, self.device),
        )  # fmt: skip

    # -- memory ----------------------------------------------------------------------------
    def _allocate(self) -> None:
        """In the worker, so its own threads touch the host pages first (NUMA placement): the
        masters and a gradient staging array page-locked (the copy engines read and write them),
        the moments pageable where only the CPU touches them (page-locked, and a state window,
        with a GPU share), with weight prediction the
        page-locked guess the landings read; a ring of two pieces of fp32 masters on the GPU,
        rounded into the bf16 params there."""
        import torch

        streams = bool(self.gpu_share or self.balance) and self.offloaded_numel > 0
        self._allocate_states(pin_moments=streams, what="cpu_adam")
        self.host_grad = self._host_array(self.grad_dtype, self.on_cuda, "cpu_adam")
        if streams:  # the copy engines read and write the moments of the GPU share
            self._window = StatesWindow(
                (self.host_master, self.host_exp_avg, self.host_exp_avg_sq), self.device,
                min(self.chunk_numel, self.offloaded_numel),
                host_grad=self.host_grad if self.delayed else None,
            )  # fmt: skip
            if self.delayed:  # late passes: issued from a thread of their own, on a side stream
                self._late = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="cpu-adam-late", initializer=_init_thread,
                    initargs=(None, None, self.device),
                )  # fmt: skip
                self._late_stream = torch.cuda.Stream() if self.on_cuda else None
        if self.predict:  # what delayed mode lands: the masters extrapolated by their last update
            self.host_guess = self._host_array(torch.float32, self.on_cuda, "cpu_adam")
        ring = min(self.chunk_numel, self.offloaded_numel) if self.on_cuda else 0  # see
        # plan.cpu_adam_ring_bytes
        self._ring = [torch.empty(ring, dtype=torch.float32, device=self.device) for _ in range(2)]
        self._landings = 0

    # -- the step -------------------------------------------------------------------------
    def step(self, closure=None):
        import torch

        began = time.perf_counter()
        self._complete()  # the last exact update, where the forward did not wait for all of it
        early, self._early, self._remaining = self._early, {}, None  # copied during the backward
        if self._pieces is None:
            self._pieces = self._plan()
            if self.land_during_forward:  # forward order: the buffer is in backward order
                self._pieces.reverse()
            self._streams = (torch.cuda.Stream(), torch.cuda.Stream()) if self.on_cuda else None
            self._on_cpu = self._cpu_pieces(self._share) if self._window else len(self._pieces)
        self.prefetch()
        step, hypers = self._next_step()
        delayed = self.delayed and step > self.exact_steps
        order = self._update_order(delayed, list(early))
        if delayed and self._hooks:  # only exact steps land during the forward
            self._unwatch()
        if delayed and not self._announced_delay:
            self._announced_delay = True
            log.info("cpu_adam: delayed parameter updates from step %d on (the first %d steps "
                     "were exact): the CPU update of step t lands before step t+2%s", step,
                     step - 1, ", extrapolated by its own change (weight prediction)"
                     if self.predict else "")  # fmt: skip
        self._start_fetch()
        if delayed and self.predict and self._unlanded and not self._guessed:
            self._worker.submit(self._guess_from_states).result()  # after a checkpoint load
        # Delayed mode lands the guess from the first delayed step on (the last exact update
        # made one); masters loaded or finished without a guess land as they are.
        guess = delayed and self._guessed
        # The worker extrapolates in delayed mode, and at the last exact step for the first
        # delayed one. It is handed the update first and takes each piece as soon as its copy
        # is enqueued (enqueueing hundreds of copies takes the training thread a while).
        guess_next = self.predict and step >= self.exact_steps
        update = _Update(step, hypers, land_in_worker=not delayed, guess=guess_next,
                         on_cpu=self._on_cpu, params=sum(self._pieces[i].numel for i in order),
                         order=order, late_share=delayed and self._window is not None,
                         ready=[threading.Event() for _ in self._pieces],
                         done=[threading.Event() for _ in self._pieces],
                         landed=[threading.Event() for _ in self._pieces],
                         unclipped=[False] * len(self._pieces))  # fmt: skip
        in_forward = self.land_during_forward and not delayed
        job = self._worker.submit(self._run_update, update)
        previous, self._pending = self._pending, None  # a delayed update: it lands piece by piece
        self._hand_over(update, early, previous, guess, began)
        self._unlanded = False
        if self._window is not None and not delayed:  # the GPU share, on the compute stream
            self._window.run(self._streamed, step, hypers)
        self._gpu_step(step, hypers)
        if delayed:
            self._pending = update
            self._jobs.append(job)
        elif in_forward:
            self._inflight = (update, job)  # the forward waits for it, module by module
        else:
            job.result()
        if not in_forward:
            self._wait_for_landings()
        if self._streams is not None:  # the grad buffer may be zeroed
            torch.cuda.current_stream().wait_stream(self._streams[0])
        self._end_step(step)
        for group, h in zip(self.param_groups, hypers, strict=True) if self.predict else ():
            group[LAST_LR] = h["lr"]  # checkpointed with the groups, for _guess_from_states
        for group in self.param_groups if self._window is not None and self._fixed else ():
            group[GPU_SHARE] = self._share  # checkpointed: a resume keeps the same split
        return None

    def _hand_over(self, update: _Update, early: dict, previous: _Update | None, guess: bool,
                   began: float) -> None:  # fmt: skip
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
                    self._land(piece, guess)
                if copied is None:  # as the worker finishes the last update, fetching behind it
                    self._cross(i, previous)
                update.ready[i].set()
            if not any(update.unclipped):
                update.scaled.set()  # every gradient went down clipped
            update.boundary_s = time.perf_counter() - began
            if previous is not None:
                self._jobs.pop(0).result()
        except BaseException:
            update.cancelled = True
            update.scaled.set()
            for ready in update.ready:
                ready.set()
            raise

    # -- exact mode's GPU share ---------------------------------------------------------------
    @property
    def streams_states(self) -> bool:
        return self._window is not None

    @property
    def window_bytes(self) -> int:
        return self._window.nbytes if self._window is not None else 0

    def prefetch(self) -> None:
        """Exact mode's GPU share: where the split between the CPU and the GPU falls this step
        (``_rebalance``), and the first of the GPU share's states coming in (at the tail of
        backward, through optimizer_states' hook; ``step()`` does it where nothing did)."""
        if self._window is None or self._pieces is None or self._window.prefetched:
            return
        if self.delayed and self.steps_taken + 1 > self.exact_steps:
            return  # a late pass: the worker splits the update (_update_pieces)
        self._window.finish()  # pieces the last pass streamed may go to the CPU now
        self._rebalance()
        self._on_cpu = self._cpu_pieces(self._share)
        self._streamed = self._pieces[self._on_cpu :]
        self._window.prefetch(self._streamed)

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
            log.info("cpu_adam: the GPU share is fixed at %.3f from step %d on (checkpointed)",
                     self._share, last.step + 1)  # fmt: skip

    def _update_order(self, delayed: bool, crossed: list[int]) -> list[int]:
        """The order the worker takes the pieces in. Exact: the pieces' own (forward order where
        the next forward waits for them), the CPU's share of them (``_on_cpu``). Delayed: the
        order their gradients went down during the backward (``crossed``), then backward-ready
        order: the worker starts on the gradients that are down first, and the next step lands
        its pieces in that order again (during the backward, or at ``step()``, which follows
        this order too); in forward order it would start on the first layers' gradients, the
        last to come down, and every landing of the next backward would wait for the update's
        end."""
        pieces = range(len(self._pieces))
        if not delayed:
            return list(pieces[: self._on_cpu])
        backward = pieces[::-1] if self.land_during_forward else pieces  # the DDP buffer's order
        seen = set(crossed)
        return crossed + [i for i in backward if i not in seen]

    def _late_pieces(self, order: list[int]) -> list[int]:
        """Delayed mode's GPU share: the pieces at the end of ``order`` (the update's, the order
        the next backward lands them in), holding about the share of the params: the CPU takes
        those the next backward needs first, the window those it needs last."""
        return order[self._cpu_pieces(self._share, order) :]

    def _late_pass(self, update: _Update) -> None:
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

        freed = self._window.run_late(pieces, update.step, update.hyper, self._late_stream,
                                      before_load, scale_of)  # fmt: skip
        for i, event in zip(update.on_gpu, freed, strict=True):
            if event is not None:
                event.synchronize()
            update.done[i].set()

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

    def _run_update(self, update: _Update) -> None:
        """The worker: Adam on each piece as its gradients arrive (landed from here in exact
        mode; by ``step()`` in delayed mode, as each piece's ``done`` is set)."""
        try:
            self._update_pieces(update)
        except BaseException:
            update.failed = True
            for event in update.landed + update.done:  # nothing waits for what will not come
                event.set()
            raise

    def _update_pieces(self, update: _Update) -> None:
        import torch

        began = time.perf_counter()
        late = None
        if update.late_share:  # the last update and its pass are done: this one's split
            self._window.finish()
            self._rebalance()
            update.on_gpu = self._late_pieces(update.order)
            update.params -= sum(self._pieces[i].numel for i in update.on_gpu)
            if update.on_gpu:
                late = self._late.submit(self._late_pass, update)
        steps = torch.tensor(float(update.step))
        landings: list[concurrent.futures.Future] = []
        on_gpu = set(update.on_gpu)
        for i in update.order:
            if i in on_gpu:
                continue
            piece, ready, done = self._pieces[i], update.ready[i], update.done[i]
            t0 = time.perf_counter()
            ready.wait()
            if update.cancelled:
                return
            if piece.fetched is not None:
                piece.fetched.synchronize()
            if piece.landed is not None:
                piece.landed.synchronize()  # the last update's masters have gone up
            scale = None
            if update.unclipped[i]:  # taken before the clipping: Megatron-Core's factor
                update.scaled.wait()
                scale = update.grad_scale
                if update.cancelled:
                    return
            t1 = time.perf_counter()
            for a, b, gi in piece.groups:
                if not update.guess:
                    self._adam(a, b, update.hyper[gi], steps, scale)
                    continue
                # in blocks whose arrays stay in the caches between the three passes
                for c in range(a, b, GUESS_BLOCK):
                    d = min(c + GUESS_BLOCK, b)
                    self.host_guess[c:d].copy_(self.host_master[c:d])
                    self._adam(c, d, update.hyper[gi], steps, scale)
                    self.host_guess[c:d].lerp_(self.host_master[c:d], 2.0)  # 2 new - old
            if update.guess:
                self._guessed = True
            t2 = time.perf_counter()
            update.wait_s += t1 - t0
            update.busy_s += t2 - t1
            if update.land_in_worker:
                landings.append(self._lander.submit(self._land_marked, piece, update, i))
            done.set()
        for landing in landings:  # enqueued (and errors raised) before step() waits on them
            landing.result()
        update.wall_s = time.perf_counter() - began  # the CPU's part (the balance compares it)
        if late is not None:
            late.result()
        self.history.append(update)
        if len(self.history) > 2 * HISTORY:
            del self.history[2:-HISTORY]  # keep the first two (warm-up) and the recent ones

    def _land_marked(self, piece: Piece, update: _Update, index: int) -> None:
        """Exact mode's landing of a piece, then the mark the next forward waits for."""
        try:
            self._land(piece)
        except BaseException:
            update.failed = True
            raise
        finally:
            update.landed[index].set()

    def _adam(self, a: int, b: int, h: dict, steps, grad_scale=None) -> None:
        """torch's fused AdamW on elements [a, b) of the host arrays (the gradients divided by
        ``grad_scale`` first, where given)."""
        adamw(
            [self.host_master[a:b]],
            [self.host_grad[a:b]],
            [self.host_exp_avg[a:b]],
            [self.host_exp_avg_sq[a:b]],
            torch_adamw(steps, h, grad_scale),
        )

    def _guess_from_states(self) -> None:
        """The extrapolation from Adam's state alone (after a checkpoint load, where the masters
        before the last update are gone): the last update recomputed from exp_avg, exp_avg_sq,
        the step count and the param groups' hyperparameters, added once more."""
        step = self.steps_taken
        if step < 1:
            self.host_guess.copy_(self.host_master)
        else:  # the learning rate of that update: the scheduler has moved the groups' since
            hypers = [{**hyper(g), "lr": g.get(LAST_LR, g["lr"])} for g in self.param_groups]
            for gi, p in self.offloaded:
                a = self._flat[id(p)]
                self._extrapolate(a, a + p.numel(), hypers[gi], step)
        self._guessed = True

    def _extrapolate(self, a: int, b: int, h: dict, step: int) -> None:
        """host_guess[a:b] = master - lr wd master - lr / (1 - beta1^t) m / (sqrt(v / (1 -
        beta2^t)) + eps): torch's AdamW update of step t applied once more."""
        guess, master = self.host_guess[a:b], self.host_master[a:b]
        bias1, bias2 = 1 - h["beta1"] ** step, 1 - h["beta2"] ** step
        guess.copy_(self.host_exp_avg_sq[a:b]).sqrt_().div_(bias2**0.5).add_(h["eps"])
        guess.reciprocal_().mul_(self.host_exp_avg[a:b]).mul_(-h["lr"] / bias1)
        guess.add_(master, alpha=1 - h["lr"] * h["weight_decay"])

    # -- exact mode: the next forward waits for what it needs -----------------------------------
    def watch(self, chunks) -> None:
        """Land exact updates during the next forward: a forward pre-hook on every module of
        ``chunks`` (the model chunks) that holds parameters waits for the update of those
        parameters alone, so ``step()`` returns once the update is handed to the worker, which
        runs it in forward order while the forward follows it. Only where nothing reads the
        parameters between the step and the forward (no data-parallel parameter all-gather)."""
        for chunk in chunks:
            for module in chunk.modules():
                params = list(module.parameters(recurse=False))
                if params:
                    hook = functools.partial(self._before_forward, params)
                    self._hooks.append(module.register_forward_pre_hook(hook, prepend=True))

    def _unwatch(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _before_forward(self, params: list, module, args) -> None:
        inflight = self._inflight
        if inflight is None:
            return
        index = self._needs.get(id(module))
        if index is None:
            index = self._needs[id(module)] = self._last_piece_of(params)
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

    def _last_piece_of(self, params: list) -> int:
        """The last piece (in update order) holding any of ``params``'s elements; -1: none."""
        return max((i for p in params for i in self._pieces_of(p)), default=-1)

    def _pieces_of(self, param) -> list[int]:
        """The pieces (indices in update order) holding any of ``param``'s elements."""
        if self._spans is None:  # each piece's bytes in the parameter buffer
            self._spans = [(q.param.data_ptr(),
                            q.param.data_ptr() + q.numel * q.param.element_size())
                           for q in self._pieces]  # fmt: skip
        lo = param.data_ptr()
        hi = lo + param.numel() * param.element_size()
        return [i for i, (a, b) in enumerate(self._spans) if a < hi and lo < b]

    # -- delayed mode: the step boundary's copies during the backward ---------------------------
    def watch_backward(self, chunks) -> None:
        """Copy during the last micro-batch's backward: a hook after each parameter's gradient
        accumulation (registered after Megatron-Core DDP's own, on the same autograd node, so the
        DDP buffer holds the gradient when it runs) counts the parameters of each piece whose
        gradients are final; when a piece's are, its gradients go down and the last update's
        masters come up into its parameters, which no later part of the backward reads. Armed by
        ``arm`` (the schedule's ``no_sync`` exit: the last micro-batch follows); only on a shard
        whose gradients nothing edits after the backward (``cpu_adam_copies_during_backward``);
        the CPU applies the clip factor (``grads_clipped``)."""
        import torch

        with torch.enable_grad():
            for chunk in chunks:
                for param in chunk.parameters():
                    if not param.requires_grad:
                        continue
                    node = param.expand_as(param).grad_fn.next_functions[0][0]
                    hook = functools.partial(self._after_grad, id(param))
                    self._grad_hooks.append((node, node.register_hook(hook)))
                    self._hooked[id(param)] = param

    def arm(self) -> None:
        """The last micro-batch's backward follows: copy during it where the coming step is
        delayed (the exact steps before need their gradients clipped at ``step()``)."""
        self._early.clear()
        if not (self._grad_hooks and self._pieces and self.steps_taken + 1 > self.exact_steps):
            self._remaining = None
            return
        if self._param_pieces is None:
            self._param_pieces = {key: self._pieces_of(p) for key, p in self._hooked.items()}
            self._piece_params = [0] * len(self._pieces)
            for pieces in self._param_pieces.values():
                for i in pieces:
                    self._piece_params[i] += 1
        self._previous = self._pending
        self._remaining = list(self._piece_params)

    def _after_grad(self, key: int, *unused) -> None:
        """A parameter's gradient is accumulated: the pieces it completes start their copies."""
        remaining = self._remaining
        if remaining is None:
            return
        for i in self._param_pieces.get(key, ()):
            remaining[i] -= 1
            if remaining[i] == 0:
                event = None
                if self._streams is not None:  # the backward so far, on this thread's stream
                    import torch

                    event = torch.cuda.Event()
                    event.record()
                self._early[i] = self._lander.submit(self._cross, i, self._previous, event)

    def _cross(self, i: int, previous: _Update | None, after=None) -> None:
        """Piece ``i`` across the step boundary: the last update's masters up once the worker
        has them (``previous``: the update not landed, if any), this step's gradients down, both
        after the CUDA event ``after`` where given (the landing thread during the backward, else
        ``step()``)."""
        piece = self._pieces[i]
        if previous is not None:
            previous.done[i].wait()
            if previous.failed:
                return  # step() raises the worker's error
            self._land(piece, previous.guess, after)
        self._fetch(piece, after)

    def grads_clipped(self, grad_norm: float | None) -> None:
        """After Megatron-Core's step (whose clipping scaled the GPU gradients by clip_grad /
        (grad_norm + 1e-6) where that is below 1): the gradients copied during the backward
        were taken before, so the worker divides them by the inverse of that factor."""
        update = self._pending
        if update is None or update.scaled.is_set():
            return
        coeff = (self.clip_grad / (float(grad_norm) + 1.0e-6)
                 if self.clip_grad > 0 and grad_norm is not None else 1.0)  # fmt: skip
        if coeff < 1.0:
            import torch

            update.grad_scale = torch.tensor(1.0 / coeff, dtype=torch.float32)
        update.scaled.set()

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

    # -- around the step ---------------------------------------------------------------------
    def finish(self) -> None:
        """Wait for a delayed update (checkpoints: masters and states consistent; not landed)
        or an exact one landing during the forward, and the GPU share's copies out."""
        self._complete()
        if self._window is not None:
            self._window.finish()
        if self._pending is not None and not self._pending.scaled.is_set():
            raise RuntimeError(
                "cpu_adam: an update whose gradients went down during the "
                "backward waits for grads_clipped(grad_norm) after the step"
            )
        while self._jobs:
            self._jobs.pop(0).result()
        if self._pending is not None:
            self._pending = None
            self._unlanded = True

    def flush(self) -> None:
        """Wait for and land a delayed update: the bf16 parameters are the newest."""
        self.finish()
        if self._pieces is None or not self._unlanded:
            return
        for piece in self._pieces:
            self._land(piece)
        self._unlanded = False
        self._wait_for_landings()

    def restore_after_load(self) -> None:
        """... and a GPU share the saved run had fixed: the resumed run splits as it did."""
        super().restore_after_load()
        saved = self.param_groups[0].get(GPU_SHARE) if self.param_groups else None
        if saved is not None and self._window is not None:
            self._share, self._fixed = float(saved), True

    def _land_loaded_masters(self) -> None:
        """Delayed mode lands the loaded masters (or their extrapolation) at the next step, as
        the uninterrupted run would."""
        if self.delayed:
            self._unlanded, self._guessed = True, False
            return
        super()._land_loaded_masters()
        self._unlanded = False

    def close(self) -> None:
        if self._pending is not None and not self._pending.scaled.is_set():
            self._pending.cancelled = True  # a run that stopped between step and clip factor
            self._pending.scaled.set()
        self.finish()
        self._unwatch()
        for _, hook in self._grad_hooks:
            hook.remove()
        self._grad_hooks.clear()
        self._worker.shutdown(wait=True)  # shared by a rank's engines: the first close waits
        self._lander.shutdown(wait=True)
        if self._late is not None:
            self._late.shutdown(wait=True)
        self._arenas.release()

    # -- what the run reports ------------------------------------------------------------------
    def metrics(self, skip: int = 2) -> dict:
        steady = self.history[skip:] or self.history
        if not steady:
            return {}
        busy = statistics.median(u.busy_s for u in steady)
        on_cpu = statistics.median(u.params for u in steady)
        passes = self._window.timing()[skip:] if self._window is not None else []
        return {
            "cpu_offloaded_params": self.offloaded_numel,
            "cpu_adam_params_on_cpu": on_cpu,
            "cpu_adam_params_per_s": on_cpu / busy if busy else None,
            "cpu_adam_busy_s_median": busy,
            "cpu_adam_params_on_gpu": statistics.median(n for _, n in passes) if passes else 0,
            "cpu_adam_stream_s_median": statistics.median(t for t, _ in passes) if passes else 0.0,
            "cpu_adam_wall_s_median": statistics.median(u.wall_s for u in steady),
            "cpu_adam_wait_s_median": statistics.median(u.wait_s for u in steady),
            "cpu_adam_forward_wait_s_median": statistics.median(u.forward_wait_s for u in steady),
            "cpu_adam_boundary_s_median": statistics.median(u.boundary_s for u in steady),
            "cpu_adam_pieces_in_backward": statistics.median(sum(u.unclipped) for u in steady),
            "cpu_adam_threads": self.threads,
            "cpu_adam_pieces": len(self._pieces or []),
        }


# --- wiring ---------------------------------------------------------------------------------------


def engines(optimizer) -> list[CpuAdam]:
    """The CpuAdam engines inside what ``get_megatron_optimizer`` returned."""
    return host_adam.engines(optimizer, CpuAdam)


def _is_expert_part(part) -> bool:
    return any(g.get("is_expert_parallel", False) for g in part.optimizer.param_groups)


def delayed_dense_warning(sizes: list[int], experts: list[bool], fraction: float,
                          delayed: bool) -> str | None:  # fmt: skip
    """Delayed mode reaching past a MoE rank's routed experts into its dense part and router:
    what that cost on the proxy, and the fraction that keeps them exact (None: nothing to say)."""
    total = sum(sizes)
    share = sum(n for n, e in zip(sizes, experts, strict=True) if e) / total if total else 0.0
    if not (delayed and share) or fraction <= share:
        return None
    keep = math.floor(share * 1e4) / 1e4
    return (
        f"cpu_adam: delayed updates at optimizer.optimizer_offload_fraction={fraction:g} reach "
        f"past the routed experts ({share:.4f} of this rank's shard) into the dense layers "
        "and the router (delayed updates of every parameter slowed convergence beyond the "
        "seeds' noise on the Qwen3-30B-A3B proxy, docs/BENCHMARKS.md); "
        f"optimizer.optimizer_offload_fraction={keep} keeps them exact on the GPU, "
        "optimizer.cpu_adam_delayed_scope=experts exact with their states on the host"
    )


def attach(run: RunConfig, optimizer, local_rank: int = 0, local_world: int = 1) -> list[CpuAdam]:
    """Make a CpuAdam the inner optimizer of every DistributedOptimizer of ``optimizer`` (built on
    Megatron-Core's precision-aware path, so no fp32 masters were allocated on the GPU)."""
    o = run.optimizer
    parts = host_adam.inner_parts(optimizer)
    sizes = [sum(q.numel() for g in p.optimizer.param_groups for q in g["params"]) for p in parts]
    experts = [_is_expert_part(p) for p in parts]
    fractions = part_fractions(sizes, experts, o.optimizer_offload_fraction,
                               o.cpu_adam_delayed_update)  # fmt: skip
    delayed = part_delays(run, experts)
    warning = delayed_dense_warning(sizes, experts, o.optimizer_offload_fraction,
                                    cpu_adam_delays_dense(run))  # fmt: skip
    if warning:
        log.warning(warning)
    cpus = worker_cpus(run, rank_cpus(local_rank, local_world))
    threads = default_threads(run, cpus)
    # exact updates land during the next forward, module by module, where no data-parallel
    # parameter all-gather follows the step (suite cpu-adam-landing: faster than within the step)
    in_forward = [not _gathers_params(p) for p in parts]
    # DDP scales every gradient, the experts' too, by 1 / data-parallel size after the backward
    in_backward = [cpu_adam_copies_during_backward(run, _data_parallel_size())] * len(parts)
    # One worker runs every part's update in the order their step() hands them over: Megatron-
    # Core's ChainedOptimizer steps the dense part before the experts', so with delayed experts
    # the dense part's exact update (the next forward waits for it) runs first.
    worker = cpu_worker(cpus, threads, _current_device())
    share = step_cost(run, local_world).gpu_share(run) if cpu_adam_streams(run) else 0.0
    # the exact updates' share, and delayed mode's for every parameter (delayed experts beside
    # an exact dense part run on the CPU alone)
    shared = [not d or cpu_adam_delays_dense(run) for d in delayed]
    built = host_adam.install(optimizer, lambda part, i: CpuAdam(
        part.optimizer.param_groups, fraction=fractions[i], lr=o.lr,
        weight_decay=o.weight_decay, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
        delayed=delayed[i], exact_steps=exact_steps(run),
        predict=o.cpu_adam_weight_prediction, threads=threads,
        cpus=cpus, chunk_bytes=o.cpu_adam_chunk_mb * 1024**2,
        land_during_forward=in_forward[i], copy_during_backward=in_backward[i],
        clip_grad=o.clip_grad, gpu_share=share if shared[i] else 0.0,
        balance=shared[i] and balanced_share(run),
        worker=worker, moment_dtypes=optimizer_states.moment_dtypes(run),
        grad_dtype=host_adam.grad_dtype(run),
    ))  # fmt: skip
    for part, engine in zip(parts, built, strict=True):
        if engine.land_during_forward:
            engine.watch(part.model_chunks)
        if engine.copy_during_backward:
            engine.watch_backward(part.model_chunks)
    numel = sum(e.offloaded_numel for e in built)
    log.info("cpu_adam: %.3fB of %.3fB params of this rank's shard on the CPU (%d threads on cores "
             "%s), %s", numel / 1e9, sum(sizes) / 1e9, threads, cpu_ranges(cpus),
             mode_name(built))  # fmt: skip
    if share:
        log.info("cpu_adam: Adam on %.0f%% of them on the GPU instead, their states streamed "
                 "through a %.0f MiB window %s while the CPU updates the rest (%s)",
                 100 * share, max(e.window_bytes for e in built) / 1024**2,
                 "with their gradients under the next forward+backward (delayed steps) or during "
                 "the step (exact steps)" if cpu_adam_late_share(run) else "during the step",
                 f"the share starts at the planner's balance and follows the measured one "
                 f"up to step {BALANCE_STEPS}, then stays" if balanced_share(run)
                 else "the planner's balance, fixed: model.deterministic_mode"
                 if o.cpu_adam_gpu_share is None else "optimizer.cpu_adam_gpu_share")  # fmt: skip
    if not all(in_forward):
        log.info("cpu_adam: the exact updates of a shard that data-parallel ranks all-gather "
                 "after the step land within step() (the all-gather needs them whole); "
                 "the others land during the next forward")  # fmt: skip
    if o.cpu_adam_delayed_update:
        log.info("cpu_adam: delayed steps copy %s", "during the last micro-batch's backward "
                 "(the CPU applies the clip factor)" if all(in_backward) else "at the step "
                 "boundary: Megatron-Core edits gradients after the backward here (data, tensor, "
                 "pipeline or context parallelism)")  # fmt: skip
    return built


def balanced_share(run: RunConfig) -> bool:
    """The GPU share follows the measured rates for BALANCE_STEPS steps: unset
    (optimizer.cpu_adam_gpu_share=null), and not under model.deterministic_mode, where the
    planner's balance from the config's rates stays fixed from the first step."""
    share = run.optimizer.cpu_adam_gpu_share
    return cpu_adam_streams(run) and share is None and not run.model.deterministic_mode


def arming(no_sync, built: list[CpuAdam]):
    """Megatron-Core's ``config.no_sync_func`` for the schedules: DDP's ``no_sync``, and on its
    exit (the last micro-batch follows, as DDP's own grad sync reads it) the engines that copy
    during the backward arm (``CpuAdam.arm``); ``no_sync`` itself where none does."""
    armed = [e for e in built if e.copy_during_backward]
    if not armed:
        return no_sync

    @contextlib.contextmanager
    def no_sync_then_arm():
        with no_sync():
            yield
        for engine in armed:
            engine.arm()

    return no_sync_then_arm


def grads_clipped(built: list[CpuAdam], grad_norm: float | None) -> None:
    """After Megatron-Core's ``optimizer.step()``: its grad norm to the engines whose gradients
    went down before the clipping (``CpuAdam.grads_clipped``)."""
    for engine in built:
        engine.grads_clipped(grad_norm)


def _gathers_params(part) -> bool:
    """Megatron-Core all-gathers ``part``'s updated parameter shards right after the step
    (several data-parallel ranks share its buffer), so its update must land within step()."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size(getattr(part, "data_parallel_group", None)) > 1


def _data_parallel_size() -> int:
    """Data-parallel ranks (with context parallelism) of the dense part: Megatron-Core's DDP
    scales every gradient, the experts' too, by their inverse after the backward."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_data_parallel_world_size(with_context_parallel=True)


def _current_device():
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def cpu_ranges(cpus: list[int]) -> str:
    """``0-3,6-7`` for [0, 1, 2, 3, 6, 7]."""
    spans: list[list[int]] = []
    for c in cpus:
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans) or "?"


def metrics(optimizer, forward_backward_s: float | None = None, planner=None,
            copy_micro_batches: int | None = None) -> dict:  # fmt: skip
    """summary.json fields: offloaded params, the CPU Adam rate and host memory over all engines
    of a rank, the mode, and (given the run's median forward+backward) the largest offload
    fraction delayed mode hides at this run's rate (``step_cost.hidden_fraction``): its CPU Adam
    under forward+backward, its copies at ``planner.host_link_gb_per_s`` (``planner``: a
    PlannerConfig; None: copies not counted) beyond the last of ``copy_micro_batches`` backwards
    (None: copies at the step boundary) and the training thread's slowdown beside it within
    ``planner.delayed_max_overhead`` of it.

    Forward+backward without offload is ``planner.forward_backward_s`` where given; a delayed
    run then measures how much its CPU Adam slowed its own (``cpu_adam_launch_slowdown``: seconds
    per second of CPU Adam beside it). Otherwise the run's own, less that slowdown at the
    planner's ``cpu_adam_launch_slowdown``."""
    built = engines(optimizer)
    found = [m for m in (e.metrics() for e in built) if m]
    if not found:
        return {}
    busy = sum(m["cpu_adam_busy_s_median"] for m in found)
    params = sum(m["cpu_offloaded_params"] for m in found)
    on_cpu = sum(m["cpu_adam_params_on_cpu"] for m in found)
    on_gpu = sum(m["cpu_adam_params_on_gpu"] for m in found)
    stream_s = sum(m["cpu_adam_stream_s_median"] for m in found)  # the passes run in turn
    rate = on_cpu / busy if busy else None
    shard = sum(e.shard_numel for e in built)
    forward_wait = sum(m["cpu_adam_forward_wait_s_median"] for m in found)
    if forward_backward_s:  # exact mode landing during the forward: its wait is not its work
        forward_backward_s = max(forward_backward_s - forward_wait, 0.0)
    delayed = any(e.delayed for e in built)
    slowdown, without, measured = launch_slowdown(forward_backward_s, busy, delayed, planner)
    hidden = None
    if without and rate:
        copies = copy_seconds_per_param(planner.host_link_gb_per_s) if planner else 0.0
        overhead = planner.delayed_max_overhead if planner else 1.0
        window = copy_window(without, copy_micro_batches) if copy_micro_batches else 0.0
        hidden = hidden_fraction(without, rate, shard, copies, overhead, window, slowdown)
    return {
        "cpu_offloaded_params": params,  # their masters and moments live on the host
        "cpu_adam_params_on_cpu": on_cpu,  # ... of which Adam ran on the CPU (medians)
        "cpu_adam_params_per_s": rate,
        "cpu_adam_params_on_gpu": on_gpu,  # ... and on the GPU, the states streamed
        "cpu_adam_gpu_share": on_gpu / params if params else 0.0,
        "cpu_adam_stream_s_median": stream_s,  # the GPU share's pass, first Adam to last copy
        "cpu_adam_stream_params_per_s": on_gpu / stream_s if stream_s else None,
        "cpu_adam_hidden_fraction": hidden,
        "cpu_adam_busy_s_median": busy,
        "cpu_adam_wall_s_median": sum(m["cpu_adam_wall_s_median"] for m in found),
        "cpu_adam_wait_s_median": sum(m["cpu_adam_wait_s_median"] for m in found),
        "cpu_adam_forward_wait_s_median": forward_wait,
        "cpu_adam_boundary_s_median": sum(m["cpu_adam_boundary_s_median"] for m in found),
        "cpu_adam_pieces_in_backward": sum(m["cpu_adam_pieces_in_backward"] for m in found),
        "cpu_adam_copies_in_backward": any(e.copy_during_backward for e in built),
        "cpu_adam_threads": found[0]["cpu_adam_threads"],
        "cpu_adam_pieces": sum(m["cpu_adam_pieces"] for m in found),
        "cpu_adam_host_gb": sum(e.host_bytes for e in built) / GiB,
        "cpu_adam_mode": mode_name(built),
        # ... of the offloaded params, those updated one step late
        "cpu_adam_delayed_params": sum(e.offloaded_numel for e in built if e.delayed),
        "cpu_adam_lands_in_forward": any(e.land_during_forward for e in built),
        # forward+backward less the forward's wait for an exact update
        "cpu_adam_forward_backward_s": forward_backward_s,
        # ... and without offload: what the hidden fraction used
        "cpu_adam_forward_backward_without_s": without,
        "cpu_adam_launch_slowdown": slowdown,
        "cpu_adam_launch_slowdown_measured": measured,  # else the planner's figure
    }


def mode_name(built: list[CpuAdam]) -> str:
    """exact, delayed, or delayed experts (the dense part exact: cpu_adam_delayed_scope)."""
    delayed = [e.delayed for e in built if e.offloaded_numel]
    if not any(delayed):
        return "exact"
    return "delayed" if all(delayed) else "delayed experts"


def launch_slowdown(forward_backward_s: float | None, busy_s: float, delayed: bool,
                    planner) -> tuple[float | None, float | None, bool]:  # fmt: skip
    """(seconds of forward+backward lost per second of CPU Adam beside it, forward+backward
    without offload, whether the first was measured) for a run whose forward+backward was
    ``forward_backward_s`` and CPU Adam ``busy_s``: measured where the planner knows
    forward+backward without offload and the run is delayed (its CPU Adam runs beside
    forward+backward), else the planner's figure."""
    if not forward_backward_s:
        return None, None, False
    without = planner.forward_backward_s if planner else None
    beside = min(busy_s, forward_backward_s) if delayed else 0.0
    if without and beside:
        return max(forward_backward_s - without, 0.0) / beside, without, True
    slowdown = planner.cpu_adam_launch_slowdown if planner else 0.0
    return slowdown, without or max(forward_backward_s - slowdown * beside, 0.0), False


def report_hidden_fraction(found: dict, planner) -> None:
    """The log's last word on the CPU-Adam engine: what delayed mode hides (``planner``: the
    run's PlannerConfig, whose link and overhead the fraction used)."""
    fraction = found.get("cpu_adam_hidden_fraction")
    without = found.get("cpu_adam_forward_backward_without_s")
    if fraction is None or not without:
        return
    slowdown = found.get("cpu_adam_launch_slowdown") or 0.0
    measured = found.get("cpu_adam_launch_slowdown_measured")
    log.info("cpu_adam: %.2fB params at %.2f G/s take %.2f s on the CPU, forward+backward %.2f s "
             "without offload; the training thread loses %.2f s per second of CPU Adam beside "
             "it (%s): delayed mode hides the CPU update, with that slowdown and its copies "
             "(beyond the last backward where they run during it) within %.0f%% of "
             "forward+backward (planner.delayed_max_overhead), up to "
             "optimizer.optimizer_offload_fraction=%.2f (planner.forward_backward_s=%.2f "
             "planner.cpu_adam_launch_slowdown=%.2f let --plan and offload/optimizer=auto use "
             "this)",
             found["cpu_offloaded_params"] / 1e9, found["cpu_adam_params_per_s"] / 1e9,
             found["cpu_adam_busy_s_median"], without, slowdown,
             "measured against planner.forward_backward_s" if measured
             else "planner.cpu_adam_launch_slowdown; give planner.forward_backward_s from a run "
             "without offload to measure it",
             100 * planner.delayed_max_overhead, fraction, without, slowdown)  # fmt: skip
