"""Make the chat sample and the chat tokenizer the tests and the bench use (no hub is reachable):

    python tools/make_chat_data.py

tests/data/chat/sotu_chat.jsonl: conversations made from the public-domain State of the Union
sample (tests/data/sotu): the user gives a passage of an address, the assistant continues it; every
third conversation has a system message, every second a second turn ("Go on.").
tests/data/chat_tokenizer/: a 4,096-id byte-level BPE trained on the same text with ChatML's
special tokens and a ChatML chat template (as Qwen's, without generation markers), saved with
transformers' ``save_pretrained``. Both come out the same on every run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tests/data/sotu"
CHAT = ROOT / "tests/data/chat/sotu_chat.jsonl"
TOKENIZER = ROOT / "tests/data/chat_tokenizer"
SENTENCES_PER_PASSAGE = 3
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SYSTEM = "You continue historical speeches in their own style."


def passages(text: str) -> list[str]:
    sentences = re.split(r"(?<=[.!?])\s+", " ".join(text.split()))
    step = SENTENCES_PER_PASSAGE
    return [" ".join(sentences[i : i + step]) for i in range(0, len(sentences), step)]


def speaker(path: Path) -> str:
    year, *name = path.stem.split("_")[:-1]
    return f"the {year} State of the Union address of {' '.join(name).title()}"


def conversations() -> list[dict]:
    made = []
    for path in sorted(SOURCE.glob("*.txt")):
        parts = passages(path.read_text(encoding="utf-8"))
        for i in range(0, len(parts) - 2, 3):
            n = len(made)
            messages = [{"role": "system", "content": SYSTEM}] if n % 3 == 0 else []
            messages += [
                {"role": "user", "content": f"Continue {speaker(path)}:\n\n{parts[i]}"},
                {"role": "assistant", "content": parts[i + 1]},
            ]
            if n % 2 == 0:
                messages += [
                    {"role": "user", "content": "Go on."},
                    {"role": "assistant", "content": parts[i + 2]},
                ]
            made.append({"messages": messages})
    return made


def tokenizer() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [p.read_text(encoding="utf-8") for p in sorted(SOURCE.glob("*.txt"))]
    bpe.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML,
    )
    fast.save_pretrained(TOKENIZER)


if __name__ == "__main__":
    CHAT.parent.mkdir(parents=True, exist_ok=True)
    made = conversations()
    CHAT.write_text("".join(json.dumps(c) + "\n" for c in made), encoding="utf-8")
    tokenizer()
    print(f"{CHAT}: {len(made)} conversations, {CHAT.stat().st_size / 1e3:.0f} kB; {TOKENIZER}")
