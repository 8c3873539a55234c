"""Hugging Face checkpoints in and out (offload_runner/hf): round trips, layouts, configs,
loading into Megatron-Core's model on the CPU, refusals. Checkpoints are built here with
transformers' own config classes and save_pretrained (no hub)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from offload_runner import checkpoint
from offload_runner.cli import main
from offload_runner.hf import convert
from offload_runner.hf.families import (
    FAMILIES,
    GATE_UP,
    QKV,
    HfError,
    hf_config,
    model_keys,
    tensor_rows,
)
from tests.conftest import CHAT_TOKENIZER

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}
# Odd sizes: a vocabulary Megatron pads (301 -> 384), head_dim not hidden / heads, GQA.
COMMON = dict(
    vocab_size=301,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=12,
    max_position_embeddings=16384,
)
CONFIGS = {
    "qwen3_moe-fp32-untied": (
        "Qwen3MoeConfig",
        dict(COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
        | dict(norm_topk_prob=True),
        torch.float32,
    ),
    "qwen3-bf16-tied": ("Qwen3Config", dict(COMMON, tie_word_embeddings=True), torch.bfloat16),
    "llama-bf16-untied-rope-scaled": (
        "LlamaConfig",
        dict(COMMON, tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE),
        torch.bfloat16,
    ),
}


def save_hf(folder: Path, name: str, dtype: torch.dtype | None = None, **changes) -> Path:
    """A random model of one of CONFIGS (in its dtype, or ``dtype``; config keys changed as
    given), saved as transformers saves a published one."""
    config_class, kwargs, own_dtype = CONFIGS[name]
    config = getattr(transformers, config_class)(**(kwargs | changes))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype or own_dtype)
    with torch.no_grad():
        for p in model.parameters():  # norms start at 1: random, so a swap shows
            p.normal_(1.0, 0.2) if p.dim() == 1 else p.normal_(0.0, 0.05)
    model.save_pretrained(folder)
    return folder


def hf_tensors(folder: Path) -> dict:
    found = {}
    for file in folder.glob("*.safetensors"):
        found.update(safetensors_torch.load_file(file))
    return found


@pytest.fixture(scope="module", params=list(CONFIGS))
def imported(request, tmp_path_factory) -> tuple[str, Path, Path]:
    root = tmp_path_factory.mktemp(request.param)
    source = save_hf(root / "hf", request.param)
    convert.import_hf(source, root / "ckpt", None, lambda n, total: None)
    return request.param, source, root / "ckpt"


def test_hf_import_then_export_gives_back_every_tensor_bit_for_bit(imported, tmp_path) -> None:
    name, source, ckpt = imported
    convert.export_hf(ckpt, tmp_path / "out", lambda n, total: None)
    before, after = hf_tensors(source), hf_tensors(tmp_path / "out")
    assert set(after) == set(before)
    for key, tensor in before.items():
        assert after[key].dtype == tensor.dtype, key
        assert torch.equal(after[key], tensor), key
    index = json.loads((tmp_path / "out" / convert.INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(before)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True
    )
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])


def test_hf_imported_weights_load_into_the_megatron_model_on_the_cpu(imported) -> None:
    """checkpoint.load_pretrained into GPTModel (local spec, SequentialMLP): no missing or
    unexpected key, and each parameter is its HF tensors joined."""
    name, source, ckpt = imported
    arch = checkpoint.saved_architecture(ckpt)
    run = convert.single_run(arch)
    hf = hf_tensors(source)
    with convert.single_process():
        model = convert.meta_model(run, device="cpu")
        checkpoint.load_pretrained(ckpt, [model])
        state = model.state_dict()
    family = FAMILIES[json.loads((source / "config.json").read_text())["model_type"]]
    rows = tensor_rows(
        family,
        arch["num_layers"],
        arch["num_moe_experts"] or 0,
        arch["share_embeddings_and_output_weights"],
    )
    shapes = convert.Shapes.of(run.model)
    for megatron, hf_names, how in rows:
        want = convert.join(how, [hf[n] for n in hf_names], shapes)
        assert torch.equal(state[megatron], want.to(state[megatron].dtype)), megatron
    assert state["embedding.word_embeddings.weight"].shape[0] == 384  # padded, zeros past 301
    assert not state["embedding.word_embeddings.weight"][301:].any()


def test_hf_qkv_and_gate_up_layouts_match_a_hand_built_example() -> None:
    """Two query groups of two heads, head_dim 1: Megatron's rows are, per group, its queries,
    its key, its value."""
    s = convert.Shapes(groups=2, heads=4, head_dim=1, vocab=4, padded_vocab=4)
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    fused = convert.join(QKV, [q, k, v], s)
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    assert all(
        torch.equal(a, b) for a, b in zip(convert.split(QKV, fused, s), [q, k, v], strict=True)
    )
    gate, up = torch.tensor([[1.0], [2.0]]), torch.tensor([[3.0], [4.0]])
    assert convert.join(GATE_UP, [gate, up], s).flatten().tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_config_json_to_model_keys_and_back(name, tmp_path) -> None:
    source = save_hf(tmp_path, name)
    original = transformers.AutoConfig.from_pretrained(source)
    keys = model_keys(original)
    assert keys["kv_channels"] == 12 and keys["num_query_groups"] == 2
    assert keys["rope_scaling"] == (name.startswith("llama"))
    run = convert.single_run(keys)
    back = hf_config(FAMILIES[original.model_type], run.model, "bfloat16")
    for attr in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "tie_word_embeddings",
        "rope_parameters",
        "max_position_embeddings",
    ):
        assert getattr(back, attr) == getattr(original, attr), attr
    if original.model_type == "qwen3_moe":
        for attr in (
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "norm_topk_prob",
        ):
            assert getattr(back, attr) == getattr(original, attr), attr


def test_hf_import_writes_a_recipe_that_starts_from_it(imported) -> None:
    _, _, ckpt = imported
    assert checkpoint.weights_only(ckpt)
    recipe = (ckpt / "recipe.yaml").read_text()
    assert f'"pretrained_checkpoint": "{ckpt.resolve()}"' in recipe
    assert (ckpt / checkpoint.HF_FILES_DIR / "config.json").is_file()


def _edited(source: Path, tmp_path: Path, **changes) -> Path:
    folder = tmp_path / "edited"
    folder.mkdir()
    for file in source.iterdir():
        (folder / file.name).symlink_to(file)
    config = json.loads((source / "config.json").read_text()) | changes
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "changes, said",
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "not a family"),
        ({"hidden_size": 64}, "do not make the model's"),
        ({"num_hidden_layers": 3, "layer_types": ["full_attention"] * 3}, "are not in"),
        ({"num_hidden_layers": 3}, "layer_types"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type"),
    ],
)
def test_hf_import_refuses_what_it_cannot_map(changes, said, tmp_path) -> None:
    source = save_hf(tmp_path / "hf", "qwen3-bf16-tied")
    with pytest.raises(HfError, match=said):
        convert.import_hf(_edited(source, tmp_path, **changes), tmp_path / "out", None, print)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_hf_cli_refusals_are_one_line_and_exit_2(tmp_path, capfd) -> None:
    source = save_hf(tmp_path / "hf", "qwen3-bf16-tied")
    broken = _edited(source, tmp_path)
    (broken / convert.INDEX_FILE).write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep")
    new = str(tmp_path / "new")
    cases = [
        (["--import-hf", str(broken), "--output", new], "gone.safetensors"),
        (["--import-hf", str(tmp_path), "--output", new], "no config.json"),
        (["--export-hf", str(tmp_path), "--output", new], "holds no checkpoint"),
        (["--import-hf", str(source)], "--output"),
        (["--import-hf", str(source), "--output", str(taken)], "not an empty folder"),
    ]
    for args, said in cases:
        assert main(args) == 2, args
        err = capfd.readouterr().err
        assert said in err and err.count("error:") == 1, err
    assert (taken / "mine.txt").read_text() == "keep" and not Path(new).exists()


def test_hf_checkpoint_rules_refuse_a_wrong_start(imported, tmp_path) -> None:
    """A weights-only checkpoint is no resume; a pretrained folder must hold a checkpoint of
    this model's shapes."""
    from offload_runner.validation import Environment, errors, validate
    from tests.conftest import compose_run

    _, _, ckpt = imported

    def broken(*overrides: str) -> set[str]:
        run = compose_run("recipe=tiny", *overrides)
        return {v.rule for v in errors(validate(run, Environment(te_available=True)))}

    assert "load_weights_only" in broken(f"checkpoint.load={ckpt}")
    assert "pretrained_checkpoint_missing" in broken(f"checkpoint.pretrained_checkpoint={tmp_path}")
    assert "pretrained_architecture_differs" in broken(f"checkpoint.pretrained_checkpoint={ckpt}")
    arch = checkpoint.saved_architecture(ckpt)
    same = [f"model.{k}={v}" for k, v in arch.items() if v is not None]
    assert not broken(f"checkpoint.pretrained_checkpoint={ckpt}", *same, "speed=plain")


def readme_section_commands() -> list[list[str]]:
    import re
    import shlex

    from tests.conftest import PROJECT_ROOT

    text = (PROJECT_ROOT / "README.md").read_text()
    section = text.split("## Fine-tune a Hugging Face checkpoint", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    lines = block.replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True)[2:] for line in lines if line.startswith("python")]


def test_hf_readme_commands_run_on_the_cpu(tmp_path, monkeypatch) -> None:
    """README's fine-tuning section as printed, on a tiny Qwen3-MoE in its place: import,
    prepare, the fine-tune as a dry run, export (of the import: no GPU trained it here)."""
    from tests.conftest import CHAT_SAMPLE

    import_, prepare, finetune, export = readme_section_commands()
    save_hf(tmp_path / import_[1], "qwen3_moe-fp32-untied", vocab_size=4096)  # the tokenizer's
    (tmp_path / "chat.jsonl").write_bytes(CHAT_SAMPLE.read_bytes())
    tokenizer = tmp_path / import_[1] / "tokenizer.json"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / import_[1] / name).write_bytes((CHAT_TOKENIZER / name).read_bytes())
    assert tokenizer.is_file()
    export = [a.replace("ckpt/tuned", "ckpt/qwen3") for a in export]
    monkeypatch.chdir(tmp_path)
    for args in (import_, prepare, [*finetune, "--dry-run"], export):
        assert main(args) == 0, args
    exported = tmp_path / export[3]
    assert (exported / "tokenizer_config.json").is_file()
    assert json.loads((exported / "config.json").read_text())["model_type"] == "qwen3_moe"


def test_hf_import_refuses_a_recipe_of_other_shapes(tmp_path) -> None:
    source = save_hf(tmp_path / "hf", "qwen3-bf16-tied")
    with pytest.raises(HfError, match="does not match recipe tiny: num_layers=2 \\(recipe 4\\)"):
        convert.import_hf(source, tmp_path / "out", "tiny", print)
    assert not (tmp_path / "out").exists()
