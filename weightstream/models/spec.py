"""What a model is: the facts of an HF config that conversion and model building need."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ConfigFields", "transformers_knows", "load_hf_config", "hf_model_problem", "YarnRope", "yarn_rope", "Llama3Rope",
    "rope_type", "llama3_rope", "ModelSpec", "dtype_name", "dtype_from_name"
]


@dataclass(frozen=True, slots=True, eq=False)
class ConfigFields:
    """The fields of an HF config whose ``model_type`` transformers does not know, exactly as given (a
    ``config.json`` or a dict), read as attributes the way a transformers config is (``cfg.hidden_size``).

    Nothing is interpreted or run: an ``auto_map`` and the ``configuration_*.py`` / ``modeling_*.py`` it names
    (a ``trust_remote_code`` model) are kept for whoever loads the model, and conversion needs only these fields.
    """

    fields: Mapping[str, Any]

    def __getattr__(self, name: str) -> Any:
        if name == "fields":  # while unpickling, before the slot is set
            raise AttributeError(name)
        try:
            return self.fields[name]
        except KeyError:
            raise AttributeError(f"the {self.fields.get('model_type')!r} config has no field {name!r}") from None

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(dict(self.fields))

    def with_fields(self, **values: Any) -> ConfigFields:
        """These fields with ``values`` set."""
        return ConfigFields({**self.fields, **values})

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """``config.json`` in ``directory``, holding these fields."""
        Path(directory, "config.json").write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")


def transformers_knows(model_type: str) -> bool:
    """Whether transformers has a config class for ``model_type`` (its own, or one ``AutoConfig.register`` added)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


def _config_from_dict(data: Mapping[str, Any], where: str) -> Any:
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"{where} has no model_type")
    if not transformers_knows(model_type):
        return ConfigFields(dict(data))
    from transformers import AutoConfig

    values = dict(data)
    values.pop("model_type")
    return AutoConfig.for_model(model_type, **values)


def _config_from_directory(directory: str) -> Any:
    path = Path(directory, "config.json")
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise OSError(f"{directory} has no config.json") from None
    except ValueError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    if not transformers_knows(str(data.get("model_type"))):
        return _config_from_dict(data, str(path))
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(directory)


def load_hf_config(config: Any) -> Any:
    """The config of a model: a transformers config of any class (as it is), a dict with ``model_type``, or a
    directory with ``config.json``. A ``model_type`` transformers knows gives its config class (with its defaults
    for what the dict or file leaves out); any other gives :class:`ConfigFields`, the fields as written, so that a
    model transformers does not know converts once a converter is registered for it (no code of the model is run).
    """
    from transformers import PretrainedConfig

    if isinstance(config, (PretrainedConfig, ConfigFields)):
        return config
    if isinstance(config, dict):
        return _config_from_dict(config, "the config dict")
    if isinstance(config, (str, os.PathLike)):
        return _config_from_directory(os.fspath(config))
    raise TypeError(f"expected a transformers config, a dict or a directory, got {type(config).__name__}")


def hf_model_problem(config: Any) -> str | None:
    """Why transformers cannot build the model of ``config`` (which the reference engine and logits checks run),
    or None when it can: it has a causal-LM class for the config's class, its own or one registered with
    ``AutoModelForCausalLM.register``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cfg = load_hf_config(config)
    if not isinstance(cfg, ConfigFields) and type(cfg) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return None
    remote = isinstance(cfg, ConfigFields) and "AutoModelForCausalLM" in (cfg.fields.get("auto_map") or {})
    code = (" (its config names remote code in auto_map, which this process does not run: the model's code "
            "must be importable and registered with AutoConfig.register and AutoModelForCausalLM.register)"
            if remote else "")
    return (f"transformers has no causal-LM model for model_type {cfg.model_type!r}{code}; converting, dumping "
            "and streaming it need only a registered converter, but running the model (an engine, logits) needs "
            "the model class in transformers")


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(cfg, "rope_theta", 10000.0))


@dataclass(frozen=True, slots=True)
class YarnRope:
    """YaRN rotary scaling (``rope_parameters`` with ``rope_type: yarn``; DeepSeek-V3's): the frequencies
    interpolated by ``factor`` between the ``beta_fast``/``beta_slow`` bounds, cos/sin scaled by
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``, and MLA's softmax scale by ``mscale(factor,
    mscale_all_dim)`` squared."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


def yarn_rope(cfg) -> YarnRope | None:
    """The YaRN scaling an HF config declares (``rope_parameters``, or ``rope_scaling`` in older configs)."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    if not isinstance(params, dict) or params.get("rope_type", params.get("type")) != "yarn":
        return None
    mscale_all_dim = float(params.get("mscale_all_dim") or 0.0)
    return YarnRope(
        factor=float(params["factor"]),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings")
                                             or cfg.max_position_embeddings),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        # transformers reads mscale only together with mscale_all_dim (else cos/sin take mscale(factor, 1)).
        mscale=float(params.get("mscale") or 1.0) if mscale_all_dim else 1.0,
        mscale_all_dim=mscale_all_dim,
    )


@dataclass(frozen=True, slots=True)
class Llama3Rope:
    """Llama 3.1 / 3.2 rotary scaling (``rope_type: llama3``): frequencies whose wavelength exceeds
    ``original_max_position_embeddings / low_freq_factor`` divided by ``factor``, those below ``... /
    high_freq_factor`` kept, those between interpolated smoothly."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def _rope_params(cfg) -> dict[str, Any]:
    """The rotary parameters of an HF config (``rope_parameters``, or ``rope_scaling`` in older configs)."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    return params if isinstance(params, dict) else {}


def rope_type(cfg) -> str:
    """The rotary embedding an HF config declares: ``default``, ``llama3``, ``yarn``, ``linear``, ..."""
    params = _rope_params(cfg)
    return str(params.get("rope_type", params.get("type")) or "default")


def llama3_rope(cfg) -> Llama3Rope | None:
    """The Llama 3 scaling an HF config declares (None where its rotary embedding is another)."""
    if rope_type(cfg) != "llama3":
        return None
    params = _rope_params(cfg)
    return Llama3Rope(
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings")
                                             or cfg.max_position_embeddings),
    )


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
    # Routing: "softmax" or "sigmoid" scores; a per-expert score-correction bias added to the scores that choose
    # the experts, not to the weights (HF ``e_score_correction_bias``, Megatron's router ``expert_bias``); grouped
    # top-k (``moe_num_groups`` groups of experts, the best ``moe_group_top_k`` of them kept; 0: no grouping);
    # the factor the chosen experts' weights are scaled by.
    moe_score_function: str = "softmax"
    moe_expert_bias: bool = False
    moe_num_groups: int = 0
    moe_group_top_k: int = 0
    moe_routed_scaling_factor: float = 1.0
    # Whether the shared expert's output is scaled by a sigmoid gate of its own (Qwen2-MoE), or added as it is.
    shared_expert_gate: bool = False
    # The share of each head's dimensions that rotary embeddings turn (the first ones; the rest pass as they are).
    partial_rotary_factor: float = 1.0
    # Multi-latent attention (DeepSeek-V3; kv_lora_rank == 0: not MLA): queries through a low-rank latent
    # (q_lora_rank; None: one q_proj), keys and values through one latent of kv_lora_rank plus a rotary key of
    # qk_rope_head_dim shared by all heads; per head, qk_nope_head_dim + qk_rope_head_dim query/key dimensions and
    # v_head_dim value dimensions.
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Multi-token prediction layers the checkpoint holds after the decoder's (HF num_nextn_predict_layers).
    mtp_layers: int = 0
    yarn: YarnRope | None = None
    # The rotary embedding the config declares (``rope_type``: default, llama3, yarn, ...), and Llama 3's scaling.
    rope_type: str = "default"
    llama3_rope: Llama3Rope | None = None

    @property
    def q_per_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

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
            rope_type=rope_type(cfg),
            llama3_rope=llama3_rope(cfg),
        )
        values.update(features(cfg))
        spec = cls(**values)
        spec.validate()
        return spec

    def _routing_problems(self) -> list[str]:
        problems = []
        if self.moe_score_function not in ("softmax", "sigmoid"):
            problems.append(f"moe_score_function must be 'softmax' or 'sigmoid', got {self.moe_score_function!r}")
        if self.moe_expert_bias and self.moe_score_function != "sigmoid":
            problems.append("an expert score-correction bias (moe_expert_bias) goes with sigmoid scores only")
        if self.moe_num_groups < 0 or self.moe_group_top_k < 0:
            problems.append(f"moe_num_groups ({self.moe_num_groups}) and moe_group_top_k ({self.moe_group_top_k}) "
                            "cannot be negative")
        elif self.moe_num_groups and self.num_experts % self.moe_num_groups:
            problems.append(f"num_experts ({self.num_experts}) is not a multiple of moe_num_groups "
                            f"({self.moe_num_groups})")
        elif self.moe_group_top_k > self.moe_num_groups:
            problems.append(f"moe_group_top_k ({self.moe_group_top_k}) is more than moe_num_groups "
                            f"({self.moe_num_groups})")
        elif self.moe_num_groups and not self.moe_group_top_k:
            problems.append(f"moe_num_groups={self.moe_num_groups} needs moe_group_top_k >= 1")
        if self.moe_routed_scaling_factor <= 0:
            problems.append(f"moe_routed_scaling_factor must be positive, got {self.moe_routed_scaling_factor}")
        return problems

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
            problems += self._routing_problems()
        if self.shared_expert_gate and self.shared_expert_intermediate_size <= 0:
            problems.append("shared_expert_gate needs a shared expert (shared_expert_intermediate_size > 0)")
        rotary = self.head_dim * self.partial_rotary_factor
        if not 0 < self.partial_rotary_factor <= 1 or rotary != int(rotary) or int(rotary) % 2:
            problems.append(f"partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1] and turn an even "
                            f"number of each head's {self.head_dim} dimensions")
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
