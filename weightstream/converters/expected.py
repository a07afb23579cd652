"""The Hugging Face side: which tensors a checkpoint of a config holds, and with which shapes.

transformers builds the model (on the meta device: no memory); each tensor it holds in memory is turned into
the checkpoint's tensors by the family's in-memory declarations (:meth:`Converter.in_memory`: transformers 5
holds MoE experts fused, checkpoints and engines one tensor per expert), their shapes computed by the
declared op itself. Tied copies (the output embedding of a model that ties it to the input one) are left out;
tensors a family's checkpoints hold that transformers' model does not (``Converter.checkpoint_only``: DeepSeek-V3's
multi-token prediction layers) are added.

A model transformers has no class for (a model type it does not know, registered with weightstream only) has no
such list: its HF tensors are those its converter's declarations make (:func:`hf_model_shapes` gives None).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch
from torch import nn

from weightstream.converters.ops import OpContext
from weightstream.converters.registry import get_converter, model_spec
from weightstream.errors import WeightstreamError
from weightstream.models.spec import hf_model_problem, load_hf_config

__all__ = ["hf_model_shapes", "expected_hf_shapes"]


def _tied_names(model: nn.Module, tied: bool) -> set[str]:
    """The names of the output embedding's tensors where the config ties it to the input embedding."""
    if not tied:
        return set()
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return set()
    out = model.get_output_embeddings()
    return {f"{name}.{p}" for name, m in model.named_modules() if m is out for p, _ in m.named_parameters()}


@functools.lru_cache(maxsize=16)
def _expected_from_json(config_json: str) -> dict[str, tuple[int, ...]] | None:
    from transformers import AutoModelForCausalLM

    cfg = load_hf_config(json.loads(config_json))
    if hf_model_problem(cfg) is not None:
        return None
    spec = model_spec(cfg)
    converter = get_converter(cfg.model_type)
    in_memory = converter.in_memory()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    tied = _tied_names(model, bool(cfg.tie_word_embeddings))
    out: dict[str, tuple[int, ...]] = {}
    ctx = OpContext(spec)
    for name, tensor in model.state_dict().items():
        resolved = None if name in tied else in_memory.resolve(name, spec)
        if resolved is None:
            continue
        made = resolved.mapping.op.to_hf(tensor, ctx)
        out.update({n: tuple(t.shape) for n, t in zip(resolved.hf_names, made, strict=True)})
    if converter.checkpoint_only is not None:
        out.update(converter.checkpoint_only(spec, out))
    return out


def hf_model_shapes(config: Any) -> dict[str, tuple[int, ...]] | None:
    """Checkpoint name -> shape of every tensor an HF checkpoint of ``config`` holds (tied copies left out); None
    where transformers has no model class for the config (then the converter's declarations say what it holds)."""
    cfg = load_hf_config(config)
    data = {k: v for k, v in cfg.to_dict().items() if k not in ("transformers_version", "_name_or_path")}
    shapes = _expected_from_json(json.dumps(data, sort_keys=True, default=str))
    return None if shapes is None else dict(shapes)


def expected_hf_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor an HF checkpoint of ``config`` holds (tied copies left out); a
    config transformers has no model class for raises, saying so."""
    shapes = hf_model_shapes(config)
    if shapes is None:
        raise WeightstreamError(hf_model_problem(config) or "transformers has no model for this config")
    return shapes
