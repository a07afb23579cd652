"""DeepSeek-V3 (and Kimi-K2, which is the same architecture): multi-latent attention, a leading block of dense
layers, then MoE layers with shared experts and grouped sigmoid routing with a score-correction bias.

Multi-latent attention, Megatron-Core's ``MLASelfAttention`` <-> HF ``DeepseekV3Attention``, tensor for tensor:

- ``linear_q_down_proj`` / ``linear_q_up_proj`` are ``q_a_proj`` / ``q_b_proj`` (``linear_q_proj`` is ``q_proj``
  where ``q_lora_rank`` is null); ``linear_kv_down_proj`` is ``kv_a_proj_with_mqa``, its rows in the same order
  (the ``kv_lora_rank`` latent, then the ``qk_rope_head_dim`` rotary key); ``linear_kv_up_proj`` is
  ``kv_b_proj`` (per head, ``qk_nope_head_dim`` key rows then ``v_head_dim`` value rows in both).
- The rotary part of each query head and of the shared key stays in DeepSeek's interleaved pairs on both sides:
  Megatron's MLA de-interleaves it in its rotary embedding, as HF's ``rope_interleave`` does, so no weight is
  permuted (the equal logits of the tests are the proof).
- The latent norms are ``q_layernorm`` / ``kv_layernorm`` in the local spec; Transformer Engine fuses them
  into the up projections (``linear_q_up_proj.layer_norm_weight``, ``linear_kv_up_proj.layer_norm_weight``).
- The up projections split their heads over TP (dim 0), ``linear_proj`` its input (dim 1). The down projections
  are split on dim 0 in the local spec (``ColumnParallelLinear``, output gathered) and held whole on every rank
  under Transformer Engine (a duplicated ``TELinear``): which one is read off the shapes the ranks hold.

Layers below ``first_k_dense_replace`` are dense (the dense families' MLP declarations); the others hold the
router (``mlp.gate``, its ``e_score_correction_bias`` Megatron's ``router.expert_bias``), the routed experts (the
Qwen MoE declarations: SequentialMLP and grouped-GEMM names, EP and expert-TP) and ``n_shared_experts`` shared
experts as one dense MLP (``mlp.shared_experts``, no gate).

Multi-token prediction layers (Megatron-Core's ``mtp.layers.*``) have no declaration yet: a model that holds them
is refused, each of their tensors named ("Megatron tensors no mapping covers"); a config that declares
``num_nextn_predict_layers`` streams the decoder's layers, as transformers' own model holds no MTP layer.
"""

from __future__ import annotations

from typing import Any

from weightstream.converters.mapping import Converter, Mapping
from weightstream.converters.ops import GATED
from weightstream.converters.qwen2 import DENSE_MLP, EMBEDDINGS, H, L
from weightstream.converters.qwen_moe import FP8_EXPERTS, FUSED_EXPERTS, ROUTED_EXPERTS
from weightstream.models.spec import yarn_rope

A = f"{L}.self_attention"
HA = f"{H}.self_attn"

MLA = (
    Mapping(f"{L}.input_layernorm.weight", f"{H}.input_layernorm.weight"),
    Mapping(f"{A}.linear_q_proj.weight", f"{HA}.q_proj.weight", tp_dim=0),
    Mapping(f"{A}.linear_q_down_proj.weight", f"{HA}.q_a_proj.weight", tp_dim=0, whole_or_split=True),
    Mapping(f"{A}.q_layernorm.weight", f"{HA}.q_a_layernorm.weight"),
    Mapping(f"{A}.linear_q_up_proj.layer_norm_weight", f"{HA}.q_a_layernorm.weight"),  # Transformer Engine
    Mapping(f"{A}.linear_q_up_proj.weight", f"{HA}.q_b_proj.weight", tp_dim=0),
    Mapping(f"{A}.linear_kv_down_proj.weight", f"{HA}.kv_a_proj_with_mqa.weight", tp_dim=0, whole_or_split=True),
    Mapping(f"{A}.kv_layernorm.weight", f"{HA}.kv_a_layernorm.weight"),
    Mapping(f"{A}.linear_kv_up_proj.layer_norm_weight", f"{HA}.kv_a_layernorm.weight"),  # Transformer Engine
    Mapping(f"{A}.linear_kv_up_proj.weight", f"{HA}.kv_b_proj.weight", tp_dim=0),
    Mapping(f"{A}.linear_proj.weight", f"{HA}.o_proj.weight", tp_dim=1),
)

ROUTER = (
    # Replicated, each in the dtype it has (HF keeps the bias in float32).
    Mapping(f"{L}.mlp.router.weight", f"{H}.mlp.gate.weight"),
    Mapping(f"{L}.mlp.router.expert_bias", f"{H}.mlp.gate.e_score_correction_bias"),
)

# n_shared_experts shared experts, one dense gated MLP over the dense TP group, added without a gate.
SHARED_EXPERTS = (
    Mapping(f"{L}.mlp.shared_experts.linear_fc1.weight",
            (f"{H}.mlp.shared_experts.gate_proj.weight", f"{H}.mlp.shared_experts.up_proj.weight"), GATED, tp_dim=0),
    Mapping(f"{L}.mlp.shared_experts.linear_fc2.weight", f"{H}.mlp.shared_experts.down_proj.weight", tp_dim=1),
)


def deepseek_v3_features(config: Any) -> dict[str, Any]:
    experts = int(config.n_routed_experts)
    first_dense = int(getattr(config, "first_k_dense_replace", 0) or 0)
    return {
        "qkv_bias": bool(getattr(config, "attention_bias", False)),
        "q_lora_rank": int(config.q_lora_rank) if config.q_lora_rank else None,
        "kv_lora_rank": int(config.kv_lora_rank),
        "qk_nope_head_dim": int(config.qk_nope_head_dim),
        "qk_rope_head_dim": int(config.qk_rope_head_dim),
        "v_head_dim": int(config.v_head_dim),
        "mtp_layers": int(getattr(config, "num_nextn_predict_layers", 0) or 0),
        "yarn": yarn_rope(config),
        "num_experts": experts,
        "moe_intermediate_size": int(config.moe_intermediate_size),
        "moe_top_k": int(config.num_experts_per_tok),
        "shared_expert_intermediate_size": int(config.moe_intermediate_size) * int(config.n_shared_experts or 0),
        "norm_topk_prob": bool(config.norm_topk_prob),
        "dense_layers": frozenset(range(min(first_dense, int(config.num_hidden_layers)))),
        "moe_score_function": "sigmoid",
        "moe_expert_bias": True,
        "moe_num_groups": int(getattr(config, "n_group", 0) or 0),
        "moe_group_top_k": int(getattr(config, "topk_group", 0) or 0),
        "moe_routed_scaling_factor": float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
    }


# Block FP8 as the published DeepSeek-V3 checkpoint holds it: every projection of attention (q_a/q_b or q,
# kv_a_proj_with_mqa, kv_b, o), of the dense MLPs, the shared and the routed experts, in the decoder's layers and
# in the multi-token prediction layers' own attention and MLP; the embeddings, the output layer and its MTP
# copies, norms, routers, their bias and the MTP layers' eh_proj stay as they are.
FP8_MLA = tuple(f"{HA}.{p}.weight" for p in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                              "o_proj"))
FP8_MLP = tuple(f"{H}.mlp.{e}{p}_proj.weight" for e in ("", "shared_experts.") for p in ("gate", "up", "down"))

DEEPSEEK_V3 = Converter("deepseek_v3", EMBEDDINGS + MLA + DENSE_MLP + ROUTER + ROUTED_EXPERTS + SHARED_EXPERTS,
                        features=deepseek_v3_features, memory=FUSED_EXPERTS, fp8=FP8_MLA + FP8_MLP + FP8_EXPERTS)
