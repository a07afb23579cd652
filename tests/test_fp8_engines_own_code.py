"""Block-FP8 buckets through SGLang's and LMDeploy's own receivers and block-FP8 weight loaders, at engine TP 2
(tests/engines/sglang_fp8_check.py, tests/engines/lmdeploy_fp8_check.py; run by the engines' python:
``WEIGHTSTREAM_SGLANG_PYTHON`` / ``WEIGHTSTREAM_LMDEPLOY_PYTHON``, skipped without them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.checks import engine_check

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ROOT / "tests" / "engines"
FUSED = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]
# SGLang's and LMDeploy's parameters on one engine TP rank of 2 (hidden 256, 4 + 2 + 2 heads of 128, MLP 512)
SHARD_SHAPES = {"self_attn.qkv_proj": ([512, 256], [4, 2]), "self_attn.o_proj": ([256, 256], [2, 2]),
                "mlp.gate_up_proj": ([512, 256], [4, 2]), "mlp.down_proj": ([256, 256], [2, 2])}


@pytest.fixture(scope="module")
def sglang_fp8() -> dict:
    return engine_check("sglang", "sglang, einops", ENGINES / "sglang_fp8_check.py", ROOT)


@pytest.fixture(scope="module")
def lmdeploy_fp8() -> dict:
    return engine_check("lmdeploy", "lmdeploy.utils", ENGINES / "lmdeploy_fp8_check.py", ROOT)


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_sglang_block_fp8_loaders_store_each_ranks_slice_of_our_tensors(sglang_fp8, scale_fmt):
    """One dense bucket (bf16 norm, float8 weights, float32 scales) through SGLang's distributed receiver, then
    SGLang's Qwen3 load_weights into its QKV / merged gate-up (column) and o / down (row) parallel linears with
    Fp8LinearMethod, for engine TP ranks 0 and 1: each parameter holds that rank's slice of our values and
    scales, bit for bit."""
    assert sglang_fp8["sglang_version"] == "0.5.23"
    res = sglang_fp8["formats"][scale_fmt]
    assert res["ok"], res
    assert res["received_equal"] and res["dtypes_sent"] == ["bfloat16", "float32", "float8_e4m3fn"]
    assert [r["rank"] for r in res["ranks"]] == [0, 1]
    for r in res["ranks"]:
        assert r["methods"] == ["Fp8LinearMethod"]
        for param in FUSED:
            weight, scale = SHARD_SHAPES[param]
            assert r["params"][f"{param}.weight"] == ["torch.float8_e4m3fn", weight, "ModelWeightParameter"]
            assert r["params"][f"{param}.weight_scale_inv"] == ["torch.float32", scale, "BlockQuantScaleParameter"]
        assert all(r["equal"].values()) and len(r["equal"]) == 2 * len(FUSED) + 1


@pytest.mark.parametrize("path", ["broadcast", "ipc"])
def test_lmdeploy_blocked_fp8_loaders_store_each_ranks_slice_of_our_tensors(lmdeploy_fp8, path):
    """Single-dtype buckets (bf16, float8_e4m3fn, float32) through LMDeploy's update_weights_from_distributed or
    update_params (another process), then its post-load pass, into the blocked-FP8 layers its builders make
    for our quantization_config at engine TP ranks 0 and 1: each parameter holds that rank's slice of ours."""
    assert lmdeploy_fp8["lmdeploy_version"] == "0.18.0" and "error" not in lmdeploy_fp8, lmdeploy_fp8
    res = lmdeploy_fp8[path]
    assert res["ok"], res
    if path == "broadcast":
        assert res["dtypes_per_bucket"] == [["bfloat16"], ["float8_e4m3fn"], ["float32"]]
    for r in res["ranks"]:
        assert r["classes"] == {"self_attn.qkv_proj": "QKVBlockedF8Linear", "self_attn.o_proj": "BlockedF8Linear",
                                "mlp.gate_up_proj": "MergedBlockedF8Linear", "mlp.down_proj": "BlockedF8Linear"}
        for param in FUSED:
            weight, scale = SHARD_SHAPES[param]
            assert r["params"][f"{param}.weight"] == ["torch.float8_e4m3fn", weight]
            assert r["params"][f"{param}.weight_scale_inv"] == ["torch.float32", scale]
        assert all(r["equal"].values()) and len(r["equal"]) == 2 * len(FUSED) + 1


def test_lmdeploy_does_not_requantize_what_we_send(lmdeploy_fp8):
    """LMDeploy's own quantizer (a division) gives other scales and values than ours for these very weights; sent
    as our FP8 they are stored as ours (tests above), sent in bf16 as its own quantization."""
    own = lmdeploy_fp8["own_quantization"]
    assert own["differs_somewhere"] and own["bf16_update_stored_as_lmdeploy_quantized"]
    assert sum(w["scales_differ"] for w in own["per_weight"].values()) > 0


def test_lmdeploy_takes_fp8_into_an_unquantized_model_without_a_word(lmdeploy_fp8):
    """Why a statement must be right for LMDeploy (nothing to check it against): its unquantized layers cast
    float8 weights into bf16, and only the scales fail."""
    wrong = lmdeploy_fp8["wrong_statement"]
    assert wrong["classes"] == ["BaseLinear", "MergedBaseLinear", "QKVBaseLinear"]
    assert wrong["float8_weights_loaded_into"] == "torch.bfloat16"
    assert wrong["scales_error"] == "KeyError: 'model.layers.0.self_attn.qkv_proj.weight_scale_inv'"
