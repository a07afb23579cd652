"""What a model is: the facts of an HF config that conversion and model building need."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


def load_hf_config(config: Any):
    """A ``transformers`` config from a config object, a dict (with ``model_type``) or a directory."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return config
    if isinstance(config, dict):
        data = dict(config)
        model_type = data.pop("model_type")
        return AutoConfig.for_model(model_type, **data)
    if isinstance(config, (str, os.PathLike)):
        return AutoConfig.from_pretrained(os.fspath(config))
    raise TypeError(f"expected a transformers config, a dict or a directory, got {type(config).__name__}")


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(cfg, "rope_theta", 10000.0))


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model's shape, read from its HF config; everything a converter and a model builder need."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    # Mixture of experts (num_experts == 0 for dense models).
    num_experts: int = 0
    moe_intermediate_size: int = 0
    moe_top_k: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: frozenset[int] = field(default_factory=frozenset)

    @property
    def q_per_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer not in self.dense_layers

    @classmethod
    def from_hf_config(cls, config: Any, features: Callable[[Any], dict[str, Any]]) -> ModelSpec:
        """The spec of an HF config; ``features``: what the family reads from it besides the common fields (a
        converter's ``features``; :func:`weightstream.converters.model_spec` passes the registered one)."""
        cfg = load_hf_config(config)
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        values: dict[str, Any] = dict(
            model_type=cfg.model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=getattr(cfg, "intermediate_size", 0) or 0,
            num_layers=cfg.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(cfg),
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        )
        values.update(features(cfg))
        spec = cls(**values)
        spec.validate()
        return spec

    def validate(self) -> None:
        problems = []
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "head_dim"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        if self.is_moe:
            if self.moe_intermediate_size <= 0:
                problems.append(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
            if not 0 < self.moe_top_k <= self.num_experts:
                problems.append(f"experts per token ({self.moe_top_k}) must be in 1..num_experts ({self.num_experts})")
            if len(self.dense_layers) == self.num_layers:
                problems.append("every layer is dense (mlp_only_layers / decoder_sparse_step leave no MoE layer)")
            if self.dense_layers and self.intermediate_size <= 0:
                problems.append(f"dense layers {sorted(self.dense_layers)} need intermediate_size > 0")
        if problems:
            raise ValueError(f"invalid {self.model_type} config: " + "; ".join(problems))


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling engines use on the wire)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype
