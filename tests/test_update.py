"""Live updates into the reference engine: real Megatron-Core trainers (gloo jobs), a real engine
(its own worker processes, HTTP), every transport, and the faults."""

from __future__ import annotations

import base64
import json
import os
import pickle
import time
import urllib.request
from contextlib import contextmanager

import pytest
import torch

from tests.conftest import hf_logits
from tests.helpers.checks import assert_logits_close
from tests.helpers.faults import hide_capabilities, serve_with_fault
from tests.helpers.workers import INPUT_IDS, Case, run_prepared_update, run_update
from weightstream.engines import EngineError, ReferenceEngine
from weightstream.jobs import Layout
from weightstream.launch import launch
from weightstream.models.presets import preset_config, save_random_checkpoint
from weightstream.reference_engine.server import serve, stop

SMALL = 120_000  # bytes per bucket: the tiny models travel in several buckets


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> str:
    """What engines start from: other random weights of the same config, so an update must change them."""
    return save_random_checkpoint(preset_config("tiny-qwen3"), tmp_path_factory.mktemp("engine") / "m", seed=123)


@contextmanager
def engine(model_dir: str, tp: int = 1, fault: str | None = None, api_key: str | None = None,
           rollback: bool = True, ahead: bool = False, ep: int = 1):
    """A reference engine serving ``model_dir`` at TP ``tp`` (and expert parallelism ``ep``); ``fault``: one of
    :mod:`tests.helpers.faults`'s, injected into its workers (``ahead``: the faulty engine still takes buckets sent
    ahead)."""
    if fault:
        server = serve_with_fault(model_dir, tp, fault, ahead=ahead, api_key=api_key, rollback=rollback, ep=ep)
    else:
        server = serve(model_dir, tp, api_key=api_key, rollback=rollback, ep=ep)
    try:
        yield server
    finally:
        stop(server)


def _ok(results):
    for rank_results in results:
        for r in rank_results:
            assert "error" not in r, r["error"]
    return [r["report"] for r in results[0]]


def test_broadcast_tp2_pp2_two_updates(sources, engine_dir, tmp_path):
    src = sources["tiny-qwen3"]
    saved1, saved2 = tmp_path / "v1", tmp_path / "v2"
    with engine(engine_dir) as server:
        eng = ReferenceEngine(server.url)
        before = eng.logits(INPUT_IDS)
        updates = [
            {"transport": "broadcast", "bucket_bytes": SMALL, "save_to": str(saved1), "checksums": True,
             "weight_version": "step-1"},
            {"transport": "broadcast", "bucket_bytes": SMALL, "reseed": 7, "save_to": str(saved2),
             "weight_version": "step-2"},
        ]
        # Trainer rank 0 reads the engine's logits right after each update.
        results = launch(4, run_update, Case(src, Layout(2, 2)), [server.url], updates)
        reports = _ok(results)
        after1, after2 = (r["engine_logits"] for r in results[0])
        assert eng.weight_version() == "step-2"
    assert_logits_close(after1, hf_logits(str(saved1), INPUT_IDS))
    assert_logits_close(after1, hf_logits(src, INPUT_IDS))
    assert_logits_close(after2, hf_logits(str(saved2), INPUT_IDS))
    assert (after2 - after1).abs().max() > 1e-3 and (after1 - before).abs().max() > 1e-2
    for rep, version in zip(reports, ("step-1", "step-2"), strict=True):
        # Asked for (auto would reshard by P2P into this engine of another TP: tests/test_reshard_updates.py).
        assert rep.transport == "broadcast" and rep.reason == "asked for"
        assert rep.tensors == 47 and rep.buckets > 3 and rep.weight_version == version
        assert set(rep.seconds) >= {"pause", "connect", "transfer", "commit", "resume", "total"}
    # Checksums are per bucket: one request each. Without them the reference engine takes every bucket's
    # metadata in one request and receives the buckets back to back.
    assert [rep.metadata_ahead for rep in reports] == [False, True]


def test_two_engines_through_one_broadcast_group(sources, engine_dir):
    src = sources["tiny-qwen3"]
    with engine(engine_dir) as a, engine(engine_dir, tp=2) as b:
        (rep,) = _ok(launch(2, run_update, Case(src, Layout(2, 1)), [a.url, b.url],
                            [{"transport": "auto", "bucket_bytes": SMALL}]))
        la, lb = ReferenceEngine(a.url).logits(INPUT_IDS), ReferenceEngine(b.url).logits(INPUT_IDS)
        versions = ReferenceEngine(a.url).weight_version(), ReferenceEngine(b.url).weight_version()
    assert rep.transport == "broadcast" and rep.metadata_ahead
    assert f"engine {a.url} TP 1 != trainer TP 2 (resharding serves one engine; 2 given)" in rep.reason
    ref = hf_logits(src, INPUT_IDS)
    assert_logits_close(la, ref)
    assert_logits_close(lb, ref)
    assert versions == ("1", "1")


def test_p2p_without_any_gather_and_fallback(sources, engine_dir):
    src = sources["tiny-qwen3-tied"]
    tied_dir = save_random_checkpoint(preset_config("tiny-qwen3-tied"), engine_dir + "-tied", seed=5)
    with engine(tied_dir, tp=2) as two, engine(tied_dir, tp=1) as one:
        results = launch(2, run_update, Case(src, Layout(2, 1)), [two.url],
                         [{"transport": "auto", "bucket_bytes": SMALL}])
        (p2p,) = _ok(results)
        l2 = ReferenceEngine(two.url).logits(INPUT_IDS)
        (fallback,) = _ok(launch(2, run_update, Case(src, Layout(2, 1)), [two.url, one.url],
                                 [{"transport": "p2p", "bucket_bytes": SMALL}]))
        l1 = ReferenceEngine(one.url).logits(INPUT_IDS)
    assert p2p.transport == "p2p" and p2p.mode == "per_rank"
    assert p2p.metadata_ahead  # the same layout on both sides: plain per-rank buckets, every one told ahead
    for rank_results in results:
        assert rank_results[0]["report"].gathers == 0  # no all-gather ran on any trainer rank
    assert fallback.transport == "broadcast"
    assert fallback.reason.startswith("fell back from p2p")
    assert f"engine {one.url} TP 1 != trainer TP 2 (resharding serves one engine; 2 given)" in fallback.reason
    ref = hf_logits(src, INPUT_IDS)
    assert_logits_close(l2, ref)
    assert_logits_close(l1, ref)


def test_ipc_shared_memory_between_processes(sources, engine_dir, tmp_path):
    """Colocated updates through one WeightSync: the bucket metadata goes ahead, per bucket one frame on the
    control channel per TP rank; each rank's two kept buffers are mapped by its engine rank once, in the
    first update, and named by id after that; closing the WeightSync closes them in the engine."""
    src = sources["tiny-qwen3"]
    saved = [tmp_path / "one", tmp_path / "two"]
    with engine(engine_dir, tp=2) as server:
        eng = ReferenceEngine(server.url)
        results = launch(2, run_update, Case(src, Layout(2, 1)), [server.url],
                         [{"save_to": str(saved[0])}, {"reseed": 3, "save_to": str(saved[1])}],
                         {"transport": "ipc", "bucket_bytes": SMALL})
        reports = _ok(results)
        generated = eng.generate(INPUT_IDS[0], max_new_tokens=4)
        memory = eng.get("/weightstream/memory")["ranks"]
    for rep in reports:
        assert rep.transport == "ipc" and rep.buckets > 3 and rep.metadata_ahead
    for step, entry in enumerate(results[0]):
        for rank in entry["engine_memory"]:  # two kept buffers per rank, opened in the first update only
            assert rank["ipc_buffers_opened"] == 2 and rank["ipc_buffers_held"] == 2, (step, entry["engine_memory"])
    for rank in memory:  # after the WeightSync closed
        assert rank["ipc_buffers_opened"] == 2 and rank["ipc_buffers_held"] == 0, memory
    for entry, where in zip(results[0], saved, strict=True):
        assert_logits_close(entry["engine_logits"], hf_logits(str(where), INPUT_IDS))
    # Greedy generation by the engine equals greedy generation by the HF model of the weights sent last.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(saved[1], dtype=torch.float32).eval()
    ids = list(INPUT_IDS[0])
    with torch.no_grad():
        for _ in range(4):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    assert generated["output_ids"] == ids[len(INPUT_IDS[0]):]
    assert generated["meta_info"]["weight_version"] == "2"


def test_ipc_writes_straight_into_the_engine_weights(tmp_path):
    """Colocated with an engine at TP 1 (every tensor one whole weight of it), the trainer writes each tensor
    straight into the engine's weights, mapped into the trainer once: one copy, no bucket buffer on either
    side. MoE: the engine's experts are fused per layer; the trainer's grouped experts go in as pieces of them."""
    cfg = preset_config("tiny-qwen3-moe")
    src = save_random_checkpoint(cfg, tmp_path / "src", seed=71)
    eng_dir = save_random_checkpoint(cfg, tmp_path / "eng", seed=72)
    saved = [tmp_path / "one", tmp_path / "two"]
    with engine(eng_dir) as server:
        results = launch(1, run_update, Case(src, Layout(1, 1), grouped_experts=True), [server.url],
                         [{"save_to": str(saved[0])}, {"reseed": 3, "save_to": str(saved[1])}],
                         {"transport": "ipc", "bucket_bytes": SMALL})
        reports = _ok(results)
        memory = ReferenceEngine(server.url).get("/weightstream/memory")["ranks"]
    for rep in reports:
        assert rep.transport == "ipc" and rep.direct and rep.metadata_ahead and rep.buckets > 3
        # The update's one request to the reference engine opened its session (paused) and committed it (resumed).
        assert rep.session_in_request and rep.seconds["resume"] == rep.seconds["commit"] == 0.0
    for step, entry in enumerate(results[0]):
        (rank,) = entry["engine_memory"]
        assert (rank["direct_updates"], rank["ipc_buffers_opened"]) == (step + 1, 0)
    assert [m["direct_updates"] for m in memory] == [2]
    for entry, where in zip(results[0], saved, strict=True):
        assert_logits_close(entry["engine_logits"], hf_logits(str(where), INPUT_IDS))


def test_engine_not_there_fails_fast_and_clearly(sources):
    start = time.monotonic()
    results = launch(2, run_update, Case(sources["tiny-qwen3"], Layout(2, 1)), ["http://127.0.0.1:9"],
                     [{"transport": "auto", "timeout_s": 5}])
    for (r,) in results:
        assert "http://127.0.0.1:9" in r["error"] and "unreachable" in r["error"], r
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("transport", ["broadcast", "ipc"])
def test_engine_dying_mid_update_then_a_fresh_engine(sources, engine_dir, transport):
    src = sources["tiny-qwen3"]
    with engine(engine_dir, fault="die@2") as dying:
        start = time.monotonic()
        results = launch(2, run_update, Case(src, Layout(2, 1)), [dying.url],
                         [{"transport": transport, "bucket_bytes": SMALL, "timeout_s": 8}])
        for (r,) in results:
            assert "error" in r and "engine rank 0 died" in r["error"], r
        assert "bucket 2" in results[0][0]["error"]
        assert not dying.engine.alive()
        assert time.monotonic() - start < 60
    if transport == "ipc":
        return  # a fresh engine after a failure: once is enough
    with engine(engine_dir) as fresh:
        (rep,) = _ok(launch(2, run_update, Case(src, Layout(2, 1)), [fresh.url],
                            [{"transport": "broadcast", "bucket_bytes": SMALL, "timeout_s": 20}]))
        logits = ReferenceEngine(fresh.url).logits(INPUT_IDS)
    assert rep.weight_version == "1"
    assert_logits_close(logits, hf_logits(src, INPUT_IDS))


def test_corrupted_bucket_is_caught_by_the_checksum(sources, engine_dir):
    with engine(engine_dir, fault="corrupt@1") as server:
        eng = ReferenceEngine(server.url)
        results = launch(1, run_update, Case(sources["tiny-qwen3"], Layout(1, 1)), [server.url],
                         [{"transport": "broadcast", "bucket_bytes": SMALL, "checksums": True}])
        (r,) = results[0]
        assert "bucket 1 arrived corrupted" in r["error"], r
        assert "model.layers" in r["error"]  # the bucket's tensors are named
        assert eng.weight_version() == "default"  # the failed session was not committed


def test_disallowed_pickle_global_and_bearer_token(engine_dir):
    with engine(engine_dir, api_key="s3cret") as server:
        anonymous = ReferenceEngine(server.url)
        with pytest.raises(EngineError, match="HTTP 401"):
            anonymous.server_info()
        eng = ReferenceEngine(server.url, api_key="s3cret")
        eng.begin_update("evil")
        evil = base64.b64encode(pickle.dumps(os.system)).decode()
        with pytest.raises(EngineError, match="refused to unpickle global posix.system"):
            eng.receive_ipc(0, [evil], None)
        with pytest.raises(EngineError, match="not committed"):
            eng.commit_update()
        assert server.engine.alive()  # refused, not crashed
        # While paused, generation waits; it completes once generation continues.
        import threading

        eng.pause("abort")
        done: list = []
        worker = threading.Thread(target=lambda: done.append(eng.generate([1, 2, 3], max_new_tokens=2)))
        worker.start()
        worker.join(timeout=1.0)
        assert not done
        eng.resume()
        worker.join(timeout=30)
        assert len(done) == 1 and len(done[0]["output_ids"]) == 2
        req = urllib.request.Request(server.url + "/health")
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert resp.status == 200 and json.loads(resp.read()) == {}


def test_moe_ep2_trainer_into_tp2_engine(tmp_path):
    """Qwen3-MoE trained with EP 2 into an engine that splits every expert over its two TP ranks: resharded P2P,
    each EP rank sending each engine rank its half of every expert it holds, checked per bucket and sender."""
    cfg = preset_config("tiny-qwen3-moe")
    src = save_random_checkpoint(cfg, tmp_path / "src", seed=21)
    eng_dir = save_random_checkpoint(cfg, tmp_path / "eng", seed=22)
    with engine(eng_dir, tp=2) as server:
        results = launch(2, run_update, Case(src, Layout(1, 1, ep=2)), [server.url],
                         [{"transport": "auto", "bucket_bytes": SMALL, "checksums": True}])
        (rep,) = _ok(results)
        logits = ReferenceEngine(server.url).logits(INPUT_IDS)
    assert rep.transport == "p2p" and "trainer TP 1 EP 2" in rep.reason and rep.gathers == 0
    assert rep.tensors == 135
    assert_logits_close(logits, hf_logits(src, INPUT_IDS))


def test_engine_without_rollback_refuses_half_updated_weights(sources, engine_dir):
    """``rollback=False`` (as SGLang, no copy of the weights during an update): an aborted update leaves the
    engine refusing to serve, naming why, until a complete update has loaded every tensor again."""
    from weightstream.common.hf_files import CheckpointReader
    from weightstream.engines.base import ROLLBACK
    from weightstream.streaming.bucket import Bucket

    src = sources["tiny-qwen3"]
    with CheckpointReader(src) as reader:
        named = [(n, reader.get(n).clone()) for n in sorted(reader.keys())]
    server = serve(engine_dir, 1, rollback=False)
    try:
        eng = ReferenceEngine(server.url)
        assert not eng.info().can(ROLLBACK)
        # A sender keeps the memory it shares mapped until the engine has answered (the engine maps only what
        # the process the name gives still maps).
        half, whole = Bucket.pack(named[:10]), Bucket.pack(named)
        eng.begin_update("half")
        eng.receive_ipc(0, [eng.encode_ipc(half)], None)
        eng.abort_update()
        with pytest.raises(EngineError, match="10 tensors were half-updated by an aborted update"):
            eng.logits(INPUT_IDS)
        eng.begin_update("whole")
        eng.receive_ipc(0, [eng.encode_ipc(whole)], None)
        assert eng.commit_update() == "whole"
        assert_logits_close(eng.logits(INPUT_IDS), hf_logits(src, INPUT_IDS))
    finally:
        stop(server)


@pytest.mark.parametrize("transport", ["broadcast", "ipc", "ipc-buffers"])
def test_prepare_makes_the_plan_and_the_group_before_the_first_update(sources, engine_dir, transport):
    """prepare() makes the plan, the copies and the group (broadcast), so the update makes none of them.
    IPC into an engine at TP 1: the engine exports its weights then, and the trainer's rank 0 writes into
    them (the copies into them made in prepare); with ``direct=False`` the engine instead learns the plan
    and maps the two kept buffers in prepare, and the update opens none."""
    src = sources["tiny-qwen3"]
    options = {"transport": transport.split("-")[0], "bucket_bytes": SMALL}
    if transport == "ipc-buffers":
        options["direct"] = False
    with engine(engine_dir) as server:
        results = launch(2, run_prepared_update, Case(src, Layout(2, 1)), server.url, options)
        logits = ReferenceEngine(server.url).logits(INPUT_IDS)
    for r in results:
        assert r["prepared"] == options["transport"] and r["group_ready"]
        assert r["builds_in_update"] == 0  # the update streamed with the plan prepare() made
        assert r["copies_in_update"] == 0  # and with the batched copies prepare() made
        assert r["report"].transport == options["transport"] and r["report"].weight_version == "1"
    if transport != "broadcast":
        after_prepare, after_update = results[0]["engine_memory"]
        assert results[0]["report"].metadata_ahead
        assert results[0]["report"].direct == (transport == "ipc")
        opened = 0 if transport == "ipc" else 2
        assert [(m["ipc_buffers_opened"], m["ipc_buffers_held"]) for m in after_prepare] == [(opened, opened)]
        assert [(m["ipc_buffers_opened"], m["ipc_buffers_held"]) for m in after_update] == [(opened, opened)]
        assert [m["direct_updates"] for m in after_update] == [1 if transport == "ipc" else 0]
    assert_logits_close(logits, hf_logits(src, INPUT_IDS))


@pytest.mark.parametrize("transport,engine_tp,warm", [("broadcast", 1, True), ("broadcast", 1, False),
                                                       ("p2p", 2, True), ("p2p", 1, True)])
def test_prepare_makes_the_groups_first_transfer_where_the_engine_takes_it(sources, engine_dir, transport, engine_tp,
                                                                           warm):
    """prepare() forms the group and, where the engine declares ``warm_group``, runs its first, tiny transfer with
    it (NCCL makes a group's connections on first use): a broadcast, or a byte from each trainer rank to each
    engine rank (P2P from a TP 2 trainer into TP 2, and resharded into TP 1). An engine that does not declare it is
    sent nothing extra (it would take the byte for its first bucket); either way the update is exact."""
    src = sources["tiny-qwen3"]
    with engine(engine_dir, tp=engine_tp) as server:
        if not warm:
            hide_capabilities(server, ("warm_group",))
        results = launch(2, run_prepared_update, Case(src, Layout(2, 1)), server.url,
                         {"transport": transport, "bucket_bytes": SMALL, "checksums": True})
        logits = ReferenceEngine(server.url).logits(INPUT_IDS)
    after_prepare, after_update = results[0]["engine_memory"]
    assert [m["groups_warmed"] for m in after_prepare] == [int(warm)] * engine_tp
    assert [m["groups_warmed"] for m in after_update] == [int(warm)] * engine_tp  # the update formed no other
    for r in results:
        assert r["prepared"] == transport and r["group_ready"] and r["report"].weight_version == "1"
    assert_logits_close(logits, hf_logits(src, INPUT_IDS))


def test_ipc_update_after_parameters_are_re_pointed_is_sent_again_with_a_new_plan(engine_dir, caplog):
    """An update reuses its kept plan on the parameters' addresses alone and confirms it in full before the sink
    closes. A parameter re-pointed (``p.data = ...``) and a weight replaced by a new ``nn.Parameter`` between updates
    leave the old storages alive and unmoved: the first attempt's copies (straight into the engine's weights) read
    stale bytes, the confirmation says so, the sessions are aborted uncommitted and the update is sent again with a
    new plan; the engine holds the model's new values bit for bit. The next update (values changed in place only)
    reuses that plan."""
    import logging

    from torch import nn

    from weightstream import WeightSync
    from weightstream.models.presets import random_hf_model
    from weightstream.streaming.kept_plans import clear_plans
    from weightstream.wire.handles import checksum

    cfg = preset_config("tiny-qwen3")
    model = random_hf_model(cfg, seed=9, dtype=torch.bfloat16)
    clear_plans()
    server = serve(engine_dir, 1, dtype="bfloat16")  # the trainer's dtype: every tensor written straight in

    def engine_holds_the_model() -> None:  # bit for bit: the checksum of each weight's bytes on both sides
        ours = {n: checksum(t.contiguous().reshape(-1).view(torch.uint8)) for n, t in model.state_dict().items()}
        (held,) = ReferenceEngine(server.url).weight_checksums(sorted(ours))
        assert set(held) <= set(ours) and {"model.layers.0.self_attn.q_proj.weight",
                                           "model.layers.1.mlp.down_proj.weight"} <= set(held)
        different = [n for n, c in held.items() if c != ours[n]]
        assert not different, f"the engine's tensors differ from the model's: {different}"

    try:
        with WeightSync([server.url], transport="ipc", bucket_bytes=SMALL) as sync:
            first = sync.update(model, cfg)
            assert first.direct and first.planned and first.replanned is None and "transfer:confirm" in first.seconds
            engine_holds_the_model()

            q = model.model.layers[0].self_attn.q_proj
            q.weight.data = q.weight.data.clone() + 1  # re-pointed
            down = model.model.layers[1].mlp.down_proj
            down.weight = nn.Parameter(torch.randn_like(down.weight))  # replaced
            with caplog.at_level(logging.WARNING, logger="weightstream"):
                second = sync.update(model, cfg)
            assert second.replanned is not None and "changed since the kept stream plan was made" in second.replanned
            assert second.planned and second.direct and second.weight_version == "2"
            assert "sent again with a new plan" in second.summary()
            warned = [r.getMessage() for r in caplog.records if "sent again with a new plan" in r.getMessage()]
            assert len(warned) == 1, warned
            engine_holds_the_model()

            with torch.no_grad():  # what an optimizer step does: values in place
                for p in model.parameters():
                    p.add_(0.5)
            third = sync.update(model, cfg)
            assert not third.planned and third.replanned is None and third.direct
            engine_holds_the_model()
            assert ReferenceEngine(server.url).generate(INPUT_IDS[0], max_new_tokens=1)["meta_info"][
                "weight_version"] == "3"
    finally:
        stop(server)
