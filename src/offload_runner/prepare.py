"""Text into Megatron's indexed dataset, for ``data=indexed``:

    python run_recipe.py --prepare TEXT... --output PREFIX [--tokenizer PATH | --vocab-size N]

TEXT is ``.txt`` files, ``.jsonl`` files (a ``text`` field a line) or folders of them. Each text
is cut at paragraph ends into documents of about ``--chunk-kb`` KB (a few long books must still
give every split documents; Megatron-Core loops forever on an empty split), and each document
ends with the tokenizer's end-of-document token. The tokenizer is a local file's (``--tokenizer``:
a Hugging Face ``tokenizer.json`` or BPE folder, a SentencePiece ``.model``, a tiktoken file; see
tokenizer.py) or a byte-level BPE trained on the input with HF ``tokenizers`` (``--vocab-size``).
Written: ``PREFIX.bin`` and ``PREFIX.idx`` (Megatron-Core's IndexedDatasetBuilder), the tokenizer
beside them (``PREFIX.tokenizer.json``, ``.tokenizer.model`` or ``.tiktoken``) and ``PREFIX.json``
(vocab size, EOD id, counts, each input's sha256), which training reads for the vocabulary and
EOD. Bad input is refused before anything is written.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from offload_runner import chat
from offload_runner.rundir import writable
from offload_runner.tokenizer import TextTokenizer, TokenizerError
from offload_runner.tokenizer import load as load_tokenizer
from offload_runner.tokenizer import train as train_tokenizer

MIN_CHUNK_KB = 0.1  # a document of ~100 characters; below a character the cutting never ends
MIN_DOCUMENTS = 100  # so the 1% validation split of dataset.split=99,1,0 holds a document
TEXT_SUFFIXES = (".txt", ".jsonl")


class PrepareError(ValueError):
    """Input --prepare refuses: ``str(err)`` says what, ``fix`` how."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


@dataclass
class PrepareArgs:
    inputs: list[Path]
    output: Path
    tokenizer: Path | None = None
    vocab_size: int = 8192  # of a tokenizer trained on the input
    chunk_kb: float = 8.0
    sources: list[Path] = field(default_factory=list)  # the files, once collected


def metadata_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.json")


METADATA_KEYS = ("vocab_size", "eod_id")  # what training reads of it


def read_metadata(prefix: str | Path) -> dict | None:
    """What --prepare wrote beside a prefix (None: not prepared here, or the file there is not
    --prepare's: ``foreign_metadata`` names it)."""
    path = metadata_path(prefix)
    try:
        found = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None
    ours = isinstance(found, dict) and all(type(found.get(k)) is int for k in METADATA_KEYS)
    return found if ours else None


def foreign_metadata(prefix: str | Path) -> Path | None:
    """PREFIX.json where it is there but not --prepare's metadata."""
    path = metadata_path(prefix)
    return path if path.is_file() and read_metadata(prefix) is None else None


def collect(inputs: list[Path]) -> list[Path]:
    """The text files named, folders searched for TEXT_SUFFIXES, in a stable order."""
    found = []
    for path in inputs:
        if path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES)
        elif path.is_file():
            found.append(path)
        else:
            raise PrepareError(f"--prepare: {path} does not exist", "name text files or folders")
    if not found:
        raise PrepareError(
            f"--prepare: no .txt or .jsonl file in {', '.join(map(str, inputs))}",
            "name .txt / .jsonl files, or folders holding them",
        )
    return found


BINARY_SNIFF = 8000  # bytes read for a NUL, as git does


def texts(path: Path) -> Iterator[str]:
    """A file's texts: the whole of a .txt, each line's ``text`` of a .jsonl."""
    if path.suffix != ".jsonl":
        data = path.read_bytes()
        if b"\0" in data[:BINARY_SNIFF]:  # git's test for a binary file
            raise PrepareError(
                f"--prepare: {path} is not text (it holds NUL bytes)",
                "name text files (.txt in UTF-8, or .jsonl)",
            )
        yield data.decode("utf-8", errors="replace")
        return
    try:
        lines = chat.utf8_lines(path)
    except chat.ChatError as err:
        raise PrepareError(str(err), err.fix) from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
            if not isinstance(text, str):
                raise TypeError(text)
            yield text
        except (json.JSONDecodeError, KeyError, TypeError):
            raise PrepareError(
                f"--prepare: {path}:{number} is not a JSON object with a text field",
                'write one {"text": "..."} object a line',
            ) from None


def chunks(text: str, size: int) -> Iterator[str]:
    """``text`` in pieces of about ``size`` characters, each cut after the last paragraph or
    sentence end before ``size`` (else the first after it, else at ``size``)."""
    text = text.strip()
    while len(text) > size:
        cut = _last_break(text[:size], size // 2)
        if cut < 0:
            after = _last_break(text[: 2 * size], size)
            cut = after if after > 0 else size
        yield text[:cut].strip()
        text = text[cut:].strip()
    if text:
        yield text


def _last_break(window: str, start: int) -> int:
    """The position after the last paragraph or sentence end in ``window`` past ``start``
    (-1: none)."""
    ends = [m.end() for m in re.finditer(r"\n\s*\n|[.!?][\"')\]]?\s", window[start:])]
    return start + ends[-1] if ends else -1


def file_documents(path: Path, chunk_kb: float) -> Iterator[str]:
    """One file's documents: each of its texts in pieces of about ``chunk_kb`` KB."""
    for text in texts(path):
        yield from chunks(text, int(chunk_kb * 1024))


def documents(args: PrepareArgs) -> Iterator[str]:
    for path in args.sources:
        yield from file_documents(path, args.chunk_kb)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- writing ------------------------------------------------------------------------------------


def check(args: PrepareArgs) -> int:
    """Collect the inputs (unless done) and count their documents; refuse what cannot make a
    dataset."""
    check_output(args)
    args.sources = args.sources or collect(args.inputs)
    count = sum(1 for _ in documents(args))
    if not count:
        raise PrepareError("--prepare: the input holds no text", "name files that hold text")
    if count < MIN_DOCUMENTS:
        smaller = max(0.5, args.chunk_kb * count / MIN_DOCUMENTS / 2)
        raise PrepareError(
            f"--prepare: {count} documents of about {args.chunk_kb:g} KB are too few for a "
            f"validation split (at least {MIN_DOCUMENTS})",
            f"add text, or cut smaller documents: --chunk-kb {smaller:.1f}",
        )
    return count


def prepare(args: PrepareArgs, on_bytes: Callable[[int], None] = lambda n: None) -> dict:
    """Write PREFIX.bin/.idx/.tokenizer.json/.json; returns the metadata. Raises PrepareError
    before writing anything."""
    args.sources = args.sources or collect(args.inputs)
    if any(map(chat.is_chat, args.sources)):
        return prepare_chat(args, on_bytes)
    count = check(args)
    import numpy
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    tokenizer = the_tokenizer(args)
    eod, vocab = tokenizer.eod, tokenizer.vocab_size
    args.output.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(f"{args.output}.partial")
    builder = IndexedDatasetBuilder(f"{partial}.bin", dtype=DType.optimal_dtype(vocab))
    tokens = 0
    for path in args.sources:
        pieces = list(file_documents(path, args.chunk_kb))
        for encoded in tokenizer.encode(pieces):
            ids = [*encoded, eod]
            builder.add_document(numpy.array(ids, dtype=numpy.int64), [len(ids)])
            tokens += len(ids)
        on_bytes(path.stat().st_size)
    builder.finalize(f"{partial}.idx")
    for suffix in (".bin", ".idx"):
        Path(f"{partial}{suffix}").replace(f"{args.output}{suffix}")
    meta = {
        "tokenizer": tokenizer.save(args.output),
        "tokenizer_kind": tokenizer.kind,
        "tokenizer_trained": args.tokenizer is None,
        **({"tokenizer_encoding": tokenizer.name} if tokenizer.name else {}),
        "vocab_size": vocab,
        "eod_id": eod,
        "documents": count,
        "tokens": tokens,
        "chunk_kb": args.chunk_kb,
        "sources": [{"path": str(p), "sha256": sha256(p)} for p in args.sources],
    }
    metadata_path(args.output).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def mask_prefix(prefix: str | Path) -> str:
    """Where chat data's loss mask lies beside its tokens (an indexed dataset of 0/1)."""
    return f"{prefix}.mask"


def prepare_chat(args: PrepareArgs, on_bytes: Callable[[int], None]) -> dict:
    """Conversations -> tokens (PREFIX.bin/.idx), their loss mask (PREFIX.mask.bin/.idx), the
    tokenizer folder (PREFIX.tokenizer/) and PREFIX.json. Everything is read and checked before
    anything is written."""
    import numpy
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    check_output(args)
    encoded, tokenizer = _encoded_chats(args)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(f"{args.output}.partial")
    tokens = IndexedDatasetBuilder(
        f"{partial}.bin", dtype=DType.optimal_dtype(tokenizer.vocab_size)
    )
    masks = IndexedDatasetBuilder(f"{partial}.mask.bin", dtype=numpy.uint8)
    for ids, mask in encoded:
        tokens.add_document(numpy.array(ids, dtype=numpy.int64), [len(ids)])
        masks.add_document(numpy.array(mask, dtype=numpy.uint8), [len(mask)])
    tokens.finalize(f"{partial}.idx")
    masks.finalize(f"{partial}.mask.idx")
    for suffix in (".bin", ".idx", ".mask.bin", ".mask.idx"):
        Path(f"{partial}{suffix}").replace(f"{args.output}{suffix}")
    folder = Path(f"{args.output}.tokenizer")
    tokenizer.hf.save_pretrained(folder)
    lengths = [len(ids) for ids, _ in encoded]
    meta = {
        "chat": True,
        "tokenizer": str(folder),
        "tokenizer_kind": "huggingface",
        "tokenizer_trained": False,
        "vocab_size": tokenizer.vocab_size,
        "eod_id": tokenizer.pad,  # pads a conversation to the sequence length (masked)
        "end_of_turn_ids": sorted(tokenizer.end_of_turn),
        "documents": len(encoded),
        "tokens": sum(lengths),
        "trained_tokens": sum(sum(m) for _, m in encoded),
        "longest": max(lengths),
        "sources": [{"path": str(p), "sha256": sha256(p)} for p in args.sources],
    }
    metadata_path(args.output).write_text(json.dumps(meta, indent=1) + "\n")
    on_bytes(sum(p.stat().st_size for p in args.sources))
    return meta


def check_output(args: PrepareArgs) -> None:
    """A prefix (not a folder) in a folder that exists or can be made, and can be written."""

    if args.output.is_dir() or not args.output.name:
        raise PrepareError(
            f"--output {args.output} is a folder",
            "give a prefix: --output data/sotu (writes data/sotu.bin, ...)",
        )
    folder = args.output.resolve().parent
    if not writable(folder):
        raise PrepareError(
            f"--prepare: {folder} can not be written here", "name an --output you can write"
        )


def _encoded_chats(args: PrepareArgs) -> tuple[list, chat.ChatTokenizer]:
    """Every conversation's tokens and mask, or the PrepareError that refuses the input."""
    plain = [p for p in args.sources if not chat.is_chat(p)]
    if plain:
        raise PrepareError(
            f"--prepare: {plain[0]} is plain text beside chat data",
            "prepare chat and plain text separately (data=sft and data=indexed)",
        )
    if args.tokenizer is None:
        raise PrepareError(
            "--prepare: chat data needs --tokenizer HF_DIR (its chat template renders it)",
            "--tokenizer the model's Hugging Face folder (an --import-hf output's hf/ has it)",
        )
    try:
        tokenizer = chat.ChatTokenizer.load(args.tokenizer)
        encoded = [
            tokenizer.encode(messages, f"{path}:{n}")
            for path in args.sources
            for n, messages in enumerate(chat.conversations(path), start=1)
        ]
    except chat.ChatError as err:
        raise PrepareError(str(err), err.fix) from None
    if len(encoded) < MIN_DOCUMENTS:
        raise PrepareError(
            f"--prepare: {len(encoded)} conversations are too few for a validation split "
            f"(at least {MIN_DOCUMENTS})",
            "add conversations",
        )
    return encoded, tokenizer


def the_tokenizer(args: PrepareArgs) -> TextTokenizer:
    """The file's tokenizer, or one trained on the documents; refusals as PrepareError."""
    try:
        if args.tokenizer is not None:
            return load_tokenizer(args.tokenizer)
        return train_tokenizer(lambda: documents(args), args.vocab_size)
    except TokenizerError as err:
        raise PrepareError(str(err), err.fix) from None


class Parser:
    """--prepare's arguments (argparse), its mistakes raised as PrepareError."""

    @staticmethod
    def parse(argv: list[str]) -> PrepareArgs:
        import argparse

        class Parser(argparse.ArgumentParser):
            def error(self, message: str):  # noqa: ANN201 - argparse's hook
                raise PrepareError(f"--prepare: {message}", USAGE)

        parser = Parser(prog="run_recipe.py --prepare", add_help=False)
        parser.add_argument("inputs", nargs="+", type=Path)
        parser.add_argument("--output", required=True, type=Path)
        parser.add_argument("--tokenizer", type=Path)
        parser.add_argument("--vocab-size", type=int, default=PrepareArgs.vocab_size)
        parser.add_argument("--chunk-kb", type=float, default=PrepareArgs.chunk_kb)
        ns = parser.parse_args(argv)
        if ns.tokenizer is not None and "--vocab-size" in argv:
            raise PrepareError(
                "--prepare: --tokenizer and --vocab-size exclude each other",
                "a file's tokenizer has its own vocabulary: drop --vocab-size",
            )
        if ns.vocab_size < 300 or not MIN_CHUNK_KB <= ns.chunk_kb < float("inf"):
            raise PrepareError(
                "--prepare: --vocab-size must be at least 300 (256 bytes and some "
                f"merges) and --chunk-kb a number of at least {MIN_CHUNK_KB}",
                USAGE,
            )
        return PrepareArgs(ns.inputs, ns.output, ns.tokenizer, ns.vocab_size, ns.chunk_kb)


USAGE = (
    "python run_recipe.py --prepare TEXT... --output PREFIX "
    "[--tokenizer PATH | --vocab-size N] [--chunk-kb KB]"
)
