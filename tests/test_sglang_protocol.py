"""The SGLang adapter against SGLang's own code (SGLang 0.5.23, CPU; no server is started).

tests/engines/sglang_check.py runs in a python that has sglang (``WEIGHTSTREAM_SGLANG_PYTHON``; .ci/run builds
one) and prints one JSON object: every request body :class:`SGLangEngine` sends, decoded by SGLang's HTTP
layer into its request class; the broadcast layout against SGLang's distributed receiver; the IPC payloads
decoded in another process by SGLang's deserializer and model-runner path. Skipped without that python,
failed instead when ``WEIGHTSTREAM_REQUIRE_SGLANG=1``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.checks import engine_check

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "engines" / "sglang_check.py"
OUR_EXTRAS = {"timeout_s", "weightstream_checksum", "weightstream_checksums"}
ROUTES = {  # every route the adapter uses
    "GET /get_server_info", "GET /model_info", "POST /pause_generation", "POST /continue_generation",
    "POST /begin_weight_update", "POST /end_weight_update", "POST /flush_cache", "POST /init_weights_update_group",
    "POST /destroy_weights_update_group", "POST /update_weights_from_distributed",
    "POST /update_weights_from_tensor", "POST /release_memory_occupation", "POST /resume_memory_occupation",
}


@pytest.fixture(scope="module")
def result() -> dict:
    return engine_check("sglang", "sglang, sglang.srt.weight_sync.tensor_bucket", CHECK, ROOT)


def test_sglang_version(result):
    assert result["sglang_version"] == "0.5.23", "docs/engines.md and the adapter were checked against 0.5.23"


def test_every_route_decodes(result):
    sent = result["requests"]
    assert ROUTES <= set(result["routes_sent"]), ROUTES - set(result["routes_sent"])
    assert all(r["route_exists"] for r in sent), [r["path"] for r in sent if not r["route_exists"]]
    bad = [(r["call"], r["path"], r.get("error")) for r in sent if not r.get("decoded")]
    assert not bad, bad
    assert result["all_decoded"] and result["all_routes_exist"]
    assert not result["missing_required"], result["missing_required"]
    assert not result["mismatched_values"], result["mismatched_values"]
    body_classes = {r["path"]: r["request_class"] for r in sent}
    assert body_classes["/update_weights_from_tensor"] == "UpdateWeightsFromTensorReqInput"
    assert body_classes["/update_weights_from_distributed"] == "UpdateWeightsFromDistributedReqInput"
    assert body_classes["/init_weights_update_group"] == "InitWeightsUpdateGroupReqInput"


def test_no_unknown_field_beyond_our_extras(result):
    assert not result["unknown_beyond_extras"], result["unknown_beyond_extras"]
    assert set(result["unknown_fields"]) <= OUR_EXTRAS


def test_broadcast_layout_matches_sglang_receiver(result):
    b = result["broadcast"]
    assert b["error"] is None, b["error"]
    assert b["layout_equal"], (b["our_layout"], b["sglang_layout"])
    assert b["nbytes_equal"], (b["our_nbytes"], b["sglang_nbytes"])
    assert b["dtypes_equal"] and b["shapes_equal"]
    assert b["tensors_equal"]


def test_ipc_payloads_decode_in_another_process(result):
    ipc = result["ipc"]
    assert ipc.get("child") is not None, ipc.get("child_stderr")
    assert ipc["other_process"]
    assert ipc["one_payload_per_rank"] and ipc["child"]["n_payloads"] == ipc["engine_tp_size"]
    assert ipc["child"]["load_format"] == "flattened_bucket"
    for rank in ipc["child"]["ranks"]:
        assert rank["error"] is None, (rank["error"], rank.get("traceback"))
        assert rank["success"] and rank["payload_keys"] == ["flattened_tensor", "metadata"]
        assert rank["names_equal"] and rank["dtypes_equal"] and rank["shapes_equal"] and rank["tensors_equal"]
    assert ipc["ok"] and result["ok"]


def test_block_fp8_bucket_through_sglang_receivers(result):
    """A dense (align=1) bucket of a bf16 norm + X.weight (float8_e4m3fn) + X.weight_scale_inv (float32) from
    quantize_block_fp8: SGLang's FlattenedTensorBucket.empty gives our layout, its distributed receive path and
    its IPC path (another process) give the tensors bit for bit, under the names, dtypes and shapes sent."""
    fp8 = result["fp8"]
    assert fp8["dtypes_sent"] == ["bfloat16", "float8_e4m3fn", "float32"]
    assert fp8["shapes_sent"] == [[256], [320, 200], [3, 2]]
    assert fp8["aligned"] and fp8["offsets"][2] % 4 == 0  # the float32 scales start at a 4-byte offset
    b = fp8["broadcast"]
    assert b["error"] is None and b["layout_equal"] and b["nbytes_equal"], b
    assert b["dtypes_equal"] and b["shapes_equal"] and b["tensors_equal"]
    assert b["sglang_dtypes"] == ["torch.bfloat16", "torch.float8_e4m3fn", "torch.float32"]
    for rank in fp8["ipc"]["child"]["ranks"]:
        assert rank["error"] is None and rank["success"], rank.get("traceback")
        assert rank["dtypes"] == ["torch.bfloat16", "torch.float8_e4m3fn", "torch.float32"]
        assert rank["names_equal"] and rank["shapes_equal"] and rank["tensors_equal"]
    assert fp8["ipc"]["ok"] and fp8["ok"]


def test_misaligned_scales_are_refused_before_sglang(result):
    """An odd-length bf16 tensor ahead of an FP8 pair in a dense bucket would put the scales at an offset
    SGLang cannot view as float32: weightstream's own bucket refuses it first (no bytes reach the engine)."""
    fp8 = result["fp8"]
    assert "must be divisible by 4" in fp8["odd_norm_error"]
    assert fp8["odd_norm_raised_in"].endswith("weightstream/streaming/bucket.py")
