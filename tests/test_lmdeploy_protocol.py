"""The LMDeploy adapter against LMDeploy's own code (LMDeploy 0.18.0, CPU; no model, no GPU).

tests/engines/lmdeploy_check.py runs in a python that has lmdeploy (``WEIGHTSTREAM_LMDEPLOY_PYTHON``; .ci/run
builds one, the same environment as SGLang's) and prints one JSON object: every request
:class:`LMDeployEngine` sends, over HTTP to LMDeploy's own routes (``create_openai_router`` on its
``ServerContext`` and ``AsyncEngine``; the PyTorch engine behind them records what it receives); the
broadcast through LMDeploy's ``update_weights_from_distributed``; the IPC payloads decoded in another process
by LMDeploy's ``update_params``. Skipped without that python, failed instead when
``WEIGHTSTREAM_REQUIRE_LMDEPLOY=1``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.checks import engine_check

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "engines" / "lmdeploy_check.py"
ROUTES = {  # every route the adapter uses
    "GET /distserve/engine_info", "GET /is_sleeping", "POST /abort_request", "POST /sleep", "POST /wakeup",
    "POST /init_weights_update_group", "POST /destroy_weights_update_group",
    "POST /update_weights_from_distributed", "POST /update_weights",
}


@pytest.fixture(scope="module")
def result() -> dict:
    return engine_check("lmdeploy", "lmdeploy.utils, lmdeploy.serve.openai.protocol", CHECK, ROOT)


def _requests(result, path: str) -> list[dict]:
    return [r for r in result["requests"] if r["path"].split("?")[0] == path]


def _event(result, call: str) -> dict:
    return next(e for e in result["events"] if e["call"] == call)


def test_lmdeploy_version(result):
    assert result["lmdeploy_version"] == "0.18.0", "docs/engines.md and the adapter were checked against 0.18.0"


def test_every_route_decodes(result):
    sent = result["requests"]
    assert ROUTES <= set(result["routes_sent"]), ROUTES - set(result["routes_sent"])
    assert all(r["route_exists"] for r in sent), [r["path"] for r in sent if not r["route_exists"]]
    assert all(r["http_requests"] == 1 for r in sent)
    bad = [(r["call"], r["path"], r["status"], r.get("error")) for r in sent if not r["decoded"]]
    assert not bad, bad
    assert result["all_decoded"] and result["all_routes_exist"] and result["all_json_content_type"]
    assert not result["missing_required"], result["missing_required"]
    assert not result["mismatched_values"], result["mismatched_values"]
    classes = {r["path"].split("?")[0]: r["request_class"] for r in sent}
    assert classes["/update_weights"] == "UpdateParamsRequest"
    assert classes["/update_weights_from_distributed"] == "UpdateWeightsFromDistributedRequest"
    assert classes["/init_weights_update_group"] == "InitWeightsUpdateGroupRequest"
    assert classes["/destroy_weights_update_group"] == "DestroyWeightsUpdateGroupRequest"
    assert classes["/abort_request"] == "AbortRequest"
    for r in sent:  # the object the engine received is the route's own request class
        if r["request_class"] and r["path"] != "/abort_request":
            assert r["built_class"] == r["request_class"] and r["built_by"].startswith("route"), r
    statuses = {r["call"]: r["status"] for r in sent}
    assert statuses.pop("pause() [no abort handling: 501]") == 501
    assert set(statuses.values()) == {200}, statuses


def test_no_unknown_field(result):
    # LMDeploy's pydantic requests ignore unknown fields: the adapter sends none, so nothing is silently lost.
    assert result["unknown_fields"] == [], result["unknown_fields"]


def test_engine_info_is_a_json_string(result):
    (r,) = _requests(result, "/distserve/engine_info")
    assert r["reply_text"].startswith('"{') and json.loads(json.loads(r["reply_text"]))["tp_size"] == 2
    info = _event(result, "info(refresh=True)")["result"]
    assert info["engine"] == "lmdeploy" and info["tp_size"] == 2 and info["pp_size"] == 1
    assert {"broadcast", "ipc", "release_memory", "single_dtype"} <= set(info["capabilities"])


def test_pause_aborts_and_tolerates_501(result):
    on, off = _event(result, "pause() [--enable-abort-handling]"), _event(result, "pause() [no abort handling: 501]")
    assert on["raised"] is None and on["abort_epoch_after"] == on["abort_epoch_before"] + 1  # stop_all_session ran
    assert off["raised"] is None and off["abort_epoch_after"] == off["abort_epoch_before"]
    (r501,) = [r for r in result["requests"] if r["call"] == "pause() [no abort handling: 501]"]
    assert "enable-abort-handling" in r501["raised"]  # the adapter saw the 501 and went on


def test_sleep_levels_and_wakeup_tags(result):
    assert _event(result, "release_memory()")["engine_calls"] == [["sleep", 2]]
    assert _event(result, "release_memory(['kv_cache'])")["engine_calls"] == [["sleep", 1]]
    assert _event(result, "is_sleeping() [after sleep]")["result"] is True
    assert _event(result, "resume_memory(['weights'])")["engine_calls"] == [["wakeup", ["weights"]]]
    ev = _event(result, "resume_memory(['kv_cache','cuda_graph'])")
    assert ev["engine_calls"] == [["wakeup", ["kv_cache"]]] and ev["is_sleeping_after"] is False
    assert _event(result, "is_sleeping() [awake]")["result"] is False
    # level 1 offloaded the weights too: they wake first, with the KV cache
    ev = _event(result, "resume_memory(['kv_cache','cuda_graph']) [after level 1]")
    assert ev["engine_calls"] == [["wakeup", ["weights", "kv_cache"]]] and ev["sleeping_tags_after"] == []
    # LMDeploy answers 200 to waking a tag that is awake and does nothing (why the adapter tracks the tags)
    ev = _event(result, "resume_memory(['weights']) [awake, fresh adapter]")
    assert ev["requests"] == 1 and ev["engine_calls"] == []


def test_finished_flag_semantics(result):
    dist = [json.loads(r["decoded_fields"]["finished"].lower())
            for r in _requests(result, "/update_weights_from_distributed")]
    assert dist == [False, True, False, True]  # bucket, commit, bucket, abort
    empty = [r for r in _requests(result, "/update_weights_from_distributed") if r["decoded_fields"]["names"] == "[]"]
    assert [r["call"] for r in empty] == ["commit_update [broadcast]", "abort_update"]
    ipc = [json.loads(r["decoded_fields"]["finished"].lower()) for r in _requests(result, "/update_weights")]
    assert ipc == [False, True]
    for call in ("begin_update('v1')", "begin_update('v2')", "abort_update [no session]", "resume"):
        assert _event(result, call)["requests"] == 0, call
    b = result["broadcast"]
    assert b["finished_flags"] == [False, True]
    assert b["finished_loads_nothing_and_finalizes"], b["steps"]


def test_broadcast_bits_through_lmdeploy_receiver(result):
    b = result["broadcast"]
    assert b["error"] is None, (b["error"], b.get("traceback"))
    assert b["request_class"] == "UpdateWeightsFromDistributedRequest" and b["load_format"] == "flattened_bucket"
    assert b["layout_equal"], (b["our_layout_bytes"], b["lmdeploy_layout_bytes"])
    assert b["nbytes_equal"], b["broadcasts"]
    assert b["received_dtypes"] == ["torch.bfloat16"] * 3
    assert b["tensors_equal"]
    assert b["padded_bucket_nbytes"] != b["broadcasts"][0]["our_nbytes"]  # only a dense bucket fits


def test_ipc_bits_per_rank_in_another_process(result):
    ipc = result["ipc"]
    assert ipc.get("child") is not None, ipc.get("child_stderr")
    child = ipc["child"]
    assert not child.get("error"), (child.get("error"), child.get("traceback"))
    assert ipc["other_process"] and result["ipc_bucket_padded"]
    assert ipc["one_payload_per_rank"] and child["n_payloads"] == ipc["engine_tp_size"]
    assert child["removed_statements"] == ["args[6] = torch.cuda.current_device()"]
    assert child["load_format"] == ["flattened_bucket", "flattened_bucket"] and child["finished"] == [False, True]
    assert child["payload_keys"] == ["flattened_tensor", "metadata", "require_clone"]
    assert child["metadata_attributes"] == child["lmdeploy_metadata_fields"]
    assert child["finished_payload"] == {"metadata": "list[0]"}
    assert len(child["ranks"]) == ipc["engine_tp_size"]
    for rank in child["ranks"]:
        assert rank["error"] is None, (rank["error"], rank.get("traceback"))
        assert rank["names_equal"] and rank["dtypes_equal"] and rank["shapes_equal"] and rank["tensors_equal"]
        assert rank["finished_semantics"], rank
    assert ipc["ok"]


def test_single_dtype_guard(result):
    g = result["guard"]
    assert g["bucket_dtypes"] == ["bfloat16", "float32"]
    for how in ("encode_ipc", "receive_broadcast", "receive_ipc(encode_ipc(...))"):
        assert g[how]["raised"] == "EngineError" and g[how]["sent"] == 0 and g[how]["names_dtypes"], g[how]
    ev = _event(result, "receive_broadcast [mixed dtypes]")
    assert ev["raised"]["type"] == "EngineError" and ev["requests"] == 0
    assert _event(result, "abort_update [after the refused bucket]")["requests"] == 0
    assert g["ok"] and result["ok"]
