"""Llama (3.1 untied, 3.2 tied, both with Llama 3 rotary scaling) and Mistral over real Megatron-Core models in real
gloo jobs: the HF tensors bit-identical to what ``save_pretrained`` writes, exactly its keys, and the Megatron model's
logits equal to the HF model's, in TP 2 (grouped-query attention: one and two KV heads per rank), PP 2 (tied: the
last stage's copy of the embedding), PP 2 x VPP 2; per-rank mode; Transformer Engine names; block FP8; the rotary
scaling carried into the Megatron model and into the config written; a Megatron checkpoint converted; an update
into the reference engine; transformers' own models."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import hf_logits
from tests.helpers.checks import (
    INPUT_IDS,
    assert_full_exact,
    assert_logits_close,
    assert_per_rank_assembles,
    by_label,
)
from tests.helpers.workers import Case, run_cases
from weightstream.converters import get_converter, model_spec
from weightstream.converters.expected import expected_hf_shapes
from weightstream.converters.fp8 import BlockFP8
from weightstream.converters.qwen2 import QWEN2
from weightstream.errors import ConversionError
from weightstream.jobs import Layout
from weightstream.launch import launch
from weightstream.models.presets import preset_config, save_random_checkpoint
from weightstream.models.spec import Llama3Rope

FAMILIES = ("tiny-llama", "tiny-llama-tied", "tiny-mistral")


@pytest.fixture(scope="module")
def llama_sources(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("llama")
    return {name: save_random_checkpoint(preset_config(name), root / name, seed=90 + i)
            for i, name in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def llama_references(llama_sources) -> dict[str, torch.Tensor]:
    return {name: hf_logits(src, INPUT_IDS) for name, src in llama_sources.items()}


def _assert_logits(results: list[dict], ref: torch.Tensor) -> None:
    assert ref.abs().max().item() > 0.1
    for r in results:
        assert_logits_close(r["logits"], ref, atol=1e-5)


@pytest.mark.unit
def test_llama_is_qwen2_without_the_qkv_bias_and_mistral_is_llama():
    llama, mistral = get_converter("llama"), get_converter("mistral")
    assert [m.megatron for m in QWEN2.mappings if m not in llama.mappings] == [
        "decoder.layers.*.self_attention.linear_qkv.bias"]
    assert mistral.mappings == llama.mappings and mistral.fp8 == llama.fp8 == QWEN2.fp8
    shapes = expected_hf_shapes(preset_config("tiny-llama-tied"))
    assert "lm_head.weight" not in shapes and len(shapes) == 2 + 9 * 4
    assert [n for n in shapes if llama.quantizes(n)] == [n for n in shapes if n.endswith("_proj.weight")]
    # The rotary scaling is read into the spec, for the Megatron model built for it.
    spec = model_spec(preset_config("tiny-llama-tied"))
    assert (spec.rope_type, spec.llama3_rope, spec.rope_theta) == ("llama3", Llama3Rope(32.0, 1.0, 4.0, 8192), 5e5)
    assert (spec.head_dim, spec.q_per_group, spec.qkv_bias) == (8, 4, False)
    assert model_spec(preset_config("tiny-mistral")).head_dim == 16  # not hidden / heads


def test_what_the_llama_family_cannot_carry_is_refused_naming_it():  # not unit: it imports Megatron-Core
    from weightstream.checks.megatron_models import _rope_scaling

    biased = preset_config("tiny-llama")
    biased.attention_bias, biased.mlp_bias = True, True
    with pytest.raises(ValueError, match="llama configs with attention_bias and mlp_bias are not supported"):
        model_spec(biased)
    assert _rope_scaling(model_spec(preset_config("tiny-llama"))) == {"rope_scaling": True, "rope_scaling_factor": 8.0}
    assert _rope_scaling(model_spec(preset_config("tiny-mistral"))) == {}
    odd = preset_config("tiny-llama")
    odd.rope_parameters = {**odd.rope_parameters, "low_freq_factor": 2.0}
    linear = preset_config("tiny-mistral")
    linear.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}
    for cfg, what in ((odd, "low_freq_factor=2.0"), (linear, "rope_type 'linear'")):
        with pytest.raises(ConversionError) as err:
            _rope_scaling(model_spec(cfg))
        assert what in str(err.value)


def test_llama_world2_tp_gqa_pp_vpp_tied_per_rank_te(llama_sources, llama_references, tmp_path):
    src = llama_sources
    written = tmp_path / "written"
    cases = [
        Case(src["tiny-llama"], Layout(2, 1), label="tp2 llama", logits=True, save_to=str(written)),
        Case(src["tiny-llama-tied"], Layout(2, 1), label="tp2 tied", logits=True),  # one KV head per rank
        Case(src["tiny-mistral"], Layout(2, 1), label="tp2 mistral", logits=True),
        Case(src["tiny-llama"], Layout(1, 2, vpp=2), label="pp2 vpp2 llama", logits=True),
        Case(src["tiny-llama-tied"], Layout(1, 2), label="pp2 tied", logits=True),
        Case(src["tiny-llama-tied"], Layout(2, 1), mode="per_rank", label="tp2 per_rank tied"),
        Case(src["tiny-mistral"], Layout(2, 1), mode="per_rank", label="tp2 per_rank mistral"),
        Case(src["tiny-llama-tied"], Layout(2, 1), te_names=True, label="tp2 te tied"),
        Case(src["tiny-llama"], Layout(1, 2), te_names=True, label="pp2 te llama"),
        Case(src["tiny-llama-tied"], Layout(2, 1), label="tp2 fp8 tied", quantize=BlockFP8(block=(16, 16))),
    ]
    results = by_label(launch(2, run_cases, cases))

    for label, family in (("tp2 llama", "tiny-llama"), ("tp2 tied", "tiny-llama-tied"),
                          ("tp2 mistral", "tiny-mistral"), ("pp2 vpp2 llama", "tiny-llama"),
                          ("pp2 tied", "tiny-llama-tied")):
        assert_full_exact(results[label], src[family])
        _assert_logits(results[label], llama_references[family])
    assert_full_exact(results["tp2 te tied"], src["tiny-llama-tied"])
    assert_full_exact(results["pp2 te llama"], src["tiny-llama"])
    assert_full_exact(results["tp2 fp8 tied"], src["tiny-llama-tied"], BlockFP8(block=(16, 16)))
    assert "model.layers.3.mlp.down_proj.weight_scale_inv" in results["tp2 fp8 tied"][0]["names"]
    assert_per_rank_assembles(results["tp2 per_rank tied"], src["tiny-llama-tied"], tp=2)
    assert_per_rank_assembles(results["tp2 per_rank mistral"], src["tiny-mistral"], tp=2)
    for r in results["tp2 per_rank tied"] + results["tp2 per_rank mistral"]:
        assert r["stats"].gathers == 0

    # The rotary scaling matters to these logits (the same weights without it differ by far more than the
    # tolerance), so the Megatron model computes it; and the config written with the checkpoint keeps it.
    plain = preset_config("tiny-llama")
    plain.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    unscaled = save_random_checkpoint(plain, tmp_path / "unscaled", seed=90)
    assert (hf_logits(unscaled, INPUT_IDS) - llama_references["tiny-llama"]).abs().max() > 1e-4
    config = json.loads((written / "config.json").read_text())
    assert config["rope_parameters"] == preset_config("tiny-llama").rope_parameters
    assert_logits_close(hf_logits(str(written), INPUT_IDS), llama_references["tiny-llama"])


def test_llama_megatron_checkpoint_converts_and_updates_the_reference_engine(llama_sources, tmp_path):
    """A PP 2 Megatron job's checkpoint (tied Llama: the last stage's copy of the embedding is on disk too) converted
    in both formats, bit for bit; then a TP 2 trainer updates a TP 2 reference engine (point to point, each rank
    its own shards, the vocabulary re-split) and the engine's logits equal the HF model's."""
    from tests.helpers.family_workers import run_updates
    from tests.helpers.megatron_saves import run_saves
    from weightstream.common.hf_files import CheckpointReader
    from weightstream.convert import convert_checkpoint
    from weightstream.engines import ReferenceEngine
    from weightstream.reference_engine.server import serve, stop

    tied = llama_sources["tiny-llama-tied"]
    (saved,) = launch(2, run_saves, [(Case(tied, Layout(1, 2)), str(tmp_path / "megatron"))])[-1]
    ref = hf_logits(tied, INPUT_IDS)
    assert_logits_close(saved["logits"], ref)
    for fmt in ("torch_dist", "legacy"):
        report = convert_checkpoint(tmp_path / "megatron" / fmt, tied, tmp_path / fmt, bucket_bytes=40_000,
                                    verify=tied)
        assert report.verify.ok and report.verify.compared == len(CheckpointReader(tied).keys()), fmt
        assert_logits_close(hf_logits(str(tmp_path / fmt), INPUT_IDS), ref)

    server = serve(save_random_checkpoint(preset_config("tiny-llama-tied"), tmp_path / "engine", seed=5), 2)
    try:
        before = ReferenceEngine(server.url).logits(INPUT_IDS)
        update = [{"transport": "auto", "bucket_bytes": 60_000, "weight_version": "llama-1"}]
        ((result,),) = launch(2, run_updates, [(Case(tied, Layout(2, 1)), [server.url], update)])[0]
    finally:
        stop(server)
    assert result["report"].transport == "p2p" and result["report"].weight_version == "llama-1"
    assert (before - ref).abs().max() > 1e-2
    assert_logits_close(result["engine_logits"], ref)


@pytest.mark.unit
def test_llama_3_1_8b_preset_has_the_real_shapes():
    """``llama-3.1-8b`` (for ``weightstream bench``): Meta's 8,030,261,248 parameters in 291 HF tensors."""
    import math

    shapes = expected_hf_shapes(preset_config("llama-3.1-8b"))
    assert len(shapes) == 291 and sum(math.prod(s) for s in shapes.values()) == 8_030_261_248
    assert shapes["model.layers.31.self_attn.k_proj.weight"] == (1024, 4096)
    assert model_spec(preset_config("llama-3.1-8b")).llama3_rope == Llama3Rope(8.0, 1.0, 4.0, 8192)


def test_llama_and_mistral_transformers_models_stream_as_saved(tmp_path):
    """No process group: transformers' own Llama (tied: the embedding once) and Mistral models, in bf16, stream
    exactly as ``save_pretrained`` writes them."""
    from weightstream.common.hf_files import CheckpointReader
    from weightstream.models.presets import random_hf_model
    from weightstream.streaming.stream import stream_hf_weights

    for i, name in enumerate(("tiny-llama-tied", "tiny-mistral")):
        model = random_hf_model(preset_config(name), seed=97 + i, dtype=torch.bfloat16)
        model.save_pretrained(tmp_path / name)
        with CheckpointReader(str(tmp_path / name)) as reader:
            want = dict(reader.items())
        got = {n: t.clone() for b in stream_hf_weights(model, tmp_path / name, bucket_bytes=60_000)
               for n, t in b.named_tensors()}
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want), name
