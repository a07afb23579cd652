"""Bad input in real jobs: one clear error on every rank, naming every offending tensor."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers.workers import Case, run_error_case
from weightstream.common.hf_files import CheckpointReader
from weightstream.jobs import Layout, dump_job
from weightstream.launch import LaunchError, launch


def test_errors_are_raised_alike_on_every_rank(sources):
    case = Case(sources["tiny-qwen3"], Layout(2, 1))
    # An unmapped parameter on some ranks' chunks.
    results = launch(2, run_error_case, case, "extra_param", {})
    for r in results:
        assert r["type"] == "ConversionError", r
        assert r["problems"]["Megatron tensors no mapping covers"] == [
            "decoder.layers.0.mlp.extra_scale",
            "decoder.final_layernorm.stray",
        ]
    # A config whose shapes do not match the model: every offending tensor is named.
    results = launch(2, run_error_case, case, "", {"num_key_value_heads": 2, "intermediate_size": 80})
    for r in results:
        assert r["type"] == "ConversionError", r
        mismatched = r["problems"]["shape mismatches"]
        for layer in range(4):
            for proj in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"):
                assert any(f"model.layers.{layer}.self_attn.{proj}" in m or f"model.layers.{layer}.mlp.{proj}" in m
                           for m in mismatched), (layer, proj, mismatched)
    # An unknown model type.
    results = launch(2, run_error_case, case, "", {"model_type": "phi3"})
    for r in results:
        assert r["type"] == "UnknownModelError", r
        assert "qwen2" in r["message"] and "qwen3" in r["message"] and "phi3" in r["message"]


def test_loading_a_checkpoint_with_missing_and_extra_tensors(sources, tmp_path):
    src = sources["tiny-qwen2"]
    broken = tmp_path / "broken"
    broken.mkdir()
    with CheckpointReader(src) as r:
        tensors = {k: r.get(k).clone() for k in r.keys()}
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    del tensors["model.norm.weight"]
    tensors["model.layers.0.mlp.surprise.weight"] = torch.ones(2)
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(f"{src}/config.json", broken / "config.json")
    with pytest.raises(LaunchError) as err:
        launch(2, dump_job, str(broken), Layout(2, 1), str(tmp_path / "out"), 1 << 20)
    text = str(err.value)
    for rank in (0, 1):
        assert f"rank {rank} failed" in text
    assert "model.layers.1.self_attn.k_proj.bias" in text
    assert "model.norm.weight" in text
    assert "model.layers.0.mlp.surprise.weight" in text
    assert not (tmp_path / "out").exists()
