"""``data=sft``: one conversation per sample, its loss on the answers only.

Each sample is one conversation of ``--prepare``'s chat output, cut to ``model.seq_length`` + 1
tokens or padded to it; the loss mask is the prepared one (answers and their end-of-turn
tokens), zero on padding. Conversations are padded, not packed: several in one sequence would
attend to each other unless the attention knew their boundaries (Megatron-Core's packed-sequence
path, ``PackedSeqParams`` in the THD layout, which the schedules and offload paths here do not
carry), so a short conversation costs its padding. Each epoch visits the split's conversations
in a new order drawn from ``dataset.random_seed``.
"""

from __future__ import annotations

import numpy
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_dataset import MegatronDataset


class ChatDocuments:
    """A chat prefix's tokens and loss mask, document by document."""

    def __init__(self, prefix: str) -> None:
        from offload_runner.prepare import mask_prefix

        self.tokens = IndexedDataset(prefix)
        self.mask = IndexedDataset(mask_prefix(prefix))

    def __len__(self) -> int:
        return len(self.tokens)


class SFTDataset(MegatronDataset):
    """Megatron-Core's mid-level dataset over ChatDocuments (the builder splits and blends it)."""

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: ChatDocuments) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config) -> ChatDocuments:
        return ChatDocuments(dataset_path)

    def __len__(self) -> int:
        return self.num_samples if self.num_samples is not None else len(self.indices)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        epoch, i = divmod(int(idx), len(self.indices))
        order = numpy.random.default_rng([self.config.random_seed, epoch]).permutation(
            len(self.indices)
        )
        document = int(self.indices[order[i]])
        length = self.config.sequence_length + 1
        ids = _padded(self.dataset.tokens.get(document)[:length], length, self._pad_id())
        mask = _padded(self.dataset.mask.get(document)[:length], length, 0)
        return {
            "tokens": torch.from_numpy(ids[:-1]),
            "labels": torch.from_numpy(ids[1:]),
            "loss_mask": torch.from_numpy(mask[1:].astype(numpy.float32)),
            "position_ids": torch.arange(length - 1, dtype=torch.int64),
        }

    def _pad_id(self) -> int:
        return self.config.tokenizer.eod  # --prepare recorded the tokenizer's pad id as EOD


def _padded(values: numpy.ndarray, length: int, fill: int) -> numpy.ndarray:
    out = numpy.full(length, fill, dtype=numpy.int64)
    out[: len(values)] = values
    return out
