"""Several engine replicas updated at once by broadcast (one group with every engine rank): the update commits
on all of them or on none. A real Megatron-Core trainer (gloo job) and real reference engines."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch

from tests.conftest import hf_logits
from tests.helpers.checks import assert_logits_close
from tests.helpers.workers import INPUT_IDS, Case, run_timed_updates
from tests.test_update import engine
from weightstream.engines import ReferenceEngine
from weightstream.jobs import Layout
from weightstream.launch import launch
from weightstream.models.presets import preset_config, save_random_checkpoint

SMALL = 120_000  # bytes per bucket: the tiny model travels in several buckets
T = 6.0  # timeout_s of each wait
BOUND = 1.2 * T + 5  # what a failed update may take, from its failing wait to every rank raising


@pytest.mark.parametrize("transport,layout,tps,reason", [
    ("broadcast", Layout(2, 1), (1, 2), "(resharding serves one engine; 2 given)"),
    ("p2p", Layout(1), (1, 1), "2 engines at the trainer's TP 1"),
])
def test_a_failing_replica_makes_the_update_commit_on_none(tmp_path, transport, layout, tps, reason):
    """Three replicas, the third of which gets corrupted bytes: the update fails at that bucket on every trainer
    rank within its bound, and the two good replicas put their weights back (same version, same logits, bit for
    bit). The next update to the good ones commits on both, each serving the trainer's weights (logits equal to
    HF's). By broadcast: a trainer at TP 2 into engines at TP 1, TP 2 and TP 1 (one group with every engine rank).
    By P2P: a trainer of two data-parallel replicas into engines at its TP 1, engine j from replica j % 2 (the
    corrupted one is replica 0's second; replica 1, which saw nothing wrong, fails too); each replica tells its
    engines of every bucket in one request, then sends them back to back."""
    cfg = preset_config("tiny-qwen3")
    src = save_random_checkpoint(cfg, tmp_path / "src", seed=61)
    eng_dir = save_random_checkpoint(cfg, tmp_path / "eng", seed=62)
    opts = {"transport": "auto", "bucket_bytes": SMALL, "checksums": True, "timeout_s": T}
    with ExitStack() as stack:
        one, two = (stack.enter_context(engine(eng_dir, tp=tp)) for tp in tps)
        bad = stack.enter_context(engine(eng_dir, tp=1, fault="corrupt@1"))
        good = [ReferenceEngine(one.url), ReferenceEngine(two.url)]
        before = [(e.weight_version(), e.logits(INPUT_IDS)) for e in good]
        failed = launch(2, run_timed_updates, Case(src, layout),
                        [([one.url, two.url, bad.url], {**opts, "weight_version": "v1"})])
        after_failure = [(e.weight_version(), e.logits(INPUT_IDS)) for e in good]
        done = launch(2, run_timed_updates, Case(src, layout),
                      [([one.url, two.url], {**opts, "checksums": False, "weight_version": "v2"})])
        served = [(e.weight_version(), e.logits(INPUT_IDS)) for e in good]
    for (attempt,) in failed:
        assert attempt.get("type") == "UpdateError" and attempt["phase"] == "bucket 1", attempt
        assert "arrived corrupted" in attempt["error"] and bad.url in attempt["error"], attempt
        assert attempt["seconds"] <= BOUND, attempt["seconds"]
    for (version, logits), (v0, l0) in zip(after_failure, before, strict=True):
        assert version == v0 != "v1" and torch.equal(logits, l0)  # committed on none: each put its weights back
    reports = [r["report"] for (r,) in done]
    assert reports[0].transport == transport and reason in reports[0].reason and reports[0].metadata_ahead, reports
    ref = hf_logits(src, INPUT_IDS)
    for version, logits in served:
        assert version == "v2"
        assert_logits_close(logits, ref)


def test_a_replica_failing_its_commit_leaves_every_replica_as_it_was(tmp_path):
    """Three replicas, the last of which fails the commit itself (its device reports an error once every bucket
    was loaded and checked): the trainer commits none until each has prepared, so the two before it put their
    weights back (same version, same logits, bit for bit) instead of serving the new ones alone."""
    cfg = preset_config("tiny-qwen3")
    src = save_random_checkpoint(cfg, tmp_path / "src", seed=63)
    eng_dir = save_random_checkpoint(cfg, tmp_path / "eng", seed=64)
    opts = {"transport": "broadcast", "bucket_bytes": SMALL, "timeout_s": T, "weight_version": "v1"}
    with ExitStack() as stack:
        one = stack.enter_context(engine(eng_dir, tp=1))
        two = stack.enter_context(engine(eng_dir, tp=2))
        bad = stack.enter_context(engine(eng_dir, tp=1, fault="fail_commit"))
        replicas = [ReferenceEngine(u) for u in (one.url, two.url, bad.url)]
        before = [(e.weight_version(), e.logits(INPUT_IDS)) for e in replicas]
        failed = launch(2, run_timed_updates, Case(src, Layout(2, 1)), [([one.url, two.url, bad.url], opts)])
        after = [(e.weight_version(), e.logits(INPUT_IDS)) for e in replicas]
        # Alone (a commit in one phase), its failed commit is aborted at once: it serves its weights again.
        alone = launch(2, run_timed_updates, Case(src, Layout(2, 1)), [([bad.url], opts)])
        after_alone = (replicas[2].weight_version(), replicas[2].logits(INPUT_IDS))
    for (attempt,) in failed + alone:
        assert attempt.get("type") == "UpdateError" and attempt["phase"] == "commit", attempt
        assert "the device reported an error" in attempt["error"] and bad.url in attempt["error"], attempt
        assert "committed on" not in attempt["error"], attempt  # none had committed
        assert attempt["seconds"] <= BOUND, attempt["seconds"]
    for (version, logits), (v0, l0) in zip([*after, after_alone], [*before, before[2]], strict=True):
        assert version == v0 != "v1" and torch.equal(logits, l0)
