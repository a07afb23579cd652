"""A colocated update in one request (``ipc_session``): the reference engine's IPC request opens the update session
(pausing generation) before the buckets and commits it (resuming) after them, where every trainer rank's last frame
(``Finish``) lets it. A trainer rank that withholds its commit leaves the session open and the served weights and
version as they were, for the trainer to abort; an engine that does not declare ``ipc_session`` is updated with a
request before and one after, as before. Every check compares the engine's weights with the model's bit for bit
(checksums of each weight's bytes)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.faults import hide_capabilities
from weightstream import WeightSync
from weightstream.engines import ReferenceEngine
from weightstream.engines.base import IPC_SESSION, IpcSession
from weightstream.models.presets import preset_config, random_hf_model, save_random_checkpoint
from weightstream.reference_engine.server import serve, stop
from weightstream.sinks import IPCSink
from weightstream.streaming.kept_plans import clear_plans
from weightstream.streaming.stream import stream_hf_weights
from weightstream.wire.handles import checksum

SMALL = 120_000  # bytes per bucket: several buckets


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> str:
    return save_random_checkpoint(preset_config("tiny-qwen3"), tmp_path_factory.mktemp("session") / "m", seed=77)


def _checksums(model: torch.nn.Module) -> dict[str, str]:
    return {n: checksum(t.contiguous().reshape(-1).view(torch.uint8)) for n, t in model.state_dict().items()}


def _held(engine: ReferenceEngine, names: list[str]) -> dict[str, str]:
    (held,) = engine.weight_checksums(sorted(names))
    return held


def _state(engine: ReferenceEngine) -> tuple[bool, str | None]:
    info = engine.get("/get_server_info", step="server info")
    return info["update_session_open"], info["weight_version"]


def _one_update(sink: IPCSink, model: torch.nn.Module, cfg, session: IpcSession, lets_commit: bool) -> None:
    """One update through ``sink`` whose request opens and commits the session (the commit withheld unless
    ``lets_commit``), as WeightSync runs it."""
    stream = stream_hf_weights(model, cfg, bucket_bytes=SMALL)
    sink.fold(session)
    sink.open(stream)
    for bucket in stream:
        sink.send(bucket)
    if not lets_commit:
        sink.withhold_commit()
    sink.close()


def test_the_request_commits_only_what_the_trainer_lets_it(engine_dir):
    cfg = preset_config("tiny-qwen3")
    model = random_hf_model(cfg, seed=5, dtype=torch.bfloat16)
    ours = _checksums(model)
    server = serve(engine_dir, 1, dtype="bfloat16")  # (rollback on: an aborted session puts its weights back)
    engine = ReferenceEngine(server.url)
    sink = IPCSink(engine, timeout_s=30.0)
    try:
        assert engine.info().can(IPC_SESSION)
        before, version = _held(engine, list(ours)), _state(engine)[1]
        assert before != {n: ours[n] for n in before}  # the engine starts from other weights

        _one_update(sink, model, cfg, IpcSession("abort", "withheld", 30.0), lets_commit=False)
        assert sink.committed is None
        assert _state(engine) == (True, version)  # open, not committed: the trainer aborts it
        engine.abort_update(timeout_s=30.0)
        assert _state(engine) == (False, version) and _held(engine, list(ours)) == before

        _one_update(sink, model, cfg, IpcSession("abort", "v2", 30.0), lets_commit=True)
        assert sink.committed == "v2" and _state(engine) == (False, "v2")
        held = _held(engine, list(ours))
        assert held and held == {n: ours[n] for n in held}
        assert engine.generate([1, 2, 3], max_new_tokens=1)["meta_info"]["weight_version"] == "v2"  # it serves
    finally:
        sink.disconnect()
        stop(server)


@pytest.mark.parametrize(("declared", "direct"), [(True, True), (False, True), (True, False)])
def test_weight_sync_folds_the_session_where_the_engine_declares_it(engine_dir, declared, direct):
    """Written straight into the engine's weights, or through buffers the engine copies out of (its last frame then
    follows the last bucket's)."""
    cfg = preset_config("tiny-qwen3")
    clear_plans()
    server = serve(engine_dir, 1, dtype="bfloat16")
    if not declared:
        hide_capabilities(server, (IPC_SESSION,))
    try:
        with WeightSync([server.url], transport="ipc", bucket_bytes=SMALL, direct=direct) as sync:
            for seed in (11, 12):
                model = random_hf_model(cfg, seed=seed, dtype=torch.bfloat16)
                report = sync.update(model, cfg)
                assert report.session_in_request == declared and report.direct == direct
                # Folded: no commit request after the transfer; else the commit (and resume) request was timed.
                assert (report.seconds["commit"] == 0.0) == declared
                ours = _checksums(model)
                held = _held(ReferenceEngine(server.url), list(ours))
                assert held and held == {n: ours[n] for n in held}
                assert _state(ReferenceEngine(server.url)) == (False, report.weight_version)
    finally:
        stop(server)
