"""Qwen2-MoE and Qwen3-MoE: the dense families' attention, plus routed experts (and Qwen2-MoE's shared expert).

Routed experts arrive under global indices (the source renames ``ep_rank * experts_per_rank + e``)
and under either of Megatron's namings: SequentialMLP (``experts.local_experts.{E}.linear_fc1``) or
Transformer Engine's grouped GEMM (``experts.linear_fc1.weight{E}``). They are split over the
expert-TP group (``tp_group="etp"``), not the dense TP group. Layers the HF config makes dense
(``mlp_only_layers``, ``decoder_sparse_step``) carry ``mlp.linear_fc1``/``linear_fc2`` and convert
through the dense declarations; which layer is which is checked against the HF config's tensors.
"""

from __future__ import annotations

from typing import Any

from weightstream.converters.mapping import Mapping
from weightstream.converters.ops import GATED, FusedExperts, Unrepresentable
from weightstream.converters.qwen2 import QWEN2, H, L, qwen2_features
from weightstream.converters.qwen3 import QWEN3, qwen3_features

__all__ = [
    "ROUTER", "ROUTED_EXPERTS", "SHARED_EXPERT", "FUSED_EXPERTS", "dense_layers", "qwen2_moe_features",
    "qwen3_moe_features", "FP8_EXPERTS", "FP8_SHARED_EXPERT", "QWEN2_MOE", "QWEN3_MOE"
]


_GATE_UP = (f"{H}.mlp.experts.*.gate_proj.weight", f"{H}.mlp.experts.*.up_proj.weight")
_DOWN = f"{H}.mlp.experts.*.down_proj.weight"

ROUTER = (
    # Replicated; emitted in whatever dtype it has (often float32 in a bf16 model).
    Mapping(f"{L}.mlp.router.weight", f"{H}.mlp.gate.weight"),
    # Megatron's aux-loss-free balancing bias (moe_router_enable_expert_bias, which Megatron allows
    # only with sigmoid scores). Qwen MoE models route by a softmax and have no per-expert score
    # correction: dropping the bias would hand engines a model that routes differently from the one
    # trained, so a model that has it is refused, when streaming and when loading.
    Mapping(
        f"{L}.mlp.router.expert_bias",
        (),
        Unrepresentable(
            "Qwen MoE models route by a softmax and have no expert score-correction bias (no "
            "e_score_correction_bias), so a model trained with moe_router_enable_expert_bias would route "
            "differently in Hugging Face and in every engine; train without it, or register a converter for "
            "a model type that has such a bias"
        ),
    ),
)

ROUTED_EXPERTS = (
    # SequentialMLP (local spec, and TE without grouped GEMM).
    Mapping(f"{L}.mlp.experts.local_experts.*.linear_fc1.weight", _GATE_UP, GATED, tp_dim=0, tp_group="etp"),
    Mapping(f"{L}.mlp.experts.local_experts.*.linear_fc2.weight", _DOWN, tp_dim=1, tp_group="etp"),
    # Transformer Engine grouped GEMM: one parameter per expert, the index at the end of the name.
    # fc2 is split on dim 1 whatever partition_dim Megatron reports for it.
    Mapping(f"{L}.mlp.experts.linear_fc1.weight*", _GATE_UP, GATED, tp_dim=0, tp_group="etp"),
    Mapping(f"{L}.mlp.experts.linear_fc2.weight*", _DOWN, tp_dim=1, tp_group="etp"),
)

# Qwen2-MoE's shared expert is a dense gated MLP over the dense TP group, scaled by a sigmoid gate.
SHARED_EXPERT = (
    Mapping(
        f"{L}.mlp.shared_experts.linear_fc1.weight",
        (f"{H}.mlp.shared_expert.gate_proj.weight", f"{H}.mlp.shared_expert.up_proj.weight"),
        GATED,
        tp_dim=0,
    ),
    Mapping(f"{L}.mlp.shared_experts.linear_fc2.weight", f"{H}.mlp.shared_expert.down_proj.weight", tp_dim=1),
    Mapping(f"{L}.mlp.shared_experts.gate_weight", f"{H}.mlp.shared_expert_gate.weight"),
)


# transformers 5 holds each layer's routed experts fused: gate_up_proj (E, 2I, H), down_proj (E, H, I).
FUSED_EXPERTS = (
    Mapping(f"{H}.mlp.experts.gate_up_proj", (f"{H}.mlp.experts.{{e}}.gate_proj.weight",
                                               f"{H}.mlp.experts.{{e}}.up_proj.weight"), FusedExperts(2)),
    Mapping(f"{H}.mlp.experts.down_proj", f"{H}.mlp.experts.{{e}}.down_proj.weight", FusedExperts(1)),
)


def dense_layers(config: Any) -> frozenset[int]:
    """The layers an HF Qwen MoE config makes dense: those in ``mlp_only_layers``, and those that
    ``decoder_sparse_step`` skips (layer i is sparse when ``(i + 1) % step == 0``)."""
    only = set(getattr(config, "mlp_only_layers", None) or ())
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return frozenset(i for i in range(config.num_hidden_layers) if i in only or (i + 1) % step)


def _moe_features(config: Any, shared: bool) -> dict[str, Any]:
    shared_size = int(getattr(config, "shared_expert_intermediate_size", 0) or 0) if shared else 0
    return {
        "num_experts": int(config.num_experts),
        "moe_intermediate_size": int(config.moe_intermediate_size),
        "moe_top_k": int(config.num_experts_per_tok),
        "shared_expert_intermediate_size": shared_size,
        # Qwen2-MoE scales its shared expert by a sigmoid gate (shared_expert_gate).
        "shared_expert_gate": shared_size > 0,
        "norm_topk_prob": bool(getattr(config, "norm_topk_prob", False)),
        "dense_layers": dense_layers(config),
    }


def qwen2_moe_features(config: Any) -> dict[str, Any]:
    # transformers 5 names the q/k/v bias switch ``qkv_bias`` (default on); older configs do not have it.
    return {**qwen2_features(config), "qkv_bias": bool(getattr(config, "qkv_bias", True)),
            **_moe_features(config, True)}


def qwen3_moe_features(config: Any) -> dict[str, Any]:
    return {**qwen3_features(config), **_moe_features(config, False)}


# Block FP8: every expert's and the shared expert's projections; the routers (``mlp.gate``,
# ``mlp.shared_expert_gate``) stay as they are.
FP8_EXPERTS = tuple(f"{H}.mlp.experts.*.{p}_proj.weight" for p in ("gate", "up", "down"))
FP8_SHARED_EXPERT = tuple(f"{H}.mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down"))

# Each MoE family is its dense family (embeddings, attention, dense MLP for dense layers) plus experts.
QWEN2_MOE = QWEN2.derive("qwen2_moe", add=ROUTER + ROUTED_EXPERTS + SHARED_EXPERT, features=qwen2_moe_features,
                         memory=FUSED_EXPERTS, fp8=FP8_EXPERTS + FP8_SHARED_EXPERT)
QWEN3_MOE = QWEN3.derive("qwen3_moe", add=ROUTER + ROUTED_EXPERTS, features=qwen3_moe_features,
                         memory=FUSED_EXPERTS, fp8=FP8_EXPERTS)
