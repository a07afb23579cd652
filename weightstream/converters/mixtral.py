"""Mixtral (``mixtral``): Llama's attention, and in every layer routed experts under ``block_sparse_moe``.

Each expert is a gated MLP named ``w1`` (gate), ``w3`` (up) and ``w2`` (down); the router is
``block_sparse_moe.gate``: a softmax over the chosen experts' logits (top-k renormalised: Megatron's
``moe_router_pre_softmax=False``), no shared expert, no dense layer. Experts arrive under global indices and either
of Megatron's namings, split over the expert-TP group, as in :mod:`weightstream.converters.qwen_moe`.

transformers 5 holds them otherwise in memory: ``mlp.gate`` and each layer's experts fused (``mlp.experts.gate_up_proj``
(E, 2I, H), ``mlp.experts.down_proj`` (E, H, I)); ``save_pretrained`` and engines use the names above.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from weightstream.converters.llama import LLAMA, llama_features
from weightstream.converters.mapping import Mapping
from weightstream.converters.ops import GATED, FusedExperts, Unrepresentable
from weightstream.converters.qwen2 import FP8_ATTENTION, H, L

__all__ = ["M", "ROUTER", "EXPERTS", "FUSED_EXPERTS", "mixtral_features", "MIXTRAL"]


M = f"{H}.block_sparse_moe"
_W1_W3 = (f"{M}.experts.*.w1.weight", f"{M}.experts.*.w3.weight")
_W2 = f"{M}.experts.*.w2.weight"

ROUTER = (
    Mapping(f"{L}.mlp.router.weight", f"{M}.gate.weight"),
    Mapping(f"{L}.mlp.router.expert_bias", (), Unrepresentable(
        "Mixtral routes by a softmax and has no expert score-correction bias, so a model trained with "
        "moe_router_enable_expert_bias would route differently in Hugging Face and in every engine; train "
        "without it")),
)

EXPERTS = (
    Mapping(f"{L}.mlp.experts.local_experts.*.linear_fc1.weight", _W1_W3, GATED, tp_dim=0, tp_group="etp"),
    Mapping(f"{L}.mlp.experts.local_experts.*.linear_fc2.weight", _W2, tp_dim=1, tp_group="etp"),
    Mapping(f"{L}.mlp.experts.linear_fc1.weight*", _W1_W3, GATED, tp_dim=0, tp_group="etp"),
    Mapping(f"{L}.mlp.experts.linear_fc2.weight*", _W2, tp_dim=1, tp_group="etp"),
)

FUSED_EXPERTS = (
    Mapping(f"{H}.mlp.gate.weight", f"{M}.gate.weight"),
    Mapping(f"{H}.mlp.experts.gate_up_proj", (f"{M}.experts.{{e}}.w1.weight", f"{M}.experts.{{e}}.w3.weight"),
            FusedExperts(2)),
    Mapping(f"{H}.mlp.experts.down_proj", f"{M}.experts.{{e}}.w2.weight", FusedExperts(1)),
)


def mixtral_features(config: Any) -> dict[str, Any]:
    return {**llama_features(config), "num_experts": int(config.num_local_experts),
            "moe_intermediate_size": int(config.intermediate_size), "moe_top_k": int(config.num_experts_per_tok),
            "norm_topk_prob": True}


# Every layer is MoE: the dense MLP's declarations go (a dense layer would be reported as unmapped), its norm stays.
_DENSE = (f"{L}.mlp.linear_fc1.layer_norm_weight", f"{L}.mlp.linear_fc1.weight", f"{L}.mlp.linear_fc2.weight")

# Block FP8: the attention projections and every expert's w1/w2/w3; the router stays as it is.
MIXTRAL = replace(LLAMA.derive("mixtral", remove=_DENSE, add=ROUTER + EXPERTS, features=mixtral_features,
                               memory=FUSED_EXPERTS),
                  fp8=FP8_ATTENTION + tuple(f"{M}.experts.*.w{i}.weight" for i in (1, 2, 3)))
