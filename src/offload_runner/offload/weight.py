"""Weight offload: the bf16 weights of ``model.cpu_offloading_num_layers`` transformer layers live
in page-locked host memory and stream through a two-slot GPU ring, module by module.

Transformer Engine removed its own weight offload (>= 2.3: "does not have any effect"), so this
is offload-runner's (``offload/weight=enabled``). The first N layers of the decoder are taken out
of Megatron-Core's DDP buffers and optimizer before those are built (``requires_grad`` off while
they are) and owned here in flat host arrays: bf16 weights, gradients (in DDP's gradient dtype,
summed as its buffer sums them), fp32 masters and the two Adam moments.

The ring streams *units*: each module of those layers with parameters of its own (the fused QKV,
the projection, fc1 and fc2, or a MoE layer's routed experts' fc1 and fc2, the router, norms).
Its two slots share one array, one growing from each end, as wide as a layer's two widest units
together (a gated MLP's fc1 + fc2: three quarters of two fc1s), so neighbours fit side by side;
a pair wider than that (modules of two layers, in a recompute) is not prefetched.
- Forward: a pre-hook on each unit waits for its weights in its slot and starts copying the
  next unit (the order the first forward ran them in) into the other slot on the side stream
  ``h2d``.
- Backward: a hook on the unit's output brings its weights back into the same slot (a unit
  always uses one slot, so any view autograd saved in the forward sees them again) and prefetches
  the unit before it; its gradients accumulate in a GPU gradient slot (``param.main_grad``,
  where Transformer Engine's fused wgrad writes, or added from ``.grad`` by a post-accumulate
  hook, as Megatron-Core's DDP does), and when its backward ends (an identity on its input) they
  go down on ``d2h`` into the host gradients. A later micro-batch brings their sum back up into
  the slot before the unit's backward, which adds to it on the GPU as DDP's buffer would: no
  GPU buffer holds them across micro-batches and the host adds nothing (the CPU's adds of
  2.5B fp32 gradients per micro-batch had kept the proxy's backward waiting; the link moves
  them faster). On the last micro-batch their norm is taken on the GPU on the way.
- Step: the gradients' norm joins the GPU's (``clip_factor``), then the masters, moments and
  gradients go up in pieces, Adam runs on the GPU (Transformer Engine's multi-tensor Adam, the
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
from dataclasses import dataclass, field

from offload_runner.config.schema import RunConfig
from offload_runner.hardware import (
    WEIGHT_GRAD_SLOTS,
    WEIGHT_OFFLOAD_IN_FLIGHT,
    WEIGHT_OFFLOAD_PIECE,
    weight_ring_sizes,
)
from offload_runner.offload.base import OffloadSummary
from offload_runner.offload.host_memory import HostArenas

SLOTS = 2  # weight slots: the unit in use and the next one coming in
STATE_FILE = "weight_offload_rank{rank}.pt"

DISABLED = {"model.cpu_offloading_weights": False}


def enabled(run: RunConfig) -> bool:
    return run.mode.weights and run.model.cpu_offloading_num_layers > 0


def describe(run: RunConfig) -> OffloadSummary:
    m = run.model
    on = enabled(run)
    return OffloadSummary(
        "weights",
        "offload/weight",
        on,
        f"bf16 weights, gradients, masters and Adam moments of the first "
        f"{m.cpu_offloading_num_layers} of {m.num_layers} layers live on the host; a GPU ring of "
        "two modules streams the weights in for forward and backward"
        if on
        else "-",
    )


@dataclass
class _Unit:
    """One streamed module (a module of an offloaded layer with parameters of its own): its
    parameters and where they lie in the flat host arrays."""

    layer: int  # the offloaded layer it belongs to
    module: object
    params: list
    offsets: list  # each param's start, from the unit's start
    start: int  # the unit's start in the flat host arrays
    numel: int
    decays: list  # per param: weight decay applies (Megatron-Core's rule: not biases, not 1-D)
    position: int | None = None  # in the forward's order, once the first forward ran it
    backwards: int = 0  # backward passes this step (micro-batches)
    norm: object = None  # its final gradients' L2 norm (a GPU scalar), on the last one
    down: object = None  # event: its gradients' last copy down is done

    @property
    def slot(self) -> int:  # neighbours in the forward's order alternate between the slots
        return self.position % SLOTS


@dataclass
class _Ring:
    """The GPU side: the weight slots and the gradient slots, each set in one flat array, slot
    0 at its start and slot 1 at its end (module doc)."""

    weights: object
    grads: object
    grad_slots: int
    owner: list = field(default_factory=lambda: [None] * SLOTS)  # the unit in each slot
    loaded: list = field(default_factory=lambda: [None] * SLOTS)  # event: its copy in is done
    drained: list = field(default_factory=lambda: [None] * SLOTS)  # event: grads gone down
    draining: list = field(default_factory=lambda: [None] * SLOTS)  # ... of this unit

    def grad_slot(self, unit: _Unit) -> int:
        return unit.position % self.grad_slots

    def crowds(self, unit: _Unit, other: _Unit | None) -> bool:
        """The two units overlap in the weight array (at opposite ends, wider than it)."""
        return _overlap(self.weights, unit, other)

    def drains_before(self, unit: _Unit) -> list:
        """The copies down that must end before ``unit``'s gradient slot is zeroed: its slot's
        last, and the other slot's where that unit's gradients overlap its own."""
        slot = self.grad_slot(unit)
        other = self.draining[1 - slot] if self.grad_slots == 2 else None
        crowded = _overlap(self.grads, unit, other)
        return [self.drained[slot]] + ([self.drained[1 - slot]] if crowded else [])

    def weight_span(self, unit: _Unit):
        return _end(self.weights, unit.slot, unit.numel)

    def grad_span(self, unit: _Unit):
        return _end(self.grads, self.grad_slot(unit), unit.numel)


def _overlap(array, unit: _Unit, other: _Unit | None) -> bool:
    """Two units at opposite ends of ``array`` overlap (together wider than it)."""
    return other is not None and unit.numel + other.numel > array.numel()


def _end(array, slot: int, numel: int):
    """Slot 0's ``numel`` elements from the start of ``array``, slot 1's from its end."""
    return array[:numel] if slot == 0 else array[array.numel() - numel :]


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
        self.layer_count = len(modules)
        self.units = self._lay_out(modules)
        self.order: list[_Unit] = []  # the units as the first forward ran them
        total = sum(unit.numel for unit in self.units)
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
        self.moved = {"up": 0, "down": 0}  # bytes over the link, over the run, for metrics
        self._take_weights()  # their GPU copies freed before the ring takes its place
        weight_size, grad_size = weight_ring_sizes(
            [[u.numel for u in self.units if u.layer == i] for i in range(len(modules))],
            grad_dtype.itemsize,
        )
        self.ring = _Ring(
            torch.empty(weight_size, dtype=torch.bfloat16, device=device),
            torch.zeros(grad_size, dtype=grad_dtype, device=device),
            WEIGHT_GRAD_SLOTS[grad_dtype.itemsize],
        )
        self.streams = (torch.cuda.Stream(), torch.cuda.Stream()) if self.on_cuda else None
        self.steps = 0
        self.micro_batches = 1
        self._hooks: list = []

    # --- layout ------------------------------------------------------------------------------

    @staticmethod
    def _lay_out(layers: list) -> list[_Unit]:
        """Each layer's modules that own parameters, as units, laid out one after another."""
        units, start = [], 0
        for index, layer in enumerate(layers):
            for module in layer.modules():
                named = list(module.named_parameters(recurse=False))
                if not named:
                    continue
                offsets, at = [], 0
                for _, p in named:
                    offsets.append(at)
                    at += p.numel()
                decays = [not (n.endswith("bias") or p.dim() == 1) for n, p in named]
                params = [p for _, p in named]
                units.append(_Unit(index, module, params, offsets, start, at, decays))
                start += at
        return units

    def _host_view(self, array, unit: _Unit, i: int):
        p, a = unit.params[i], unit.start + unit.offsets[i]
        return array[a : a + p.numel()].view(p.shape)

    def _slot_view(self, slot, unit: _Unit, i: int):
        p, a = unit.params[i], unit.offsets[i]
        return slot[a : a + p.numel()].view(p.shape)

    def _take_weights(self) -> None:
        """The weights into the host arrays (masters as Megatron-Core's optimizer makes them:
        the bf16 weights upcast), the parameters pointed at them."""
        for unit in self.units:
            for i, p in enumerate(unit.params):
                self._host_view(self.weights, unit, i).copy_(p.data)
                p.data = self._host_view(self.weights, unit, i)
        self.master.copy_(self.weights)
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        self.grads.zero_()

    def arm(self) -> None:
        """After DDP and the optimizer are built: gradients on, the hooks (``main_grad`` comes
        with a unit's slot, on its first forward)."""
        for unit in self.units:
            for p in unit.params:
                p.requires_grad_(True)
                p.grad_added_to_main_grad = False  # TE's fused wgrad says it wrote main_grad
                self._hooks.append(p.register_post_accumulate_grad_hook(_add_to_main_grad))
            module = unit.module
            self._hooks.append(
                module.register_forward_pre_hook(self._pre_forward(unit), with_kwargs=True)
            )
            self._hooks.append(module.register_forward_hook(self._post_forward(unit)))

    def _place(self, unit: _Unit) -> None:
        """A unit's first forward: its place in the order, hence its slots and ``main_grad``."""
        unit.position = len(self.order)
        self.order.append(unit)
        grads = self.ring.grad_span(unit)
        for i, p in enumerate(unit.params):
            p.main_grad = self._slot_view(grads, unit, i)

    # --- the ring ----------------------------------------------------------------------------

    def _load(self, unit: _Unit, prefetch: bool = False) -> None:
        """``unit``'s weights into its slot on ``h2d``, after every queued use of the slot. A
        unit that would overlap the other slot's (a pair wider than the ring was sized for) is
        not prefetched, since that one may still be computing; loaded for use, it evicts it
        (queued work has been issued and a later use loads it again)."""
        import torch

        slot = unit.slot
        if self.ring.owner[slot] is unit:
            return
        if self.ring.crowds(unit, self.ring.owner[1 - slot]):
            if prefetch:
                return
            self.ring.owner[1 - slot] = None
        self.ring.owner[slot] = unit
        span = self.weights[unit.start : unit.start + unit.numel]
        self.moved["up"] += span.nbytes
        if self.streams is None:
            self.ring.weight_span(unit).copy_(span)
            return
        h2d = self.streams[0]
        h2d.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(h2d):
            self.ring.weight_span(unit).copy_(span, non_blocking=True)
            self.ring.loaded[slot] = torch.cuda.Event()
            self.ring.loaded[slot].record(h2d)

    def _use(self, unit: _Unit) -> None:
        """``unit``'s weights in its slot, the compute stream behind their copy, the parameters
        pointed at them."""
        import torch

        self._load(unit)
        slot = unit.slot
        if self.streams is not None and self.ring.loaded[slot] is not None:
            torch.cuda.current_stream().wait_event(self.ring.loaded[slot])
        for i, p in enumerate(unit.params):
            p.data = self._slot_view(self.ring.weight_span(unit), unit, i)

    def _neighbour(self, unit: _Unit, step: int, same_layer: bool = False):
        at = unit.position + step
        other = self.order[at] if 0 <= at < len(self.order) else None
        return None if other is None or same_layer and other.layer != unit.layer else other

    def _pre_forward(self, unit: _Unit):
        import torch

        def hook(module, args, kwargs):
            if unit.position is None:
                self._place(unit)
            self._use(unit)
            # the next unit comes in; in a recompute inside backward, only within the layer
            if (following := self._neighbour(unit, 1, _in_backward())) is not None:
                self._load(following, prefetch=True)
            if not torch.is_grad_enabled():
                return None
            hidden = args[0] if args else kwargs.get("hidden_states")
            if not getattr(hidden, "requires_grad", False):
                raise RuntimeError(
                    f"weight offload: the input of {type(module).__name__} (layer {unit.layer}) "
                    "needs no gradient, so nothing would send its gradients to the host"
                )
            hidden = _after_backward().apply(hidden, self, unit)
            if args:
                return (hidden, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": hidden}

        return hook

    def _post_forward(self, unit: _Unit):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            if getattr(out, "requires_grad", False):
                out.register_hook(lambda grad: self._before_backward(unit) or grad)
            return None

        return hook

    def _before_backward(self, unit: _Unit) -> None:
        """The unit's weights back in its slot (a recompute or a neighbour may have replaced
        them); once the last gradients in its gradient slot have gone down, the slot zeroed on
        a step's first micro-batch, else the sum so far brought up into it; the previous unit's
        weights coming."""
        import torch

        self._use(unit)
        slot, drains = self.ring.grad_span(unit), self.ring.drains_before(unit)
        if unit.backwards == 0:
            for event in drains if self.streams is not None else ():
                if event is not None:
                    torch.cuda.current_stream().wait_event(event)
            slot.zero_()
        else:
            self._bring_sum(unit, slot, [*drains, unit.down])
        previous = self._neighbour(unit, -1)
        if previous is not None:
            self._load(previous, prefetch=True)

    def _bring_sum(self, unit: _Unit, slot, after: list) -> None:
        """The unit's gradients summed so far on the host up into its slot on ``h2d``, after
        the copies down in ``after``; the compute stream behind it."""
        import torch

        summed = self.grads[unit.start : unit.start + unit.numel]
        self.moved["up"] += summed.nbytes
        if self.streams is None:
            slot.copy_(summed)
            return
        h2d = self.streams[0]
        for event in after:
            if event is not None:
                h2d.wait_event(event)
        with torch.cuda.stream(h2d):
            slot.copy_(summed, non_blocking=True)
            up = torch.cuda.Event()
            up.record(h2d)
        torch.cuda.current_stream().wait_event(up)

    def after_backward(self, unit: _Unit) -> None:
        """The unit's backward is done: its gradients (their sum over the step's micro-batches
        so far) go down into the host gradients; on the last micro-batch their norm first."""
        import torch

        slot = self.ring.grad_slot(unit)
        unit.backwards += 1
        for p in unit.params:
            p.grad_added_to_main_grad = False
        target = self.grads[unit.start : unit.start + unit.numel]
        source = self.ring.grad_span(unit)
        if unit.backwards == self.micro_batches:  # final: its norm, on the GPU
            unit.norm = torch.linalg.vector_norm(source, dtype=torch.float32)
        self.moved["down"] += target.nbytes
        if self.streams is None:
            target.copy_(source)
        else:
            d2h = self.streams[1]
            d2h.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(d2h):
                target.copy_(source, non_blocking=True)
                unit.down = torch.cuda.Event()
                unit.down.record(d2h)
            self.ring.drained[slot] = unit.down
        self.ring.draining[slot] = unit

    # --- the step ----------------------------------------------------------------------------

    def begin_step(self, micro_batches: int) -> None:
        self.micro_batches = micro_batches
        for unit in self.units:
            unit.backwards, unit.norm = 0, None

    def grads_ready(self) -> float:
        """Every gradient on the host; returns their squared L2 norm (for the global norm)."""

        import torch

        if self.streams is not None:
            self.streams[1].synchronize()
        norms = []
        for unit in self.units:
            grads = self.grads[unit.start : unit.start + unit.numel]
            if unit.backwards == 0:  # no backward reached it: no gradient (DDP's zeroed buffer)
                grads.zero_()
            elif unit.norm is not None:
                norms.append(unit.norm)
            else:  # fewer backward passes than micro-batches: its sum is on the host
                norms.append(torch.linalg.vector_norm(grads, dtype=torch.float32))
        # one copy to the host per device (the last micro-batch's norms are on the GPU)
        kinds = (
            [n for n in norms if n.device.type != "cpu"],
            [n for n in norms if n.device.type == "cpu"],
        )
        return sum((float((torch.stack(k).double() ** 2).sum()) for k in kinds if k), 0.0)

    def update(self, hypers: tuple[dict, dict], clip: float) -> None:
        """Adam on the GPU for every offloaded unit, piece by piece (module doc): ``hypers``
        for the parameters with and without weight decay; gradients scaled by ``clip``. Pieces
        come up on ``h2d`` while the one before runs Adam and the one before that goes down on
        ``d2h``; at most WEIGHT_OFFLOAD_IN_FLIGHT pieces hold GPU memory."""
        import torch

        self.steps += 1
        states = self.master.nbytes + self.exp_avg.nbytes + self.exp_avg_sq.nbytes
        self.moved["up"] += self.grads.nbytes + states
        self.moved["down"] += states + self.weights.nbytes
        adam = _gpu_adam(self.device)
        gone: list = []  # per piece: event, its copies down are done
        for unit in self.units:
            for a, b, decay in self._spans(unit):
                if self.streams is not None and len(gone) >= WEIGHT_OFFLOAD_IN_FLIGHT:
                    # the CPU waits, so the allocator sees that piece's memory free and reuses it
                    gone[-WEIGHT_OFFLOAD_IN_FLIGHT].synchronize()
                gone.append(self._update_piece(a, b, hypers[0 if decay else 1], clip, adam))
        self.ring.owner = [None] * SLOTS  # the slots hold last step's weights
        if self.streams is not None:
            for stream in (torch.cuda.current_stream(), self.streams[0]):
                stream.wait_stream(self.streams[1])  # the next loads read the new host weights
        for unit in self.units:
            for i, p in enumerate(unit.params):
                p.data = self._host_view(self.weights, unit, i)

    def _spans(self, unit: _Unit):
        """(start, stop, decays) runs of the flat arrays, at most WEIGHT_OFFLOAD_PIECE long."""
        runs: list[list] = []
        for i, p in enumerate(unit.params):
            a = unit.start + unit.offsets[i]
            if runs and runs[-1][2] == unit.decays[i] and runs[-1][1] == a:
                runs[-1][1] = a + p.numel()
            else:
                runs.append([a, a + p.numel(), unit.decays[i]])
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
        adam([[grad], [master], [exp_avg], [exp_avg_sq]], self.steps, h)
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
        layout = [unit.numel for unit in self.units]
        return {
            "steps": self.steps,
            "master": self.master,
            "exp_avg": self.exp_avg,
            "exp_avg_sq": self.exp_avg_sq,
            "layout": layout,
        }

    def load_state_dict(self, state: dict) -> None:
        layout = [unit.numel for unit in self.units]
        if state["layout"] != layout:
            raise ValueError(
                "the checkpoint's weight-offload modules differ from this model's: "
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
        for unit in self.units:
            for i, p in enumerate(unit.params):
                view = self._host_view(self.weights, unit, i)
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
        return sum(unit.numel for unit in self.units)

    def metrics(self) -> dict:
        """What it holds, and what it moved over the link per step (forward and backward, and
        the update), each way."""
        steps = max(self.steps, 1)
        ring = self.ring.weights.nbytes + self.ring.grads.nbytes
        return {
            "weight_offload_layers": self.layer_count,
            "weight_offload_params": self.offloaded_params,
            "weight_offload_ring_gb": ring / 1024**3,
            "weight_offload_up_gb": self.moved["up"] / steps / 1e9,
            "weight_offload_down_gb": self.moved["down"] / steps / 1e9,
        }

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


@functools.cache
def _after_backward():
    """Identity on a unit's input whose backward runs once the unit's backward is done (an
    autograd Function, built on first use: torch is imported lazily here)."""
    import torch

    class AfterBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, owner, unit):
            ctx.owner, ctx.unit = owner, unit
            return hidden.view_as(hidden)

        @staticmethod
        def backward(ctx, grad):
            ctx.owner.after_backward(ctx.unit)
            return grad, None, None

    return AfterBackward


def _add_to_main_grad(p) -> None:
    """Megatron-Core DDP's gradient hook for a parameter outside its buffers: ``.grad`` into the
    fp32 ``main_grad`` unless Transformer Engine's fused wgrad already wrote it there."""
    if p.grad is not None and not p.grad_added_to_main_grad:
        p.main_grad.add_(p.grad)
    p.grad = None


def _in_backward() -> bool:
    import torch

    return torch._C._current_graph_task_id() != -1


def _gpu_adam(device):
    """Megatron-Core's GPU Adam kernel (Transformer Engine's), else torch's fused AdamW."""
    import torch

    from offload_runner.offload.host_adam import torch_adamw
    from offload_runner.offload.window import te_adam

    te = te_adam(device) if device.type == "cuda" else None
    if te is not None:
        return te

    def adam(lists: list, step: int, h: dict) -> None:  # [grads, masters, moments, moments]
        grads, masters, exp_avgs, exp_avg_sqs = lists
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
    from offload_runner.offload.host_adam import grad_dtype
    from offload_runner.offload.optimizer_states import moment_dtypes

    return WeightOffload(layers, device, moment_dtypes(run)[0], grad_dtype(run))


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

    total = torch.zeros(
        (),
        dtype=torch.float64,
        device=torch.cuda.current_device() if torch.cuda.is_available() else "cpu",
    )
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
    return [
        b.grad_data for chunk in model for b in [*chunk.buffers, *chunk.expert_parallel_buffers]
    ]
