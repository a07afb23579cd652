"""Llama (3 / 3.1 / 3.2, ``llama``) and Mistral (``mistral``): Qwen2's layout without the q/k/v bias.

Dense, grouped-query attention, no bias anywhere; Llama 3.2's small models tie the output layer to the embedding.
Rotary scaling changes no weight: it is carried by the HF config (``rope_parameters``, written as it is with
every checkpoint) and read into ``ModelSpec.llama3_rope`` for the Megatron-Core model built for the config.
"""

from __future__ import annotations

from typing import Any

from weightstream.converters.qwen2 import QWEN2, L

__all__ = ["llama_features", "LLAMA", "MISTRAL"]


def llama_features(config: Any) -> dict[str, Any]:
    """No q/k/v bias, no q/k norm; a config with biases (``attention_bias``, ``mlp_bias``: q/k/v/o and MLP biases
    that Megatron's ``add_bias_linear`` would hold) is refused, each named."""
    biased = [k for k in ("attention_bias", "mlp_bias") if getattr(config, k, False)]
    if biased:
        raise ValueError(f"{config.model_type} configs with {' and '.join(biased)} are not supported: the "
                         f"{config.model_type} converter declares no bias")
    return {"qkv_bias": False, "qk_norm": False}


LLAMA = QWEN2.derive("llama", remove=[f"{L}.self_attention.linear_qkv.bias"], features=llama_features)
# Mistral's tensors are Llama's; its sliding window (where a config has one) changes no weight either.
MISTRAL = LLAMA.derive("mistral")
