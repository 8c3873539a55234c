"""Per-iteration measurements: step time, tokens/s, TFLOP/s per GPU, GPU and pinned host memory.

Rank 0 writes one JSON line per iteration to metrics.jsonl and shows a rich progress bar (plain
lines when the output is not a terminal); the final summary goes to summary.json and a table.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from offload_runner import console
from offload_runner.config.schema import LoggerConfig
from offload_runner.rundir import SUMMARY_FILE, metrics_file

GB = 1024**3


@dataclass
class StepMetrics:
    iteration: int
    loss: float
    lr: float
    grad_norm: float | None
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    gpu_peak_allocated_gb: float  # the run's peak so far
    gpu_allocated_gb: float
    host_pinned_gb: float | None
    gpu_peak_fwd_bwd_gb: float | None = None  # this iteration's peak in forward + backward
    gpu_peak_step_gb: float | None = None  # ... and in the optimizer step
    fwd_bwd_time_s: float | None = None  # forward + backward + gradient reduction (GPU events)
    optimizer_time_s: float | None = None  # the rest of the step: optimizer, offload waits

    def line(self) -> str:
        pinned = "n/a" if self.host_pinned_gb is None else f"{self.host_pinned_gb:.2f} GB"
        grad = "n/a" if self.grad_norm is None else f"{self.grad_norm:.3f}"
        return (
            f"iter {self.iteration:>5} | loss {self.loss:.4f} | lr {self.lr:.2e} | grad {grad} | "
            f"{self.step_time_s * 1000:7.1f} ms | {self.tokens_per_s:,.0f} tok/s | "
            f"{self.tflops_per_gpu:6.1f} TFLOP/s/GPU | GPU peak {self.gpu_peak_allocated_gb:.2f} GB"
            f" | pinned {pinned}"
        )


def host_pinned_bytes() -> int | None:
    """Bytes held by torch's pinned host allocator (None where this torch does not say)."""
    import torch

    stats_fn = getattr(torch.cuda, "host_memory_stats", None)
    if stats_fn is None:
        return None
    stats = stats_fn()
    for key in ("allocated_bytes.current", "reserved_bytes.current", "allocations.current"):
        if key in stats:
            return int(stats[key])
    return None


def host_used_bytes() -> int | None:
    """RAM in use on this node (MemTotal - MemAvailable: every process, not page cache)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    except OSError:
        return None
    kib = {k: int(v.split()[0]) for k, v in fields.items() if k in ("MemTotal", "MemAvailable")}
    if len(kib) != 2:
        return None
    return (kib["MemTotal"] - kib["MemAvailable"]) * 1024


# The launcher's wall clock when it started torchrun (time.time()), for time to first step.
LAUNCHED_AT_ENV = "OFFLOAD_RUNNER_LAUNCHED_AT"


class Startup:
    """Time to first step and where it went (process group, model, optimizer, checkpoint), and
    this node's RAM in use: before the model is built and at its highest while training (sampled
    by the node's local rank 0 after every phase and iteration)."""

    def __init__(self, is_node_sampler: bool) -> None:
        self.launched_at = float(os.environ.get(LAUNCHED_AT_ENV, time.time()))
        self.phases: dict[str, float] = {}
        self._mark = time.perf_counter()
        self.is_node_sampler = is_node_sampler
        self.host_before = host_used_bytes() if is_node_sampler else None
        self.host_max = self.host_before
        self.first_step_s: float | None = None

    def phase(self, name: str) -> None:
        """The phase ``name`` ended now."""
        now = time.perf_counter()
        self.phases[name] = now - self._mark
        self._mark = now
        self.sample_host()

    def sample_host(self) -> None:
        if self.is_node_sampler and (used := host_used_bytes()) is not None:
            self.host_max = max(self.host_max or 0, used)

    def first_step_done(self) -> None:
        if self.first_step_s is None:
            self.first_step_s = time.time() - self.launched_at

    def gathered(self, gpu_peak_gb: float) -> dict:
        """Every rank's GPU peak and every node's RAM (collective: all ranks call it)."""
        import torch.distributed as dist

        mine = {
            "gpu_peak": gpu_peak_gb,
            "node": int(os.environ.get("GROUP_RANK", 0)),
            "host_before": self.host_before,
            "host_max": self.host_max,
            "first_step": self.first_step_s,
            **gpu_beside_allocated(),
        }
        everyone: list[dict] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, mine)
        nodes = {r["node"]: r for r in everyone if r["host_max"] is not None}
        return {
            # the job's first step is done when the last rank's is
            "time_to_first_step_s": max(
                (r["first_step"] for r in everyone if r["first_step"] is not None), default=None
            ),
            "launched_at": self.launched_at,  # epoch s: a run's time before its workers
            "startup_s": {k: round(v, 2) for k, v in self.phases.items()},
            "gpu_peak_per_rank_gb": [r["gpu_peak"] for r in everyone],
            "gpu_reserved_peak_per_rank_gb": [r["reserved_peak"] for r in everyone],
            "gpu_outside_torch_per_rank_gb": [r["outside_torch"] for r in everyone],
            "gpu_alloc_retries_per_rank": [r["alloc_retries"] for r in everyone],
            "host_used_gb_before_per_node": [nodes[n]["host_before"] / GB for n in sorted(nodes)],
            "host_used_gb_max_per_node": [nodes[n]["host_max"] / GB for n in sorted(nodes)],
        }


def _median(values) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def gpu_beside_allocated() -> dict[str, float | None]:
    """This GPU's memory beyond what torch allocated, in GB: torch's reserved peak (allocated plus
    its cache's slack) and what is in use outside torch (the CUDA context, NCCL's buffers); and
    how many allocations found no room until the allocator had freed its cache."""
    import torch

    if not torch.cuda.is_available():
        return {"reserved_peak": None, "outside_torch": None, "alloc_retries": None}
    free, total = torch.cuda.mem_get_info()
    outside = total - free - torch.cuda.memory_reserved()
    # each retry freed the allocator's cache (cudaFree, which waits for the device) to find room
    retries = torch.cuda.memory_stats().get("num_alloc_retries")
    return {
        "reserved_peak": torch.cuda.max_memory_reserved() / GB,
        "outside_torch": outside / GB,
        "alloc_retries": retries,
    }


def gpu_memory() -> tuple[float, float]:
    import torch

    return torch.cuda.max_memory_allocated() / GB, torch.cuda.memory_allocated() / GB


# TensorBoard tags: grouped as Megatron-LM groups them (a name without a group stays as it is).
TENSORBOARD_TAGS = {
    "loss": "lm loss",
    "lr": "learning-rate",
    "grad_norm": "grad-norm",
    "step_time_s": "time/step_s",
    "fwd_bwd_time_s": "time/fwd_bwd_s",
    "optimizer_time_s": "time/optimizer_s",
    "tokens_per_s": "throughput/tokens_per_s",
    "tflops_per_gpu": "throughput/tflops_per_gpu",
    "gpu_peak_allocated_gb": "memory/gpu_peak_allocated_gb",
    "gpu_peak_fwd_bwd_gb": "memory/gpu_peak_fwd_bwd_gb",
    "gpu_peak_step_gb": "memory/gpu_peak_step_gb",
    "gpu_allocated_gb": "memory/gpu_allocated_gb",
    "host_pinned_gb": "memory/host_pinned_gb",
    "validation_loss": "lm loss validation",  # Megatron-LM's tag
}


class ScalarSinks:
    """Where rank 0 sends each step's scalars besides metrics.jsonl: TensorBoard
    (``logger.tensorboard_dir``) and Weights & Biases (``logger.wandb_project``; ``WANDB_MODE=
    offline`` keeps the run on disk for ``wandb sync``)."""

    def __init__(self, logger: LoggerConfig, run_dir: Path, config: dict | None) -> None:
        self.tensorboard = self.wandb = None
        if logger.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=logger.tensorboard_dir)
        if logger.wandb_project:
            import wandb

            save_dir = Path(logger.wandb_save_dir or run_dir)
            save_dir.mkdir(parents=True, exist_ok=True)
            self.wandb = wandb.init(
                project=logger.wandb_project,
                entity=logger.wandb_entity,
                name=logger.wandb_exp_name or Path(run_dir).name,
                dir=str(save_dir),
                config=config or {},
            )

    def add(self, scalars: dict[str, float], iteration: int) -> None:
        tagged = {TENSORBOARD_TAGS.get(k, k): v for k, v in scalars.items()}
        if self.tensorboard:
            for tag, value in tagged.items():
                self.tensorboard.add_scalar(tag, value, iteration)
        if self.wandb:
            self.wandb.log(tagged, step=iteration)

    def summary(self, summary: dict) -> None:
        if self.wandb:
            self.wandb.summary.update(
                {k: v for k, v in summary.items() if isinstance(v, int | float | str)}
            )

    def close(self) -> None:
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()
        self.tensorboard = self.wandb = None


class MetricsReporter:
    """Collects StepMetrics; rank 0 prints them, writes metrics.jsonl / summary.json, and sends
    the scalars to TensorBoard and W&B when the logger section asks for them."""

    def __init__(
        self,
        run_dir: Path,
        total_iters: int,
        first_iter: int,
        is_writer: bool,
        logger: LoggerConfig,
        config: dict | None = None,
    ) -> None:
        self.run_dir, self.is_writer, self.log_interval = run_dir, is_writer, logger.log_interval
        self.sinks = ScalarSinks(logger, run_dir, config) if is_writer else None
        self.history: list[StepMetrics] = []
        self.validation: list[tuple[int, float]] = []  # (iteration, loss) per evaluation
        self.progress = Progress(
            TextColumn("[bold]training"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=console.console,
            disable=not (is_writer and console.console.is_terminal),
        )
        self.task = self.progress.add_task("train", total=total_iters, completed=first_iter)
        self.file = open(metrics_file(run_dir), "a") if is_writer else None  # noqa: SIM115

    def __enter__(self) -> MetricsReporter:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()
        if self.file:
            self.file.close()
        if self.sinks and exc[0] is not None:  # else write_summary sends the summary, then closes
            self.sinks.close()

    def record(self, step: StepMetrics) -> None:
        self.history.append(step)
        if not self.is_writer:
            return
        row = asdict(step)
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        scalars = {k: v for k, v in row.items() if k != "iteration" and isinstance(v, int | float)}
        self.sinks.add(scalars, step.iteration)
        self.progress.advance(self.task)
        if step.iteration % self.log_interval == 0 or step.iteration == 1:
            self.progress.console.print(step.line(), highlight=False)
            console.log_line(step.line())

    def record_validation(self, iteration: int, loss: float) -> None:
        """An evaluation's loss on the held-out split, beside the training loss."""
        self.validation.append((iteration, loss))
        if not self.is_writer:
            return
        self.file.write(json.dumps({"iteration": iteration, "validation_loss": loss}) + "\n")
        self.file.flush()
        self.sinks.add({"validation_loss": loss}, iteration)
        line = f"iteration {iteration}: validation loss {loss:.4f}"
        self.progress.console.print(line, highlight=False)
        console.log_line(line)

    def summary(self, skip_first: int = 2) -> dict:
        steady = self.history[skip_first:] or self.history
        if not steady:
            return {}
        return {
            "iterations": len(self.history),
            "step_time_s_median": statistics.median(s.step_time_s for s in steady),
            "fwd_bwd_time_s_median": _median(s.fwd_bwd_time_s for s in steady),
            "optimizer_time_s_median": _median(s.optimizer_time_s for s in steady),
            "tokens_per_s_median": statistics.median(s.tokens_per_s for s in steady),
            "tflops_per_gpu_median": statistics.median(s.tflops_per_gpu for s in steady),
            "gpu_peak_allocated_gb": max(s.gpu_peak_allocated_gb for s in self.history),
            "gpu_peak_fwd_bwd_gb": max((s.gpu_peak_fwd_bwd_gb or 0.0) for s in self.history),
            "gpu_peak_step_gb": max((s.gpu_peak_step_gb or 0.0) for s in self.history),
            "host_pinned_gb_max": max((s.host_pinned_gb or 0.0) for s in self.history),
            "first_loss": self.history[0].loss,
            "final_loss": self.history[-1].loss,
            "losses": [s.loss for s in self.history],
            "steady_state_from_iteration": steady[0].iteration,
            **self._validation_summary(),
        }

    def _validation_summary(self) -> dict:
        if not self.validation:
            return {}
        return {
            "final_validation_loss": self.validation[-1][1],
            "validation_losses": [[i, loss] for i, loss in self.validation],
        }

    def write_summary(self, extra: dict) -> dict:
        summary = {**self.summary(), **extra}
        if summary:  # epoch s: a run's wall clock after this is its teardown
            summary["summary_written_at"] = time.time()
        if self.is_writer and summary:
            (self.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
            self.sinks.summary(summary)
        if self.sinks:
            self.sinks.close()
            table = Table(title="run summary", title_justify="left")
            table.add_column("metric")
            table.add_column("value", justify="right")
            for key in (
                "iterations",
                "step_time_s_median",
                "fwd_bwd_time_s_median",
                "optimizer_time_s_median",
                "tokens_per_s_median",
                "tflops_per_gpu_median",
                "gpu_peak_allocated_gb",
                "gpu_peak_fwd_bwd_gb",
                "gpu_peak_step_gb",
                "host_pinned_gb_max",
                "first_loss",
                "final_loss",
                *(["final_validation_loss"] if "final_validation_loss" in summary else []),
            ):
                value = summary.get(key)
                table.add_row(key, f"{value:,.4f}" if isinstance(value, float) else str(value))
            table.add_row("run directory", str(self.run_dir))
            console.console.print(table)
        return summary
