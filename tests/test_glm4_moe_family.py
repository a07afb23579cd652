"""GLM-4.5 MoE (``glm4_moe``) over real Megatron-Core models in real gloo jobs: the HF tensors bit-identical to
what ``save_pretrained`` writes, exactly its keys, and the Megatron model's logits equal to the HF model's, in
TP 2, PP 2 (a dense stage, then MoE), PP 2 x VPP 2, EP 2 with shared experts, expert-TP 2, TP 2 x EP 2; per-rank
mode; Transformer Engine and grouped-GEMM names; a Megatron checkpoint converted; FSDP2 and plain transformers
models; an update into the reference engine. One two-process launch runs the Megatron layouts."""

from __future__ import annotations

import math
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
from tests.helpers.megatron_saves import run_saves
from tests.helpers.workers import Case, run_cases, run_update
from weightstream.checks.megatron_models import transformer_config
from weightstream.common.hf_files import CheckpointReader
from weightstream.common.layout import ALIGN
from weightstream.convert import convert_checkpoint
from weightstream.converters import NotRepresentable, OpContext, get_converter
from weightstream.converters.expected import expected_hf_shapes
from weightstream.converters.registry import model_spec
from weightstream.errors import ConversionError
from weightstream.jobs import Layout
from weightstream.launch import launch
from weightstream.models.presets import preset_config, random_hf_model
from weightstream.reference_engine.server import serve, stop
from weightstream.streaming.plan import plan_buckets
from weightstream.streaming.stream import stream_hf_weights

EXPERTS = 8


def _save(cfg, out, seed: int, dtype: torch.dtype = torch.float32) -> str:
    """A random checkpoint in ``dtype``: the routers in ``dtype`` too, as a Megatron model of that dtype holds
    them, and the score-correction biases in float32, as Megatron keeps its expert bias. Both are set here because
    transformers' from_config decides their dtypes by version (5.24 keeps both float32 in a bf16 model,
    `_keep_in_fp32_modules_strict`)."""
    model = random_hf_model(cfg, seed=seed, dtype=dtype)
    for layer in model.model.layers[cfg.first_k_dense_replace:]:
        layer.mlp.gate.weight.data = layer.mlp.gate.weight.data.to(dtype)
        layer.mlp.gate.e_score_correction_bias.data = layer.mlp.gate.e_score_correction_bias.data.float()
    model.save_pretrained(out)
    return os.fspath(out)


def _air_like():
    cfg = preset_config("tiny-glm4-moe")
    cfg.use_qk_norm, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor = False, 1, 1, 1.0
    return cfg


@pytest.fixture(scope="module")
def glm_sources(tmp_path_factory) -> dict[str, str]:
    """Random GLM-4.5 MoE checkpoints written by ``save_pretrained`` (score-correction biases random too): the
    preset (q/k norm, grouped top-k, scaled weights), and GLM-4.5-Air's kind (no q/k norm, no groups)."""
    root = tmp_path_factory.mktemp("glm4_moe")
    cfg = preset_config("tiny-glm4-moe")
    return {"glm": _save(cfg, root / "glm", 60), "air": _save(_air_like(), root / "air", 61),
            "bf16": _save(cfg, root / "bf16", 62, torch.bfloat16),  # the routers bf16, the biases float32
            "engine": _save(cfg, root / "engine", 63), "root": os.fspath(root)}


@pytest.fixture(scope="module")
def glm_references(glm_sources) -> dict[str, torch.Tensor]:
    return {k: hf_logits(glm_sources[k], INPUT_IDS) for k in ("glm", "air")}


def _assert_logits(results: list[dict], ref: torch.Tensor) -> None:
    assert ref.abs().max().item() > 0.1
    for r in results:
        assert_logits_close(r["logits"], ref, atol=1e-5)


# -- declarations (no processes) ---------------------------------------------------------------------------------


@pytest.mark.unit
def test_features_follow_the_hf_config():
    s = model_spec(preset_config("tiny-glm4-moe"))
    assert (s.qkv_bias, s.qk_norm, s.partial_rotary_factor, s.dense_layers) == (True, True, 0.5, frozenset({0}))
    assert (s.num_experts, s.moe_top_k, s.moe_intermediate_size, s.shared_expert_intermediate_size,
            s.shared_expert_gate) == (8, 2, 32, 32, False)
    assert (s.moe_score_function, s.moe_expert_bias, s.moe_num_groups, s.moe_group_top_k,
            s.moe_routed_scaling_factor, s.norm_topk_prob) == ("sigmoid", True, 2, 1, 2.5, True)
    air = model_spec(preset_config("glm-4.5-air"))
    assert (air.num_layers, air.num_experts, air.moe_top_k, air.head_dim, air.hidden_size, air.qk_norm,
            air.dense_layers, air.shared_expert_intermediate_size) == (46, 128, 8, 128, 4096, False,
                                                                        frozenset({0}), 1408)
    # n_shared_experts widens the shared MLP; first_k_dense_replace past the last layer leaves no MoE layer.
    cfg = preset_config("tiny-glm4-moe")
    cfg.n_shared_experts = 2
    assert model_spec(cfg).shared_expert_intermediate_size == 64
    cfg.first_k_dense_replace = 9
    with pytest.raises(ValueError, match="every layer is dense"):
        model_spec(cfg)


@pytest.mark.unit
def test_declarations_resolve_to_the_checkpoint_names():
    spec = model_spec(preset_config("tiny-glm4-moe"))
    conv = get_converter("glm4_moe")
    names = {
        "decoder.layers.1.mlp.router.weight": ("model.layers.1.mlp.gate.weight",),
        "decoder.layers.1.mlp.router.expert_bias": ("model.layers.1.mlp.gate.e_score_correction_bias",),
        "decoder.layers.1.mlp.shared_experts.linear_fc1.weight": (
            "model.layers.1.mlp.shared_experts.gate_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight"),
        "decoder.layers.1.mlp.shared_experts.linear_fc2.weight": (
            "model.layers.1.mlp.shared_experts.down_proj.weight",),
        "decoder.layers.2.mlp.experts.local_experts.5.linear_fc2.weight": (
            "model.layers.2.mlp.experts.5.down_proj.weight",),
        "decoder.layers.0.mlp.linear_fc1.weight": ("model.layers.0.mlp.gate_proj.weight",
                                                   "model.layers.0.mlp.up_proj.weight"),
        "decoder.layers.0.self_attention.linear_qkv.bias": ("model.layers.0.self_attn.q_proj.bias",
                                                            "model.layers.0.self_attn.k_proj.bias",
                                                            "model.layers.0.self_attn.v_proj.bias"),
        "decoder.layers.0.self_attention.k_layernorm.weight": ("model.layers.0.self_attn.k_norm.weight",),
    }
    for megatron, hf in names.items():
        assert conv.resolve(megatron, spec).hf_names == hf, megatron
    shared = conv.resolve("decoder.layers.1.mlp.shared_experts.linear_fc1.weight", spec).mapping
    assert (shared.tp_dim, shared.tp_group) == (0, "tp")  # dense TP, not expert-TP
    assert conv.resolve("decoder.layers.1.mlp.shared_experts.gate_weight", spec) is None  # no gate in GLM-4.5
    # Multi-token prediction layers: refused, with the reason, rather than streamed without them.
    mtp = conv.resolve("mtp.layers.0.eh_proj.weight", spec)
    with pytest.raises(NotRepresentable, match="multi-token-prediction layers are not streamed"):
        mtp.mapping.op.to_hf(torch.zeros(4, 4), OpContext(spec))


def test_expected_names_are_what_save_pretrained_writes(tmp_path):
    """The HF side of key coverage: the names the family declares from transformers' in-memory model (fused
    experts one name per expert, the score-correction bias buffer) are exactly what ``save_pretrained`` writes;
    and the block-FP8 declaration quantizes every projection, never the router, its bias or a norm."""
    for key, cfg in (("glm", preset_config("tiny-glm4-moe")), ("air", _air_like())):
        out = _save(cfg, tmp_path / key, 1)
        with CheckpointReader(out) as reader:
            saved = {n: tuple(reader.get(n).shape) for n in reader.keys()}
        assert expected_hf_shapes(cfg) == saved
        assert not any(".mlp.gate." in n for n in saved if n.startswith("model.layers.0."))  # layer 0 dense
    conv = get_converter("glm4_moe")
    fp8 = sorted(n for n in saved if conv.quantizes(n))
    assert all(n.endswith("_proj.weight") for n in fp8)
    assert len(fp8) == 4 * 4 + 3 + 3 * (3 + 3 * 8)  # attention x 4 layers, dense MLP, (shared + 8 experts) x 3
    assert conv.not_quantized({n: s for n, s in saved.items() if n.startswith("model.layers.1.")}) == [
        "model.layers.1.mlp.gate"]


def test_routing_megatron_cannot_compute_is_refused_listing_every_problem():
    """Megatron-Core renormalises the chosen sigmoid scores always, and ranks groups by their best top_k /
    group_top_k scores (HF by their best 2): configs it would route otherwise are refused, each problem named.
    ModelSpec refuses inconsistent routing on its own."""
    cfg = preset_config("tiny-glm4-moe")
    cfg.norm_topk_prob, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group = False, 4, 4, 1
    with pytest.raises(ConversionError) as err:
        transformer_config(model_spec(cfg))
    text = str(err.value)
    assert "sigmoid scores without norm_topk_prob" in text and "4 // 1 scores in Megatron" in text
    cfg = preset_config("tiny-glm4-moe")
    cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.rope_parameters = 3, 4, 0.0, {
        **cfg.rope_parameters, "partial_rotary_factor": 0.3}
    with pytest.raises(ValueError) as err:
        model_spec(cfg)
    text = str(err.value)
    for problem in ("not a multiple of moe_num_groups (3)", "moe_routed_scaling_factor must be positive",
                    "partial_rotary_factor=0.3"):
        assert problem in text


@pytest.mark.unit
def test_plain_transformers_model_streams_as_saved(tmp_path):
    """A transformers model in bf16 (no process group; fused experts, the float32 bias buffer) streams exactly
    what ``save_pretrained`` writes."""
    model = random_hf_model(preset_config("tiny-glm4-moe"), seed=5, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    with CheckpointReader(tmp_path) as reader:
        want = {n: reader.get(n).clone() for n in reader.keys()}
    got = {n: t.clone() for b in stream_hf_weights(model, tmp_path, bucket_bytes=60_000) for n, t in b.named_tensors()}
    assert set(got) == set(want)
    assert [n for n in want if got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n])] == []
    assert {want[n].dtype for n in want if n.endswith("e_score_correction_bias")} == {torch.float32}


def test_glm45_air_shapes_and_plan():
    """GLM-4.5-Air's real shapes (random weights for ``weightstream bench``): 17,925 HF tensors, 106.85 B
    parameters, 213.7 GB in bf16 (the score-correction biases in float32); 512 MiB buckets hold every tensor
    but the embedding and lm_head (1.24 GB each, alone), 408 buckets in all."""
    shapes = expected_hf_shapes(preset_config("glm-4.5-air"))
    assert len(shapes) == 45 * (7 + 2 + 2 + 3 + 3 * 128) + (7 + 2 + 3) + 3 == 17925  # MoE layers, layer 0, ends
    assert sum(math.prod(s) for s in shapes.values()) == 106_852_251_264
    assert shapes["model.layers.1.mlp.experts.127.gate_proj.weight"] == (1408, 4096)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (96 * 128, 4096)
    assert "model.layers.46.eh_proj.weight" not in shapes  # the MTP layer: not in transformers' model
    outputs = [[math.prod(s) * (4 if n.endswith("e_score_correction_bias") else 2)] for n, s in shapes.items()]
    plan = plan_buckets(outputs, 512 << 20, ALIGN)
    oversize = [bp for bp in plan if bp.nbytes > 512 << 20]
    assert [(len(bp.items), bp.nbytes) for bp in oversize] == [(1, 151552 * 4096 * 2)] * 2
    assert len(plan) == 408


# -- real Megatron-Core jobs -------------------------------------------------------------------------------------


def run_world2(cases: list[Case], saves: list[tuple[Case, str]], update: tuple) -> dict:
    """One two-process job: the layout cases, Megatron checkpoints saved, and an update into an engine."""
    return {"cases": run_cases(cases), "saves": run_saves(saves), "update": run_update(*update)}


@pytest.fixture(scope="module")
def world2(glm_sources) -> dict:
    src = glm_sources
    glm, air = src["glm"], src["air"]
    cases = [
        Case(glm, Layout(2, 1), label="tp2", logits=True),
        Case(glm, Layout(1, 2), label="pp2", logits=True),  # stage 0: the dense layer and an MoE layer
        Case(glm, Layout(1, 2, vpp=2), label="pp2 vpp2", logits=True),  # one layer per chunk
        Case(glm, Layout(1, 1, ep=2), label="ep2", logits=True),
        Case(air, Layout(1, 1, ep=2), label="ep2 air", logits=True),
        Case(glm, Layout(1, 1, ep=1, etp=2), label="etp2", logits=True),
        Case(glm, Layout(2, 1, ep=2, etp=1), label="tp2 ep2", logits=True),
        Case(glm, Layout(1, 1, ep=2), te_names=True, grouped_experts=True, label="ep2 te grouped"),
        Case(src["bf16"], Layout(1, 1, ep=2), dtype="bfloat16", label="ep2 bf16"),
        Case(glm, Layout(2, 1), mode="per_rank", label="tp2 per_rank"),
        Case(glm, Layout(1, 1, ep=2), mode="per_rank", label="ep2 per_rank"),
    ]
    saves = [(Case(glm, Layout(1, 2)), os.path.join(src["root"], "megatron"))]
    server = serve(src["engine"], 2)
    try:
        before = hf_logits(src["engine"], INPUT_IDS)
        update = (Case(glm, Layout(1, 1, ep=2)), [server.url], [{"transport": "auto", "bucket_bytes": 120_000}])
        results = launch(2, run_world2, cases, saves, update)
    finally:
        stop(server)
    return {"cases": by_label([r["cases"] for r in results]), "saves": [r["saves"] for r in results],
            "update": results[0]["update"], "engine_before": before}


def test_layouts_bit_identical_exact_keys_equal_logits(glm_sources, glm_references, world2):
    glm, results = glm_sources["glm"], world2["cases"]
    for label in ("tp2", "pp2", "pp2 vpp2", "ep2", "etp2", "tp2 ep2", "ep2 te grouped"):
        assert_full_exact(results[label], glm)
    for label in ("tp2", "pp2", "pp2 vpp2", "ep2", "etp2", "tp2 ep2"):
        _assert_logits(results[label], glm_references["glm"])
    assert_full_exact(results["ep2 air"], glm_sources["air"])
    _assert_logits(results["ep2 air"], glm_references["air"])
    # bf16 weights, the expert bias in float32 as Megatron keeps it: bit for bit.
    assert_full_exact(results["ep2 bf16"], glm_sources["bf16"])
    assert_per_rank_assembles(results["tp2 per_rank"], glm, tp=2)
    assert_per_rank_experts(results["ep2 per_rank"], glm, EXPERTS, ep=2, tp=1, etp=1)
    for r in results["ep2 per_rank"]:
        assert r["stats"].gathers == 0 and r["stats"].broadcasts == 0


def test_update_from_megatron_into_reference_engine_tp2(glm_sources, glm_references, world2):
    """An EP 2 trainer into a reference engine of TP 2 (transformers' Glm4MoeForCausalLM, its projections, shared
    experts and every fused expert split over the engine's two ranks; router and its bias whole)."""
    (entry,) = world2["update"]
    assert "error" not in entry, entry.get("error")
    ref = glm_references["glm"]
    assert (world2["engine_before"] - ref).abs().max() > 1e-2
    assert entry["report"].tensors == len(CheckpointReader(glm_sources["glm"]).keys())
    assert_logits_close(entry["engine_logits"], ref)


@pytest.mark.parametrize("fmt", ["torch_dist", "legacy"])
def test_convert_megatron_checkpoint(glm_sources, glm_references, world2, fmt, tmp_path):
    """A PP 2 job's checkpoint (dense stage then MoE, the expert bias among its buffers) converted: bit for
    bit the HF checkpoint it was built from, whose logits equal the Megatron model's."""
    src = glm_sources["glm"]
    report = convert_checkpoint(os.path.join(glm_sources["root"], "megatron", fmt), src, tmp_path / "hf",
                                bucket_bytes=40_000, verify=src)
    assert report.verify.ok, report.verify.render(src, str(tmp_path / "hf"))
    assert report.verify.compared == len(CheckpointReader(src).keys())
    megatron = world2["saves"][-1][0]["logits"]  # the last stage's
    assert_logits_close(megatron, glm_references["glm"])
    assert_logits_close(hf_logits(str(tmp_path / "hf"), INPUT_IDS), megatron)


def test_fsdp2_model_streams_as_saved(glm_sources):
    """transformers' Glm4MoeForCausalLM under FSDP2 (2 ranks, fused experts sharded): streamed in full mode,
    bit for bit what ``save_pretrained`` wrote."""
    from tests.helpers.fsdp_workers import run_fsdp_cases

    src = glm_sources["glm"]
    results = launch(2, run_fsdp_cases, [("run_fsdp_stream", src, (2,), ["full"])])
    with CheckpointReader(src) as reader:
        want = {n: reader.get(n).clone() for n in reader.keys()}
    for (out,) in results:
        assert any("Shard" in p for p in out["placements"].values())
        for got in (out["full"], out["again"]):
            assert set(got["tensors"]) == set(want)
            assert [n for n, t in got["tensors"].items() if t.dtype != want[n].dtype or not torch.equal(t, want[n])] \
                == []
