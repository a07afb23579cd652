"""Qwen2-MoE / Qwen3-MoE over real Megatron-Core MoE models in real gloo jobs, layout by layout.

Expert parallel (EP 1, 2, 4), EP x TP, EP x PP (and VPP), expert-TP different from dense TP,
Transformer Engine grouped-GEMM names, per_rank mode, a float32 router in a bf16 model, the
refusal of Megatron's expert bias, and the memory bound with many small experts. Two launches
(2 and 4 processes) run every case, to keep process start-ups few on a two-core machine.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.conftest import hf_logits
from tests.helpers.checks import assert_full_exact, assert_logits_close, assert_per_rank_experts, by_label
from tests.helpers.workers import INPUT_IDS, Case, run_cases
from weightstream.jobs import Layout
from weightstream.launch import launch
from weightstream.models.presets import preset_config, random_hf_model, save_random_checkpoint

MOE = ("tiny-qwen2-moe", "tiny-qwen3-moe")
EXPERTS = 8
_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


@pytest.fixture(scope="module")
def moe_sources(tmp_path_factory) -> dict[str, str]:
    """Random HF MoE checkpoints written by ``save_pretrained``: the truth every case compares against."""
    root = tmp_path_factory.mktemp("moe_sources")
    out = {name: save_random_checkpoint(preset_config(name), root / name, seed=20 + i) for i, name in enumerate(MOE)}
    # bf16 weights with float32 routers, as many MoE trainers keep them.
    model = random_hf_model(preset_config("tiny-qwen3-moe"), seed=30, dtype=torch.bfloat16)
    for layer in model.model.layers:
        layer.mlp.gate.to(torch.float32)
    model.save_pretrained(root / "bf16-fp32-router")
    out["bf16-fp32-router"] = str(root / "bf16-fp32-router")
    return out


@pytest.fixture(scope="module")
def references(moe_sources) -> dict[str, torch.Tensor]:
    """Logits of Qwen2MoeForCausalLM / Qwen3MoeForCausalLM loaded from the source checkpoints."""
    return {f: hf_logits(moe_sources[f], INPUT_IDS) for f in MOE}


def _assert_logits(results: list[dict], ref: torch.Tensor) -> None:
    assert ref.abs().max().item() > 0.1  # the comparison is not between near-zero tensors
    for r in results:
        assert_logits_close(r["logits"], ref, atol=1e-5)


def test_moe_world2_ep1_ep2_expert_tp_grouped_per_rank_router_dtype_expert_bias(moe_sources, references):
    src = moe_sources
    cases = []
    for f in MOE:
        cases += [
            Case(src[f], Layout(1, 1, ep=1), label=f"ep1 {f}", logits=True),
            Case(src[f], Layout(1, 1, ep=2), label=f"ep2 {f}", logits=True),
            # Expert-TP 2 under dense TP 1: the experts are split over a group that is not the TP group.
            Case(src[f], Layout(1, 1, ep=1, etp=2), label=f"etp2 {f}", logits=True),
            Case(src[f], Layout(1, 1, ep=2), te_names=True, grouped_experts=True, label=f"ep2 grouped {f}"),
            Case(src[f], Layout(1, 1, ep=2), mode="per_rank", label=f"ep2 per_rank {f}"),
        ]
    cases.append(Case(src["bf16-fp32-router"], Layout(1, 1, ep=2), dtype="bfloat16", router_dtype="float32",
                      label="ep2 bf16 fp32 router"))
    errors = [(Case(src["tiny-qwen3-moe"], Layout(1, 1, ep=2), label="expert bias"), "expert_bias", {})]
    results = by_label(launch(2, run_cases, cases, errors))

    for f in MOE:
        for layout in ("ep1", "ep2", "etp2", "ep2 grouped"):
            assert_full_exact(results[f"{layout} {f}"], src[f])
        for layout in ("ep1", "ep2", "etp2"):
            _assert_logits(results[f"{layout} {f}"], references[f])
        for r in results[f"ep2 {f}"]:
            assert r["stats"].broadcasts > 0 and r["stats"].gathers == 0
        for r in results[f"etp2 {f}"]:
            assert r["stats"].gathers > 0  # experts all-gathered over expert-TP, nothing over dense TP
        # Grouped-GEMM names: the same HF tensors as SequentialMLP names (both bit-identical to the
        # source above), the experts in the same order (TE's fused norms move within their layer).
        for seq, grouped in zip(results[f"ep2 {f}"], results[f"ep2 grouped {f}"], strict=True):
            assert sorted(grouped["names"]) == sorted(seq["names"])
            experts = [[n for n in r["names"] if _EXPERT.search(n)] for r in (seq, grouped)]
            assert experts[0] == experts[1] and len(experts[0]) == 3 * EXPERTS * (3 if "qwen2" in f else 4)
        per_rank = results[f"ep2 per_rank {f}"]
        assert_per_rank_experts(per_rank, src[f], EXPERTS, ep=2, tp=1, etp=1)
        for r in per_rank:
            assert r["stats"].gathers == 0 and r["stats"].broadcasts == 0, "per_rank mode must not gather over EP"

    # The router keeps its dtype: float32 in a bf16 model, bit for bit (and the rest stays bf16).
    assert_full_exact(results["ep2 bf16 fp32 router"], src["bf16-fp32-router"])

    # Megatron's expert bias has no place in Qwen MoE models: refused when streaming and when loading,
    # naming every router that holds one.
    for r in results["expert bias"]:
        for err in (r, r["load"]):
            assert err["type"] == "ConversionError", err
            refused = err["problems"]["Megatron tensors the HF model has no place for"]
            assert [x.split(":")[0] for x in refused] == [f"decoder.layers.{i}.mlp.router.expert_bias"
                                                          for i in range(4)]
            assert "e_score_correction_bias" in refused[0]


def test_moe_world4_ep4_ep2tp2_ep2pp2_vpp_etp_per_rank_bounds(moe_sources, references):
    src = moe_sources
    limit = 64 << 10
    cases = []
    for f in MOE:
        cases += [
            Case(src[f], Layout(1, 1, ep=4), label=f"ep4 {f}", logits=True),
            Case(src[f], Layout(2, 1, ep=2), label=f"ep2 tp2 {f}", logits=True),  # expert-TP = TP = 2
            Case(src[f], Layout(1, 2, ep=2), label=f"ep2 pp2 {f}", logits=True),
            Case(src[f], Layout(2, 1, ep=2, etp=1), label=f"ep2 tp2 etp1 {f}"),
        ]
    cases += [
        Case(src["tiny-qwen2-moe"], Layout(1, 2, vpp=2, ep=2), label="ep2 pp2 vpp2", logits=True),
        Case(src["tiny-qwen3-moe"], Layout(1, 1, ep=2, etp=2), grouped_experts=True, bucket_bytes=limit,
             label="ep2 etp2 grouped"),
        Case(src["tiny-qwen2-moe"], Layout(2, 1, ep=2), mode="per_rank", label="ep2 tp2 per_rank"),
        Case(src["tiny-qwen3-moe"], Layout(1, 1, ep=4), mode="per_rank", label="ep4 per_rank"),
        Case(src["tiny-qwen3-moe"], Layout(1, 2, ep=2), mode="per_rank", label="ep2 pp2 per_rank"),
        Case(src["tiny-qwen2-moe"], Layout(1, 1, ep=2, etp=2), mode="per_rank", label="ep2 etp2 per_rank"),
    ]
    results = by_label(launch(4, run_cases, cases))

    for f in MOE:
        for layout in ("ep4", "ep2 tp2", "ep2 pp2", "ep2 tp2 etp1"):
            assert_full_exact(results[f"{layout} {f}"], src[f])
        for layout in ("ep4", "ep2 tp2", "ep2 pp2"):
            _assert_logits(results[f"{layout} {f}"], references[f])
    assert_full_exact(results["ep2 pp2 vpp2"], src["tiny-qwen2-moe"])
    _assert_logits(results["ep2 pp2 vpp2"], references["tiny-qwen2-moe"])
    assert_full_exact(results["ep2 etp2 grouped"], src["tiny-qwen3-moe"])

    assert_per_rank_experts(results["ep2 tp2 per_rank"], src["tiny-qwen2-moe"], EXPERTS, ep=2, tp=2, etp=2)
    assert_per_rank_experts(results["ep4 per_rank"], src["tiny-qwen3-moe"], EXPERTS, ep=4, tp=1, etp=1)
    assert_per_rank_experts(results["ep2 pp2 per_rank"], src["tiny-qwen3-moe"], EXPERTS, ep=2, tp=1, etp=1)
    assert_per_rank_experts(results["ep2 etp2 per_rank"], src["tiny-qwen2-moe"], EXPERTS, ep=2, tp=1, etp=2)
    for label in ("ep2 tp2 per_rank", "ep4 per_rank", "ep2 etp2 per_rank"):
        for r in results[label]:
            assert r["stats"].gathers == 0 and r["stats"].broadcasts == 0, label

    # Many small experts: batched per bucket (one expert-TP all-gather per bucket, not one per
    # tensor), many tensors per bucket, and staging within two buckets plus the largest tensor.
    for r in results["ep2 etp2 grouped"]:
        stats = r["stats"]
        assert stats.gathers <= stats.buckets
        for size, count in zip(r["bucket_sizes"], r["tensors_per_bucket"], strict=True):
            assert size <= limit or count <= 3, (size, count)
        assert stats.peak_staging_bytes <= 2 * max(limit, r["largest_tensor"]) + r["largest_tensor"]
        expert_only = [n for n in _bucket_names(r) if all(_EXPERT.search(x) for x in n)]
        # An expert tensor here is 8 KiB: a 64 KiB bucket holds 8; greedy packing leaves at most one slot empty.
        assert len(expert_only) >= 8 and min(len(n) for n in expert_only) >= 7, [len(n) for n in expert_only]


def _bucket_names(r: dict) -> list[list[str]]:
    out, pos = [], 0
    for count in r["tensors_per_bucket"]:
        out.append(r["names"][pos : pos + count])
        pos += count
    return out
