"""The options of a :class:`~weightstream.update.WeightSync`: one frozen object of four groups (where the engines
are and how to reach them; how the bytes move; what is sent; how an update is kept safe), checked once, as a
whole, when it is made: one error lists every problem. Each field's default and meaning are given where the
field is declared, here."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from numbers import Real
from typing import Any, TypedDict

from weightstream.engines import ADAPTERS
from weightstream.streaming.stream import DEFAULT_BUCKET_BYTES
from weightstream.wire.fp8 import BlockFP8

__all__ = [
    "TRANSPORTS", "PAUSE_MODES", "SNAPSHOTS", "BACKENDS", "EngineOptions", "TransferOptions", "PayloadOptions",
    "SafetyOptions", "SyncOptions", "AdapterOptions", "OptionsError",
]

TRANSPORTS = ("auto", "ipc", "broadcast", "p2p")
PAUSE_MODES = ("abort", "retract", "in_place", "wait", "keep")  # SGLang's names; vLLM also takes wait and keep
SNAPSHOTS = ("device", "host")
BACKENDS = ("nccl", "gloo")


class OptionsError(ValueError):
    """Options that cannot be used: every problem found, in one message (and as ``problems``)."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(f"{len(problems)} problem{'s' if len(problems) > 1 else ''} with the WeightSync options: "
                         + "; ".join(problems))


class AdapterOptions(TypedDict, total=False):
    """What every adapter made from a URL is given (``fp8`` and ``model_path`` only where stated)."""

    api_key: str | None
    timeout_s: float
    group_name: str
    fp8: BlockFP8
    model_path: str


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """Where the engines are and how to reach them."""

    # The engine behind every URL given: "auto" (asked, on the first update) or a registered adapter's name
    # ("sglang", "vllm", "lmdeploy", "reference", ...). Adapters given as objects are used as they are.
    engine: str = "auto"
    api_key: str | None = None  # sent with every request to the engines given by URL
    # Seconds any one wait for an engine may take (a request, forming the group, a session's step); a failed
    # update ends within 1.2 * timeout_s + 5 s of the wait that failed. Engines given by URL get it too.
    timeout_s: float = 60.0
    group_name: str = "weightstream"  # the name of the weight-update group the engines join (broadcast, P2P)
    master_address: str = "127.0.0.1"  # where the engines reach trainer rank 0 to form that group
    master_port: int | None = None  # its port (None: a free one, per group formed)
    backend: str | None = None  # the group's torch.distributed backend (None: nccl where CUDA is, else gloo)
    # The block-FP8 layout the engines given by URL serve, stated where they do not report it (SGLang, vLLM,
    # LMDeploy): their adapters' ``fp8=``. None: as they report it.
    engine_fp8: BlockFP8 | None = None
    # Or the served model's directory, whose config.json's ``quantization_config`` says it (``model_path=``).
    engine_model_path: str | os.PathLike[str] | None = None

    def problems(self) -> list[str]:
        known = ("auto", *sorted(ADAPTERS))
        return [p for p in (
            _one_of("engine", self.engine, known),
            _optional(self.api_key, str, "api_key", "a string"),
            _positive("timeout_s", self.timeout_s, Real),
            _name("group_name", self.group_name),
            _name("master_address", self.master_address),
            _port(self.master_port),
            None if self.backend is None else _one_of("backend", self.backend, BACKENDS),
            _optional(self.engine_fp8, BlockFP8, "engine_fp8", "a BlockFP8"),
            _optional(self.engine_model_path, (str, os.PathLike), "engine_model_path", "a path"),
        ) if p is not None]

    def adapter_options(self) -> AdapterOptions:
        """What an adapter made from a URL is given (its ``fp8`` and ``model_path`` only where stated)."""
        out = AdapterOptions(api_key=self.api_key, timeout_s=self.timeout_s, group_name=self.group_name)
        if self.engine_fp8 is not None:
            out["fp8"] = self.engine_fp8
        if self.engine_model_path is not None:
            out["model_path"] = os.fspath(self.engine_model_path)
        return out


@dataclass(frozen=True, slots=True)
class TransferOptions:
    """How the bytes move."""

    # "auto": chosen at each update from what the engines declare (IPC for colocated engines, P2P per TP rank
    # where the engine's layout allows it, broadcast otherwise; the report says why); or one of them by name.
    transport: str = "auto"
    # The engines share this trainer's GPUs (IPC under "auto"); None: found out by comparing GPU UUIDs.
    colocated: bool | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES  # the largest bucket (a tensor larger than that goes alone)
    # Buckets are packed into two buffers kept with the stream's plan (``stream_hf_weights(reuse_buffers=)``);
    # False: a new buffer per bucket.
    reuse_buffers: bool = True
    # Where the engines take it (``broadcast_ahead``, ``ipc_ahead``): the metadata of every bucket in one
    # request; False: one request per bucket (what every engine takes).
    metadata_ahead: bool = True
    # IPC, where the engine offers its weights (the reference engine at TP 1): the trainer writes each tensor
    # straight into them, one copy; False: into buffers the engine copies out of (two copies).
    direct: bool = True

    def problems(self) -> list[str]:
        return [p for p in (
            _one_of("transport", self.transport, TRANSPORTS),
            _optional(self.colocated, bool, "colocated", "True, False"),
            _positive("bucket_bytes", self.bucket_bytes, int),
            _flag("reuse_buffers", self.reuse_buffers),
            _flag("metadata_ahead", self.metadata_ahead),
            _flag("direct", self.direct),
        ) if p is not None]


@dataclass(frozen=True, slots=True)
class PayloadOptions:
    """What is sent."""

    # The layout the update sends: block FP8 (the weights the family declares FP8 leave quantized; every engine
    # must serve that layout), or None: unquantized.
    quantize: BlockFP8 | None = None
    # After a first full update, each bucket goes as the words that changed since the engines' last committed
    # update (:mod:`weightstream.sinks.delta` says when an update is full instead), and every update is checked
    # (each engine rank's checksum of each bucket's bytes against the trainer's; a mismatch aborts the update
    # and sends it again, full).
    delta: bool = False
    full_every: int | None = None  # with ``delta``: every N-th update is full (None: only when needed)
    # With ``delta``: where the trainer keeps its copy of the bytes the engines hold, "device" or pinned "host"
    # memory (2 GB per billion bf16 parameters).
    snapshot: str = "device"

    def problems(self) -> list[str]:
        out = [p for p in (
            _optional(self.quantize, BlockFP8, "quantize", "a BlockFP8"),
            _flag("delta", self.delta),
            None if self.full_every is None else _positive("full_every", self.full_every, int),
            _one_of("snapshot", self.snapshot, SNAPSHOTS),
        ) if p is not None]
        if self.full_every is not None and self.delta is not True:
            out.append("full_every applies to delta updates (delta=True)")
        return out


@dataclass(frozen=True, slots=True)
class SafetyOptions:
    """How an update is kept safe."""

    # Every engine rank checks each bucket it takes against the trainer's checksum of it (the IPC sink then
    # keeps its transport copy: nothing is written straight into an engine's weights).
    checksums: bool = False
    # How generation pauses for an update: "abort" (requests in flight end), "retract" or "in_place" (kept,
    # where the engine takes it; vLLM also names them "wait" and "keep").
    pause_mode: str = "abort"

    def problems(self) -> list[str]:
        return [p for p in (_flag("checksums", self.checksums), _one_of("pause_mode", self.pause_mode, PAUSE_MODES))
                if p is not None]


_Group = EngineOptions | TransferOptions | PayloadOptions | SafetyOptions


@dataclass(frozen=True, slots=True)
class SyncOptions:
    """Every option of a :class:`~weightstream.update.WeightSync`, by concern. Checked once, when made: an
    :class:`OptionsError` (a ``ValueError``) lists every problem. ``SyncOptions.of(transport="p2p", delta=True)``
    makes one from the fields' names alone (the keywords ``WeightSync`` also takes)."""

    engines: EngineOptions = field(default_factory=EngineOptions)
    transfer: TransferOptions = field(default_factory=TransferOptions)
    payload: PayloadOptions = field(default_factory=PayloadOptions)
    safety: SafetyOptions = field(default_factory=SafetyOptions)

    def __post_init__(self) -> None:
        problems: list[str] = []
        given: dict[str, Any] = {"engines": self.engines, "transfer": self.transfer, "payload": self.payload,
                                 "safety": self.safety}
        for name, group in given.items():
            if not isinstance(group, _GROUPS[name]):
                problems.append(f"{name} must be {_GROUPS[name].__name__}, got {type(group).__name__}")
            else:
                problems += group.problems()
        if problems:
            raise OptionsError(problems)

    @classmethod
    def of(cls, **options: Any) -> SyncOptions:
        """The options from their fields' names (each belongs to one group); every name not known is a
        ``TypeError`` listing them all, every bad value is one :class:`OptionsError` listing them all."""
        unknown = sorted(set(options) - set(_GROUP_OF))
        if unknown:
            raise TypeError(f"unknown WeightSync options {unknown}; known: {', '.join(sorted(_GROUP_OF))}")
        given: dict[str, dict[str, Any]] = {name: {} for name in _GROUPS}
        for key, value in options.items():
            given[_GROUP_OF[key]][key] = value
        return cls(EngineOptions(**given["engines"]), TransferOptions(**given["transfer"]),
                   PayloadOptions(**given["payload"]), SafetyOptions(**given["safety"]))


_GROUPS: dict[str, type[_Group]] = {"engines": EngineOptions, "transfer": TransferOptions, "payload": PayloadOptions,
                                    "safety": SafetyOptions}
_GROUP_OF = {f.name: group for group, cls in _GROUPS.items() for f in fields(cls)}


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> str | None:
    return None if isinstance(value, str) and value in allowed else f"{name} must be one of {allowed}, got {value!r}"


def _optional(value: Any, kind: type | tuple[type, ...], name: str, what: str) -> str | None:
    return None if value is None or isinstance(value, kind) else f"{name} must be {what} or None, got {value!r}"


def _positive(name: str, value: Any, kind: type) -> str | None:
    numeric = isinstance(value, kind) and not isinstance(value, bool)
    if numeric and value > 0:
        return None
    return f"{name} must be a positive {'integer' if kind is int else 'number'}, got {value!r}"


def _flag(name: str, value: Any) -> str | None:
    return None if isinstance(value, bool) else f"{name} must be True or False, got {value!r}"


def _name(name: str, value: Any) -> str | None:
    return None if isinstance(value, str) and value else f"{name} must be a non-empty string, got {value!r}"


def _port(value: Any) -> str | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536):
        return None
    return f"master_port must be a port number (1 to 65535) or None, got {value!r}"
