"""Broadcast plans kept by the engine (weightstream.receiver.ahead_plans): the key is the engine's digest of what it
decoded, any difference in a name, dtype, shape or bucket boundary gives another key, and at most a few are kept; a
trainer whose next update has the same plan sends the key alone (a real reference engine, a real gloo group). The
engine's ranks keep the plans too: each is sent the key alone where it last said it holds the plan, else the buckets
(a real engine of two worker processes, one keeping fewer plans than the server)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from tests.helpers.plan_workers import serve_keeping
from tests.test_delta_updates import SMALL, Trainer, assert_engine_holds, engine
from tests.test_engine_hardening import request
from weightstream import WeightSync
from weightstream.engines import ReferenceEngine
from weightstream.models.presets import preset_config, save_random_checkpoint
from weightstream.receiver.ahead_plans import KEPT_AHEAD_PLANS, AheadPlans, KeyedReceive, plan_key
from weightstream.receiver.plan import DenseBucket, Receive, ReceivePlan, Transport
from weightstream.receiver.requests import BROADCAST_AHEAD_ROUTE, PREPARE_BROADCAST_ROUTE, BroadcastUpdate
from weightstream.reference_engine.ranks import EngineFailure
from weightstream.reference_engine.server import stop

A = DenseBucket(("a", "b"), ("bfloat16", "float32"), ((2, 3), (4,)))
B = DenseBucket(("c",), ("bfloat16",), ((8,),))


@pytest.mark.unit
def test_the_key_changes_with_any_part_of_the_metadata():
    plan = (A, B)
    others = [
        (DenseBucket(("a", "x"), A.dtypes, A.shapes), B),
        (DenseBucket(A.names, ("bfloat16", "bfloat16"), A.shapes), B),
        (DenseBucket(A.names, A.dtypes, ((3, 2), (4,))), B),
        (A,),
        (B, A),
        (DenseBucket(("a",), ("bfloat16",), ((2, 3),)), DenseBucket(("b", "c"), ("float32", "bfloat16"), ((4,), (8,)))),
    ]
    keys = {plan_key(plan)} | {plan_key(o) for o in others}
    assert len(keys) == len(others) + 1
    assert plan_key((DenseBucket(A.names, A.dtypes, A.shapes), B)) == plan_key(plan)  # equal metadata, equal key


@pytest.mark.unit
def test_the_least_recently_used_plan_goes_first_beyond_the_capacity():
    plans = AheadPlans(capacity=2)
    plans.put("k1", (A,))
    plans.put("k2", (B,))
    assert plans.get("k1") == (A,)  # k1 used: k2 is now the oldest
    plans.put("k3", (A, B))
    assert plans.keys() == ["k1", "k3"]
    assert plans.get("k2") is None
    plans.clear()
    assert plans.keys() == []


@pytest.mark.unit
def test_each_rank_is_sent_the_key_alone_where_it_holds_the_plan_else_the_buckets_and_the_key():
    update = BroadcastUpdate((A, B), ahead=True, load_format="flattened_bucket", plan_key="k1")
    held, other = update.keyed_receives("k1", [{"k0", "k1"}, {"k0"}])
    assert (held.key, held.by_key, held.receive.buckets) == ("k1", True, ())
    assert (other.key, other.by_key, other.receive.buckets) == ("k1", False, (A, B))
    assert held.receive.plan == other.receive.plan == ReceivePlan(Transport.BROADCAST, ahead=True)
    with pytest.raises(ValueError, match="a receive by key k1 names 2 buckets: it names none"):
        KeyedReceive("k1", other.receive, by_key=True)


@pytest.fixture(scope="module")
def plans_engine_dir(tmp_path_factory) -> str:
    return save_random_checkpoint(preset_config("tiny-qwen3"), tmp_path_factory.mktemp("plans") / "m", seed=77)


def _spied(monkeypatch) -> list[dict]:
    """The bodies reference engine clients post to the broadcast-ahead route (the real client, its posts recorded)."""
    bodies: list[dict] = []
    post = ReferenceEngine.post

    def recording(self, path: str, body=None, **kw):
        if path == BROADCAST_AHEAD_ROUTE:
            bodies.append(dict(body))
        return post(self, path, body, **kw)

    monkeypatch.setattr(ReferenceEngine, "post", recording)
    return bodies


def test_a_plan_the_engine_keeps_goes_as_its_key_and_loads_bit_for_bit(plans_engine_dir, monkeypatch):
    """The first broadcast update sends every bucket's metadata and the engine answers with its key for it; the next
    ones send the key alone, and the engine loads what the trainer holds bit for bit. An engine restarted at the same
    address holds no plan: its begin says so, and the buckets go again."""
    trainer = Trainer(seed=4)
    with engine(plans_engine_dir) as server:
        port = server.server_address[1]
        bodies = _spied(monkeypatch)
        sync = WeightSync([server.url], bucket_bytes=SMALL)
        for step in range(3):
            trainer.step()
            report = sync.update(trainer.model, trainer.config, weight_version=f"v{step}")
            assert report.metadata_ahead and report.buckets > 3
            assert_engine_holds(server, trainer)
        key = server.ahead_plans.keys()
        assert len(key) == 1 and "buckets" in bodies[0] and "weightstream_plan" not in bodies[0]
        assert [("buckets" in b, b.get("weightstream_plan")) for b in bodies[1:]] == [(False, key[0])] * 2
        sync.close()
    with engine(plans_engine_dir, port=port) as server:
        trainer.step()
        sync.update(trainer.model, trainer.config, weight_version="v3")
        assert "buckets" in bodies[3] and server.ahead_plans.keys() == key  # the same metadata, the same key
        assert_engine_holds(server, trainer)
        sync.close()


def test_a_key_the_engine_does_not_hold_or_a_body_with_both_is_refused_and_nothing_is_received(plans_engine_dir):
    with engine(plans_engine_dir) as server:
        begin = request(server.url, "POST", "/begin_weight_update", {})
        assert begin[0] == 200 and begin[1]["weightstream_plans"] == []
        status, reply = request(server.url, "POST", BROADCAST_AHEAD_ROUTE, {"weightstream_plan": "0" * 32})
        assert status == 400 and "no plan kept by key 00000000000000000000000000000000" in reply["message"]
        status, reply = request(server.url, "POST", BROADCAST_AHEAD_ROUTE,
                                {"weightstream_plan": "0" * 32, "buckets": []})
        assert status == 400 and "give buckets or weightstream_plan" in reply["message"]
        assert request(server.url, "POST", "/weightstream/abort_weight_update", {})[0] == 200


def test_prepare_makes_the_plan_ready_and_the_first_update_sends_its_key(plans_engine_dir, monkeypatch):
    """``WeightSync.prepare()`` by broadcast hands the engine every bucket's metadata: its ranks make each bucket's
    copy program then (kept), and the first update sends the plan's key alone and loads bit for bit."""
    trainer = Trainer(seed=5)
    with engine(plans_engine_dir) as server:
        bodies = _spied(monkeypatch)
        sync = WeightSync([server.url], bucket_bytes=SMALL)
        assert sync.prepare(trainer.model, trainer.config) == "broadcast"
        keys = server.ahead_plans.keys()
        status, memory = request(server.url, "GET", "/weightstream/memory")
        assert status == 200 and len(keys) == 1, memory
        prepared = memory["ranks"][0]["programs_kept"]
        trainer.step()
        report = sync.update(trainer.model, trainer.config, weight_version="v1")
        assert report.metadata_ahead and prepared == report.buckets
        assert [("buckets" in b, b.get("weightstream_plan")) for b in bodies] == [(False, keys[0])]
        assert_engine_holds(server, trainer)
        sync.close()


@contextmanager
def keeping(model_dir: str, kept_plans: tuple[int, ...]):
    """An engine whose ranks keep ``kept_plans`` broadcast plans each (:func:`serve_keeping`)."""
    server = serve_keeping(model_dir, kept_plans)
    try:
        yield server
    finally:
        stop(server)


def _plans(server) -> list[tuple[int, int, int, int]]:
    """Per rank, what it reports of its broadcast plans: kept, of them without programs, and the keyed commands it
    was sent by key alone and with the buckets."""
    status, memory = request(server.url, "GET", "/weightstream/memory")
    assert status == 200, memory
    return [(r["broadcast_plans_kept"], r["broadcast_plans_unresolved"], r["broadcast_plans_by_key"],
             r["broadcast_plans_sent"]) for r in memory["ranks"]]


def _one_bucket_plan(trainer: Trainer) -> dict:
    """The body that prepares another plan of the same tensors: all of them in one bucket."""
    tensors = trainer.tensors()
    bucket = {"names": list(tensors), "dtypes": ["bfloat16"] * len(tensors),
              "shapes": [list(t.shape) for t in tensors.values()]}
    return {"load_format": "flattened_bucket", "buckets": [bucket]}


def test_each_rank_keeps_its_plans_and_is_sent_a_plan_it_holds_by_key_alone(plans_engine_dir):
    """Two ranks, rank 1 keeping one plan: the first update brings the buckets to both, the second the key alone;
    a second plan prepared pushes the first out of rank 1 only, so the next update by the first plan's key brings
    rank 0 the key alone and rank 1 the buckets. After the weights' memory is released and resumed, the ranks still
    hold their plans, their programs made again at the next update, which loads by key alone. After a keyed update
    failed, the next brings the buckets to every rank. Every update loads the trainer's tensors bit for bit."""
    trainer = Trainer(seed=6)
    with keeping(plans_engine_dir, (KEPT_AHEAD_PLANS, 1)) as server:
        sync = WeightSync([server.url], bucket_bytes=SMALL)

        def update(version: str) -> None:
            trainer.step()
            assert sync.update(trainer.model, trainer.config, weight_version=version).metadata_ahead
            assert_engine_holds(server, trainer)

        update("v0")
        assert _plans(server) == [(1, 0, 0, 1)] * 2
        update("v1")
        (first,) = server.ahead_plans.keys()
        assert _plans(server) == [(1, 0, 1, 1)] * 2 and server.rank_plans == [{first}] * 2

        status, reply = request(server.url, "POST", PREPARE_BROADCAST_ROUTE, _one_bucket_plan(trainer))
        assert status == 200, reply
        second = reply["weightstream_plan"]
        assert server.rank_plans == [{first, second}, {second}]
        assert _plans(server) == [(2, 0, 1, 2), (1, 0, 1, 2)]

        update("v2")  # by the first plan's key: rank 1 dropped it
        assert _plans(server) == [(2, 0, 2, 2), (1, 0, 1, 3)]
        assert server.rank_plans == [{first, second}, {first}]

        for route in ("/release_memory_occupation", "/resume_memory_occupation"):
            assert request(server.url, "POST", route, {"tags": ["weights"]})[0] == 200
        assert _plans(server) == [(2, 2, 2, 2), (1, 1, 1, 3)]  # kept, their programs dropped with the weights
        update("v3")
        assert _plans(server) == [(2, 1, 3, 2), (1, 0, 2, 3)]

        # A keyed update that failed leaves what the ranks hold unknown to the server: the next brings the buckets.
        assert request(server.url, "POST", "/begin_weight_update", {})[0] == 200
        status, reply = request(server.url, "POST", BROADCAST_AHEAD_ROUTE, {
            "weightstream_plan": first, "group_name": "elsewhere", "load_format": "flattened_bucket"})
        assert status == 400 and "no weight-update group 'elsewhere'" in reply["message"]
        assert server.rank_plans == [frozenset()] * 2
        assert request(server.url, "POST", "/weightstream/abort_weight_update", {})[0] == 200
        update("v4")
        assert _plans(server) == [(2, 1, 3, 3), (1, 0, 2, 4)]
        assert server.rank_plans == [{first, second}, {first}]
        sync.close()


def test_a_rank_sent_a_key_it_does_not_hold_refuses_it_naming_what_it_holds(plans_engine_dir):
    """The engine sends a key alone only where the rank named it; a rank that gets one anyway (a defect of the
    server) refuses it, saying which key it was sent and which it holds."""
    with keeping(plans_engine_dir, (KEPT_AHEAD_PLANS, KEPT_AHEAD_PLANS)) as server:
        bare = Receive(ReceivePlan(Transport.BROADCAST, ahead=True), "weight_update_group", (), prepare=True)
        with pytest.raises(EngineFailure) as failed:
            server.engine.call(KeyedReceive("0" * 32, bare, by_key=True))
        for rank in (0, 1):
            assert (f"rank {rank}: RuntimeError: engine rank {rank} keeps no plan by key {'0' * 32} (it keeps []): "
                    "the engine sent the key alone") in str(failed.value)
