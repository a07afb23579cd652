"""Broadcast plans kept by the engine (weightstream.receiver.ahead_plans): the key is the engine's digest of what it
decoded, any difference in a name, dtype, shape or bucket boundary gives another key, and at most a few are kept; a
trainer whose next update has the same plan sends the key alone (a real reference engine, a real gloo group)."""

from __future__ import annotations

import pytest

from tests.test_delta_updates import SMALL, Trainer, assert_engine_holds, engine
from tests.test_engine_hardening import request
from weightstream import WeightSync
from weightstream.engines import ReferenceEngine
from weightstream.models.presets import preset_config, save_random_checkpoint
from weightstream.receiver.ahead_plans import AheadPlans, plan_key
from weightstream.receiver.plan import DenseBucket
from weightstream.receiver.requests import BROADCAST_AHEAD_ROUTE

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
