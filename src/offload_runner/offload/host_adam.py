"""Adam whose fp32 masters and moments live in host memory: what the two engines share.

offload-runner has two engines that keep the optimizer of (a fraction of) a rank's
distributed-optimizer shard on the host and hand Megatron-Core an inner optimizer:

- ``cpu_adam.CpuAdam`` (``offload/optimizer=cpu_adam*``): Adam runs on the CPU; gradients go down
  and masters come up, 4 B/param each way;
- ``optimizer_states.WindowedStates`` (``offload/optimizer=states``): Adam runs on the GPU; masters
  and moments stream through a small GPU window, 10 B/param each way (each master as its
  16-bit remainder beside the bf16 parameter: remainders.py; 12 with fp32 masters).

Both are the inner optimizer of a precision-aware Megatron-Core DistributedOptimizer (built with
``use_precision_aware_optimizer=True``, so Megatron-Core allocates no fp32 masters on the GPU) and
are HybridDeviceOptimizers by type, so Megatron-Core keeps every other duty (gradient
reduce-scatter, norm and clipping, zero_grad, scheduler, parameter all-gather) and checkpoints them
with HybridDeviceOptimizer's layout: ``state[param]`` holds ``master_param``, ``exp_avg`` and
``exp_avg_sq`` (views of this engine's flat host arrays), the step count lives in the param groups.
A checkpoint moves between the engines and HybridDeviceOptimizer where the layouts match.

This module owns what does not depend on where Adam runs: which parameters go to the host, the
flat host arrays and each parameter's views of them, the pieces they move in (contiguous in the
host arrays, the DDP gradient buffer and the DDP parameter buffer, so each moves with one copy),
the GPU share of Adam for fraction < 1, and the checkpoint hooks.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass

from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

from offload_runner.offload import host_kernel, quantized, remainders
from offload_runner.offload.host_memory import HostArenas, aligned

STATE_KEYS = ("master_param", "exp_avg", "exp_avg_sq")


@dataclass
class Piece:
    """A contiguous run of offloaded elements: it moves as one copy each way."""

    start: int  # in the flat host arrays
    stop: int
    grad: object  # the GPU (or, in tests, CPU) fp32 gradient elements, a view of the DDP buffer
    param: object  # the bf16 parameter elements, a view of the DDP parameter buffer
    groups: list[tuple[int, int, int]]  # (start, stop, param group index), flat coordinates
    block: int = 0  # its first block in the host arrays of 8-bit moments' scales (quantized.py)
    fetched: object = None  # cpu_adam: event, the gradient copy has reached the host
    landed: object = None  # cpu_adam: event, the masters' copy up has read the host buffer

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class AdamSettings:
    """What every host engine is built with: Adam's hyper-parameters, the share of the shard on
    the host, the piece size (4 B per param), the pieces' order (the DDP buffer's; tests give
    their own) and the moments' storage dtypes (fp32 unless bf16 or 8-bit was asked for)."""

    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    fraction: float = 1.0
    chunk_bytes: int = 64 * 1024**2
    order_key: Callable | None = None
    moment_dtypes: tuple = ()

    @classmethod
    def of(cls, run, **rest) -> AdamSettings:
        """``run``'s optimizer hyper-parameters, with ``rest``."""
        o = run.optimizer
        return cls(o.lr, o.weight_decay, (o.adam_beta1, o.adam_beta2), o.adam_eps, **rest)


class HostAdam(HybridDeviceOptimizer):
    """Adam for one DistributedOptimizer's shard, ``fraction`` of it kept on the host.

    ``params`` are the param groups of the precision-aware DistributedOptimizer: bf16 views of the
    DDP parameter buffer, their gradients in ``decoupled_grad`` (fp32 views of the grad buffer).
    On a machine without CUDA (tests) every tensor is on the CPU and copies are synchronous.
    Subclasses allocate the host arrays (``_allocate_states``) and implement ``step``.
    """

    def __init__(self, params, adam: AdamSettings) -> None:
        import torch

        # torch.optim.Optimizer only: none of HybridDeviceOptimizer's own machinery is used.
        defaults = dict(lr=adam.lr, weight_decay=adam.weight_decay, betas=adam.betas, eps=adam.eps)
        torch.optim.Optimizer.__init__(self, params, defaults)
        # exp_avg's and exp_avg_sq's storage (fp32 unless bf16 was asked for); the math is fp32
        self.moment_dtypes = tuple(adam.moment_dtypes) or (torch.float32, torch.float32)
        self.chunk_numel = max(1, adam.chunk_bytes // 4)
        self._arenas = HostArenas()
        self._pieces: list[Piece] | None = None
        self._spans: PieceSpans | None = None  # the pieces' bytes in the parameter buffer
        self._needs: dict[int, int] = {}  # id(module) -> the last piece holding its parameters
        self._own: dict[int, dict] = {}  # id(param) -> its views of the engine's arrays
        self._params_as_masters = False  # bf16 masters: the params stand in (checkpoints)
        self._flat: dict[int, int] = {}  # id(param) -> its start in the flat host arrays

        everything = [(gi, p) for gi, g in enumerate(self.param_groups) for p in g["params"]]
        self.on_cuda = bool(everything) and everything[0][1].is_cuda
        self.device = everything[0][1].device if everything else torch.device("cpu")
        # Backward-ready order: the DDP buffer's own order (``order_key`` for tests). Only bf16
        # parameters move: the copies back are bf16 (fp32 ones, if any, stay on the GPU).
        order_key = adam.order_key or _buffer_position
        ordered = sorted(everything, key=lambda item: order_key(item[1]))
        budget = adam.fraction * sum(p.numel() for _, p in everything)
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

    @property
    def pieces(self) -> list[Piece]:
        """The offloaded elements as pieces, in the order they move (after the first step)."""
        return self._pieces

    def flat_start(self, param) -> int:
        """Where ``param``'s elements start in the flat host arrays."""
        return self._flat[id(param)]

    # -- memory ----------------------------------------------------------------------------
    def _host_array(self, dtype, pin: bool, what: str):
        """A flat host array of ``dtype`` for the offloaded shard (page-locked when ``pin``)."""
        return self._typed_host(dtype, self.offloaded_numel, pin, what)

    def _typed_host(self, dtype, n: int, pin: bool, what: str):
        arena = self._arenas.allocate(aligned(n * dtype.itemsize), pin, what)
        return _typed(arena, dtype, n)

    def _allocate_states(
        self, pin_moments: bool, what: str, remainders: bool = False, bf16_masters: bool = False
    ) -> None:
        """Host masters (page-locked where CUDA copies them) and moments for the offloaded part,
        GPU arrays for the rest, masters copied from the bf16 parameters, moments zero. With
        ``remainders`` the host keeps each master as the int16 remainder beside its bf16
        parameter (remainders.py): 2 B instead of 4, zero for a master equal to its parameter;
        with ``bf16_masters`` none (the parameters are the masters: quantized.py). A moment of
        dtype uint8 is kept as 8-bit codes, its blocks' scales in ``host_scales``."""
        import torch

        self.remainders = remainders
        master = torch.int16 if remainders else torch.float32
        self.host_master = None if bf16_masters else self._host_array(master, self.on_cuda, what)
        pin_moments = pin_moments and self.on_cuda
        first, second = self.moment_dtypes
        self.host_exp_avg = self._host_array(first, pin_moments, what)  # arenas come zeroed
        self.host_exp_avg_sq = self._host_array(second, pin_moments, what)
        # a block for every BLOCK elements, and one more where a run of pieces ends mid-block
        scales = quantized.blocks(self.offloaded_numel) + len(self.offloaded) + 1
        self.host_scales = tuple(
            self._typed_host(torch.float32, scales, pin_moments, what)
            if dtype == torch.uint8
            else None
            for dtype in (None, first, second)
        )
        self._flat = self._lay_out(
            self.offloaded, self.host_master, self.host_exp_avg, self.host_exp_avg_sq
        )
        m, on = sum(p.numel() for _, p in self.kept), self.device
        self.gpu_master = torch.empty(m, dtype=torch.float32, device=on)
        self.gpu_exp_avg = torch.zeros(m, dtype=first, device=on)
        self.gpu_exp_avg_sq = torch.zeros(m, dtype=second, device=on)
        self._lay_out(self.kept, self.gpu_master, self.gpu_exp_avg, self.gpu_exp_avg_sq)

    def _lay_out(self, params: list, master, exp_avg, exp_avg_sq) -> dict[int, int]:
        """Consecutive slices of the flat arrays for ``params`` (their state), masters copied
        from the bf16 parameters; returns each parameter's start."""
        import torch

        starts, start = {}, 0
        for _, p in params:
            view = slice(start, start + p.numel())
            if master is not None and master.dtype != torch.int16:  # remainders come zeroed
                _upcast_into(master[view], p.detach().view(-1))
            self._own[id(p)] = {
                **({} if master is None else {"master_param": master[view]}),
                "exp_avg": exp_avg[view],
                "exp_avg_sq": exp_avg_sq[view],
            }
            self.state[p] = self._views(p)
            starts[id(p)] = start
            start += p.numel()
        _upcasts_landed(params)
        return starts

    @property
    def shard_numel(self) -> int:
        """Every parameter element of this engine's shard, on the host or not."""
        return self.offloaded_numel + sum(p.numel() for _, p in self.kept)

    @property
    def state_bytes_per_param(self) -> float:
        """The fp32 master (or its remainder, or none) and the moments in their dtypes (8-bit
        codes with their share of a block's scale), per offloaded param."""
        import torch

        master = 0 if self.host_master is None else self.host_master.element_size()
        scale = 4 / quantized.BLOCK
        return master + sum(d.itemsize + scale * (d == torch.uint8) for d in self.moment_dtypes)

    @property
    def host_bytes(self) -> int:
        return self._arenas.nbytes

    @property
    def pinned_bytes(self) -> int:
        return self._arenas.pinned_bytes

    # -- the transfer plan (first step: the gradients' places are known then) ---------------
    def _plan(self) -> list[Piece]:
        """Pieces of at most ``chunk_numel`` elements, contiguous on the host, in the gradient
        buffer and in the parameter buffer, so each moves with one copy each way."""
        runs: list[list[tuple[int, object]]] = []
        last_grad = None  # the gradient of the last parameter placed
        for gi, p in self.offloaded:
            grad = self._grad(p)
            if runs and _follows(runs[-1][-1][1], p) and _follows(last_grad, grad):
                runs[-1].append((gi, p))
            else:
                runs.append([(gi, p)])
            last_grad = grad
        pieces = []
        for run in runs:
            first = run[0][1]
            base = self._flat[id(first)]
            numel = sum(p.numel() for _, p in run)
            bounds, offset = [], base  # (start, stop, group) of each parameter in the run
            for gi, p in run:
                bounds.append((offset, offset + p.numel(), gi))
                offset += p.numel()
            grad0, param0 = self._grad(first), first
            for a in range(base, base + numel, self.chunk_numel):
                b = min(a + self.chunk_numel, base + numel)
                groups = _merge(
                    [(max(s, a), min(e, b), gi) for s, e, gi in bounds if s < b and e > a]
                )
                pieces.append(
                    Piece(
                        a,
                        b,
                        _window(grad0, a - base, b - a),
                        _window(param0, a - base, b - a),
                        groups,
                    )
                )
        block = 0
        for piece in pieces:  # their blocks of 8-bit moments' scales, one after the other
            piece.block, block = block, block + quantized.blocks(piece.numel)
        return pieces

    def piece_spans(self) -> PieceSpans:
        """Which of the planned pieces hold a parameter's elements."""
        if self._spans is None:
            self._spans = PieceSpans(self._pieces)
        return self._spans

    def last_piece_needed(self, module, params: list) -> int:
        """The last piece (in update order) holding any of a watched ``module``'s ``params``
        (-1: none), found once per module."""
        index = self._needs.get(id(module))
        if index is None:
            index = self._needs[id(module)] = self.piece_spans().last_holding(params)
        return index

    def _grad(self, p):
        """``p``'s gradient (a view of the DDP buffer, bound by Megatron-Core's step)."""
        return grad_of(p)

    @property
    def steps_taken(self) -> int:
        """Updates applied so far (the step count lives in the param groups)."""
        return int(self.param_groups[0].get("step", 0)) if self.param_groups else 0

    def _next_step(self) -> tuple[int, list[dict]]:
        """This step's number and every group's hyperparameters, captured at ``step()`` (the
        scheduler moves them right after)."""
        return self.steps_taken + 1, [hyper(g) for g in self.param_groups]

    def _end_step(self, step: int) -> None:
        for group in self.param_groups:
            group["step"] = step

    def _gpu_step(self, step: int, hypers: list[dict]) -> None:
        """The share kept on the GPU: fused AdamW on its fp32 masters, rounded into the bf16
        params."""
        import torch

        if not self.kept:
            return
        steps = torch.full((), float(step), device=self.device)
        by_group: dict[int, list] = {}
        for gi, p in self.kept:
            grad = grad_of(p)
            if grad is not None:
                by_group.setdefault(gi, []).append((p, self.state[p], grad))
        for gi, items in by_group.items():
            masters = [s["master_param"] for _, s, _ in items]
            adamw(
                masters,
                [g for _, _, g in items],
                [s["exp_avg"] for _, s, _ in items],
                [s["exp_avg_sq"] for _, s, _ in items],
                steps,
                hypers[gi],
            )
            torch._foreach_copy_([p.view(-1) for p, _, _ in items], masters)

    # -- around the step ---------------------------------------------------------------------
    @property
    def streams_states(self) -> bool:
        """Some of Adam runs on the GPU over states streamed from the host (``prefetch``)."""
        return False

    @property
    def arms(self) -> bool:
        """Something runs during the last micro-batch's backward (``arm``, from ``arming``)."""
        return self.streams_states

    def arm(self) -> None:
        """The last micro-batch's forward and backward follow."""

    def grow(self, reserve: int = 0) -> None:
        """During the armed backward: streamed states into the memory it has freed, but for
        ``reserve`` bytes the rest of the backward allocates (StatesWindow.grow)."""

    def prefetch(self) -> None:
        """Start bringing in the first streamed states (at the tail of backward)."""

    def finish(self) -> None:
        """Wait until the host arrays hold this engine's newest masters and moments
        (checkpoints)."""

    def flush(self) -> None:
        """Make the bf16 parameters the newest (end of training)."""
        self.finish()

    def restore_after_load(self) -> None:
        """After a checkpoint load: put the loaded masters and moments into the engine's own
        arrays (Megatron-Core's loaders replace the state's tensors), and round them into the
        bf16 parameters."""
        for p, state in list(self.state.items()):
            self._adopt(p, state)
        for _, p in self.kept:
            p.detach().view(-1).copy_(self.state[p]["master_param"])
        self._land_loaded_masters()

    def _land_loaded_masters(self) -> None:
        if self.remainders or self.host_master is None:  # _adopt split the loaded masters into
            return  # the parameters already (or they are the masters)
        for _, p in self.offloaded:
            a = self._flat[id(p)]
            p.detach().view(-1).copy_(self.host_master[a : a + p.numel()])

    def _views(self, p) -> dict:
        """``p``'s master and moments in the engine's own arrays (a fresh dict); inside
        ``_parameters_as_masters`` the parameter stands in for an absent master."""
        views = dict(self._own[id(p)])
        if self._params_as_masters:
            views["master_param"] = p.detach().view(-1)
        return views

    def _adopt(self, p, loaded: dict) -> None:
        """Copy loaded tensors of ``p`` (any device) into the engine's arrays; its state becomes
        those arrays' views again (a loaded ``step`` is dropped: the groups hold it)."""
        own = self._views(p)
        for key in STATE_KEYS:
            value = loaded.get(key)
            if value is None or key not in own or value is own[key]:
                continue  # (no master of bf16 masters: the model's checkpoint holds it)
            if own[key].dtype == value.dtype or key != "master_param":
                own[key].copy_(value.reshape(-1))
            else:  # an fp32 master into a remainder: the parameter rounded as it rounds it
                _split_into(value.reshape(-1), p.detach().view(-1), own[key])
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
        params = self.kept + ([] if self.remainders or self.host_master is None else self.offloaded)
        for _, p in params:
            _upcast_into(self.state[p]["master_param"], p.detach().view(-1))
        _upcasts_landed(params)
        if self.remainders:
            self.host_master.zero_()  # each master is its parameter

    @property
    def native_checkpoint(self) -> bool:
        """8-bit moments or bf16 masters: a checkpoint holds the host arrays as they are (codes,
        remainders; the blocks' scales in checkpoint.py's file beside them), exact and without
        the fp32 copies a whole model's host could not hold; only the same precision loads it."""
        return self.host_master is None or any(s is not None for s in self.host_scales)

    def quantized_state(self) -> list:
        """What Megatron-Core's layout cannot carry: the 8-bit moments' block scales."""
        return [s for s in self.host_scales if s is not None]

    @property
    def _rounding(self):
        """bf16 masters' rounding generator, in the state window (None without one)."""
        return getattr(getattr(self, "_window", None), "rounding", None)

    def rounding_state(self):
        """The state of the bf16 masters' rounding generator (None without one)."""
        return None if self._rounding is None else self._rounding.get_state()

    def load_rounding_state(self, state) -> None:
        if self._rounding is not None and state is not None:
            self._rounding.set_state(state)

    def load_quantized_state(self, saved: list) -> None:
        mine = self.quantized_state()
        if [s.numel() for s in saved] != [s.numel() for s in mine]:
            raise ValueError(
                f"the checkpoint's 8-bit moments have {[s.numel() for s in saved]} block scales, "
                f"this rank's shard {[s.numel() for s in mine]}: resume with the layout (model, "
                "parallelism, offload) it was saved with"
            )
        for own, scales in zip(mine, saved, strict=True):
            own.copy_(scales)

    @contextlib.contextmanager
    def fp32_masters(self):
        """For a checkpoint's save or load: ``state[p]["master_param"]`` an fp32 host array (the
        masters rebuilt from the parameters and remainders), HybridDeviceOptimizer's layout, so
        a checkpoint moves between the engines; the remainders' views again after (a load's
        masters went through ``_adopt``). Host memory for 4 B/param meanwhile. A native
        checkpoint keeps the arrays as they are (bf16 masters: the parameters stand in)."""
        import torch

        if self.native_checkpoint:
            self.finish()
            with self._parameters_as_masters():
                yield
            return
        if not self.remainders:
            yield
            return
        self.finish()
        full = torch.empty(self.offloaded_numel, dtype=torch.float32)
        for _, p in self.offloaded:
            a = self._flat[id(p)]
            view = full[a : a + p.numel()]
            remainders.rebuild(
                p.detach().view(-1).cpu(), self.host_master[a : a + p.numel()], out=view
            )
            self.state[p] = {**self._views(p), "master_param": view}
        try:
            yield
        finally:
            for _, p in self.offloaded:
                if self.state[p].get("master_param") is not self._own[id(p)]["master_param"]:
                    self.state[p] = self._views(p)

    @contextlib.contextmanager
    def _parameters_as_masters(self):
        """Without masters (bf16 ones) ``state[p]["master_param"]`` is the parameter itself, the
        key Megatron-Core's checkpoint layout asks for; the engine's own views again after."""
        if self.host_master is not None:
            yield
            return
        # kept through a load too: DistributedOptimizer reloads the engine's own state dict
        # before it lays out the checkpoint's
        self._params_as_masters = True
        for _, p in self.offloaded:
            self.state[p] = self._views(p)
        try:
            yield
        finally:
            self._params_as_masters = False
            for _, p in self.offloaded:
                self.state[p] = self._views(p)

    def close(self) -> None:
        self.finish()
        self._arenas.release()


UPCAST_BLOCK = 1 << 22  # elements upcast at a time on the CPU, into a reused fp32 block


def torch_adamw(steps, h: dict, grad_scale=None):
    """torch's fused AdamW on lists of fp32 tensors, with ``h``'s hyperparameters."""
    import torch

    def run(masters, grads, exp_avgs, exp_avg_sqs) -> None:
        torch._fused_adamw_(
            masters,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            [steps] * len(masters),
            lr=h["lr"],
            beta1=h["beta1"],
            beta2=h["beta2"],
            weight_decay=h["weight_decay"],
            eps=h["eps"],
            amsgrad=False,
            maximize=False,
            grad_scale=grad_scale,
        )

    return run


def adamw(
    masters: list, grads: list, exp_avgs: list, exp_avg_sqs: list, steps, h: dict, grad_scale=None
) -> None:
    """torch's fused AdamW at ``steps`` with ``h``'s hyperparameters, for fp32 masters whose
    gradients or moments may be bf16: fp32 math, bf16 storage rounded to nearest even, as
    Transformer Engine's FusedAdam does with bf16 moments. On the CPU such a mix takes
    host_kernel's one-pass loop where a C compiler built it (fused AdamW takes one dtype), else
    the blocks: upcast into fp32 arrays the thread reuses, updated, the moments rounded back
    (each block wakes the engines' passive OpenMP team twice, and a new array per block costs
    its page faults: docs/evidence/grad-dtype-probe-h100.txt). On the GPU whole tensors are
    upcast."""
    import torch

    fp32, fused = torch.float32, torch_adamw(steps, h, grad_scale)
    if all(t.dtype == fp32 for t in (*grads, *exp_avgs, *exp_avg_sqs)):
        fused(masters, grads, exp_avgs, exp_avg_sqs)
        return
    for master, grad, m, v in zip(masters, grads, exp_avgs, exp_avg_sqs, strict=True):
        on_cpu = master.device.type == "cpu"
        kernel = host_kernel.load() if on_cpu else None
        if kernel is not None and host_kernel.supports(master, grad, m, v):
            scale = 1.0 if grad_scale is None else float(grad_scale)
            host_kernel.adamw(kernel, master, grad, m, v, h, float(steps), scale)
            continue
        block = UPCAST_BLOCK if on_cpu else max(master.numel(), 1)
        for a in range(0, master.numel(), block):
            b = min(a + block, master.numel())
            g32, m32, v32 = (
                _fp32(t[a:b], i if on_cpu else None) for i, t in enumerate((grad, m, v))
            )
            fused([master[a:b]], [g32], [m32], [v32])
            if m.dtype != fp32:
                m[a:b].copy_(m32)
            if v.dtype != fp32:
                v[a:b].copy_(v32)


_SCRATCH = threading.local()  # per thread: fp32 arrays of UPCAST_BLOCK elements


def _fp32(tensor, slot: int | None):
    """``tensor`` itself where fp32, else its fp32 copy: in this thread's ``slot``-th reused
    array (None: a new one)."""
    import torch

    if tensor.dtype == torch.float32:
        return tensor
    if slot is None:
        return tensor.float()
    arrays = getattr(_SCRATCH, "arrays", None)
    if arrays is None or arrays[0].numel() < UPCAST_BLOCK:
        arrays = _SCRATCH.arrays = [torch.empty(UPCAST_BLOCK) for _ in range(3)]
    return arrays[slot][: tensor.numel()].copy_(tensor)


def holders(shards, model_params) -> dict:
    """id(shard) -> (the parameter of ``model_params`` whose data the shard views, the shard's
    first element within it), for each shard one of them holds whole (1-D views of the
    parameter buffer, as the distributed optimizer's shards are, lack their parameters'
    shapes and gradients)."""
    import bisect

    by_storage: dict[int, list] = {}
    for p in model_params:
        by_storage.setdefault(p.untyped_storage().data_ptr(), []).append(p)
    starts = {}
    for ptr, params in by_storage.items():
        params.sort(key=lambda q: q.storage_offset())
        starts[ptr] = [q.storage_offset() for q in params]
    found = {}
    for shard in shards:
        ptr, lo = shard.untyped_storage().data_ptr(), shard.storage_offset()
        i = bisect.bisect_right(starts.get(ptr, []), lo) - 1
        if i < 0:
            continue
        p = by_storage[ptr][i]
        start = lo - p.storage_offset()
        if start + shard.numel() <= p.numel():
            found[id(shard)] = (p, start)
    return found


def main_grad_views(shards, model_params) -> dict:
    """id(shard) -> its gradient before Megatron-Core's optimizer binds it at its step: the same
    elements of the ``main_grad`` (DDP's gradient buffer) of the model parameter whose data the
    shard views, as the distributed optimizer's own binding takes them (shards no parameter of
    ``model_params`` holds are left out)."""
    with_grads = [p for p in model_params if getattr(p, "main_grad", None) is not None]
    found = holders(shards, with_grads)
    views = {}
    for shard in shards:
        if id(shard) in found:
            p, start = found[id(shard)]
            views[id(shard)] = p.main_grad.view(-1)[start : start + shard.numel()]
    return views


def _typed(arena, dtype, numel: int):
    return arena[: numel * dtype.itemsize].view(dtype) if numel else arena[:0].view(dtype)


def grad_of(p):
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


UPCAST_NUMEL = 16 * 1024**2  # bf16 elements upcast on the GPU at once: a 64 MiB fp32 block


def _upcast_into(dst, src) -> None:
    """``dst`` (fp32) = ``src`` (bf16). From the GPU to the host: upcast there block by block
    and copied down asynchronously (the caller synchronizes). One synchronous copy of a bf16
    parameter into a host fp32 array converts on one host thread instead: the proxy's 3.1B
    masters took 2.0 s of the CPU-Adam engine's 5.2 s start-up that way."""
    if not (src.is_cuda and not dst.is_cuda):
        dst.copy_(src)
        return
    for a in range(0, src.numel(), UPCAST_NUMEL):
        b = min(a + UPCAST_NUMEL, src.numel())
        dst[a:b].copy_(src[a:b].float(), non_blocking=True)


def _upcasts_landed(params: list) -> None:
    """Wait for ``_upcast_into``'s asynchronous copies of ``params`` (pairs, as the engines keep
    them) to have landed on the host."""
    import torch

    if params and params[0][1].is_cuda:
        torch.cuda.current_stream().synchronize()


def _split_into(master, param, remainder) -> None:
    """``remainders.split`` of a master into a parameter on any device (through a host copy of
    it) and a host remainder."""
    import torch

    staged = param.cpu() if param.is_cuda else param
    remainders.split(master.to("cpu", torch.float32), staged, remainder)
    if staged is not param:
        param.copy_(staged)


@contextlib.contextmanager
def fp32_masters(optimizer):
    """``HostAdam.fp32_masters`` of every engine of ``optimizer`` at once (checkpoints)."""
    with contextlib.ExitStack() as stack:
        for engine in engines(optimizer):
            stack.enter_context(engine.fp32_masters())
        yield


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


def grad_dtype(run):
    """The DDP gradient buffer's dtype: fp32 with ddp.grad_reduce_in_fp32, else bf16 (what the
    engines' host copies of the gradients are kept in)."""
    import torch

    return torch.float32 if run.ddp.grad_reduce_in_fp32 else torch.bfloat16


def hyper(group: dict) -> dict:
    beta1, beta2 = group["betas"]
    return {
        "lr": float(group["lr"]),
        "weight_decay": float(group["weight_decay"]),
        "beta1": float(beta1),
        "beta2": float(beta2),
        "eps": float(group["eps"]),
    }


def inner_parts(optimizer) -> list:
    """The DistributedOptimizers inside what ``get_megatron_optimizer`` returned that hold an
    inner optimizer (the ones an engine goes into)."""
    from offload_runner.offload.base import optimizer_parts

    return [p for p in optimizer_parts(optimizer) if getattr(p, "optimizer", None) is not None]


def engines(optimizer, kind: type | None = None) -> list:
    """The engines of type ``kind`` (default: every HostAdam: CPU Adam, windowed state offload)
    inside what ``get_megatron_optimizer`` returned."""
    return [
        p.optimizer for p in inner_parts(optimizer) if isinstance(p.optimizer, kind or HostAdam)
    ]


def install(optimizer, build) -> list[HostAdam]:
    """Make ``build(part, index)`` the inner optimizer of every part of ``inner_parts`` (built on
    Megatron-Core's precision-aware path, so no fp32 masters were allocated on the GPU)."""
    built = []
    for index, part in enumerate(inner_parts(optimizer)):
        part.optimizer = build(part, index)
        built.append(part.optimizer)
    return built


def arming(no_sync, built: list):
    """Megatron-Core's ``config.no_sync_func`` for the schedules: DDP's ``no_sync``, and on its
    exit (the last micro-batch follows, as DDP's own grad sync reads it) the engines of
    ``built`` that act during its backward ``arm``; ``no_sync`` itself where none does."""
    armed = [e for e in built if e.arms]
    if not armed:
        return no_sync

    @contextlib.contextmanager
    def no_sync_then_arm():
        with no_sync():
            yield
        for engine in armed:
            engine.arm()

    return no_sync_then_arm


def after_each_grad(chunks, hook) -> list:
    """``hook(param)`` after each trainable parameter's gradient accumulation in ``chunks`` (on
    its autograd node, after Megatron-Core DDP's own hook there, so the DDP buffer holds the
    gradient when it runs); returns the (node, handle) pairs."""
    import torch

    hooks = []
    with torch.enable_grad():
        for chunk in chunks:
            for param in chunk.parameters():
                if param.requires_grad:
                    node = param.expand_as(param).grad_fn.next_functions[0][0]
                    call = functools.partial(_call_with, hook, param)
                    hooks.append((node, node.register_hook(call)))
    return hooks


def _call_with(hook, param, *unused) -> None:
    hook(param)


def before_each_forward(chunks, hook) -> list[tuple[list, object]]:
    """``hook(params, module, args)`` as the first forward pre-hook of each module of ``chunks``
    that holds parameters (``params``: its own); returns the (params, handle) pairs in the order
    the modules are registered (a GPT model's forward order)."""
    pairs = []
    for chunk in chunks:
        for module in chunk.modules():
            params = list(module.parameters(recurse=False))
            if params:
                call = functools.partial(hook, params)
                pairs.append((params, module.register_forward_pre_hook(call, prepend=True)))
    return pairs


class PieceSpans:
    """Which pieces hold a parameter's elements, by their bytes in the parameter buffer."""

    def __init__(self, pieces: list[Piece]) -> None:
        self.spans = sorted(
            (q.param.data_ptr(), q.param.data_ptr() + q.numel * q.param.element_size(), i)
            for i, q in enumerate(pieces)
        )
        self.starts = [a for a, _, _ in self.spans]

    def holding(self, params: list) -> list[int]:
        """The indices of the pieces holding any element of ``params``, ascending."""
        found = set()
        for p in params:
            lo = p.data_ptr()
            hi = lo + p.numel() * p.element_size()
            k = max(bisect.bisect_right(self.starts, lo) - 1, 0)
            while k < len(self.spans) and self.spans[k][0] < hi:
                if lo < self.spans[k][1]:
                    found.add(self.spans[k][2])
                k += 1
        return sorted(found)

    def last_holding(self, params: list) -> int:
        """The last piece holding any element of ``params``; -1: none."""
        held = self.holding(params)
        return held[-1] if held else -1


def gathers_params(part) -> bool:
    """Megatron-Core all-gathers ``part``'s updated parameter shards right after the step
    (several data-parallel ranks share its buffer), so its update must be whole within step()."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size(getattr(part, "data_parallel_group", None)) > 1
