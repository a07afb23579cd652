"""Plans are made once and kept: repeated streams of one live model reuse the table, bucket plan and
copy programs, see values changed in place, and re-plan whenever the model, its storage, the bucket
settings or the parallel layout change (all ranks together). Real Megatron-Core models, real gloo jobs."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.workers import run_plan_reuse
from weightstream.launch import launch
from weightstream.models.presets import preset_config, random_hf_model


@pytest.fixture(scope="module")
def moe_bf16_fp32_router(tmp_path_factory) -> str:
    model = random_hf_model(preset_config("tiny-qwen3-moe"), seed=41, dtype=torch.bfloat16)
    for layer in model.model.layers:
        layer.mlp.gate.to(torch.float32)
    out = tmp_path_factory.mktemp("plan_cache") / "moe"
    model.save_pretrained(out)
    return str(out)


EXPECTED = [  # (label, planned)
    ("first", True), ("again", False), ("in place x2", False), ("parameter replaced", True),
    ("fresh plan after clear_plans", True), ("new storage on the last rank", True), ("kept again", False),
    ("submodule replaced", True), ("fresh plan after the swap", True),
    ("another bucket size", True), ("per_rank", True), ("first bucket size again", False),
    ("split dtypes", True), ("unsplit", False), ("new parallel state", True),
]


@pytest.mark.parametrize("tp", [1, 2])
def test_plan_made_once_and_replanned_on_change(moe_bf16_fp32_router, tp):
    results = launch(tp, run_plan_reuse, moe_bf16_fp32_router, tp)
    for r in results:
        steps = r["steps"]
        assert [(s["label"], s["planned"]) for s in steps] == EXPECTED, (r["rank"], steps)
        assert [s["builds"] for s in steps] == [int(p) for _, p in EXPECTED]
        assert r["again_equal"], "a kept plan gave other bytes than the first stream"
        assert r["doubled_equal"], "values changed in place did not reach the kept plan's stream"
        assert r["replaced_equal_fresh"], "after a parameter was replaced the stream differs from a fresh plan's"
        assert r["swapped_equal_fresh"], "after a submodule was replaced the stream differs from a fresh plan's"
        assert r["split_equal"], "split_dtypes changed the tensors"
        per_bucket = r["split_dtypes_per_bucket"]
        assert all(len(d) == 1 for d in per_bucket), per_bucket
        assert {d[0] for d in per_bucket} == {"torch.bfloat16", "torch.float32"}
        first = steps[0]
        if tp == 1:  # every tensor is a view of its parameter: all packed by the batched copies
            assert first["unbatched"] == 0 and first["batched"] == first["tensors"] > 0
            # gate and up are the two halves of one Megatron parameter, back to back in the bucket: one copy
            assert first["copies"] == first["batched"] - first["gate_projs"] and first["gate_projs"] > 0
        else:  # TP-split tensors are gathered, then converted one by one; the rest are batched
            assert first["unbatched"] > 0 and first["batched"] > 0
