"""Qwen3 (dense): Qwen2 plus q/k RMSNorm per head; q/k/v bias only if ``attention_bias``."""

from __future__ import annotations

from typing import Any

from weightstream.converters.mapping import Mapping
from weightstream.converters.qwen2 import QWEN2, H, L

__all__ = ["QK_NORM", "qwen3_features", "QWEN3"]


QK_NORM = (
    Mapping(f"{L}.self_attention.q_layernorm.weight", f"{H}.self_attn.q_norm.weight"),
    Mapping(f"{L}.self_attention.k_layernorm.weight", f"{H}.self_attn.k_norm.weight"),
)


def qwen3_features(config: Any) -> dict[str, Any]:
    return {"qkv_bias": bool(getattr(config, "attention_bias", False)), "qk_norm": True}


QWEN3 = QWEN2.derive("qwen3", add=QK_NORM, features=qwen3_features)
