"""DeepSeek-V3 (``deepseek_v3``, Kimi-K2's architecture) over real Megatron-Core MLA models in real gloo jobs.

Each layout is proven three ways: every HF tensor bit-identical to what transformers saves, exactly the
checkpoint's names, and the Megatron model's logits equal to the HF model's loaded from that checkpoint.
Multi-latent attention with TP 2 (heads split, down projections split in the local spec and whole under
Transformer Engine), q_lora_rank set and null, YaRN with its mscales, PP 2 with a dense stage then an MoE stage,
EP 2 with shared experts, expert-TP, VPP, grouped-GEMM names, per-rank mode; the in-memory transformers model
(fused experts). Two launches (2 and 4 processes).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.conftest import hf_logits
from tests.helpers.checks import (
    assert_full_exact,
    assert_logits_close,
    assert_per_rank_assembles,
    assert_per_rank_experts,
    by_label,
)
from tests.helpers.mla import run_family_cases, run_family_job
from tests.helpers.mtp_checkpoint import save_mtp_checkpoint
from tests.helpers.workers import INPUT_IDS, Case
from weightstream.common.hf_files import CheckpointReader
from weightstream.convert import convert_checkpoint
from weightstream.converters.expected import expected_hf_shapes
from weightstream.converters.fp8 import BlockFP8
from weightstream.converters.registry import get_converter, model_spec
from weightstream.engines import ReferenceEngine
from weightstream.jobs import Layout
from weightstream.launch import launch
from weightstream.models.presets import preset_config, random_hf_model, save_random_checkpoint
from weightstream.reference_engine.server import serve, stop
from weightstream.streaming.plan import ALIGN, plan_buckets
from weightstream.streaming.stream import stream_hf_weights

LORA, QPROJ = "tiny-deepseek-v3", "tiny-deepseek-v3-q-proj"
FAMILY = (LORA, QPROJ)
EXPERTS = 8


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("deepseek_v3")
    out = {name: save_random_checkpoint(preset_config(name), root / name, seed=80 + i)
           for i, name in enumerate(FAMILY)}
    # bf16 weights with the score-correction bias in float32, as the published checkpoints hold it and Megatron
    # keeps its expert bias, and the router in bf16, as a bf16 Megatron model holds it. Both are set here because
    # transformers' from_config decides their dtypes by version (5.19 makes both bf16; 5.24 keeps both float32,
    # `_keep_in_fp32_modules_strict`).
    model = random_hf_model(preset_config(LORA), seed=84, dtype=torch.bfloat16)
    for layer in model.model.layers[2:]:
        layer.mlp.gate.e_score_correction_bias.data = layer.mlp.gate.e_score_correction_bias.data.float()
        layer.mlp.gate.weight.data = layer.mlp.gate.weight.data.to(torch.bfloat16)
    model.save_pretrained(root / "bf16")
    out["bf16"] = str(root / "bf16")
    return out


@pytest.fixture(scope="module")
def mtp_source(tmp_path_factory) -> str:
    """A checkpoint with one multi-token prediction layer (``model.layers.4.*``), as DeepSeek-V3's hold them."""
    cfg = preset_config(LORA)
    cfg.num_nextn_predict_layers = 1
    return save_mtp_checkpoint(cfg, str(tmp_path_factory.mktemp("deepseek_v3_mtp")), seed=85)


@pytest.fixture(scope="module")
def references(sources, mtp_source) -> dict[str, torch.Tensor]:
    """Logits of DeepseekV3ForCausalLM loaded from the source checkpoints (it has no MTP layer: those of the MTP
    checkpoint are left out)."""
    return {**{f: hf_logits(sources[f], INPUT_IDS) for f in FAMILY}, "mtp": hf_logits(mtp_source, INPUT_IDS)}


def _assert_logits(results: list[dict], ref: torch.Tensor) -> None:
    assert ref.abs().max().item() > 0.1
    for r in results:
        assert_logits_close(r["logits"], ref, atol=1e-5)


@pytest.mark.unit
def test_spec_and_declarations():
    spec = model_spec(preset_config(LORA))
    assert (spec.q_lora_rank, spec.kv_lora_rank, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim) == (
        24, 16, 8, 4, 8)
    assert spec.dense_layers == frozenset({0, 1}) and spec.num_experts == EXPERTS
    assert (spec.moe_score_function, spec.moe_expert_bias, spec.moe_num_groups, spec.moe_group_top_k) == (
        "sigmoid", True, 4, 2)
    assert spec.moe_routed_scaling_factor == 2.5 and spec.shared_expert_intermediate_size == 32
    assert spec.yarn is not None and (spec.yarn.factor, spec.yarn.mscale, spec.yarn.mscale_all_dim) == (4.0, 0.8, 1.0)
    q_proj = model_spec(preset_config(QPROJ))
    assert q_proj.q_lora_rank is None and q_proj.yarn is None and q_proj.shared_expert_intermediate_size == 64
    # Block FP8 as the published DeepSeek-V3 FP8 checkpoint: every projection of attention and the MLPs; the
    # embeddings, output layer, routers (and their bias), norms stay.
    conv = get_converter("deepseek_v3")
    names = {"model.layers.0.self_attn.q_a_proj.weight": True, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight":
             True, "model.layers.1.self_attn.q_proj.weight": True, "model.layers.0.self_attn.kv_b_proj.weight": True,
             "model.layers.2.mlp.shared_experts.down_proj.weight": True, "model.layers.2.mlp.experts.7.up_proj.weight":
             True, "model.layers.0.mlp.gate_proj.weight": True, "model.layers.2.mlp.gate.weight": False,
             "model.layers.2.mlp.gate.e_score_correction_bias": False,
             "model.layers.0.self_attn.kv_a_layernorm.weight": False, "model.embed_tokens.weight": False,
             "lm_head.weight": False}
    assert {n: conv.quantizes(n) for n in names} == names


def test_transformers_model_in_memory_streams_as_saved(tmp_path):
    """No process group: DeepseekV3ForCausalLM's parameters (routed experts fused in memory, the router's bias a
    buffer) stream exactly as ``save_pretrained`` writes them."""
    for i, name in enumerate(FAMILY):
        model = random_hf_model(preset_config(name), seed=90 + i, dtype=torch.bfloat16)
        model.save_pretrained(tmp_path / name)
        with CheckpointReader(str(tmp_path / name)) as reader:
            want = dict(reader.items())
        got = {}
        for bucket in stream_hf_weights(model, tmp_path / name, bucket_bytes=60_000):
            got.update({n: t.clone() for n, t in bucket.named_tensors()})
        assert set(got) == set(want)
        assert [n for n in want if got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n])] == []


@pytest.fixture(scope="module")
def world2(sources, mtp_source, tmp_path_factory) -> dict:
    """One two-process job: every two-rank layout, the refusals, a TP 2 job's Megatron checkpoints (both formats),
    and an EP 2 trainer's update into a reference engine of TP 2."""
    src = sources
    cases = [
        Case(src[LORA], Layout(2, 1), label="tp2", logits=True),
        Case(src[QPROJ], Layout(2, 1), label="tp2 q_proj", logits=True),
        Case(src[LORA], Layout(1, 2), label="pp2", logits=True),  # stage 0: layers 0-1 dense; stage 1: MoE
        Case(src[LORA], Layout(1, 1, ep=2), label="ep2", logits=True),
        Case(src[QPROJ], Layout(1, 1, ep=2), label="ep2 q_proj", logits=True),
        Case(src[LORA], Layout(1, 1, ep=1, etp=2), label="etp2", logits=True),
        Case(src[LORA], Layout(1, 1, ep=2), te_names=True, grouped_experts=True, label="ep2 te grouped"),
        Case(src[LORA], Layout(2, 1), mode="per_rank", label="tp2 per_rank"),
        Case(src[QPROJ], Layout(1, 1, ep=2), mode="per_rank", label="ep2 per_rank"),
        # Multi-token prediction layers streamed (TP 2, EP 2, PP 2: the last stage's embedding copy) and loaded.
        Case(mtp_source, Layout(2, 1), label="mtp tp2", logits=True),
        Case(mtp_source, Layout(1, 1, ep=2), label="mtp ep2"),
        Case(mtp_source, Layout(1, 2), label="mtp pp2", logits=True),
        # Block FP8 as the family declares it (its shapes are not multiples of 128: 16 x 16 blocks here).
        Case(src[LORA], Layout(2, 1), quantize=BlockFP8((16, 16)), label="tp2 fp8"),
        Case(src["bf16"], Layout(1, 1, ep=2), dtype="bfloat16", label="ep2 bf16"),
    ]
    te = [Case(src[f], Layout(2, 1), label=f"tp2 te reload {f}") for f in FAMILY]
    # MTP layers where only one side has them: refused.
    errors = [(Case(mtp_source, Layout(1, 1), label="mtp not in config"), "", {"num_nextn_predict_layers": 0}),
              (Case(src[LORA], Layout(1, 1), label="mtp not in model"), "", {"num_nextn_predict_layers": 1})]
    root = tmp_path_factory.mktemp("deepseek_v3_megatron")
    saves = [(Case(src[LORA], Layout(2, 1)), str(root))]
    engine_start = save_random_checkpoint(preset_config(LORA), root / "engine", seed=86)
    server = serve(engine_start, 2)
    try:
        before = ReferenceEngine(server.url).logits(INPUT_IDS)
        update = (Case(src[LORA], Layout(1, 1, ep=2)), [server.url], [{"transport": "auto", "bucket_bytes": 120_000}])
        fsdp = [("run_fsdp_stream", src[LORA], (2,), ["full"])]
        results = launch(2, run_family_job, cases, te, errors, saves, update, fsdp)
    finally:
        stop(server)
    return {"cases": by_label([r["cases"] for r in results]), "saves": [r["saves"] for r in results],
            "update": results[0]["update"], "engine_before": before, "megatron": str(root),
            "fsdp": [r["fsdp"][0] for r in results]}


def test_world2_tp2_pp2_ep2_etp2_te_names_per_rank_mtp(sources, mtp_source, references, world2):
    src, results = sources, world2["cases"]
    for label, f in (("tp2", LORA), ("tp2 q_proj", QPROJ), ("pp2", LORA), ("ep2", LORA), ("ep2 q_proj", QPROJ),
                     ("etp2", LORA), ("ep2 te grouped", LORA)):
        assert_full_exact(results[label], src[f])
    for label, f in (("tp2", LORA), ("tp2 q_proj", QPROJ), ("pp2", LORA), ("ep2", LORA), ("ep2 q_proj", QPROJ),
                     ("etp2", LORA)):
        _assert_logits(results[label], references[f])
    assert_full_exact(results["tp2 fp8"], src[LORA], BlockFP8((16, 16)))
    assert_full_exact(results["ep2 bf16"], src["bf16"])
    assert_per_rank_assembles(results["tp2 per_rank"], src[LORA], tp=2)
    assert_per_rank_experts(results["ep2 per_rank"], src[QPROJ], EXPERTS, ep=2, tp=1, etp=1)

    for label in ("mtp tp2", "mtp ep2", "mtp pp2"):
        assert_full_exact(results[label], mtp_source)
        assert len(results[label][0]["names"]) == 103 + 44  # the decoder's, then layer 4: its own, copies, MoE layer
    for label in ("mtp tp2", "mtp pp2"):
        _assert_logits(results[label], references["mtp"])
    for r in results["mtp not in config"]:
        refused = r["problems"]["Megatron tensors the HF model has no place for"]
        # Its own 4, the attention's 8 and pre-MLP norm, the router's 2, 8 experts' and the shared experts' fc1/fc2.
        assert len(refused) == 4 + 9 + 2 + 16 + 2 and all(x.startswith("mtp.layers.0.") for x in refused)
        assert "num_nextn_predict_layers = 0" in refused[0]
    for r in results["mtp not in model"]:
        missing = r["problems"]["HF tensors the model does not provide"]
        # Every tensor of layer 4 but the embedding and output-layer copies (made from the model's own).
        assert len(missing) == 44 - 2 and all(x.startswith("model.layers.4.") for x in missing)

    # Transformer Engine's spec: latent norms fused into the up projections, down projections whole on both TP
    # ranks; loaded into those names and streamed, bit for bit.
    for f in FAMILY:
        rs = results[f"tp2 te reload {f}"]
        assert_full_exact(rs, src[f])
        for r in rs:
            assert r["kv_down_shape"] == (16 + 4, 64)
            assert "linear_kv_up_proj.layer_norm_weight" in r["te_names"]
            assert ("linear_q_up_proj.layer_norm_weight" in r["te_names"]) == (f == LORA)


def test_world4_tp2_ep2_pp2_vpp2(sources, references):
    src = sources
    cases = [
        Case(src[LORA], Layout(2, 1, ep=2), label="tp2 ep2", logits=True),
        Case(src[QPROJ], Layout(2, 2), label="tp2 pp2", logits=True),
        Case(src[LORA], Layout(1, 2, vpp=2, ep=2), label="pp2 vpp2 ep2", logits=True),
    ]
    results = by_label(launch(4, run_family_cases, cases))
    for label, f in (("tp2 ep2", LORA), ("tp2 pp2", QPROJ), ("pp2 vpp2 ep2", LORA)):
        assert_full_exact(results[label], src[f])
        _assert_logits(results[label], references[f])


def test_update_from_megatron_into_reference_engine_tp2(sources, references, world2):
    """An EP 2 trainer into a reference engine of TP 2 (transformers' DeepseekV3ForCausalLM: q_b_proj and kv_b_proj
    split by heads, o_proj by its input, the latent projections and norms whole, every fused expert split)."""
    (entry,) = world2["update"]
    assert "error" not in entry, entry.get("error")
    ref = references[LORA]
    assert (world2["engine_before"] - ref).abs().max() > 1e-2
    assert entry["report"].tensors == len(CheckpointReader(sources[LORA]).keys())
    assert_logits_close(entry["engine_logits"], ref)


@pytest.mark.parametrize("fmt", ["torch_dist", "legacy"])
def test_convert_megatron_checkpoint(sources, references, world2, fmt, tmp_path):
    """A TP 2 job's checkpoint (MLA heads and down projections split in its files) converted by
    ``convert_checkpoint``: bit for bit the HF checkpoint it was built from, whose logits equal the job's."""
    src = sources[LORA]
    report = convert_checkpoint(os.path.join(world2["megatron"], fmt), src, tmp_path / "hf", bucket_bytes=40_000,
                                verify=src)
    assert report.verify.ok, report.verify.render(src, str(tmp_path / "hf"))
    assert report.verify.compared == len(CheckpointReader(src).keys())
    assert_logits_close(world2["saves"][0][0]["logits"], references[LORA])
    assert_logits_close(hf_logits(str(tmp_path / "hf"), INPUT_IDS), references[LORA])


def test_deepseek_v3_671b_shapes_and_plan():
    """DeepSeek-V3's real shapes (random weights for ``weightstream bench``): 46,183 HF tensors with its MTP layer
    (model.layers.61), 684.5 B parameters (671.0 B without it), 1.37 TB in bf16 (the score-correction biases in
    float32); 512 MiB buckets hold every tensor but the embedding, lm_head and their MTP copies (1.85 GB each,
    alone): 2,589 buckets. Block FP8 quantizes 45,808 of them (680.6 B parameters)."""
    cfg = preset_config("deepseek-v3")
    shapes = expected_hf_shapes(cfg)
    moe_layer, dense_layer = 7 + 2 + 2 + 3 + 3 * 256, 7 + 2 + 3  # attention, norms, router, shared, experts
    assert len(shapes) == 58 * moe_layer + 3 * dense_layer + (moe_layer + 6) + 3 == 46183
    assert sum(math.prod(s) for s in shapes.values()) == 684_489_845_504
    assert sum(math.prod(s) for n, s in shapes.items() if not n.startswith("model.layers.61.")) == 671_026_419_200
    assert shapes["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"] == (512 + 64, 7168)
    assert shapes["model.layers.3.self_attn.q_b_proj.weight"] == (128 * (128 + 64), 1536)
    assert shapes["model.layers.3.self_attn.kv_b_proj.weight"] == (128 * (128 + 128), 512)
    assert shapes["model.layers.61.eh_proj.weight"] == (7168, 2 * 7168)
    assert shapes["model.layers.61.mlp.experts.255.down_proj.weight"] == (7168, 2048)
    outputs = [[math.prod(s) * (4 if n.endswith("e_score_correction_bias") else 2)] for n, s in shapes.items()]
    assert sum(o[0] for o in outputs) == 1_368_979_721_216
    plan = plan_buckets(outputs, 512 << 20, ALIGN)
    assert [(len(bp.items), bp.nbytes) for bp in plan if bp.nbytes > 512 << 20] == [(1, 129280 * 7168 * 2)] * 4
    assert len(plan) == 2589
    conv = get_converter("deepseek_v3")
    fp8 = [n for n in shapes if conv.quantizes(n)]
    assert len(fp8) == 45808 and sum(math.prod(shapes[n]) for n in fp8) == 680_571_043_840


def test_fsdp2_model_streams_as_saved(sources, world2):
    """transformers' DeepseekV3ForCausalLM under FSDP2 (2 ranks, fused experts and the router's bias buffer
    included), streamed in full mode: bit for bit what ``save_pretrained`` wrote."""
    with CheckpointReader(sources[LORA]) as reader:
        want = {n: reader.get(n).clone() for n in reader.keys()}
    for out in world2["fsdp"]:
        assert any("Shard" in p for p in out["placements"].values())
        got = out["full"]["tensors"]
        assert set(got) == set(want)
        assert [n for n, t in got.items() if t.dtype != want[n].dtype or not torch.equal(t, want[n])] == []
