"""A delta-mode update whose kept plan turns out stale after its buckets (a parameter re-pointed between updates, the
old storage alive and unmoved: the kept plan's copies read its old bytes, and the trainer's snapshot encoded them) is
aborted uncommitted and sent again with a new plan, in full; the engine then holds the trainer's tensors bit for bit,
and the next update goes back to deltas on the new plan. A real reference engine, in this process's trainer."""

from __future__ import annotations

import pytest

from tests.test_delta_updates import SMALL, Trainer, assert_engine_holds, engine
from weightstream import WeightSync
from weightstream.models.presets import preset_config, save_random_checkpoint
from weightstream.streaming.kept_plans import clear_plans


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> str:
    """What the engine starts from: other random weights of the same config."""
    return save_random_checkpoint(preset_config("tiny-qwen3"), tmp_path_factory.mktemp("replan") / "m", seed=123)


@pytest.mark.parametrize("transport", ["broadcast", "ipc"])
def test_a_stale_kept_plan_in_delta_mode_is_sent_again_in_full(engine_dir, transport):
    clear_plans()
    trainer = Trainer(seed=6)
    with engine(engine_dir) as server, \
            WeightSync([server.url], transport=transport, bucket_bytes=SMALL, delta=True) as sync:
        def update(version: str):
            trainer.step()
            report = sync.update(trainer.model, trainer.config, weight_version=version)
            assert report.transport == transport and report.delta.checked, report.summary()
            assert_engine_holds(server, trainer)
            return report

        first = update("v0")
        assert first.delta.full and first.planned and first.replanned is None
        second = update("v1")
        assert not second.delta.full and not second.planned and second.replanned is None

        q = trainer.model.model.layers[0].self_attn.q_proj
        q.weight.data = q.weight.data.clone()  # re-pointed: the next step writes into the new storage only
        third = update("v2")
        assert third.replanned is not None and third.planned
        assert third.delta.full and "kept stream plan was stale" in third.delta.reason, third.delta.summary()

        fourth = update("v3")
        assert not fourth.delta.full and not fourth.planned and fourth.replanned is None
