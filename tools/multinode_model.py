"""Multi-node weight updates on paper: a pipeline model of one update, calibrated on our single-host
measurements (docs/benchmarks.md), then used to predict updates across nodes joined by NICs.

A model, not a measurement: no multi-node machine has been lent for this project.

The model. An update moves B buckets. Each bucket passes through stages, and each stage is a resource that
works on one bucket at a time:

- ``pack``: the sender's GPU converts and copies the bucket's tensors into a buffer (the stream), at
  ``pack_factor`` times a device copy of the bytes it reads, plus ``pack_us_per_tensor`` of host work per
  tensor; resharded P2P packs each route once more (one more device copy); a delta update also encodes the bucket
  against the sender's snapshot and checksums its new bytes (``DeltaCost``, measured);
- ``share``: in full mode (broadcast), every trainer rank receives the experts other EP ranks hold: over
  NVLink from GPUs of its node, over the NICs from other trainer nodes;
- ``wire``: the busiest NIC or NVLink port: the bytes it carries over its achieved rate (``efficiency`` x
  line rate), plus a fixed latency per bucket;
- ``load``: an engine rank copies its part of the bucket into its weights (one device copy), plus
  ``engine_ms_per_bucket`` and ``engine_us_per_tensor`` of its own work (a delta is applied first, and its new
  bytes checksummed);
- ``request``: where the trainer sends one HTTP request per bucket and waits for the answer before the next
  bucket goes out (a delta update, by broadcast or by P2P; P2P before its routes went ahead),
  ``request_ms_per_bucket`` + ``request_us_per_tensor`` per tensor it describes.

The sender keeps two buffers (it packs bucket k+1 while k is on the wire). Where the metadata of every bucket went
ahead (``Update.metadata_ahead``: a full broadcast, a full P2P) there is no request stage. Where the engine also
receives bucket k+1 while it loads k (``Update.overlapped``: a full broadcast; P2P into an engine of the trainer's
layout, as in the measured TP 1 -> TP 1 row) every stage overlaps; otherwise the wire and the load of one bucket
follow each other and act as one stage (the 2026-11-23 broadcast rows; resharded P2P, whose engine receives a
bucket's pieces, then loads them), and with the request where there is one (deltas). With per-bucket stage times
t_s:

    T = fixed + sum_s t_s + (B - 1) * max_s t_s

(the first bucket goes through every stage, then one bucket leaves per slowest stage).

Across nodes (``predict``): nodes of 8 GPUs, one NIC per GPU or ``nics`` per node; the trainer at Megatron TP 1
with EP over all its GPUs, PP 1; one engine replica at TP 8 per engine node. Broadcast: trainer rank 0 sends,
over the one NIC its GPU reaches, to every engine rank (one ring). P2P (the resharded sink): every trainer GPU
sends each engine rank the slices it needs, over its own NIC (into two engine replicas at once: not built, the code
sends them by broadcast; the rows' notes say so). Not modelled: a delta update's per-bucket gather of the senders'
delta headers on the trainer (resharded P2P).

Calibration (``fit``): ``pack_factor`` and ``pack_us_per_tensor`` from the two H200 stream rows;
``engine_ms_per_bucket`` and ``engine_us_per_tensor`` from the two H200 x2 broadcast rows (metadata ahead, the
engine loading each bucket before receiving the next); ``request_*`` from the two broadcast rows with one request
per bucket. ``checks`` then compares the model with the rows not used to fit it. The delta operations are not
fitted: they are the measured per-bucket figures (``DELTA_*_MS``).

    PYTHONPATH=. python tools/multinode_model.py [--nic-gbps 400] [--nics 8 1] [--efficiency 0.8] [--bucket-mb 512]
        [--changed 0.02 0.03] [--presets qwen3-30b-a3b qwen3-235b-a22b] [--json F]

Against a measured wire (``--check F.json ...``): the rows of ``weightstream bench --json`` (full updates) and
``weightstream bench --delta --json`` (each learning rate's delta updates) by broadcast, each modelled on its own
link (``--wire socket``: NCCL's socket transport over loopback, a wire like one between nodes), the link's rate
that of the row's ceiling, a plain broadcast of the same bytes in the same run; model against measured per row.

    PYTHONPATH=. python tools/multinode_model.py --check gpu-out/broadcast_*wiresocket*.json [--host H100]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

GB = 1e9
MIB = 1 << 20

# -- bytes to move: exact, from the presets ----------------------------------------------------------------------


@dataclass(frozen=True)
class ModelBytes:
    """What one update of a preset moves: per HF tensor (checkpoint order) its bytes in bf16 and in block FP8
    (the float8 weight and its float32 128 x 128 block scales, as one item: they travel together)."""

    name: str
    params: int
    bf16: tuple[int, ...]
    fp8: tuple[tuple[int, ...], ...]
    expert: tuple[bool, ...]  # routed-expert tensors (held by one EP rank; shared over EP in full mode)

    @property
    def tensors(self) -> int:
        return len(self.bf16)

    def total(self, precision: Precision) -> int:
        return sum(self.bf16) if precision == "bf16" else sum(sum(f) for f in self.fp8)

    def count(self, precision: Precision) -> int:
        """HF tensors an engine receives (an FP8 weight and its scales are two)."""
        return self.tensors if precision == "bf16" else sum(len(f) for f in self.fp8)

    def expert_bytes(self, precision: Precision) -> int:
        sizes = self.bf16 if precision == "bf16" else tuple(sum(f) for f in self.fp8)
        return sum(s for s, e in zip(sizes, self.expert, strict=True) if e)

    def buckets(self, precision: Precision, bucket_bytes: int) -> int:
        """Buckets of the plan the stream makes (``plan_buckets`` over the tensors in checkpoint order)."""
        return _buckets(self.name, precision, bucket_bytes)


Precision = Literal["bf16", "fp8"]


@functools.cache
def model_bytes(preset: str) -> ModelBytes:
    """Exact byte counts of ``preset``'s HF checkpoint (transformers builds it on the meta device)."""
    from weightstream.converters.expected import expected_hf_shapes
    from weightstream.converters.registry import get_converter
    from weightstream.models.presets import preset_config

    cfg = preset_config(preset)
    shapes = expected_hf_shapes(cfg)
    conv = get_converter(cfg.model_type)
    bf16: list[int] = []
    fp8: list[tuple[int, ...]] = []
    expert: list[bool] = []
    for name, shape in shapes.items():
        n = math.prod(shape)
        bf16.append(2 * n)
        if conv.quantizes(name):
            fp8.append((n, 4 * math.ceil(shape[0] / 128) * math.ceil(shape[1] / 128)))
        else:
            fp8.append((2 * n,))
        expert.append(".mlp.experts." in name)
    return ModelBytes(preset, sum(math.prod(s) for s in shapes.values()), tuple(bf16), tuple(fp8), tuple(expert))


@functools.cache
def _buckets(preset: str, precision: Precision, bucket_bytes: int) -> int:
    from weightstream.common.layout import ALIGN
    from weightstream.streaming.plan import plan_buckets

    m = model_bytes(preset)
    items = [[s] for s in m.bf16] if precision == "bf16" else [list(f) for f in m.fp8]
    return len(plan_buckets(items, bucket_bytes, ALIGN))


# -- what was measured on one host (docs/benchmarks.md) -----------------------------------------------------------


# Delta operations per 512 MiB bucket of bf16 words, ms, on an H100 with the word kernels, 5% of the words changed
# (``python3 tools/gpu_delta_ops.py --changed 0.05 0.22``, 2026-11-25,
# docs/bench/2026-11-25-delta-encodings/h100_gpu_delta_ops_2048x4.txt): a device copy of the bucket 0.40; encoding
# into the snapshot (compare, count, pack, the changed words written into the snapshot) 1.60 by bitmap and 1.69 by
# indices with the copy that restores its inputs, so 1.20 and 1.29 alone; applying 0.94 and 0.66 with the clone of
# the held bytes, so 0.54 and 0.26 alone; the checksum of the new bytes, which each side computes, 0.32. The model
# takes them as multiples of that run's device copy. At 2-3% changed fewer words are scattered than at 5%: the
# apply figures are then an upper bound. ``dense`` (past ~15/16 changed; not measured): the comparison of a bitmap's
# encoding, nothing to apply.
DELTA_COPY_MS = 0.40
DELTA_ENCODE_MS: Mapping[str, float] = {"bitmap": 1.20, "indices": 1.29, "dense": 1.20}
DELTA_APPLY_MS: Mapping[str, float] = {"bitmap": 0.54, "indices": 0.26, "dense": 0.0}
DELTA_CHECKSUM_MS = 0.32


@dataclass(frozen=True)
class DeltaCost:
    """A bf16 delta with ``changed`` of the words changed: the encoding the sink sends (the smallest of
    ``indices``, 6 bytes per changed word, ``bitmap``, ``words / 8 + 2 * changed`` bytes, and dense:
    ``weightstream.streaming.delta.choose``), its bytes as a fraction of the dense bytes, and its operations in
    device copies of the bytes they go over."""

    changed: float
    encoding: str
    wire_fraction: float

    @property
    def sender_copies(self) -> float:
        """Encoding into the snapshot, and the checksum of the new bytes."""
        return (DELTA_ENCODE_MS[self.encoding] + DELTA_CHECKSUM_MS) / DELTA_COPY_MS

    @property
    def engine_copies(self) -> float:
        """Applying the payload to the bytes held, and the checksum of the new bytes."""
        return (DELTA_APPLY_MS[self.encoding] + DELTA_CHECKSUM_MS) / DELTA_COPY_MS


def delta_cost(changed: float) -> DeltaCost:
    from weightstream.streaming.delta import choose, encoded_bytes

    words = 1 << 28  # a 512 MiB bucket of bf16 words
    count = round(changed * words)
    encoding = choose(words, count, 2)
    return DeltaCost(changed, encoding, encoded_bytes(encoding, words, count, 2) / (2 * words))


@dataclass(frozen=True)
class Host:
    """A measured machine: device-copy rate (bytes copied per second) and NVLink broadcast rate, GB/s."""

    name: str
    copy_gbps: float
    nvlink_gbps: float


# Device copy of Qwen3-8B's 16.38 GB: 7.8 ms on the H200, 11.1 ms on the H100; NCCL broadcast GPU0 -> GPU1 of
# the same bytes in 512 MiB pieces on H200 x2 (NV18): 44.6 ms (docs/benchmarks.md, 2026-11-22 and 2026-11-23).
H200 = Host("H200", 16.381e9 / 7.8e-3 / GB, 16.381e9 / 44.6e-3 / GB)
H100 = Host("H100", 16.381e9 / 11.1e-3 / GB, H200.nvlink_gbps)


# How a measured row ran: a stream alone; IPC (the stream writes into the engine's weights); by wire with the metadata
# ahead, the engine loading each bucket before it receives the next ("ahead"), or receiving bucket k + 1 while it
# loads k ("overlapped"); by wire with one request per bucket ("per-bucket").
RowKind = Literal["stream", "ipc", "ahead", "overlapped", "per-bucket"]


@dataclass(frozen=True)
class Row:
    """One measured row: what ran, where, and its best warm time in ms (the section of docs/benchmarks.md)."""

    label: str
    preset: str
    kind: RowKind
    host: Host
    ms: float
    buckets: int | None = None  # as the bench reported it
    precision: Precision = "bf16"
    where: str = ""


FIT_ROWS = {
    "stream-8b": Row("Qwen3-8B stream, kept buffers", "qwen3-8b", "stream", H200, 11.1, 38,
                     where="2026-11-23 (later), H200 x2"),
    "stream-30b": Row("Qwen3-30B-A3B stream, kept buffers", "qwen3-30b-a3b", "stream", H200, 44.8, 115,
                      where="2026-11-24 (night), H200"),
    "bcast-8b": Row("Qwen3-8B broadcast GPU0 -> GPU1, metadata ahead", "qwen3-8b", "ahead", H200, 76.4,
                    38, where="2026-11-23, H200 x2"),
    "bcast-30b": Row("Qwen3-30B-A3B broadcast, metadata ahead", "qwen3-30b-a3b", "ahead", H200, 370.0,
                     115, where="2026-11-23, H200 x2"),
    "req-8b": Row("Qwen3-8B broadcast, one request per bucket", "qwen3-8b", "per-bucket", H200, 95.5, 38,
                  where="2026-11-23, H200 x2"),
    "req-30b": Row("Qwen3-30B-A3B broadcast, one request per bucket", "qwen3-30b-a3b", "per-bucket", H200,
                   552.0, 115, where="2026-11-23, H200 x2"),
}
CHECK_ROWS = (
    Row("Qwen3-8B broadcast, metadata ahead, kept buffers", "qwen3-8b", "ahead", H200, 77.6, 38,
        where="2026-11-23 (later), H200 x2"),
    Row("Qwen3-30B-A3B broadcast, metadata ahead, kept buffers", "qwen3-30b-a3b", "ahead", H200, 422.5, 115,
        where="2026-11-23 (later), H200 x2"),
    Row("Qwen3-8B stream, kept buffers", "qwen3-8b", "stream", H100, 13.7, 38, where="2026-11-23 (late), H100"),
    Row("Qwen3-30B-A3B stream, kept buffers", "qwen3-30b-a3b", "stream", H100, 58.6, 115,
        where="2026-11-23 (late), H100"),
    Row("Qwen3-8B stream, block FP8", "qwen3-8b", "stream", H100, 14.2, 38, "fp8",
        where="2026-11-24 (evening), H100"),
    Row("Qwen3-30B-A3B stream, block FP8", "qwen3-30b-a3b", "stream", H200, 53.3, 115, "fp8",
        where="2026-11-24 (night), H200"),
    Row("Qwen3-8B IPC one copy, no rollback", "qwen3-8b", "ipc", H200, 16.4, 38, where="2026-11-24, H200"),
    Row("Qwen3-8B IPC one copy, no rollback", "qwen3-8b", "ipc", H100, 19.2, 38, where="2026-11-23 (late), H100"),
    Row("Qwen3-30B-A3B IPC one copy, no rollback", "qwen3-30b-a3b", "ipc", H200, 63.1, 115, where="2026-11-24, H200"),
    Row("Qwen3-30B-A3B IPC one copy, block FP8, no rollback", "qwen3-30b-a3b", "ipc", H200, 102.8, 115, "fp8",
        where="2026-11-24 (night), H200"),
    # The engine receiving bucket k + 1 while it loads k; the trainer still waiting for each bucket's transfer before
    # queuing the next (best of 4 warm, with rollback, code 1c62620).
    *(Row(label, preset, "overlapped", H200, ms, buckets, precision, where="2026-11-24 (late night), H200 x2")
      for label, preset, ms, buckets, precision in (
          ("Qwen3-8B broadcast, receive while loading", "qwen3-8b", 71.0, 38, "bf16"),
          ("Qwen3-8B P2P TP 1 -> TP 1, receive while loading", "qwen3-8b", 74.1, 38, "bf16"),
          ("Qwen3-30B-A3B broadcast, receive while loading", "qwen3-30b-a3b", 410.5, 115, "bf16"),
          ("Qwen3-8B broadcast, receive while loading", "qwen3-8b", 57.3, 17, "fp8"),
          ("Qwen3-8B P2P TP 1 -> TP 1, receive while loading", "qwen3-8b", 64.4, 17, "fp8"),
          ("Qwen3-30B-A3B broadcast, receive while loading", "qwen3-30b-a3b", 526.5, 59, "fp8"))),
)

# Pause + commit + resume of the Qwen3-8B broadcast (1.3 + 1.9 + 0.8 ms, 2026-11-22 phase split): the part of
# an update that does not depend on its size.
FIXED_MS = 4.0


@dataclass(frozen=True)
class Costs:
    """The fitted constants (``fit``)."""

    pack_factor: float  # a stream's device time / a device copy of the bytes it reads
    pack_us_per_tensor: float  # the stream's host work per HF tensor (plan check, views, launches)
    engine_ms_per_bucket: float  # an engine rank's own work per bucket (synchronisation, dispatch)
    engine_us_per_tensor: float  # ... and per tensor it loads (programs, views, the commit's share)
    request_ms_per_bucket: float  # one HTTP request per bucket, the trainer waiting for its answer
    request_us_per_tensor: float  # ... per tensor the request describes


# -- the pipeline ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """A predicted update: its time, the per-bucket stage times (ms) and which stage bounds it."""

    ms: float
    buckets: int
    stages: dict[str, float]
    bound: str
    notes: tuple[str, ...] = ()


def pipeline(stages: dict[str, float], buckets: int, serial: Sequence[str] = (), fixed_ms: float = FIXED_MS,
             notes: Sequence[str] = ()) -> Estimate:
    """``stages``: per-bucket time of each stage (ms). The stages named in ``serial`` follow each other for one
    bucket (the engine does not receive the next bucket before it has answered for this one): they act as one."""
    merged = {k: v for k, v in stages.items() if k not in serial}
    if serial:
        merged[" + ".join(serial)] = sum(stages[k] for k in serial)
    slowest = max(merged, key=lambda k: merged[k])
    ms = fixed_ms + sum(merged.values()) + (buckets - 1) * merged[slowest]
    return Estimate(ms, buckets, {k: round(v, 4) for k, v in stages.items()}, slowest, tuple(notes))


def single_host(row: Row, c: Costs) -> Estimate:
    """The model of a measured single-host row: trainer and engine at TP 1, one GPU each (IPC: the same GPU)."""
    m = model_bytes(row.preset)
    buckets = row.buckets or m.buckets(row.precision, 512 * MIB)
    read = m.total("bf16")  # the stream reads bf16 parameters whatever it writes
    moved = m.total(row.precision)
    tensors = m.count(row.precision)
    pack = (c.pack_factor * read / (row.host.copy_gbps * GB) * 1e3 + c.pack_us_per_tensor * m.tensors / 1e3) / buckets
    if row.kind == "stream":
        return pipeline({"pack": pack}, buckets, fixed_ms=0.0)
    if row.kind == "ipc":  # the trainer's stream writes straight into the engine's weights: the stream is the update
        return pipeline({"pack": pack}, buckets)
    wire = moved / (row.host.nvlink_gbps * GB) * 1e3 / buckets
    load = (moved / (row.host.copy_gbps * GB) * 1e3 + c.engine_ms_per_bucket * buckets
            + c.engine_us_per_tensor * tensors / 1e3) / buckets
    stages = {"pack": pack, "wire": wire, "load": load}
    if row.kind == "overlapped":  # P2P TP 1 -> TP 1 too: whole per-rank buckets, a broadcast's wire and loads
        return pipeline(stages, buckets)
    if row.kind == "ahead":
        return pipeline(stages, buckets, serial=("wire", "load"))
    stages["request"] = c.request_ms_per_bucket + c.request_us_per_tensor * tensors / buckets / 1e3
    return pipeline(stages, buckets, serial=("wire", "load", "request"))


def _solve(a: tuple[float, float, float], b: tuple[float, float, float]) -> tuple[float, float]:
    """x, y with a0 x + a1 y = a2 and b0 x + b1 y = b2."""
    det = a[0] * b[1] - a[1] * b[0]
    return (a[2] * b[1] - a[1] * b[2]) / det, (a[0] * b[2] - a[2] * b[0]) / det


def fit() -> Costs:
    """The constants that make the model give the six fitting rows exactly (each pair solved in turn: every
    fitted row is linear in its two unknowns once the previous pair is known)."""

    def linear(row: Row, base: Costs, names: tuple[str, str]) -> tuple[float, float, float]:
        zero = single_host(row, replace(base, **{names[0]: 0.0, names[1]: 0.0})).ms
        one = single_host(row, replace(base, **{names[0]: 1.0, names[1]: 0.0})).ms - zero
        two = single_host(row, replace(base, **{names[0]: 0.0, names[1]: 1.0})).ms - zero
        return one, two, row.ms - zero

    c = Costs(1.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    for pair, rows in ((("pack_factor", "pack_us_per_tensor"), ("stream-8b", "stream-30b")),
                       (("engine_ms_per_bucket", "engine_us_per_tensor"), ("bcast-8b", "bcast-30b")),
                       (("request_ms_per_bucket", "request_us_per_tensor"), ("req-8b", "req-30b"))):
        zeroed = replace(c, **{pair[0]: 0.0, pair[1]: 0.0})
        x, y = _solve(*(linear(FIT_ROWS[r], zeroed, pair) for r in rows))
        c = replace(c, **{pair[0]: x, pair[1]: y})
    return c


# -- across nodes -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cluster:
    """Nodes of ``gpus`` GPUs of ``host``'s kind, ``nics`` NICs of ``nic_gbps`` Gb/s per node (GPU i uses NIC
    i * nics // gpus), achieving ``efficiency`` of the line rate per direction, ``latency_ms`` per bucket."""

    nics: int = 8
    nic_gbps: float = 400.0
    efficiency: float = 0.8
    gpus: int = 8
    host: Host = H100
    latency_ms: float = 0.05
    gpu_gb: float = 80.0

    @property
    def nic_GBps(self) -> float:  # bytes, not bits
        return self.nic_gbps / 8 * self.efficiency


@dataclass(frozen=True)
class Split:
    """Trainer nodes (Megatron TP 1, EP over all their GPUs, PP 1) and engine nodes (one replica of TP = GPUs per
    node on each)."""

    trainer_nodes: int
    engine_nodes: int

    def label(self) -> str:
        return f"{self.trainer_nodes + self.engine_nodes} ({self.trainer_nodes} trainer + {self.engine_nodes} engine)"


Transport = Literal["broadcast", "p2p"]


@dataclass(frozen=True)
class Update:
    """One update. ``ahead``: every bucket's metadata (P2P: its routes) goes to the engine in one request before the
    first bucket; otherwise one request per bucket, answered once the engine has loaded it. ``overlap``: the engine
    receives bucket k + 1 while it loads k. None: as the code does today (``metadata_ahead``, ``overlapped``)."""

    transport: Transport
    precision: Precision = "bf16"
    changed: float | None = None  # a delta update: the fraction of bf16 words changed
    bucket_bytes: int = 512 * MIB
    ahead: bool | None = None
    overlap: bool | None = None

    @property
    def metadata_ahead(self) -> bool:
        """Today: every update, by broadcast or P2P, full or delta (a delta's header crosses the wire before its
        payload: ``delta_ahead``)."""
        return True if self.ahead is None else self.ahead

    @property
    def overlapped(self) -> bool:
        """Today: a full broadcast; the resharded engine receives a bucket's pieces, then loads them, and an engine
        taking deltas ahead applies and loads a bucket before it reads the next header."""
        if self.overlap is not None:
            return self.overlap
        return self.metadata_ahead and self.transport == "broadcast" and self.changed is None

    def label(self) -> str:
        what = "broadcast" if self.transport == "broadcast" else "P2P"
        if self.changed is not None:
            what += f", delta {self.changed:.0%}"
        elif self.transport == "p2p":
            what += ", routes ahead" if self.metadata_ahead else ", a request per bucket (the code before routes ahead)"
        if self.overlap is not None and self.overlap != replace(self, overlap=None).overlapped:
            what += ", receiving while loading (not built)" if self.overlap else ", each bucket loaded before the next"
        return what


Stages = tuple[int, dict[str, float], list[str]]  # buckets, seconds per stage over the whole update, notes


def predict(preset: str, split: Split, update: Update, cluster: Cluster, c: Costs) -> Estimate:
    m = model_bytes(preset)
    delta = None if update.changed is None else delta_cost(update.changed)
    build = _broadcast if update.transport == "broadcast" else _p2p
    buckets, stages, notes = build(m, split, update, cluster, c, delta)
    per_bucket = {k: v * 1e3 / buckets for k, v in stages.items()}
    return pipeline(per_bucket, buckets, serial=_serial(update), notes=notes)


def _serial(update: Update) -> tuple[str, ...]:
    """The stages one bucket goes through in turn (``pipeline``): with a request per bucket, the wire, the load and
    the request; with the metadata ahead, the wire and the load unless the engine receives while it loads."""
    if not update.metadata_ahead:
        return ("wire", "load", "request")
    return () if update.overlapped else ("wire", "load")


def _broadcast(m: ModelBytes, split: Split, update: Update, cluster: Cluster, c: Costs,
               delta: DeltaCost | None) -> Stages:
    """Trainer rank 0 sends every bucket, over the one NIC its GPU reaches, to every engine rank (one ring)."""
    p, gpus = update.precision, cluster.gpus
    copy, nvl, nic = cluster.host.copy_gbps * GB, cluster.host.nvlink_gbps * GB, cluster.nic_GBps * GB
    moved, tensors = m.total(p), m.count(p)
    wire_bytes = moved if delta is None else moved * delta.wire_fraction
    ep, nics_used = split.trainer_nodes * gpus, min(cluster.nics, gpus)
    buckets = m.buckets(p, update.bucket_bytes)
    experts = m.expert_bytes(p)
    pack = _pack(m, c, copy, senders=1, routes=False)
    # Full mode: every trainer rank receives every expert it does not hold (EP "share").
    share_nvlink = experts * (gpus - 1) / ep / nvl
    remote = experts * (split.trainer_nodes - 1) / split.trainer_nodes
    share_nic = remote / (nics_used * nic)
    # Rank 0's NIC sends the stream, and its share of the experts its node sends the other trainer nodes.
    tx = (wire_bytes + remote / nics_used) / nic
    into_engine_gpu = wire_bytes / nvl  # each engine rank receives every bucket (its node's NVLink ring)
    wire = max(tx, into_engine_gpu) + cluster.latency_ms * 1e-3 * buckets
    load = _load(c, moved / gpus, tensors, buckets, copy)
    notes = []
    if delta is not None:  # the sender encodes the whole bucket; each engine rank applies it to the whole bucket
        pack += delta.sender_copies * moved / copy
        load += delta.engine_copies * moved / copy
        weights = {"trainer rank 0": m.expert_bytes("bf16") / ep + m.total("bf16") - m.expert_bytes("bf16"),
                   "each engine rank": moved / gpus}
        notes.append(_kept({"trainer rank 0": moved, "each engine rank": moved}, weights, cluster.gpu_gb))
    stages = {"pack": pack, "share (NVLink)": share_nvlink, "share (NIC)": share_nic, "wire": wire, "load": load}
    if not update.metadata_ahead:
        stages["request"] = _request(c, buckets, tensors)
    return buckets, stages, notes


def _p2p(m: ModelBytes, split: Split, update: Update, cluster: Cluster, c: Costs, delta: DeltaCost | None) -> Stages:
    """Resharded P2P: every trainer GPU sends each engine rank the slices it needs, over its own NIC."""
    p, gpus = update.precision, cluster.gpus
    copy, nic = cluster.host.copy_gbps * GB, cluster.nic_GBps * GB
    moved, tensors = m.total(p), m.count(p)
    wire_bytes = moved if delta is None else moved * delta.wire_fraction
    senders, engine_tp, replicas = split.trainer_nodes * gpus, gpus, split.engine_nodes
    per_sender, part = moved / senders, moved / engine_tp
    buckets = max(1, math.ceil(per_sender / update.bucket_bytes))
    pack = _pack(m, c, copy, senders=senders, routes=True)
    senders_per_nic = gpus // min(cluster.nics, gpus)
    tx = replicas * (wire_bytes / senders) * senders_per_nic / nic
    rx = wire_bytes / engine_tp * senders_per_nic / nic  # each engine rank receives its part, per replica
    wire = max(tx, rx) + cluster.latency_ms * 1e-3 * buckets
    load = _load(c, part, tensors, buckets, copy)
    notes = []
    if replicas > 1:
        notes.append(f"{replicas} engines resharded into at once: not built (the code sends them by broadcast)")
    if delta is not None:  # each sender encodes its routes; each engine rank applies its part
        pack += delta.sender_copies * per_sender / copy
        load += delta.engine_copies * part / copy
        weights = {"each sender": m.expert_bytes("bf16") / senders + m.total("bf16") - m.expert_bytes("bf16"),
                   "each engine rank": part}
        notes.append(_kept({"each sender": per_sender, "each engine rank": part}, weights, cluster.gpu_gb))
    stages = {"pack": pack, "wire": wire, "load": load}
    if not update.metadata_ahead:  # to each engine, describing every route: each tensor in engine_tp pieces
        stages["request"] = _request(c, buckets, tensors * engine_tp)
    return buckets, stages, notes


def _pack(m: ModelBytes, c: Costs, copy: float, senders: int, routes: bool) -> float:
    """Seconds a sender packs its share of the update; ``routes``: each route then copied into its own buffer."""
    factor = c.pack_factor + (1.0 if routes else 0.0)
    return factor * m.total("bf16") / senders / copy + c.pack_us_per_tensor * 1e-6 * m.tensors / senders


def _load(c: Costs, part: float, tensors: int, buckets: int, copy: float) -> float:
    """Seconds an engine rank loads ``part`` bytes of ``tensors`` tensors in ``buckets`` buckets."""
    return part / copy + c.engine_ms_per_bucket * 1e-3 * buckets + c.engine_us_per_tensor * 1e-6 * tensors


def _request(c: Costs, buckets: int, described: int) -> float:
    """Seconds of one request per bucket, describing ``described`` tensors (or pieces) in all."""
    return c.request_ms_per_bucket * 1e-3 * buckets + c.request_us_per_tensor * 1e-6 * described


def _kept(kept: Mapping[str, float], weights: Mapping[str, float], gpu_gb: float) -> str:
    """What a delta update keeps per GPU (device snapshots), and where that and the GPU's weights exceed it."""
    over = [k for k in kept if (kept[k] + weights[k]) / GB > gpu_gb]
    text = "keeps " + ", ".join(f"{v / GB:.0f} GB on {k}" for k, v in kept.items())
    return text + (f": with the weights, over {gpu_gb:g} GB on {' and '.join(over)}" if over else "")


# -- output -------------------------------------------------------------------------------------------------------


def _ms(ms: float) -> str:
    return f"{ms:,.1f} ms" if ms < 1000 else f"{ms / 1000:,.2f} s"


@dataclass
class Report:
    costs: Costs
    cluster: dict
    checks: list[dict] = field(default_factory=list)
    bytes: list[dict] = field(default_factory=list)
    deltas: list[dict] = field(default_factory=list)
    predictions: list[dict] = field(default_factory=list)
    variants: list[dict] = field(default_factory=list)  # the engine's overlap otherwise than today, against today


def checks(c: Costs) -> list[dict]:
    out = []
    for key, row in [*FIT_ROWS.items(), *(("", r) for r in CHECK_ROWS)]:
        est = single_host(row, c)
        out.append({"row": row.label, "kind": row.kind, "precision": row.precision, "host": row.host.name,
                    "where": row.where, "measured_ms": row.ms, "model_ms": round(est.ms, 1),
                    "error": round(est.ms / row.ms - 1, 3), "use": "fitted" if key else "check"})
    return out


def run(presets: Sequence[str], nics: Sequence[int], cluster: Cluster, changed: Sequence[float],
        bucket_bytes: int) -> Report:
    c = fit()
    report = Report(c, asdict(cluster), checks(c))
    report.bytes = [_bytes_entry(preset, bucket_bytes) for preset in presets]
    report.deltas = [{**asdict(d), "sender_copies": d.sender_copies, "engine_copies": d.engine_copies}
                     for d in map(delta_cost, changed)]
    updates = [Update("broadcast", bucket_bytes=bucket_bytes), Update("p2p", bucket_bytes=bucket_bytes),
               Update("p2p", bucket_bytes=bucket_bytes, ahead=False)]
    updates += [Update(t, changed=x, bucket_bytes=bucket_bytes) for t in ("broadcast", "p2p") for x in changed]
    variants = [Update("broadcast", bucket_bytes=bucket_bytes, overlap=False),
                Update("p2p", bucket_bytes=bucket_bytes, overlap=True)]
    first = replace(cluster, nics=nics[0])
    for preset in presets:
        for split in (Split(1, 1), Split(2, 2)):
            for up in updates:
                report.predictions.append(_prediction(preset, split, up, nics, cluster, c))
            for up in variants:
                ms, today = (predict(preset, split, u, first, c).ms for u in (up, replace(up, overlap=None)))
                report.variants.append({"preset": preset, "nodes": split.label(), "update": up.label(),
                                        "nics": nics[0], "ms": ms, "today_ms": today})
    return report


def _bytes_entry(preset: str, bucket_bytes: int) -> dict:
    m = model_bytes(preset)
    return {"preset": preset, "params": m.params, "tensors": m.tensors, "tensors_fp8": m.count("fp8"),
            "bf16_bytes": m.total("bf16"), "fp8_bytes": m.total("fp8"), "expert_bf16_bytes": m.expert_bytes("bf16"),
            "buckets_bf16": m.buckets("bf16", bucket_bytes)}


def _prediction(preset: str, split: Split, up: Update, nics: Sequence[int], cluster: Cluster, c: Costs) -> dict:
    """One row of the table: ``up`` at each NIC count, in bf16 and (not a delta) block FP8."""
    entry: dict = {"preset": preset, "nodes": split.label(), "update": up.label()}
    for n in nics:
        for p in (("bf16", "fp8") if up.changed is None else ("bf16",)):
            est = predict(preset, split, replace(up, precision=p), replace(cluster, nics=n), c)
            entry[f"{n}x{cluster.nic_gbps:g}G {p}"] = asdict(est)
    return entry


def markdown(r: Report, nics: Sequence[int], nic_gbps: float) -> str:
    c = r.costs
    lines = ["Fitted constants: " + ", ".join(f"{k} = {v:.4g}" for k, v in asdict(c).items()), ""]
    lines += ["| row | where | measured | model | error | use |", "|---|---|---|---|---|---|"]
    for x in r.checks:
        lines.append(f"| {x['row']} ({x['precision']}) | {x['where']} | {x['measured_ms']:.1f} ms | "
                     f"{x['model_ms']:.1f} ms | {x['error']:+.1%} | {x['use']} |")
    lines += ["", "| preset | parameters | HF tensors (FP8) | bf16 | block FP8 | routed experts (bf16) | "
              "512 MiB buckets |", "|---|---|---|---|---|---|---|"]
    for b in r.bytes:
        lines.append(f"| {b['preset']} | {b['params'] / 1e9:.2f} B | {b['tensors']:,} ({b['tensors_fp8']:,}) | "
                     f"{b['bf16_bytes'] / GB:,.1f} GB | {b['fp8_bytes'] / GB:,.1f} GB | "
                     f"{b['expert_bf16_bytes'] / GB:,.1f} GB | {b['buckets_bf16']} |")
    cols = [f"{n}x{nic_gbps:g}G {p}" for n in nics for p in ("bf16", "fp8")]
    lines += ["", "| model | nodes | update | " + " | ".join(f"{n} x {nic_gbps:g} Gb/s per node, {p}"
                                                          for n in nics for p in ("bf16", "FP8"))
              + f" | bound ({nics[0]} NICs, bf16) |", "|---|---|---|" + "---|" * (len(cols) + 1)]
    for e in r.predictions:
        cells = [(_ms(e[k]["ms"]) if k in e else "—") for k in cols]
        first = e[cols[0]]
        bound = first["bound"] + ("; " + "; ".join(first["notes"]) if first["notes"] else "")
        lines.append(f"| {e['preset']} | {e['nodes']} | {e['update']} | " + " | ".join(cells) + f" | {bound} |")
    lines += ["", "| delta | encoding | on the wire | sender (encode + checksum) | engine rank (apply + checksum) |",
              "|---|---|---|---|---|"]
    for d in r.deltas:
        lines.append(f"| {d['changed']:.0%} changed | {d['encoding']} | {d['wire_fraction']:.2%} of the dense bytes | "
                     f"{d['sender_copies']:.3g} device copies | {d['engine_copies']:.3g} device copies |")
    lines += ["", f"| model | nodes | otherwise than today ({nics[0]} x {nic_gbps:g} Gb/s per node, bf16) | time | "
              "today |", "|---|---|---|---|---|"]
    for v in r.variants:
        lines.append(f"| {v['preset']} | {v['nodes']} | {v['update']} | {_ms(v['ms'])} | {_ms(v['today_ms'])} |")
    return "\n".join(lines)


# -- against a measured wire (--check) ---------------------------------------------------------------------------


def on_link(preset: str, precision: Precision, buckets: int, link_gbps: float, host: Host, c: Costs,
            delta: DeltaCost | None = None, wire_fraction: float | None = None) -> Estimate:
    """A broadcast between two GPUs over a link of ``link_gbps`` GB/s: trainer and engine at TP 1, the stream
    reading bf16, the engine receiving bucket k + 1 while it loads k (a full update); a delta update (``delta``,
    ``wire_fraction`` of the bytes on the wire) encoded by the sender and applied by the engine, each bucket's wire
    and load in turn."""
    m = model_bytes(preset)
    copy = host.copy_gbps * GB
    read, moved, tensors = m.total("bf16"), m.total(precision), m.count(precision)
    pack = c.pack_factor * read / copy * 1e3 + c.pack_us_per_tensor * m.tensors / 1e3
    load = moved / copy * 1e3 + c.engine_ms_per_bucket * buckets + c.engine_us_per_tensor * tensors / 1e3
    wire = moved * (1.0 if wire_fraction is None else wire_fraction) / (link_gbps * GB) * 1e3
    serial: tuple[str, ...] = ()
    if delta is not None:
        pack += delta.sender_copies * moved / copy * 1e3
        load += delta.engine_copies * moved / copy * 1e3
        serial = ("wire", "load")
    return pipeline({"pack": pack / buckets, "wire": wire / buckets, "load": load / buckets}, buckets, serial=serial)


def _measured(row: dict) -> list[tuple[str, float, Precision, float | None, float | None]]:
    """A bench JSON row as (what, best ms, precision, words changed, wire fraction): a full row once; a delta row
    per learning rate (its best delta update, its mean share of words changed and of the bytes on the wire)."""
    if "updates" not in row:
        precision: Precision = "fp8" if "block FP8" in row["transport"] else "bf16"
        return [("full update", row["best_s"] * 1e3, precision, None, None)]
    out: list[tuple[str, float, Precision, float | None, float | None]] = []
    for lr in dict.fromkeys(u["lr"] for u in row["updates"] if u["lr"] is not None):
        steps = [u for u in row["updates"] if u["lr"] == lr and not u["full"]]
        if steps:
            changed = sum(u["changed_fraction"] for u in steps) / len(steps)
            wire = sum(u["wire_bytes"] for u in steps) / len(steps) / row["bytes"]
            out.append((f"delta, lr {lr:g}", min(u["seconds"] for u in steps) * 1e3, "bf16", changed, wire))
    return out


def check_rows(paths: Sequence[str], host: Host, c: Costs) -> list[dict]:
    """Every broadcast row of the bench JSON files ``paths``, modelled on its own link (:func:`on_link`)."""
    out = []
    for path in paths:
        with open(path) as f:
            rows = json.load(f)
        for row in rows:
            if not row["transport"].startswith("broadcast") or not row.get("ceiling_s"):
                continue
            preset = row["preset"].split(" (")[0]
            link = row["bytes"] / row["ceiling_s"] / GB
            for what, ms, precision, changed, wire in _measured(row):
                delta = None if changed is None else delta_cost(changed)
                est = on_link(preset, precision, row["buckets"], link, host, c, delta, wire)
                out.append({"file": path, "preset": preset, "update": what, "precision": precision,
                            "wire": row.get("wire", "default"), "link_gbps": round(link, 3),
                            "ceiling_ms": row["ceiling_s"] * 1e3, "measured_ms": ms, "model_ms": round(est.ms, 1),
                            "error": round(est.ms / ms - 1, 3), "bound": est.bound, "stages": est.stages})
    return out


def check_markdown(rows: Sequence[dict], host: Host) -> str:
    lines = [f"Model against measured rows on their own links ({host.name} copy rate; the link's rate: the row's "
             "plain broadcast of the same bytes)", "",
             "| row | wire | link | ceiling | measured | measured / ceiling | model | error | bound |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["measured_ms"] / r["ceiling_ms"]
        lines.append(f"| {r['preset']} {r['update']} ({r['precision']}) | {r['wire']} | {r['link_gbps']:.2f} GB/s | "
                     f"{r['ceiling_ms']:.1f} ms | {r['measured_ms']:.1f} ms | {ratio:.2f}x "
                     f"| {r['model_ms']:.1f} ms | {r['error']:+.1%} | {r['bound']} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=["qwen3-30b-a3b", "qwen3-235b-a22b"])
    ap.add_argument("--nics", nargs="+", type=int, default=[8, 1], help="NICs per node (one table column each)")
    ap.add_argument("--nic-gbps", type=float, default=400.0)
    ap.add_argument("--efficiency", type=float, default=0.8, help="achieved fraction of the NIC's line rate")
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--changed", nargs="*", type=float, default=[0.02, 0.03], help="delta rows: words changed")
    ap.add_argument("--json", help="write everything computed here as JSON")
    ap.add_argument("--check", nargs="+", metavar="F.json", help="bench --json files: model vs measured per row")
    ap.add_argument("--host", choices=["H100", "H200"], default="H100", help="--check: the GPUs the rows ran on")
    a = ap.parse_args(argv)
    if a.check:
        host = {"H100": H100, "H200": H200}[a.host]
        rows = check_rows(a.check, host, fit())
        print(check_markdown(rows, host))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    cluster = Cluster(nic_gbps=a.nic_gbps, efficiency=a.efficiency)
    report = run(a.presets, a.nics, cluster, a.changed, int(a.bucket_mb * MIB))
    print(markdown(report, a.nics, a.nic_gbps))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(asdict(report), f, indent=1, default=str)


if __name__ == "__main__":
    main()
