"""Hugging Face checkpoints in and out of Megatron-Core's dist_checkpointing.

    python run_recipe.py --import-hf HF_DIR --output CKPT_DIR [--recipe NAME]
    python run_recipe.py --export-hf CKPT_DIR --output HF_DIR

Import reads ``config.json`` (through transformers' config classes), maps it onto ``model.*``
(families.py), reads the safetensors shards tensor by tensor and writes a weights-only checkpoint
with a recipe beside it (``CKPT_DIR/recipe.yaml``) that starts from it
(``checkpoint.pretrained_checkpoint``). Export reads any checkpoint of ours, a layer at a time,
and writes safetensors shards of at most 5 GB with their index, ``config.json``,
``generation_config.json`` and the tokenizer files an import kept. Both build the model on the
meta device (no memory) with Megatron-Core's local spec: its sharded state dict names every
tensor, and dist_checkpointing reshards from and to any TP / PP / EP layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from offload_runner import checkpoint
from offload_runner.hf.families import (
    ARCH_KEYS,
    COPY,
    FAMILIES,
    FIXED_KEYS,
    GATE_UP,
    VOCAB,
    Family,
    HfError,
    arch_of,
    family_of,
    family_of_model,
    hf_config,
    model_keys,
    tensor_rows,
)
from offload_runner.rundir import writable

SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size
INDEX_FILE = "model.safetensors.index.json"
# What an import keeps of the source folder for export: configs, tokenizer, chat template.
KEPT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
IGNORED_TENSORS = (".rotary_emb.inv_freq",)  # buffers some older checkpoints saved
# (done since the last call, total): tensors (import) or layers (export)
Progress = Callable[[int, int], None]


# --- the model both directions build ---------------------------------------------------------


def single_run(arch: dict):
    """A one-rank RunConfig of this architecture, local spec, SequentialMLP experts, fp32."""
    from omegaconf import OmegaConf

    from offload_runner.config.compose import compose_config, to_run_config

    cfg = compose_config(
        [
            "recipe=tiny",
            "model.transformer_impl=local",
            "model.moe_grouped_gemm=false",
            "model.moe_token_dispatcher_type=allgather",
            "mixed_precision.bf16=false",
        ]
    )
    return to_run_config(OmegaConf.merge(cfg, {"model": arch}))


@contextlib.contextmanager
def single_process():
    """torch.distributed and Megatron-Core's parallel state for one process (gloo, in memory),
    as dist_checkpointing and GPTModel need them; left as found where a group exists."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
    try:
        yield
    finally:
        if owned:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def host_save_strategy():
    """Megatron-Core's torch_dist save strategy (the same files) for one process on a machine
    without CUDA, where megatron-core 0.16's staging synchronizes CUDA and its finalization
    broadcasts a CUDA tensor: the host copy blocks, and one process finalizes alone."""
    import functools

    import torch
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.utils import _get_failure_dict

    class HostSave(TorchDistSaveShardedStrategy):
        def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret):
            request = super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret)
            blocking = functools.partial(writer.preload_tensors, writer.write_buckets, False)
            _, metadata, _ = save_state_dict_ret

            def finalize() -> None:
                results = [writer.retrieve_write_results()]
                if failures := _get_failure_dict(results):
                    raise CheckpointException("write", failures)
                writer.finish(metadata, results)

            return request._replace(preload_fn=blocking, finalize_fns=[finalize])

    return None if torch.cuda.is_available() else HostSave("torch_dist", 1)


def meta_model(run, device: str = "meta"):
    """``run``'s GPTModel on the meta device: shapes and checkpoint keys, no memory (tests
    build it on the CPU to load weights into)."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from offload_runner.mcore.megatron_config import transformer_config_kwargs
    from offload_runner.mcore.model import gpt_model_kwargs

    kwargs = transformer_config_kwargs(run.model)
    kwargs.update(use_cpu_initialization=True, perform_initialization=False)
    with torch.device(device):
        return GPTModel(config=TransformerConfig(**kwargs), **gpt_model_kwargs(run))


# --- joining HF tensors into Megatron's and splitting them back -----------------------------


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What the joins need of the model: query groups, heads per group, head size, vocab."""

    groups: int
    heads: int
    head_dim: int
    vocab: int  # config.json's
    padded_vocab: int

    @staticmethod
    def of(model) -> Shapes:
        from offload_runner.model_size import padded_vocab_size

        groups = model.num_query_groups or model.num_attention_heads
        head_dim = model.kv_channels or model.hidden_size // model.num_attention_heads
        return Shapes(
            groups,
            model.num_attention_heads,
            head_dim,
            model.vocab_size,
            padded_vocab_size(model),
        )


def join(how: str, parts: list, s: Shapes):
    """One Megatron tensor from its HF tensors (meta tensors give the shape alone)."""
    import torch

    if how == COPY:
        return parts[0]
    if how == GATE_UP:
        return torch.cat(parts)
    if how == VOCAB:
        (table,) = parts
        pad = table.new_zeros((s.padded_vocab - table.shape[0], *table.shape[1:]))
        return torch.cat([table, pad])
    q, k, v = parts
    hidden = q.shape[-1]
    q = q.reshape(s.groups, s.heads // s.groups * s.head_dim, hidden)
    k, v = (t.reshape(s.groups, s.head_dim, hidden) for t in (k, v))
    return torch.cat([q, k, v], dim=1).reshape(-1, hidden)


def split(how: str, tensor, s: Shapes) -> list:
    """The HF tensors of one Megatron tensor (``join``'s inverse)."""
    if how == COPY:
        return [tensor]
    if how == GATE_UP:
        return list(tensor.chunk(2))
    if how == VOCAB:
        return [tensor[: s.vocab]]
    hidden = tensor.shape[-1]
    per_group = s.heads // s.groups * s.head_dim
    grouped = tensor.reshape(s.groups, per_group + 2 * s.head_dim, hidden)
    q, k, v = grouped.split([per_group, s.head_dim, s.head_dim], dim=1)
    return [t.reshape(-1, hidden) for t in (q, k, v)]


# --- import -----------------------------------------------------------------------------------


def read_config(source: Path):
    """config.json through transformers' own config class (its aliases and RoPE layout)."""
    if not (source / "config.json").is_file():
        raise HfError(
            f"--import-hf: {source} has no config.json",
            "name a Hugging Face model folder (config.json and *.safetensors)",
        )
    try:
        from transformers import AutoConfig
    except ImportError:
        raise HfError(
            "--import-hf needs transformers and safetensors", 'pip install -e ".[hf]"'
        ) from None
    try:
        return AutoConfig.from_pretrained(source)
    except Exception as err:  # noqa: BLE001 - transformers' config checks raise many kinds
        raise HfError(
            f"--import-hf: {source}/config.json: {' '.join(str(err).split())[:300]}",
            f"offload-runner imports model_type {', '.join(FAMILIES)}",
        ) from None


def shard_files(source: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (the index's, else every file's)."""
    from safetensors import safe_open

    index = source / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: source / file for name, file in weight_map.items()}
        absent = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if absent:
            raise HfError(
                f"--import-hf: {INDEX_FILE} names {len(absent)} shard(s) not in {source}: "
                f"{', '.join(absent[:3])}",
                "download every shard the index lists",
            )
        return files
    found = sorted(source.glob("*.safetensors"))
    if not found:
        raise HfError(
            f"--import-hf: no *.safetensors in {source}",
            "name a folder with safetensors weights (save_pretrained writes them)",
        )
    files = {}
    for path in found:
        with safe_open(path, "pt") as f:
            files.update(dict.fromkeys(f.keys(), path))
    return files


def check_names(rows: list, files: dict[str, Path], source: Path) -> None:
    needed = {n for _, names, _ in rows for n in names}
    missing = sorted(needed - set(files))
    extra = sorted(n for n in set(files) - needed if not n.endswith(IGNORED_TENSORS))
    if missing:
        raise HfError(
            f"--import-hf: {len(missing)} tensor(s) config.json implies are not in {source}'s "
            f"shards, e.g. {', '.join(missing[:3])}",
            "check the download is complete and config.json is the checkpoint's own",
        )
    if extra:
        raise HfError(
            f"--import-hf: {len(extra)} tensor(s) in {source} have no place in the model "
            f"config.json describes, e.g. {', '.join(extra[:3])}",
            "check config.json is the checkpoint's own",
        )


class Reader:
    """Tensors by HF name from open safetensors files; shapes without reading data."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self.stack = contextlib.ExitStack()
        self.open: dict[Path, object] = {}

    def _file(self, name: str):
        from safetensors import safe_open

        path = self.files[name]
        if path not in self.open:
            self.open[path] = self.stack.enter_context(safe_open(path, "pt"))
        return self.open[path]

    def meta(self, name: str):
        import torch

        return torch.empty(self._file(name).get_slice(name).get_shape(), device="meta")

    def tensor(self, name: str):
        return self._file(name).get_tensor(name)

    def dtype(self, name: str) -> str:
        return self._file(name).get_slice(name).get_dtype()

    def close(self) -> None:
        self.stack.close()


def with_data(entry, tensor):
    """A ShardedTensor (or factory) of the meta model holding ``tensor`` in its own dtype."""
    if any(f.name == "dtype" for f in dataclasses.fields(entry)):
        return dataclasses.replace(entry, data=tensor, dtype=tensor.dtype)
    return dataclasses.replace(entry, data=tensor)


def planned(rows: list, weights: dict, reader: Reader, s: Shapes) -> None:
    """Every joined shape equals the model's, checked on meta tensors before any data moves."""
    for name, hf_names, how in rows:
        want = tuple(weights[name].data.shape)
        try:
            got = tuple(join(how, [reader.meta(n) for n in hf_names], s).shape)
        except RuntimeError:
            got = None
        if got != want:
            shapes = ", ".join(f"{n} {list(reader.meta(n).shape)}" for n in hf_names)
            raise HfError(
                f"--import-hf: {shapes} do not make the model's {name} {list(want)}",
                "check config.json is the checkpoint's own (heads, groups, head_dim, sizes)",
            )


def check_rows(rows: list, weights: dict) -> None:
    """The family's table names exactly the model's tensors (a table error, not the user's)."""
    ours = {r[0] for r in rows}
    if ours != set(weights):
        odd = sorted(ours ^ set(weights))[:3]
        raise RuntimeError(f"the HF name table and the model disagree on {odd}")


def compose_import(family: Family, keys: dict, recipe: str | None):
    """The run an import describes: the family's base recipe (or ``recipe``, whose shapes
    must match config.json's) with config.json's model keys."""
    from omegaconf import OmegaConf

    from offload_runner.config.compose import compose_config, to_run_config

    cfg = compose_config([f"recipe={recipe or family.base_recipe}"])
    if recipe:
        differ = [
            f"{k}={keys[k]} (recipe {cfg.model[k]})"
            for k in ARCH_KEYS
            if k not in FIXED_KEYS and k in keys and cfg.model.get(k) != keys[k]
        ]
        if differ:
            raise HfError(
                f"--import-hf: config.json does not match recipe {recipe}: {', '.join(differ[:3])}",
                "drop --recipe (the import writes a recipe of its own), or name the recipe "
                "of this model",
            )
    return to_run_config(OmegaConf.merge(cfg, {"model": keys}))


def check_output(output: Path, flag: str) -> None:
    """An output folder that is absent or empty, whose parent can be written."""
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise HfError(
            f"{flag}: --output {output} is not an empty folder",
            "name a new folder (nothing is overwritten)",
        )
    parent = output.resolve().parent
    if not writable(parent):
        raise HfError(f"{flag}: {parent} can not be written", "name a folder you can write")


def import_hf(source: Path, output: Path, recipe: str | None, progress: Progress) -> dict:
    """The HF folder ``source`` as a weights-only checkpoint in ``output``; returns what it did."""
    from megatron.core import dist_checkpointing

    began = time.perf_counter()
    hf = read_config(source)
    family = family_of(hf.model_type)
    keys = model_keys(hf)
    check_output(output, "--import-hf")
    run = single_run(arch_of(compose_import(family, keys, recipe).model))
    files = shard_files(source)
    rows = tensor_rows(
        family,
        hf.num_hidden_layers,
        keys["num_moe_experts"] or 0,
        keys["share_embeddings_and_output_weights"],
    )
    check_names(rows, files, source)
    s = Shapes.of(run.model)
    reader = Reader(files)
    partial = output.with_name(output.name + ".partial")
    try:
        with single_process():
            weights = checkpoint.model_weights(meta_model(run))
            check_rows(rows, weights)
            planned(rows, weights, reader, s)
            dtype = SAFETENSORS_DTYPES.get(reader.dtype(rows[0][1][0]), "other")
            filled = {}
            for name, hf_names, how in rows:
                tensor = join(how, [reader.tensor(n) for n in hf_names], s)
                filled[name] = with_data(weights[name], tensor)
                progress(1, len(rows))
            shutil.rmtree(partial, ignore_errors=True)
            where = checkpoint.iteration_dir(partial, 0)  # its parents made too
            where.mkdir(parents=True)
            size = sum(t.data.numel() * t.data.element_size() for t in filled.values())
            params = sum(t.data.numel() for t in filled.values())
            state = {"model": filled, "iteration": 0}
            dist_checkpointing.save(state, str(where), sharded_strategy=host_save_strategy())
        _describe_import(partial, source, run, family, where)
    finally:
        reader.close()
    if output.exists():
        output.rmdir()
    partial.rename(output)
    return {
        "family": family.model_type,
        "tensors": len(rows),
        "params": params,
        "bytes": size,
        "dtype": dtype,
        "seconds": time.perf_counter() - began,
        "peak_host_gb": peak_host_gb(),
    }


def _describe_import(root: Path, source: Path, run, family: Family, where: Path) -> None:
    """What an import writes beside its weights: tracker, marker, model.yaml, the HF files
    export brings back, and a recipe that starts from it."""
    (root / checkpoint.LATEST).write_text("0")
    checkpoint.mark_weights_only(where, f"imported from {source.resolve()}")
    arch = arch_of(run.model)
    checkpoint.write_model_file(root, arch)
    kept = root / checkpoint.HF_FILES_DIR
    kept.mkdir()
    for name in KEPT_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, kept / name)
    final = root.with_name(root.name.removesuffix(".partial")).resolve()
    recipe = {
        "defaults": [family.base_recipe],
        "name": final.name,
        "model": arch,
        "checkpoint": {"pretrained_checkpoint": str(final)},
    }
    body = json.dumps(recipe, indent=2)  # JSON is YAML: one dependency fewer
    (root / "recipe.yaml").write_text(
        f"# @package _global_\n# {family.model_type} imported from {source.resolve()} by "
        f"offload-runner --import-hf: train from these weights with --recipe {final}/recipe.yaml"
        f"\n{body}\n"
    )


def peak_host_gb() -> float:
    """This process's peak resident memory (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


# --- export -----------------------------------------------------------------------------------


def checkpoint_dirs(path: Path) -> tuple[Path, Path]:
    """The save folder (with model.yaml) and the iteration folder to read, from either."""
    if not checkpoint.holds_checkpoint(path):
        raise HfError(
            f"--export-hf: {path} holds no checkpoint",
            "name a checkpoint folder (an --import-hf output or checkpoint.save's folder)",
        )
    root = path if (path / checkpoint.LATEST).is_file() else path.parent
    if not (root / checkpoint.MODEL_FILE).is_file():
        raise HfError(
            f"--export-hf: no {checkpoint.MODEL_FILE} beside {path} to say the model's shape",
            "export a checkpoint saved by this version of offload-runner, or write the "
            f"run's model section into {root / checkpoint.MODEL_FILE}",
        )
    return root, checkpoint.resolve_load_dir(path)


def export_hf(path: Path, output: Path, progress: Progress) -> dict:
    """A checkpoint of ours as an HF model folder in ``output``; returns what it did."""
    from omegaconf import OmegaConf

    began = time.perf_counter()
    root, load_dir = checkpoint_dirs(path)
    arch = OmegaConf.to_container(OmegaConf.load(root / checkpoint.MODEL_FILE))
    check_output(output, "--export-hf")
    run = single_run(arch)
    family = exportable(run.model)
    kept = root / checkpoint.HF_FILES_DIR
    config = (
        json.loads((kept / "config.json").read_text()) if (kept / "config.json").is_file() else None
    )
    partial = output.with_name(output.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    with single_process():
        written = _write_tensors(run, family, load_dir, partial, config, progress)
    _write_configs(partial, kept, family, run.model, config, written["dtype"])
    if output.exists():
        output.rmdir()
    partial.rename(output)
    took = time.perf_counter() - began
    return {**written, "family": family.model_type, "seconds": took, "peak_host_gb": peak_host_gb()}


def exportable(model) -> Family:
    family = family_of_model(model)
    arch = arch_of(model)
    wrong = [f"{k}={arch[k]}" for k, v in FIXED_KEYS.items() if arch[k] != v]
    if model.qk_layernorm != family.qk_norm:
        wrong.append(f"qk_layernorm={model.qk_layernorm}")
    if wrong:
        raise HfError(
            f"--export-hf: no Hugging Face family has this model's {', '.join(wrong[:3])}",
            f"export models of the architectures of {', '.join(FAMILIES)}",
        )
    return family


def _write_tensors(
    run, family, load_dir: Path, folder: Path, config: dict | None, progress
) -> dict:
    """Load the model's tensors from the checkpoint, split them, write HF shards."""
    from megatron.core import dist_checkpointing

    m = run.model
    s = Shapes.of(m)
    stored = checkpoint.stored_tensors(load_dir)
    weights = checkpoint.aligned(checkpoint.model_weights(meta_model(run)), stored)
    rows = tensor_rows(
        family, m.num_layers, m.num_moe_experts or 0, m.share_embeddings_and_output_weights
    )
    check_rows(rows, weights)
    dtype = _export_dtype(config, stored[weights[rows[0][0]].key].dtype)
    writer = ShardWriter(folder)
    # the whole model in one read: dist_checkpointing reads a stacked tensor's layers only
    # together on one process (a layer alone is an access pattern it refuses)
    request = {name: _request(weights[name], stored) for name, _, _ in rows}
    loaded = dist_checkpointing.load(request, str(load_dir))
    groups = _by_layer(rows)
    for group in groups:
        for name, hf_names, how in group:
            for hf_name, tensor in zip(hf_names, split(how, loaded.pop(name), s), strict=True):
                writer.add(hf_name, tensor.to(dtype))
        progress(1, len(groups))
    return {**writer.close(), "dtype": str(dtype).removeprefix("torch.")}


def _request(entry, stored: dict):
    """What to load for one model tensor: its shard in the stored dtype, or a vocabulary table
    whole where the checkpoint padded it otherwise (a run at another TP size)."""
    import torch

    meta = stored[entry.key]
    if checkpoint.vocab_differs(entry, stored):
        return checkpoint.whole(entry.key, meta)
    return with_data(entry, torch.empty(entry.data.shape, dtype=meta.dtype))


def _export_dtype(config: dict | None, stored):
    """The dtype the weights came in (an import's config.json), else the checkpoint's."""
    import torch

    name = (config or {}).get("dtype") or (config or {}).get("torch_dtype")
    return getattr(torch, name) if isinstance(name, str) and hasattr(torch, name) else stored


def _by_layer(rows: list) -> list[list]:
    """Rows grouped: the top-level tensors, then one group per decoder layer."""
    groups: dict[str, list] = {}
    for row in rows:
        parts = row[0].split(".")
        key = parts[2] if parts[:2] == ["decoder", "layers"] else "top"
        groups.setdefault(key, []).append(row)
    return list(groups.values())


class ShardWriter:
    """safetensors shards of at most SHARD_BYTES, named as transformers names them, and the
    index of which shard holds each tensor."""

    def __init__(self, folder: Path, limit: int = SHARD_BYTES) -> None:
        self.folder, self.limit = folder, limit
        self.pending: dict = {}
        self.size = self.total = 0
        self.files: list[tuple[Path, list[str]]] = []

    def add(self, name: str, tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.size + nbytes > self.limit:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.size += nbytes
        self.total += nbytes

    def flush(self) -> None:
        from safetensors.torch import save_file

        path = self.folder / f"shard-{len(self.files):05d}.tmp"
        save_file(self.pending, path, metadata={"format": "pt"})
        self.files.append((path, list(self.pending)))
        self.pending, self.size = {}, 0

    def close(self) -> dict:
        if self.pending:
            self.flush()
        weight_map = {}
        for i, (path, names) in enumerate(self.files, start=1):
            final = f"model-{i:05d}-of-{len(self.files):05d}.safetensors"
            path.rename(self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {
            "metadata": {"total_size": self.total},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return {"tensors": len(weight_map), "bytes": self.total, "shards": len(self.files)}


def _write_configs(
    folder: Path, kept: Path, family: Family, model, config: dict | None, dtype: str
) -> None:
    """config.json (the import's, else made from model.*), generation_config.json (the
    import's, else its end-of-text ids from config.json) and the tokenizer files kept."""
    from transformers import GenerationConfig

    if config is None:
        hf_config(family, model, dtype).save_pretrained(folder)
    else:
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in KEPT_FILES:
        if name != "config.json" and (kept / name).is_file():
            shutil.copy2(kept / name, folder / name)
    if not (folder / "generation_config.json").is_file():
        made = json.loads((folder / "config.json").read_text())
        ids = {k: made.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        GenerationConfig(**{k: v for k, v in ids.items() if v is not None}).save_pretrained(folder)
