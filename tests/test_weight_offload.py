"""offload/weight.py on the CPU: layers whose weights live in host arrays and pass through a
two-slot ring train exactly as the same layers resident (gradients over micro-batches, the global
norm's clipping, Adam), and checkpoint their masters and moments."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from offload_runner.offload import weight
from offload_runner.offload.host_adam import torch_adamw

HIDDEN = 16


class Layer(nn.Module):
    """Three modules with weights, registered otherwise than they run (as Megatron-Core's
    attention registers its projection before its QKV): the ring must follow the run."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(4 * HIDDEN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN)

    def forward(self, hidden_states):
        return hidden_states + self.out(torch.tanh(self.up(self.norm(hidden_states)))), None


class Decoder(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(layers))


class Model(nn.Module):
    """What offloaded_layers looks for: ``.decoder.layers`` under wrappers' ``.module``."""

    def __init__(self, layers: int = 4, recompute: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(HIDDEN, HIDDEN)
        self.decoder = Decoder(layers)
        self.recompute = recompute  # each layer's forward again inside backward (full recompute)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.decoder.layers:
            if self.recompute:
                h = checkpoint(
                    lambda h, layer=layer: layer(hidden_states=h)[0], h, use_reentrant=True
                )
            else:
                h, _ = layer(hidden_states=h)
        return h.pow(2).mean()


def _bf16_model(layers: int = 4, recompute: bool = False) -> Model:
    torch.manual_seed(0)
    return Model(layers, recompute).to(torch.bfloat16)


H = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}


def _reference_step(
    model: Model, batches, state: dict, step: int, clip: float, grad_dtype=torch.float32
) -> float:
    """The resident model: gradients summed over micro-batches in DDP's gradient dtype, clipped
    by the global norm, AdamW (torch's fused kernel) on fp32 masters; returns the norm."""
    params = dict(model.named_parameters())
    grads = _summed_grads(model, params, batches, grad_dtype)
    norm, factor = weight.clip_factor(
        [float(torch.linalg.vector_norm(g, dtype=torch.float64) ** 2) for g in grads.values()], clip
    )
    _adam(params, grads, state, step, factor)
    return norm


def _summed_grads(model: Model, params: dict, batches, dtype=torch.float32) -> dict:
    """``params``' gradients summed over the micro-batches in ``dtype`` (as DDP's buffer sums
    them), as fp32."""
    grads = {n: torch.zeros_like(p, dtype=dtype) for n, p in params.items()}
    for x in batches:
        for p in params.values():
            p.grad = None
        model(x).backward()
        for n, p in params.items():
            grads[n] += p.grad.to(dtype)
    return {n: g.float() for n, g in grads.items()}


def _adam(params: dict, grads: dict, state: dict, step: int, factor: float) -> None:
    """AdamW (torch's fused kernel) on resident fp32 masters, Megatron-Core's weight-decay rule."""
    steps = torch.tensor(float(step))
    for n, p in params.items():
        master, m, v = state.setdefault(
            n, (p.detach().float().clone(), torch.zeros_like(grads[n]), torch.zeros_like(grads[n]))
        )
        h = H if not (n.endswith(".bias") or p.dim() == 1) else {**H, "weight_decay": 0.0}
        torch_adamw(steps, h)([master], [grads[n] * factor], [m], [v])
        p.data.copy_(master)


def _offloaded_step(
    model: Model, offload: weight.WeightOffload, batches, state: dict, clip: float
) -> float:
    """The same with the first layers offloaded: the rest resident as in the reference."""
    offload.begin_step(len(batches))
    rest = {
        n: p
        for n, p in model.named_parameters()
        if not n.startswith("decoder.layers.0") and not n.startswith("decoder.layers.1")
    }
    grads = _summed_grads(model, rest, batches, offload.grads.dtype)
    sq = [float(torch.linalg.vector_norm(g, dtype=torch.float64) ** 2) for g in grads.values()]
    norm, factor = weight.clip_factor([sum(sq), offload.grads_ready()], clip)
    offload.update((H, {**H, "weight_decay": 0.0}), factor)
    _adam(rest, grads, state, offload.steps, factor)
    return norm


def _offload(model: Model, layers: int = 2, grad_dtype=torch.float32) -> weight.WeightOffload:
    modules = weight.offloaded_layers(model, layers)
    for module in modules:
        for p in module.parameters():
            p.requires_grad_(False)
    offload = weight.WeightOffload(modules, torch.device("cpu"), grad_dtype=grad_dtype)
    offload.arm()
    return offload


@pytest.mark.parametrize("recompute", [False, True], ids=["", "recompute"])
@pytest.mark.parametrize("clip", [0.0, 1.0, 1e-3])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_offloaded_layers_train_as_resident_ones_bit_for_bit(
    clip: float, grad_dtype, recompute: bool
) -> None:
    """fp32 gradients: one gradient slot (each unit waits for the last one's to go down);
    bf16: two, and the host sums micro-batches in bf16 as DDP's bf16 buffer does. With full
    recompute each layer's units run forward again inside backward, replacing each other in
    the two slots: each unit's backward must find its own weights again."""
    reference, offloaded = _bf16_model(recompute=recompute), _bf16_model(recompute=recompute)
    offload = _offload(offloaded, grad_dtype=grad_dtype)
    assert offload.ring.grad_slots == (1 if grad_dtype == torch.float32 else 2)
    torch.manual_seed(1)
    data = [[torch.randn(3, HIDDEN, dtype=torch.bfloat16) for _ in range(3)] for _ in range(4)]
    ref_state, off_state = {}, {}
    try:
        for step, batches in enumerate(data, start=1):
            ref_norm = _reference_step(reference, batches, ref_state, step, clip, grad_dtype)
            off_norm = _offloaded_step(offloaded, offload, batches, off_state, clip)
            # fp32 norms summed per layer here, per tensor there
            assert off_norm == pytest.approx(ref_norm, rel=1e-6)
            # Adam's first moment carries the clipped gradient (Adam's step alone would not
            # show a clip factor): the offloaded layers' equal the resident ones'
            first = next(u for u in offload.units if u.module is offloaded.decoder.layers[0].norm)
            m = ref_state["decoder.layers.0.norm.weight"][1]
            assert first.params[0] is offloaded.decoder.layers[0].norm.weight
            got = offload.exp_avg[first.start : first.start + m.numel()].view_as(m)
            torch.testing.assert_close(got, m, rtol=1e-5, atol=1e-12)
        for (name, a), (_, b) in zip(
            reference.named_parameters(), offloaded.named_parameters(), strict=True
        ):
            if clip == 0.0:  # no clip factor whose last bit the two norms' order moves
                assert torch.equal(a.detach(), b.detach()), name
            else:
                torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-2, atol=1e-2)
    finally:
        offload.close()


@contextlib.contextmanager
def _after_one_step(grad_dtype=None):
    """The toy with two layers offloaded, after one step's forward and backward."""
    model = _bf16_model()
    offload = _offload(model, grad_dtype=grad_dtype)
    try:
        offload.begin_step(1)
        model(torch.randn(3, HIDDEN, dtype=torch.bfloat16)).backward()
        offload.grads_ready()
        yield model, offload
    finally:
        offload.close()


def test_the_ring_streams_modules_in_the_order_they_run() -> None:
    """Two slots at the ends of one array of the two widest modules, not of a layer; neighbours
    in the forward's order (not the modules' registration order) in different slots, so the
    next one's copy never lands on the one computing."""
    with _after_one_step() as (model, offload):
        first, second = model.decoder.layers[:2]
        ran = [first.norm, first.up, first.out, second.norm, second.up, second.out]
        assert [u.module for u in offload.order] == ran
        assert [u.slot for u in offload.order] == [0, 1, 0, 1, 0, 1]
        sizes = sorted((sum(p.numel() for p in m.parameters()) for m in ran[:3]), reverse=True)
        assert offload.ring.weights.shape == (sizes[0] + sizes[1],)  # a layer's two widest
        assert sizes[0] + sizes[1] < 2 * sizes[0]
        for unit in offload.order:  # slot 0 from the array's start, slot 1 from its end
            span = offload.ring.weight_span(unit)
            at = span.data_ptr() - offload.ring.weights.data_ptr()
            end = offload.ring.weights.numel() - unit.numel
            assert at == (0 if unit.slot == 0 else end * span.element_size())


def test_a_pair_wider_than_the_ring_is_not_prefetched_and_a_use_evicts() -> None:
    """Two layers' fc1s (``up``) at opposite ends overlap (the ring is one layer's fc1 + fc2
    wide): the prefetch of one beside the other is skipped, since that one may be computing;
    its use evicts the other, which comes back whole when next used."""
    with _after_one_step() as (model, offload):
        first, second = model.decoder.layers[:2]
        up = [next(u for u in offload.order if u.module is layer.up) for layer in (first, second)]
        assert up[0].slot != up[1].slot and offload.ring.crowds(*up)
        offload._use(up[1])
        offload._load(up[0], prefetch=True)
        assert offload.ring.owner[up[0].slot] is not up[0]
        assert offload.ring.owner[up[1].slot] is up[1]
        offload._use(up[0])
        assert offload.ring.owner[up[1].slot] is None
        offload._use(up[1])
        for unit in up:
            host = offload.weights[unit.start : unit.start + unit.numel]
            if offload.ring.owner[unit.slot] is unit:
                assert torch.equal(offload.ring.weight_span(unit), host)
        assert offload.ring.owner[up[0].slot] is None


def test_bf16_gradient_slots_wait_for_an_overlapping_neighbours_copy_down() -> None:
    """bf16 gradients take two slots from the ends of one array as the weights do: a unit's
    slot is zeroed after its own slot's last copy down, and after the other slot's too where
    that unit's gradients overlap its own."""
    with _after_one_step(torch.bfloat16) as (model, offload):
        ring = offload.ring
        up = [
            next(u for u in offload.order if u.module is layer.up)
            for layer in model.decoder.layers[:2]
        ]
        out = next(u for u in offload.order if u.module is model.decoder.layers[0].out)
        assert ring.grads.numel() == ring.weights.numel()
        ring.draining = [None] * 2
        ring.draining[ring.grad_slot(up[1])] = up[1]
        assert len(ring.drains_before(up[0])) == 2  # overlapping: both copies down
        ring.draining[ring.grad_slot(up[1])] = out
        assert ring.grad_slot(out) != ring.grad_slot(up[0])
        assert len(ring.drains_before(up[0])) == 1  # side by side: its own slot's only


def test_between_steps_the_offloaded_parameters_are_their_host_copy() -> None:
    model = _bf16_model()
    offload = _offload(model)
    try:
        params = list(model.decoder.layers[0].parameters())
        host = offload.weights.untyped_storage().data_ptr()
        assert all(p.untyped_storage().data_ptr() == host for p in params)
        assert not any(
            p.untyped_storage().data_ptr() == host for p in model.decoder.layers[2].parameters()
        )
        assert offload.offloaded_params == sum(
            p.numel() for p in model.decoder.layers[:2].parameters()
        )
    finally:
        offload.close()


def test_a_layer_without_a_backward_gets_no_stale_gradient() -> None:
    """A layer no micro-batch reached (e.g. cut off) has zero gradients, as DDP's zeroed
    buffer would."""
    model = _bf16_model()
    offload = _offload(model)
    try:
        offload.grads.fill_(7.0)
        offload.begin_step(2)
        assert offload.grads_ready() == 0.0
    finally:
        offload.close()


def test_masters_and_moments_round_trip_through_a_checkpoint() -> None:
    model = _bf16_model()
    offload = _offload(model)
    x = [torch.randn(3, HIDDEN, dtype=torch.bfloat16)]
    try:
        _offloaded_step(model, offload, x, {}, 1.0)
        saved = copy.deepcopy(offload.state_dict())
        restored = _offload(_bf16_model())
        restored.load_state_dict(saved)
        assert restored.steps == 1
        for name in ("master", "exp_avg", "exp_avg_sq", "weights"):
            assert torch.equal(getattr(restored, name), getattr(offload, name)), name
        restored.close()
        other = _offload(_bf16_model(layers=4), layers=1)
        with pytest.raises(ValueError, match="modules differ"):
            other.load_state_dict(saved)
        other.close()
    finally:
        offload.close()


def test_a_checkpoint_sees_the_weights_on_pageable_copies_and_they_come_back() -> None:
    """torch's sharded tensors refuse page-locked storage (measured on the GPU); the copies'
    values, changed as a load changes them, land in the host arrays."""
    model = _bf16_model()
    offload = _offload(model)
    try:
        p = model.decoder.layers[0].up.weight
        host = offload.weights.untyped_storage().data_ptr()
        with offload.pageable():
            assert p.untyped_storage().data_ptr() != host
            p.data.fill_(0.5)  # what a load would write
        assert p.untyped_storage().data_ptr() == host
        assert torch.all(p == 0.5)
    finally:
        offload.close()


BRIDGE = ("--recipe", "tiny", "model.cpu_offloading=True", "model.cpu_offloading_num_layers=2")
WEIGHTS_ONLY = ("model.cpu_offloading_weights=True", "model.cpu_offloading_activations=False")


@pytest.mark.parametrize(
    ("lines", "code"),
    [
        pytest.param(("model.cpu_offloading_activations=True",), 0, id="activations"),
        # weights alone keep their optimizer state on the GPU: refused, the fix says which engine
        pytest.param(WEIGHTS_ONLY, 2, id="weights-without-a-host-engine"),
        pytest.param((*WEIGHTS_ONLY, "offload/optimizer=states"), 0, id="weights"),
        pytest.param(
            (
                "model.cpu_offloading_weights=True",
                "model.cpu_offloading_activations=True",
                "offload/optimizer=states",
            ),
            0,
            id="both",
        ),
    ],
)
def test_megatron_bridge_offload_lines_dry_run(lines, code: int, tmp_path, capsys) -> None:
    """Megatron-Bridge's three cpu_offloading_* configs (activations, weights, both), pasted."""
    from offload_runner.cli import main

    assert main([*BRIDGE, *lines, f"output_dir={tmp_path}/run", "--dry-run"]) == code
    if code:
        assert "fix: add offload/optimizer=states" in capsys.readouterr().err


def test_its_metrics_say_what_crossed_the_link() -> None:
    """Per step, each way: the weights up twice per micro-batch (forward, backward) and the
    gradients' sum so far up before each later micro-batch's backward; the gradients down after
    each; the update's gradients, masters and moments up and masters, moments and weights down."""
    model = _bf16_model()
    offload = _offload(model)
    try:
        offload.begin_step(3)
        for _ in range(3):
            model(torch.randn(3, HIDDEN, dtype=torch.bfloat16)).backward()
        offload.grads_ready()
        offload.update((H, {**H, "weight_decay": 0.0}), 1.0)
        found = offload.metrics()
        n = offload.offloaded_params
        assert found["weight_offload_layers"] == 2
        weights_up = found["weight_offload_up_gb"] * 1e9 - 2 * 4 * n - (4 + 12) * n
        # a unit still in its slot is not loaded again (the last one forward, then backward)
        assert 3 * 2 * n < weights_up <= 3 * 2 * 2 * n
        assert found["weight_offload_down_gb"] * 1e9 == pytest.approx(3 * 4 * n + (12 + 2) * n)
    finally:
        offload.close()


class _Chunk:
    """What the engines read of a DDP-wrapped chunk: its weight offload and its buffers (none:
    the toy's resident parameters are updated by the optimizer's own gradients)."""

    def __init__(self, offload) -> None:
        self.weight_offload, self.buffers, self.expert_parallel_buffers = offload, [], []


class _Optimizer:
    """Megatron-Core's optimizer as the loop sees it: param groups, step() -> (ok, norm, zeros)."""

    def __init__(self) -> None:
        self.param_groups = [
            {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "wd_mult": 1.0}
        ]
        self.steps = 0

    def step(self):
        self.steps += 1
        return True, 0.0, 0


def test_the_training_loop_calls_the_engines_through_one_object() -> None:
    """Engines: built after the optimizer (weight offload armed), a step (the global norm is
    the host's where the GPU holds no gradient, the offloaded layers updated), the save and end
    calls, metrics, and close."""
    from types import SimpleNamespace

    from offload_runner.config.schema import OffloadMode
    from offload_runner.offload.engines import Engines

    model = _bf16_model()
    modules = weight.offloaded_layers(model, 2)
    for module in modules:
        for p in module.parameters():
            p.requires_grad_(False)
    offload = weight.WeightOffload(modules, torch.device("cpu"))
    one_gpu = OffloadMode(*[False] * 8, one_model_rank=True)
    run = SimpleNamespace(optimizer=SimpleNamespace(clip_grad=0.0), planner=None, mode=one_gpu)
    optimizer = _Optimizer()
    engines = Engines(run, [_Chunk(offload)], optimizer)
    try:
        assert engines.weights == [offload] and engines.cpu_adam == []
        before = model.decoder.layers[0].up.weight.detach().clone()
        engines.begin_step(2)
        for _ in range(2):
            model(torch.randn(3, HIDDEN, dtype=torch.bfloat16)).backward()
        norm = engines.step()
        assert optimizer.steps == 1 and offload.steps == 1
        assert norm == pytest.approx(math.sqrt(float(offload.grads.double().pow(2).sum())))
        assert not torch.equal(model.decoder.layers[0].up.weight.detach(), before)
        engines.before_save()
        engines.flush()
        assert engines.pinned_bytes == offload.pinned_bytes
        assert engines.metrics(None, 2, 1, is_writer=True)["weight_offload_layers"] == 2
    finally:
        engines.close()
