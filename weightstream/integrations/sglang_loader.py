"""weightstream's custom weight loader inside SGLang: what each TP rank's scheduler process runs when an
``/update_weights_from_tensor`` request names it as ``load_format``.

Start the server with ``--custom-weight-loader weightstream.integrations.sglang_loader.load_bucket`` (SGLang
calls a loader only where its server lists it) and give the trainer's adapter the same name
(``SGLangEngine(url, custom_loader=LOADER)``). SGLang hands :func:`load_bucket` the runner's model and this rank's
``[(header, tensor)]`` (:mod:`weightstream.engines.sglang_inside` says what the header holds). Each bucket's
checksum is verified before anything of it is loaded, a delta bucket is applied to the bytes this rank holds of
that bucket, and the tensors go into the model through its own ``load_weights`` (HF names; the model fuses and
cuts them for its TP rank).

For delta updates each process keeps, besides the bytes of each bucket it applied, its ``instance`` (named when
it starts: a restarted server names another) and ``version``, the committed update those bytes are (None: none,
and the trainer sends a full update): a session's ``commit`` names it where the session applied delta buckets
only, a bucket loaded whole drops the bytes held, and a session opened with no version held drops them too.
``state`` answers all three, with the checksum of each bucket's bytes the session applied.

SGLang ignores what a loader returns and ends the server when one raises, so :func:`load_bucket` raises nothing:
each step's outcome goes to the store the trainer hosts, named by the session's ``open``
(:class:`~weightstream.engines.sglang_inside.RankOutcome`), and the trainer turns any failure into the update's.
SGLang calls the loader once per model runner (the target, and a draft model where there is one) with the same
payload: the second call loads what the first received and decoded, without receiving or applying it again.

Nothing of SGLang is imported at module level, so ``import weightstream`` never needs SGLang.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from weightstream.engines.sglang_inside import (
    LOADER,
    HeaderError,
    LoaderHeader,
    RankDelta,
    RankOutcome,
    ReplyAddress,
    decode_header,
)
from weightstream.receiver.deltas import HeldDeltas, held_limit
from weightstream.receiver.programs import verify_checksum
from weightstream.streaming.bucket import view_tensor
from weightstream.wire.groups import tcp_store
from weightstream.wire.handles import checksum

__all__ = ["LOADER", "log", "SGLangModel", "Receiver", "load_bucket", "receiver"]

log = logging.getLogger("weightstream.sglang")

Named = list[tuple[str, torch.Tensor]]


class SGLangModel(Protocol):
    """What SGLang hands a custom loader: the runner's model, which loads unsharded HF-named tensors itself."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any: ...

    def parameters(self) -> Iterable[torch.nn.Parameter]: ...


@dataclass
class Receiver:
    """What this process keeps between calls: the open session (its name, this TP rank, the trainer's store),
    the bytes held for deltas (:class:`HeldDeltas`: with this process's ``instance`` and the committed ``version``
    they are), and the payload last received (its ``op_id`` and views) for the next runner's call."""

    session: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    reply: ReplyAddress | None = None
    store: Any = None  # the trainer's TCP store, connected once per session's address
    held: HeldDeltas = field(default_factory=HeldDeltas)  # bounded at its first delta
    last: tuple[str, Named] | None = None  # the op_id of the payload last received, and its tensors
    opened: set[str] = field(default_factory=set)  # sessions this process has answered ``open`` for
    answered: str = ""  # the op_id of the last ``state`` or ``commit`` answered (the next runner's call of it)

    @property
    def instance(self) -> str:
        """This process's name for delta updates (a restarted server names another)."""
        return self.held.instance

    def report(self, step: str, outcome: RankOutcome) -> None:
        """``outcome`` of ``step`` to the trainer's store (a process never opened only logs it)."""
        if self.store is None or self.reply is None:
            log.error("weightstream: no session is open, so this outcome reaches no trainer: %s", outcome.as_json())
            return
        self.store.set(f"{self.reply.prefix}/{self.session}/{step}/{self.tp_rank}", outcome.as_json())


_RECEIVER = Receiver()


def receiver() -> Receiver:
    """This process's :class:`Receiver`."""
    return _RECEIVER


def load_bucket(model: SGLangModel, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """SGLang's ``custom_loader(model, named_tensors)``: every entry's op, its outcome reported; raises nothing."""
    for name, tensor in named_tensors:
        try:
            _one(model, name, tensor)
        except Exception:  # an exception here would end SGLang's scheduler process
            log.exception("weightstream: the loader failed and could not report it")


def _one(model: SGLangModel, name: str, tensor: torch.Tensor) -> None:
    r = _RECEIVER
    try:
        header = decode_header(name)
    except (HeaderError, ValueError, TypeError) as exc:
        exc = exc if isinstance(exc, HeaderError) else HeaderError([f"{type(exc).__name__}: {exc}"])
        log.error("weightstream: %s", exc)
        if exc.index is not None:
            r.report(str(exc.index), RankOutcome(r.tp_rank, False, str(exc)))
        return
    if header.op == "open":
        _open(r, header)
        return
    if header.op in ("state", "commit"):
        _query(r, header)
        return
    try:
        outcome = _load(r, model, header, tensor)
    except Exception as exc:
        log.exception("weightstream: bucket %d not loaded", header.index)
        outcome = RankOutcome(r.tp_rank, False, f"{type(exc).__name__}: {exc}", nbytes=tensor.numel())
    r.report(str(header.index), outcome)


def _open(r: Receiver, header: LoaderHeader) -> None:
    """A session opens: the trainer's store (connected again where its address changed) and this rank."""
    if header.session in r.opened:
        return  # the next runner's call of the same payload
    reply = header.reply
    assert reply is not None  # decode_header gives every open a reply
    problem = _rank_problem(header.tp_rank)
    _connect(r, reply)
    r.session, r.tp_rank, r.tp_size, r.last = header.session, header.tp_rank, header.tp_size, None
    r.opened = {header.session}
    r.held.begin()  # bytes no committed update names are dropped: the trainer sends a full update
    r.report("open", RankOutcome(r.tp_rank, problem is None, problem))


def _connect(r: Receiver, reply: ReplyAddress) -> None:
    """The trainer's store at ``reply`` (connected again where its address changed)."""
    if r.reply is None or (r.reply.host, r.reply.port) != (reply.host, reply.port):
        r.store = tcp_store(reply.host, reply.port, is_master=False, timeout=reply.timeout_s)
    r.reply = reply


def _query(r: Receiver, header: LoaderHeader) -> None:
    """``state``: what this rank holds for deltas; ``commit``: the bytes the open session applied are kept as
    ``header.version``'s where it applied delta buckets only. Answered under the query's own name."""
    if header.op_id == r.answered:
        return  # the next runner's call of the same payload
    assert header.reply is not None  # decode_header gives every query a reply
    _connect(r, header.reply)
    r.answered = header.op_id
    problem = _rank_problem(header.tp_rank)
    delta = None
    if header.op == "commit" and problem is None:
        r.held.commit(header.version)
    elif header.op == "state":
        delta = RankDelta(r.held.instance, r.held.version, tuple(sorted(r.held.checksums().items())))
    key = f"{header.reply.prefix}/{header.session}/{header.op}/{header.tp_rank}"
    r.store.set(key, RankOutcome(header.tp_rank, problem is None, problem, delta=delta).as_json())


def _rank_problem(tp_rank: int) -> str | None:
    """Where SGLang publishes this process's TP rank, whether it is the one the payload was made for."""
    try:
        from sglang.srt.runtime_context import get_parallel

        own = int(get_parallel().tp_rank)
    except Exception:  # noqa: BLE001 -- not published (no server in this process): the payload's index stands
        return None
    return None if own == tp_rank else f"the payload for TP rank {tp_rank} reached TP rank {own}"


def _load(r: Receiver, model: SGLangModel, header: LoaderHeader, tensor: torch.Tensor) -> RankOutcome:
    if not r.session:
        raise RuntimeError("no session is open on this rank (the trainer sends 'open' first)")
    if r.last is not None and r.last[0] == header.op_id:
        named, raw = r.last[1], None  # the next runner: what the first call received, loaded again
    else:
        r.last = None
        raw = _new_bytes(r, model, header, tensor)
        named = [(m.name, view_tensor(raw, m)) for m in header.metas]
        r.last = (header.op_id, named)
    model.load_weights(named)
    total = header.delta.total if header.delta is not None else header.nbytes
    digest = checksum(raw.narrow(0, 0, total)) if raw is not None else None
    return RankOutcome(r.tp_rank, True, None, len(named), tensor.numel(), digest)


def _new_bytes(r: Receiver, model: SGLangModel, header: LoaderHeader, tensor: torch.Tensor) -> torch.Tensor:
    """The bucket's bytes, checked against the sender's checksum before anything is loaded: the buffer itself, or
    a delta's payload applied to the bytes held of the bucket. Any bucket sent whole drops the bytes held (the
    trainer sends the next delta against the weights it sent, which they no longer are)."""
    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or tensor.numel() != header.nbytes:
        raise ValueError(f"bucket {header.index}: the buffer is {tensor.dtype} {tuple(tensor.shape)}, the header "
                         f"says {header.nbytes} bytes of uint8")
    if header.delta is None:
        r.held.loaded_whole()  # whether or not this bucket loads, the trainer no longer sends against those bytes
        verify_checksum(tensor, header.checksum, f"bucket {header.index}",
                        lambda: f"; its tensors: {[m.name for m in header.metas][:10]}")
        return tensor
    if r.held.limit is None:
        r.held.limit = held_limit(model.parameters(), r.tp_size)
    received = tensor.clone() if header.delta.encoding == "dense" else tensor  # the trainer's memory: not kept
    return r.held.new_bytes(header.index, header.metas, header.delta.total, header.delta, received, header.checksum)

