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
3. each finished piece's fp32 masters go up on the side stream ``h2d`` into a small GPU ring
   buffer and are rounded to bf16 into the parameter buffer there (the same round-to-nearest-even
   as on the CPU, but the CPU spends its memory bandwidth on Adam alone; the link carries 4 B/param
   up instead of 2, and it is idle otherwise);
4. meanwhile the GPU part of Adam runs on the compute stream; the compute stream waits for the
   last copy back before Megatron-Core's parameter all-gather.

So the CPU step overlaps both copies; the cost over GPU Adam is about the CPU Adam time,
``offloaded params / rate`` (fused CPU AdamW: 4-6 G params/s on 16 cores).

Delayed mode (after ``exact_steps`` exact steps): ``step()`` lands the previous update piece by
piece as the worker finishes each (its masters go up while this step's gradients of the same
piece go down, both directions at once), hands this step's update to the worker and returns: the
worker runs during the next forward and backward, and its result lands at the next ``step()``: the
forward of step t+1 sees the update of step t-1. The GPU
share of Adam stays exact. Checkpoints are taken with the worker finished but its result not
landed, so the saved masters are one update ahead of the saved bf16 weights; after a load the
first step lands them, which resumes the uninterrupted run exactly.

Which parameters go to the CPU at a fraction < 1: whole parameter shards, in the order of the DDP
buffer, which is backward-ready order (the output layer and last layers first): their gradients
are final first, and the next forward needs them last. In delayed mode the expert part of a MoE
model is offloaded before the dense part: routed experts see a fraction of the tokens each step,
so one step of staleness costs them least.

The cost model: exact step = GPU step + params/rate (the copies hide behind the CPU work: 4 B/param
each way against 50 GB/s); delayed step = max(GPU step + copy time not hidden,
params/rate). State offload (offload/optimizer=states) moves 12 B/param each way instead and keeps
Adam on the GPU: on a PCIe host the CPU engine usually wins; on a link several times faster
(Grace-Hopper class C2C) state offload does.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import statistics
import threading
import time
from dataclasses import dataclass, field

from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

from offload_runner.config.schema import CpuOffloadEngine, RunConfig
from offload_runner.model_size import count_parameters
from offload_runner.offload import OffloadSummary, optimizer_parts
from offload_runner.offload.host_memory import HostArenas, aligned
from offload_runner.plan import CPU_ADAM_PAGEABLE_BYTES, CPU_ADAM_PINNED_BYTES, GiB

log = logging.getLogger("offload_runner")

STATE_KEYS = ("master_param", "exp_avg", "exp_avg_sq")
HOST_BYTES_PER_PARAM = CPU_ADAM_PINNED_BYTES + CPU_ADAM_PAGEABLE_BYTES  # the planner's figures
RESERVED_CORES_DELAYED = 2  # the training thread and data loading, while the worker runs
HISTORY = 500  # CPU updates kept for the metrics


DISABLED = {"optimizer.cpu_offload_engine": "hybrid", "optimizer.cpu_adam_delayed_update": False}


def enabled(run: RunConfig) -> bool:
    o = run.optimizer
    return o.optimizer_cpu_offload and o.cpu_offload_engine == CpuOffloadEngine.cpu_adam


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
    if not enabled(run) or "OMP_WAIT_POLICY" in os.environ:
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


def describe(run: RunConfig) -> OffloadSummary:
    group = "offload/optimizer=cpu_adam*"
    if not enabled(run):
        return OffloadSummary("optimizer (cpu adam)", group, False, "-")
    o = run.optimizer
    params = count_parameters(run.model).total * o.optimizer_offload_fraction
    mode = (
        f"delayed parameter update after {exact_steps(run)} exact steps"
        if o.cpu_adam_delayed_update
        else "exact: each update lands before the next forward"
    )
    return OffloadSummary(
        "optimizer (cpu adam)",
        group,
        True,
        f"{o.optimizer_offload_fraction:.0%} of Adam: fp32 master + states of ~{params / 1e9:.2f}B"
        f" params on the host, updated in {o.cpu_adam_chunk_mb} MiB pieces",
        mode,
    )


def rank_cpus(local_rank: int, local_world: int) -> list[int]:
    """This rank's share of the cores it may run on: the cores of its GPU's NUMA node where the
    machine has several (split among the ranks on that node), else an equal slice of all."""
    cpus = sorted(os.sched_getaffinity(0))
    nodes = _numa_nodes()
    if len(nodes) > 1:
        node = _gpu_numa_node(local_rank)
        if node in nodes:
            peers = [r for r in range(local_world) if _gpu_numa_node(r) == node] or [local_rank]
            cpus = [c for c in nodes[node] if c in set(cpus)] or cpus
            return _slice(cpus, peers.index(local_rank) if local_rank in peers else 0, len(peers))
    return _slice(cpus, local_rank, local_world)


def _slice(cpus: list[int], index: int, parts: int) -> list[int]:
    share = max(1, len(cpus) // max(parts, 1))
    return cpus[index * share : (index + 1) * share] or cpus


def _numa_nodes() -> dict[int, list[int]]:
    from pathlib import Path

    nodes = {}
    for path in Path("/sys/devices/system/node").glob("node[0-9]*"):
        try:
            nodes[int(path.name[4:])] = _parse_cpulist((path / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    return nodes


def _parse_cpulist(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


def _gpu_numa_node(local_rank: int) -> int | None:
    try:
        import torch

        bus = torch.cuda.get_device_properties(local_rank).pci_bus_id.lower()
        with open(f"/sys/bus/pci/devices/{bus}/numa_node") as f:
            return int(f.read())
    except Exception:  # noqa: BLE001 - no CUDA, no sysfs entry: no NUMA preference
        return None


def worker_cpus(run: RunConfig, cpus: list[int]) -> list[int]:
    """The cores the CPU-Adam team runs on. Exact mode: all of the rank's (the training thread
    waits for the update). Delayed mode: the team runs during forward and backward, whose kernel
    launches come from one Python thread (on the MoE proxy the GPU waits for them over half of
    forward+backward), so whole physical cores (every SMT sibling) are kept out of the team for
    that thread and data loading: at least RESERVED_CORES_DELAYED logical CPUs."""
    if not run.optimizer.cpu_adam_delayed_update or len(cpus) <= RESERVED_CORES_DELAYED:
        return cpus
    reserved: set[int] = set()
    for cpu in cpus:
        if len(reserved) >= RESERVED_CORES_DELAYED:
            break
        reserved |= _thread_siblings(cpu) & set(cpus) | {cpu}
    return [c for c in cpus if c not in reserved] or cpus


def _thread_siblings(cpu: int) -> set[int]:
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            return set(_parse_cpulist(f.read()))
    except (OSError, ValueError):
        return {cpu}


def fused_adamw_rate(threads: int, numel: int = 512 * 1024**2, repeats: int = 5) -> float:
    """torch.optim.AdamW(fused=True) alone on the CPU: params/s at ``threads`` threads (median of
    ``repeats`` steps on ``numel`` fp32 params, far past the caches). The bench's reference for
    the engine's rate, and the planner's when planner.cpu_adam_params_per_s is unset."""
    import statistics
    import time

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        param = torch.nn.Parameter(torch.randn(numel) * 0.02)
        param.grad = torch.randn(numel) * 1e-3
        opt = torch.optim.AdamW([param], lr=1e-4, weight_decay=0.1, fused=True)
        times = []
        for i in range(repeats + 2):
            began = time.perf_counter()
            opt.step()
            if i >= 2:
                times.append(time.perf_counter() - began)
        return numel / statistics.median(times)
    finally:
        torch.set_num_threads(before)


def default_threads(run: RunConfig, cpus: list[int]) -> int:
    """One OpenMP thread per core the team may use (``worker_cpus``), unless configured."""
    return run.optimizer.cpu_adam_threads or len(cpus)


# --- the engine ----------------------------------------------------------------------------------


@dataclass
class _Piece:
    """A contiguous run of offloaded elements: one copy down, one Adam call per group, one up."""

    start: int  # in the flat host arrays
    stop: int
    grad: object  # the GPU (or, in tests, CPU) fp32 gradient elements, a view of the DDP buffer
    param: object  # the bf16 parameter elements, a view of the DDP parameter buffer
    groups: list[tuple[int, int, int]]  # (start, stop, param group index), flat coordinates
    fetched: object = None  # event: the gradient copy has reached the host
    landed: object = None  # event: the masters' copy up has read the host buffer


@dataclass
class _Update:
    """One CPU update: the hyperparameters captured at ``step()`` and what the worker measured."""

    step: int
    hyper: list[dict]  # per param group: lr, weight_decay, beta1, beta2, eps
    land_in_worker: bool
    done: list = field(default_factory=list)  # threading.Event per piece: Adam has run on it
    busy_s: float = 0.0  # the worker's own work: its Adam calls
    wait_s: float = 0.0  # waiting for gradient copies
    wall_s: float = 0.0


class CpuAdam(HybridDeviceOptimizer):
    """Adam for one DistributedOptimizer's shard, ``fraction`` of it on the CPU (see module doc).

    ``params`` are the param groups of the precision-aware DistributedOptimizer: bf16 views of the
    DDP parameter buffer, their gradients in ``decoupled_grad`` (fp32 views of the grad buffer).
    On a machine without CUDA (tests) every tensor is on the CPU and copies are synchronous.
    """

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
        threads: int | None = None,
        cpus: list[int] | None = None,
        chunk_bytes: int = 64 * 1024**2,
        order_key=None,
    ) -> None:
        import torch

        # torch.optim.Optimizer only: none of HybridDeviceOptimizer's own machinery is used.
        defaults = dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
        torch.optim.Optimizer.__init__(self, params, defaults)
        self.delayed = delayed
        self.exact_steps = exact_steps
        self.chunk_numel = max(1, chunk_bytes // 4)
        self.threads = threads
        self._arenas = HostArenas()
        self._pieces: list[_Piece] | None = None
        self._pending: _Update | None = None  # a delayed update, not landed
        self._jobs: list[concurrent.futures.Future] = []
        self._unlanded = False  # the host masters are newer than the bf16 params
        self._announced_delay = False
        self.history: list[_Update] = []

        everything = [(gi, p) for gi, g in enumerate(self.param_groups) for p in g["params"]]
        self.on_cuda = bool(everything) and everything[0][1].is_cuda
        self.device = everything[0][1].device if everything else torch.device("cpu")
        self._worker = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="cpu-adam", initializer=self._init_worker, initargs=(cpus,)
        )
        # Backward-ready order: the DDP buffer's own order (``order_key`` for tests). Only bf16
        # parameters move: the copies back are bf16 (fp32 ones, if any, stay on the GPU).
        order_key = order_key or _buffer_position
        ordered = sorted(everything, key=lambda item: order_key(item[1]))
        budget = fraction * sum(p.numel() for _, p in everything)
        offloaded, taken = [], 0
        for gi, p in ordered:
            if taken + p.numel() / 2 > budget:
                break
            if p.dtype == torch.bfloat16:
                offloaded.append((gi, p))
                taken += p.numel()
        self.offloaded = offloaded
        self.offloaded_numel = taken
        host = {id(p) for _, p in offloaded}
        self.kept = [(gi, p) for gi, p in everything if id(p) not in host]
        self._worker.submit(self._allocate).result()

    # -- memory ----------------------------------------------------------------------------
    def _init_worker(self, cpus: list[int] | None) -> None:
        import torch

        if cpus:
            os.sched_setaffinity(0, cpus)  # this thread; its OpenMP team inherits the mask
        if self.threads:
            torch.set_num_threads(self.threads)
        if self.on_cuda:
            torch.cuda.set_device(self.device)

    def _allocate(self) -> None:
        """Host arrays for the offloaded shard (first touched by the worker's own threads), GPU
        arrays for the rest, masters copied from the bf16 parameters, Adam moments zero."""
        import torch

        n = self.offloaded_numel

        def host(dtype, pin: bool):
            arena = self._arenas.allocate(aligned(n * dtype.itemsize), pin, "cpu_adam")
            return _typed(arena, dtype, n)

        self.host_master = host(torch.float32, pin=self.on_cuda)
        self.host_exp_avg = host(torch.float32, pin=False).zero_()
        self.host_exp_avg_sq = host(torch.float32, pin=False).zero_()
        self.host_grad = host(torch.float32, pin=self.on_cuda)
        # two pieces of fp32 masters on the GPU, rounded into the bf16 params there
        ring = min(self.chunk_numel, n) if self.on_cuda else 0
        self._ring = [torch.empty(ring, dtype=torch.float32, device=self.device) for _ in range(2)]
        self._landings = 0
        self._own: dict[int, dict] = {}  # id(param) -> its views of the engine's arrays
        self._flat = self._lay_out(self.offloaded, self.host_master, self.host_exp_avg,
                                   self.host_exp_avg_sq)  # fmt: skip
        m, on = sum(p.numel() for _, p in self.kept), self.device
        self.gpu_master = torch.empty(m, dtype=torch.float32, device=on)
        self.gpu_exp_avg = torch.zeros(m, dtype=torch.float32, device=on)
        self.gpu_exp_avg_sq = torch.zeros(m, dtype=torch.float32, device=on)
        self._lay_out(self.kept, self.gpu_master, self.gpu_exp_avg, self.gpu_exp_avg_sq)

    def _lay_out(self, params: list, master, exp_avg, exp_avg_sq) -> dict[int, int]:
        """Consecutive slices of the flat arrays for ``params`` (their state), masters copied
        from the bf16 parameters; returns each parameter's start."""
        starts, start = {}, 0
        for _, p in params:
            view = slice(start, start + p.numel())
            master[view].copy_(p.detach().view(-1))
            self._own[id(p)] = {"master_param": master[view], "exp_avg": exp_avg[view],
                                "exp_avg_sq": exp_avg_sq[view]}  # fmt: skip
            self.state[p] = self._views(p)
            starts[id(p)] = start
            start += p.numel()
        return starts

    @property
    def host_bytes(self) -> int:
        return self._arenas.nbytes

    @property
    def pinned_bytes(self) -> int:
        return self._arenas.pinned_bytes

    # -- the transfer plan (first step: the gradients' places are known then) ---------------
    def _plan(self) -> list[_Piece]:
        """Pieces of at most ``chunk_numel`` elements, contiguous on the host, in the gradient
        buffer and in the parameter buffer, so each moves with one copy each way."""
        runs: list[list[tuple[int, object]]] = []
        for gi, p in self.offloaded:
            grad = _grad_of(p)
            if runs and _follows(runs[-1][-1][1], p) and _follows(_grad_of(runs[-1][-1][1]), grad):
                runs[-1].append((gi, p))
            else:
                runs.append([(gi, p)])
        pieces = []
        for run in runs:
            first = run[0][1]
            base = self._flat[id(first)]
            numel = sum(p.numel() for _, p in run)
            bounds, offset = [], base  # (start, stop, group) of each parameter in the run
            for gi, p in run:
                bounds.append((offset, offset + p.numel(), gi))
                offset += p.numel()
            grad0, param0 = _grad_of(first), first
            for a in range(base, base + numel, self.chunk_numel):
                b = min(a + self.chunk_numel, base + numel)
                groups = _merge([(max(s, a), min(e, b), gi) for s, e, gi in bounds
                                 if s < b and e > a])  # fmt: skip
                pieces.append(_Piece(a, b, _window(grad0, a - base, b - a),
                                     _window(param0, a - base, b - a), groups))  # fmt: skip
        return pieces

    # -- the step -------------------------------------------------------------------------
    def step(self, closure=None):
        import torch

        if self._pieces is None:
            self._pieces = self._plan()
            self._streams = (torch.cuda.Stream(), torch.cuda.Stream()) if self.on_cuda else None
        step = int(self.param_groups[0].get("step", 0)) + 1 if self.param_groups else 1
        hyper = [_hyper(g) for g in self.param_groups]
        delayed = self.delayed and step > self.exact_steps
        if delayed and not self._announced_delay:
            self._announced_delay = True
            log.info("cpu_adam: delayed parameter updates from step %d on (the first %d steps "
                     "were exact): the CPU update of step t lands before step t+2", step,
                     step - 1)  # fmt: skip
        self._start_fetch()
        if self._pending is not None:  # land the last update and fetch behind the worker
            previous, self._pending = self._pending, None
            for piece, done in zip(self._pieces, previous.done, strict=True):
                done.wait()
                self._land(piece)
                self._fetch(piece)
            self._jobs.pop(0).result()
        else:
            for piece in self._pieces:
                if self._unlanded:
                    self._land(piece)
                self._fetch(piece)
        self._unlanded = False
        update = _Update(step, hyper, land_in_worker=not delayed,
                         done=[threading.Event() for _ in self._pieces])  # fmt: skip
        job = self._worker.submit(self._run_update, update)
        self._gpu_step(update)
        if delayed:
            self._pending = update
            self._jobs.append(job)
        else:
            job.result()
        if self._streams is not None:
            compute = torch.cuda.current_stream()
            compute.wait_stream(self._streams[1])  # the bf16 params are back
            compute.wait_stream(self._streams[0])  # the grad buffer may be zeroed
        for group in self.param_groups:
            group["step"] = step
        return None

    def _start_fetch(self) -> None:
        import torch

        if self._streams is not None:  # clipping wrote the grads on the compute stream
            self._streams[0].wait_stream(torch.cuda.current_stream())

    def _fetch(self, piece: _Piece) -> None:
        """A piece's gradients down (on ``d2h``; synchronously without CUDA)."""
        import torch

        target = self.host_grad[piece.start : piece.stop]
        if self._streams is None:
            target.copy_(piece.grad)
            return
        with torch.cuda.stream(self._streams[0]):
            target.copy_(piece.grad, non_blocking=True)
            piece.fetched = torch.cuda.Event(blocking=True)  # the worker sleeps on it
            piece.fetched.record(self._streams[0])

    def _land(self, piece: _Piece) -> None:
        """A piece's masters up and rounded into its bf16 parameters (on ``h2d``; on the CPU,
        synchronously, without CUDA)."""
        import torch

        source = self.host_master[piece.start : piece.stop]
        if self._streams is None:
            piece.param.copy_(source)
            return
        ring = self._ring[self._landings % 2][: piece.stop - piece.start]
        self._landings += 1
        with torch.cuda.stream(self._streams[1]):  # ring reuse is ordered on this stream
            ring.copy_(source, non_blocking=True)
            piece.param.copy_(ring)
            piece.landed = torch.cuda.Event(blocking=True)
            piece.landed.record(self._streams[1])

    def _run_update(self, update: _Update) -> None:
        """The worker: Adam on each piece as its gradients arrive (landed from here in exact
        mode; by ``step()`` in delayed mode, as each piece's ``done`` is set)."""
        import torch

        began = time.perf_counter()
        steps = torch.tensor(float(update.step))
        for piece, done in zip(self._pieces, update.done, strict=True):
            t0 = time.perf_counter()
            if piece.fetched is not None:
                piece.fetched.synchronize()
            if piece.landed is not None:
                piece.landed.synchronize()  # the last update's masters have gone up
            t1 = time.perf_counter()
            for a, b, gi in piece.groups:
                h = update.hyper[gi]
                torch._fused_adamw_(
                    [self.host_master[a:b]], [self.host_grad[a:b]], [self.host_exp_avg[a:b]],
                    [self.host_exp_avg_sq[a:b]], [], [steps], lr=h["lr"], beta1=h["beta1"],
                    beta2=h["beta2"], weight_decay=h["weight_decay"], eps=h["eps"],
                    amsgrad=False, maximize=False,
                )  # fmt: skip
            t2 = time.perf_counter()
            update.wait_s += t1 - t0
            update.busy_s += t2 - t1
            if update.land_in_worker:
                self._land(piece)
            done.set()
        update.wall_s = time.perf_counter() - began
        self.history.append(update)
        if len(self.history) > 2 * HISTORY:
            del self.history[2:-HISTORY]  # keep the first two (warm-up) and the recent ones

    def _gpu_step(self, update: _Update) -> None:
        """The GPU share: fused AdamW on its fp32 masters, then rounded into the bf16 params."""
        import torch

        if not self.kept:
            return
        steps = torch.full((), float(update.step), device=self.device)
        by_group: dict[int, list] = {}
        for gi, p in self.kept:
            grad = _grad_of(p)
            if grad is not None:
                by_group.setdefault(gi, []).append((p, self.state[p], grad))
        for gi, items in by_group.items():
            h = update.hyper[gi]
            masters = [s["master_param"] for _, s, _ in items]
            torch._fused_adamw_(
                masters, [g for _, _, g in items], [s["exp_avg"] for _, s, _ in items],
                [s["exp_avg_sq"] for _, s, _ in items], [], [steps] * len(items), lr=h["lr"],
                beta1=h["beta1"], beta2=h["beta2"], weight_decay=h["weight_decay"],
                eps=h["eps"], amsgrad=False, maximize=False,
            )  # fmt: skip
            torch._foreach_copy_([p.view(-1) for p, _, _ in items], masters)

    # -- around the step ---------------------------------------------------------------------
    def finish(self) -> None:
        """Wait for a delayed update (checkpoints: masters and states consistent; not landed)."""
        while self._jobs:
            self._jobs.pop(0).result()
        if self._pending is not None:
            self._pending = None
            self._unlanded = True

    def flush(self) -> None:
        """Wait for and land a delayed update: the bf16 parameters are the newest."""
        import torch

        self.finish()
        if self._pieces is None or not self._unlanded:
            return
        for piece in self._pieces:
            self._land(piece)
        self._unlanded = False
        if self._streams is not None:
            torch.cuda.current_stream().wait_stream(self._streams[1])

    def restore_after_load(self) -> None:
        """After a checkpoint load: put the loaded masters and moments into the engine's own
        buffers (Megatron-Core's loaders replace the state's tensors), then land the masters
        (delayed mode: at the next step, as the uninterrupted run would)."""
        for p, state in list(self.state.items()):
            self._adopt(p, state)
        for _, p in self.kept:
            p.detach().view(-1).copy_(self.state[p]["master_param"])
        if self.delayed:
            self._unlanded = True  # the next step() lands them
            return
        for _, p in self.offloaded:
            a = self._flat[id(p)]
            p.detach().view(-1).copy_(self.host_master[a : a + p.numel()])
        self._unlanded = False

    def _views(self, p) -> dict:
        """``p``'s master and moments in the engine's own arrays (a fresh dict)."""
        return dict(self._own[id(p)])

    def _adopt(self, p, loaded: dict) -> None:
        """Copy loaded tensors of ``p`` (any device) into the engine's arrays; its state becomes
        those arrays' views again (a loaded ``step`` is dropped: the groups hold it)."""
        own = self._views(p)
        for key in STATE_KEYS:
            value = loaded.get(key)
            if value is not None and value is not own[key]:
                own[key].copy_(value.reshape(-1))
        self.state[p] = own

    # -- what Megatron-Core's DistributedOptimizer calls on a HybridDeviceOptimizer -------------
    def load_state_dict(self, state_dict: dict) -> None:
        """Copy a state dict into the engine's buffers, never onto the parameters' device/dtype
        (torch's loader would cast the fp32 host states to bf16 GPU tensors)."""
        params = [p for g in self.param_groups for p in g["params"]]
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for index, p in zip(ids, params, strict=True):
            self._adopt(p, state_dict["state"].get(index, {}))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
                if set_to_none:
                    p.decoupled_grad = None

    @property
    def sub_optimizers(self) -> list:
        return []  # the step count is in the param groups, not in torch AdamW states

    def dummy_step(self) -> None:
        """The states exist from the start: nothing to create before a load."""

    def _sync_hdo_state_to_sub_optimizers(self) -> None:
        self.restore_after_load()

    def update_fp32_param_by_new_param(self) -> None:
        """Masters from the bf16 parameters (Megatron-Core's reload of model weights)."""
        self.finish()
        for _, p in self.offloaded + self.kept:
            self.state[p]["master_param"].copy_(p.detach().view(-1))

    def close(self) -> None:
        self.finish()
        self._worker.shutdown(wait=True)
        self._arenas.release()

    # -- what the run reports ------------------------------------------------------------------
    def metrics(self, skip: int = 2) -> dict:
        steady = self.history[skip:] or self.history
        if not steady:
            return {}
        busy = statistics.median(u.busy_s for u in steady)
        return {
            "cpu_offloaded_params": self.offloaded_numel,
            "cpu_adam_params_per_s": self.offloaded_numel / busy if busy else None,
            "cpu_adam_busy_s_median": busy,
            "cpu_adam_wall_s_median": statistics.median(u.wall_s for u in steady),
            "cpu_adam_wait_s_median": statistics.median(u.wait_s for u in steady),
            "cpu_adam_threads": self.threads,
            "cpu_adam_pieces": len(self._pieces or []),
        }


def _typed(arena, dtype, numel: int):
    return arena[: numel * dtype.itemsize].view(dtype) if numel else arena[:0].view(dtype)


def _grad_of(p):
    grad = getattr(p, "decoupled_grad", None)
    return grad if grad is not None else p.grad


def _buffer_position(p) -> tuple[int, int]:
    return (p.untyped_storage().data_ptr(), p.storage_offset())


def _follows(previous, tensor) -> bool:
    """``tensor`` starts where ``previous`` ends, in the same storage (both contiguous)."""
    return (
        previous is not None
        and tensor is not None
        and previous.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
        and previous.dtype == tensor.dtype
        and previous.is_contiguous()
        and tensor.is_contiguous()
        and previous.storage_offset() + previous.numel() == tensor.storage_offset()
    )


def _window(first, offset: int, numel: int):
    """``numel`` elements from ``offset`` past the start of ``first``, in its storage."""
    return first.as_strided((numel,), (1,), first.storage_offset() + offset)


def _merge(bounds: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Adjacent ranges of one param group become one Adam call."""
    merged: list[tuple[int, int, int]] = []
    for a, b, gi in bounds:
        if merged and merged[-1][2] == gi and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b, gi)
        else:
            merged.append((a, b, gi))
    return merged


def _hyper(group: dict) -> dict:
    beta1, beta2 = group["betas"]
    return {"lr": float(group["lr"]), "weight_decay": float(group["weight_decay"]),
            "beta1": float(beta1), "beta2": float(beta2), "eps": float(group["eps"])}  # fmt: skip


# --- wiring ---------------------------------------------------------------------------------------


def engines(optimizer) -> list[CpuAdam]:
    """The CpuAdam engines inside what ``get_megatron_optimizer`` returned."""
    inner = [getattr(part, "optimizer", None) for part in optimizer_parts(optimizer)]
    return [e for e in inner if isinstance(e, CpuAdam)]


def _is_expert_part(part) -> bool:
    return any(g.get("is_expert_parallel", False) for g in part.optimizer.param_groups)


def part_fractions(sizes: list[int], experts: list[bool], fraction: float,
                   experts_first: bool) -> list[float]:  # fmt: skip
    """The fraction of each optimizer part that goes to the CPU: ``fraction`` of each, or, with
    ``experts_first``, the expert parts filled before the dense ones."""
    if not experts_first:
        return [fraction] * len(sizes)
    budget = fraction * sum(sizes)
    fractions = [0.0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: not experts[i]):
        take = min(budget, sizes[i])
        fractions[i] = take / sizes[i] if sizes[i] else 0.0
        budget -= take
    return fractions


def attach(run: RunConfig, optimizer, local_rank: int = 0, local_world: int = 1) -> list[CpuAdam]:
    """Make a CpuAdam the inner optimizer of every DistributedOptimizer of ``optimizer`` (built on
    Megatron-Core's precision-aware path, so no fp32 masters were allocated on the GPU)."""
    o = run.optimizer
    parts = [p for p in optimizer_parts(optimizer) if getattr(p, "optimizer", None) is not None]
    sizes = [sum(q.numel() for g in p.optimizer.param_groups for q in g["params"]) for p in parts]
    fractions = part_fractions(sizes, [_is_expert_part(p) for p in parts],
                               o.optimizer_offload_fraction, o.cpu_adam_delayed_update)  # fmt: skip
    cpus = worker_cpus(run, rank_cpus(local_rank, local_world))
    threads = default_threads(run, cpus)
    built = []
    for part, fraction in zip(parts, fractions, strict=True):
        engine = CpuAdam(
            part.optimizer.param_groups, fraction=fraction, lr=o.lr,
            weight_decay=o.weight_decay, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
            delayed=o.cpu_adam_delayed_update, exact_steps=exact_steps(run), threads=threads,
            cpus=cpus, chunk_bytes=o.cpu_adam_chunk_mb * 1024**2,
        )  # fmt: skip
        part.optimizer = engine
        built.append(engine)
    numel = sum(e.offloaded_numel for e in built)
    log.info("cpu_adam: %.3fB of %.3fB params of this rank's shard on the CPU (%d threads on cores "
             "%s), %s", numel / 1e9, sum(sizes) / 1e9, threads, _ranges(cpus),
             "delayed" if o.cpu_adam_delayed_update else "exact")  # fmt: skip
    return built


def _ranges(cpus: list[int]) -> str:
    """``0-3,6-7`` for [0, 1, 2, 3, 6, 7]."""
    spans: list[list[int]] = []
    for c in cpus:
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans) or "?"


def metrics(optimizer) -> dict:
    """summary.json fields: offloaded params, the CPU Adam rate and host memory over all engines
    of a rank, and the mode."""
    built = engines(optimizer)
    found = [m for m in (e.metrics() for e in built) if m]
    if not found:
        return {}
    busy = sum(m["cpu_adam_busy_s_median"] for m in found)
    params = sum(m["cpu_offloaded_params"] for m in found)
    return {
        "cpu_offloaded_params": params,
        "cpu_adam_params_per_s": params / busy if busy else None,
        "cpu_adam_busy_s_median": busy,
        "cpu_adam_wall_s_median": sum(m["cpu_adam_wall_s_median"] for m in found),
        "cpu_adam_wait_s_median": sum(m["cpu_adam_wait_s_median"] for m in found),
        "cpu_adam_threads": found[0]["cpu_adam_threads"],
        "cpu_adam_pieces": sum(m["cpu_adam_pieces"] for m in found),
        "cpu_adam_host_gb": sum(e.host_bytes for e in built) / GiB,
        "cpu_adam_mode": "delayed" if built[0].delayed else "exact",
    }
