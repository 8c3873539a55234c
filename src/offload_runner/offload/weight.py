"""Weight offload: the bf16 weights of ``model.cpu_offloading_num_layers`` transformer layers live
in page-locked host memory and stream through a two-slot GPU ring, layer by layer.

Transformer Engine removed its own weight offload (>= 2.3: "does not have any effect"), so this
is offload-runner's (``offload/weight=enabled``). The first N layers of the decoder are taken out
of Megatron-Core's DDP buffers and optimizer before those are built (``requires_grad`` off while
they are) and owned here, per layer, in flat host arrays: bf16 weights, gradients (in DDP's
gradient dtype, summed as its buffer sums them), fp32 masters and the two Adam moments.

- Forward: a pre-hook on each offloaded layer waits for its weights in ring slot ``i % 2`` and
  starts copying layer ``i + 1`` into the other slot on the side stream ``h2d``.
- Backward: a hook on the layer's output brings its weights back into the same slot (a layer
  always uses one slot, so any view autograd saved in the forward sees them again) and prefetches
  layer ``i - 1``; the layer's gradients accumulate in a GPU gradient slot
  (``param.main_grad``, where Transformer Engine's fused wgrad writes, or added from ``.grad`` by
  a post-accumulate hook, as Megatron-Core's DDP does), and when its backward ends they go down
  on ``d2h``: into the host gradients on a step's first micro-batch, through a staging buffer and
  a CPU add on the later ones (no GPU buffer holds a layer's gradients across micro-batches).
- Step: the gradients' norm joins the GPU's (``clip_factor``), then each layer's masters, moments
  and gradients go up in pieces, Adam runs on the GPU (Transformer Engine's multi-tensor Adam, the
  kernel of Megatron-Core's own GPU Adam; torch's fused AdamW without TE) and the masters, moments
  and rounded bf16 weights go back down: no weight goes up twice for the update.

Between steps the offloaded parameters point at their host copy (checkpoints read it there).
One rank only for now (validation refuses data, tensor, pipeline, expert and context
parallelism with it).
"""

from __future__ import annotations

import contextlib
import functools
import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from offload_runner.config.schema import RunConfig, weights_offloaded
from offload_runner.hardware import (
    RESERVED_CORES_DELAYED,
    WEIGHT_OFFLOAD_IN_FLIGHT,
    WEIGHT_OFFLOAD_PIECE,
)
from offload_runner.offload.base import OffloadSummary
from offload_runner.offload.host_memory import HostArenas

SLOTS = 2  # weight slots: the layer in use and the next one coming in
# gradient slots, by the DDP gradient dtype: one fp32 slot (a layer's backward waits for the last
# layer's gradients to have gone down) or two bf16 ones, 4 B per param of the widest layer either
# way, so the ring holds 8 B per param of one layer where each offloaded layer frees 6 (or 4)
GRAD_SLOTS = {4: 1, 2: 2}
STATE_FILE = "weight_offload_rank{rank}.pt"

DISABLED = {"model.cpu_offloading_weights": False}


def enabled(run: RunConfig) -> bool:
    return weights_offloaded(run) and run.model.cpu_offloading_num_layers > 0


def describe(run: RunConfig) -> OffloadSummary:
    m = run.model
    on = enabled(run)
    return OffloadSummary(
        "weights",
        "offload/weight",
        on,
        f"bf16 weights, gradients, masters and Adam moments of the first "
        f"{m.cpu_offloading_num_layers} of {m.num_layers} layers live on the host; a 2-layer GPU "
        "ring streams the weights in for forward and backward"
        if on
        else "-",
    )


@dataclass
class _Layer:
    """One offloaded layer: its parameters and where they lie in the flat host arrays."""

    index: int
    module: object
    params: list
    offsets: list  # each param's start, from the layer's start
    start: int  # the layer's start in the flat host arrays
    numel: int
    decays: list  # per param: weight decay applies (Megatron-Core's rule: not biases, not 1-D)
    backwards: int = 0  # backward passes this step (micro-batches)
    sq_norm: object = None  # Future: its gradients' squared norm, once the last ones are summed


@dataclass
class _Ring:
    """The GPU side: SLOTS weight slots and GRAD_SLOTS gradient slots of the widest layer."""

    weights: object
    grads: object
    owner: list = field(default_factory=lambda: [None] * SLOTS)  # layer index in each slot
    loaded: list = field(default_factory=lambda: [None] * SLOTS)  # event: its copy in is done
    drained: list = field(default_factory=lambda: [None] * SLOTS)  # event: grads gone down

    def grad_slot(self, layer: _Layer) -> int:
        return layer.index % len(self.grads)


def offloaded_layers(model_chunk, count: int) -> list:
    """The first ``count`` TransformerLayers of a model chunk (DDP / Float16Module unwrapped)."""
    module = model_chunk
    while not hasattr(module, "decoder"):
        module = module.module
    return list(module.decoder.layers)[:count]


class WeightOffload:
    """The offloaded layers of one model chunk, their host arrays, ring and hooks (module doc).

    Its layers leave DDP's sight before DDP is built (``exclude``); built after DDP broadcast
    the weights (``take``), armed after the optimizer (``arm``)."""

    def __init__(self, modules: list, device, moment_dtype=None, grad_dtype=None) -> None:
        import torch

        from offload_runner.offload.host_adam import _typed

        self.device = device
        self.on_cuda = device.type == "cuda"
        self.layers = self._lay_out(modules)
        total = sum(layer.numel for layer in self.layers)
        widest = max(layer.numel for layer in self.layers)
        moments = moment_dtype or torch.float32
        grad_dtype = grad_dtype or torch.float32
        self.arenas = HostArenas()

        def host(dtype, numel: int, what: str):
            arena = self.arenas.allocate(
                numel * dtype.itemsize, self.on_cuda, f"weight offload: {what}"
            )
            return _typed(arena, dtype, numel)

        # page-locked: the copy engines read and write each of them
        self.weights = host(torch.bfloat16, total, "bf16 weights")
        self.grads = host(grad_dtype, total, "gradients")  # summed as DDP's buffer sums them
        self.master = host(torch.float32, total, "fp32 masters")
        self.exp_avg = host(moments, total, "exp_avg")
        self.exp_avg_sq = host(moments, total, "exp_avg_sq")
        self.staging = [host(grad_dtype, widest, "staging") for _ in range(SLOTS)]
        self._adding: list[Future | None] = [None] * SLOTS
        # the adds and norms run during backward, on an OpenMP team of the rank's cores
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weight-offload",
                                        initializer=_host_team)  # fmt: skip
        self._adds: list[Future] = []
        self.ring = _Ring(
            torch.empty(SLOTS, widest, dtype=torch.bfloat16, device=device),
            torch.zeros(GRAD_SLOTS[grad_dtype.itemsize], widest, dtype=grad_dtype, device=device),
        )
        self.streams = (torch.cuda.Stream(), torch.cuda.Stream()) if self.on_cuda else None
        self.steps = 0
        self.micro_batches = 1
        self._hooks: list = []
        self._take_weights()

    # --- layout ------------------------------------------------------------------------------

    @staticmethod
    def _lay_out(modules: list) -> list[_Layer]:
        layers, start = [], 0
        for index, module in enumerate(modules):
            named = list(module.named_parameters())
            offsets, at = [], 0
            for _, p in named:
                offsets.append(at)
                at += p.numel()
            decays = [not (n.endswith(".bias") or p.dim() == 1) for n, p in named]
            layers.append(_Layer(index, module, [p for _, p in named], offsets, start, at, decays))
            start += at
        return layers

    def _host_view(self, array, layer: _Layer, i: int):
        p, a = layer.params[i], layer.start + layer.offsets[i]
        return array[a : a + p.numel()].view(p.shape)

    def _slot_view(self, ring_array, layer: _Layer, i: int):
        p, a = layer.params[i], layer.offsets[i]
        return ring_array[layer.index % len(ring_array)][a : a + p.numel()].view(p.shape)

    def _take_weights(self) -> None:
        """The weights into the host arrays (masters as Megatron-Core's optimizer makes them:
        the bf16 weights upcast), the parameters pointed at them."""
        for layer in self.layers:
            for i, p in enumerate(layer.params):
                self._host_view(self.weights, layer, i).copy_(p.data)
                p.data = self._host_view(self.weights, layer, i)
        self.master.copy_(self.weights)
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        self.grads.zero_()

    def arm(self) -> None:
        """After DDP and the optimizer are built: gradients on, main_grad in the gradient slots,
        the hooks."""
        for layer in self.layers:
            for i, p in enumerate(layer.params):
                p.requires_grad_(True)
                p.main_grad = self._slot_view(self.ring.grads, layer, i)
                p.grad_added_to_main_grad = False  # TE's fused wgrad says it wrote main_grad
                self._hooks.append(p.register_post_accumulate_grad_hook(_add_to_main_grad))
            module = layer.module
            self._hooks.append(module.register_forward_pre_hook(
                self._pre_forward(layer), with_kwargs=True))  # fmt: skip
            self._hooks.append(module.register_forward_hook(self._post_forward(layer)))

    # --- the ring ----------------------------------------------------------------------------

    def _load(self, layer: _Layer) -> None:
        """``layer``'s weights into its slot on ``h2d``, after every queued use of the slot."""
        import torch

        slot = layer.index % SLOTS
        if self.ring.owner[slot] == layer.index:
            return
        self.ring.owner[slot] = layer.index
        span = self.weights[layer.start : layer.start + layer.numel]
        if self.streams is None:
            self.ring.weights[slot][: layer.numel].copy_(span)
            return
        h2d = self.streams[0]
        h2d.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(h2d):
            self.ring.weights[slot][: layer.numel].copy_(span, non_blocking=True)
            self.ring.loaded[slot] = torch.cuda.Event()
            self.ring.loaded[slot].record(h2d)

    def _use(self, layer: _Layer) -> None:
        """``layer``'s weights in its slot, the compute stream behind their copy, the parameters
        pointed at them."""
        import torch

        self._load(layer)
        slot = layer.index % SLOTS
        if self.streams is not None and self.ring.loaded[slot] is not None:
            torch.cuda.current_stream().wait_event(self.ring.loaded[slot])
        for i, p in enumerate(layer.params):
            p.data = self._slot_view(self.ring.weights, layer, i)

    def _neighbour(self, layer: _Layer, step: int):
        index = layer.index + step
        return self.layers[index] if 0 <= index < len(self.layers) else None

    def _pre_forward(self, layer: _Layer):
        import torch

        def hook(module, args, kwargs):
            if _in_backward():  # full recompute: the layer's backward follows this forward
                self._before_backward(layer)
            else:
                self._use(layer)
                if (following := self._neighbour(layer, 1)) is not None:
                    self._load(following)
            if not torch.is_grad_enabled():
                return None
            if args:
                return (_after_backward().apply(args[0], self, layer), *args[1:]), kwargs
            if kwargs.get("hidden_states") is not None:
                kwargs = {**kwargs, "hidden_states": _after_backward().apply(
                    kwargs["hidden_states"], self, layer)}  # fmt: skip
            return args, kwargs

        return hook

    def _post_forward(self, layer: _Layer):
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            if getattr(hidden, "requires_grad", False) and not _in_backward():
                hidden.register_hook(lambda grad: self._before_backward(layer) or grad)
            return None

        return hook

    def _before_backward(self, layer: _Layer) -> None:
        """The layer's weights back in its slot, the previous layer's coming, its gradient slot
        zeroed once its last gradients have gone down."""
        import torch

        self._use(layer)
        previous = self._neighbour(layer, -1)
        if previous is not None:
            self._load(previous)
        slot = self.ring.grad_slot(layer)
        if self.streams is not None and self.ring.drained[slot] is not None:
            torch.cuda.current_stream().wait_event(self.ring.drained[slot])
        self.ring.grads[slot][: layer.numel].zero_()

    def after_backward(self, layer: _Layer) -> None:
        """The layer's backward is done: its gradients go down (on the first micro-batch
        straight into the host gradients, else through staging and a CPU add)."""
        import torch

        slot = self.ring.grad_slot(layer)
        first = layer.backwards == 0
        layer.backwards += 1
        for p in layer.params:
            p.grad_added_to_main_grad = False
        target = self.grads[layer.start : layer.start + layer.numel]
        k = layer.index % SLOTS  # the staging buffer
        if not first:
            if self._adding[k] is not None:
                self._adding[k].result()  # the staging buffer's last add has read it
            staged = self.staging[k][: layer.numel]
        source = self.ring.grads[slot][: layer.numel]
        event = None
        if self.streams is None:
            (target if first else staged).copy_(source)
        else:
            d2h = self.streams[1]
            d2h.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(d2h):
                (target if first else staged).copy_(source, non_blocking=True)
                event = torch.cuda.Event()
                event.record(d2h)
            self.ring.drained[slot] = event
        if not first:
            self._adding[k] = self._pool.submit(_add_when_down, target, staged, event)
            self._adds.append(self._adding[k])
        if layer.backwards == self.micro_batches:  # its sum is final: its norm, off the path
            layer.sq_norm = self._pool.submit(_sq_norm_when_down, target, event)

    # --- the step ----------------------------------------------------------------------------

    def begin_step(self, micro_batches: int) -> None:
        self.micro_batches = micro_batches
        for layer in self.layers:
            layer.backwards, layer.sq_norm = 0, None

    def grads_ready(self) -> float:
        """Every gradient on the host; returns their squared L2 norm (for the global norm)."""

        if self.streams is not None:
            self.streams[1].synchronize()
        for done in self._adds:
            done.result()
        self._adds.clear()
        self._adding = [None] * SLOTS
        total = 0.0
        for layer in self.layers:
            grads = self.grads[layer.start : layer.start + layer.numel]
            if layer.backwards == 0:  # no backward reached it: no gradient (DDP's zeroed buffer)
                grads.zero_()
            total += layer.sq_norm.result() if layer.sq_norm else _sq_norm_when_down(grads, None)
        return total

    def update(self, hypers: tuple[dict, dict], clip: float) -> None:
        """Adam on the GPU for every offloaded layer, piece by piece (module doc): ``hypers``
        for the parameters with and without weight decay; gradients scaled by ``clip``. Pieces
        come up on ``h2d`` while the one before runs Adam and the one before that goes down on
        ``d2h``; at most WEIGHT_OFFLOAD_IN_FLIGHT pieces hold GPU memory."""
        import torch

        self.steps += 1
        adam = _gpu_adam(self.device)
        gone: list = []  # per piece: event, its copies down are done
        for layer in self.layers:
            for a, b, decay in self._spans(layer):
                if self.streams is not None and len(gone) >= WEIGHT_OFFLOAD_IN_FLIGHT:
                    # the CPU waits, so the allocator sees that piece's memory free and reuses it
                    gone[-WEIGHT_OFFLOAD_IN_FLIGHT].synchronize()
                gone.append(self._update_piece(a, b, hypers[0 if decay else 1], clip, adam))
        self.ring.owner = [None] * SLOTS  # the slots hold last step's weights
        if self.streams is not None:
            for stream in (torch.cuda.current_stream(), self.streams[0]):
                stream.wait_stream(self.streams[1])  # the next loads read the new host weights
        for layer in self.layers:
            for i, p in enumerate(layer.params):
                p.data = self._host_view(self.weights, layer, i)

    def _spans(self, layer: _Layer):
        """(start, stop, decays) runs of the flat arrays, at most WEIGHT_OFFLOAD_PIECE long."""
        runs: list[list] = []
        for i, p in enumerate(layer.params):
            a = layer.start + layer.offsets[i]
            if runs and runs[-1][2] == layer.decays[i] and runs[-1][1] == a:
                runs[-1][1] = a + p.numel()
            else:
                runs.append([a, a + p.numel(), layer.decays[i]])
        for a, b, decay in runs:
            for s in range(a, b, WEIGHT_OFFLOAD_PIECE):
                yield s, min(b, s + WEIGHT_OFFLOAD_PIECE), decay

    def _update_piece(self, a: int, b: int, h: dict, clip: float, adam):
        """One piece: up on ``h2d``, Adam on the compute stream, down on ``d2h``; returns the
        event after its copies down (None without CUDA)."""
        import torch

        arrays = (self.grads, self.master, self.exp_avg, self.exp_avg_sq)
        streams = self.streams or (None, None)
        with torch.cuda.stream(streams[0]) if streams[0] else contextlib.nullcontext():
            grad, master, exp_avg, exp_avg_sq = (
                x[a:b].to(self.device, torch.float32, non_blocking=True) for x in arrays
            )
        compute = torch.cuda.current_stream() if streams[0] else None
        if compute is not None:
            compute.wait_stream(streams[0])
        if clip != 1.0:
            grad.mul_(clip)
        adam([grad], [master], [exp_avg], [exp_avg_sq], self.steps, h)
        rounded = master.to(torch.bfloat16)
        down = [
            (self.master, master),
            (self.exp_avg, exp_avg.to(self.exp_avg.dtype)),
            (self.exp_avg_sq, exp_avg_sq.to(self.exp_avg_sq.dtype)),
            (self.weights, rounded),
        ]
        if compute is None:
            for host, gpu in down:
                host[a:b].copy_(gpu)
            return None
        streams[1].wait_stream(compute)
        with torch.cuda.stream(streams[1]):
            for host, gpu in down:
                host[a:b].copy_(gpu, non_blocking=True)
            done = torch.cuda.Event()
            done.record(streams[1])
        for tensor in (grad, master, exp_avg, exp_avg_sq, rounded, *(gpu for _, gpu in down)):
            tensor.record_stream(compute)  # freed for reuse once every stream is past it
            tensor.record_stream(streams[1])
        return done

    def finish(self) -> None:
        import torch

        if self.on_cuda:
            torch.cuda.current_stream().synchronize()

    flush = finish

    # --- checkpoints, metrics, teardown ------------------------------------------------------

    def state_dict(self) -> dict:
        self.finish()
        layout = [layer.numel for layer in self.layers]
        return {"steps": self.steps, "master": self.master, "exp_avg": self.exp_avg,
                "exp_avg_sq": self.exp_avg_sq, "layout": layout}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        layout = [layer.numel for layer in self.layers]
        if state["layout"] != layout:
            raise ValueError(
                "the checkpoint's weight-offload layers differ from this model's: "
                f"{state['layout']} against {layout}"
            )
        self.steps = int(state["steps"])
        for name in ("master", "exp_avg", "exp_avg_sq"):
            getattr(self, name).copy_(state[name])
        self.weights.copy_(self.master)  # the model's weights loaded too; the masters rule

    @contextlib.contextmanager
    def pageable(self):
        """The offloaded parameters on pageable copies for a checkpoint's save or load (torch's
        sharded tensors refuse page-locked storage their shards do not share); copied back and
        pointed at the host arrays again on exit."""
        self.finish()
        moved = []
        for layer in self.layers:
            for i, p in enumerate(layer.params):
                view = self._host_view(self.weights, layer, i)
                p.data = view.clone()
                moved.append((p, view))
        try:
            yield
        finally:
            for p, view in moved:
                view.copy_(p.data)
                p.data = view

    @property
    def pinned_bytes(self) -> int:
        return self.arenas.pinned_bytes

    @property
    def offloaded_params(self) -> int:
        return sum(layer.numel for layer in self.layers)

    def metrics(self) -> dict:
        return {"weight_offload_layers": len(self.layers),
                "weight_offload_params": self.offloaded_params,
                "weight_offload_ring_gb": (self.ring.weights.nbytes + self.ring.grads.nbytes)
                / 1024**3}  # fmt: skip

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._pool.shutdown(wait=True)


@functools.cache
def _after_backward():
    """Identity on a layer's input whose backward runs once the layer's backward is done (an
    autograd Function, built on first use: torch is imported lazily here)."""
    import torch

    class AfterBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, owner, layer):
            ctx.owner, ctx.layer = owner, layer
            return hidden.view_as(hidden)

        @staticmethod
        def backward(ctx, grad):
            ctx.owner.after_backward(ctx.layer)
            return grad, None, None

    return AfterBackward


def _add_to_main_grad(p) -> None:
    """Megatron-Core DDP's gradient hook for a parameter outside its buffers: ``.grad`` into the
    fp32 ``main_grad`` unless Transformer Engine's fused wgrad already wrote it there."""
    if p.grad is not None and not p.grad_added_to_main_grad:
        p.main_grad.add_(p.grad)
    p.grad = None


def _host_team() -> None:
    """The weight offload's worker: an OpenMP team of the rank's cores but those the training
    thread and data loading keep (a new thread starts with OpenMP's default team: with one
    core the MoE proxy's backward waited on its adds, the GPU busy 5% of the step, H100)."""
    import os

    import torch

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - RESERVED_CORES_DELAYED))


def _add_when_down(target, staged, event) -> None:
    if event is not None:
        event.synchronize()
    target.add_(staged)


def _sq_norm_when_down(grads, event) -> float:
    import torch

    if event is not None:
        event.synchronize()
    return float(torch.linalg.vector_norm(grads, dtype=torch.float32)) ** 2


def _in_backward() -> bool:
    import torch

    return torch._C._current_graph_task_id() != -1


def _gpu_adam(device):
    """Megatron-Core's GPU Adam kernel (Transformer Engine's), else torch's fused AdamW."""
    import torch

    from offload_runner.offload.host_adam import torch_adamw
    from offload_runner.offload.optimizer_states import _te_adam

    te = _te_adam(device) if device.type == "cuda" else None
    if te is not None:
        return te

    def adam(grads, masters, exp_avgs, exp_avg_sqs, step: int, h: dict) -> None:
        steps = torch.tensor(float(step), device=device)
        torch_adamw(steps, h)(masters, grads, exp_avgs, exp_avg_sqs)

    return adam


# --- what the training loop calls ----------------------------------------------------------------


def exclude(run: RunConfig, chunk) -> list:
    """Before DDP wraps ``chunk``: the layers to offload, their parameters out of DDP's buffers
    and the optimizer (``requires_grad`` off until ``WeightOffload.arm``)."""
    if not enabled(run):
        return []
    layers = offloaded_layers(chunk, run.model.cpu_offloading_num_layers)
    for layer in layers:
        for p in layer.parameters():
            p.requires_grad_(False)
    return layers


def take(run: RunConfig, layers: list, device) -> WeightOffload | None:
    """After DDP broadcast the parameters: ``layers``' weights to the host (None: no layers)."""
    if not layers:
        return None
    import torch

    from offload_runner.offload.optimizer_states import moment_dtypes

    grads = torch.float32 if run.ddp.grad_reduce_in_fp32 else torch.bfloat16
    return WeightOffload(layers, device, moment_dtypes(run)[0], grads)


def of(model: list) -> list[WeightOffload]:
    """The weight offloads of a rank's model chunks (set by mcore.model.build_model)."""
    return [o for chunk in model if (o := getattr(chunk, "weight_offload", None)) is not None]


def hypers_of(optimizer) -> tuple[dict, dict]:
    """The step's Adam hyperparameters for parameters with and without weight decay, read
    from Megatron-Core's param groups (the scheduler sets lr and weight decay there)."""
    from offload_runner.offload.host_adam import hyper

    groups = [g for g in optimizer.param_groups if not g.get("is_expert_parallel", False)]
    groups = groups or list(optimizer.param_groups)
    decay = next((g for g in groups if g.get("wd_mult", 1.0) > 0), groups[0])
    h = hyper(decay)
    return h, {**h, "weight_decay": 0.0}


def clip_factor(sq_norms: list[float], clip_grad: float) -> tuple[float, float]:
    """(the global gradient norm, the factor clipping scales every gradient by), as
    Megatron-Core's clip_grad_by_total_norm_fp32 computes them."""
    norm = math.sqrt(sum(sq_norms))
    if clip_grad <= 0:
        return norm, 1.0
    coeff = clip_grad / (norm + 1.0e-6)
    return norm, min(coeff, 1.0)


def gpu_grad_sq_norm(model: list) -> float:
    """The squared L2 norm of the gradients in DDP's buffers (one rank: nothing duplicated)."""
    import torch

    total = torch.zeros((), dtype=torch.float64, device=torch.cuda.current_device()
                        if torch.cuda.is_available() else "cpu")  # fmt: skip
    for grads in _ddp_grads(model):
        total += torch.linalg.vector_norm(grads, dtype=torch.float32).double() ** 2
    return float(total)


def scale_gpu_grads(model: list, factor: float) -> None:
    if factor == 1.0:
        return
    for grads in _ddp_grads(model):
        grads.mul_(factor)


def _ddp_grads(model: list) -> list:
    """The gradient arrays of DDP's buffers (dense and expert) of a rank's model chunks."""
    return [b.grad_data for chunk in model
            for b in [*chunk.buffers, *chunk.expert_parallel_buffers]]  # fmt: skip
