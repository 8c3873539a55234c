"""Chat data for fine-tuning: conversations rendered with a Hugging Face tokenizer's chat template,
and a loss mask that trains the answers only.

A ``.jsonl`` line is ``{"messages": [{"role": ..., "content": ...}, ...]}`` or
``{"prompt": ..., "response": ...}`` (an optional ``"system"``). The whole conversation is rendered
once (transformers' ``apply_chat_template``) and tokenized with character offsets. Trained: each
assistant message's content, found in the rendered text in order, and the end-of-turn token that
follows it (the tokenizer's EOS and generation_config.json's end ids; only whitespace may stand
between). Everything else (system, user, role headers, the template's own text) is masked. Published
templates (Qwen3, Llama 3) carry no ``{% generation %}`` markers, so the boundary is found this way
for every template alike; a template that rewrites the content (so it cannot be found) is refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROLES = ("system", "user", "assistant", "tool")


class ChatError(ValueError):
    """Chat input or a tokenizer that cannot make it: ``str(err)`` says what, ``fix`` how."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


def is_chat(path: Path) -> bool:
    """A .jsonl whose first record holds ``messages`` or ``prompt`` (not ``text``)."""
    if path.suffix != ".jsonl":
        return False
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    first = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(first, dict) and ("messages" in first or "prompt" in first)
    return False


def utf8_lines(path: Path) -> list[str]:
    """A .jsonl file's lines; one that is not UTF-8 is refused (ChatError)."""
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise ChatError(
            f"--prepare: {path} is not UTF-8 text (byte {err.start})", "save it as UTF-8"
        ) from None


def conversations(path: Path) -> Iterator[list[dict]]:
    """Each line's messages, checked: roles known, contents strings, an answer to train."""
    for number, line in enumerate(utf8_lines(path), start=1):
        if line.strip():
            yield _messages(line, f"{path}:{number}")


def _messages(line: str, where: str) -> list[dict]:
    fix = (
        'write one {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", '
        '"content": "..."}]} or {"prompt": "...", "response": "..."} object a line'
    )
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        raise ChatError(f"--prepare: {where} is not JSON", fix) from None
    if isinstance(record, dict) and "prompt" in record:
        record = {"messages": _from_prompt(record)}
    messages = record.get("messages") if isinstance(record, dict) else None
    ok = isinstance(messages, list) and all(
        isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
        for m in messages
    )
    if not ok:
        raise ChatError(f"--prepare: {where} is not a conversation of {'/'.join(ROLES)}", fix)
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise ChatError(f"--prepare: {where} has no assistant answer to train on", fix)
    return messages


def _from_prompt(record: dict) -> list:
    system = [{"role": "system", "content": record["system"]}] if "system" in record else []
    turns = [("user", record.get("prompt")), ("assistant", record.get("response"))]
    return system + [{"role": role, "content": content} for role, content in turns]


@dataclass
class ChatTokenizer:
    """A Hugging Face tokenizer folder with a chat template."""

    hf: object  # transformers' PreTrainedTokenizerFast
    end_of_turn: frozenset[int]
    folder: Path

    @staticmethod
    def load(folder: Path) -> ChatTokenizer:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ChatError("chat data needs transformers", 'pip install -e ".[hf]"') from None
        if not (folder / "tokenizer_config.json").is_file():
            raise ChatError(
                f"--prepare: chat data needs a Hugging Face tokenizer folder, {folder} is not one",
                "--tokenizer HF_DIR (tokenizer.json and tokenizer_config.json, with a chat "
                "template: an --import-hf output's hf/ folder has them)",
            )
        hf = AutoTokenizer.from_pretrained(folder)
        if not getattr(hf, "chat_template", None):
            raise ChatError(
                f"--prepare: the tokenizer in {folder} has no chat template",
                "use the tokenizer of an instruct/chat model, or add a Jinja chat_template to "
                "its tokenizer_config.json",
            )
        return ChatTokenizer(hf, _end_of_turn(hf, folder), folder)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def pad(self) -> int:
        pad = self.hf.pad_token_id
        return pad if pad is not None else min(self.end_of_turn)

    def encode(self, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
        """Token ids of the rendered conversation and their loss mask (1: trained)."""
        text = self.hf.apply_chat_template(messages, tokenize=False)
        spans = _answer_spans(text, messages, where)
        found = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = found["input_ids"], found["offset_mapping"]
        mask = [int(any(s < b and e > a for a, b in spans)) for s, e in offsets]
        for a, b in spans:
            last = max((i for i, (s, e) in enumerate(offsets) if e <= b and e > a), default=None)
            if last is not None:
                self._end_of_answer(ids, offsets, text, last, mask)
        return ids, mask

    def _end_of_answer(self, ids, offsets, text: str, last: int, mask: list[int]) -> None:
        """Train the end-of-turn token after an answer (whitespace tokens may come first)."""
        for i in range(last + 1, len(ids)):
            if ids[i] in self.end_of_turn:
                mask[i] = 1
                return
            if text[offsets[i][0] : offsets[i][1]].strip():
                return


def _answer_spans(text: str, messages: list[dict], where: str) -> list[tuple[int, int]]:
    """Character spans of the assistant contents in the rendered text, found in order."""
    spans, cursor = [], 0
    for m in messages:
        content = m["content"].strip()
        if m["role"] != "assistant":  # passed over, so an answer is never found inside it
            found = text.find(content, cursor) if content else cursor
            cursor = found + len(content) if found >= 0 else cursor
            continue
        if not content:
            continue
        start = text.find(content, cursor)
        if start < 0:
            raise ChatError(
                f"--prepare: {where}: the chat template changes an answer's text, so its tokens "
                "cannot be found to train",
                "use a template that renders message contents as they are",
            )
        spans.append((start, start + len(content)))
        cursor = start + len(content)
    return spans


def _end_of_turn(hf, folder: Path) -> frozenset[int]:
    """The EOS id and generation_config.json's end ids (vLLM stops on the same)."""
    ids = {hf.eos_token_id} if hf.eos_token_id is not None else set()
    generation = folder / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if not ids:
        raise ChatError(
            f"--prepare: the tokenizer in {folder} names no end-of-turn (EOS) token",
            "set eos_token in its tokenizer_config.json",
        )
    return frozenset(ids)
