"""Mixtral (``mixtral``) over real Megatron-Core MoE models in real gloo jobs: the HF tensors (experts named
``block_sparse_moe.experts.{E}.w1/w2/w3``, the router ``block_sparse_moe.gate``) bit-identical to what
``save_pretrained`` writes, exactly its keys, and the Megatron model's logits equal to the HF model's, in EP 2,
expert-TP 2, TP 2 (experts split over the same two ranks), PP 2, TP 2 x EP 2; per-rank mode; Transformer Engine and
grouped-GEMM names; block FP8; Megatron's expert bias refused; transformers' own models (fused experts in memory),
plain and under FSDP2; a Megatron checkpoint converted; an update into the reference engine."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import hf_logits
from tests.helpers.checks import (
    INPUT_IDS,
    assert_full_exact,
    assert_logits_close,
    assert_per_rank_experts,
    by_label,
)
from tests.helpers.workers import Case, run_cases
from weightstream.common.hf_files import CheckpointReader
from weightstream.converters import get_converter, model_spec
from weightstream.converters.expected import expected_hf_shapes
from weightstream.converters.fp8 import BlockFP8
from weightstream.jobs import Layout
from weightstream.launch import launch
from weightstream.models.presets import preset_config, random_hf_model, save_random_checkpoint

EXPERTS = 8
M = "model.layers.3.block_sparse_moe"


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> str:
    return save_random_checkpoint(preset_config("tiny-mixtral"), tmp_path_factory.mktemp("mixtral") / "m", seed=95)


@pytest.fixture(scope="module")
def reference(mixtral) -> torch.Tensor:
    ref = hf_logits(mixtral, INPUT_IDS)
    assert ref.abs().max().item() > 0.1
    return ref


def _saved(src: str) -> dict[str, torch.Tensor]:
    with CheckpointReader(src) as reader:
        return dict(reader.items())


@pytest.mark.unit
def test_mixtral_declarations_and_its_in_memory_form():
    conv, llama = get_converter("mixtral"), get_converter("llama")
    spec = model_spec(preset_config("tiny-mixtral"))
    assert (spec.num_experts, spec.moe_top_k, spec.norm_topk_prob, spec.moe_intermediate_size) == (8, 2, True, 32)
    assert spec.dense_layers == frozenset() and spec.moe_score_function == "softmax"
    removed = {m.megatron for m in llama.mappings} - {m.megatron for m in conv.mappings}
    assert removed == {"decoder.layers.*.mlp.linear_fc1.layer_norm_weight", "decoder.layers.*.mlp.linear_fc1.weight",
                       "decoder.layers.*.mlp.linear_fc2.weight"}
    fc1 = conv.resolve("decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight", spec)
    assert fc1.hf_names == (f"{M}.experts.5.w1.weight", f"{M}.experts.5.w3.weight")
    assert fc1.mapping.tp_group == "etp" and fc1.mapping.tp_dim == 0
    assert conv.resolve("decoder.layers.3.mlp.experts.linear_fc2.weight5", spec).hf_names == (
        f"{M}.experts.5.w2.weight",)
    assert conv.resolve("decoder.layers.3.mlp.router.weight", spec).hf_names == (f"{M}.gate.weight",)
    # Block FP8: the attention projections and the experts, not the router, norms or embeddings.
    shapes = expected_hf_shapes(preset_config("tiny-mixtral"))
    assert len(shapes) == 3 + 4 * (7 + 3 * EXPERTS)
    assert sorted(n for n in shapes if conv.quantizes(n)) == sorted(
        n for n in shapes if n.endswith("_proj.weight") or ".experts." in n)
    # transformers' in-memory names and fused experts become the checkpoint's, expert by expert.
    memory = conv.in_memory()
    assert memory.resolve("model.layers.3.mlp.gate.weight", spec).hf_names == (f"{M}.gate.weight",)
    gate_up = memory.resolve("model.layers.3.mlp.experts.gate_up_proj", spec)
    assert gate_up.hf_names[:4] == (f"{M}.experts.0.w1.weight", f"{M}.experts.0.w3.weight",
                                    f"{M}.experts.1.w1.weight", f"{M}.experts.1.w3.weight")
    assert len(gate_up.hf_names) == 2 * EXPERTS


def test_mixtral_world2_ep_etp_tp_pp_per_rank_names_expert_bias(mixtral, reference):
    cases = [
        Case(mixtral, Layout(1, 1, ep=2), label="ep2", logits=True),
        Case(mixtral, Layout(1, 1, ep=1, etp=2), label="etp2", logits=True),
        Case(mixtral, Layout(2, 1, ep=1), label="tp2", logits=True),  # experts over expert-TP = TP = 2
        Case(mixtral, Layout(1, 2, ep=1), label="pp2", logits=True),
        Case(mixtral, Layout(2, 1, ep=2, etp=1), label="tp2 ep2", logits=True),  # attention over TP, experts over EP
        Case(mixtral, Layout(1, 1, ep=2), label="ep2 fp8", quantize=BlockFP8(block=(16, 16))),
        Case(mixtral, Layout(1, 1, ep=2), te_names=True, grouped_experts=True, label="ep2 te grouped"),
        Case(mixtral, Layout(1, 1, ep=2), mode="per_rank", label="ep2 per_rank"),
        Case(mixtral, Layout(1, 1, ep=1, etp=2), mode="per_rank", label="etp2 per_rank"),
    ]
    errors = [(Case(mixtral, Layout(1, 1, ep=2), label="expert bias"), "expert_bias", {})]
    results = by_label(launch(2, run_cases, cases, errors))

    for label in ("ep2", "etp2", "tp2", "pp2", "tp2 ep2", "ep2 te grouped"):
        assert_full_exact(results[label], mixtral)
    for label in ("ep2", "etp2", "tp2", "pp2", "tp2 ep2"):
        for r in results[label]:
            assert_logits_close(r["logits"], reference, atol=1e-5)
    for r in results["ep2"]:
        assert r["stats"].broadcasts > 0 and r["stats"].gathers == 0
    # Block FP8 as the family declares it: attention and experts quantized, values and scales bit for bit.
    assert_full_exact(results["ep2 fp8"], mixtral, BlockFP8(block=(16, 16)))
    names = results["ep2 fp8"][0]["names"]
    assert f"{M}.experts.7.w2.weight_scale_inv" in names and f"{M}.gate.weight_scale_inv" not in names
    assert_per_rank_experts(results["ep2 per_rank"], mixtral, EXPERTS, ep=2, tp=1, etp=1)
    assert_per_rank_experts(results["etp2 per_rank"], mixtral, EXPERTS, ep=1, tp=1, etp=2)
    for r in results["ep2 per_rank"] + results["etp2 per_rank"]:
        assert r["stats"].gathers == 0 and r["stats"].broadcasts == 0
    for r in results["expert bias"]:
        for err in (r, r["load"]):
            refused = err["problems"]["Megatron tensors the HF model has no place for"]
            assert [x.split(":")[0] for x in refused] == [f"decoder.layers.{i}.mlp.router.expert_bias"
                                                          for i in range(4)]
            assert "Mixtral routes by a softmax" in refused[0]


def test_mixtral_transformers_models_plain_and_fsdp2(mixtral, tmp_path):
    """transformers' Mixtral holds ``mlp.gate`` and fused experts: streamed as ``save_pretrained`` writes them,
    from a plain model (bf16) and from an FSDP2 model over two ranks (the fused experts sharded)."""
    from tests.helpers.fsdp_workers import run_fsdp_cases
    from weightstream.streaming.stream import stream_hf_weights

    model = random_hf_model(preset_config("tiny-mixtral"), seed=96, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    want = _saved(str(tmp_path / "bf16"))
    got = {n: t.clone() for b in stream_hf_weights(model, tmp_path / "bf16", bucket_bytes=60_000)
           for n, t in b.named_tensors()}
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)

    want = _saved(mixtral)
    for out in launch(2, run_fsdp_cases, [("run_fsdp_stream", mixtral, (2,), ["full"])]):
        (fsdp,) = out
        assert set(fsdp["placements"].values()) == {"(Shard(dim=0),)"}
        for stream in (fsdp["full"], fsdp["again"]):
            assert stream["tensors"].keys() == want.keys() and stream["gathers"] > 0
            assert all(torch.equal(t, want[n]) for n, t in stream["tensors"].items())


def test_mixtral_megatron_checkpoint_converts_and_updates_the_reference_engine(mixtral, reference, tmp_path):
    """An EP 2 Megatron job's checkpoint converted (legacy per-rank files, experts from both EP ranks), bit for bit;
    then an EP 2 trainer updates a TP 2 reference engine by resharded P2P (its fused experts split over its ranks,
    loaded under Mixtral's checkpoint names) and the engine's logits equal the HF model's."""
    from tests.helpers.family_workers import run_updates
    from tests.helpers.megatron_saves import run_saves
    from weightstream.convert import convert_checkpoint
    from weightstream.engines import ReferenceEngine
    from weightstream.reference_engine.server import serve, stop

    (saved,) = launch(2, run_saves, [(Case(mixtral, Layout(1, 1, ep=2)), str(tmp_path / "megatron"))])[0]
    assert_logits_close(saved["logits"], reference)
    report = convert_checkpoint(tmp_path / "megatron" / "legacy", mixtral, tmp_path / "hf", bucket_bytes=40_000,
                                verify=mixtral)
    assert report.verify.ok and report.verify.compared == len(_saved(mixtral))
    assert_logits_close(hf_logits(str(tmp_path / "hf"), INPUT_IDS), reference)

    server = serve(save_random_checkpoint(preset_config("tiny-mixtral"), tmp_path / "engine", seed=7), 2)
    try:
        before = ReferenceEngine(server.url).logits(INPUT_IDS)
        update = [{"transport": "auto", "bucket_bytes": 60_000, "weight_version": "mixtral-1"}]
        ((result,),) = launch(2, run_updates, [(Case(mixtral, Layout(1, 1, ep=2)), [server.url], update)])[0]
    finally:
        stop(server)
    assert result["report"].transport == "p2p" and result["report"].tensors == len(_saved(mixtral))
    assert (before - reference).abs().max() > 1e-2
    assert_logits_close(result["engine_logits"], reference)
