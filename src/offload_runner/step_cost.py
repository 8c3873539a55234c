"""The step-time model: what an optimizer offload (and weight offload) adds to each step, from
the CPU's Adam rate, the host link and the forward+backward it may hide under; ``--plan``'s cost
notes. Pure arithmetic, no GPU (the rates come from hardware.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from offload_runner.config.schema import RunConfig
from offload_runner.gpu_time import forward_backward_seconds
from offload_runner.hardware import (
    ADAM_BYTES,
    BF16_MOMENTS_CPU_FACTOR,
    CPU_ADAM_COPY_BYTES,
    CPU_ADAM_RATE_BESIDE_STREAMS,
    EXACT,
    GPU_ADAM_S_PER_PARAM,
    HDO_RATE_SHARE,
    LATE,
    LINK_BESIDE_CPU_ADAM,
    REFERENCE_CPU_ADAM_PARAMS_PER_S,
    WEIGHT_PREDICTION_CPU_FACTOR,
    measured_rate,
    rank_cpus,
    rank_link_gb_per_s,
    worker_cpus,
)
from offload_runner.plan import Layout, Plan, RankPlan, predicting_weights

# --- step time: what an optimizer offload adds to each step ---------------------------------


def balanced_gpu_share(
    cpu_params_per_s: float, host_link_gb_per_s: float, bytes_moved: tuple[int, int, int] = EXACT
) -> float:
    """The GPU share x of the offloaded Adam at which the CPU and the GPU's side finish together:
    the CPU's share at its rate beside the streams (a = 1 / (rate k)); the link at its rate
    beside CPU Adam (l = 1 / (link LINK_BESIDE_CPU_ADAM)) carrying ``bytes_moved`` = (W, C, E),
    EXACT for exact updates, LATE for delayed ones (``StepCost.moved``: W with the moments'
    dtypes), then the share's Adam in the window (g = GPU_ADAM_S_PER_PARAM, after its pieces
    land, as the state window's): (1 - x) a = (W x + C (1 - x) + E) l + g x, so
    x = (a - (C + E) l) / (a + (W - C) l + g)."""
    window, copies, every = bytes_moved
    cpu = 1 / (cpu_params_per_s * CPU_ADAM_RATE_BESIDE_STREAMS)
    link = 1 / (host_link_gb_per_s * LINK_BESIDE_CPU_ADAM * 1e9)
    share = (cpu - (copies + every) * link) / (
        cpu + (window - copies) * link + GPU_ADAM_S_PER_PARAM
    )
    return min(max(share, 0.0), 1.0)


def exact_update_seconds(
    params: float,
    cpu_params_per_s: float,
    host_link_gb_per_s: float,
    gpu_share: float,
    bytes_moved: tuple[int, int, int] = EXACT,
) -> float:
    """The update of ``params`` offloaded params with ``gpu_share`` of them on the GPU (exact,
    or with LATE ``bytes_moved`` a delayed one): the CPU's share at its rate (beside the
    streams where there are any) or the GPU's side, the link (beside CPU Adam) then the share's
    Adam in the window, whichever takes longer."""
    if gpu_share <= 0:
        return params / cpu_params_per_s
    window, copies, every = bytes_moved
    cpu = (1 - gpu_share) * params / (cpu_params_per_s * CPU_ADAM_RATE_BESIDE_STREAMS)
    moved = window * gpu_share + copies * (1 - gpu_share) + every
    link = moved * params / (host_link_gb_per_s * LINK_BESIDE_CPU_ADAM * 1e9)
    return max(cpu, link + gpu_share * params * GPU_ADAM_S_PER_PARAM)


def param_count(n: float) -> str:
    """3.11B, 42.5M, 900K."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def hidden_fraction(
    forward_backward_s: float,
    params_per_s: float,
    shard_params: float,
    copy_s_per_param: float = 0.0,
    max_overhead: float = 1.0,
    copy_window_s: float = 0.0,
    launch_slowdown: float = 0.0,
) -> float:
    """The largest optimizer_offload_fraction of a rank's Adam shard (``shard_params``) that
    delayed mode hides: CPU Adam at ``params_per_s`` finishes within one forward+backward
    (``forward_backward_s``, without offload), and what the step gains beside it stays within
    ``max_overhead`` of it: forward+backward slowed by ``launch_slowdown`` per second of CPU Adam
    (see PlannerConfig.cpu_adam_launch_slowdown), and the copies (``copy_s_per_param``, each way
    at once) beyond ``copy_window_s`` (the last micro-batch's backward where they run during it,
    see ``copy_window``; 0 at the step boundary)."""
    if not shard_params:
        return 1.0
    cpu = forward_backward_s * params_per_s / shard_params
    budget = max_overhead * forward_backward_s
    slowdown = launch_slowdown * shard_params / params_per_s  # seconds per unit of fraction
    copies = copy_s_per_param * shard_params
    knee = copy_window_s / copies if copies else math.inf  # where the copies outlast the window
    if not (slowdown or copies):
        gained = math.inf
    elif slowdown and slowdown * knee >= budget:  # the slowdown alone uses the budget up first
        gained = budget / slowdown
    else:
        gained = (budget + copy_window_s) / (slowdown + copies)
    return min(1.0, cpu, gained)


# Of a micro-batch's forward+backward, the backward's share (twice the forward's matmul FLOPs).
BACKWARD_SHARE = 2 / 3


def copy_window(forward_backward_s: float, micro_batches: int) -> float:
    """Delayed mode copying during the backward: the time its copies have before the step ends,
    about the last micro-batch's backward (gradients are final only there)."""
    return forward_backward_s / max(micro_batches, 1) * BACKWARD_SHARE


def copy_seconds_per_param(host_link_gb_per_s: float) -> float:
    """Delayed mode's boundary copies per offloaded param (CPU_ADAM_COPY_BYTES each way at once)."""
    return CPU_ADAM_COPY_BYTES / (host_link_gb_per_s * 1e9)


@dataclass(frozen=True)
class StepCost:
    """The model: CPU Adam runs at ``cpu_adam_params_per_s`` per rank (HybridDeviceOptimizer at
    HDO_RATE_SHARE of it) and is not hidden in exact mode; in delayed mode it hides under
    ``forward_backward_s`` (when known), and the copies at the step boundary (4 B/param each way,
    both at once) are what remains where they cannot run during the backward
    (``RankPlan.boundary_params``). State offload streams its 10 B/param (12 with fp32 masters)
    through the GPU window both ways at once, at ``host_link_gb_per_s`` each way, then runs their
    Adam there; CPU Adam's GPU share likewise."""

    cpu_adam_params_per_s: float
    host_link_gb_per_s: float
    forward_backward_s: float | None = None
    delayed_max_overhead: float = 0.1  # planner.delayed_max_overhead
    launch_slowdown: float = 0.0  # planner.cpu_adam_launch_slowdown

    def exact_rate(self, run: RunConfig) -> float:
        """Params/s of the CPU part of Adam with ``run``'s engine, its updates exact (with bf16
        moments at BF16_MOMENTS_CPU_FACTOR of it)."""
        low = BF16_MOMENTS_CPU_FACTOR if run.precision.low_moments else 1.0
        return self.cpu_adam_params_per_s * (low if run.mode.cpu_adam else HDO_RATE_SHARE)

    def moved(self, run: RunConfig) -> tuple[int, int, int]:
        """(W, C, E) bytes per param each way of ``run``'s CPU Adam with a GPU share (see
        balanced_gpu_share): EXACT or LATE, the share's states in their dtypes."""
        window, copies, every = LATE if run.mode.late_share else EXACT
        return window - ADAM_BYTES + run.precision.host_state_bytes, copies, every

    def cpu_rate(self, run: RunConfig) -> float:
        """... its delayed updates (weight prediction adds CPU work), the CPU's alone."""
        slower = WEIGHT_PREDICTION_CPU_FACTOR if predicting_weights(run) else 1.0
        return self.exact_rate(run) / slower

    def delayed_rate(self, run: RunConfig) -> float:
        """... and with their GPU share (delayed mode's late passes), where there is one."""
        share = self.gpu_share(run) if run.mode.late_share else 0.0
        if not share:
            return self.cpu_rate(run)
        return 1.0 / exact_update_seconds(
            1.0, self.cpu_rate(run), self.host_link_gb_per_s, share, self.moved(run)
        )

    def gpu_share(self, run: RunConfig) -> float:
        """The GPU share (0: none; null in the config: the balanced one), of the exact updates,
        or of the delayed ones in delayed mode for every parameter."""
        if not run.mode.streams:
            return 0.0
        share = run.optimizer.cpu_adam_gpu_share
        if share is None:
            return balanced_gpu_share(
                self.exact_rate(run), self.host_link_gb_per_s, self.moved(run)
            )
        return share

    def seconds(self, run: RunConfig, rank: RankPlan) -> float:
        parts = (self.states_seconds, self.exact_seconds, self.delayed_seconds)
        return sum(part(run, rank) for part in parts)

    def states_seconds(self, run: RunConfig, rank: RankPlan) -> float:
        """State offload: its states through the link, then their Adam in the GPU window (its
        pieces' Adam runs after they land, as CPU Adam's GPU share's does)."""
        if not rank.states_moved:
            return 0.0
        link = rank.states_moved / (self.host_link_gb_per_s * 1e9)
        return link + rank.states_moved / run.precision.host_state_bytes * GPU_ADAM_S_PER_PARAM

    def exact_seconds(self, run: RunConfig, rank: RankPlan) -> float:
        """The step's wait for the exact updates (with their GPU share, where it streams)."""
        exact = rank.cpu_adam_params - rank.delayed_params
        if run.mode.streams and exact:
            return exact_update_seconds(
                exact,
                self.exact_rate(run),
                self.host_link_gb_per_s,
                self.gpu_share(run),
                self.moved(run),
            )
        return exact / self.exact_rate(run)

    def delayed_seconds(self, run: RunConfig, rank: RankPlan) -> float:
        """What the delayed updates add to the step: their CPU Adam beyond forward+backward,
        the training thread's slowdown beside it, their copies the step waits for."""
        if not rank.delayed_params:
            return 0.0
        cpu = rank.delayed_params / self.delayed_rate(run)
        copies = rank.delayed_params * copy_seconds_per_param(self.host_link_gb_per_s)
        tail = max(copies - self._copy_window(run, rank), 0.0)  # what the step waits for
        beside = min(cpu, self.forward_backward_s or 0.0)  # CPU Adam beside the training
        return cpu - beside + self.launch_slowdown * beside + tail

    def _copy_window(self, run: RunConfig, rank: RankPlan) -> float:
        """The time delayed mode's copies hide in: the last micro-batch's backward where they
        run during it (one GPU, so one micro-batch per sample), else none."""
        if rank.boundary_params or not self.forward_backward_s:
            return 0.0
        t = run.train
        return copy_window(self.forward_backward_s, t.global_batch_size // t.micro_batch_size)

    def hidden_fraction(self, run: RunConfig, rank: RankPlan) -> float | None:
        """Delayed mode: the largest optimizer_offload_fraction whose CPU Adam fits under
        forward_backward_s and whose copies the step waits for add at most delayed_max_overhead
        of it (None when that is unknown or nothing is on the CPU)."""
        fraction = run.optimizer.optimizer_offload_fraction
        if not (self.forward_backward_s and rank.cpu_adam_params and fraction):
            return None
        return hidden_fraction(
            self.forward_backward_s,
            self.delayed_rate(run),
            rank.cpu_adam_params / fraction,
            copy_seconds_per_param(self.host_link_gb_per_s),
            self.delayed_max_overhead,
            self._copy_window(run, rank),
            self.launch_slowdown,
        )

    def explain(self, run: RunConfig, rank: RankPlan) -> str:
        parts = []
        exact, delayed = rank.cpu_adam_params - rank.delayed_params, rank.delayed_params
        share = self.gpu_share(run)
        dense = " (the dense part, exact)" if exact and delayed else ""
        if exact and share:
            how = "balanced, then fixed" if run.optimizer.cpu_adam_gpu_share is None else "fixed"
            parts.append(
                f"the states of {param_count(exact)} params{dense} on the host, "
                f"Adam on {1 - share:.0%} of them on the CPU at "
                f"{self.exact_rate(run) / 1e9:.2f} G/s ({CPU_ADAM_RATE_BESIDE_STREAMS:g}x "
                f"beside the streams) and on {share:.0%} on the GPU, their states "
                f"streamed at {self.host_link_gb_per_s:.0f} GB/s each way "
                f"({self.exact_seconds(run, rank):.2f} s; the share {how})"
            )
        elif exact:
            parts.append(
                f"{param_count(exact)} params{dense} of Adam on the CPU at "
                f"{self.exact_rate(run) / 1e9:.2f} G/s "
                f"({self.exact_seconds(run, rank):.2f} s)"
            )
        if delayed and run.mode.late_share:
            how = "balanced, then fixed" if run.optimizer.cpu_adam_gpu_share is None else "fixed"
            parts.append(
                f"{param_count(delayed)} params of Adam a step late, {1 - share:.0%} of "
                f"them on the CPU at {self.cpu_rate(run) / 1e9:.2f} G/s "
                f"({CPU_ADAM_RATE_BESIDE_STREAMS:g}x beside the streams) and {share:.0%} "
                f"on the GPU, their states and gradients streamed at "
                f"{self.host_link_gb_per_s:.0f} GB/s under the next forward+backward "
                f"({delayed / self.delayed_rate(run):.2f} s; the share {how})"
            )
        elif delayed:
            experts = " (the routed experts)" if exact else ""
            parts.append(
                f"{param_count(delayed)} params{experts} of Adam on the CPU at "
                f"{self.cpu_rate(run) / 1e9:.2f} G/s "
                f"({delayed / self.cpu_rate(run):.2f} s)"
            )
            hidden = self.hidden_fraction(run, rank)
            at_boundary = bool(rank.boundary_params)
            limited = "boundary copies" if at_boundary else "copies beyond the last backward"
            where = (
                "at the step boundary"
                if at_boundary
                else ("during the last micro-batch's backward")
            )
            if self.launch_slowdown:
                limited += " and the training thread's slowdown beside CPU Adam"
            parts.append(
                "delayed: hidden under forward+backward of "
                f"{self.forward_backward_s:.2f} s up to a fraction of {hidden:.2f} "
                f"({limited} within {self.delayed_max_overhead:.0%} of it), "
                if hidden is not None
                else "delayed: not counted as hidden (set planner.forward_backward_s), "
            )
            parts[-1] += f"{CPU_ADAM_COPY_BYTES} B/param each way {where}"
        if rank.states_moved:
            parts.append(
                f"{rank.states_moved / 1e9:.1f} GB of states each way at once over "
                f"{self.host_link_gb_per_s:.0f} GB/s"
            )
        return ", ".join(parts) or "nothing offloaded from the optimizer"


def step_cost(run: RunConfig, gpus_per_node: int = 1) -> StepCost:
    """The step-time model for ``run``: the configured CPU Adam rate, else torch's fused AdamW
    measured on this machine with the cores the engine gives one rank (once per process; under
    model.deterministic_mode REFERENCE_CPU_ADAM_PARAMS_PER_S, so nothing timed steers a run);
    delayed mode hides under planner.forward_backward_s, else gpu_time's forward+backward."""
    p = run.planner
    rate = p.cpu_adam_params_per_s
    if not rate:
        rate = (
            REFERENCE_CPU_ADAM_PARAMS_PER_S
            if run.model.deterministic_mode
            else measured_rate(len(worker_cpus(run, rank_cpus(0, max(1, gpus_per_node)))))
        )
    return StepCost(
        rate,
        rank_link_gb_per_s(p.host_link_gb_per_s, gpus_per_node),
        p.forward_backward_s or forward_backward_seconds(run),
        p.delayed_max_overhead,
        p.cpu_adam_launch_slowdown,
    )


def rate_for_ranks(run: RunConfig, gpus_per_node: int) -> float | None:
    """The CPU Adam rate the launcher measured (or auto planned with), for its ranks to take as
    planner.cpu_adam_params_per_s: else every rank of a node times fused AdamW on 64M params at
    once at its start (1 GiB and a second or two each), each getting its own rate and GPU share.
    None where the run sets the rate, runs no CPU-Adam engine or times nothing (deterministic
    mode: the reference rate)."""
    p = run.planner
    if not run.mode.cpu_adam or p.cpu_adam_params_per_s or run.model.deterministic_mode:
        return None
    return step_cost(run, gpus_per_node).cpu_adam_params_per_s


def cost_note(run: RunConfig, plan: Plan) -> str | None:
    """--plan's line on what the optimizer offload adds to a step (None: nothing offloaded)."""
    if not any(r.cpu_adam_params or r.states_moved for r in plan.ranks):
        return None
    cost = step_cost(run, plan.gpus_per_node)
    worst = max(plan.ranks, key=lambda r: cost.seconds(run, r))
    return f"predicted +{cost.seconds(run, worst):.2f} s per step: {cost.explain(run, worst)}"


def weight_offload_link_bytes(run: RunConfig, params: float) -> tuple[float, float]:
    """Bytes weight offload of ``params`` moves per step, (up, down): its bf16 weights up twice
    per micro-batch (forward, backward; three times with full recompute, whose forward inside
    backward brings them again), the gradients' sums (``weight_offload_sum_bytes``) and the
    gradients' slot down after each micro-batch, then the update
    (``weight_offload_update_bytes``) (one GPU: every micro-batch of the global batch runs on
    it)."""
    micro_batches = _micro_batches(run)
    passes = 3 if run.model.recompute_granularity == "full" else 2  # full recompute: again
    update_up, update_down = weight_offload_update_bytes(run, params)
    up = params * 2 * passes * micro_batches + weight_offload_sum_bytes(run, params) + update_up
    down = params * run.precision.grad_bytes * micro_batches + update_down
    return up, down


def weight_offload_sum_bytes(run: RunConfig, params: float) -> float:
    """Bytes of the gradients' sums so far brought back up per step, before each micro-batch's
    backward but the first."""
    return params * run.precision.grad_bytes * (_micro_batches(run) - 1)


def weight_offload_update_bytes(run: RunConfig, params: float) -> tuple[float, float]:
    """Bytes weight offload's update moves, (up, down): the gradients, fp32 masters and moments
    up; the masters, moments and rounded bf16 weights down."""
    states = 4 + run.precision.moment_bytes
    return params * (run.precision.grad_bytes + states), params * (states + 2)


def _micro_batches(run: RunConfig) -> int:
    t = run.train
    return max(1, t.global_batch_size // t.micro_batch_size)


def activation_offload_link_bytes(run: RunConfig, plan: Plan) -> float:
    """Bytes activation offload moves each way per step on its busiest rank: what it takes off
    the GPU per micro-batch, down in forward and up in backward."""
    t = run.train
    dp = Layout.of(run, len(plan.ranks)).dp
    micro_batches = max(1, t.global_batch_size // (t.micro_batch_size * dp))
    return max(r.activations_offloaded for r in plan.ranks) * micro_batches


def weight_offload_note(run: RunConfig, plan: Plan) -> str | None:
    """--plan's line on the link time weight offload adds (its bound: both directions at once),
    activation offload's traffic on the same link included; activation offload's alone."""
    params = max(r.weight_offload_params for r in plan.ranks)
    activations = activation_offload_link_bytes(run, plan)
    up, down = weight_offload_link_bytes(run, params) if params else (0.0, 0.0)
    if not up and not activations:
        return None
    rate = run.planner.host_link_gb_per_s * 1e9
    moved = (
        f"weight offload: {param_count(params)} params on the host move {up / 1e9:.1f} GB up "
        f"and {down / 1e9:.1f} GB down per step"
        if params
        else "activation offload moves"
    )
    if activations:
        moved += (
            f"{', and activation offload' if params else ''} {activations / 1e9:.3g} GB each way"
        )
    bound = max(up, down) + activations
    return (
        f"{moved}, at least +{bound / rate:.2f} s over {run.planner.host_link_gb_per_s:.0f} "
        "GB/s where compute does not hide them"
    )
