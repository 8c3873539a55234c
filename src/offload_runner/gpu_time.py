"""The GPU's side of the step-time model: what forward+backward and the GPU's Adam take, so that
``auto`` can rank settings by tokens/s (step_cost.py adds what an optimizer offload costs).

A micro-batch costs each layer a fixed time, whatever its size, plus its FLOPs at the GPU's rate.
The fixed time is what makes a small micro-batch launch-bound on a MoE model: every local expert
gets its own GEMM launches (fc1 and fc2, forward and both backward products), and the alltoall
dispatcher waits for the tokens-per-expert count on the host in every MoE forward, so the CPU
cannot queue ahead. So a MoE layer's fixed time grows with its local experts (EP divides them),
and a larger micro-batch spreads it over more tokens. Full recompute runs each layer's forward
again (its FLOPs and fixed time x 4/3). Activation offload counts as free (its copies overlap
compute); communication and the pipeline's bubble are not modelled beyond (PP - 1) / micro-batches.
The chunked loss (model.chunked_loss) computes the output layer's product once more in backward.
The rates (hardware.GPU_RATES) were fitted on the Qwen3-30B-A3B proxy on one H100.
"""

from __future__ import annotations

from dataclasses import dataclass

from offload_runner.config.schema import RunConfig, te_fusions
from offload_runner.hardware import GPU_ADAM_S_PER_PARAM, GPU_RATES, GpuRates
from offload_runner.model_size import (
    count_parameters,
    padded_vocab_size,
    training_flops_per_token,
)
from offload_runner.plan import Layout, rank_micro_batches

RECOMPUTE_FACTOR = 4 / 3  # full recompute: the layer's forward (a third of its work) again


def kernels(run: RunConfig) -> str:
    """``run``'s kernel set, a key of GPU_RATES: fused (conf/speed/fused.yaml) or plain."""
    return "fused" if te_fusions(run) else "plain"


def rates(run: RunConfig) -> GpuRates:
    """The rates of ``run``'s kernels: fused (conf/speed/fused.yaml) or Megatron-Core's plain."""
    return GPU_RATES[kernels(run)]


def layer_fixed_seconds(run: RunConfig, layout: Layout, gpu: GpuRates | None = None) -> float:
    """One layer's fixed time per micro-batch (forward and backward): a MoE layer's grows with
    the experts one rank holds."""
    m, r = run.model, gpu or rates(run)
    if not m.num_moe_experts:
        return r.dense_layer_s
    return r.dense_layer_s + r.expert_s * m.num_moe_experts / layout.ep


def forward_backward_seconds(
    run: RunConfig, world: int | None = None, gpu: GpuRates | None = None
) -> float:
    """One step's forward+backward on the busiest rank (at ``gpu``'s rates, default the
    fitted ones of ``run``'s kernels)."""
    m, t = run.model, run.train
    layout = Layout.of(run, world)
    n = rank_micro_batches(run, layout)
    layers = m.num_layers // layout.pp
    tokens = t.micro_batch_size * m.seq_length
    per_token = training_flops_per_token(m)
    if m.chunked_loss:
        per_token += 2 * padded_vocab_size(m) * m.hidden_size
    flops = per_token * tokens / (layout.tp * layout.pp * layout.cp)
    recompute = (
        RECOMPUTE_FACTOR
        if m.recompute_granularity is not None and m.recompute_granularity.value == "full"
        else 1.0
    )
    r = gpu or rates(run)
    per_micro_batch = recompute * (layers * layer_fixed_seconds(run, layout, r) + flops / r.flops)
    bubble = 1 + (layout.pp - 1) / n
    return n * per_micro_batch * bubble


def gpu_adam_seconds(run: RunConfig, world: int | None = None) -> float:
    """Adam on the GPU for what no offload takes off it (an offloaded part's own update is
    step_cost's), the busiest rank's shard."""
    o, layout = run.optimizer, Layout.of(run, world)
    params = count_parameters(run.model).total / (layout.tp * layout.pp)
    if o.use_distributed_optimizer:
        params /= layout.dp
    on_gpu = 1.0
    if o.optimizer_cpu_offload:
        on_gpu -= o.optimizer_offload_fraction
    elif run.mode.states:
        on_gpu -= o.optimizer_state_offload_fraction
    return max(on_gpu, 0.0) * params * GPU_ADAM_S_PER_PARAM


@dataclass(frozen=True)
class Predicted:
    """A setting's predicted step: forward+backward, the GPU's Adam, the offload's cost."""

    forward_backward_s: float
    gpu_adam_s: float
    offload_s: float
    tokens: int  # per step, every rank

    @property
    def step_s(self) -> float:
        return self.forward_backward_s + self.gpu_adam_s + self.offload_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s


def predict(
    run: RunConfig, offload_s: float, world: int | None = None, gpu: GpuRates | None = None
) -> Predicted:
    """``run``'s predicted step, given what its optimizer offload adds (StepCost.seconds)."""
    tokens = run.train.global_batch_size * run.model.seq_length
    fwd_bwd = forward_backward_seconds(run, world, gpu)
    return Predicted(fwd_bwd, gpu_adam_seconds(run, world), offload_s, tokens)
