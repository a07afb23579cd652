"""``WeightSync``: a lasting connection from a trainer to its engines, and ``update_weights``, one update through a
new one. An update resolves the engines (once), chooses the transport and the stream's plan, runs (pause, open,
transfer, with ``delta`` check, commit, resume) and reports what it did."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from weightstream.common.bounds import cleanup_budget
from weightstream.converters.registry import model_spec
from weightstream.engines.base import IPC_AHEAD, IPC_SESSION, SINGLE_DTYPE, EngineAdapter, IpcSession
from weightstream.errors import UpdateError
from weightstream.models.spec import ModelSpec, load_hf_config
from weightstream.sinks.base import Sink
from weightstream.sinks.delta import DeltaTracker
from weightstream.sinks.ipc import IPCSink
from weightstream.sources import as_source
from weightstream.sources.base import Source
from weightstream.streaming.bucket import extent
from weightstream.streaming.delta import Snapshot, warm_kernels, word_size
from weightstream.streaming.kept_plans import PlanSettings
from weightstream.streaming.stream import BucketStream, confirm_plan, stream_of
from weightstream.update.delta_steps import DeltaSteps
from weightstream.update.engine_sessions import EngineSessions
from weightstream.update.options import SyncOptions
from weightstream.update.ranks import as_update_error, first_error, rank, share
from weightstream.update.report import UpdateReport, fill_report
from weightstream.update.sink_set import SinkSet
from weightstream.update.transport import Decision, check_formats, choose_transport, reshards

__all__ = ["WeightSync", "engines_list", "update_weights"]

log = logging.getLogger("weightstream")

# An opened update: the sink, opened on the stream (None: opening failed before the stream was made).
_Opened = tuple[Sink, BucketStream] | None

# Why an update was sent again (UpdateReport.replanned): its stream's kept plan, confirmed after the buckets were
# sent, was no longer the model's.
STALE_PLAN = ("the model's parameters changed since the kept stream plan was made (a parameter replaced, re-pointed, "
              "re-shaped or re-typed, or one added or removed)")


@dataclass(frozen=True)
class _Job:
    """What one call is about: the model's config, spec and source."""

    cfg: Any
    spec: ModelSpec
    source: Source

    @classmethod
    def of(cls, model_chunks: Any, hf_config: Any) -> _Job:
        cfg = load_hf_config(hf_config)
        return cls(cfg, model_spec(cfg), as_source(model_chunks))


class WeightSync:
    """A lasting connection from a trainer to its engines: connect once, ``update`` many times.

    Create and call it on every trainer rank. ``engines``: engine adapters (:class:`SGLangEngine`,
    :class:`ReferenceEngine`, ...) or URLs (their engine: ``options.engines.engine``). ``options``: a
    :class:`~weightstream.update.options.SyncOptions`, which documents every option and its default; or, instead,
    its fields as keywords (``WeightSync(urls, transport="p2p", delta=True)``, made into one by
    :meth:`SyncOptions.of`).

    Each update: resolve the engines (the first time) → decide the transport, pause the engines and open their
    sessions → stream the buckets into the transport's sink → (delta: check) → commit, resume → its report.

    The stream's kept plan (made by the first update or :meth:`prepare`) is reused on a check of a fraction of the
    full one's cost, that its copies are memory safe to launch (the storages they read alive and where they were);
    the full check that it is still the model's runs once every bucket is queued (on a GPU, while the device still
    copies them), before the sink closes and anything is committed (:func:`weightstream.streaming.stream.confirm_plan`).
    Where a parameter was replaced or re-pointed since, the copies read stale bytes: the sessions are aborted
    uncommitted and the update is sent again with a new plan (``report.replanned`` says so).
    """

    def __init__(self, engines: EngineAdapter | str | Sequence[EngineAdapter | str],
                 options: SyncOptions | None = None, **keywords: Any):
        if options is not None and not isinstance(options, SyncOptions):
            raise TypeError(f"options must be a SyncOptions, got {type(options).__name__}")
        if options is not None and keywords:
            raise TypeError(f"pass the options as one SyncOptions or as keywords, not both (got {sorted(keywords)})")
        self._options = options if options is not None else SyncOptions.of(**keywords)
        if not engines:
            raise ValueError("no engines given")
        payload = self.options.payload
        self.delta = DeltaTracker(Snapshot(payload.snapshot), payload.full_every) if payload.delta else None
        self._sessions = EngineSessions(engines_list(engines), self.options.engines, self.options.safety.pause_mode)
        self._sinks = SinkSet(self.delta.snapshot if self.delta is not None else None)
        self._delta_steps = DeltaSteps(self.delta, self._sessions) if self.delta is not None else None
        self.updates = 0

    @property
    def options(self) -> SyncOptions:
        """The options, as made (the engines, sinks and delta tracker were made from them); only the transport
        may change later (:attr:`transport`)."""
        return self._options

    @property
    def transport(self) -> str:
        """The transport the next update asks for (``"auto"``: chosen by it)."""
        return self.options.transfer.transport

    @transport.setter
    def transport(self, kind: str) -> None:
        self._options = replace(self._options, transfer=replace(self._options.transfer, transport=kind))

    @property
    def engines(self) -> list[EngineAdapter]:
        """The engines' adapters (made on the first update where URLs were given)."""
        return self._sessions.engines

    @property
    def sinks(self) -> dict[str, Sink]:
        """The sinks kept, by transport."""
        return self._sinks.kept

    @property
    def released(self) -> list[str]:
        """Memory the engines gave up (:meth:`release_memory`), re-created by the next update."""
        return self._sessions.released

    # -- resolve engines → decide --------------------------------------------------------------

    def _resolve_engines(self) -> None:
        self._sessions.resolve()

    def _urls(self) -> list[str]:
        return self._sessions.urls()

    def _decide(self, job: _Job, version: str | None, seconds: dict[str, float]) -> Decision:
        """Rank 0 asks the engines and decides; for an update (``version``) it also pauses them and opens
        their sessions. Every rank gets the decision, or raises the same error."""
        self._resolve_engines()
        decided: Decision | BaseException | None = None
        if rank() == 0:
            t = time.perf_counter()
            try:
                decided = self._choose(job)
                if version is not None and self._folds_session(decided):  # opened and committed by the request
                    decided = replace(decided, session=IpcSession(self._sessions.pause_mode, version,
                                                                  self.options.engines.timeout_s))
                elif version is not None:
                    self._sessions.pause(version)
            except Exception as exc:  # noqa: BLE001 — shared with every rank below
                if version is not None:
                    self._sessions.abort()
                decided = as_update_error("connect", exc, self._urls())
            if version is not None:
                seconds["pause"] = time.perf_counter() - t
        decided = share(decided)
        if isinstance(decided, BaseException):
            raise decided
        if not isinstance(decided, Decision):
            raise TypeError(f"rank 0 decided {decided!r}")
        return decided

    def _choose(self, job: _Job) -> Decision:
        """Rank 0: the transport, from what the engines declare, and the layout they serve checked."""
        engines, transfer = self.engines, self.options.transfer
        kind, reason = choose_transport(transfer.transport, engines, job.source.topology, job.spec, transfer.colocated,
                                        p2p_source=job.source.per_rank_senders)
        check_formats(engines, self.options.payload.quantize)
        if self.delta is not None:  # a delta-mode update the transport cannot carry: refused before any pause
            self.delta.refuse_transport(engines, kind)
        return Decision(kind, reason, any(e.info().can(SINGLE_DTYPE) for e in engines),
                        kind == "p2p" and reshards(engines))

    def _folds_session(self, decision: Decision) -> bool:
        """Rank 0: whether an update by ``decision`` has its request open and commit the engine's session
        (:data:`IPC_SESSION`): by IPC ahead into one engine that declares it, with nothing to do between the buckets
        and the commit (no delta check) nor before the writes (no memory released to re-create first)."""
        engines = self.engines
        return (decision.transport == "ipc" and len(engines) == 1 and engines[0].info().can(IPC_SESSION)
                and engines[0].info().can(IPC_AHEAD) and self.options.transfer.metadata_ahead and self.delta is None
                and not self._sessions.released)

    def _stream(self, job: _Job, decision: Decision, confirm_later: bool) -> BucketStream:
        """``confirm_later``: an update's stream, whose kept plan :meth:`_transfer` confirms after the buckets."""
        transfer = self.options.transfer
        settings = PlanSettings(decision.mode, transfer.bucket_bytes, decision.align, decision.one_dtype,
                                self.options.payload.quantize)
        return stream_of(job.source, job.cfg, job.spec, settings, reuse_buffers=transfer.reuse_buffers,
                         confirm_later=confirm_later)

    def _sink(self, job: _Job, decision: Decision) -> Sink:
        return self._sinks.get(decision.transport, self.engines, job.source.topology, decision.reshard, self.options)

    # -- run the update → report -------------------------------------------------------------

    def update(self, model_chunks: nn.Module | Sequence[nn.Module], hf_config: Any, *,
               weight_version: str | None = None) -> UpdateReport:
        """One update; call on every trainer rank. On failure every rank raises the same error (an
        :class:`UpdateError` naming the phase and the engines, or the :class:`ConversionError` that
        stopped the stream), the engines' sessions are aborted, the group is torn down on both sides,
        generation resumes, and it all ends within ``1.2 * timeout_s + 5`` seconds of the wait that
        failed. The phases: decide (and pause), open, transfer, (delta mode: check,) commit, resume. With
        ``delta``, an update whose check finds a mismatch is aborted (the engines put their weights back) and
        done again in full; its report says what was found. An update whose stream's kept plan turns out stale
        (a parameter replaced or re-pointed since it was made: see the class doc) is aborted the same way and done
        again with a new plan (with ``delta``, in full); its report's ``replanned`` says so."""
        start = time.perf_counter()
        job = _Job.of(model_chunks, hf_config)
        self.updates += 1
        version = weight_version if weight_version is not None else str(self.updates)
        report, mismatch, stale = self._update_once(job, version)
        if stale is not None:  # the same on every rank (voted); the kept plan is forgotten: a new one is made
            log.warning("update %s: %s, so what its kept plan read was stale: its sessions were aborted uncommitted "
                        "and it is sent again with a new plan", version, stale)
            report, mismatch, _ = self._update_once(job, version)
        if mismatch is not None:  # the same on every rank: the tracker forced the next update full
            log.warning("delta update %s failed its check (%s): updating again, in full", version, mismatch)
            report, _, _ = self._update_once(job, version)
            if report.delta is not None:
                report.delta.mismatch = mismatch
        report.replanned = stale
        report.seconds["total"] = time.perf_counter() - start
        return report

    def _update_once(self, job: _Job, version: str) -> tuple[UpdateReport, str | None, str | None]:
        """One attempt: its report, what the delta check found, and why its stream's kept plan did not hold
        (either not None: the sessions were aborted uncommitted, to be done again)."""
        seconds: dict[str, float] = {}
        decision = self._decide(job, version, seconds)
        report = UpdateReport(decision.transport, decision.reason, decision.mode, engines=self._urls(),
                              session_in_request=decision.session is not None)
        (failure, held), mismatch, stale = self._send(job, decision, report, seconds), None, None
        if failure is None and not held:  # every rank alike (voted): what was sent may be stale
            stale = STALE_PLAN
            self._abort_stale()
        elif failure is None and rank() == 0:
            failure, mismatch = self._conclude(version, decision, report, seconds)
        failure, mismatch, delta = share((failure, mismatch, report.delta))
        report.delta = delta  # rank 0 decides and checks deltas; every rank reports what it found
        if failure is not None:
            if self.delta is not None:
                self.delta.force_full(f"the last update failed ({type(failure).__name__})")
            self._fail()
            raise failure
        if mismatch is None and stale is None:
            self._sessions.released = []
        report.weight_version = version
        report.seconds = seconds
        return report, mismatch, stale

    def _abort_stale(self) -> None:
        """Every rank, after an attempt whose stream's kept plan did not hold: as after a delta mismatch, rank 0
        aborts the engines' sessions without committing (an engine that cannot roll back holds stale bytes: it stays
        paused for the update that follows at once); with ``delta``, the next update is full (the trainer's
        snapshot encoded the stale bytes)."""
        if self.delta is not None:
            self.delta.force_full("the last attempt's kept stream plan was stale (a parameter replaced or re-pointed)")
        if rank() == 0:
            self._sessions.abort(resume_stale=False)

    def _send(self, job: _Job, decision: Decision, report: UpdateReport,
              seconds: dict[str, float]) -> tuple[BaseException | None, bool]:
        """Every rank: open the sink on the stream and stream every bucket into it; the first failure of any
        rank, the same on every rank, and whether the stream's kept plan held (the same on every rank)."""
        err, opened = self._open(job, decision, seconds, report)
        held = True
        if opened is not None:
            err, held = self._transfer(*opened, err, report, seconds)
        failure = first_error(err)
        if failure is None and opened is not None:
            opened[0].share_digests()  # every rank: the check below needs what each engine rank's senders sent
        return failure, held

    def _conclude(self, version: str, decision: Decision, report: UpdateReport,
                  seconds: dict[str, float]) -> tuple[BaseException | None, str | None]:
        """Rank 0, every bucket sent: (delta mode) the check (:class:`DeltaSteps`), then the commit and the
        resume (made by the update's request where it folded the session: its answer checked); the failure, and
        what the delta check found."""
        if decision.session is not None:
            return self._folded_commit(version, seconds), None
        if self._delta_steps is not None:
            failure, mismatch = self._delta_steps.check(report, seconds)
            if failure is not None or mismatch is not None:
                return failure, mismatch
        failure, resumed = self._sessions.commit(version, seconds)
        if failure is None and not resumed:
            self._sessions.resume(seconds)
        if failure is None and self.delta is not None and report.delta is not None:
            self.delta.committed(self.engines, version, report.delta.full)
        return failure, None

    def _folded_commit(self, version: str, seconds: dict[str, float]) -> BaseException | None:
        """Rank 0: the engine committed the update with its request and resumed (:data:`IPC_SESSION`); the version
        it now serves must be ``version``."""
        served = self._folding_sink().committed
        seconds["commit"] = seconds["resume"] = 0.0  # (in the transfer: the request's last step)
        if served == version:
            return None
        return UpdateError("commit", f"engine {self._urls()[0]} committed the update with its request and reports "
                           f"weight version {served!r}, expected {version!r}", self._urls())

    def _open(self, job: _Job, decision: Decision, seconds: dict[str, float],
              report: UpdateReport) -> tuple[BaseException | None, _Opened]:
        """Every rank: the sink (kept across updates), the stream, (with ``delta``, :class:`DeltaSteps`: full or
        deltas, before the sink opens) and the sink opened on it. A failure is kept, not raised: the stream still runs
        on this rank so that no other rank waits on it."""
        sink: Sink | None = None
        stream: BucketStream | None = None
        try:
            sink = self._sink(job, decision)
            t = time.perf_counter()
            stream = self._stream(job, decision, confirm_later=True)  # (its kept plan's addresses checked)
            seconds["plan"] = time.perf_counter() - t
            steps = self._delta_steps
            failed = steps.begin(decision, stream, report) if steps is not None else None
            if failed is not None:
                return failed, _opened(sink, stream)
            t = time.perf_counter()
            if decision.session is not None:
                self._folding_sink().fold(decision.session)
            sink.open(stream)
            seconds["connect"] = time.perf_counter() - t
        except BaseException as exc:  # noqa: BLE001
            return as_update_error("group", exc, self._urls()), _opened(sink, stream)
        return None, _opened(sink, stream)

    def _transfer(self, sink: Sink, stream: BucketStream, err: BaseException | None, report: UpdateReport,
                  seconds: dict[str, float]) -> tuple[BaseException | None, bool]:
        """Every rank streams every bucket into the sink; a failing rank keeps joining the collectives
        (drains) so nobody hangs. Then every rank, failed or not, confirms the stream's kept plan (one vote:
        :func:`confirm_plan`, the full check its reuse deferred) before the sink closes: on a GPU while the device
        still copies and sends the buckets queued; by IPC direct writes, before waiting on the engine's answer.
        The first failure is returned, and whether the plan held (False: what was sent may be stale)."""
        t = time.perf_counter()
        phase = "transfer"
        held = True
        try:
            for bucket in stream:  # iterated to the end even after a failure: the gathers need every rank
                phase = f"bucket {bucket.index}"
                if err is None:
                    try:
                        sink.send(bucket)
                    except BaseException as exc:  # noqa: BLE001
                        err = as_update_error(phase, exc, self._urls())
        except BaseException as exc:  # noqa: BLE001
            err = err or as_update_error(phase, exc, self._urls())
        confirming = time.perf_counter()
        try:
            held = confirm_plan(stream)
        except BaseException as exc:  # noqa: BLE001
            err = err or as_update_error(phase, exc, self._urls())
        ipc = self._sinks.ipc()
        if not held and ipc is not None and ipc is sink:  # (where its request commits the session: it must not)
            ipc.withhold_commit()
        seconds["transfer:confirm"] = time.perf_counter() - confirming
        if err is None:  # (also where the plan did not hold: the engines answer, then their sessions are aborted)
            try:
                sink.close()
            except BaseException as exc:  # noqa: BLE001
                err = as_update_error(phase, exc, self._urls())
        fill_report(report, stream, sink.delivery())
        seconds["transfer"] = time.perf_counter() - t
        seconds["transfer:pack"] = stream.stats.seconds  # of which: this rank making the buckets
        waited = sink.delivery().waited_s
        if waited is not None:
            seconds["transfer:wait"] = waited  # and waiting for the engine's answers
        return err, held

    def _folding_sink(self) -> IPCSink:
        """The IPC sink of an update whose request opens and commits the engine's session."""
        sink = self._sinks.ipc()
        if sink is None:
            raise RuntimeError("an update's session folded into its IPC request, but no IPC sink is kept")
        return sink

    # -- before and between updates ----------------------------------------------------------

    def prepare(self, model_chunks: nn.Module | Sequence[nn.Module], hf_config: Any) -> str:
        """What an update needs before its first bytes, done now: call it on every trainer rank once the model
        and the engines are up (before training starts, say). The engines are asked what they are, the
        transport is chosen, the stream's plan (table, buckets, copy programs, the kept buffers and the batched
        copies into them; on a GPU the copy kernel compiled, and with ``delta`` the word kernels) is made and kept,
        by broadcast or P2P every bucket is packed once (sending nothing: what a first pack compiles is compiled),
        and the group to the engines is formed and, where they take it, its connections made by a first, tiny
        transfer; the first :meth:`update` then costs about what a later one does (by IPC, where the trainer may
        write straight into the engine's weights, nothing is packed outside an update). The engines keep serving
        meanwhile (nothing is paused). Returns the transport; raises on every rank what the first update would have
        raised."""
        job = _Job.of(model_chunks, hf_config)
        decision = self._decide(job, None, {})
        err: BaseException | None = None
        try:
            self._warm(job, decision)
        except BaseException as exc:  # noqa: BLE001
            err = as_update_error("group", exc, self._urls())
        failure = first_error(err)
        if failure is not None:
            self._sinks.abort()
            raise failure
        return decision.transport

    def _warm(self, job: _Job, decision: Decision) -> None:
        """:meth:`prepare`'s work on this rank: the stream's plan and copies, the kernels, the sink's group."""
        stream = self._stream(job, decision, confirm_later=False)  # (nothing here confirms it later)
        stream.metadata_digest()  # every bucket's copy program, made and kept with the plan
        sink = self._sink(job, decision)
        sink.prepare(stream)  # IPC: the engine learns the plan and maps the kept buffers (first: on the CPU,
        stream.prepare_copies()  # sharing a buffer moves it into shared memory); then the copies into them
        if self.delta is not None:  # the word kernels compiled, for the first delta (on a GPU)
            warm_kernels(stream.device, {word_size(extent(ms), (m.dtype.itemsize for m in ms))
                                         for ms in map(stream.bucket_metas, range(len(stream)))})
        stream.warm_casts()  # on a GPU with block FP8, the cast kernel compiled (whatever the transport)
        if decision.transport != "ipc":  # (IPC may write into the engine's weights, on some ranks only)
            stream.rehearse()  # every bucket packed once (on a GPU, the block-FP8 kernel compiled), none sent
        sink.connect()  # (and the group's first transfer made, where the engines take it)

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Between rollouts, on every trainer rank: pause generation and have the engines free their memory
        (``tags``: SGLang's ``weights``, ``kv_cache``, ``cuda_graph``; all by default) while the trainer
        trains. The next :meth:`update` re-creates the weights before streaming into them and the rest
        after committing, then resumes generation; the engine serves nothing until then."""
        self._resolve_engines()
        tags = list(tags) if tags else ["weights", "kv_cache", "cuda_graph"]
        ipc = self._sinks.ipc()
        if ipc is not None and "weights" in tags:
            ipc.forget_targets()  # the engine's weights mapped here would keep their memory from being freed
        err: Any = None
        if rank() == 0:
            try:
                self._sessions.release(tags)
            except Exception as exc:  # noqa: BLE001 — shared with every rank below
                err = as_update_error("release_memory", exc, self._urls())
        err = share(err)
        if err is not None:
            raise err
        self._sessions.released = sorted(set(self.released) | set(tags))

    # -- failure and the end -----------------------------------------------------------------

    def _fail(self) -> None:
        """After a failed update, on every rank: the group is left (both sides) while rank 0 aborts the
        engines' sessions and resumes generation, all within the cleanup budget."""
        aborting = None
        if rank() == 0:
            aborting = threading.Thread(target=self._sessions.abort, name="ws-abort", daemon=True)
            aborting.start()
        try:
            self._sinks.abort()
        finally:
            if aborting is not None:
                aborting.join(cleanup_budget(self.options.engines.timeout_s))

    def close(self) -> None:
        """Tear down the weight-update groups (engines keep their weights)."""
        self._sinks.close()

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _opened(sink: Sink | None, stream: BucketStream | None) -> _Opened:
    return None if sink is None or stream is None else (sink, stream)


def engines_list(engines: EngineAdapter | str | Sequence[EngineAdapter | str]) -> list[EngineAdapter | str]:
    """One engine (its URL or adapter) or several, as a list: a string is one URL, never a sequence of them."""
    if isinstance(engines, str) or not isinstance(engines, Sequence):
        return [engines]
    return list(engines)


def update_weights(model_chunks: nn.Module | Sequence[nn.Module], hf_config: Any,
                   engines: EngineAdapter | str | Sequence[EngineAdapter | str], *,
                   weight_version: str | None = None, options: SyncOptions | None = None,
                   **keywords: Any) -> UpdateReport:
    """One update: pause, connect, stream, commit, flush the engines' caches, resume, disconnect. Call on every
    trainer rank. ``options`` or its fields as keywords: as :class:`WeightSync` takes them. For repeated updates
    keep a :class:`WeightSync` instead (the group is made once)."""
    with WeightSync(engines, options, **keywords) as sync:
        return sync.update(model_chunks, hf_config, weight_version=weight_version)
