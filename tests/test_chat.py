"""Chat data (chat.py, --prepare, data=sft): tokens and loss masks, samples, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from offload_runner.chat import ChatTokenizer, conversations
from offload_runner.cli import main
from tests.conftest import CHAT_SAMPLE, CHAT_TOKENIZER, compose_run

pytest.importorskip("transformers")


def answer_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs, current = [], []
    for token, trained in zip(ids, mask, strict=True):
        if trained:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_hf_chat_mask_trains_exactly_the_answers_and_their_end_of_turn() -> None:
    tokenizer = ChatTokenizer.load(CHAT_TOKENIZER)
    checked = 0
    for messages in list(conversations(CHAT_SAMPLE))[:40]:
        ids, mask = tokenizer.encode(messages, "sample")
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        runs = answer_runs(ids, mask)
        assert [tokenizer.hf.decode(r) for r in runs] == [a + "<|im_end|>" for a in answers]
        checked += len(runs)
    assert checked > 40


def test_hf_chat_prompt_response_lines_and_a_system_message(tmp_path: Path) -> None:
    tokenizer = ChatTokenizer.load(CHAT_TOKENIZER)
    line = {"system": "Be brief.", "prompt": "Say yes.", "response": "Yes."}
    (tmp_path / "pr.jsonl").write_text(json.dumps(line) + "\n")
    (messages,) = conversations(tmp_path / "pr.jsonl")
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    ids, mask = tokenizer.encode(messages, "pr")
    assert tokenizer.hf.decode([t for t, m in zip(ids, mask, strict=True) if m]) == "Yes.<|im_end|>"


def test_hf_chat_prepare_writes_tokens_mask_and_metadata(chat_prepared: Path) -> None:
    meta = json.loads(Path(f"{chat_prepared}.json").read_text())
    assert meta["chat"] and meta["documents"] == 152 and meta["vocab_size"] == 4096
    assert 0 < meta["trained_tokens"] < meta["tokens"]
    for suffix in (".bin", ".idx", ".mask.bin", ".mask.idx"):
        assert Path(f"{chat_prepared}{suffix}").is_file()
    assert (Path(f"{chat_prepared}.tokenizer") / "tokenizer.json").is_file()


def test_hf_sft_samples_pad_cut_and_mask_the_labels(chat_prepared: Path) -> None:
    from offload_runner.mcore.data import build_datasets

    run = compose_run(
        "recipe=tiny",
        "data=sft",
        f"dataset.data_path=[{chat_prepared}]",
        "model.seq_length=512",
        "train.train_iters=100",
    )
    train, validation = build_datasets(run)
    assert validation is not None and len(train) == 100 * run.train.global_batch_size
    tokenizer = ChatTokenizer.load(CHAT_TOKENIZER)
    seen_padding, ended = False, 0
    for i in range(60):
        sample = train[i]
        assert sample["tokens"].shape == (512,) and sample["labels"].shape == (512,)
        assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
        trained = sample["labels"][sample["loss_mask"] > 0].tolist()
        ended += tokenizer.hf.decode(trained).endswith("<|im_end|>")  # else cut at 512
        pad = sample["labels"] == tokenizer.pad
        seen_padding |= bool(pad.any())
        assert not sample["loss_mask"][pad].any()
    assert 20 <= ended < 60  # most end inside 512 tokens, some are cut
    assert seen_padding


@pytest.mark.parametrize(
    "content, said",
    [
        (b"\xff\xfe not utf-8\n", "not UTF-8"),
        (b'{"messages": [{"role": "user", "content": 3}]}\n', "not a conversation"),
        (b'{"messages": [{"role": "user", "content": "hi"}]}\n', "no assistant answer"),
    ],
)
def test_hf_chat_prepare_refuses_bad_chat_data(
    content: bytes, said: str, tmp_path: Path, capfd
) -> None:
    bad = tmp_path / "bad.jsonl"
    first = CHAT_SAMPLE.read_bytes().splitlines(keepends=True)[0]  # makes the file chat data
    bad.write_bytes(content if said == "not UTF-8" else first + content)
    args = ["--prepare", str(bad), "--output", str(tmp_path / "out")]
    assert main([*args, "--tokenizer", str(CHAT_TOKENIZER)]) == 2
    assert said in capfd.readouterr().err
    assert not list(tmp_path.glob("out*"))


def test_hf_chat_prepare_needs_a_tokenizer_with_a_chat_template(tmp_path: Path, capfd) -> None:
    plain = tmp_path / "plain_tokenizer"
    plain.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        config = (CHAT_TOKENIZER / name).read_text()
        (plain / name).write_text(config)
    cases = [
        ((), "needs --tokenizer"),
        (("--tokenizer", str(plain)), "has no chat template"),
    ]
    for extra, said in cases:
        assert main(["--prepare", str(CHAT_SAMPLE), "--output", str(tmp_path / "o"), *extra]) == 2
        assert said in capfd.readouterr().err
    assert not list(tmp_path.glob("o*"))


def test_hf_sft_rules_want_chat_data_for_sft_and_warn_on_indexed(
    chat_prepared: Path, prepared: Path
) -> None:
    from offload_runner.validation import Environment, validate

    def found(*overrides: str) -> dict[str, str]:
        run = compose_run("recipe=tiny", *overrides)
        return {v.rule: v.level.value for v in validate(run, Environment(te_available=True))}

    assert found("data=sft", f"dataset.data_path=[{prepared}]")["sft_needs_chat_data"] == "error"
    chat_indexed = found("data=indexed", f"dataset.data_path=[{chat_prepared}]")
    assert chat_indexed["chat_data_without_sft"] == "warning"
    assert "sft_needs_chat_data" not in found("data=sft", f"dataset.data_path=[{chat_prepared}]")
