"""One table per Hugging Face model family: its tensors' names beside Megatron-Core's, and its
``config.json`` beside ``model.*``.

Megatron names are those of the GPTModel built with Megatron-Core's local layer spec and
SequentialMLP experts (the names ``checkpoint`` sees on any machine); dist_checkpointing gives the
Transformer Engine and grouped-GEMM layouts the same checkpoint keys. Facts from Megatron-Bridge's
mapping tables (``qwen3_moe_bridge.py``, ``llama_bridge.py``) and transformers' model files.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

# How one Megatron tensor is made of HF tensors (hf_io.py joins and splits them):
COPY = "copy"  # the same tensor
QKV = "qkv"  # q, k, v projections interleaved per query group
GATE_UP = "gate_up"  # gate projection stacked over up projection (SwiGLU's fc1)
VOCAB = "vocab"  # rows padded to Megatron's padded vocabulary, cut back on export

# (Megatron name, HF names, how); a layer's names follow decoder.layers.N. / model.layers.N.,
# {e} is an expert's index.
TOP = (
    ("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB),
    ("decoder.final_layernorm.weight", ("model.norm.weight",), COPY),
    ("output_layer.weight", ("lm_head.weight",), VOCAB),  # absent when tied
)
ATTENTION = (
    ("input_layernorm.weight", ("input_layernorm.weight",), COPY),
    (
        "self_attention.linear_qkv.weight",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        QKV,
    ),
    ("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), COPY),
    ("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), COPY),
)
QK_NORM = (
    ("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), COPY),
    ("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), COPY),
)
DENSE_MLP = (
    ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), GATE_UP),
    ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), COPY),
)
MOE_MLP = (
    ("mlp.router.weight", ("mlp.gate.weight",), COPY),
    (
        "mlp.experts.local_experts.{e}.linear_fc1.weight",
        ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
        GATE_UP,
    ),
    (
        "mlp.experts.local_experts.{e}.linear_fc2.weight",
        ("mlp.experts.{e}.down_proj.weight",),
        COPY,
    ),
)


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's
    config_class: str  # transformers' config class (export writes config.json through it)
    architecture: str
    base_recipe: str  # the recipe an import of this family composes on
    layer: tuple  # the rows of one decoder layer
    qk_norm: bool
    moe: bool


FAMILIES = {
    f.model_type: f
    for f in (
        Family(
            "qwen3_moe",
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            "qwen3_30b_a3b_sft",
            ATTENTION + QK_NORM + MOE_MLP,
            True,
            True,
        ),
        Family(
            "qwen3",
            "Qwen3Config",
            "Qwen3ForCausalLM",
            "llama3_8b_sft",
            ATTENTION + QK_NORM + DENSE_MLP,
            True,
            False,
        ),
        Family(
            "llama",
            "LlamaConfig",
            "LlamaForCausalLM",
            "llama3_8b_sft",
            ATTENTION + DENSE_MLP,
            False,
            False,
        ),
    )
}

# model.* a checkpoint's tensor shapes follow (a pretrained start checks them against the run's)
SHAPE_KEYS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "qk_layernorm",
    "share_embeddings_and_output_weights",
    "num_moe_experts",
    "moe_ffn_hidden_size",
    "vocab_size",
)
# ... and the rest of the architecture (model.yaml beside a checkpoint holds them all)
ARCH_KEYS = SHAPE_KEYS + (
    "max_position_embeddings",
    "make_vocab_size_divisible_by",
    "normalization",
    "layernorm_epsilon",
    "activation_func",
    "gated_linear_unit",
    "add_bias_linear",
    "add_qkv_bias",
    "position_embedding_type",
    "rotary_base",
    "rope_scaling",
    "rope_scaling_factor",
    "moe_router_topk",
    "moe_router_pre_softmax",
    "moe_aux_loss_coeff",
)
# The architecture keys every family maps alike
FIXED_KEYS = {
    "normalization": "RMSNorm",
    "activation_func": "silu",
    "gated_linear_unit": True,
    "add_bias_linear": False,
    "add_qkv_bias": False,
    "position_embedding_type": "rope",
}
# Megatron-Core's Llama 3 RoPE scaling (RotaryEmbedding._apply_scaling) fixes all but the factor.
LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


class HfError(ValueError):
    """A checkpoint this table cannot map: ``str(err)`` says what, ``fix`` how."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


def arch_of(model) -> dict:
    """``model.*``'s architecture keys as plain values (model.yaml)."""
    values = {k: getattr(model, k, None) for k in ARCH_KEYS}
    return {k: v.value if isinstance(v, Enum) else v for k, v in values.items()}


def family_of(model_type: str | None) -> Family:
    if model_type not in FAMILIES:
        raise HfError(
            f"model_type {model_type!r} is not a family offload-runner maps",
            f"import one of: {', '.join(FAMILIES)}",
        )
    return FAMILIES[model_type]


def family_of_model(model) -> Family:
    """The family a ``model.*`` section exports as (a model trained from scratch has none)."""
    if model.num_moe_experts:
        return FAMILIES["qwen3_moe"]
    return FAMILIES["qwen3" if model.qk_layernorm else "llama"]


def tensor_rows(family: Family, num_layers: int, experts: int, tied: bool) -> list[tuple]:
    """Every (Megatron name, HF names, how) of a model of this family."""
    rows = [r for r in TOP if not (tied and r[0] == "output_layer.weight")]
    for n in range(num_layers):
        for megatron, hf, how in family.layer:
            for e in range(experts) if "{e}" in megatron else [None]:
                rows.append(
                    (
                        f"decoder.layers.{n}.{megatron.format(e=e)}",
                        tuple(f"model.layers.{n}.{h.format(e=e)}" for h in hf),
                        how,
                    )
                )
    return rows


def model_keys(hf) -> dict:
    """``model.*`` from a transformers config object (``AutoConfig.from_pretrained``)."""
    family = family_of(hf.model_type)
    _refuse_unmapped(hf, family)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    keys = {
        "num_layers": hf.num_hidden_layers,
        "hidden_size": hf.hidden_size,
        "ffn_hidden_size": hf.intermediate_size,
        "num_attention_heads": hf.num_attention_heads,
        "num_query_groups": hf.num_key_value_heads,
        "kv_channels": head_dim,
        "max_position_embeddings": hf.max_position_embeddings,
        "vocab_size": hf.vocab_size,
        **FIXED_KEYS,
        "layernorm_epsilon": hf.rms_norm_eps,
        "qk_layernorm": family.qk_norm,
        "rotary_base": float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))),
        "rope_scaling": rope.get("rope_type") == "llama3",
        "rope_scaling_factor": float(rope.get("factor", 8.0)),
        "share_embeddings_and_output_weights": bool(hf.tie_word_embeddings),
        "num_moe_experts": None,
    }
    if family.moe:
        keys.update(
            num_moe_experts=hf.num_experts,
            moe_router_topk=hf.num_experts_per_tok,
            moe_ffn_hidden_size=hf.moe_intermediate_size,
            # HF: softmax over all experts, top-k, renormalized if norm_topk_prob; Megatron's
            # default (top-k of the logits, then softmax over them) is that renormalization.
            moe_router_pre_softmax=not hf.norm_topk_prob,
            moe_aux_loss_coeff=hf.router_aux_loss_coef,
        )
    return keys


def _refuse_unmapped(hf, family: Family) -> None:
    """Settings of config.json the Megatron model cannot reproduce."""
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    kind = rope.get("rope_type", "default")
    checks = [
        (hf.hidden_act != "silu", f"hidden_act={hf.hidden_act}", "silu"),
        (getattr(hf, "attention_bias", False), "attention_bias=true", "no attention biases"),
        (getattr(hf, "mlp_bias", False), "mlp_bias=true", "no MLP biases"),
        (kind not in ("default", "llama3"), f"rope_type={kind}", "default or llama3 RoPE"),
        (
            kind == "llama3" and any(float(rope.get(k, v)) != v for k, v in LLAMA3_ROPE.items()),
            f"llama3 RoPE {rope}",
            f"Megatron-Core's fixed llama3 scaling {LLAMA3_ROPE} (any factor)",
        ),
        (getattr(hf, "use_sliding_window", False), "use_sliding_window=true", "full attention"),
    ]
    if family.moe:
        checks += [
            (
                getattr(hf, "decoder_sparse_step", 1) != 1,
                "decoder_sparse_step>1",
                "every layer MoE",
            ),
            (bool(getattr(hf, "mlp_only_layers", [])), "mlp_only_layers", "every layer MoE"),
        ]
    for bad, what, supported in checks:
        if bad:
            raise HfError(
                f"{what} in config.json has no Megatron-Core equivalent here",
                f"offload-runner imports {family.model_type} checkpoints with {supported}",
            )


def hf_config(family: Family, model, dtype: str):
    """A transformers config object for ``model.*`` (export of a model with no config.json)."""
    import transformers

    rope = {"rope_theta": float(model.rotary_base), "rope_type": "default"}
    if model.rope_scaling:
        rope.update(rope_type="llama3", factor=float(model.rope_scaling_factor), **LLAMA3_ROPE)
    kwargs = dict(
        vocab_size=model.vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_query_groups or model.num_attention_heads,
        head_dim=model.kv_channels or model.hidden_size // model.num_attention_heads,
        max_position_embeddings=model.max_position_embeddings or model.seq_length,
        rms_norm_eps=model.layernorm_epsilon,
        rope_parameters=rope,
        tie_word_embeddings=model.share_embeddings_and_output_weights,
        hidden_act="silu",
        dtype=dtype,
        architectures=[family.architecture],
    )
    if family.moe:
        kwargs.update(
            num_experts=model.num_moe_experts,
            num_experts_per_tok=model.moe_router_topk,
            moe_intermediate_size=model.moe_ffn_hidden_size,
            norm_topk_prob=not getattr(model, "moe_router_pre_softmax", False),
            router_aux_loss_coef=model.moe_aux_loss_coeff,
        )
    return getattr(transformers, family.config_class)(**kwargs)
