"""How the reference engine stops its workers (:meth:`Engine.shutdown`): a worker busy with a command reads no request
until the command is done, so it is killed at once instead of after the grace; an idle worker is asked, and exits by
itself. Real engines (tiny Qwen3, two worker ranks) run from this process."""

from __future__ import annotations

import threading
import time

import pytest

from weightstream.models.presets import preset_config, save_random_checkpoint
from weightstream.reference_engine.protocol import Memory
from weightstream.reference_engine.ranks import Engine, EngineFailure
from weightstream.reference_engine.worker import Worker, worker_main

GRACE_S = 10.0


class StuckWorker(Worker):
    """A worker that never finishes a :class:`Memory` request, as one stuck in a transfer never finishes it."""

    def memory(self):
        time.sleep(3600)


def stuck_worker_main(*args) -> None:
    """A worker process's entry (importable where the engine starts it): a :class:`StuckWorker`."""
    worker_main(*args, worker_type=StuckWorker)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return save_random_checkpoint(preset_config("tiny-qwen3"), tmp_path_factory.mktemp("shutdown") / "m", seed=7)


def test_a_worker_busy_with_a_command_is_killed_at_once(model):
    engine = Engine(model, 2, worker=stuck_worker_main)
    raised: list[BaseException] = []

    def ask() -> None:
        try:
            engine.call(Memory())
        except BaseException as exc:  # noqa: BLE001 — what the caller of the command is told
            raised.append(exc)

    caller = threading.Thread(target=ask, daemon=True)
    caller.start()
    deadline = time.monotonic() + 30
    while not all(u is not None for u in engine.unanswered):
        assert time.monotonic() < deadline, "the command was not sent"
        time.sleep(0.01)
    start = time.monotonic()
    engine.shutdown(grace_s=GRACE_S)
    seconds = time.monotonic() - start
    assert seconds < GRACE_S / 2, seconds
    assert not any(p.is_alive() for p in engine.procs)
    caller.join(timeout=30)
    assert not caller.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], EngineFailure), raised
    assert "died" in str(raised[0]), raised[0]


def test_idle_workers_exit_by_themselves(model):
    engine = Engine(model, 2)
    assert len(engine.call(Memory())) == 2
    engine.shutdown(grace_s=GRACE_S)
    assert [p.exitcode for p in engine.procs] == [0, 0]
