"""Qwen2 (dense): q/k/v carry a bias; no q/k norm."""

from __future__ import annotations

from typing import Any

from weightstream.converters.mapping import Converter, Mapping, tied, untied
from weightstream.converters.ops import GATED, QKV, VOCAB

__all__ = [
    "L", "H", "EMBEDDINGS", "ATTENTION", "DENSE_MLP", "qwen2_features", "FP8_ATTENTION", "FP8_DENSE_MLP", "QWEN2"
]


L = "decoder.layers.*"
H = "model.layers.*"

EMBEDDINGS = (
    Mapping("embedding.word_embeddings.weight", "model.embed_tokens.weight", VOCAB, tp_dim=0),
    Mapping("decoder.final_layernorm.weight", "model.norm.weight"),
    Mapping("output_layer.weight", "lm_head.weight", VOCAB, tp_dim=0, when=untied),
    # With tied embeddings and PP > 1 the last stage holds a copy of the embedding: loaded, never emitted.
    Mapping("output_layer.weight", "model.embed_tokens.weight", VOCAB, tp_dim=0, emit=False, when=tied),
)

ATTENTION = (
    Mapping(f"{L}.input_layernorm.weight", f"{H}.input_layernorm.weight"),
    # Transformer Engine fuses the input norm into linear_qkv.
    Mapping(f"{L}.self_attention.linear_qkv.layer_norm_weight", f"{H}.input_layernorm.weight"),
    Mapping(
        f"{L}.self_attention.linear_qkv.weight",
        (f"{H}.self_attn.q_proj.weight", f"{H}.self_attn.k_proj.weight", f"{H}.self_attn.v_proj.weight"),
        QKV,
        tp_dim=0,
    ),
    Mapping(
        f"{L}.self_attention.linear_qkv.bias",
        (f"{H}.self_attn.q_proj.bias", f"{H}.self_attn.k_proj.bias", f"{H}.self_attn.v_proj.bias"),
        QKV,
        tp_dim=0,
    ),
    Mapping(f"{L}.self_attention.linear_proj.weight", f"{H}.self_attn.o_proj.weight", tp_dim=1),
)

DENSE_MLP = (
    Mapping(f"{L}.pre_mlp_layernorm.weight", f"{H}.post_attention_layernorm.weight"),
    # Transformer Engine fuses the post-attention norm into linear_fc1 (dense layers only).
    Mapping(f"{L}.mlp.linear_fc1.layer_norm_weight", f"{H}.post_attention_layernorm.weight"),
    Mapping(f"{L}.mlp.linear_fc1.weight", (f"{H}.mlp.gate_proj.weight", f"{H}.mlp.up_proj.weight"), GATED, tp_dim=0),
    Mapping(f"{L}.mlp.linear_fc2.weight", f"{H}.mlp.down_proj.weight", tp_dim=1),
)


def qwen2_features(config: Any) -> dict[str, Any]:
    return {"qkv_bias": True, "qk_norm": False}


# Block FP8 (as the published Qwen FP8 checkpoints): every linear weight of the decoder layers; the embeddings,
# the output layer, norms and biases stay as they are.
FP8_ATTENTION = tuple(f"{H}.self_attn.{p}_proj.weight" for p in ("q", "k", "v", "o"))
FP8_DENSE_MLP = tuple(f"{H}.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))

QWEN2 = Converter("qwen2", EMBEDDINGS + ATTENTION + DENSE_MLP, features=qwen2_features,
                  fp8=FP8_ATTENTION + FP8_DENSE_MLP)
