"""The trainer's side of weightstream's custom weight loader inside SGLang
(:mod:`weightstream.integrations.sglang_loader`), and the header both sides read.

SGLang calls a custom weight loader only where its server was started with ``--custom-weight-loader`` naming it
(:data:`LOADER`) and an ``/update_weights_from_tensor`` request names it as ``load_format``. Its deserializer
allows plain data only, so each TP rank's payload is ``[(header, tensor)]``: the header travels in the tensor's
name, as :data:`PREFIX` followed by a JSON object (:class:`LoaderHeader`), and the tensor is the bucket's flat
``uint8`` buffer (an empty tensor for an ``open``). SGLang ignores what the loader returns and a loader that raises
ends the server, so every TP rank reports its outcome to a TCP store this trainer hosts (:class:`ReplyChannel`),
under ``PREFIX/session/step/rank``, and the trainer waits for every rank's report, bounded.

``open`` (one per update session, every payload made by trainer rank 0): the reply store's address, the
session's name and the TP rank each payload is for. ``load``: one bucket (its tensors' layout, the checksum
of the buffer's bytes, and for a delta bucket its header: the payload is applied to the bytes the rank holds of
that bucket). ``state`` and ``commit`` (delta updates, made by trainer rank 0 as ``open`` is, each under a
query name of its own in ``session``): each rank answers what it holds for deltas (:class:`RankDelta`), or
keeps the bytes the session applied as ``version``'s.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from weightstream.engines.base import DeltaChecks
from weightstream.models.spec import dtype_from_name, dtype_name
from weightstream.receiver.schema import (
    bucket_problems,
    delta_problems,
    duration_problem,
    int_lists,
    text_problem,
)
from weightstream.streaming.bucket import Bucket, TensorMeta
from weightstream.streaming.delta import DeltaHeader
from weightstream.wire.groups import tcp_store
from weightstream.wire.handles import checksum, dumps_b64

__all__ = [
    "LOADER", "HEADER_VERSION", "PREFIX", "OPS", "HeaderError", "ReplyAddress", "LoaderHeader", "decode_header",
    "payload", "bucket_payload", "RankDelta", "RankOutcome", "engine_delta", "failures", "ReplyChannel",
    "loader_problems", "LoaderClient", "QUERIES"
]

LOADER = "weightstream.integrations.sglang_loader.load_bucket"  # --custom-weight-loader and load_format
HEADER_VERSION = 1
PREFIX = f"weightstream/{HEADER_VERSION}:"
OPS = ("open", "load", "state", "commit")
QUERIES = ("open", "state", "commit")  # ops whose header names the reply store, a session and a TP rank
MAX_HEADER_CHARS = 1 << 24  # a bucket of some 100,000 tensors


class HeaderError(ValueError):
    """A header that cannot be read; ``index``: the bucket it names, where that much could be read."""

    def __init__(self, problems: Sequence[str], index: int | None = None):
        self.problems, self.index = tuple(problems), index
        super().__init__("bad weightstream header: " + "; ".join(problems))


@dataclass(frozen=True, slots=True)
class ReplyAddress:
    """The TCP store a trainer hosts for its ranks' outcomes: keys ``prefix/session/step/rank``."""

    host: str
    port: int
    prefix: str
    timeout_s: float


@dataclass(frozen=True, slots=True)
class LoaderHeader:
    """What one TP rank's payload says (``op_id``: a name of its own). ``open``: ``session``, ``tp_rank`` of
    ``tp_size``, ``reply``; ``state`` and ``commit`` as well (``session``: the query's name), ``commit`` with
    the ``version`` to keep the applied bytes as. ``load``: bucket ``index``, its tensors (``metas``, byte offsets
    in the buffer), the buffer's ``nbytes``, the ``checksum`` of its bytes (None: unchecked) and, a delta bucket,
    its ``delta`` header (the buffer is then the payload)."""

    op: str
    op_id: str = ""  # names this payload: a second call with it (another model runner) is not a new bucket
    session: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    reply: ReplyAddress | None = None
    index: int = 0
    metas: tuple[TensorMeta, ...] = ()
    nbytes: int = 0
    checksum: str | None = None
    delta: DeltaHeader | None = None
    version: str | None = None

    def encode(self) -> str:
        """The header as the tensor's name carries it."""
        body: dict[str, Any] = {"op": self.op, "op_id": self.op_id}
        if self.op in QUERIES:
            body.update(session=self.session, tp_rank=self.tp_rank, tp_size=self.tp_size,
                        reply=_reply_json(self.reply))
            if self.op == "commit":
                body["version"] = self.version
        else:
            body.update(index=self.index, names=[m.name for m in self.metas],
                        dtypes=[dtype_name(m.dtype) for m in self.metas], shapes=[list(m.shape) for m in self.metas],
                        offsets=[m.offset for m in self.metas], nbytes=self.nbytes, checksum=self.checksum,
                        delta=None if self.delta is None else {**self.delta.as_json(), "index": self.index})
        return PREFIX + json.dumps(body, separators=(",", ":"))


def _reply_json(reply: ReplyAddress | None) -> dict[str, Any] | None:
    if reply is None:
        return None
    return {"host": reply.host, "port": reply.port, "prefix": reply.prefix, "timeout_s": reply.timeout_s}


def payload(header: LoaderHeader, tensor: torch.Tensor) -> str:
    """One TP rank's entry of ``serialized_named_tensors``: ``[(header, tensor)]`` pickled for SGLang's
    deserializer (a CUDA tensor as an IPC handle, a CPU tensor as named shared memory)."""
    return dumps_b64([(header.encode(), tensor)])


# -- reading a header: one error listing every problem ----------------------------------------------------

def decode_header(name: Any) -> LoaderHeader:
    """The header a tensor's name carries; raises :class:`HeaderError` listing every problem."""
    if not isinstance(name, str) or not name.startswith("weightstream/"):
        raise HeaderError([f"the tensor's name does not start with {PREFIX!r}: {str(name)[:60]!r}"])
    if not name.startswith(PREFIX):
        raise HeaderError([f"header version {name.split(':', 1)[0][len('weightstream/'):]!r} is not this "
                           f"loader's ({HEADER_VERSION}): trainer and engine run different weightstream versions"])
    if len(name) > MAX_HEADER_CHARS:
        raise HeaderError([f"the header has {len(name)} characters, more than {MAX_HEADER_CHARS}"])
    try:
        body = json.loads(name[len(PREFIX):])
    except ValueError as exc:
        raise HeaderError([f"the header is not JSON ({exc})"]) from None
    if not isinstance(body, dict):
        raise HeaderError(["the header must be a JSON object"])
    if body.get("op") in QUERIES:
        return _decode_query(body)
    if body.get("op") == "load":
        return _decode_load(body)
    raise HeaderError([f"op must be one of {list(OPS)}, got {str(body.get('op'))[:40]!r}"])


def _session_problems(session: Any) -> list[str]:
    if not isinstance(session, str) or not session:
        return ["session must be a non-empty string"]
    problem = text_problem("session", session)
    return [problem] if problem else []


def _op_id_problems(op_id: Any) -> list[str]:
    if not isinstance(op_id, str) or not op_id:
        return ["op_id must be a non-empty string"]
    problem = text_problem("op_id", op_id)
    return [problem] if problem else []


def _decode_query(body: dict[str, Any]) -> LoaderHeader:
    problems = _session_problems(body.get("session")) + _op_id_problems(body.get("op_id"))
    version = body.get("version")
    if body["op"] == "commit" and (not isinstance(version, str) or not version or text_problem("version", version)):
        problems.append("a commit's version must be non-empty printable text")
    if not int_lists(body.get("tp_rank"), 0) or not int_lists(body.get("tp_size"), 0) \
            or not body["tp_rank"] < body["tp_size"]:
        problems.append("tp_rank and tp_size must be integers, 0 <= tp_rank < tp_size")
    reply = body.get("reply")
    if not isinstance(reply, dict):
        raise HeaderError([*problems, "reply must be an object (host, port, prefix, timeout_s)"])
    if not isinstance(reply.get("host"), str) or not reply["host"]:
        problems.append("reply.host must be a non-empty string")
    if not int_lists(reply.get("port"), 0) or not 0 < reply["port"] < 65536:
        problems.append("reply.port must be a port number")
    if not isinstance(reply.get("prefix"), str) or text_problem("reply.prefix", reply["prefix"]):
        problems.append("reply.prefix must be printable text")
    timeout = reply.get("timeout_s")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool):
        problems.append("reply.timeout_s must be seconds")
    elif duration_problem("reply.timeout_s", timeout):
        problems.append(str(duration_problem("reply.timeout_s", timeout)))
    if problems:
        raise HeaderError(problems)
    return LoaderHeader(body["op"], op_id=body["op_id"], session=body["session"], tp_rank=body["tp_rank"],
                        tp_size=body["tp_size"],
                        reply=ReplyAddress(reply["host"], reply["port"], reply["prefix"], float(reply["timeout_s"])),
                        version=version if body["op"] == "commit" else None)


def _decode_load(body: dict[str, Any]) -> LoaderHeader:
    index = body.get("index") if int_lists(body.get("index"), 0) else None
    problems = [] if index is not None else ["index must be a non-negative integer"]
    problems += _op_id_problems(body.get("op_id"))
    problems += bucket_problems(body)
    if not int_lists(body.get("offsets"), 1) or len(body["offsets"]) != len(body.get("names") or []):
        problems.append("offsets must be one non-negative integer per tensor")
    if not int_lists(body.get("nbytes"), 0):
        problems.append("nbytes must be a non-negative integer")
    if body.get("checksum") is not None and not isinstance(body["checksum"], str):
        problems.append("checksum must be a string or null")
    problems += delta_problems(body.get("delta"))
    if problems:
        raise HeaderError(problems, index)
    metas = _metas(body)
    delta = None
    if body["delta"] is not None:
        delta = _delta(body["delta"], body["nbytes"], body["index"])
    return LoaderHeader("load", op_id=body["op_id"], index=body["index"], metas=tuple(metas), nbytes=body["nbytes"],
                        checksum=body["checksum"], delta=delta)


def _metas(body: dict[str, Any]) -> list[TensorMeta]:
    """The tensors at their offsets; each must lie whole in the buffer (its decoded bytes, a delta bucket) and
    start at a multiple of its element size."""
    metas = [TensorMeta(name, dtype_from_name(dt), tuple(shape), off)
             for name, dt, shape, off in zip(body["names"], body["dtypes"], body["shapes"], body["offsets"],
                                             strict=True)]
    total = body["delta"]["total"] if body.get("delta") else body["nbytes"]
    problems = [f"{m.name}: bytes [{m.offset}, {m.offset + m.nbytes}) lie outside the bucket's {total}"
                for m in metas if m.offset + m.nbytes > total]
    problems += [f"{m.name}: starts at byte {m.offset}, not a multiple of its {m.dtype} size"
                 for m in metas if m.offset % m.dtype.itemsize]
    if problems:
        raise HeaderError(problems[:20], body["index"])
    return metas


def _delta(d: dict[str, Any], nbytes: int, index: int) -> DeltaHeader:
    problems = [] if d["index"] == index else [f"delta.index {d['index']} is not the bucket's {index}"]
    if d["nbytes"] != nbytes:
        problems.append(f"delta.nbytes {d['nbytes']} is not the payload's {nbytes} bytes")
    try:
        header, _ = DeltaHeader.from_request(d, int(d["total"]), nbytes)
    except ValueError as exc:
        problems.append(str(exc))
    if problems:
        raise HeaderError(problems, index)
    return header


# -- the trainer's side -------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RankDelta:
    """What one TP rank holds for delta updates (its answer to ``state``): ``instance`` names the process (a
    restarted server names another), ``version`` the committed update whose bucket bytes it keeps (None: none),
    ``buckets`` the checksum of each bucket's bytes the open (or last) session applied."""

    instance: str
    version: str | None
    buckets: tuple[tuple[int, str], ...] = ()

    def as_json(self) -> dict[str, Any]:
        return {"instance": self.instance, "version": self.version, "buckets": {str(i): d for i, d in self.buckets}}

    @classmethod
    def from_json(cls, d: Any) -> RankDelta:
        """Raises ``ValueError`` for an answer that is not one."""
        if not (isinstance(d, dict) and isinstance(d.get("instance"), str) and isinstance(d.get("version"), str | None)
                and isinstance(d.get("buckets"), dict)
                and all(isinstance(v, str) for v in d["buckets"].values())):
            raise ValueError(f"not a delta state: {str(d)[:200]}")
        return cls(d["instance"], d["version"], tuple(sorted((int(k), v) for k, v in d["buckets"].items())))


@dataclass(frozen=True, slots=True)
class RankOutcome:
    """What one TP rank reported of a step: ``ok``, the error (None where ok), the tensors loaded, the bytes
    received and the checksum of the bytes loaded (a delta bucket: the bytes it applied); a ``state``: what the
    rank holds for deltas."""

    rank: int
    ok: bool
    error: str | None = None
    loaded: int = 0
    nbytes: int = 0
    digest: str | None = None
    delta: RankDelta | None = None

    def as_json(self) -> str:
        return json.dumps({"rank": self.rank, "ok": self.ok, "error": self.error, "loaded": self.loaded,
                           "nbytes": self.nbytes, "digest": self.digest,
                           "delta": None if self.delta is None else self.delta.as_json()})

    @classmethod
    def from_json(cls, rank: int, text: bytes) -> RankOutcome:
        try:
            d = json.loads(text)
            delta = None if d.get("delta") is None else RankDelta.from_json(d["delta"])
            return cls(rank, d["ok"] is True, d.get("error"), int(d.get("loaded") or 0), int(d.get("nbytes") or 0),
                       d.get("digest"), delta)
        except (ValueError, TypeError, KeyError) as exc:
            return cls(rank, False, f"unreadable report {text[:80]!r} ({exc})")


def engine_delta(ranks: Sequence[RankDelta]) -> DeltaChecks:
    """The engine's :class:`DeltaChecks` from its TP ranks': its instance names every rank's (a restart of any
    changes it), its base is ``instance/version`` where every rank keeps the same committed version, and each
    bucket's checksums are per rank ("" where a rank applied none of it)."""
    return DeltaChecks.of_ranks([(r.instance, r.version, dict(r.buckets)) for r in ranks])


def loader_problems(server_info: dict, loader: str) -> list[str]:
    """Why an SGLang server (its ``/get_server_info`` reply) cannot take updates through ``loader``."""
    problems = []
    listed = server_info.get("custom_weight_loader") or []
    if loader not in listed:
        problems.append(f"the server was not started with --custom-weight-loader {loader} (it lists {listed}): "
                        "SGLang would refuse the request by ending its scheduler")
    for size in ("dp_size", "pp_size"):
        if int(server_info.get(size, 1) or 1) != 1:
            problems.append(f"{size} {server_info[size]}: the custom loader reports per TP rank (run it at 1)")
    return problems


class ReplyChannel:
    """The TCP store this trainer (rank 0) hosts on ``host`` for the ranks' outcomes, and the session it names."""

    def __init__(self, host: str = "127.0.0.1", timeout_s: float = 60.0):
        self.timeout_s = timeout_s
        self.store = tcp_store(host, 0, is_master=True, timeout=timeout_s)
        self.address = ReplyAddress(host, int(self.store.port), f"ws-{uuid.uuid4().hex[:12]}", timeout_s)
        self.session = ""

    def open_headers(self, tp_size: int) -> list[LoaderHeader]:
        """A new session's ``open`` header for each TP rank."""
        self.session = uuid.uuid4().hex[:16]
        return self.query_headers("open", self.session, tp_size)

    def query_headers(self, op: str, session: str, tp_size: int, version: str | None = None) -> list[LoaderHeader]:
        """``op``'s header (``open``, ``state``, ``commit``) for each TP rank, answered under ``session``."""
        return [LoaderHeader(op, op_id=uuid.uuid4().hex, session=session, tp_rank=r, tp_size=tp_size,
                             reply=self.address, version=version) for r in range(tp_size)]

    def open_payloads(self, tp_size: int) -> list[str]:
        """A new session's ``open`` payload for each TP rank (all of them made here, around an empty tensor)."""
        empty = torch.empty(0, dtype=torch.uint8)
        return [payload(h, empty) for h in self.open_headers(tp_size)]

    def outcomes(self, step: str, tp_size: int, wait_s: float | None = None,
                 session: str | None = None) -> list[RankOutcome]:
        """Every rank's report of ``step`` (``open``, a bucket index, ``state``, ``commit``) in ``session`` (None:
        the open one), each taken off the store; a rank that did not report within ``wait_s`` is a failure that
        says so."""
        keys = [f"{self.address.prefix}/{session or self.session}/{step}/{r}" for r in range(tp_size)]
        try:
            self.store.wait(keys, timedelta(seconds=wait_s or self.timeout_s))
        except RuntimeError:
            pass  # the missing ones are named below
        found = [r for r, k in enumerate(keys) if self.store.check([k])]
        out = [RankOutcome.from_json(r, self.store.get(keys[r])) if r in found else
               RankOutcome(r, False, f"no report within {wait_s or self.timeout_s:g} s") for r in range(tp_size)]
        for r in found:
            self.store.delete_key(keys[r])
        return out


def failures(outcomes: Sequence[RankOutcome]) -> str | None:
    """One line naming every rank that failed and why (None: none did)."""
    bad = [o for o in outcomes if not o.ok]
    if not bad:
        return None
    return (f"{len(bad)} of {len(outcomes)} TP ranks failed: "
            + "; ".join(f"rank {o.rank}: {o.error}" for o in bad))



def bucket_payload(bucket: Bucket, checked: bool = True) -> str:
    """This trainer rank's bucket as the loader's payload (made on every colocated rank); ``checked``: with the
    checksum of its buffer's bytes, which each rank verifies before it loads anything."""
    header = LoaderHeader("load", op_id=uuid.uuid4().hex, index=bucket.index, metas=bucket.metas, nbytes=bucket.nbytes,
                          checksum=checksum(bucket.buffer) if checked else None, delta=bucket.delta)
    return payload(header, bucket.buffer)



class LoaderClient:
    """An SGLang adapter's use of the custom loader (``SGLangEngine(url, custom_loader=LOADER)``): the request
    bodies of ``/update_weights_from_tensor`` that name it, and the ranks' outcomes read back (rank 0)."""

    def __init__(self, loader: str, timeout_s: float):
        if loader != LOADER:
            raise ValueError(f"custom_loader {loader!r}: weightstream's SGLang loader is {LOADER!r} (start the "
                             "server with --custom-weight-loader naming it)")
        self.loader, self.timeout_s = loader, timeout_s
        self.channel: ReplyChannel | None = None  # hosted by rank 0 from its first session on

    def open_body(self, server_info: dict, version: str | None) -> dict[str, Any]:
        """The request that opens a session on every TP rank; raises ``ValueError`` where the server cannot take
        it (:func:`loader_problems`)."""
        problems = loader_problems(server_info, self.loader)
        if problems:
            raise ValueError("; ".join(problems))
        if self.channel is None:
            self.channel = ReplyChannel(timeout_s=self.timeout_s)
        return self.body(self.channel.open_payloads(int(server_info.get("tp_size", 1))), version)

    def body(self, payloads: Sequence[str], version: str | None) -> dict[str, Any]:
        """``/update_weights_from_tensor`` naming the loader (SGLang's own fields only)."""
        return {"serialized_named_tensors": list(payloads), "load_format": self.loader, "flush_cache": False,
                "weight_version": version}

    def query(self, op: str, tp_size: int, version: str | None = None) -> tuple[dict[str, Any], str]:
        """The request of ``op`` (``state`` or ``commit`` as ``version``) to every TP rank's loader, and the query's
        name its answers come under (:meth:`answers`)."""
        if self.channel is None:
            self.channel = ReplyChannel(timeout_s=self.timeout_s)
        name = uuid.uuid4().hex[:16]
        empty = torch.empty(0, dtype=torch.uint8)
        headers = self.channel.query_headers(op, name, tp_size, version)
        return self.body([payload(h, empty) for h in headers], None), name

    def answers(self, op: str, name: str, tp_size: int) -> list[RankOutcome]:
        """Every rank's answer to query ``name`` (:meth:`query`)."""
        assert self.channel is not None  # made by query
        return self.channel.outcomes(op, tp_size, session=name)

    def problem(self, step: str, tp_size: int) -> str | None:
        """What went wrong on any rank in ``step`` (``open`` or a bucket index), read from the store (None: every
        rank reported success)."""
        if self.channel is None:
            return "no session was opened through the loader"
        return failures(self.channel.outcomes(step, tp_size))
