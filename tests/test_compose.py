"""Every recipe composes, alone and with every offload option; the keys land where they should."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from conftest import compose_run

from offload_runner.config.compose import (
    OFFLOAD_GROUPS,
    config_groups,
    group_options,
    normalize_recipe_name,
    recipe_paths,
)
from offload_runner.config.schema import ModelConfig, Normalization, RunConfig
from offload_runner.model_size import count_parameters

RECIPES = sorted(recipe_paths())
OFFLOAD_CHOICES = [f"{g}={o}" for g in OFFLOAD_GROUPS for o in group_options(g)]


def _layout(m: ModelConfig) -> tuple[int, int, int]:
    """(TP, PP, EP)."""
    return (
        m.tensor_model_parallel_size,
        m.pipeline_model_parallel_size,
        m.expert_model_parallel_size,
    )


def test_the_required_recipes_exist() -> None:
    assert {"qwen3_30b_a3b", "qwen3_30b_a3b_proxy", "llama3_8b", "tiny"} <= set(RECIPES)


@pytest.mark.parametrize(("recipe", "choice"), list(itertools.product(RECIPES, OFFLOAD_CHOICES)))
def test_every_recipe_composes_with_every_offload_option(recipe: str, choice: str) -> None:
    run = compose_run(f"recipe={recipe}", choice)
    assert isinstance(run, RunConfig)
    assert run.name == recipe


def test_qwen3_30b_a3b_matches_the_published_architecture() -> None:
    m = compose_run("recipe=qwen3_30b_a3b").model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.moe_ffn_hidden_size) == (
        48,
        2048,
        6144,
        768,
    )
    assert (m.num_moe_experts, m.moe_router_topk) == (128, 8)
    assert (m.num_attention_heads, m.num_query_groups, m.kv_channels) == (32, 4, 128)
    assert (m.vocab_size, m.seq_length, m.rotary_base) == (151936, 4096, 1e6)
    assert m.qk_layernorm and m.gated_linear_unit and not m.share_embeddings_and_output_weights
    assert m.normalization == Normalization.RMSNorm and m.layernorm_epsilon == 1e-6
    assert _layout(m) == (4, 2, 4)
    assert round(count_parameters(m).total / 1e9, 1) == 30.5


def test_proxy_keeps_the_widths_with_four_layers_on_one_gpu() -> None:
    full = compose_run("recipe=qwen3_30b_a3b").model
    proxy = compose_run("recipe=qwen3_30b_a3b_proxy").model
    assert proxy.num_layers == 4
    for key in ("hidden_size", "moe_ffn_hidden_size", "num_moe_experts", "num_query_groups"):
        assert getattr(proxy, key) == getattr(full, key)
    assert _layout(proxy) == (1, 1, 1)
    assert round(count_parameters(proxy).total / 1e9, 2) == 3.11


@pytest.mark.parametrize(
    ("choice", "fraction", "overlap"),
    [
        ("cpu_25", 0.25, False),
        ("cpu_50", 0.5, False),
        ("cpu_75", 0.75, False),
        ("cpu_100", 1.0, True),
    ],
)
def test_optimizer_cpu_options(choice: str, fraction: float, overlap: bool) -> None:
    o = compose_run("recipe=tiny", f"offload/optimizer={choice}").optimizer
    assert o.optimizer_cpu_offload and not o.offload_optimizer_states
    assert o.optimizer_offload_fraction == fraction
    assert o.overlap_cpu_optimizer_d2h_h2d is overlap
    assert o.use_precision_aware_optimizer  # follows optimizer_cpu_offload


@pytest.mark.parametrize(
    ("choice", "delayed", "scope"),
    [
        ("cpu_adam", False, "all"),
        ("cpu_adam_delayed", True, "all"),
        ("cpu_adam_delayed_experts", True, "experts"),
    ],
)
def test_cpu_adam_options(choice: str, delayed: bool, scope: str) -> None:
    o = compose_run("recipe=tiny", f"offload/optimizer={choice}").optimizer
    assert o.optimizer_cpu_offload and o.cpu_offload_engine.value == "cpu_adam"
    assert o.optimizer_offload_fraction == 1.0 and o.cpu_adam_delayed_update is delayed
    assert o.cpu_adam_delayed_scope.value == scope
    assert o.use_precision_aware_optimizer  # Megatron-Core's path without GPU fp32 masters
    # a Megatron-Bridge fraction key still applies, and other options reset the engine
    quarter = compose_run(
        "recipe=tiny", f"offload/optimizer={choice}", "optimizer.optimizer_offload_fraction=0.25"
    ).optimizer
    assert quarter.optimizer_offload_fraction == 0.25
    hybrid = compose_run("recipe=tiny", "offload/optimizer=cpu_50").optimizer
    assert hybrid.cpu_offload_engine.value == "hybrid"


def test_states_option() -> None:
    o = compose_run("recipe=tiny", "offload/optimizer=states").optimizer
    assert o.offload_optimizer_states and not o.optimizer_cpu_offload
    assert not o.use_precision_aware_optimizer


@pytest.mark.parametrize(
    ("choices", "activations", "weights"),
    [
        ((), False, False),
        (("offload/activation=enabled",), True, False),
        (("offload/weight=enabled",), False, True),
        (("offload/weight=enabled", "offload/activation=enabled"), True, True),
        (("offload/activation=enabled", "offload/weight=enabled"), True, True),
    ],
)
def test_activation_and_weight_groups_compose(choices, activations, weights) -> None:
    m = compose_run("recipe=tiny", *choices).model
    assert m.cpu_offloading is (activations or weights)
    if m.cpu_offloading:
        assert (m.cpu_offloading_activations, m.cpu_offloading_weights) == (activations, weights)
        assert m.cpu_offloading_num_layers >= 1


def test_bridge_style_keys_keep_megatron_defaults() -> None:
    """model.cpu_offloading=True alone offloads activations, as in Megatron-Bridge."""
    m = compose_run(
        "recipe=tiny", "model.cpu_offloading=True", "model.cpu_offloading_num_layers=2"
    ).model
    assert m.cpu_offloading and m.cpu_offloading_activations and not m.cpu_offloading_weights
    o = compose_run(
        "recipe=tiny",
        "optimizer.optimizer_cpu_offload=True",
        "optimizer.optimizer_offload_fraction=0.5",
    ).optimizer
    assert o.use_precision_aware_optimizer and o.optimizer_offload_fraction == 0.5


def test_command_line_wins_over_group_and_recipe() -> None:
    run = compose_run(
        "recipe=qwen3_30b_a3b", "offload/activation=enabled", "model.cpu_offloading_num_layers=16"
    )
    assert run.model.cpu_offloading_num_layers == 16


def test_a_recipe_picks_group_options_and_the_command_line_overrides_them(tmp_path: Path) -> None:
    (tmp_path / "my_recipe.yaml").write_text(
        "# @package _global_\n# mine\ndefaults:\n  - tiny\n"
        "  - override /offload/optimizer: cpu_50\n"
        "name: my_recipe\nmodel:\n  num_layers: 6\n"
    )
    run = compose_run("recipe=my_recipe", extra_recipe_dirs=(tmp_path,))
    assert run.model.num_layers == 6 and run.optimizer.optimizer_offload_fraction == 0.5
    run = compose_run("recipe=my_recipe", "offload/optimizer=cpu_25", extra_recipe_dirs=(tmp_path,))
    assert run.optimizer.optimizer_offload_fraction == 0.25


def test_bridge_recipe_alias() -> None:
    assert normalize_recipe_name("qwen3_30b_a3b_pretrain_config") == "qwen3_30b_a3b"
    assert normalize_recipe_name("tiny") == "tiny"


def test_config_groups_lists_offload_groups_and_recipes() -> None:
    groups = config_groups()
    assert groups["offload/optimizer"] == [
        "auto",
        "cpu_100",
        "cpu_25",
        "cpu_50",
        "cpu_75",
        "cpu_adam",
        "cpu_adam_delayed",
        "cpu_adam_delayed_experts",
        "disabled",
        "states",
    ]
    assert groups["offload/activation"] == ["auto", "disabled", "enabled"]
    assert groups["offload/weight"] == ["disabled", "enabled"]
    assert "qwen3_30b_a3b_proxy" in groups["recipe"]


def test_a_wrong_type_fails_in_hydra() -> None:
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        compose_run("recipe=tiny", "model.num_layers=four")
    with pytest.raises(ConfigCompositionException):
        compose_run("recipe=tiny", "model.no_such_key=1")
