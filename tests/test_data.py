"""The data path on the CPU: Megatron-Core's mock dataset, and an indexed dataset made here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose_run

from offload_runner.mcore.data import build_data_iterator, build_datasets


def write_indexed_dataset(prefix: Path, documents: int = 120, vocab: int = 4000) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    rng = np.random.default_rng(0)
    for _ in range(documents):
        tokens = rng.integers(0, vocab, size=int(rng.integers(50, 400)), dtype=np.int32)
        builder.add_item(torch.from_numpy(tokens))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


@pytest.mark.filterwarnings("ignore")
def test_indexed_dataset_feeds_micro_batches(tmp_path: Path) -> None:
    prefix = tmp_path / "corpus_text_document"
    write_indexed_dataset(prefix)
    run = compose_run(
        "recipe=tiny",
        "data=indexed",
        f"dataset.data_path=[{prefix}]",
        "dataset.num_workers=0",
        "train.train_iters=3",
    )
    dataset = build_datasets(run)[0]
    assert len(dataset) >= run.train.train_iters * run.train.global_batch_size
    batch = next(build_data_iterator(run, dataset, 0, dp_rank=0, dp_size=1))
    assert batch["tokens"].shape == (run.train.micro_batch_size, run.model.seq_length)
    assert int(batch["tokens"].max()) < run.model.vocab_size
    # labels are the tokens shifted by one
    assert torch.equal(batch["labels"][0, :-1], batch["tokens"][0, 1:])


@pytest.mark.filterwarnings("ignore")
def test_indexing_a_large_corpus_is_said_with_its_size(tmp_path: Path, monkeypatch, capsys):
    """Over progress.SAY_GB of .bin files, rank 0 says the indexing before and after."""
    from offload_runner import progress

    prefix = tmp_path / "corpus_text_document"
    write_indexed_dataset(prefix)
    run = compose_run("recipe=tiny", "data=indexed", f"dataset.data_path=[{prefix}]")
    monkeypatch.setattr(progress, "SAY_GB", 1e-6)
    monkeypatch.setenv("RANK", "0")
    build_datasets(run)
    said = [ln for ln in capsys.readouterr().out.splitlines() if "index" in ln]
    gb = Path(f"{prefix}.bin").stat().st_size / 1e9
    assert said[0] == f"indexing {gb:.1f} GB of tokens (1 file(s)) ..."
    assert said[1].startswith("  ... indexed in ")


@pytest.mark.filterwarnings("ignore")
def test_blend_of_two_prefixes(tmp_path: Path) -> None:
    for name in ("a", "b"):
        write_indexed_dataset(tmp_path / name, documents=60)
    run = compose_run(
        "recipe=tiny",
        "data=indexed",
        f"dataset.data_path=[0.7,{tmp_path / 'a'},0.3,{tmp_path / 'b'}]",
        "train.train_iters=2",
    )
    assert len(build_datasets(run)[0]) >= 2 * run.train.global_batch_size


@pytest.mark.filterwarnings("ignore")
def test_mock_dataset_is_deterministic() -> None:
    run = compose_run("recipe=tiny", "train.train_iters=2")
    first = build_datasets(run)[0][3]["tokens"]
    assert torch.equal(first, build_datasets(run)[0][3]["tokens"])
