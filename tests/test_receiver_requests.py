"""The typed requests an engine's HTTP routes decode (:mod:`weightstream.receiver.requests`, and the reference
engine's own serving requests in :mod:`weightstream.reference_engine.protocol`): the defaults of a bare body, the
values of a full one, and one error that lists every problem of a bad one."""

from __future__ import annotations

import pytest

from weightstream.receiver.requests import (
    DEFAULT_GROUP,
    BeginRequest,
    CommitRequest,
    DestroyGroupRequest,
    EmptyRequest,
    InitGroupRequest,
    PauseRequest,
    ReleaseIpcRequest,
    RequestError,
    VersionRequest,
    WeightChecksumsRequest,
    update_problems,
)
from weightstream.reference_engine.protocol import (
    MEMORY_TAGS,
    GenerateRequest,
    LogitsRequest,
    ReleaseMemoryRequest,
    ResumeMemoryRequest,
)
from weightstream.reference_engine.server import REQUESTS, SCHEMAS

pytestmark = pytest.mark.unit

GROUP = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3}


def _refusal(decode, body) -> str:
    with pytest.raises(RequestError) as info:
        decode(body)
    return info.value.message


def test_init_group_defaults_and_values():
    assert InitGroupRequest.decode(GROUP) == InitGroupRequest("127.0.0.1", 29500, 1, 3, DEFAULT_GROUP, "nccl", 60.0,
                                                              "", 1)
    full = {**GROUP, "group_name": "g", "backend": "gloo", "timeout_s": 5, "weightstream_warm": "p2p",
            "weightstream_warm_senders": 2, "a_newer_field": [1]}
    assert InitGroupRequest.decode(full) == InitGroupRequest("127.0.0.1", 29500, 1, 3, "g", "gloo", 5.0, "p2p", 2)


def test_init_group_lists_every_problem():
    body = {"master_address": "x" * 300, "master_port": 0, "world_size": True, "timeout_s": float("inf"),
            "backend": 7}
    assert _refusal(InitGroupRequest.decode, body) == (
        "bad request to /init_weights_update_group: field 'master_address' has 300 characters, more than 256; "
        "field 'master_port' must be in [1, 65535], got 0; missing field 'rank_offset'; "
        "field 'world_size' must be int, got bool; field 'backend' must be str, got int; "
        "field 'timeout_s' must be seconds in (0, 3600], got inf")


def test_session_requests_defaults_and_values():
    assert DestroyGroupRequest.decode({}) == DestroyGroupRequest(DEFAULT_GROUP)
    assert DestroyGroupRequest.decode({"group_name": "g"}) == DestroyGroupRequest("g")
    assert BeginRequest.decode({}) == BeginRequest(None, "", None)
    assert BeginRequest.decode({"timeout_s": 2.5, "pause": "abort", "weight_version": "v3"}) == \
        BeginRequest(2.5, "abort", "v3")
    assert CommitRequest.decode({}) == CommitRequest(False)
    assert CommitRequest.decode({"resume": True}) == CommitRequest(True)
    assert PauseRequest.decode({"mode": "retract"}) == PauseRequest("retract")
    assert VersionRequest.decode({"new_version": "v9"}) == VersionRequest("v9")
    assert EmptyRequest.decode({"anything": 1}) == EmptyRequest()


def test_session_requests_list_every_problem():
    assert _refusal(BeginRequest.decode, {"timeout_s": -1, "pause": 3, "weight_version": "\x00"}) == (
        "bad request to /begin_weight_update: field 'timeout_s' must be seconds in (0, 3600], got -1; "
        "field 'pause' must be str, got int; field 'weight_version' must be printable text (no control "
        "characters, no lone surrogates)")
    assert _refusal(CommitRequest.decode, {"resume": 1}) == \
        "bad request to /end_weight_update: field 'resume' must be bool, got int"
    assert _refusal(DestroyGroupRequest.decode, {"group_name": None}) == \
        "bad request to /destroy_weights_update_group: field 'group_name' must be str, got NoneType"
    assert _refusal(VersionRequest.decode, {}) == "bad request to /update_weight_version: missing field 'new_version'"


def test_weight_checksums():
    assert WeightChecksumsRequest.decode({"names": ["a.weight", "b"]}) == WeightChecksumsRequest(("a.weight", "b"))
    assert _refusal(WeightChecksumsRequest.decode, {"names": ["a", 1]}) == \
        "bad request to /weightstream/weight_checksums: names must be a list of tensor names"
    assert _refusal(WeightChecksumsRequest.decode, {"names": "a"}) == \
        "bad request to /weightstream/weight_checksums: field 'names' must be list, got str"


def test_generate_and_logits():
    assert GenerateRequest.decode({"input_ids": [1, 2]}) == GenerateRequest(((1, 2),), True, 16)
    assert GenerateRequest.decode({"input_ids": [[1], [2, 3]], "sampling_params": {"max_new_tokens": 0}}) == \
        GenerateRequest(((1,), (2, 3)), False, 0)
    assert _refusal(GenerateRequest.decode, {"input_ids": [], "sampling_params": []}) == \
        "bad request to /generate: field 'sampling_params' must be dict or null, got list"
    assert _refusal(GenerateRequest.decode, {"input_ids": []}) == (
        "bad request to /generate: input_ids must be a non-empty list of token ids or a non-empty list of non-empty "
        "lists of token ids")
    assert _refusal(GenerateRequest.decode, {"input_ids": [1], "sampling_params": {"max_new_tokens": True}}) == \
        "sampling_params.max_new_tokens must be an integer in [0, 4096], got True"
    assert LogitsRequest.decode({"input_ids": [[1, 2], [3, 4]]}) == LogitsRequest(((1, 2), (3, 4)))
    assert _refusal(LogitsRequest.decode, {"input_ids": [[1, 2], [3]]}) == \
        "bad request to /weightstream/logits: the rows of input_ids must have one length"
    assert _refusal(LogitsRequest.decode, {"input_ids": [1, 2]}) == \
        "bad request to /weightstream/logits: input_ids must be a non-empty list of non-empty lists of token ids"


def test_memory_tags():
    assert ReleaseMemoryRequest.decode({}) == ReleaseMemoryRequest(MEMORY_TAGS)
    assert ResumeMemoryRequest.decode({"tags": None}) == ResumeMemoryRequest(MEMORY_TAGS)
    assert ReleaseMemoryRequest.decode({"tags": ["kv_cache"]}) == ReleaseMemoryRequest(("kv_cache",))
    assert _refusal(ReleaseMemoryRequest.decode, {"tags": ["weights", "disk", "ram"]}) == \
        "unknown memory tags ['disk', 'ram']; known: ['weights', 'kv_cache', 'cuda_graph']"
    assert _refusal(ResumeMemoryRequest.decode, {"tags": "weights"}) == \
        "bad request to /resume_memory_occupation: field 'tags' must be list or null, got str"


def test_update_problems_and_the_routes_schemas():
    assert ReleaseIpcRequest.decode({"client": "c1"}) == ReleaseIpcRequest("c1")
    assert _refusal(ReleaseIpcRequest.decode, {"client": 1}) == \
        "bad request to /weightstream/release_ipc_buffers: field 'client' must be str, got int"
    assert update_problems("/weightstream/prepare_ipc_ahead", {"plan": "p", "num_buckets": 1, "channels": ["tcp:x"],
                                                               "client": "c"}) == \
        ["channels must be 'unix:@NAME' addresses (the trainer ranks' control channels), one per engine rank"]
    assert sorted(set(SCHEMAS) - set(REQUESTS)) == sorted([
        "/update_weights_from_distributed", "/weightstream/update_weights_from_distributed_ahead",
        "/weightstream/update_weights_from_ipc_ahead",
        "/update_weights_from_tensor", "/weightstream/update_weights_from_p2p",
        "/weightstream/update_weights_from_p2p_ahead", "/weightstream/prepare_ipc_ahead"])
