"""The reference engine with a fault injected into its workers, from the tests' side. Each worker process runs a
:class:`FaultyWorker` (the engine's own :class:`~weightstream.reference_engine.worker.Worker`, whose receiver's
session and receives misbehave as the fault says: the server takes the worker processes' entry as a parameter), and the
engine does not declare ``broadcast_ahead`` nor ``p2p_ahead`` (a trainer then sends one request per bucket, and
the engine takes each bucket on its own). Every bucket goes through the path where the fault strikes: none is
copied in a batch, none is written by the trainer straight into the engine's weights.

Faults, as ``KIND`` or ``KIND@N``:

- ``corrupt@K``: bucket K's bytes are changed before its checksum is checked;
- ``die@K``: the worker exits (code 17) at bucket K;
- ``stall@K``: the worker hangs at bucket K;
- ``skip_join@R``: engine rank R says it joined the weight-update group and does not;
- ``stall_commit``: the worker hangs when the update is committed;
- ``fail_commit``: the worker fails the commit, in its first phase where the trainer asks for one (what a
  device error surfacing at the end of an update, or a failed exchange of vocabulary pieces, does);
- ``corrupt_delta@K``: the first delta payload of bucket K (changed words, not a dense bucket; resharded: of one
  trainer rank's part) has its last
  value changed as it arrives (with ``checksums=True`` the transfer's own checksum catches it first).

Every faulty worker also answers :class:`HeldWeights`: the tensors its model holds, by name, on the CPU.

``python -m tests.helpers.faults FAULT ARGS...`` runs ``weightstream ARGS...`` (its ``engine`` command, as users
run it) with the fault.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from weightstream.receiver.collective import CollectiveReceiver
from weightstream.receiver.ipc import IpcReceiver
from weightstream.receiver.plan import RankBucket
from weightstream.receiver.receiver import Receiver
from weightstream.receiver.requests import InitGroupRequest
from weightstream.receiver.session import Facilities, UpdateSession
from weightstream.receiver.transfer import ReceiveBuffers
from weightstream.reference_engine import server as server_module
from weightstream.reference_engine.server import EngineServer, serve
from weightstream.reference_engine.worker import Worker, worker_main
from weightstream.streaming.bucket import Bucket

INFO_ROUTE = ("GET", "/get_server_info")


@dataclass(frozen=True, slots=True)
class HeldWeights:
    """A request a :class:`FaultyWorker` answers: the weights it holds (:meth:`FaultyWorker.held_weights`)."""


class FaultySession(UpdateSession):
    """The session of a :class:`FaultyWorker`: every bucket loads through :meth:`apply`, where the fault strikes, and
    the commit fails or hangs as the fault says."""

    def load_dense(self, program, raw, expected_checksum, kept: bool = False):
        """Every bucket through :meth:`apply` (never the batched copies)."""
        return self.apply(Bucket(self.bucket_count, raw.narrow(0, 0, program.total), tuple(program.metas)),
                          expected_checksum)

    def apply(self, bucket: Bucket, expected_checksum, foreign: bool = False):
        _strike(self.bucket_count, bucket.buffer)
        return super().apply(bucket, expected_checksum, foreign)

    def prepare(self):
        _fail_commit()
        return super().prepare()

    def commit(self):
        _fail_commit()
        if FaultyWorker.fault == "stall_commit":
            time.sleep(3600)
        return super().commit()


class FaultyCollective(CollectiveReceiver):
    """The receives over groups of a :class:`FaultyWorker`: a resharded bucket struck before its pieces are
    received, a delta payload changed as it arrives."""

    struck_delta = False

    def _receive_parts(self, group, parts: tuple[RankBucket, ...], load: bool = True):
        """A resharded bucket (sent ahead or not): ``die`` and ``stall`` strike before its pieces are received."""
        _strike(self.session.bucket_count, torch.empty(0, dtype=torch.uint8))
        return super()._receive_parts(group, parts, load)

    def _receive_delta(self, group, header, index: int, src: int | None = None) -> torch.Tensor:
        raw = super()._receive_delta(group, header, index, src)
        if (FaultyWorker.fault == f"corrupt_delta@{index}" and not self.struck_delta and header.encoding != "dense"
                and header.nbytes):
            raw[header.nbytes - 1] ^= 0x5A
            self.struck_delta = True
        return raw

    def _pieces_from_deltas(self, parts: tuple[RankBucket, ...], layouts: list,
                            payloads: list[torch.Tensor]) -> list[torch.Tensor]:
        for part, payload in zip(parts, payloads, strict=True):  # resharded: the first delta part of bucket K
            d = part.delta or {}
            if (FaultyWorker.fault == f"corrupt_delta@{d.get('index')}" and not self.struck_delta
                    and d.get("encoding") != "dense" and d.get("nbytes")):
                payload[int(d["nbytes"]) - 1] ^= 0x5A
                self.struck_delta = True
        return super()._pieces_from_deltas(parts, layouts, payloads)


class FaultyIpc(IpcReceiver):
    def _can_take_writes(self, programs) -> bool:
        return False  # the trainer sends buckets (where the fault strikes), it does not write into the weights


class FaultyWorker(Worker):
    """A worker that misbehaves as :attr:`fault` says (set in its process before the worker is made)."""

    fault = ""

    def make_receiver(self, at: Facilities, max_lent_bytes: int) -> Receiver:
        session = FaultySession(self.model, at, max_lent_bytes)
        return Receiver(session, FaultyCollective(session, ReceiveBuffers(at.device)),
                        FaultyIpc(session, max_lent_bytes))

    def init_group(self, r: InitGroupRequest):
        if self.fault == f"skip_join@{self.rank}":
            return f"rank {r.rank_offset + self.rank} skipped joining {r.group_name} (test fault)"
        return super().init_group(r)

    def held_weights(self) -> dict[str, torch.Tensor]:
        """By the checkpoint's names (a row-parallel projection wraps its ``linear``)."""
        return {n.replace(".linear.", "."): t.detach().cpu().clone()
                for n, t in self.model.model.state_dict().items()}

    def handlers(self):
        return {**super().handlers(), HeldWeights: lambda _: self.held_weights()}


def _fail_commit() -> None:
    if FaultyWorker.fault == "fail_commit":
        raise RuntimeError("the device reported an error at the end of the update (test fault)")


def _strike(index: int, buffer: torch.Tensor) -> None:
    kind, _, at = FaultyWorker.fault.partition("@")
    if kind not in ("corrupt", "die", "stall") or int(at or 0) != index:
        return
    if kind == "corrupt" and buffer.numel():
        buffer.view(-1)[buffer.numel() // 2] ^= 0x5A
    elif kind == "die":
        os._exit(17)
    elif kind == "stall":
        time.sleep(3600)


def faulty_worker_main(fault: str, *args) -> None:
    """A worker process's entry: :func:`~weightstream.reference_engine.worker.worker_main` with a
    :class:`FaultyWorker`."""
    FaultyWorker.fault = fault
    worker_main(*args, worker_type=FaultyWorker)


def faulty_entry(fault: str) -> Callable[..., None]:
    """What the engine starts its worker processes with, for ``fault`` (importable where they start)."""
    return partial(faulty_worker_main, fault)


def hide_ahead(server: EngineServer) -> None:
    """The engine's server info without ``broadcast_ahead`` and ``p2p_ahead``: a trainer sends its buckets one
    request each."""
    hide_capabilities(server, ("broadcast_ahead", "p2p_ahead"))


def hide_capabilities(server: EngineServer, hidden: tuple[str, ...]) -> None:
    """The engine's server info without the capabilities ``hidden`` (a trainer then treats it as an engine that
    lacks them)."""
    info = server.routes[INFO_ROUTE]

    def without(body):
        status, reply = info(body)
        return status, {**reply, "capabilities": [c for c in reply["capabilities"] if c not in hidden]}

    server.routes[INFO_ROUTE] = without


def serve_with_fault(model_dir: str, tp: int, fault: str, ahead: bool = False, **kwargs) -> EngineServer:
    """:func:`~weightstream.reference_engine.server.serve` with ``fault`` injected into its workers; ``ahead``: it
    still declares ``broadcast_ahead`` and ``p2p_ahead`` (faults then strike where each path loads)."""
    server = serve(model_dir, tp, worker=faulty_entry(fault), **kwargs)
    if not ahead:
        hide_ahead(server)
    return server


def main(argv: list[str]) -> int:
    """``FAULT ARGS...``: the command line ``weightstream ARGS...``, its engine's workers faulty."""
    from weightstream.cli import main as cli_main

    fault, *args = argv
    real = server_module.serve

    def faulty_serve(*a, **kw) -> EngineServer:
        server = real(*a, worker=faulty_entry(fault), **kw)
        hide_ahead(server)
        return server

    server_module.serve = faulty_serve  # what the engine command starts (it imports serve when it runs)
    return cli_main(args)


if __name__ == "__main__":
    from tests.helpers.faults import main as entry  # by its module's name: the worker processes import it so

    sys.exit(entry(sys.argv[1:]))
