"""GLM-4.5 / 4.6 MoE (``glm4_moe``): Qwen2's attention (q/k/v bias when ``attention_bias``) with partial rotary
embeddings and, when ``use_qk_norm``, Qwen3's q/k norm; ``first_k_dense_replace`` dense layers, then MoE layers
routed by sigmoid scores with a per-expert score-correction bias and grouped top-k, plus shared experts.

Partial rotary needs no op: HF and Megatron both turn the first ``head_dim * partial_rotary_factor`` dimensions of
each head with rotate-half pairs (``rotary_percent``, not ``rotary_interleaved``) and pass the rest as they are,
so the q/k rows are in the same order on both sides.

Multi-token prediction: GLM-4.5 checkpoints carry ``num_nextn_predict_layers`` extra layers under
``model.layers.{num_hidden_layers}``, which transformers' model neither holds nor saves. They are not emitted: a
Megatron model that has MTP layers (``mtp.*``) is refused, naming them, rather than streamed without them.
"""

from __future__ import annotations

from typing import Any

from weightstream.converters.mapping import Mapping
from weightstream.converters.ops import GATED, Unrepresentable
from weightstream.converters.qwen2 import QWEN2, H, L
from weightstream.converters.qwen3 import QK_NORM
from weightstream.converters.qwen_moe import FP8_EXPERTS, FUSED_EXPERTS, ROUTED_EXPERTS

__all__ = ["ROUTER", "SHARED_EXPERTS", "MTP", "glm4_moe_features", "FP8_SHARED_EXPERTS", "GLM4_MOE"]


ROUTER = (
    Mapping(f"{L}.mlp.router.weight", f"{H}.mlp.gate.weight"),
    # Added to the sigmoid scores that choose the experts (not to their weights); float32 on both sides.
    Mapping(f"{L}.mlp.router.expert_bias", f"{H}.mlp.gate.e_score_correction_bias"),
)

# The shared experts: one dense gated MLP (n_shared_experts x moe_intermediate_size wide) over the dense TP
# group, added without a gate.
SHARED_EXPERTS = (
    Mapping(
        f"{L}.mlp.shared_experts.linear_fc1.weight",
        (f"{H}.mlp.shared_experts.gate_proj.weight", f"{H}.mlp.shared_experts.up_proj.weight"),
        GATED,
        tp_dim=0,
    ),
    Mapping(f"{L}.mlp.shared_experts.linear_fc2.weight", f"{H}.mlp.shared_experts.down_proj.weight", tp_dim=1),
)

MTP = (
    Mapping(
        "mtp.**",
        (),
        Unrepresentable(
            "GLM-4.5 multi-token-prediction layers are not streamed (transformers' Glm4MoeForCausalLM holds "
            "none); build the Megatron model without mtp_num_layers, or stream only the main model"
        ),
    ),
)


def glm4_moe_features(config: Any) -> dict[str, Any]:
    experts = int(config.n_routed_experts)
    return {
        "qkv_bias": bool(config.attention_bias),
        "qk_norm": bool(config.use_qk_norm),
        "num_experts": experts,
        "moe_intermediate_size": int(config.moe_intermediate_size),
        "moe_top_k": int(config.num_experts_per_tok),
        "shared_expert_intermediate_size": int(config.moe_intermediate_size) * int(config.n_shared_experts),
        "norm_topk_prob": bool(config.norm_topk_prob),
        "dense_layers": frozenset(range(min(int(config.first_k_dense_replace), int(config.num_hidden_layers)))),
        "moe_score_function": "sigmoid",
        "moe_expert_bias": True,
        "moe_num_groups": int(config.n_group),
        "moe_group_top_k": int(config.topk_group),
        "moe_routed_scaling_factor": float(config.routed_scaling_factor),
        "partial_rotary_factor": float((config.rope_parameters or {}).get("partial_rotary_factor", 1.0)),
    }


# Block FP8 (as GLM-4.5-FP8 holds it): attention and dense MLP (Qwen2's declaration), routed and shared experts'
# projections; the router (``mlp.gate``), its bias, the embeddings, the output layer and the norms stay as they are.
FP8_SHARED_EXPERTS = tuple(f"{H}.mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down"))

GLM4_MOE = QWEN2.derive(
    "glm4_moe",
    add=QK_NORM + ROUTER + ROUTED_EXPERTS + SHARED_EXPERTS + MTP,
    features=glm4_moe_features,
    memory=FUSED_EXPERTS,
    fp8=FP8_EXPERTS + FP8_SHARED_EXPERTS,
)
