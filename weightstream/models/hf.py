"""The Hugging Face side: which tensors a checkpoint of a config holds, and with which shapes."""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import torch

from weightstream.models.spec import load_hf_config

# transformers 5 holds MoE experts fused in memory (``mlp.experts.gate_up_proj`` of shape
# (E, 2 * I, H), ``mlp.experts.down_proj`` of shape (E, H, I)); checkpoints, and every engine,
# use one tensor per expert. These expand the in-memory names to the checkpoint names.
_FUSED_GATE_UP = re.compile(r"^(.*\.mlp\.experts)\.gate_up_proj$")
_FUSED_DOWN = re.compile(r"^(.*\.mlp\.experts)\.down_proj$")


def _checkpoint_entries(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    m = _FUSED_GATE_UP.match(name)
    if m and len(shape) == 3:
        e, two_i, h = shape
        return [
            (f"{m.group(1)}.{x}.{proj}.weight", (two_i // 2, h)) for x in range(e) for proj in ("gate_proj", "up_proj")
        ]
    m = _FUSED_DOWN.match(name)
    if m and len(shape) == 3:
        e, h, i = shape
        return [(f"{m.group(1)}.{x}.down_proj.weight", (h, i)) for x in range(e)]
    return [(name, shape)]


@functools.lru_cache(maxsize=16)
def _expected_from_json(config_json: str) -> dict[str, tuple[int, ...]]:
    from transformers import AutoModelForCausalLM

    cfg = load_hf_config(json.loads(config_json))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    tied = set(getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or ())
    if not getattr(cfg, "tie_word_embeddings", False):
        tied = set()
    out: dict[str, tuple[int, ...]] = {}
    for name, tensor in model.state_dict().items():
        if name in tied:
            continue
        for cname, shape in _checkpoint_entries(name, tuple(tensor.shape)):
            out[cname] = shape
    return out


def expected_hf_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor an HF checkpoint of ``config`` holds (tied copies left out)."""
    cfg = load_hf_config(config)
    data = cfg.to_dict()
    data = {k: v for k, v in data.items() if k not in ("transformers_version", "_name_or_path")}
    return dict(_expected_from_json(json.dumps(data, sort_keys=True, default=str)))
