"""Checkpoints with Megatron-Core dist_checkpointing: save every N iterations and at the end,
resume with ``checkpoint.load=DIR`` (the save folder, or one ``iter_NNNNNNN`` inside it)."""

from __future__ import annotations

from pathlib import Path

from offload_runner.progress import on_terminal, timed_line

LATEST = "latest_checkpointed_iteration.txt"
# 8-bit moments' block scales and the random state stochastic rounding draws from, per rank
QUANTIZED_FILE = "quantized_states_rank{rank}.pt"
PRECISION_FILE = "optimizer_precision.json"  # the precision of a native checkpoint's states
# Megatron-LM's default layout for the distributed optimizer's state (reshardable over DP); the
# older default, fully_sharded_model_space, is refused by megatron-core 0.19's dist_checkpointing.
OPTIMIZER_METADATA = {
    "distrib_optim_sharding_type": "dp_reshardable",
    "chained_optim_avoid_prefix": True,
}


def iteration_dir(root: Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def has_checkpoint(path: str | Path | None) -> bool:
    """``path`` holds a checkpoint to load (a save folder or an iteration folder)."""
    if not path:
        return False
    path = Path(path)
    return (
        (path / LATEST).is_file()
        or (path / "metadata.json").is_file()
        or (path.is_dir() and any(path.iterdir()))
    )


def resolve_load_dir(path: str | Path) -> Path:
    """A save folder (its latest iteration) or an iteration folder."""
    path = Path(path)
    if (path / LATEST).is_file():
        return iteration_dir(path, int((path / LATEST).read_text().strip()))
    return path


def _checkpoint_state(model: list, optimizer, scheduler, iteration: int, is_loading: bool) -> dict:
    """What a checkpoint holds: sharded model and optimizer, plus schedule and iteration.

    The model's state comes from the bare GPTModel (as Megatron-LM does): DDP would prefix every
    key with ``module.`` when saving but not when loading."""
    from megatron.core.utils import unwrap_model

    model_state = {
        key: unwrap_model(chunk).sharded_state_dict()
        for key, chunk in zip(model_keys(len(model)), model, strict=True)
    }
    return {
        **model_state,
        "optimizer": optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=OPTIMIZER_METADATA
        ),
        "scheduler": scheduler.state_dict(),
        "iteration": iteration,
    }


def model_keys(chunks: int) -> list[str]:
    """Megatron-LM's checkpoint keys of a rank's model: "model", or "model0", "model1", ... with
    virtual pipeline stages."""
    return ["model"] if chunks == 1 else [f"model{i}" for i in range(chunks)]


def _save_strategy(fully_parallel: bool):
    """Megatron-Core's default sharded strategy; fully parallel: each data-parallel rank writes
    its share of what the replicas hold alike."""
    if not fully_parallel:
        return None
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    return FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy(),
        parallel_state.get_data_parallel_group(with_context_parallel=True),
    )


def save_checkpoint(
    root: str | Path,
    iteration: int,
    model: list,
    optimizer,
    scheduler,
    fully_parallel: bool = False,
) -> Path:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from offload_runner.offload import host_adam

    path = iteration_dir(Path(root), iteration)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    # fp32 masters in the checkpoint: the host engines' layout, whatever an engine keeps
    with _pageable_weights(model), host_adam.fp32_masters(optimizer):
        state = _checkpoint_state(model, optimizer, scheduler, iteration, is_loading=False)
        dist_checkpointing.save(state, str(path), sharded_strategy=_save_strategy(fully_parallel))
    _save_weight_offload(path, model)
    _save_quantized(path, optimizer)
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(root) / LATEST).write_text(str(iteration))
    return path


def load_checkpoint(path: str | Path, model: list, optimizer, scheduler) -> int:
    """Load model, optimizer and schedule in place; returns the iteration it was saved at."""
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model

    from offload_runner.offload import host_adam
    from offload_runner.offload import optimizer as hybrid_optimizer

    load_dir = resolve_load_dir(path)
    # its size on rank 0 alone: every rank stat-ing a sharded checkpoint's files is a burst of
    # metadata calls on a shared filesystem
    size = sum(f.stat().st_size for f in load_dir.rglob("*") if f.is_file()) if on_terminal() else 0
    said = timed_line(f"loading checkpoint {load_dir}: {{size}}", "loaded", size)
    with host_adam.fp32_masters(optimizer):  # the templates of the saved fp32 masters
        with _pageable_weights(model):
            state = _checkpoint_state(model, optimizer, scheduler, 0, is_loading=True)
            loaded = dist_checkpointing.load(state, str(load_dir))
            for key, chunk in zip(model_keys(len(model)), model, strict=True):
                unwrap_model(chunk).load_state_dict(loaded[key])
        _load_weight_offload(load_dir, model)
        optimizer.load_state_dict(loaded["optimizer"])
        hybrid_optimizer.restore_after_load(optimizer)
        for engine in host_adam.engines(optimizer):  # CPU Adam and windowed state offload
            engine.restore_after_load()
        _load_quantized(load_dir, optimizer)
    scheduler.load_state_dict(loaded["scheduler"])
    said()
    return int(loaded["iteration"])


def _pageable_weights(model: list):
    """Weight offload's parameters on pageable copies while a checkpoint reads or writes them."""
    import contextlib

    from offload_runner.offload import weight

    stack = contextlib.ExitStack()
    for offload in weight.of(model):
        stack.enter_context(offload.pageable())
    return stack


def _save_weight_offload(path: Path, model: list) -> None:
    """The offloaded layers' masters and moments (offload/weight), one file per rank."""
    import torch
    import torch.distributed as dist

    from offload_runner.offload import weight

    for offload in weight.of(model):
        torch.save(offload.state_dict(), path / weight.STATE_FILE.format(rank=dist.get_rank()))


def _load_weight_offload(load_dir: Path, model: list) -> None:
    """Their masters and moments back; a checkpoint without them (saved without weight
    offload) leaves the masters the loaded bf16 weights and the moments zero, and says so."""
    import logging

    import torch
    import torch.distributed as dist

    from offload_runner.offload import weight

    for offload in weight.of(model):
        file = load_dir / weight.STATE_FILE.format(rank=dist.get_rank())
        if file.is_file():
            offload.load_state_dict(torch.load(file, weights_only=True))
        else:
            offload.master.copy_(offload.weights)
            logging.getLogger("offload_runner").warning(
                "%s has no weight-offload state (%s): the offloaded layers' masters start from "
                "their bf16 weights and their Adam moments from zero",
                load_dir,
                file.name,
            )


def precision(run) -> str | None:
    """The precision a native checkpoint of ``run`` holds its host states in (None: an fp32
    checkpoint in HybridDeviceOptimizer's layout, which every other engine loads)."""
    from offload_runner.hardware import bf16_masters, master_bytes, q8_moments

    if not (q8_moments(run) or bf16_masters(run)):
        return None
    o = run.optimizer
    return _label(o.exp_avg_dtype.value, o.exp_avg_sq_dtype.value, master_bytes(run))


def _engine_precision(engine) -> str:
    import torch

    names = {
        torch.uint8: "q8",
        torch.float32: "fp32",
        torch.bfloat16: "bf16",
        torch.float16: "fp16",
    }
    master = engine.host_master
    return _label(
        *(names[d] for d in engine.moment_dtypes), 0 if master is None else master.element_size()
    )


def _label(exp_avg: str, exp_avg_sq: str, master_bytes: int) -> str:
    return f"exp_avg {exp_avg}, exp_avg_sq {exp_avg_sq}, {master_bytes} B masters"


def saved_precision(path: str | Path) -> str | None:
    """What ``precision`` was when the checkpoint at ``path`` was saved (None: fp32 layout, or
    no checkpoint there)."""
    import json

    if not has_checkpoint(path):
        return None
    found = resolve_load_dir(path) / PRECISION_FILE
    return json.loads(found.read_text())["precision"] if found.is_file() else None


def _native_engines(optimizer) -> list:
    from offload_runner.offload import host_adam

    return [e for e in host_adam.engines(optimizer) if e.native_checkpoint]


def _save_quantized(path: Path, optimizer) -> None:
    """Each rank's block scales and random states (bf16 masters round with their engine's),
    and on rank 0 the precision, beside a native checkpoint."""
    import json

    import torch
    import torch.distributed as dist

    engines = _native_engines(optimizer)
    if not engines:
        return
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    state = {"scales": [e.quantized_state() for e in engines], "rng": rng}
    state["rounding"] = [e.rounding_state() for e in engines]
    torch.save(state, path / QUANTIZED_FILE.format(rank=dist.get_rank()))
    if dist.get_rank() == 0:
        said = _engine_precision(engines[0])
        (path / PRECISION_FILE).write_text(json.dumps({"precision": said}))


def _load_quantized(load_dir: Path, optimizer) -> None:
    """The scales and the random states back (validation has checked the precision)."""
    import torch
    import torch.distributed as dist

    engines = _native_engines(optimizer)
    if not engines:
        return
    saved = torch.load(load_dir / QUANTIZED_FILE.format(rank=dist.get_rank()), weights_only=True)
    rounding = saved.get("rounding", [None] * len(engines))
    for engine, scales, state in zip(engines, saved["scales"], rounding, strict=True):
        engine.load_quantized_state(scales)
        engine.load_rounding_state(state)
    torch.set_rng_state(saved["rng"]["cpu"])
    if "cuda" in saved["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(saved["rng"]["cuda"])
