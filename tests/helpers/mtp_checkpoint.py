"""A DeepSeek-V3 checkpoint with its multi-token prediction layers, as the published checkpoints hold them:
transformers' model has none, so ``save_pretrained`` writes the decoder and the MTP tensors are added here."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from weightstream.common.hf_files import CheckpointReader
from weightstream.converters.deepseek_v3 import mtp_tensors
from weightstream.converters.expected import expected_hf_shapes
from weightstream.converters.registry import model_spec
from weightstream.models.presets import random_hf_model


def save_mtp_checkpoint(config, out_dir: str, *, seed: int) -> str:
    """``save_pretrained`` of a random model of ``config`` (which declares ``num_nextn_predict_layers``), plus
    random MTP layers (norms about 1) whose embedding and output-layer copies equal the model's."""
    random_hf_model(config, seed=seed).save_pretrained(out_dir)
    with CheckpointReader(out_dir) as reader:
        tensors = {n: reader.get(n).clone() for n in reader.keys()}
    spec = model_spec(config)
    shapes = expected_hf_shapes(config)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, shape in mtp_tensors(spec, {n: s for n, s in shapes.items() if n in tensors}).items():
        if name.endswith("embed_tokens.weight"):
            tensors[name] = tensors["model.embed_tokens.weight"].clone()
        elif name.endswith("shared_head.head.weight"):
            tensors[name] = tensors["lm_head.weight"].clone()
        else:
            base = 1.0 if name.endswith("norm.weight") else 0.0
            tensors[name] = torch.randn(shape, generator=gen) * 0.05 + base
    for f in os.listdir(out_dir):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.remove(os.path.join(out_dir, f))
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json")) as f:
        assert json.load(f)["num_nextn_predict_layers"] == spec.mtp_layers
    return out_dir
