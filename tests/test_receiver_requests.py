"""The typed requests an engine's HTTP routes decode (:mod:`weightstream.receiver.requests`, and the reference
engine's own serving requests in :mod:`weightstream.reference_engine.protocol`): the defaults of a bare body, the
values of a full one, and one error that lists every problem of a bad one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from weightstream.receiver.plan import (
    DenseBucket,
    IpcReceive,
    RankBucket,
    Receive,
    ReceivePlan,
    TensorReceive,
    Transport,
)
from weightstream.receiver.requests import (
    BROADCAST_AHEAD_ROUTE,
    BROADCAST_ROUTE,
    DEFAULT_GROUP,
    IPC_AHEAD_ROUTE,
    P2P_AHEAD_ROUTE,
    P2P_ROUTE,
    PREPARE_IPC_ROUTE,
    TENSOR_ROUTE,
    UPDATE_SCHEMAS,
    UPDATES,
    BeginRequest,
    BroadcastUpdate,
    CommitRequest,
    DestroyGroupRequest,
    EmptyRequest,
    InitGroupRequest,
    IpcUpdate,
    P2pUpdate,
    PauseRequest,
    RankReceives,
    ReleaseIpcRequest,
    RequestError,
    TensorUpdate,
    VersionRequest,
    WeightChecksumsRequest,
    decode_update,
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
        "/weightstream/update_weights_from_p2p_ahead", "/weightstream/prepare_ipc_ahead",
        "/weightstream/prepare_broadcast_ahead"])


META = {"name": "w", "dtype": "float32", "shape": [2], "offset": 0}
DELTA = {"encoding": "indices", "word": 4, "total": 8, "count": 1, "nbytes": 6, "index": 3}


def test_broadcast_updates_decode_into_each_ranks_receive():
    one = decode_update(BROADCAST_ROUTE, {"names": ["a", "b"], "dtypes": ["float32", "bfloat16"],
                                          "shapes": [[2, 3], []], "group_name": "g", "load_format": "flattened_bucket",
                                          "weight_version": "v2", "weightstream_checksum": "c",
                                          "weightstream_delta": DELTA})
    bucket = DenseBucket(("a", "b"), ("float32", "bfloat16"), ((2, 3), ()), "c", DELTA)
    assert one == BroadcastUpdate((bucket,), False, "g", "flattened_bucket", "v2", False)
    assert (one.route, one.delta, one.weight_version) == (BROADCAST_ROUTE, True, "v2")
    receive = Receive(ReceivePlan(Transport.BROADCAST, False, True), "g", (bucket,), "flattened_bucket")
    assert one.receives(2, 30.0) == RankReceives((receive, receive))
    ahead = decode_update(BROADCAST_AHEAD_ROUTE, {"buckets": [{"names": ["a"], "dtypes": ["float32"],
                                                               "shapes": [[4]]}], "load_format": "flattened_bucket"})
    plain = DenseBucket(("a",), ("float32",), ((4,),))
    assert ahead == BroadcastUpdate((plain,), True, DEFAULT_GROUP, "flattened_bucket", None, False)
    assert (ahead.route, ahead.delta) == (BROADCAST_AHEAD_ROUTE, False)
    assert ahead.receives(1, 30.0) == RankReceives((Receive(ReceivePlan(Transport.BROADCAST, True, False),
                                                            DEFAULT_GROUP, (plain,), "flattened_bucket"),))


def test_tensor_and_ipc_updates_fit_the_engines_ranks():
    tensor = decode_update(TENSOR_ROUTE, {"serialized_named_tensors": ["p0", "p1"], "load_format": "flattened_bucket",
                                          "weightstream_checksums": ["c0", None], "weight_version": "v"})
    assert tensor == TensorUpdate(("p0", "p1"), "flattened_bucket", ("c0", None), "v")
    assert tensor.receives(2, 1.0) == RankReceives((TensorReceive("p0", "flattened_bucket", "c0"),
                                                    TensorReceive("p1", "flattened_bucket", None)))
    assert _refusal(lambda b: decode_update(TENSOR_ROUTE, b).receives(3, 1.0),
                    {"serialized_named_tensors": "p", "weightstream_checksums": ["a", "b"]}) == (
        "bad request to /update_weights_from_tensor: got 1 payloads for 3 engine TP ranks; got 2 checksums for 3 "
        "engine TP ranks")
    ipc = {"plan": "d", "num_buckets": 5, "channels": ["unix:@a", "unix:@b"], "client": "c",
           "weightstream_delta_mode": True}
    update = decode_update(IPC_AHEAD_ROUTE, ipc)
    assert update == IpcUpdate("d", 5, ("unix:@a", "unix:@b"), "c", None, None, True, False)
    assert update.receives(2, 10.0) == RankReceives((IpcReceive("d", 5, "unix:@a", "c", 10.0, True, False),
                                                     IpcReceive("d", 5, "unix:@b", "c", 10.0, True, False)), 80.0)
    prepare = decode_update(PREPARE_IPC_ROUTE, {**ipc, "timeout_s": 2, "weight_version": 7})  # fields it has not
    assert prepare == IpcUpdate("d", 5, ("unix:@a", "unix:@b"), "c", 2.0, None, False, True)
    assert (prepare.route, prepare.receives(2, 10.0).wait_s) == (PREPARE_IPC_ROUTE, 8.0)
    assert _refusal(lambda b: decode_update(IPC_AHEAD_ROUTE, b).receives(1, 1.0), ipc) == \
        "bad request to /weightstream/update_weights_from_ipc_ahead: got 2 control channels for 1 engine TP ranks"
    # ipc_session: the request opens the session (the fields of /begin_weight_update) and commits it (those of
    # /end_weight_update); each rank then ends with the trainer's last frame.
    folded = decode_update(IPC_AHEAD_ROUTE, {**ipc, "weightstream_delta_mode": False, "weight_version": "v",
                                             "weightstream_begin": {"pause": "abort", "timeout_s": 9,
                                                                    "weight_version": "v"},
                                             "weightstream_commit": {"resume": True}})
    assert folded == IpcUpdate("d", 5, ("unix:@a", "unix:@b"), "c", None, "v", False, False,
                               BeginRequest(9, "abort", "v"), CommitRequest(True))
    assert folded.receives(2, 10.0).per_rank[1] == IpcReceive("d", 5, "unix:@b", "c", 10.0, False, False, True, True,
                                                              False)  # (at TP 1 a rank commits with its receive)
    assert replace(folded, channels=("unix:@a",)).receives(1, 10.0).per_rank[0].commit
    assert _refusal(lambda b: decode_update(IPC_AHEAD_ROUTE, b), {
        **ipc, "weightstream_begin": {"pause": 3, "timeout_s": "soon"}}) == (
        "bad request to /weightstream/update_weights_from_ipc_ahead: weightstream_begin: field 'timeout_s' must be int "
        "or float or null, got str; weightstream_begin: field 'pause' must be str, got int")
    assert _refusal(lambda b: decode_update(IPC_AHEAD_ROUTE, b), {**ipc, "weightstream_commit": {"resume": 1}}) == (
        "bad request to /weightstream/update_weights_from_ipc_ahead: weightstream_commit: field 'resume' must be "
        "bool, got int; weightstream_commit needs weightstream_begin (the request commits only a session it opened)")
    assert "weightstream_begin" not in UPDATE_SCHEMAS[PREPARE_IPC_ROUTE]


def test_p2p_updates_whole_and_resharded():
    entry = {"src": 1, "metas": [META], "nbytes": 8}
    one = decode_update(P2P_ROUTE, {"ranks": [{**entry, "checksum": "c", "delta": DELTA}, entry], "group_name": "g"})
    first, second = RankBucket(1, (META,), 8, "c", DELTA), RankBucket(1, (META,), 8)
    assert one == P2pUpdate(((first, second),), None, False, "g", None, False)
    assert one.delta and one.receives(2, 1.0) == RankReceives((
        Receive(ReceivePlan(Transport.P2P, False, True), "g", (first,)),
        Receive(ReceivePlan(Transport.P2P, False, False), "g", (second,))))
    pieces = decode_update(P2P_AHEAD_ROUTE, {"buckets": [[{**entry, "rank": 1}, {**entry, "src": 0, "rank": 1}],
                                                         [{**entry, "rank": 0}]], "weightstream_delta_mode": True})
    from_0 = RankBucket(0, (META,), 8)
    assert pieces == P2pUpdate(((second, from_0), (second,)), ((1, 1), (0,)), True, DEFAULT_GROUP, None, True)
    assert pieces.route == P2P_AHEAD_ROUTE and pieces.delta
    plan = ReceivePlan(Transport.PIECES, True, True)
    assert pieces.receives(2, 1.0) == RankReceives((Receive(plan, DEFAULT_GROUP, ((), (second,))),
                                                    Receive(plan, DEFAULT_GROUP, ((second, from_0), ()))))
    assert _refusal(lambda b: decode_update(P2P_AHEAD_ROUTE, b).receives(1, 1.0),
                    {"buckets": [[{**entry, "rank": 1}], [entry]]}) == (
        "bad request to /weightstream/update_weights_from_p2p_ahead: bucket 0: a part for engine rank 1; the engine "
        "has ranks 0..0; bucket 1: a part for engine rank None; the engine has ranks 0..0")
    assert _refusal(lambda b: decode_update(P2P_ROUTE, b).receives(3, 1.0), {"ranks": [entry]}) == (
        "bad request to /weightstream/update_weights_from_p2p: bad P2P buckets: bucket 0: 1 entries, the engine has "
        "3 ranks")


def test_update_bodies_list_every_problem_in_one_error():
    assert _refusal(lambda b: decode_update(P2P_AHEAD_ROUTE, b), {"buckets": [
        [{"src": 0, "metas": [], "nbytes": 1, "rank": -1, "checksum": 5, "delta": {"encoding": "zstd"}}], "x"]}) == (
        "bad request to /weightstream/update_weights_from_p2p_ahead: bad P2P buckets: bucket 0: entry 0: 'rank' must "
        "be a non-negative integer (an engine rank); bucket 0: entry 0: 'checksum' must be text or null; bucket 0: "
        "entry 0: weightstream_delta.word must be a non-negative integer; bucket 0: entry 0: weightstream_delta.total "
        "must be a non-negative integer; bucket 0: entry 0: weightstream_delta.count must be a non-negative integer; "
        "bucket 0: entry 0: weightstream_delta.nbytes must be a non-negative integer; bucket 0: entry 0: "
        "weightstream_delta.index must be a non-negative integer; bucket 0: entry 0: weightstream_delta.encoding must "
        "be one of ['dense', 'indices', 'bitmap'], got 'zstd'")
    assert _refusal(lambda b: decode_update(TENSOR_ROUTE, b), {"serialized_named_tensors": [1],
                                                               "weightstream_checksums": [2]}) == (
        "bad request to /update_weights_from_tensor: serialized_named_tensors must be one payload (text) or a list of "
        "them, one per engine rank; weightstream_checksums must be a list of checksums (text or null), one per engine "
        "rank")
    assert _refusal(lambda b: decode_update(BROADCAST_ROUTE, b), {"names": ["a"], "dtypes": ["float32"],
                                                                  "shapes": [[1]], "weightstream_delta": {}}) == (
        "bad request to /update_weights_from_distributed: weightstream_delta.word must be a non-negative integer; "
        "weightstream_delta.total must be a non-negative integer; weightstream_delta.count must be a non-negative "
        "integer; weightstream_delta.nbytes must be a non-negative integer; weightstream_delta.index must be a "
        "non-negative integer; weightstream_delta.encoding must be one of ['dense', 'indices', 'bitmap'], got 'None'")
    assert sorted(UPDATES) == sorted(UPDATE_SCHEMAS)
