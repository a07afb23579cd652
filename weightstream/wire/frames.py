"""The frames of the IPC control channel (:mod:`weightstream.wire.channel`), declared: every message either
end sends is one of the frozen dataclasses below, and both ends build and read them only through these types.

On the wire a frame is one JSON object: ``{"v": PROTOCOL_VERSION, "kind": KIND, <its fields>}``. Every frame
carries the version; every field is always written (``null`` for an absent optional one); nested records
(:class:`BucketLayout`, :class:`LentBuffer`, :class:`ExportedWeights`) are objects of their fields; tuples are
lists. :func:`decode` takes nothing else: an unknown kind, a missing field, a field of the wrong type, a field
no frame of that kind has and another version each raise one :class:`FrameError` that names the frame's kind
and lists every problem found. docs/engines.md ("The IPC control channel") says in which order they go.
"""

from __future__ import annotations

import functools
import operator
import types
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from typing import Annotated, Any, ClassVar, TypeVar, Union, get_args, get_origin, get_type_hints

from weightstream.errors import WeightstreamError

__all__ = [
    "PROTOCOL_VERSION", "Natural", "FrameError", "Frame", "BucketLayout", "LentBuffer", "ExportedWeights",
    "DeltaRecord", "Hello", "Offer", "Export", "Ready", "BucketLoaded", "WritesApplied", "BuffersHeld", "Plan",
    "OfferAnswer", "KeptBuffers", "BucketSent", "WritesDone", "Finish", "Error", "Descriptors", "FRAMES", "F",
    "expect", "encode", "decode"
]


# 2: BucketSent.delta; 3: ExportedWeights.flag, WritesDone.checked; 4: Finish, OfferAnswer ahead; 5: OfferAnswer first
PROTOCOL_VERSION = 5

_ENVELOPE = ("v", "kind")
_SHOWN = 3  # problems shown per list field (then how many more)


class _NonNegative:
    """Marks an integer field that may not be negative (a size, an offset, an index, a count)."""


Natural = Annotated[int, _NonNegative]


class FrameError(WeightstreamError, ValueError):
    """A control frame that is not one of this protocol's: the kind it named (``None`` where it named none)
    and every problem found."""

    def __init__(self, kind: str | None, problems: list[str]):
        self.kind, self.problems = kind, list(problems)
        what = f"control frame {kind!r}" if kind is not None else "control frame"
        super().__init__(f"bad {what}: " + "; ".join(self.problems))

    def __reduce__(self):
        return (type(self), (self.kind, self.problems))


class _Checked:
    """What its fields' types cannot say (lengths that must agree, fields that exclude each other)."""

    __slots__ = ()

    def problems(self) -> list[str]:
        return []


class Frame(_Checked):
    """One message of the control channel; ``kind`` names it on the wire."""

    __slots__ = ()
    kind: ClassVar[str]


# -- records inside frames ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BucketLayout(_Checked):
    """Where each tensor of one bucket lies in the bucket's flat buffer: per tensor (in one order) its HF name,
    its dtype's name (``bfloat16``), its shape and its first byte."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[Natural, ...], ...]
    offsets: tuple[Natural, ...]

    def problems(self) -> list[str]:
        lengths = (len(self.names), len(self.dtypes), len(self.shapes), len(self.offsets))
        if len(set(lengths)) > 1:
            return [f"names, dtypes, shapes and offsets differ in length ({', '.join(map(str, lengths))})"]
        return []


@dataclass(frozen=True, slots=True)
class LentBuffer(_Checked):
    """A buffer of the trainer, named by ``id`` (the trainer's numbering). With ``payload`` (a GPU): its CUDA
    IPC handle, pickled, base64; with ``fd_bytes`` (the CPU): the size of the shared-memory file whose
    descriptor comes with the frame (in the order the frame names them); with neither: a buffer the engine
    holds already."""

    id: Natural
    payload: str | None = None
    fd_bytes: Natural | None = None

    def problems(self) -> list[str]:
        if self.payload is not None and self.fd_bytes is not None:
            return [f"buffer {self.id} is named by a payload and by a descriptor: one of them"]
        return []

    @property
    def lent(self) -> bool:
        """It comes with this frame (a handle or a descriptor), not held already."""
        return self.payload is not None or self.fd_bytes is not None


@dataclass(frozen=True, slots=True)
class ExportedWeights(_Checked):
    """The engine's weights a trainer may write into: their storages, and per tensor (HF name) its place in
    them (storage index, byte offset, elements, dtype name). The storages are, on the CPU, files whose sizes
    are ``sizes`` (one descriptor each comes with the frame, in order); on a GPU ``payload``, their CUDA IPC
    handles (a pickled list, base64). ``flag``: the storage (one int32, on a GPU) a trainer whose copies check what
    they write raises where a value is one the engine checks for (:class:`WritesDone` ``checked``)."""

    names: tuple[str, ...]
    storages: tuple[Natural, ...]
    offsets: tuple[Natural, ...]
    numels: tuple[Natural, ...]
    dtypes: tuple[str, ...]
    sizes: tuple[Natural, ...] | None
    payload: str | None
    flag: Natural | None = None

    def problems(self) -> list[str]:
        out = []
        lengths = (len(self.names), len(self.storages), len(self.offsets), len(self.numels), len(self.dtypes))
        if len(set(lengths)) > 1:
            out.append(f"names, storages, offsets, numels and dtypes differ in length "
                       f"({', '.join(map(str, lengths))})")
        if (self.sizes is None) == (self.payload is None):
            out.append("the storages come as sizes (descriptors) or as a payload (handles): exactly one")
        count = len(self.sizes) if self.sizes is not None else None
        if count is not None and any(s >= count for s in self.storages):
            out.append(f"a tensor is placed in a storage past the {count} exported")
        if self.flag is not None and (self.sizes is not None or self.flag in self.storages):
            out.append(f"the flag (storage {self.flag}) is a storage of its own, among the handles (a GPU's export)")
        return out


@dataclass(frozen=True, slots=True)
class DeltaRecord(_Checked):
    """How a bucket of a delta-mode update is encoded (:class:`~weightstream.streaming.delta.DeltaHeader`):
    bucket ``index`` of the plan, ``total`` bytes compared in words of ``word`` bytes, of which ``count``
    changed, sent in ``nbytes`` bytes as ``encoding`` (``dense``, ``indices`` or ``bitmap``)."""

    index: Natural
    encoding: str
    word: Natural
    total: Natural
    count: Natural
    nbytes: Natural

    def problems(self) -> list[str]:
        out = []
        if self.encoding not in ("dense", "indices", "bitmap"):
            out.append(f"delta encoding {self.encoding[:40]!r} is not one of dense, indices, bitmap")
        if self.word not in (1, 2, 4) or self.total % max(self.word, 1):
            out.append(f"delta word {self.word} must be 1, 2 or 4 and divide the bucket's {self.total} bytes")
        elif self.count > self.total // self.word:
            out.append(f"delta count {self.count} exceeds the bucket's {self.total // self.word} words")
        return out


# -- the engine's frames --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello(Frame):
    """The engine rank's first frame, once it has connected: its rank, the client it takes this trainer for,
    the ids of that client's buffers it holds still, and whether it knows the update's plan already."""

    kind: ClassVar[str] = "hello"
    rank: Natural
    client: str
    have: tuple[Natural, ...]
    plan_known: bool


@dataclass(frozen=True, slots=True)
class Offer(Frame):
    """Whether the engine rank can take the plan as writes straight into its weights."""

    kind: ClassVar[str] = "offer"
    direct: bool


@dataclass(frozen=True, slots=True)
class Export(Frame):
    """The export of the engine's weights the trainer writes into: its id, and the weights themselves unless
    the trainer said it holds that export (``weights`` null)."""

    kind: ClassVar[str] = "export"
    id: str
    weights: ExportedWeights | None


@dataclass(frozen=True, slots=True)
class Ready(Frame):
    """What the trainer overwrites is backed up (on a GPU: the engine recorded the trainer's "ready" event):
    the writes may start."""

    kind: ClassVar[str] = "ready"


@dataclass(frozen=True, slots=True)
class BucketLoaded(Frame):
    """Bucket ``k``'s copies are made (on a GPU: queued, the engine's "done" event recorded): its buffer may
    be packed again."""

    kind: ClassVar[str] = "bucket_loaded"
    k: Natural


@dataclass(frozen=True, slots=True)
class WritesApplied(Frame):
    """The trainer's writes are in the engine's weights (its device finished them): ``tensors`` of them."""

    kind: ClassVar[str] = "writes_applied"
    tensors: Natural


@dataclass(frozen=True, slots=True)
class BuffersHeld(Frame):
    """The answer to :class:`KeptBuffers`: the engine maps them (and made the copies out of them); it holds
    ``held`` buffers of this trainer."""

    kind: ClassVar[str] = "buffers_held"
    held: Natural


# -- the trainer's frames -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan(Frame):
    """Every bucket's layout, in order: sent once per plan, when the engine's greeting says it does not know it."""

    kind: ClassVar[str] = "plan"
    buckets: tuple[BucketLayout, ...]


@dataclass(frozen=True, slots=True)
class OfferAnswer(Frame):
    """Whether the trainer writes into the engine's weights where the engine offers them (sent without waiting for
    the :class:`Offer`: both write only where both say so); the export of them it holds (``have``), and on a GPU its
    four interprocess CUDA events (handles, base64: ready 0, ready 1, done 0, done 1)."""

    kind: ClassVar[str] = "offer_answer"
    direct: bool
    have: str | None
    events: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class KeptBuffers(Frame):
    """Before the first update (or, with no buffers, to announce this trainer): the buffers the engine keeps
    mapped for it, the buffer each bucket arrives in (bucket k in ``slots[k % len(slots)]``) and ids of
    buffers the engine may close."""

    kind: ClassVar[str] = "kept_buffers"
    buffers: tuple[LentBuffer, ...]
    slots: tuple[Natural, ...]
    drop: tuple[Natural, ...]


@dataclass(frozen=True, slots=True)
class BucketSent(Frame):
    """Bucket ``k`` lies in ``buffer``, ``nbytes`` from byte ``offset``. ``keep``: the engine keeps that buffer
    mapped (named by its id from then on); ``drop``: kept buffers it may close; ``checksum``: the bucket's
    digest where the trainer asks for it to be checked (of the payload, in a delta-mode update); ``events``
    (bucket 0 on a GPU): the trainer's four interprocess CUDA events. ``delta`` (every bucket of a delta-mode
    update): the buffer holds the bucket's payload, encoded as it says, to apply to the bytes the engine
    holds of that bucket."""

    kind: ClassVar[str] = "bucket"
    k: Natural
    buffer: LentBuffer
    offset: Natural
    nbytes: Natural
    keep: bool
    drop: tuple[Natural, ...] = ()
    checksum: str | None = None
    events: tuple[str, ...] = ()
    delta: DeltaRecord | None = None

    def problems(self) -> list[str]:
        if self.delta is not None and self.delta.nbytes > self.nbytes:
            return [f"the delta's {self.delta.nbytes} bytes exceed the {self.nbytes} sent"]
        return []


@dataclass(frozen=True, slots=True)
class WritesDone(Frame):
    """Every tensor is written into the engine's weights (on a GPU: queued, and the trainer's event recorded).
    ``checked``: the trainer's copies looked at every value they wrote and raised the export's ``flag`` where one is
    NaN, an infinity or a block-FP8 scale out of range; the engine then reads the flag instead of its weights."""

    kind: ClassVar[str] = "writes_done"
    checked: bool = False


@dataclass(frozen=True, slots=True)
class Finish(Frame):
    """The trainer rank's last frame of an update whose request asked the engine to commit it (``ipc_session``),
    after its last bucket or its :class:`WritesDone`: whether it lets the engine commit (False: what it sent is not
    to be served, e.g. its stream's plan turned out stale; the trainer aborts the session)."""

    kind: ClassVar[str] = "finish"
    commit: bool


# -- either end's ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Error(Frame):
    """This end gives the update up: why, and the bucket it was at (if any). Nothing is sent after it; the
    other end raises it and ends its part of the update (the engine's session is then rolled back)."""

    kind: ClassVar[str] = "error"
    message: str
    bucket: Natural | None = None


@dataclass(frozen=True, slots=True)
class Descriptors(Frame):
    """The channel's own: ``count`` descriptors came with this frame, for the frame after it (a frame's
    descriptors go in chunks, each with one of these: the kernel passes at most 253 per message)."""

    kind: ClassVar[str] = "fds"
    count: Natural


FRAMES: dict[str, type[Frame]] = {cls.kind: cls for cls in (
    Hello, Offer, Export, Ready, BucketLoaded, WritesApplied, BuffersHeld,
    Plan, OfferAnswer, KeptBuffers, BucketSent, WritesDone, Finish,
    Error, Descriptors,
)}

F = TypeVar("F", bound=Frame)


def expect(frame: Frame, kind: type[F], what: str) -> F:
    """``frame`` as ``kind``; another kind raises :class:`FrameError` saying what was expected (an
    :class:`Error` frame is the caller's to handle first)."""
    if isinstance(frame, kind):
        return frame
    raise FrameError(frame.kind, [f"{what}: expected a {kind.kind!r} frame"])


# -- encoding -------------------------------------------------------------------------------------------

_Encode = Callable[[Any], Any]
# value, where it is (for messages), the problems found so far -> the value as its declared type
_Decode = Callable[[Any, str, list[str]], Any]


def encode(frame: Frame) -> dict[str, Any]:
    """``frame`` as the JSON object the channel sends."""
    return {"v": PROTOCOL_VERSION, "kind": frame.kind, **_record_encoder(type(frame))(frame)}


def _is_record(tp: Any) -> bool:
    return isinstance(tp, type) and is_dataclass(tp) and issubclass(tp, _Checked)


def _hints(cls: type) -> dict[str, Any]:
    """The declared type of each field of ``cls``, in order."""
    hints = get_type_hints(cls, include_extras=True)
    return {f.name: hints[f.name] for f in fields(cls)}


_RECORD_ENCODERS: dict[type, Callable[[Any], dict[str, Any]]] = {}
_RECORD_DECODERS: dict[type, _Decode] = {}


def _record_encoder(cls: type) -> Callable[[Any], dict[str, Any]]:
    """A record's fields as a dict (nested records as dicts): its declared fields, read in one go."""
    made = _RECORD_ENCODERS.get(cls)
    if made is None:
        made = _RECORD_ENCODERS[cls] = _make_record_encoder(cls)
    return made


def _make_record_encoder(cls: type) -> Callable[[Any], dict[str, Any]]:
    names = tuple(_hints(cls))
    encoders = tuple(_encoder(tp) for tp in _hints(cls).values())
    if not names:
        return lambda _: {}
    read = operator.attrgetter(*names)
    if len(names) == 1:
        return lambda obj: {names[0]: encoders[0](read(obj))}
    return lambda obj: {n: enc(v) for n, enc, v in zip(names, encoders, read(obj), strict=True)}


def _identity(value: Any) -> Any:
    return value


@functools.cache
def _encoder(tp: Any) -> _Encode:
    """How a value of type ``tp`` goes into JSON: as it is, unless records are inside."""
    tp = _strip(tp)
    if _is_record(tp):
        return _record_encoder(tp)
    args = get_args(tp)
    if _is_union(tp):
        inner = [_encoder(a) for a in args if a is not type(None)]
        if all(e is _identity for e in inner):
            return _identity
        (one,) = inner
        return lambda v: None if v is None else one(v)
    if get_origin(tp) is tuple:
        items = [_encoder(a) for a in args if a is not Ellipsis]
        if all(e is _identity for e in items):
            return _identity
        (item,) = items
        return lambda v: [item(x) for x in v]
    return _identity


# -- decoding -------------------------------------------------------------------------------------------

def decode(raw: Any) -> Frame:
    """The frame a JSON object (as the channel received it) is; :class:`FrameError` naming every problem."""
    if not isinstance(raw, dict):
        raise FrameError(None, [f"a frame is a JSON object, got {_json_type(raw)}"])
    problems: list[str] = []
    version = raw.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        problems.append(f"protocol version {version!r}: this end speaks version {PROTOCOL_VERSION} "
                        "(both ends must run the same weightstream)")
    kind = raw.get("kind")
    cls = FRAMES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        problems.append(f"unknown kind {_shown(kind)} (known: {', '.join(sorted(FRAMES))})")
        raise FrameError(kind if isinstance(kind, str) else None, problems)
    frame = _record_decoder(cls)(raw, "", problems)
    if problems:
        raise FrameError(cls.kind, problems)
    return frame


def _record_decoder(cls: type) -> _Decode:
    made = _RECORD_DECODERS.get(cls)
    if made is None:
        made = _RECORD_DECODERS[cls] = _make_record_decoder(cls)
    return made


def _make_record_decoder(cls: type) -> _Decode:
    decoders = {name: _decoder(tp) for name, tp in _hints(cls).items()}
    known = set(decoders) | (set(_ENVELOPE) if issubclass(cls, Frame) else set())

    def decode_record(value: Any, where: str, problems: list[str]) -> Any:
        if not isinstance(value, dict):
            problems.append(f"field {where!r} must be an object, got {_json_type(value)}")
            return None
        before = len(problems)
        values = {}
        for name, dec in decoders.items():
            path = f"{where}.{name}" if where else name
            if name in value:
                values[name] = dec(value[name], path, problems)
            else:
                problems.append(f"missing field {path!r}")
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            problems.append(f"unknown fields {unknown}" + (f" in {where!r}" if where else ""))
        if len(problems) > before:
            return None
        record = cls(**values)
        problems.extend(f"{where!r}: {p}" if where else p for p in record.problems())
        return record

    return decode_record


def _strip(tp: Any) -> Any:
    return get_args(tp)[0] if get_origin(tp) is Annotated else tp


def _is_union(tp: Any) -> bool:
    return isinstance(tp, types.UnionType) or get_origin(tp) is Union


@functools.cache
def _decoder(tp: Any) -> _Decode:
    natural = get_origin(tp) is Annotated and _NonNegative in get_args(tp)[1:]
    tp = _strip(tp)
    if _is_record(tp):
        return _record_decoder(tp)
    if _is_union(tp):
        return _optional(tp)
    if get_origin(tp) is tuple:
        return _tuple_decoder(tp)
    if tp is int:
        return _natural if natural else _scalar(int, "an integer")
    if tp is bool:
        return _scalar(bool, "true or false")
    if tp is str:
        return _scalar(str, "a string")
    raise TypeError(f"a frame field of type {tp!r}: not one the protocol declares")


def _scalar(tp: type, described: str) -> _Decode:
    def decode_scalar(value: Any, where: str, problems: list[str]) -> Any:
        if type(value) is not tp:  # bool is not an int here, nor an int a bool
            problems.append(f"field {where!r} must be {described}, got {_json_type(value)}")
        return value

    return decode_scalar


def _natural(value: Any, where: str, problems: list[str]) -> Any:
    if type(value) is not int or value < 0:
        got = _shown(value) if type(value) is int else _json_type(value)
        problems.append(f"field {where!r} must be a non-negative integer, got {got}")
    return value


def _optional(tp: Any) -> _Decode:
    args = [a for a in get_args(tp) if a is not type(None)]
    if len(args) != 1 or len(get_args(tp)) != 2:
        raise TypeError(f"a frame field of type {tp!r}: only 'X | None' unions are declared")
    inner = _decoder(args[0])

    def decode_optional(value: Any, where: str, problems: list[str]) -> Any:
        if value is None:
            return None
        got: list[str] = []
        out = inner(value, where, got)
        mine = f"field {where!r} must be "  # the value itself, not a field inside it
        problems.extend(p.replace(mine, mine + "null or ", 1) if p.startswith(mine) else p for p in got)
        return out

    return decode_optional


def _tuple_decoder(tp: Any) -> _Decode:
    args = get_args(tp)
    if len(args) != 2 or args[1] is not Ellipsis:
        raise TypeError(f"a frame field of type {tp!r}: only 'tuple[X, ...]' is declared")
    item = _decoder(args[0])
    fast = _fast_tuple(tp)

    def decode_tuple(value: Any, where: str, problems: list[str]) -> Any:
        if not isinstance(value, (list, tuple)):
            problems.append(f"field {where!r} must be a list, got {_json_type(value)}")
            return None
        if fast is not None and fast(value):
            return _tuples(value, tp)
        bad: list[str] = []
        out = tuple(item(v, f"{where}[{i}]", bad) for i, v in enumerate(value))
        problems.extend(bad[:_SHOWN])
        if len(bad) > _SHOWN:
            problems.append(f"field {where!r}: {len(bad) - _SHOWN} more problems")
        return out

    return decode_tuple


@functools.cache
def _fast_tuple(tp: Any) -> Callable[[Any], bool] | None:
    """For a tuple of strings or integers (or of tuples of them): whether a list is one as it stands, in one
    pass (the plan of a large model holds tens of thousands of names and shapes); None for other tuples."""
    item = get_args(tp)[0]
    plain = _strip(item)
    if plain is str:
        return lambda values: all(type(v) is str for v in values)
    if plain is int:
        if get_origin(item) is Annotated and _NonNegative in get_args(item)[1:]:
            return lambda values: all(type(v) is int and v >= 0 for v in values)
        return lambda values: all(type(v) is int for v in values)
    if get_origin(plain) is tuple and (inner := _fast_tuple(plain)) is not None:
        return lambda values: all(isinstance(v, (list, tuple)) and inner(v) for v in values)
    return None


def _tuples(value: Any, tp: Any) -> tuple:
    """A list that :func:`_fast_tuple` passed, as the tuple (of tuples) it is declared."""
    if get_origin(_strip(get_args(tp)[0])) is tuple:
        return tuple(map(tuple, value))
    return tuple(value)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true or false"
    return {int: "an integer", float: "a number", str: "a string", list: "a list", tuple: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# Every frame's encoder and decoder, made as the module loads: a field of a type the protocol cannot carry is
# found here, not in the first update.
for _cls in FRAMES.values():
    _record_encoder(_cls)
    _record_decoder(_cls)
