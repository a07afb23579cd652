"""Multi-node weight updates on paper: a pipeline model of one update, calibrated on our single-host
measurements (docs/benchmarks.md), then used to predict updates across nodes joined by NICs.

A model, not a measurement: no multi-node machine has been lent for this project.

The model. An update moves B buckets. Each bucket passes through stages, and each stage is a resource that
works on one bucket at a time:

- ``pack``: the sender's GPU converts and copies the bucket's tensors into a buffer (the stream), at
  ``pack_factor`` times a device copy of the bytes it reads, plus ``pack_us_per_tensor`` of host work per
  tensor; P2P packs each route once more (one more device copy); a delta update also compares the bucket with
  the sender's snapshot (``DELTA_ENCODE_COPIES`` device copies);
- ``share``: in full mode (broadcast), every trainer rank receives the experts other EP ranks hold: over
  NVLink from GPUs of its node, over the NICs from other trainer nodes;
- ``wire``: the busiest NIC or NVLink port: the bytes it carries over its achieved rate (``efficiency`` x
  line rate), plus a fixed latency per bucket;
- ``load``: an engine rank copies its part of the bucket into its weights (one device copy), plus
  ``engine_ms_per_bucket`` and ``engine_us_per_tensor`` of its own work (a delta is applied first);
- ``request``: where the trainer sends one HTTP request per bucket and waits for the answer before the next
  bucket goes out (P2P today; a broadcast of deltas), ``request_ms_per_bucket`` + ``request_us_per_tensor`` per
  tensor it describes.

The sender keeps two buffers (it packs bucket k+1 while k is on the wire). Where the metadata of every bucket
went ahead, the engine receives bucket k+1 while it loads k and every stage overlaps (``Update.metadata_ahead``:
a broadcast in the current code); otherwise (the measured broadcast rows, P2P today, a broadcast of deltas) the
wire, the load and the request of one bucket follow each other and act as one stage. With per-bucket stage
times t_s:

    T = fixed + sum_s t_s + (B - 1) * max_s t_s

(the first bucket goes through every stage, then one bucket leaves per slowest stage).

Across nodes (``predict``): nodes of 8 GPUs, one NIC per GPU or ``nics`` per node; the trainer at Megatron TP 1
with EP over all its GPUs, PP 1; one engine replica at TP 8 per engine node. Broadcast: trainer rank 0 sends,
over the one NIC its GPU reaches, to every engine rank (one ring). P2P (the resharded sink): every trainer GPU
sends each engine rank the slices it needs, over its own NIC.

Calibration (``fit``): ``pack_factor`` and ``pack_us_per_tensor`` from the two H200 stream rows;
``engine_ms_per_bucket`` and ``engine_us_per_tensor`` from the two H200 x2 broadcast rows (metadata ahead);
``request_*`` from the two broadcast rows with one request per bucket. ``checks`` then compares the model with
the rows not used to fit it.

    PYTHONPATH=. python tools/multinode_model.py [--nic-gbps 400] [--nics 8 1] [--efficiency 0.8] [--bucket-mb 512]
        [--changed 0.02 0.03] [--presets qwen3-30b-a3b qwen3-235b-a22b] [--json F]
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


def delta_fraction(changed: float) -> float:
    """Wire bytes of a bf16 delta as a fraction of the dense bytes, ``changed`` of the words changed: the sink
    sends the smallest of ``indices`` (6 bytes per changed word), ``bitmap`` (``words / 8 + 2 * changed``
    bytes) and dense (``weightstream.streaming.delta.choose``)."""
    from weightstream.streaming.delta import choose, encoded_bytes

    words = 1 << 28  # a 512 MiB bucket of bf16 words
    count = round(changed * words)
    return encoded_bytes(choose(words, count, 2), words, count, 2) / (2 * words)


# -- what was measured on one host (docs/benchmarks.md) -----------------------------------------------------------


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


@dataclass(frozen=True)
class Row:
    """One measured row: what ran, where, and its best warm time in ms (the section of docs/benchmarks.md)."""

    label: str
    preset: str
    kind: Literal["stream", "ipc", "broadcast-ahead", "broadcast-per-bucket"]
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
    "bcast-8b": Row("Qwen3-8B broadcast GPU0 -> GPU1, metadata ahead", "qwen3-8b", "broadcast-ahead", H200, 76.4,
                    38, where="2026-11-23, H200 x2"),
    "bcast-30b": Row("Qwen3-30B-A3B broadcast, metadata ahead", "qwen3-30b-a3b", "broadcast-ahead", H200, 370.0,
                     115, where="2026-11-23, H200 x2"),
    "req-8b": Row("Qwen3-8B broadcast, one request per bucket", "qwen3-8b", "broadcast-per-bucket", H200, 95.5, 38,
                  where="2026-11-23, H200 x2"),
    "req-30b": Row("Qwen3-30B-A3B broadcast, one request per bucket", "qwen3-30b-a3b", "broadcast-per-bucket", H200,
                   552.0, 115, where="2026-11-23, H200 x2"),
}
CHECK_ROWS = (
    Row("Qwen3-8B broadcast, metadata ahead, kept buffers", "qwen3-8b", "broadcast-ahead", H200, 77.6, 38,
        where="2026-11-23 (later), H200 x2"),
    Row("Qwen3-30B-A3B broadcast, metadata ahead, kept buffers", "qwen3-30b-a3b", "broadcast-ahead", H200, 422.5, 115,
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
)

# Pause + commit + resume of the Qwen3-8B broadcast (1.3 + 1.9 + 0.8 ms, 2026-11-22 phase split): the part of
# an update that does not depend on its size.
FIXED_MS = 4.0
# Not measured on GPUs (docs/delta.md, "Not yet"): comparing a bucket with the snapshot reads both and writes
# the snapshot (about 1.5 device copies of its bytes); applying one on the engine, about one copy of what it
# holds. Assumptions.
DELTA_ENCODE_COPIES = 1.5
DELTA_APPLY_COPIES = 1.0


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
    if row.kind == "broadcast-ahead":  # the engine loaded a bucket before receiving the next (then)
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
    def nic_GBps(self) -> float:  # noqa: N802 -- bytes, not bits
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
    """One update. ``ahead``: every bucket's metadata goes to the engine in one request before the first bucket,
    and the engine receives bucket k + 1 while it loads k; otherwise one request per bucket, answered once the
    engine has loaded it. As the code does today (None): a broadcast sends it ahead unless it sends deltas
    (their headers go per bucket); P2P does not (True for P2P: not built)."""

    transport: Transport
    precision: Precision = "bf16"
    changed: float | None = None  # a delta update: the fraction of bf16 words changed
    bucket_bytes: int = 512 * MIB
    ahead: bool | None = None

    @property
    def metadata_ahead(self) -> bool:
        if self.ahead is not None:
            return self.ahead
        return self.transport == "broadcast" and self.changed is None

    def label(self) -> str:
        if self.transport == "broadcast":
            what = "broadcast"
        else:
            what = "P2P, routes ahead (not built)" if self.metadata_ahead else "P2P, a request per bucket"
        if self.changed is None:
            return what
        return f"{what}, delta {self.changed:.0%}" + ("" if self.transport == "broadcast" else " (not built)")


def predict(preset: str, split: Split, update: Update, cluster: Cluster, c: Costs) -> Estimate:
    m = model_bytes(preset)
    p = update.precision
    host, gpus = cluster.host, cluster.gpus
    copy, nvl, nic = host.copy_gbps * GB, host.nvlink_gbps * GB, cluster.nic_GBps * GB
    read, moved, tensors = m.total("bf16"), m.total(p), m.count(p)
    wire_bytes = moved if update.changed is None else moved * delta_fraction(update.changed)
    ep = split.trainer_nodes * gpus  # trainer: TP 1, EP over every trainer GPU
    engine_tp, replicas = gpus, split.engine_nodes
    nics_used = min(cluster.nics, gpus)
    notes: list[str] = []
    if update.transport == "broadcast":
        buckets = m.buckets(p, update.bucket_bytes)
        experts = m.expert_bytes(p)
        pack = c.pack_factor * read / copy + c.pack_us_per_tensor * m.tensors * 1e-6
        if update.changed is not None:
            pack += DELTA_ENCODE_COPIES * moved / copy
        # Full mode: every trainer rank receives every expert it does not hold (EP "share").
        share_nvlink = experts * (gpus - 1) / ep / nvl
        remote = experts * (split.trainer_nodes - 1) / split.trainer_nodes
        share_nic = remote / (nics_used * nic)
        # Rank 0's NIC sends the stream, and its share of the experts its node sends the other trainer nodes.
        tx = (wire_bytes + remote / nics_used) / nic
        into_engine_gpu = wire_bytes / nvl  # each engine rank receives every bucket (its node's NVLink ring)
        wire = max(tx, into_engine_gpu) + cluster.latency_ms * 1e-3 * buckets
        held = moved if update.changed is not None else 0  # an engine rank applies a delta to the whole bucket
        load = (moved / engine_tp / copy + DELTA_APPLY_COPIES * held / copy + c.engine_ms_per_bucket * 1e-3 * buckets
                + c.engine_us_per_tensor * 1e-6 * tensors)
        stages = {"pack": pack, "share (NVLink)": share_nvlink, "share (NIC)": share_nic, "wire": wire, "load": load}
        serial: tuple[str, ...] = ()  # metadata ahead: the engine receives k + 1 while it loads k
        if not update.metadata_ahead:
            stages["request"] = c.request_ms_per_bucket * 1e-3 * buckets + c.request_us_per_tensor * 1e-6 * tensors
            serial = ("wire", "load", "request")
        if update.changed is not None:
            kept: dict[str, float] = {"trainer rank 0": moved, "each engine rank": moved}
            weights = {"trainer rank 0": m.expert_bytes("bf16") / ep + m.total("bf16") - m.expert_bytes("bf16"),
                       "each engine rank": moved / engine_tp}
            notes.append(_kept(kept, weights, cluster.gpu_gb))
    else:
        senders = ep
        per_sender = moved / senders
        buckets = max(1, math.ceil(per_sender / update.bucket_bytes))
        pack = ((c.pack_factor + 1) * read / senders / copy  # + one copy: each route packed into its own buffer
                + c.pack_us_per_tensor * 1e-6 * m.tensors / senders)
        if update.changed is not None:
            pack += DELTA_ENCODE_COPIES * per_sender / copy
        senders_per_nic = gpus // nics_used
        tx = replicas * (wire_bytes / senders) * senders_per_nic / nic
        rx = wire_bytes / engine_tp * senders_per_nic / nic  # each engine rank receives its part, per replica
        wire = max(tx, rx) + cluster.latency_ms * 1e-3 * buckets
        part = moved / engine_tp
        load = (part / copy + (DELTA_APPLY_COPIES * part / copy if update.changed is not None else 0.0)
                + c.engine_ms_per_bucket * 1e-3 * buckets + c.engine_us_per_tensor * 1e-6 * tensors)
        stages = {"pack": pack, "wire": wire, "load": load}
        serial = ()
        if not update.metadata_ahead:
            # One request per bucket to each engine, describing every route: each tensor in engine_tp pieces.
            stages["request"] = (c.request_ms_per_bucket * 1e-3 * buckets
                                 + c.request_us_per_tensor * 1e-6 * tensors * engine_tp)
            serial = ("wire", "load", "request")
        if update.changed is not None:
            kept = {"each sender": per_sender, "each engine rank": part}
            weights = {"each sender": m.expert_bytes("bf16") / ep + m.total("bf16") - m.expert_bytes("bf16"),
                       "each engine rank": part}
            notes.append(_kept(kept, weights, cluster.gpu_gb))
    per_bucket = {k: v * 1e3 / buckets for k, v in stages.items()}
    return pipeline(per_bucket, buckets, serial=serial, notes=notes)


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
    predictions: list[dict] = field(default_factory=list)


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
    for preset in presets:
        m = model_bytes(preset)
        report.bytes.append({"preset": preset, "params": m.params, "tensors": m.tensors,
                             "tensors_fp8": m.count("fp8"), "bf16_bytes": m.total("bf16"),
                             "fp8_bytes": m.total("fp8"), "expert_bf16_bytes": m.expert_bytes("bf16"),
                             "buckets_bf16": m.buckets("bf16", bucket_bytes)})
    updates = [Update("broadcast", bucket_bytes=bucket_bytes), Update("p2p", bucket_bytes=bucket_bytes),
               Update("p2p", bucket_bytes=bucket_bytes, ahead=True)]
    updates += [Update(t, changed=x, bucket_bytes=bucket_bytes) for t in ("broadcast", "p2p") for x in changed]
    for preset in presets:
        for split in (Split(1, 1), Split(2, 2)):
            for up in updates:
                entry: dict = {"preset": preset, "nodes": split.label(), "update": up.label()}
                for n in nics:
                    for p in (("bf16", "fp8") if up.changed is None else ("bf16",)):
                        est = predict(preset, split, replace(up, precision=p), replace(cluster, nics=n), c)
                        entry[f"{n}x{cluster.nic_gbps:g}G {p}"] = asdict(est)
                report.predictions.append(entry)
    return report


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
    a = ap.parse_args(argv)
    cluster = Cluster(nic_gbps=a.nic_gbps, efficiency=a.efficiency)
    report = run(a.presets, a.nics, cluster, a.changed, int(a.bucket_mb * MIB))
    print(markdown(report, a.nics, a.nic_gbps))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(asdict(report), f, indent=1, default=str)


if __name__ == "__main__":
    main()
