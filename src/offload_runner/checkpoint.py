"""Checkpoints with Megatron-Core dist_checkpointing: save every N iterations and at the end,
resume with ``checkpoint.load=DIR`` (the save folder, or one ``iter_NNNNNNN`` inside it)."""

from __future__ import annotations

from pathlib import Path

from offload_runner.progress import on_terminal, timed_line
from offload_runner.rundir import writable

LATEST = "latest_checkpointed_iteration.txt"
# 8-bit moments' block scales and the random state stochastic rounding draws from, per rank
QUANTIZED_FILE = "quantized_states_rank{rank}.pt"
PRECISION_FILE = "optimizer_precision.json"  # the precision of a native checkpoint's states
WEIGHTS_ONLY_FILE = "weights_only.json"  # in an iteration folder saved without optimizer
MODEL_FILE = "model.yaml"  # beside the iterations: the model's architecture (--export-hf)
HF_FILES_DIR = "hf"  # beside them too: config.json and tokenizer files of an imported model
# A checkpoint key and the name another layer spec gives the same tensor: the local spec files
# an MoE layer's pre-MLP norm under the fused norm's name, Transformer Engine's under its own.
KEY_ALIASES = {
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
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


def holds_checkpoint(path: str | Path | None) -> bool:
    """``path`` is a save folder whose tracker names a saved iteration, or an iteration folder
    (a stricter ``has_checkpoint``: any other folder is not one)."""
    if not path:
        return False
    path = Path(path)
    saved = tracked(path)
    if saved.isdigit():
        path = iteration_dir(path, int(saved))
    return (path / "metadata.json").is_file()


def tracked(path: Path) -> str:
    """What a save folder's tracker file says (its latest iteration), "" without one."""
    tracker = path / LATEST
    return tracker.read_text().strip() if tracker.is_file() else ""


def resolve_load_dir(path: str | Path) -> Path:
    """A save folder (its latest iteration) or an iteration folder."""
    path = Path(path)
    saved = tracked(path)
    return iteration_dir(path, int(saved)) if saved else path


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
    with_optimizer: bool = True,
) -> Path:
    """Model, optimizer and schedule (``with_optimizer=False``: the weights alone)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from offload_runner.offload import host_adam

    path = iteration_dir(Path(root), iteration)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    strategy = _save_strategy(fully_parallel)
    if not with_optimizer:
        with _pageable_weights(model):
            dist_checkpointing.save(
                _weights_state(model, iteration), str(path), sharded_strategy=strategy
            )
        if dist.get_rank() == 0:
            mark_weights_only(path, "saved with checkpoint.save_optim=false")
    # fp32 masters in the checkpoint: the host engines' layout, whatever an engine keeps
    else:
        with _pageable_weights(model), host_adam.fp32_masters(optimizer):
            state = _checkpoint_state(model, optimizer, scheduler, iteration, is_loading=False)
            dist_checkpointing.save(state, str(path), sharded_strategy=strategy)
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
    said = _loading_line(load_dir, "checkpoint")
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


def _weights_state(model: list, iteration: int) -> dict:
    from megatron.core.utils import unwrap_model

    chunks = zip(model_keys(len(model)), model, strict=True)
    return {**{k: model_weights(unwrap_model(c)) for k, c in chunks}, "iteration": iteration}


def model_weights(bare) -> dict:
    """A bare GPTModel's sharded tensors, without the layers' ``_extra_state`` objects: what a
    weights-only checkpoint holds and a pretrained start asks of any checkpoint."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = bare.sharded_state_dict()
    return {k: v for k, v in state.items() if not isinstance(v, ShardedObject)}


def stored_tensors(load_dir: Path) -> dict:
    """Checkpoint key -> its metadata (dtype, global shape) of every tensor saved there."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_tensors_metadata(str(load_dir))


class CheckpointMismatch(ValueError):
    """A checkpoint without tensors this model has."""


def aligned(weights: dict, stored: dict) -> dict:
    """``weights`` with each key the checkpoint spells as another layer spec does renamed."""
    import dataclasses

    out, missing = {}, []
    for name, entry in weights.items():
        key = entry.key
        for ours, theirs in KEY_ALIASES.items():
            if key not in stored and key.endswith(ours):
                key = key.removesuffix(ours) + theirs
        if key not in stored:
            missing.append(entry.key)
        out[name] = dataclasses.replace(entry, key=key) if key != entry.key else entry
    if missing:
        raise CheckpointMismatch(
            f"the checkpoint lacks {len(missing)} of the model's tensors, e.g. {missing[:2]}"
        )
    return out


def load_pretrained(path: str | Path, model: list) -> None:
    """The weights of any checkpoint of this model (an import, a saved run) into ``model``,
    before the optimizer is built from them; the layers' extra states stay as built."""
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model

    from offload_runner.offload import weight

    load_dir = resolve_load_dir(path)
    said = _loading_line(load_dir, "weights")
    stored = stored_tensors(load_dir)
    with _pageable_weights(model):
        for chunk in model:
            bare = unwrap_model(chunk)
            wanted = aligned(model_weights(bare), stored)
            padded = {n: wanted.pop(n) for n in list(wanted) if vocab_differs(wanted[n], stored)}
            loaded = dist_checkpointing.load(wanted, str(load_dir))
            loaded = {k: loaded[k] for k in wanted}  # not the checkpoint's common state
            loaded.update({n: _vocab_rows(e, stored, load_dir) for n, e in padded.items()})
            missing, unexpected = bare.load_state_dict(loaded, strict=False)
            left = [k for k in missing + unexpected if not k.endswith("_extra_state")]
            if left:
                raise CheckpointMismatch(f"{load_dir} and the model differ on {left[:3]}")
    for offload in weight.of(model):  # its masters were taken from the weights at build
        offload.master.copy_(offload.weights)
    said()


VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")


def vocab_differs(entry, stored: dict) -> bool:
    """A vocabulary table padded to another multiple than the checkpoint's (the padding
    grows with TP: Qwen3's 151,936 rows are 152,064 at TP 4)."""
    saved = stored[entry.key].global_shape
    if entry.key not in VOCAB_TENSORS or saved == entry.global_shape:
        return False
    if saved[1:] != entry.global_shape[1:]:
        raise CheckpointMismatch(
            f"{entry.key} is {list(saved)} there, {list(entry.global_shape)} here"
        )
    return True


def whole(key: str, meta):
    """A request for the stored tensor ``key`` whole, on the CPU, in its stored dtype."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return ShardedTensor.from_rank_offsets(key, torch.empty(meta.global_shape, dtype=meta.dtype))


def _vocab_rows(entry, stored: dict, load_dir: Path):
    """This rank's rows of a vocabulary table saved with other padding: the rows saved,
    zeros past them (padding rows are never a token's)."""
    from megatron.core import dist_checkpointing

    table = dist_checkpointing.load({"t": whole(entry.key, stored[entry.key])}, str(load_dir))["t"]
    first, rows = entry.global_offset[0], entry.local_shape[0]
    mine = table[first : first + rows]
    out = mine.new_zeros(entry.local_shape)
    out[: mine.shape[0]] = mine
    return out


def mark_weights_only(path: Path, how: str) -> None:
    import json

    (path / WEIGHTS_ONLY_FILE).write_text(json.dumps({"weights_only": how}) + "\n")


def weights_only(path: str | Path | None) -> bool:
    """The checkpoint at ``path`` holds weights alone (an import, or save_optim=false)."""
    return has_checkpoint(path) and (resolve_load_dir(path) / WEIGHTS_ONLY_FILE).is_file()


def checkpoint_root(path: str | Path) -> Path:
    """The save folder of a checkpoint named by its save folder or an iteration folder."""
    path = Path(path)
    return (
        path if (path / LATEST).is_file() or not (path.parent / LATEST).is_file() else path.parent
    )


def saved_architecture(path: str | Path | None) -> dict | None:
    """model.yaml of the checkpoint at ``path`` (None: none there)."""
    from omegaconf import OmegaConf

    if not has_checkpoint(path):
        return None
    found = checkpoint_root(path) / MODEL_FILE
    return OmegaConf.to_container(OmegaConf.load(found)) if found.is_file() else None


def write_model_file(root: Path, arch: dict) -> None:
    from omegaconf import OmegaConf

    (Path(root) / MODEL_FILE).write_text(OmegaConf.to_yaml(arch))


def describe_save(root: str | Path, arch: dict, pretrained: str | None) -> None:
    """Rank 0, beside a run's saves: its model.yaml, and an imported model's HF files."""
    import shutil

    write_model_file(Path(root), arch)
    kept = checkpoint_root(pretrained) / HF_FILES_DIR if pretrained else None
    if kept and kept.is_dir() and not (Path(root) / HF_FILES_DIR).exists():
        shutil.copytree(kept, Path(root) / HF_FILES_DIR)


def _loading_line(load_dir: Path, what: str):
    """The start-up line of a load, its size summed on rank 0 alone: every rank stat-ing a
    sharded checkpoint's files is a burst of metadata calls on a shared filesystem."""
    size = sum(f.stat().st_size for f in load_dir.rglob("*") if f.is_file()) if on_terminal() else 0
    return timed_line(f"loading {what} {load_dir}: {{size}}", "loaded", size)


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

    if not (run.precision.q8 or run.precision.bf16_masters):
        return None
    o = run.optimizer
    return _label(o.exp_avg_dtype.value, o.exp_avg_sq_dtype.value, run.precision.master_bytes)


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


def load_problem(load: str | None, save: str | None) -> tuple[str, str] | None:
    """What is wrong with ``checkpoint.load`` before anything starts, as (message, fix): a file;
    a tracker that names no iteration, or one whose folder is gone; a folder that holds files
    but no checkpoint; a precision file that does not read; a folder that is not there (unless
    it is checkpoint.save too: resume if there, else start, a job that restarts itself)."""
    if not load:
        return None
    path = Path(load)
    point = "point it at a saved run's checkpoint folder or one of its iter_NNNNNNN folders"
    if path.is_file():
        return f"checkpoint.load={load} is a file, not a checkpoint folder", point
    if not path.exists():
        if load == save:
            return None
        return (
            f"checkpoint.load={load} does not exist: the run would start from scratch",
            f"{point}, set checkpoint.save to the same folder to resume it when there and "
            "start it when not, or drop checkpoint.load",
        )
    try:
        return _tracker_problem(load, path, point) or _precision_problem(load, path)
    except OSError as err:  # unreadable: permissions, a broken link
        return f"checkpoint.load={load}: {err.strerror}: {err.filename}", point


def _tracker_problem(load: str, path: Path, point: str) -> tuple[str, str] | None:
    if not (path / LATEST).is_file():
        if any(path.iterdir()) and not (path / "metadata.json").is_file():
            return f"checkpoint.load={load} holds files but no checkpoint (no {LATEST})", point
        return None
    saved = tracked(path)
    fix = f"write the iteration of a saved iter_NNNNNNN folder into {path / LATEST}, or {point}"
    if not saved.isdigit():
        return f"checkpoint.load={load}: {LATEST} holds {saved[:40]!r}, not an iteration", fix
    if not (folder := iteration_dir(path, int(saved))).is_dir():
        return f"checkpoint.load={load}: {LATEST} names {folder.name}, which is not there", fix
    return None


def _precision_problem(load: str, path: Path) -> tuple[str, str] | None:
    import json

    found = resolve_load_dir(path) / PRECISION_FILE
    if not found.is_file():
        return None
    try:
        json.loads(found.read_text())["precision"]
    except (ValueError, KeyError, TypeError):
        return (
            f"checkpoint.load={load}: {found} does not read as the precision file it saved",
            "restore it from the run that saved the checkpoint, or load another checkpoint",
        )
    return None


def save_problem(save: str | None) -> tuple[str, str] | None:
    """``checkpoint.save`` in a place this process cannot write (checked where the folder or
    the one above it exists here: a cluster's path planned on a laptop passes)."""
    path = Path(save or "")
    if not save or not (path.exists() or path.parent.exists()) or writable(path):
        return None
    return (
        f"checkpoint.save={save} can not be written here",
        "name a checkpoint folder this job can write",
    )


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
