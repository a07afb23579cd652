"""A second trainer at an engine that a first one is connected to, under the same group name: by broadcast, P2P
and IPC it is refused with one error that names what is held (the group, or the IPC channel, and by whom), and it
leaves the first trainer's connection untouched: the first trainer's next update succeeds and the engine holds its
weights bit for bit. Each trainer is a Megatron-Core job of its own (``weightstream.launch``), into a real reference
engine."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.conflict_workers import run_first_trainer, run_second_trainer
from tests.helpers.faults import HeldWeights
from tests.helpers.workers import Case
from tests.test_delta_updates import assert_held, engine
from weightstream.jobs import Layout
from weightstream.launch import launch
from weightstream.models.presets import preset_config, save_random_checkpoint

SMALL = 120_000  # bytes per bucket: the tiny model travels in several buckets


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> str:
    return save_random_checkpoint(preset_config("tiny-qwen3"), tmp_path_factory.mktemp("held") / "m", seed=77)


def _first_updated(first, rendezvous: str) -> None:
    """Until the first trainer has updated the engine (its job's failure raised)."""
    deadline = time.monotonic() + 240
    while not os.path.exists(os.path.join(rendezvous, "a-updated")):
        if first.done():
            first.result()
            raise AssertionError("the first trainer ended before its first update")
        assert time.monotonic() < deadline, "the first trainer did not update the engine within 240 s"
        time.sleep(0.1)


@pytest.mark.parametrize("transport", ["broadcast", "p2p", "ipc"])
def test_a_second_trainer_is_refused_and_leaves_the_first_untouched(sources, engine_dir, tmp_path, transport):
    first_case = Case(sources["tiny-qwen3"], Layout(1), dtype="bfloat16", bucket_bytes=SMALL)
    second_case = Case(sources["tiny-qwen3-bf16"], Layout(1), dtype="bfloat16", bucket_bytes=SMALL)
    with engine(engine_dir) as server, ThreadPoolExecutor(1) as pool:
        first = pool.submit(launch, 1, run_first_trainer, first_case, server.url, transport, str(tmp_path))
        try:
            _first_updated(first, str(tmp_path))
            [second] = launch(1, run_second_trainer, second_case, server.url, transport)
        finally:
            (tmp_path / "b-done").touch()
        [ours] = first.result(timeout=300)
        held = server.engine.call(HeldWeights())
        version = server.engine.weight_version
    assert "report" not in second, second["report"].summary()
    if transport == "ipc":
        assert second["phase"] == "group", second
        assert "is held over IPC by another trainer (process " in second["error"], second["error"]
    else:
        assert second["phase"] == "group", second
        assert "weight-update group 'weightstream' is already held here, joined with the trainer at tcp://" \
               in second["error"], second["error"]
        assert "Connection closed" not in second["error"]
    assert [r.transport for r in ours["reports"]] == [transport, transport]
    assert version == "a1"
    assert_held(held, ours["tensors"])
