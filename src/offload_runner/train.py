"""The training loop of one rank: parallel state, model, optimizer, data, steps, checkpoints.

Megatron-Core provides every piece (GPTModel, DDP, get_megatron_optimizer, the pipeline schedules,
dist_checkpointing); this module wires them the way Megatron-LM's pretrain loop does.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import os
import time
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path

import torch
import torch.distributed as dist

from offload_runner.config.schema import RunConfig
from offload_runner.hf.families import arch_of
from offload_runner.metrics import (
    GB,
    MetricsReporter,
    Startup,
    StepMetrics,
    gpu_memory,
    host_pinned_bytes,
)
from offload_runner.model_size import training_flops_per_token
from offload_runner.offload.engines import Engines
from offload_runner.plan import planned_peaks
from offload_runner.rundir import resolved_config

log = logging.getLogger("offload_runner")


def initialize(run: RunConfig) -> None:
    """NCCL process group, Megatron-Core parallel state, and seeds."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if run.train.gpu_memory_cap_gb:  # the allocator raises OOM past it, as a smaller GPU would
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        cap = run.train.gpu_memory_cap_gb * GB
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    if not dist.is_initialized():
        dist.init_process_group("nccl")
    m = run.model
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=m.tensor_model_parallel_size,
        pipeline_model_parallel_size=m.pipeline_model_parallel_size,
        context_parallel_size=m.context_parallel_size,
        expert_model_parallel_size=m.expert_model_parallel_size,
        expert_tensor_parallel_size=m.expert_tensor_parallel_size,
        virtual_pipeline_model_parallel_size=m.virtual_pipeline_model_parallel_size,
    )
    torch.manual_seed(run.train.seed)
    model_parallel_cuda_manual_seed(run.train.seed, te_rng_tracker=run.rng.te_rng_tracker)
    if m.deterministic_mode:
        # MoE token permutation scatters with atomics unless torch is told otherwise.
        torch.use_deterministic_algorithms(True, warn_only=True)


def _to_device(batch: dict) -> dict:
    return {k: v.cuda(non_blocking=True) for k, v in batch.items()}


@cache
def _batch_on_this_cp_rank():
    """Megatron-Core's ``get_batch_on_this_cp_rank``; 0.19 added a required ``is_hybrid_cp``."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return partial(get_batch_on_this_cp_rank, is_hybrid_cp=False)
    return get_batch_on_this_cp_rank


def context_parallel_slice(batch: dict, cp_group) -> dict:
    """This CP rank's 2 of the sequence's 2 x CP chunks (Megatron-Core's load-balanced split)."""
    return _batch_on_this_cp_rank()(batch, cp_group=cp_group)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, cp_group=None):
    """Token-mean loss, and this rank's share of its value for reporting.

    With context parallelism a rank sees part of each sequence: its token-loss sum is divided by
    the token count of the whole CP group. The schedule multiplies the loss by the CP size and
    DDP averages gradients over DP x CP ranks, which gives the gradient of the global token mean;
    the reported shares of a CP group add up to that mean.

    The report is a copy: the pipeline schedule scales the returned loss in place (CP size,
    micro-batch count), and a plain ``detach()`` would share that storage.
    """
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    tokens = mask.sum()
    if cp_group is not None:
        dist.all_reduce(tokens, group=cp_group)
    loss = torch.sum(losses * mask) / tokens.clamp(min=1)
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model):
    from megatron.core import parallel_state

    batch = _to_device(next(data_iterator))
    cp_group = None
    if parallel_state.get_context_parallel_world_size() > 1:
        cp_group = parallel_state.get_context_parallel_group()
        batch = context_parallel_slice(batch, cp_group)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"], cp_group=cp_group)


class ManualGC:
    """``train.manual_gc``: Python's automatic collector off for the training loop (a collection
    of a large heap stalls the thread that launches kernels, at a different moment on each rank),
    ``gc.collect()`` every ``train.manual_gc_interval`` iterations instead (0: never), and after
    each evaluation unless ``train.manual_gc_eval=0``."""

    def __init__(self, enabled: bool, interval: int, after_eval: int = 1) -> None:
        self.enabled, self.interval, self.after_eval = enabled, interval, after_eval
        self._was_enabled = gc.isenabled()

    def __enter__(self) -> ManualGC:
        if self.enabled:
            gc.disable()
            gc.collect()
        return self

    def step(self, iteration: int) -> None:
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()

    def after_evaluation(self) -> None:
        if self.enabled and self.after_eval:
            gc.collect()

    def __exit__(self, *exc: object) -> None:
        if self.enabled and self._was_enabled:
            gc.enable()


def global_loss(losses: list[dict], pipeline_size: int, context_size: int) -> float:
    """Mean LM loss over micro-batches and data-parallel replicas, known on every rank.

    Every last-stage rank holds its share; TP ranks hold the same value and the shares of a CP
    group add up to the group's loss, so the world's sum counts each DP replica TP times.
    """
    from megatron.core import parallel_state

    value = torch.zeros(1, device="cuda")
    if parallel_state.is_pipeline_last_stage() and losses:
        value += torch.stack([x["lm loss"] for x in losses]).mean()
    dist.all_reduce(value)
    return value.item() / (dist.get_world_size() // (pipeline_size * context_size))


def per_chunk(items: list):
    """What Megatron-Core's schedules take for a rank's model chunks: the one item, or a list
    with one per virtual pipeline stage."""
    return items[0] if len(items) == 1 else items


@dataclass
class Rank:
    """What one rank trains with, built by ``build``."""

    run: RunConfig
    model: list
    optimizer: object
    scheduler: object
    engines: Engines  # the host engines (CPU Adam, windowed states, weight offload)
    data: list
    micro_batches: int
    dp_size: int
    validation: object  # the held-out split evaluations read (None: none runs)
    start: int  # the iteration a resumed run continues after
    startup: Startup


def train(run: RunConfig, run_dir: Path) -> dict:
    """Train ``run`` on this rank; returns the summary (rank 0 also writes it)."""
    rank = build(run)
    try:  # the engines' threads and host memory go on failure and Ctrl-C too
        return loop(rank, run_dir)
    finally:
        rank.engines.close()


def build(run: RunConfig) -> Rank:
    """Parallel state, model, optimizer (with the offload engines), schedule, the checkpoint to
    resume from, data."""
    from megatron.core.distributed import finalize_model_grads

    from offload_runner.mcore.megatron_config import build_transformer_config
    from offload_runner.mcore.model import build_model
    from offload_runner.mcore.optimizer import build_optimizer, build_scheduler

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    startup = Startup(is_node_sampler=local_rank == 0)
    initialize(run)
    startup.phase("process_group")
    config = build_transformer_config(run.model)
    model = build_model(run, config)
    startup.phase("model")
    _start_from_pretrained(run, model, startup)
    optimizer = build_optimizer(run, model, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    engines = Engines(run, model, optimizer)
    try:
        scheduler = build_scheduler(run, optimizer)
        startup.phase("optimizer")
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = optimizer.scale_loss
        start = _resume(run, model, optimizer, scheduler, startup)
        engines.attach(config, per_chunk([chunk.no_sync for chunk in model]))
        return Rank(
            run, model, optimizer, scheduler, engines, *_data(run, model, start), start, startup
        )
    except BaseException:
        engines.close()
        raise


def _start_from_pretrained(run: RunConfig, model: list, startup: Startup) -> None:
    """checkpoint.pretrained_checkpoint's weights, unless checkpoint.load resumes a run (the
    optimizer and its host engines are built from these weights next)."""
    from offload_runner import checkpoint

    c = run.checkpoint
    if c.pretrained_checkpoint and not checkpoint.has_checkpoint(c.load):
        checkpoint.load_pretrained(c.pretrained_checkpoint, model)
        log.info("weights from %s", c.pretrained_checkpoint)
        startup.phase("pretrained_load")


def _resume(run: RunConfig, model: list, optimizer, scheduler, startup: Startup) -> int:
    """The iteration to continue after: checkpoint.load's, or 0 (none there yet: checkpoint.load
    is checkpoint.save's folder, which the CLI allows as resume-or-start)."""
    from offload_runner import checkpoint

    if checkpoint.has_checkpoint(run.checkpoint.load):
        start = checkpoint.load_checkpoint(run.checkpoint.load, model, optimizer, scheduler)
        log.info("resumed from %s at iteration %d", run.checkpoint.load, start)
        startup.phase("checkpoint_load")
        return start
    if run.checkpoint.load:
        log.info("no checkpoint in %s yet: starting from scratch", run.checkpoint.load)
    return 0


def _data(run: RunConfig, model: list, start: int) -> tuple[list, int, int, object]:
    """One data iterator per model chunk (the interleaved schedule draws each micro-batch once
    per chunk) from ``start``'s samples on, the micro-batches per step, the data-parallel size,
    the validation split (or None)."""
    from megatron.core import parallel_state

    from offload_runner.mcore.data import build_data_iterator, build_datasets

    t = run.train
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    dataset, validation = build_datasets(run)
    data = [
        build_data_iterator(run, dataset, start * t.global_batch_size, dp_rank, dp_size)
        for _ in model
    ]
    return data, t.global_batch_size // (t.micro_batch_size * dp_size), dp_size, validation


def evaluates_at(run: RunConfig, iteration: int) -> bool:
    """Whether an evaluation follows ``iteration``: every validation.eval_interval iterations
    and after the last (none without validation.eval_iters)."""
    v = run.validation
    if not v.eval_iters:
        return False
    return iteration == run.train.train_iters or bool(
        v.eval_interval and iteration % v.eval_interval == 0
    )


def evaluate(rank: Rank) -> float:
    """The mean loss over validation.eval_iters global batches of the held-out split, forward
    only through Megatron-Core's schedule, the same batches each time (so the curve compares
    the model, not the batches); the engines' update in flight lands first."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    from offload_runner.mcore.data import build_data_iterator

    run, m, t = rank.run, rank.run.model, rank.run.train
    rank.engines.before_save()  # the forward reads the newest parameters
    dp_rank = parallel_state.get_data_parallel_rank()
    data = [
        build_data_iterator(run, rank.validation, 0, dp_rank, rank.dp_size, workers=0)
        for _ in rank.model
    ]
    for chunk in rank.model:
        chunk.eval()
    losses = []
    # the engines arm at no_sync's exit for the last micro-batch's backward: not for these
    config = get_model_config(rank.model[0])
    armed, config.no_sync_func = config.no_sync_func, contextlib.nullcontext
    with torch.no_grad():
        for _ in range(run.validation.eval_iters):
            out = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=per_chunk(data),
                model=rank.model,
                num_microbatches=rank.micro_batches,
                seq_length=m.seq_length,
                micro_batch_size=t.micro_batch_size,
                forward_only=True,
            )
            losses.append(global_loss(out, m.pipeline_model_parallel_size, m.context_parallel_size))
    config.no_sync_func = armed
    for chunk in rank.model:
        chunk.train()
    return sum(losses) / len(losses)


def loop(rank: Rank, run_dir: Path) -> dict:
    """The iterations from ``rank.start`` on, their metrics, checkpoints and profile; the
    summary."""
    from offload_runner.profiling import IterationProfiler

    run, t = rank.run, rank.run.train
    rank.startup.phase("data")
    is_writer = dist.get_rank() == 0
    log.info(
        "world %d (DP %d, CP %d), %d micro-batch(es) of %d per step, %s; ready after %s",
        dist.get_world_size(),
        rank.dp_size,
        run.model.context_parallel_size,
        rank.micro_batches,
        t.micro_batch_size,
        type(rank.optimizer).__name__,
        ", ".join(f"{name} {s:.1f} s" for name, s in rank.startup.phases.items()),
    )
    reporter = MetricsReporter(
        run_dir,
        t.train_iters,
        rank.start,
        is_writer,
        run.logger,
        resolved_config(run_dir) if is_writer else None,
    )
    step = Step(rank)
    saved_at = None
    profiler = IterationProfiler(run.profiling, run_dir, dist.get_rank())
    with reporter, ManualGC(t.manual_gc, t.manual_gc_interval, t.manual_gc_eval) as collector:
        for iteration in range(rank.start + 1, t.train_iters + 1):
            profiler.begin(iteration)
            collector.step(iteration)
            reporter.record(step(iteration))
            profiler.end(iteration)
            if evaluates_at(run, iteration):
                reporter.record_validation(iteration, evaluate(rank))
                collector.after_evaluation()
            interval = run.checkpoint.save_interval
            if run.checkpoint.save and interval and iteration % interval == 0:
                _save(rank, iteration)
                saved_at = iteration
        profiler.close()
        if run.checkpoint.save and rank.start < t.train_iters and saved_at != t.train_iters:
            _save(rank, t.train_iters)
        rank.engines.flush()
    return reporter.write_summary(_summary_extra(rank, reporter, step.peak, is_writer))


def _save(rank: Rank, iteration: int) -> None:
    from offload_runner import checkpoint

    c = rank.run.checkpoint
    rank.engines.before_save()
    checkpoint.save_checkpoint(
        c.save,
        iteration,
        rank.model,
        rank.optimizer,
        rank.scheduler,
        c.fully_parallel_save,
        with_optimizer=c.save_optim,
    )
    if dist.get_rank() == 0:
        checkpoint.describe_save(c.save, arch_of(rank.run.model), c.pretrained_checkpoint)


class Step:
    """One training step, timed (forward+backward against the rest, with CUDA events on the
    compute stream) and measured (GPU peaks per phase, page-locked host memory)."""

    def __init__(self, rank: Rank) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.rank = rank
        self.forward_backward = get_forward_backward_func()
        m, t = rank.run.model, rank.run.train
        self.tokens = t.global_batch_size * m.seq_length
        self.flops = training_flops_per_token(m) * self.tokens / dist.get_world_size()
        self.peak = torch.cuda.max_memory_allocated() / GB  # the run's GPU peak so far

    def __call__(self, iteration: int) -> StepMetrics:

        r, m, t = self.rank, self.rank.run.model, self.rank.run.train
        r.engines.begin_step(r.micro_batches)
        # The compute stream only: offload copies on side streams may run on.
        torch.cuda.current_stream().synchronize()
        torch.cuda.reset_peak_memory_stats()
        began = time.perf_counter()
        phase = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        phase[0].record()
        r.engines.zero_grad_buffers()
        r.optimizer.zero_grad()
        losses = self.forward_backward(
            forward_step_func=forward_step,
            data_iterator=per_chunk(r.data),
            model=r.model,
            num_microbatches=r.micro_batches,
            seq_length=m.seq_length,
            micro_batch_size=t.micro_batch_size,
            forward_only=False,
        )
        phase[1].record()
        fwd_bwd_peak = torch.cuda.max_memory_allocated() / GB
        torch.cuda.reset_peak_memory_stats()
        # The loss's copy to the host before the update's: behind them it would wait for them.
        loss = global_loss(losses, m.pipeline_model_parallel_size, m.context_parallel_size)
        grad_norm = r.engines.step()
        r.scheduler.step(increment=t.global_batch_size)
        torch.cuda.current_stream().synchronize()
        elapsed = time.perf_counter() - began
        fwd_bwd_s = phase[0].elapsed_time(phase[1]) / 1000
        step_peak, allocated = gpu_memory()
        self.peak = max(self.peak, fwd_bwd_peak, step_peak)
        r.startup.first_step_done()
        r.startup.sample_host()
        pinned = host_pinned_bytes()
        if pinned is not None:  # registered with cudaHostRegister, not torch's
            pinned += r.engines.pinned_bytes
        return StepMetrics(
            iteration=iteration,
            loss=loss,
            lr=r.optimizer.param_groups[0]["lr"],
            grad_norm=None if grad_norm is None else float(grad_norm),
            step_time_s=elapsed,
            fwd_bwd_time_s=fwd_bwd_s,
            optimizer_time_s=max(elapsed - fwd_bwd_s, 0.0),
            tokens_per_s=self.tokens / elapsed,
            tflops_per_gpu=self.flops / elapsed / 1e12,
            gpu_peak_allocated_gb=self.peak,
            gpu_peak_fwd_bwd_gb=fwd_bwd_peak,
            gpu_peak_step_gb=step_peak,
            gpu_allocated_gb=allocated,
            host_pinned_gb=None if pinned is None else pinned / 1024**3,
        )


def _summary_extra(rank: Rank, reporter: MetricsReporter, peak: float, is_writer: bool) -> dict:
    """summary.json beyond the step metrics: world, optimizer, startup and memory gathered from
    every rank, the engines' own metrics."""
    extra = {"world_size": dist.get_world_size(), "optimizer": type(rank.optimizer).__name__}
    extra.update(rank.startup.gathered(peak))
    extra.update(planned_peaks(rank.run, dist.get_world_size()))
    forward_backward_s = reporter.summary().get("fwd_bwd_time_s_median")
    extra.update(
        rank.engines.metrics(forward_backward_s, rank.micro_batches, rank.dp_size, is_writer)
    )
    return extra
