"""Named model configs: tiny ones for tests and the demo, real shapes for benchmarks."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["PRESETS", "preset_config", "random_hf_model", "save_random_checkpoint"]


# Tiny presets: heads != groups everywhere; vocab sizes that need padding (not multiples of 128).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny-qwen2": dict(
        model_type="qwen2", vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256, rope_theta=10000.0,
        tie_word_embeddings=False, rms_norm_eps=1e-6,
    ),
    "tiny-qwen3": dict(
        model_type="qwen3", vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=16, max_position_embeddings=256,
        rope_theta=1000000.0, tie_word_embeddings=False, rms_norm_eps=1e-6,
    ),
    "tiny-qwen3-tied": dict(
        model_type="qwen3", vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=16, max_position_embeddings=256,
        rope_theta=1000000.0, tie_word_embeddings=True, rms_norm_eps=1e-6,
    ),
    # Mixture of experts: 8 experts, top-2. Qwen2-MoE: q/k/v bias, a shared expert with its sigmoid
    # gate, softmax over all experts without renormalising the top-k, and layer 1 dense (mlp_only_layers).
    "tiny-qwen2-moe": dict(
        model_type="qwen2_moe", vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256, rope_theta=10000.0,
        tie_word_embeddings=False, rms_norm_eps=1e-6, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1],
        decoder_sparse_step=1, qkv_bias=True,
    ),
    # Qwen3-MoE: q/k norm, no shared expert, top-k probabilities renormalised, every layer MoE.
    "tiny-qwen3-moe": dict(
        model_type="qwen3_moe", vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=16, max_position_embeddings=256,
        rope_theta=1000000.0, tie_word_embeddings=False, rms_norm_eps=1e-6, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1,
    ),
    # GLM-4.5 MoE: q/k/v bias, q/k norm, half of each head rotary; layer 0 dense (first_k_dense_replace), then 8
    # experts routed by sigmoid scores with a score-correction bias, grouped top-2 (the best of 2 groups of 4),
    # weights renormalised and scaled by 2.5, one shared expert.
    "tiny-glm4-moe": dict(
        model_type="glm4_moe", vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=16, max_position_embeddings=256,
        rope_theta=1000000.0, partial_rotary_factor=0.5, tie_word_embeddings=False, rms_norm_eps=1e-5,
        attention_bias=True, use_qk_norm=True, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=32, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, num_nextn_predict_layers=0,
    ),
    # The shape of zai-org/GLM-4.5-Air: 46 layers (the first dense), 128 experts (top-8) and a shared expert, no
    # q/k norm, no grouping; its MTP layer (num_nextn_predict_layers) is not part of the transformers model.
    "glm-4.5-air": dict(
        model_type="glm4_moe", vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46,
        num_attention_heads=96, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rope_theta=1000000.0, partial_rotary_factor=0.5, tie_word_embeddings=False, rms_norm_eps=1e-5,
        attention_bias=True, use_qk_norm=False, n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8,
        moe_intermediate_size=1408, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
        norm_topk_prob=True, num_nextn_predict_layers=1,
    ),
    # DeepSeek-V3: multi-latent attention (q through a rank-24 latent, keys and values through a rank-16 one plus a
    # 4-dim rotary key, interleaved), YaRN rotary scaling with its mscales; layers 0-1 dense (first_k_dense_replace),
    # then 8 experts routed by sigmoid scores with a score-correction bias, grouped top-4 (the best 2 of 4 groups),
    # weights renormalised and scaled by 2.5, one shared expert; no MTP layer.
    "tiny-deepseek-v3": dict(
        model_type="deepseek_v3", vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, max_position_embeddings=256, rope_theta=10000.0,
        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32.0,
                             beta_slow=1.0, mscale=0.8, mscale_all_dim=1.0),
        tie_word_embeddings=False, rms_norm_eps=1e-6, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=4,
        moe_intermediate_size=32, first_k_dense_replace=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, num_nextn_predict_layers=0,
    ),
    # The same with one q_proj (q_lora_rank null, as DeepSeek-V2-Lite) and plain rotary embeddings.
    "tiny-deepseek-v3-q-proj": dict(
        model_type="deepseek_v3", vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, max_position_embeddings=256, rope_theta=10000.0,
        tie_word_embeddings=False, rms_norm_eps=1e-6, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=4,
        moe_intermediate_size=32, first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, num_nextn_predict_layers=0,
    ),
    # The shape of deepseek-ai/DeepSeek-V3 (and Kimi-K2's architecture at other sizes): 671 B parameters, 61 layers
    # (the first 3 dense) of 256 routed experts (top-8 of the best 4 of 8 groups) and a shared one, MLA, YaRN (factor
    # 40), one multi-token prediction layer (model.layers.61, which transformers' model does not hold).
    "deepseek-v3": dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840, rope_theta=10000.0,
        rope_parameters=dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                             beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        tie_word_embeddings=False, rms_norm_eps=1e-6, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
        moe_intermediate_size=2048, first_k_dense_replace=3, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        norm_topk_prob=True, num_nextn_predict_layers=1,
    ),
    # The shape of Qwen/Qwen3-30B-A3B: 48 layers of 128 experts (top-8), 18,867 HF tensors.
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, tie_word_embeddings=False, rms_norm_eps=1e-6, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True, mlp_only_layers=[],
        decoder_sparse_step=1,
    ),
    # The shape of Qwen/Qwen3-235B-A22B: 94 layers of 128 experts (top-8) of width 1536, 64 query heads over 4
    # key/value heads of 128; 36,945 HF tensors, 235.1 B parameters (470.2 GB in bf16).
    "qwen3-235b-a22b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
        num_attention_heads=64, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, tie_word_embeddings=False, rms_norm_eps=1e-6, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=1536, norm_topk_prob=True, mlp_only_layers=[],
        decoder_sparse_step=1,
    ),
    # The shape of Qwen/Qwen3-8B (weights are random: nothing is downloaded).
    "qwen3-8b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, tie_word_embeddings=False, rms_norm_eps=1e-6,
    ),
    # The shape of Qwen/Qwen3-4B (tied embeddings): what one GPU holds with fp32 masters and Adam's state beside a
    # colocated engine (``bench --delta``).
    "qwen3-4b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, tie_word_embeddings=True, rms_norm_eps=1e-6,
    ),
    # The shape of Qwen/Qwen3-1.7B (tied embeddings): ``bench --delta`` on an 80 GB GPU, masters and Adam's state on it.
    "qwen3-1.7b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, tie_word_embeddings=True, rms_norm_eps=1e-6,
    ),
    # Llama 3.1: no biases, Llama 3 rotary scaling (factor 8 beyond 8,192 positions). Llama 3.2's small models: the
    # same with the output layer tied to the embedding and factor 32.
    "tiny-llama": dict(
        model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=16384, tie_word_embeddings=False,
        rms_norm_eps=1e-5, rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                low_freq_factor=1.0, high_freq_factor=4.0,
                                                original_max_position_embeddings=8192),
    ),
    "tiny-llama-tied": dict(
        model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=16384, tie_word_embeddings=True,
        rms_norm_eps=1e-5, rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0,
                                                low_freq_factor=1.0, high_freq_factor=4.0,
                                                original_max_position_embeddings=8192),
    ),
    # Mistral: a head_dim that is not hidden / heads (as Mistral-Nemo's), no sliding window.
    "tiny-mistral": dict(
        model_type="mistral", vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=16, max_position_embeddings=256,
        rope_theta=1000000.0, tie_word_embeddings=False, rms_norm_eps=1e-5, sliding_window=None,
    ),
    # Mixtral: Llama's attention, 8 experts (top-2, renormalised) in every layer.
    "tiny-mixtral": dict(
        model_type="mixtral", vocab_size=1000, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256, rope_theta=1000000.0,
        tie_word_embeddings=False, rms_norm_eps=1e-5, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=None,
    ),
    # The shape of meta-llama/Llama-3.1-8B (weights are random: nothing is downloaded).
    "llama-3.1-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        tie_word_embeddings=False, rms_norm_eps=1e-5, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192),
    ),
}


def preset_config(name: str):
    """The transformers config of a preset."""
    from weightstream.models.spec import load_hf_config

    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    values = dict(PRESETS[name])
    theta = values.pop("rope_theta", None)
    cfg = load_hf_config(values)
    if theta is not None:
        if isinstance(getattr(cfg, "rope_parameters", None), dict):
            cfg.rope_parameters = {**cfg.rope_parameters, "rope_theta": theta}
        else:
            cfg.rope_theta = theta
    return cfg


def random_hf_model(config: Any, *, seed: int = 0, dtype: torch.dtype | None = None):
    """An HF causal LM for ``config`` whose every tensor (norms included) is random and distinct (``dtype``:
    default float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from weightstream.models.spec import load_hf_config

    cfg = load_hf_config(config)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype or torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.05
            base = 1.0 if name.endswith("norm.weight") or "layernorm" in name else 0.0
            p.copy_((noise + base).to(p.dtype))
        # Weights held in buffers (GLM-4.5's and DeepSeek-V3's e_score_correction_bias), after every parameter.
        params = {name for name, _ in model.named_parameters()}
        for name, b in model.state_dict().items():
            if name not in params and b.is_floating_point():
                b.copy_((torch.randn(b.shape, generator=gen, dtype=torch.float32) * 0.05).to(b.dtype))
    model.eval()
    return model


def save_random_checkpoint(config: Any, out_dir: str | os.PathLike, *, seed: int = 0,
                           dtype: torch.dtype | None = None) -> str:
    """Write a random HF checkpoint of ``config`` with ``save_pretrained``; return the directory."""
    model = random_hf_model(config, seed=seed, dtype=dtype)
    model.save_pretrained(os.fspath(out_dir))
    return os.fspath(out_dir)
