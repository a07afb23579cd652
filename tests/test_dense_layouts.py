"""Qwen2 / Qwen3 dense over real Megatron-Core models in real gloo jobs, layout by layout.

Each launch runs several cases in one job (parallel state is rebuilt between cases), to keep the
number of process start-ups small on a two-core machine.
"""

from __future__ import annotations

import pytest

from tests.conftest import FAMILIES, hf_logits
from tests.helpers.checks import (
    assert_full_exact,
    assert_logits_close,
    assert_per_rank_assembles,
    by_label,
    source_keys,
)
from tests.helpers.workers import INPUT_IDS, Case, run_cases
from weightstream.jobs import Layout
from weightstream.launch import launch


def test_tp1_pp1_all_families(sources):
    cases = [Case(sources[f], Layout(1, 1), label=f, logits=True) for f in FAMILIES]
    results = by_label(launch(1, run_cases, cases))
    for f in FAMILIES:
        assert_full_exact(results[f], sources[f])
        assert_logits_close(results[f][0]["logits"], hf_logits(sources[f], INPUT_IDS))


def test_world2_tp2_pp2_per_rank_te_bf16(sources, tmp_path):
    cases = []
    for f in FAMILIES:
        cases.append(Case(sources[f], Layout(2, 1), label=f"tp2 {f}", logits=f != "tiny-qwen3"))
        cases.append(Case(sources[f], Layout(1, 2), label=f"pp2 {f}"))
    cases += [
        Case(sources["tiny-qwen3"], Layout(2, 1), mode="per_rank", label="tp2 per_rank qwen3"),
        Case(sources["tiny-qwen2"], Layout(2, 1), mode="per_rank", label="tp2 per_rank qwen2"),
        Case(sources["tiny-qwen3-tied"], Layout(2, 1), te_names=True, label="tp2 te qwen3-tied"),
        Case(sources["tiny-qwen2"], Layout(1, 2), te_names=True, label="pp2 te qwen2"),
        Case(sources["tiny-qwen3-bf16"], Layout(2, 1), dtype="bfloat16", label="tp2 bf16"),
    ]
    results = by_label(launch(2, run_cases, cases))
    for f in FAMILIES:
        assert_full_exact(results[f"tp2 {f}"], sources[f])
        assert_full_exact(results[f"pp2 {f}"], sources[f])
    # Logits of the Megatron model (TP 2) equal the HF model's, for both families.
    for f in ("tiny-qwen2", "tiny-qwen3-tied"):
        ref = hf_logits(sources[f], INPUT_IDS)
        for r in results[f"tp2 {f}"]:
            assert_logits_close(r["logits"], ref)
    assert_per_rank_assembles(results["tp2 per_rank qwen3"], sources["tiny-qwen3"], tp=2)
    assert_per_rank_assembles(results["tp2 per_rank qwen2"], sources["tiny-qwen2"], tp=2)
    for r in results["tp2 per_rank qwen3"] + results["tp2 per_rank qwen2"]:
        assert r["stats"].gathers == 0, "per_rank mode must not all-gather"
    # Transformer Engine names give exactly the same tensors as local names.
    assert_full_exact(results["tp2 te qwen3-tied"], sources["tiny-qwen3-tied"])
    assert_full_exact(results["pp2 te qwen2"], sources["tiny-qwen2"])
    assert_full_exact(results["tp2 bf16"], sources["tiny-qwen3-bf16"])


@pytest.mark.parametrize("family", ["tiny-qwen2", "tiny-qwen3-tied"])
def test_tp2_logits_independent_of_loader(family, sources, tmp_path):
    """Megatron's own random weights (our loader not involved) -> stream -> disk -> HF: same logits."""
    out = tmp_path / "ckpt"
    case = Case(
        sources[family], Layout(2, 1), random_init=True, logits=True, save_to=str(out),
        save_kwargs={"shard_bytes": 200_000, "writers": "spread"}, label="rand",
    )
    results = launch(2, run_cases, [case])
    files = results[0][0]["files"]
    assert len(files) > 1 and all((out / f).exists() for f in files)
    assert sorted(p.name for p in out.glob("*.partial")) == []
    ref = hf_logits(str(out), INPUT_IDS)
    for rank_results in results:
        assert_logits_close(rank_results[0]["logits"], ref)
    # The index lists exactly the HF model's checkpoint keys.
    import json

    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == source_keys(sources[family])
    assert set(index["weight_map"].values()) == set(files)


def test_world4_tp4_tp2pp2_vpp(sources):
    cases = []
    for f in FAMILIES:
        cases.append(Case(sources[f], Layout(4, 1), label=f"tp4 {f}"))
        cases.append(Case(sources[f], Layout(2, 2), label=f"tp2pp2 {f}", logits=f == "tiny-qwen3-tied"))
    cases += [
        Case(sources["tiny-qwen3-tied"], Layout(1, 2, vpp=2), label="pp2 vpp2 tied", logits=True),
        Case(sources["tiny-qwen2"], Layout(2, 2, vpp=2), label="tp2 pp2 vpp2 qwen2"),
        Case(sources["tiny-qwen3"], Layout(4, 1), mode="per_rank", label="tp4 per_rank"),
        Case(sources["tiny-qwen3-tied"], Layout(2, 2), mode="per_rank", label="tp2pp2 per_rank"),
    ]
    results = by_label(launch(4, run_cases, cases))
    for f in FAMILIES:
        assert_full_exact(results[f"tp4 {f}"], sources[f])
        assert_full_exact(results[f"tp2pp2 {f}"], sources[f])
    assert_full_exact(results["pp2 vpp2 tied"], sources["tiny-qwen3-tied"])
    assert_full_exact(results["tp2 pp2 vpp2 qwen2"], sources["tiny-qwen2"])
    ref = hf_logits(sources["tiny-qwen3-tied"], INPUT_IDS)
    for r in results["tp2pp2 tiny-qwen3-tied"] + results["pp2 vpp2 tied"]:
        assert_logits_close(r["logits"], ref)
    assert_per_rank_assembles(results["tp4 per_rank"], sources["tiny-qwen3"], tp=4)
    assert_per_rank_assembles(results["tp2pp2 per_rank"], sources["tiny-qwen3-tied"], tp=2)


def test_world8_tp4_pp2(sources):
    cases = [Case(sources[f], Layout(4, 2), label=f) for f in FAMILIES]
    results = by_label(launch(8, run_cases, cases))
    for f in FAMILIES:
        assert_full_exact(results[f], sources[f])


def test_bucket_bounds_hold_in_a_real_job(sources):
    """Buckets respect the limit (unless one tensor alone is larger) and staging stays within
    two buckets plus the largest tensor."""
    limit = 40 << 10
    cases = [Case(sources["tiny-qwen3"], Layout(2, 1), bucket_bytes=limit, label="b")]
    results = launch(2, run_cases, cases)
    for (r,) in results:
        largest = r["largest_tensor"]
        for size, count in zip(r["bucket_sizes"], r["tensors_per_bucket"], strict=True):
            assert size <= limit or count <= 3, (size, count)  # an oversize qkv goes alone (q, k, v)
        assert r["stats"].peak_staging_bytes <= 2 * max(limit, largest) + largest
        assert r["stats"].buckets == len(r["bucket_sizes"]) > 3


def test_query_key_value_slabs_pack_bit_for_bit(tmp_path):
    """Heads wide enough that each group's query, key and value rows are copied as contiguous slabs of the fused
    parameter (streaming.programs.contiguous_slabs: 256 KiB and more each), not one strided copy: the stream is
    bit-identical to the checkpoint, at TP 1 and TP 2."""
    from transformers import Qwen3Config

    from weightstream.models.presets import save_random_checkpoint

    cfg = Qwen3Config(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128, tie_word_embeddings=False)
    src = save_random_checkpoint(cfg, str(tmp_path / "src"), seed=3)
    cases = [Case(src, Layout(tp, 1), bucket_bytes=4 << 20, label=f"tp{tp}") for tp in (1, 2)]
    results = by_label(launch(2, run_cases, cases[1:]))
    results.update(by_label(launch(1, run_cases, cases[:1])))
    for label in ("tp1", "tp2"):
        assert_full_exact(results[label], src)
