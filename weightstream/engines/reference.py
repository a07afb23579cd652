"""The reference engine (``weightstream engine``): SGLang's protocol, plus per-rank (P2P) buckets, rollback
of an aborted session, and logits for checking."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from functools import partial
from typing import Any

from weightstream.engines.base import (
    BROADCAST,
    COMMIT_AND_RESUME,
    IPC,
    IPC_AHEAD,
    P2P,
    PAUSE_AND_BEGIN,
    PREPARE_COMMIT,
    RELEASE_MEMORY,
    RESHARD,
    ROLLBACK,
    DeltaChecks,
    GroupSpec,
    IpcSession,
    RankBucket,
)
from weightstream.engines.http import PendingReply
from weightstream.engines.sglang import SGLangEngine
from weightstream.models.spec import dtype_name
from weightstream.streaming.bucket import Bucket, TensorMeta
from weightstream.streaming.reshard import EngineLayout
from weightstream.wire.frames import BucketLayout, Plan

__all__ = ["ENGINE_NAME", "KNOWN_PLANS", "ReferenceEngine"]


ENGINE_NAME = "weightstream-reference"
# The plans (every bucket's metadata of a broadcast update sent ahead) whose engine key a client remembers: as many as
# the engine keeps (``KEPT_AHEAD_PLANS`` of weightstream.reference_engine.server), beyond which it forgets them too.
KNOWN_PLANS = 4


def _layout(bucket: Sequence[TensorMeta]) -> BucketLayout:
    """A bucket's metadata: each tensor's name, dtype name, shape and byte offset, in order."""
    return BucketLayout(names=tuple(m.name for m in bucket), dtypes=tuple(dtype_name(m.dtype) for m in bucket),
                        shapes=tuple(tuple(int(d) for d in m.shape) for m in bucket),
                        offsets=tuple(m.offset for m in bucket))


def _dense_json(buckets: Sequence[Sequence[TensorMeta]]) -> list[dict[str, Any]]:
    """Dense buckets as a broadcast sent ahead names them: each one's names, dtype names and shapes."""
    return [{"names": b.names, "dtypes": b.dtypes, "shapes": b.shapes} for b in map(_layout, buckets)]


def _meta_json(m) -> dict:
    shard = None if m.shard is None else {"dim": m.shard.dim, "start": m.shard.start, "length": m.shard.length,
                                          "full": m.shard.full}
    return {"name": m.name, "dtype": dtype_name(m.dtype), "shape": list(m.shape), "offset": m.offset, "shard": shard}


class ReferenceEngine(SGLangEngine):
    name = "reference"

    def __init__(self, url: str, **options: Any):
        super().__init__(url, **options)
        # A broadcast plan sent ahead: the stream's digest of its metadata -> the key the engine keeps it by (from
        # the engine's answer; the engine derives it from what it decoded); and the keys the engine said at the
        # open session's begin that it holds. A plan the engine holds goes as its key alone.
        self._plan_keys: OrderedDict[str, str] = OrderedDict()
        self._engine_plans: frozenset[str] = frozenset()

    def capabilities(self, server_info: dict) -> frozenset[str]:
        declared = server_info.get("capabilities") or (BROADCAST, IPC, IPC_AHEAD, P2P, RESHARD, ROLLBACK,
                                                         RELEASE_MEMORY)
        # Its routes take a commit with a resume, and a pause with a begin, in one request each; and a commit's
        # first phase on its own.
        return frozenset(declared) | {COMMIT_AND_RESUME, PAUSE_AND_BEGIN, PREPARE_COMMIT}

    @staticmethod
    def _join_body(spec: GroupSpec) -> dict[str, Any]:
        """SGLang's fields, and the group's first transfer (``weightstream_warm``) where the trainer asks for one."""
        body = SGLangEngine._join_body(spec)
        if spec.warm:
            body.update(weightstream_warm=spec.warm, weightstream_warm_senders=spec.warm_senders)
        return body

    def commit_update(self) -> str | None:
        """One request: the reference engine's ``/end_weight_update`` answers with the weight version it
        now serves (it keeps no KV cache to flush)."""
        return self._end({}, "end_weight_update")

    def prepare_commit(self) -> str | None:
        """The first phase of a commit (``/weightstream/prepare_weight_update``): the version the commit will
        serve; the session stays open and restorable."""
        reply = self.post("/weightstream/prepare_weight_update", {}, step="prepare_weight_update")
        return None if reply.get("weight_version") is None else str(reply["weight_version"])

    def commit_and_resume(self) -> str | None:
        """:meth:`commit_update`, then generation resumes, in the same request (``{"resume": true}``)."""
        return self._end({"resume": True}, "end_weight_update (and continue_generation)")

    def _end(self, body: dict, step: str) -> str | None:
        reply = self.post("/end_weight_update", body, step=step)
        self._session = False  # a commit that failed leaves the session to abort (the engine may hold it open)
        return None if reply.get("weight_version") is None else str(reply["weight_version"])

    def pause_and_begin(self, mode: str, version: str | None, timeout_s: float | None = None) -> None:
        """Pause generation and open the session in one request (``/begin_weight_update`` with ``pause``)."""
        self._begin({"pause": mode}, version, timeout_s, "pause_generation and begin_weight_update")

    def begin_update(self, version: str | None, timeout_s: float | None = None) -> None:
        """Open a versioned session: the version is the engine's from the start, so that the buckets may come
        from trainer ranks other than the one that opened it (P2P from several data-parallel replicas)."""
        self._begin({}, version, timeout_s, "begin_weight_update")

    def _begin(self, body: dict, version: str | None, timeout_s: float | None, step: str) -> None:
        self._version = version
        if timeout_s:
            body["timeout_s"] = timeout_s
        if version is not None:
            body["weight_version"] = version
        reply = self.post("/begin_weight_update", body, step=step)
        plans = reply.get("weightstream_plans")
        self._engine_plans = frozenset(p for p in plans if isinstance(p, str)) if isinstance(plans, list) \
            else frozenset()
        self._session = True

    def abort_update(self, timeout_s: float | None = None) -> None:
        """Close the session without committing: the engine puts its last committed weights back."""
        if not self._session:
            return
        self._session = False
        self.post("/weightstream/abort_weight_update", {}, step="abort_weight_update", timeout_s=timeout_s)

    def receive_broadcast_ahead(self, buckets: Sequence[Sequence[TensorMeta]], timeout_s: float,
                                delta: bool = False, digest: str | None = None) -> None:
        """The metadata of every dense bucket of this update, in order, before the first is broadcast; the
        engine receives them back to back and answers once all are loaded (or once one failed: it still
        receives the rest, so that the broadcasts match, and loads none of them). ``delta``: each bucket comes as
        its delta header, then its payload. ``digest`` (the stream's, of this metadata): where the engine said at
        this session's begin that it holds the plan this client sent it under ``digest``, its key goes alone
        (thousands of tensors' names, dtypes and shapes neither encoded here nor decoded there)."""
        body: dict[str, Any] = {"group_name": self.group_name, "weight_version": self._version,
                                "load_format": "flattened_bucket", "weightstream_delta_mode": delta}
        key = self._plan_keys.get(digest) if digest is not None else None
        if key is not None and key in self._engine_plans:
            body["weightstream_plan"] = key
        else:
            body["buckets"] = _dense_json(buckets)
        reply = self.post("/weightstream/update_weights_from_distributed_ahead", body,
                          step=f"update_weights_from_distributed_ahead ({len(buckets)} buckets)", timeout_s=timeout_s)
        self._known(digest, reply.get("weightstream_plan"))

    def prepare_broadcast_ahead(self, buckets: Sequence[Sequence[TensorMeta]], digest: str, timeout_s: float) -> None:
        """Before the first update (``/weightstream/prepare_broadcast_ahead``): the engine's ranks make every bucket's
        copy programs, their receive buffers and checks now; the plan's key, answered, is what the first update
        sends (the engine names it at that update's begin)."""
        body = {"group_name": self.group_name, "load_format": "flattened_bucket", "buckets": _dense_json(buckets)}
        reply = self.post("/weightstream/prepare_broadcast_ahead", body,
                          step=f"prepare_broadcast_ahead ({len(buckets)} buckets)", timeout_s=timeout_s)
        self._known(digest, reply.get("weightstream_plan"))

    def _known(self, digest: str | None, key: Any) -> None:
        """The engine keeps the plan of metadata ``digest`` under ``key`` (its answer)."""
        if digest is not None and isinstance(key, str):
            self._plan_keys[digest] = key
            self._plan_keys.move_to_end(digest)
            while len(self._plan_keys) > KNOWN_PLANS:
                self._plan_keys.popitem(last=False)

    def receive_ipc_ahead(self, plan: str, num_buckets: int, channels: Sequence[str], client: str,
                          timeout_s: float, delta: bool = False,
                          session: IpcSession | None = None) -> PendingReply[str | None]:
        """A colocated update of ``num_buckets`` buckets laid out as ``plan`` (a digest of their metadata), and
        the control channel each engine TP rank connects to (``host:port``, the colocated trainer rank's);
        an engine rank that does not know the plan asks for its metadata there (:meth:`ipc_plan_frame`).
        The request is sent at once; the engine answers once every bucket is loaded, or once one failed
        (the returned reply's ``result()``). ``client`` names the trainer's
        buffers: the engine keeps those it was asked to keep mapped for the next update from the same
        client. ``timeout_s``: the bound of each wait on the trainer. ``delta``: a delta-mode update (every
        bucket a payload to apply to the bytes the engine holds of it, which it keeps for the next). ``session``
        (``ipc_session``): the request opens the session (``weightstream_begin``, as ``/begin_weight_update`` with a
        pause) and commits it with a resume (``weightstream_commit``), where the trainer's last frames let it; the
        answer is the version the engine then serves (None: not committed)."""
        body: dict[str, Any] = {
            "weight_version": self._version, "client": client, "channels": list(channels), "timeout_s": timeout_s,
            "plan": plan, "num_buckets": num_buckets, "weightstream_delta_mode": delta,
        }
        if session is not None:
            self._version, self._session = session.version, True  # (a failure aborts it as any session)
            body.update(weight_version=session.version, weightstream_commit={"resume": True}, weightstream_begin={
                "pause": session.pause, "timeout_s": session.timeout_s, "weight_version": session.version})
        return self.start("POST", "/weightstream/update_weights_from_ipc_ahead", body,
                          step=f"update_weights_from_ipc_ahead ({num_buckets} buckets)",
                          timeout_s=timeout_s * (num_buckets + 4),
                          then=partial(self._served, session is not None))

    def _served(self, folded: bool, reply: dict[str, Any]) -> str | None:
        """The version an update's request committed (``folded``: it carried the session), or None."""
        if not folded or reply.get("committed") is not True:
            return None
        self._session = False
        return None if reply.get("weight_version") is None else str(reply["weight_version"])

    def prepare_ipc_ahead(self, plan: str, num_buckets: int, channels: Sequence[str], client: str,
                          timeout_s: float) -> PendingReply[Any]:
        """Before the first update, outside a session: each engine rank connects to its control channel as
        for :meth:`receive_ipc_ahead`, learns the plan if it does not know it, and maps the buffers the
        trainer names in one frame (:class:`~weightstream.wire.frames.KeptBuffers`), keeping them for this
        client's updates. Sent at once; answered (the reply's ``result()``) once the engine is done."""
        return self.start("POST", "/weightstream/prepare_ipc_ahead", {
            "client": client, "channels": list(channels), "timeout_s": timeout_s, "plan": plan,
            "num_buckets": num_buckets,
        }, step="prepare_ipc_ahead", timeout_s=timeout_s * 5)

    def release_ipc_buffers(self, client: str, timeout_s: float | None = None) -> None:
        """The trainer ``client`` is done: the engine closes the buffers it kept mapped for it."""
        self.post("/weightstream/release_ipc_buffers", {"client": client}, step="release_ipc_buffers",
                  timeout_s=timeout_s)

    @staticmethod
    def ipc_plan_frame(buckets: Sequence[Sequence[TensorMeta]]) -> Plan:
        """The control-channel frame with the metadata of every bucket of a plan, in order."""
        return Plan(tuple(_layout(b) for b in buckets))

    def _broadcast_body(self, bucket: Bucket, checksum: str | None) -> dict:
        """A delta bucket (:data:`DELTA`) says how its payload is encoded, and which bucket of the plan it is."""
        body = super()._broadcast_body(bucket, checksum)
        if bucket.delta is not None:
            body["weightstream_delta"] = {**bucket.delta.as_json(), "index": bucket.index}
        return body

    def update_phases(self) -> list[dict[str, float]]:
        """Seconds per phase of the engine's last update session, per engine rank (``/weightstream/update_phases``:
        handshake, wait, receive, apply delta, load, backup, device finish, idle, commit; each where it occurred)."""
        reply = self.get("/weightstream/update_phases", step="update_phases")
        return [{str(k): float(v) for k, v in rank.items()} for rank in reply["ranks"]]

    def delta_base(self) -> str | None:
        """What the engine holds to apply deltas to: ``instance/version`` of its last committed delta-mode
        update (asked afresh: a restart or another trainer's update changes it)."""
        base = self.get("/get_server_info", step="get_server_info").get("delta_base")
        return None if base is None else str(base)

    def delta_checks(self) -> DeltaChecks:
        reply = self.get("/weightstream/delta_checksums", step="delta_checksums")
        base = reply.get("delta_base")
        return DeltaChecks(str(reply["instance"]), None if base is None else str(base),
                           {int(k): tuple(str(d) for d in v) for k, v in reply["buckets"].items()})

    def receive_p2p_ahead(self, buckets: Sequence[Sequence[RankBucket]], timeout_s: float,
                          delta: bool = False) -> None:
        """What each engine rank receives in every per-rank bucket of this update, in order, before the first is
        sent; the engine receives them back to back and answers once all are loaded (or once one failed: it still
        receives the rest, so that the sends complete, and loads none of them). ``delta``: each rank's bucket comes
        as its delta header, then its payload."""
        self.post("/weightstream/update_weights_from_p2p_ahead", {
            "group_name": self.group_name, "weight_version": self._version, "weightstream_delta_mode": delta,
            "buckets": [[{"src": r.src, "metas": [_meta_json(m) for m in r.metas], "nbytes": r.nbytes,
                          **({} if r.rank is None else {"rank": r.rank})} for r in ranks] for ranks in buckets],
        }, step=f"update_weights_from_p2p_ahead ({len(buckets)} buckets)", timeout_s=timeout_s)

    def receive_p2p(self, index: int, ranks: Sequence[RankBucket]) -> None:
        """Metadata of what each engine rank receives by send/recv in this bucket."""
        self.post("/weightstream/update_weights_from_p2p", {
            "group_name": self.group_name, "weight_version": self._version,
            "ranks": [{"src": r.src, "metas": [_meta_json(m) for m in r.metas], "nbytes": r.nbytes,
                       "checksum": r.checksum,
                       "delta": None if r.delta is None else {**r.delta.as_json(), "index": index},
                       **({} if r.rank is None else {"rank": r.rank})} for r in ranks],
        }, step=f"update_weights_from_p2p (bucket {index})")

    def layout(self) -> EngineLayout:
        """How the engine holds each checkpoint tensor over its TP ranks (``/weightstream/layout``): the dim each
        split tensor is split on, and the one rank that holds each tensor one rank holds alone (its experts, where
        it runs expert parallelism; an engine that names none holds none so)."""
        reply = self.get("/weightstream/layout", step="layout")
        return EngineLayout(int(reply["tp_size"]), {str(k): int(v) for k, v in reply["dims"].items()},
                            {str(k): int(v) for k, v in (reply.get("owners") or {}).items()})

    def weight_checksums(self, names: Sequence[str]) -> list[dict[str, str]]:
        """Per engine rank, the checksum (:func:`~weightstream.wire.handles.checksum`) of the bytes it holds of each
        of ``names`` that it holds (``/weightstream/weight_checksums``; its part of a split tensor)."""
        reply = self.post("/weightstream/weight_checksums", {"names": list(names)}, step="weight_checksums")
        return [{str(k): str(v) for k, v in rank.items()} for rank in reply["ranks"]]

    def logits(self, input_ids: list[list[int]]):
        import base64

        import numpy as np
        import torch

        reply = self.post("/weightstream/logits", {"input_ids": input_ids}, step="logits")
        arr = np.frombuffer(base64.b64decode(reply["logits_b64"]), dtype=np.float32).reshape(reply["shape"])
        return torch.from_numpy(arr.copy())
