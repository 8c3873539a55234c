"""The CPU-Adam engine's modes, as objects: ``Exact`` (each update lands before the next forward
needs it) and ``Delayed`` (ZeRO-Offload's delayed parameter update after some exact steps: the
update of step t lands before step t+2), with what each mode decides."""

from __future__ import annotations

import math
from dataclasses import dataclass

from offload_runner.config.schema import RunConfig


@dataclass(frozen=True)
class Exact:
    """Every update lands before the next forward needs it."""

    predict = False  # weight prediction is delayed mode's
    copy_during_backward = False  # exact steps clip their gradients first, at step()
    columns = 0.0  # ... and so are exact columns (columns.py)

    def delayed_at(self, step: int) -> bool:
        """Whether update ``step`` (1-based) is a delayed one."""
        return False


@dataclass(frozen=True)
class Delayed:
    """Updates one step late after ``exact_steps`` exact ones; ``predict``: land the masters
    extrapolated by their last update; ``copy_during_backward``: this step's gradients down and
    the last update's masters up during the last micro-batch's backward (one GPU), else at the
    step boundary; ``columns``: the share of each 2-D weight's columns updated exactly on the
    GPU (columns.py)."""

    exact_steps: int
    predict: bool = False
    copy_during_backward: bool = False
    columns: float = 0.0

    def delayed_at(self, step: int) -> bool:
        return step > self.exact_steps


Mode = Exact | Delayed


def exact_steps(run: RunConfig) -> int:
    o = run.optimizer
    return (
        o.cpu_adam_exact_steps
        if o.cpu_adam_exact_steps is not None
        else (run.scheduler.lr_warmup_iters)
    )


def mode_of(run: RunConfig, delayed: bool, copy_during_backward: bool) -> Mode:
    """The mode of one optimizer part: ``delayed`` (plan.part_delays), copying during the backward
    where nothing edits its gradients after it (``OffloadMode.copies_during_backward``)."""
    if not delayed:
        return Exact()
    o = run.optimizer
    predict, columns = o.cpu_adam_weight_prediction, o.cpu_adam_exact_columns
    return Delayed(exact_steps(run), predict, copy_during_backward, columns)


def mode_name(built: list) -> str:
    """exact, delayed, or delayed experts (the dense part exact: cpu_adam_delayed_scope)."""
    delayed = [e.delayed for e in built if e.offloaded_numel]
    if not any(delayed):
        return "exact"
    return "delayed" if all(delayed) else "delayed experts"


def delayed_dense_warning(
    sizes: list[int], experts: list[bool], fraction: float, delayed: bool
) -> str | None:
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
