"""Megatron-Bridge's own recipe assignments, pasted as command-line overrides.

tests/data/bridge_recipe_keys.json holds every ``cfg.section.key = value`` of Megatron-Bridge
0.6.2's GPT and MoE pretraining recipes, with the values they use (tools/bridge_recipe_keys.py
reads them from its wheel). "Accepted" means the config layer takes the line: the CLI's
translation, Hydra composition, the schema's keys and types, value ranges and Megatron-Core's
Literal choices. Whether a value fits the rest of a run (TP 8 with 4 query groups, say) is the
validation table's business and is tested there.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from offload_runner.cli import UsageError, split_argv
from offload_runner.config.compose import compose_config, schema_keys, to_run_config, unknown_keys
from offload_runner.validation import choice_violations, value_violations

DATA = Path(__file__).parent / "data" / "bridge_recipe_keys.json"
ASSIGNMENTS = json.loads(DATA.read_text())["assignments"]

# What is refused, and why. A key here that Megatron-Core 0.19 has is refused only under 0.16.
REFUSED = {
    "model.apply_dsa_kernel_fusion": "DeepSeek sparse attention: not a field of this megatron-core",
    "model.dsa_kernel_backend": "DeepSeek sparse attention: not a field of this megatron-core",
    "model.use_fused_mhc": "not a field of this megatron-core",
    "model.high_priority_a2a_comm_stream": "not a field of this megatron-core",
    "model.moe_a2a_overlap": "a Megatron-Bridge comm-overlap switch, not a model field",
    "model.moe_flex_dispatcher_num_sms": "not a field of this megatron-core",
    "model.mtp_eval_in_bf16": "not a field of this megatron-core",
    "model.rotary_scaling_factor": "YaRN/Llama-3.1 rope scaling of Megatron-Bridge's providers",
    "model.quant_recipe": "a Python object (quantization recipe)",
    "tokenizer.rank": "DeepSeek-V4 tokenizer internals",
    "tokenizer.tensor_model_parallel_size": "DeepSeek-V4 tokenizer internals",
}


def override(key: str, value: object) -> str:
    """A Python value as Hydra's override grammar writes it."""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = str(value).lower()
    elif isinstance(value, list):
        text = "[" + ",".join(override("_", v).partition("=")[2] for v in value) + "]"
    elif isinstance(value, str) and "," in value:
        text = f"'{value}'"
    else:
        text = str(value)
    return f"{key}={text}"


def accepted(key: str, value: object, literal: bool) -> bool:
    if not literal:  # the recipe computes it: the key must exist
        return key in schema_keys() or key == "mixed_precision"
    try:
        _, hydra_args = split_argv([override(key, value)])
        cfg = compose_config(["recipe=tiny", *hydra_args])
        if unknown_keys(cfg):
            return False
        run = to_run_config(cfg)
    except (UsageError, OmegaConfBaseException, HydraException, ValueError):
        return False
    return not value_violations(run)


@pytest.fixture(scope="module")
def outcome() -> dict[tuple[str, str], bool]:
    return {
        (a["key"], json.dumps(a["value"])): accepted(a["key"], a["value"], a["literal"])
        for a in ASSIGNMENTS
    }


def test_at_least_95_percent_of_bridge_recipe_assignments_are_accepted(outcome) -> None:
    share = sum(outcome.values()) / len(outcome)
    refused = sorted(f"{k}={v}" for (k, v), ok in outcome.items() if not ok)
    assert len(outcome) > 200  # the fixture is the real list, not a sample
    assert share >= 0.95, f"{share:.1%} accepted; refused: {refused}"


def test_every_refused_key_has_a_reason(outcome) -> None:
    refused = {key for (key, _), ok in outcome.items() if not ok}
    unexplained = refused - set(REFUSED) - {"mixed_precision"}
    assert not unexplained, f"refused without a listed reason: {sorted(unexplained)}"


def test_the_keys_the_issue_named_are_accepted() -> None:
    for line in (
        "ddp.use_distributed_optimizer=true",
        "model.recompute_modules=[moe_act]",
        "model.virtual_pipeline_model_parallel_size=2",
        "model.cross_entropy_loss_fusion=true",
        "model.attention_backend=flash",
        "optimizer.main_params_dtype=fp32",
        "optimizer.exp_avg_dtype=bf16",
        "optimizer.exp_avg_sq_dtype=bf16",
        "rng.seed=7",
        "dataset.seq_length=256",
        "train.manual_gc=true",
        "checkpoint.ckpt_format=torch_dist",
        "scheduler.start_weight_decay=0.033",
        "logger.tensorboard_dir=/tmp/tb",
        "mixed_precision=bf16_mixed",
    ):
        key, _, value = line.partition("=")
        assert accepted(key, value, True), line


def test_a_misspelt_megatron_core_field_is_refused_with_the_closest_key() -> None:
    with pytest.raises(UsageError, match="did you mean model.apply_rope_fusion"):
        split_argv(["model.apply_rope_fusions=true"])


def test_a_literal_field_outside_its_choices_is_refused() -> None:
    run = to_run_config(compose_config(["recipe=tiny", "model.cross_entropy_fusion_impl=fast"]))
    (violation,) = choice_violations(run)
    assert "model.cross_entropy_fusion_impl=fast" in violation.message
    assert "native, te" in violation.message
