"""Training batches from Megatron-Core datasets: MockGPTDataset, or indexed .bin/.idx prefixes.

Each data-parallel rank reads its own micro-batches of every global batch (consecutive samples, as
Megatron-LM's pretraining sampler does); TP/PP/CP ranks of one replica read the same samples.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from offload_runner.config.schema import DatasetConfig, DatasetKind, RunConfig
from offload_runner.progress import timed_line


def parse_blend(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """``[prefix, ...]`` or ``[weight, prefix, weight, prefix, ...]`` -> (prefixes, weights)."""
    items = [str(x) for x in data_path]
    try:
        weights = [float(x) for x in items[0::2]]
    except ValueError:
        return items, None
    if len(items) % 2:
        raise ValueError("a blend alternates weight and prefix: [0.7, /data/a, 0.3, /data/b]")
    return items[1::2], weights


def data_prefixes(run: RunConfig) -> list[str]:
    """dataset.data_path's prefixes (none for mock data, or where the blend does not parse:
    a rule's to say)."""
    if run.dataset.kind == DatasetKind.mock or not run.dataset.data_path:
        return []
    try:
        prefixes, _ = parse_blend(run.dataset.data_path)
    except ValueError:
        return []
    return prefixes


def prepared_metadata(run: RunConfig) -> list[dict]:
    """What --prepare wrote beside each of dataset.data_path's prefixes (prefixes made
    elsewhere have none; mock data has no prefixes)."""
    from offload_runner.prepare import read_metadata

    return [m for m in map(read_metadata, data_prefixes(run)) if m is not None]


def prepared_eods(run: RunConfig) -> list[int]:
    """The end-of-document ids --prepare recorded for the prefixes (more than one: a blend
    validation refuses)."""
    return sorted({m["eod_id"] for m in prepared_metadata(run)})


def data_tokenizer(run: RunConfig):
    """The tokenizer the datasets see: only its EOD and vocabulary size matter to them. The EOD
    is the one --prepare recorded for the prefixes, else model.vocab_size - 1."""
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    class DataTokenizer(NullTokenizer):
        def __init__(self, vocab_size: int, eod: int) -> None:
            super().__init__(vocab_size - 1)
            self._eod = eod

        @property
        def eod(self) -> int:
            return self._eod

    eods = prepared_eods(run)
    if len(eods) > 1:
        raise ValueError(f"dataset.data_path's prefixes have different EOD ids: {eods}")
    return DataTokenizer(run.model.vocab_size, eods[0] if eods else run.model.vocab_size - 1)


def dataset_config(run: RunConfig, cache_dir: Path | None = None):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    d: DatasetConfig = run.dataset
    blend = parse_blend(d.data_path) if d.kind != DatasetKind.mock else None
    return GPTDatasetConfig(
        random_seed=run.dataset.random_seed,
        sequence_length=run.model.seq_length,
        blend=blend,
        split=d.split,
        tokenizer=data_tokenizer(run),
        reset_position_ids=d.reset_position_ids,
        reset_attention_mask=d.reset_attention_mask,
        eod_mask_loss=d.eod_mask_loss,
        create_attention_mask=False,  # causal masks come from the attention kernels
        mid_level_dataset_surplus=0.005,
        path_to_cache=str(cache_dir) if cache_dir else None,
    )


# dataset.split as Megatron-Core's parser reads it whole: up to three non-negative shares
SPLIT = re.compile(r"\s*\d*\.?\d+(\s*[,/]\s*\d*\.?\d+){0,2}\s*")


def split_readable(split: str) -> bool:
    """Whether Megatron-Core reads ``split`` as the user wrote it: its parser takes any digits
    it finds ('1,-1,0' as 1,1,0; 'abc' as nothing, then divides by zero)."""
    return bool(SPLIT.fullmatch(split)) and any(float(x) for x in re.split("[,/]", split))


def validation_documents(run: RunConfig) -> int | None:
    """Documents dataset.split gives the validation split: 0 where its weight is 0, else
    counted from what --prepare recorded (None where nothing says: mock data, prefixes made
    elsewhere, a split Megatron-Core's parser refuses). Megatron-Core rounds each split's
    share of the documents."""
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    if not split_readable(run.dataset.split):
        return None
    train, valid, _ = parse_and_normalize_split(run.dataset.split)
    if valid <= 0:
        return 0
    documents = [m.get("documents") for m in prepared_metadata(run)]
    if run.dataset.kind == DatasetKind.mock or not documents or None in documents:
        return None
    return min(round(n * (train + valid)) - round(n * train) for n in documents)


def validation_samples(run: RunConfig) -> int:
    """Samples one evaluation reads (validation.eval_iters global batches; 0: none runs)."""
    return (run.validation.eval_iters or 0) * run.train.global_batch_size


def build_datasets(run: RunConfig, cache_dir: Path | None = None) -> tuple:
    """The training split, and the validation split evaluations read (None where none runs),
    through Megatron-Core's BlendedMegatronDatasetBuilder on dataset.split."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    from offload_runner.mcore.sft import SFTDataset

    kinds = {DatasetKind.mock: MockGPTDataset, DatasetKind.indexed: GPTDataset}
    cls = kinds.get(run.dataset.kind, SFTDataset)
    config = dataset_config(run, cache_dir)
    samples = run.train.train_iters * run.train.global_batch_size
    valid = validation_samples(run)
    # A weighted blend needs a size for every split; only what is read is drawn.
    weighted = config.blend is not None and config.blend[1] is not None
    sizes = [samples, valid, 0] if weighted else [samples, valid or None, None]
    bins = [Path(f"{prefix}.bin") for prefix in data_prefixes(run)]
    size = sum(b.stat().st_size for b in bins if b.exists())
    said = timed_line(f"indexing {{size}} of tokens ({len(bins)} file(s))", "indexed", size)
    train, validation, _ = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()
    said()
    return train, validation if valid else None


def micro_batch_indices(consumed: int, micro_batch_size: int, dp_rank: int) -> list[int]:
    """This DP rank's samples of the micro-batch step that starts at ``consumed``."""
    start = consumed + dp_rank * micro_batch_size
    return list(range(start, start + micro_batch_size))


class MicroBatchSampler:
    """Batch sampler yielding this rank's micro-batches from ``consumed`` samples on."""

    def __init__(
        self, total: int, consumed: int, micro_batch_size: int, dp_rank: int, dp_size: int
    ) -> None:
        self.total, self.consumed = total, consumed
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __iter__(self) -> Iterator[list[int]]:
        step = self.mbs * self.dp_size
        for consumed in range(self.consumed, self.total - step + 1, step):
            yield micro_batch_indices(consumed, self.mbs, self.dp_rank)

    def __len__(self) -> int:
        return (self.total - self.consumed) // (self.mbs * self.dp_size)


def build_data_iterator(
    run: RunConfig,
    dataset,
    consumed_samples: int,
    dp_rank: int,
    dp_size: int,
    workers: int | None = None,
) -> Iterator[dict]:
    """This rank's micro-batches of ``dataset`` from ``consumed_samples`` on (``workers``
    loader processes: dataset.num_workers unless given)."""
    import torch

    workers = run.dataset.num_workers if workers is None else workers
    sampler = MicroBatchSampler(
        len(dataset), consumed_samples, run.train.micro_batch_size, dp_rank, dp_size
    )
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=workers > 0,
    )
    return iter(loader)
