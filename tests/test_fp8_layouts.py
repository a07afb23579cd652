"""Block FP8 streams over real Megatron-Core jobs (gloo) and a plain transformers model: every tensor the family
declares FP8 leaves as float8 values and float32 scales bit-identical to the source quantized
(weightstream.converters.fp8), every other tensor as it is, no name missing or extra; per-rank shards equal the
whole tensor's blocks; a shard off the block grid, or a family with no FP8 declaration, is refused before
anything is sent."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import FAMILIES
from tests.helpers.checks import assert_full_exact, assert_per_rank_assembles, by_label
from tests.helpers.fp8_truth import same_bits
from tests.helpers.workers import Case, run_cases
from weightstream.converters import Converter, register_converter, unregister_converter
from weightstream.converters.fp8 import quantize_weight
from weightstream.converters.qwen3 import QWEN3
from weightstream.errors import ConversionError
from weightstream.jobs import Layout
from weightstream.launch import launch
from weightstream.models.presets import preset_config, random_hf_model, save_random_checkpoint
from weightstream.streaming.stream import stream_hf_weights
from weightstream.wire.fp8 import FP8, SCALE_SUFFIX, BlockFP8

SMALL = BlockFP8(block=(16, 16))  # divides every dimension of the tiny presets (and their TP-2 shards)


@pytest.fixture(scope="module")
def moe_source(tmp_path_factory) -> str:
    return save_random_checkpoint(preset_config("tiny-qwen3-moe"), tmp_path_factory.mktemp("fp8moe") / "m", seed=41)


def test_megatron_layouts_quantized(sources, moe_source):
    ue8m0 = BlockFP8(block=(16, 16), scale_fmt="ue8m0")
    cases = [Case(sources[f], Layout(2, 1), label=f"tp2 {f}", quantize=SMALL) for f in FAMILIES]
    cases += [
        Case(sources["tiny-qwen2"], Layout(1, 2), label="pp2", quantize=SMALL),
        Case(sources["tiny-qwen3"], Layout(2, 1), mode="per_rank", label="tp2 per_rank", quantize=SMALL),
        Case(sources["tiny-qwen3"], Layout(2, 1), label="tp2 ue8m0", quantize=ue8m0),
        Case(sources["tiny-qwen3"], Layout(1, 1), label="block 128", quantize=BlockFP8()),  # ragged blocks
        Case(moe_source, Layout(1, 1, ep=2), label="ep2 moe", quantize=SMALL),
        Case(moe_source, Layout(2, 1, ep=1, etp=2), label="etp2 moe", quantize=SMALL),
    ]
    results = by_label(launch(2, run_cases, cases))
    for f in FAMILIES:
        assert_full_exact(results[f"tp2 {f}"], sources[f], SMALL)
    assert_full_exact(results["pp2"], sources["tiny-qwen2"], SMALL)
    assert_per_rank_assembles(results["tp2 per_rank"], sources["tiny-qwen3"], tp=2, fp8=SMALL)
    assert_full_exact(results["tp2 ue8m0"], sources["tiny-qwen3"], ue8m0)
    assert_full_exact(results["block 128"], sources["tiny-qwen3"], BlockFP8())
    assert_full_exact(results["ep2 moe"], moe_source, SMALL)
    assert_full_exact(results["etp2 moe"], moe_source, SMALL)
    names = results["tp2 tiny-qwen3"][0]["names"]
    assert "model.layers.0.self_attn.q_proj.weight" + SCALE_SUFFIX in names
    assert "model.embed_tokens.weight" + SCALE_SUFFIX not in names and "lm_head.weight" + SCALE_SUFFIX not in names
    moe_names = results["ep2 moe"][0]["names"]
    assert "model.layers.0.mlp.experts.3.down_proj.weight" + SCALE_SUFFIX in moe_names
    assert "model.layers.0.mlp.gate.weight" + SCALE_SUFFIX not in moe_names  # the router stays as it is


def test_shards_off_the_block_grid_are_refused_on_every_rank(sources):
    case = Case(sources["tiny-qwen3"], Layout(2, 1), mode="per_rank", label="off grid", quantize=BlockFP8())
    got = launch(2, run_cases, [], [(case, "", {})])
    for rank in got:
        (err,) = rank
        assert err["type"] == "ConversionError", err
        assert "does not fall on 128-wide blocks" in err["message"] and "TP rank 1" in err["message"], err["message"]


@pytest.mark.unit
def test_plain_transformers_model_quantized_bit_for_bit():
    cfg = preset_config("tiny-qwen3")
    model = random_hf_model(cfg, seed=3, dtype=torch.bfloat16)
    held = dict(model.state_dict())
    for _ in range(2):  # the second stream reuses the kept plan, its buffers and its quantization calls
        stream = stream_hf_weights(model, cfg, quantize=SMALL, reuse_buffers=True)
        got = {n: t.clone() for b in stream for n, t in b.named_tensors()}
        # Quantized inside the batched packing: every tensor a view of a parameter, none converted one by one.
        assert stream.stats.unbatched == 0 and stream.stats.batched == len(held) - cfg.tie_word_embeddings
    quantized = [n for n in held if QWEN3.quantizes(n)]
    assert len(quantized) == 28  # q, k, v, o and gate, up, down of 4 layers
    expected = set(held) - {"lm_head.weight"} if cfg.tie_word_embeddings else set(held)
    assert set(got) == expected | {n + SCALE_SUFFIX for n in quantized}
    for name in expected:
        if name in quantized:
            values, scales = quantize_weight(SMALL, held[name])
            assert got[name].dtype == FP8 and same_bits(got[name], values), name
            assert same_bits(got[name + SCALE_SUFFIX], scales), name
        else:
            assert same_bits(got[name], held[name]), name


@pytest.mark.unit
def test_family_without_fp8_declaration_is_refused():
    register_converter("qwen3", Converter("qwen3", QWEN3.mappings, features=QWEN3.features), overwrite=True)
    try:
        cfg = preset_config("tiny-qwen3")
        with pytest.raises(ConversionError, match="declares no FP8 weights"):
            stream_hf_weights(random_hf_model(cfg, seed=3), cfg, quantize=SMALL)
    finally:
        unregister_converter("qwen3")
        register_converter("qwen3", QWEN3)


@pytest.mark.unit
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_checkpoint_loads_in_transformers_with_its_fp8_config(tmp_path, preset):
    """The written checkpoint carries quantization_config; transformers loads it (dequantized on the CPU) to
    exactly ``fp8 × scale`` per block, and its logits are within FP8 error of the bf16 model's."""
    import json

    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    from tests.helpers.checks import INPUT_IDS
    from weightstream.converters.fp8 import dequantize_block_fp8
    from weightstream.sinks.safetensors import save_hf_checkpoint

    cfg = preset_config(preset)
    model = random_hf_model(cfg, seed=5, dtype=torch.bfloat16).eval()
    report = save_hf_checkpoint(model, cfg, tmp_path / "fp8", quantize=SMALL)
    written = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert written["quant_method"] == "fp8" and written["weight_block_size"] == [16, 16]
    assert written["fmt"] == "e4m3" and written["activation_scheme"] == "dynamic"
    assert "lm_head" in written["modules_to_not_convert"] and "model.embed_tokens" in written["modules_to_not_convert"]
    assert any(n.endswith(SCALE_SUFFIX) for n in (e.name for e in report.entries))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16,
                                                  quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    got = dict(loaded.state_dict())
    name = "model.layers.1.self_attn.o_proj.weight"
    values, scales = quantize_weight(SMALL, dict(model.state_dict())[name])
    assert same_bits(got[name], dequantize_block_fp8(values, scales, SMALL.block))
    ids = torch.tensor(INPUT_IDS)
    with torch.no_grad():
        ref, out = model(ids).logits.float(), loaded(ids).logits.float()
    # e4m3 keeps 3 mantissa bits (a weight moves by up to 1/16 of its block's largest); the bound: 10 % of the
    # largest logit. Measured: 0.114 on logits up to 1.37 (tiny-qwen3), 0.121 on 1.52 (tiny-qwen3-moe).
    diff = float((ref - out).abs().max())
    print(f"{preset}: max |logits diff| {diff:.4f} on logits up to {float(ref.abs().max()):.3f}")
    assert diff <= 0.1 * max(1.0, float(ref.abs().max())), (diff, float(ref.abs().max()))


def test_dump_writes_block_fp8_from_the_command_line(tmp_path):
    """``weightstream dump --quantize fp8-block``: a TP-2 job writes the FP8 checkpoint and its config; a bad
    block is refused by the parser."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from weightstream.common.hf_files import CheckpointReader

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "weightstream.cli", "dump", "--preset", "tiny-qwen3", "--tp", "2",
           "--out", str(tmp_path / "q"), "--quantize", "fp8-block", "--fp8-block", "16x16", "--fp8-scales", "ue8m0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert config["weight_block_size"] == [16, 16] and config["scale_fmt"] == "ue8m0"
    with CheckpointReader(tmp_path / "q") as r:
        values = r.get("model.layers.1.mlp.up_proj.weight")
        scales = r.get("model.layers.1.mlp.up_proj.weight_scale_inv")
        assert values.dtype == FP8 and tuple(scales.shape) == (96 // 16, 64 // 16)
        assert not (scales.view(torch.int32) & 0x7FFFFF).any()  # powers of two
        assert r.get("model.embed_tokens.weight").dtype == torch.float32
    bad = subprocess.run(cmd[:-4] + ["--fp8-block", "16"], capture_output=True, text=True, timeout=120, cwd=root)
    assert bad.returncode == 2 and "expected ROWSxCOLS" in bad.stderr
