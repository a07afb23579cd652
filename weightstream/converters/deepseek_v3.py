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
  under Transformer Engine (a duplicated ``TELinear``): which one is read off the shapes the ranks hold. Engines
  hold them whole, so per-rank mode gathers them where the ranks hold them split (``stream.entry_mode``) and
  yields them whole on every rank.

Layers below ``first_k_dense_replace`` are dense (the dense families' MLP declarations); the others hold the
router (``mlp.gate``, its ``e_score_correction_bias`` Megatron's ``router.expert_bias``), the routed experts (the
Qwen MoE declarations: SequentialMLP and grouped-GEMM names, EP and expert-TP) and ``n_shared_experts`` shared
experts as one dense MLP (``mlp.shared_experts``, no gate).

Multi-token prediction: Megatron-Core's ``mtp.layers.{k}`` (``enorm``, ``hnorm``, ``eh_proj``, a transformer layer,
``final_layernorm``) are the HF checkpoint's ``model.layers.{num_hidden_layers + k}`` (``enorm``, ``hnorm``,
``eh_proj``, the layer's attention and MLP under the decoder's names, ``shared_head.norm``), which also holds a copy
of the embedding (``embed_tokens``) and of the output layer (``shared_head.head``), made from Megatron's
``embedding`` and ``output_layer``. transformers' model has no MTP layer; the tensors a checkpoint holds for them
are added to its expected tensors (:func:`mtp_tensors`). The config decides (``num_nextn_predict_layers``):

- Megatron holds MTP layers and the config declares as many: they are streamed (and loaded), named as above.
- Megatron holds MTP layers, the config declares none: refused, every MTP tensor named, rather than streamed
  without them.
- The config declares MTP layers that Megatron does not hold: refused, every missing MTP tensor named ("HF
  tensors the model does not provide"); stream with ``num_nextn_predict_layers=0`` (the engines keep the MTP
  weights they hold) or build the model with ``mtp_num_layers``.
- With PP > 1 Megatron's last stage holds a copy of the embedding for its MTP layers (the source names it
  ``mtp.embedding.*``): loaded, never emitted (the first stage's is).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from weightstream.converters.mapping import Converter, Mapping, untied
from weightstream.converters.ops import GATED, VOCAB, PerMTPLayer, Unrepresentable
from weightstream.converters.qwen2 import DENSE_MLP, EMBEDDINGS, H, L
from weightstream.converters.qwen_moe import FP8_EXPERTS, FUSED_EXPERTS, ROUTED_EXPERTS
from weightstream.models.spec import ModelSpec, yarn_rope

__all__ = [
    "A", "HA", "MLA", "ROUTER", "SHARED_EXPERTS", "MTP_LAYER", "MTP", "mtp_tensors", "deepseek_v3_features", "FP8_MLA",
    "FP8_MLP", "DEEPSEEK_V3"
]


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




def _with_mtp(spec: ModelSpec) -> bool:
    return spec.mtp_layers > 0


def _without_mtp(spec: ModelSpec) -> bool:
    return spec.mtp_layers == 0


MTP_LAYER = "mtp.layers.*"
# Refused where the config declares none; else the MTP layers' own tensors, and their transformer layer under the
# decoder layers' declarations (an MoE layer).
MTP = (
    Mapping("mtp.**", (), Unrepresentable(
        "the config declares no multi-token prediction layer (num_nextn_predict_layers = 0) and the Megatron model "
        "holds some; stream with a config that declares them, or build the model without mtp_num_layers"),
        when=_without_mtp),
    Mapping(f"{MTP_LAYER}.enorm.weight", f"{H}.enorm.weight", mtp_depth=True),
    Mapping(f"{MTP_LAYER}.hnorm.weight", f"{H}.hnorm.weight", mtp_depth=True),
    # Its input is [enorm(embedding); hnorm(hidden)] in both (Megatron: cat((decoder_input, hidden_states))).
    Mapping(f"{MTP_LAYER}.eh_proj.weight", f"{H}.eh_proj.weight", tp_dim=0, mtp_depth=True),
    Mapping(f"{MTP_LAYER}.final_layernorm.weight", f"{H}.shared_head.norm.weight", mtp_depth=True),
) + tuple(
    replace(m, megatron=m.megatron.replace(L, f"{MTP_LAYER}.transformer_layer", 1), mtp_depth=True)
    for m in MLA + DENSE_MLP + ROUTER + ROUTED_EXPERTS + SHARED_EXPERTS
) + (
    # With PP > 1 the last stage's copy of the embedding for its MTP layers (the source's name): loaded, not emitted.
    Mapping("mtp.embedding.word_embeddings.weight", "model.embed_tokens.weight", VOCAB, tp_dim=0, emit=False,
            when=_with_mtp),
    # Megatron's embedding and output layer, with their copies in each MTP layer.
    Mapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight", "model.layers.{mtp}.embed_tokens.weight"),
            PerMTPLayer(VOCAB), tp_dim=0, when=_with_mtp),
    Mapping("output_layer.weight", ("lm_head.weight", "model.layers.{mtp}.shared_head.head.weight"), PerMTPLayer(VOCAB),
            tp_dim=0, when=lambda spec: _with_mtp(spec) and untied(spec)),
)


def mtp_tensors(spec: ModelSpec, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The tensors of the config's MTP layers in an HF checkpoint (``model.layers.{N + k}``), from the shapes of
    transformers' model: those of its last decoder layer, the MTP layer's own, and the copies."""
    last = f"model.layers.{spec.num_layers - 1}."
    hidden = spec.hidden_size
    out: dict[str, tuple[int, ...]] = {}
    for k in range(spec.mtp_layers):
        layer = f"model.layers.{spec.num_layers + k}."
        out.update({layer + n[len(last):]: shape for n, shape in shapes.items() if n.startswith(last)})
        out.update({layer + "enorm.weight": (hidden,), layer + "hnorm.weight": (hidden,),
                    layer + "eh_proj.weight": (hidden, 2 * hidden), layer + "shared_head.norm.weight": (hidden,),
                    layer + "embed_tokens.weight": shapes["model.embed_tokens.weight"],
                    layer + "shared_head.head.weight": shapes.get("lm_head.weight",
                                                                  shapes["model.embed_tokens.weight"])})
    return out


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

DEEPSEEK_V3 = Converter("deepseek_v3", MTP + EMBEDDINGS + MLA + DENSE_MLP + ROUTER + ROUTED_EXPERTS + SHARED_EXPERTS,
                        features=deepseek_v3_features, memory=FUSED_EXPERTS, fp8=FP8_MLA + FP8_MLP + FP8_EXPERTS,
                        checkpoint_only=mtp_tensors)
