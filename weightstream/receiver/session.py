"""An update's session on one engine rank, and every load in it: begun, prepared, committed or rolled back whole
(the model keeps the rollback copies: :mod:`~weightstream.receiver.backups`), the bytes held for deltas, the values
each bucket loads checked, a bucket checked against its sender's checksum, and the copy programs kept across
updates (an update repeats the same buckets)."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightstream.common.phases import PhaseClock
from weightstream.receiver.backups import allocated_bytes
from weightstream.receiver.deltas import HeldDeltas
from weightstream.receiver.model import HeldModel, Loaded, program_for
from weightstream.receiver.pieces import Weight
from weightstream.receiver.programs import CopyProgram, ProgramCache, verify_checksum
from weightstream.receiver.values import DEFAULT_CHECKS, LoadChecks, ValuesReport, check_runs, check_values
from weightstream.streaming.bucket import Bucket, TensorMeta, view_tensor

__all__ = ["PROGRAM_TENSORS_PER_WEIGHT", "Facilities", "UpdateSession"]

PROGRAM_TENSORS_PER_WEIGHT = 4  # the bucket programs a rank keeps: at most this many times its model's tensors


@dataclass(frozen=True, slots=True)
class Facilities:
    """What an engine rank lends the receiver layer: its ``rank`` of ``size`` (the engine's TP ranks), the
    ``device`` its weights are on, the ``clock`` an update's phases are timed by (:meth:`UpdateSession.phases`),
    and the weight-update ``groups`` it has joined, by name (the engine joins and leaves them)."""

    rank: int
    size: int
    device: torch.device
    clock: PhaseClock
    groups: Mapping[str, Any]


class UpdateSession:
    """One rank's update sessions into ``model``: the open one's state (buckets loaded, weights that took NaN or an
    infinity), the bytes held for deltas (at most ``held_limit``: :class:`HeldDeltas`), what values are refused
    (``checks``), and the programs of buckets loaded before (:class:`ProgramCache`)."""

    def __init__(self, model: HeldModel, at: Facilities, held_limit: int, checks: LoadChecks = DEFAULT_CHECKS):
        self.model, self.at, self.checks = model, at, checks
        self.open = False
        self.last_phases: dict[str, float] = {}
        self.base = 0  # device bytes allocated when the open (or last) session began
        self.bucket_count = 0
        self.nonfinite: set[str] = set()  # the weights the open session loaded NaN or an infinity into
        self.deltas = HeldDeltas(held_limit)
        # Buckets loaded before (dense broadcast ones by names, dtypes, shapes; per-rank and resharded ones by their
        # layout): the parameters they load into, checked once, and how to cut the received buffer. Only a bucket
        # that loaded is kept, within PROGRAM_TENSORS_PER_WEIGHT times the model's tensors.
        self.programs = ProgramCache(PROGRAM_TENSORS_PER_WEIGHT * len(model.params))

    # -- the session's phases ---------------------------------------------------------------------------------

    def begin(self) -> str:
        place = self.model.begin_session()
        if place.where != "device" and self.model.rollback:
            print(f"weightstream engine rank {self.at.rank}: rollback copies {place.where}: {place.why}",
                  file=sys.stderr, flush=True)
        if self.at.device.type == "cuda":  # the session's peak beyond what the engine held before it
            torch.cuda.reset_peak_memory_stats(self.at.device)
            self.base = allocated_bytes(self.at.device)
        self.bucket_count = 0
        self.deltas.begin()
        self.nonfinite = set()
        self.at.clock.reset()
        self.open = True
        return "ok"

    def prepare(self) -> str:
        """The first phase of a commit across engines: what could still fail is done (the model's
        :meth:`~HeldModel.prepare_session`; on a GPU the device finishes, so an error of its queued work shows now),
        and the session stays open, restorable, until committed or aborted."""
        with self.at.clock("commit"):
            self.model.prepare_session()
            if self.at.device.type == "cuda":
                torch.cuda.synchronize(self.at.device)
        return "ok"

    def commit(self) -> str:
        with self.at.clock("commit"):
            self.model.commit_session()
        self.deltas.commit(None)  # the bytes the session changed are settled (the engine names its version itself)
        self.bucket_count = 0
        self._end()
        return "ok"

    def abort(self) -> str:
        restored = self.model.rollback_session()
        self._end()
        self.bucket_count = 0
        self.deltas.abort()  # bytes held for deltas changed in place are no longer the committed ones
        return f"restored {restored} tensors"

    def _end(self) -> None:
        self.open = False
        self.last_phases = self.at.clock.reset()

    def phases(self) -> dict[str, float]:
        """Seconds per phase of the last update session on this rank (host time; see :class:`PhaseClock`):
        ``handshake`` (IPC: the channel, the plan, the offer), ``wait`` (IPC: for the trainer's next frame or its
        writes), ``receive`` (a collective's receive; on a GPU until it is queued), ``apply delta``, ``load``
        (copies into the weights, queued on a GPU), ``backup``, ``device finish`` (waiting for the device at the
        end), ``idle`` (between the engine's requests), ``commit``."""
        return dict(self.last_phases)

    def delta_checksums(self) -> dict[int, str]:
        """The checksum of each bucket's bytes the open (or last) session applied (:meth:`HeldDeltas.checksums`)."""
        return self.deltas.checksums()

    def forget_delta(self) -> str:
        """Drop the bytes kept for deltas (the weights were loaded otherwise: they no longer match them)."""
        return f"dropped {self.deltas.forget()} buckets"

    # -- loads ------------------------------------------------------------------------------------------------

    def program(self, metas: Sequence[TensorMeta], key: tuple | None = None) -> CopyProgram:
        """The copy program of a bucket of ``metas`` into the model (:func:`program_for`); ``key``: where it is
        kept in :attr:`programs` once a bucket has loaded by it."""
        return program_for(self.model, metas, key)

    def check_values(self, named: list[tuple[str, torch.Tensor]] | ValuesReport) -> None:
        """Refuse a bucket (``named``: its tensors as they arrived, or what :func:`check_runs` found of them) whose
        values :attr:`checks` refuse, every problem named (:mod:`~weightstream.receiver.values`); log the weights it
        holds NaN or an infinity in, which the session reports."""
        report = named if isinstance(named, ValuesReport) else check_values(named)
        refusal = report.refusal(self.checks)
        if refusal is not None:
            raise ValueError(refusal)
        if report.nonfinite:
            self.nonfinite.update(report.nonfinite)
            print(f"weightstream engine: rank {self.at.rank}: an update loads NaN or an infinity into "
                  f"{len(report.nonfinite)} tensors: {', '.join(report.nonfinite[:8])}"
                  f"{' ...' if len(report.nonfinite) > 8 else ''} (served as they are; --refuse-nonfinite refuses "
                  "them)", file=sys.stderr, flush=True)

    def load(self, tensors: Iterable[Weight], foreign: bool = False) -> dict[str, Any]:
        """``foreign``: the tensors live in the sender's memory (IPC), which it may free or reuse as soon as
        we answer, so the copies are finished first. A buffer of our own (broadcast, P2P) is freed into
        this stream's allocator, which orders its reuse after the copies: the answer goes at once and
        the next bucket's receive overlaps this one's copies."""
        tensors = list(tensors)
        self.check_values([(name, t) for name, t, _ in tensors])
        report = self.model.load_weights(tensors)
        if foreign and self.at.device.type == "cuda":
            torch.cuda.synchronize(self.at.device)
        return self.report(report)

    def apply(self, bucket: Bucket, expected_checksum: str | None, foreign: bool = False) -> dict[str, Any]:
        """A bucket as it came, checked against its sender's checksum, each tensor loaded by the model."""
        index = self.bucket_count
        self.bucket_count += 1
        verify_checksum(bucket.buffer, expected_checksum, f"bucket {index}",
                        lambda: f"; its tensors: {[m.name for m in bucket.metas]}")
        return self.load([(m.name, view_tensor(bucket.buffer, m), m.shard) for m in bucket.metas], foreign)

    def load_dense(self, program: CopyProgram, raw: torch.Tensor, expected_checksum: str | None,
                   kept: bool = False) -> dict[str, Any]:
        """A bucket out of ``raw`` by its ``program``: batched copies where every tensor loads by one (unless a
        checksum is to be checked first), else :meth:`apply`. ``kept``: ``raw`` is a buffer this rank holds across
        updates (its addresses stay), so the copies out of it are made once, per buffer
        (:func:`~weightstream.streaming.copies.batched_copy`)."""
        if program.runs is not None and expected_checksum is None:
            self.check_values(check_runs(raw, program.runs))
            self.bucket_count += 1
            done = self.report(self.model.load_flat(program.names, program.targets, program.copies_from(raw, kept)))
        else:
            done = self.apply(Bucket(self.bucket_count, raw.narrow(0, 0, program.total), program.metas),
                              expected_checksum)
        if program.key is not None:  # it loaded: kept for the next bucket of the same layout
            self.programs.put(program.key, program, len(program.metas))
        return done

    def report(self, report: Loaded) -> dict[str, Any]:
        """A load's answer: how many tensors it loaded (and the session's weights that took NaN or an infinity), or
        an error naming every problem."""
        if report.problems:
            raise RuntimeError(f"{len(report.problems)} tensors could not be loaded: " + "; ".join(report.problems))
        done: dict[str, Any] = {"loaded": len(report.loaded)}  # a count: the names would cross the pipe per update
        if self.nonfinite:
            done["nonfinite"] = sorted(self.nonfinite)
        return done
