"""Parameter counts of a Megatron-Core GPTModel from its config (no torch needed).

Counts follow GPTModel's modules: padded embedding and output layer, per layer the fused
layernorm+QKV, optional q/k layernorm, output projection, and either a dense MLP or a MoE layer
(router + experts), and the final norm.
"""

from __future__ import annotations

from dataclasses import dataclass

from offload_runner.config.schema import ModelConfig, Normalization


@dataclass(frozen=True)
class ParamCount:
    embedding: int  # input embedding (+ output layer when untied)
    attention: int  # all layers
    dense_mlp: int  # all layers (0 for an all-MoE model)
    experts: int  # all layers, all experts
    router: int
    norms: int

    @property
    def total(self) -> int:
        return (
            self.embedding
            + self.attention
            + self.dense_mlp
            + self.experts
            + self.router
            + self.norms
        )

    @property
    def non_expert(self) -> int:
        return self.total - self.experts


def padded_vocab_size(model: ModelConfig) -> int:
    multiple = model.make_vocab_size_divisible_by * model.tensor_model_parallel_size
    return -(-model.vocab_size // multiple) * multiple


def kv_channels(model: ModelConfig) -> int:
    return model.kv_channels or model.hidden_size // model.num_attention_heads


def count_parameters(model: ModelConfig) -> ParamCount:
    h = model.hidden_size
    kv = kv_channels(model)
    groups = model.num_query_groups or model.num_attention_heads
    norm = h if model.normalization == Normalization.RMSNorm else 2 * h
    bias = model.add_bias_linear
    up = 2 if model.gated_linear_unit else 1

    q_width = model.num_attention_heads * kv
    qkv = h * (q_width + 2 * groups * kv) + (q_width + 2 * groups * kv) * model.add_qkv_bias
    qk_norm = 2 * (kv if model.normalization == Normalization.RMSNorm else 2 * kv)
    attention = qkv + q_width * h + h * bias + (qk_norm if model.qk_layernorm else 0)

    layers = model.num_layers
    if model.num_moe_experts:
        ffn = model.moe_ffn_hidden_size or model.ffn_hidden_size
        expert = h * ffn * up + ffn * h
        experts = layers * model.num_moe_experts * expert
        router = layers * h * model.num_moe_experts
        dense = 0
    else:
        experts = router = 0
        ffn = model.ffn_hidden_size
        dense = layers * (h * ffn * up + ffn * h + (ffn * up + h) * bias)

    vocab = padded_vocab_size(model)
    embedding = vocab * h * (1 if model.share_embeddings_and_output_weights else 2)
    return ParamCount(
        embedding=embedding,
        attention=layers * attention,
        dense_mlp=dense,
        experts=experts,
        router=router,
        norms=layers * 2 * norm + norm,
    )


def largest_modules(model: ModelConfig) -> list[int]:
    """Params of a transformer layer's modules with weights of their own that weight offload
    streams one by one, widest first: the fused layernorm + QKV, the projection, and fc1 and fc2
    of the dense MLP or of all the routed experts together."""
    h = model.hidden_size
    kv = kv_channels(model)
    groups = model.num_query_groups or model.num_attention_heads
    q_width = model.num_attention_heads * kv
    up = 2 if model.gated_linear_unit else 1
    experts = model.num_moe_experts or 1
    ffn = model.ffn_hidden_size
    if model.num_moe_experts:
        ffn = model.moe_ffn_hidden_size or ffn
    qkv = h * (q_width + 2 * groups * kv) + 2 * h
    return sorted([qkv, q_width * h, experts * h * ffn * up, experts * ffn * h], reverse=True)


def active_matmul_parameters(model: ModelConfig) -> int:
    """Weights one token meets in matrix products: attention, its experts (top-k) or the dense
    MLP, the router and the output layer (the input embedding is a lookup, not a product)."""
    counts = count_parameters(model)
    per_token_experts = 0
    if model.num_moe_experts:
        per_token_experts = counts.experts * model.moe_router_topk // model.num_moe_experts
    output_layer = padded_vocab_size(model) * model.hidden_size
    return counts.attention + counts.dense_mlp + per_token_experts + counts.router + output_layer


def training_flops_per_token(model: ModelConfig) -> float:
    """Forward + backward FLOPs per token: 6 x active matmul weights, plus causal attention
    scores and values (2 products of seq x q_width per layer, halved by the causal mask, x3)."""
    q_width = model.num_attention_heads * kv_channels(model)
    attention = 6 * model.num_layers * model.seq_length * q_width
    return 6 * active_matmul_parameters(model) + attention
