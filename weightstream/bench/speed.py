"""``weightstream bench --transport ...``: how fast weightstream moves a model, against the raw ceiling of
the same machine, measured in the same run on the same bytes.

- ``stream``: ``stream_hf_weights`` with no sink (convert + pack) vs a device copy of the same bytes, bucket
  by bucket;
- ``broadcast``: ``WeightSync.update`` from a trainer on the first device into a reference engine on the
  second vs a plain broadcast of the same bytes in buckets of the same size (NCCL on GPUs, gloo on CPUs);
- ``ipc``: ``WeightSync.update`` into a reference engine on the trainer's device vs a device copy;
- ``checkpoint`` (CPU case): ``save_hf_checkpoint`` vs ``safetensors.torch.save_file`` of the same tensors.

``--tiny`` keeps a preset's topology (layers, experts, tensor count) at small widths, so that the
per-tensor overhead can be measured on a CPU.

``--wire socket`` (broadcast and P2P rows, NCCL only): every process of the row (trainer ranks, engines, the
ceiling's ranks) runs NCCL on its socket transport over loopback (:data:`SOCKET_WIRE`), a wire like a link between
two nodes on one host; the ceiling, a plain NCCL broadcast (or sends) of the same bytes in the same run, is then
that link's own rate, and the row's ratio is to it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist

from weightstream.converters.fp8 import dequantize_block_fp8, quantize_weight
from weightstream.wire.fp8 import FP8, SCALE_SUFFIX, BlockFP8

__all__ = [
    "TRANSPORTS", "IDS", "TINY", "BenchResult", "bench_config", "copy_ceiling", "stream_job", "update_job",
    "logits_check", "raw_send_recv_job", "raw_reshard_job", "raw_broadcast_job", "run_bench", "fp8_config", "serving",
    "broadcast_ceiling", "send_recv_ceiling", "checkpoint_job", "write_json", "plot", "WIRES", "SOCKET_WIRE",
    "wire_problems", "on_wire"
]


TRANSPORTS = ("stream", "broadcast", "ipc", "p2p", "checkpoint")
IDS = [[3, 14, 15, 92, 65, 35, 89, 79]]
WIRES = ("default", "socket")
# NCCL's socket transport over loopback: no peer-to-peer or shared-memory path between the GPUs, no InfiniBand; the
# bytes go through the kernel's TCP stack as between two nodes.
SOCKET_WIRE = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket",
               "NCCL_SOCKET_IFNAME": "lo"}
TINY = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, vocab_size=1024, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8)


@dataclass
class BenchResult:
    preset: str
    transport: str
    device: str
    dtype: str
    bucket_bytes: int
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    cold_s: float = 0.0  # first run (plan, groups, handles; after WeightSync.prepare where prepare_s is set)
    prepare_s: float | None = None  # WeightSync.prepare before the first update (--prepare)
    warm_s: list[float] = field(default_factory=list)  # every later run
    ceiling_s: float = 0.0
    ceiling: str = ""
    peak_extra_bytes: int | None = None
    # the engine's (first engine, its largest rank): device bytes its last update added at its peak over what it
    # held before, and where that update kept its rollback copies (reference engine: /weightstream/memory)
    engine_peak_extra_bytes: int | None = None
    engine_backup: str = ""
    phases: dict[str, float] = field(default_factory=dict)  # of the best warm run
    cold_phases: dict[str, float] = field(default_factory=dict)  # of the first run (updates)
    # the engine's side of the best warm run, its rank 0 (reference engine: ``update_phases``), and of the first
    engine_phases: dict[str, float] = field(default_factory=dict)
    engine_cold_phases: dict[str, float] = field(default_factory=dict)
    check: str = ""  # what was checked after the runs, and how it came out
    check_ok: bool | None = None  # whether it passed; a row whose check fails or cannot run has failed
    wire: str = "default"  # WIRES: "socket" where every process ran NCCL's socket transport over loopback

    @property
    def failed(self) -> bool:
        return self.check_ok is False

    @property
    def ceiling_gbps(self) -> float:
        """The row's bytes over the ceiling's time, GB/s: on a broadcast or P2P row, the wire's own rate."""
        return self.bytes / self.ceiling_s / 1e9 if self.ceiling_s else float("nan")

    @property
    def best_s(self) -> float:
        return min(self.warm_s) if self.warm_s else self.cold_s

    @property
    def ratio(self) -> float:
        return self.best_s / self.ceiling_s if self.ceiling_s else float("nan")

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(best_s=self.best_s, ratio=self.ratio, ceiling_gbps=self.ceiling_gbps)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> BenchResult:
        """A row as :meth:`as_dict` wrote it (``--json``)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def render(self) -> str:
        us = self.best_s / max(self.tensors, 1) * 1e6
        peak = "n/a" if self.peak_extra_bytes is None else f"{self.peak_extra_bytes / 2**20:.1f} MiB"
        engine = "n/a" if self.engine_peak_extra_bytes is None else f"{self.engine_peak_extra_bytes / 2**20:.1f} MiB"
        lines = [
            f"weightstream bench: {self.preset}, {self.transport}, {self.dtype}, {self.device}, "
            f"buckets of {self.bucket_bytes / 2**20:g} MiB",
            f"  {self.bytes / 1e6:.1f} MB, {self.tensors} tensors, {self.buckets} buckets",
            f"  ours (best warm)  {self.best_s * 1e3:9.1f} ms   ({us:.2f} us per tensor)",
            f"  ceiling           {self.ceiling_s * 1e3:9.1f} ms   ({self.ceiling}"
            + (f"; {self.ceiling_gbps:.2f} GB/s)" if self.transport.startswith(("broadcast", "p2p")) else ")"),
            f"  ratio             {self.ratio:9.2f}x",
            f"  cold (first)      {self.cold_s * 1e3:9.1f} ms   ({self.cold_s / self.best_s:.2f}x warm)"
            + (f", after prepare() {self.prepare_s * 1e3:.1f} ms" if self.prepare_s is not None else ""),
            f"  peak extra memory {peak} (trainer), {engine} (engine"
            + (f"; rollback copies: {self.engine_backup})" if self.engine_backup else ")"),
        ]
        for what, phases in (("best warm", self.phases), ("cold", self.cold_phases),
                             ("engine rank 0, best warm", self.engine_phases),
                             ("engine rank 0, cold", self.engine_cold_phases)):
            if phases:
                lines.append(f"  phases ({what}): " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in phases.items()))
        if self.check:
            verdict = {True: "passed", False: "FAILED", None: "recorded"}[self.check_ok]
            lines.append(f"  check ({verdict}): {self.check}")
        return "\n".join(lines)


def bench_config(preset: str, tiny: bool, dtype: str):
    from weightstream.models.presets import preset_config

    cfg = preset_config(preset)
    if tiny:
        for k, v in TINY.items():
            if hasattr(cfg, k):
                setattr(cfg, k, v)
    cfg.dtype = dtype
    return cfg


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, runs: int, fn: Callable[[], Any]) -> tuple[list[tuple[float, Any]], int | None]:
    """``fn()`` ``runs`` times, each timed between device synchronisations, with what it returned; and the
    peak GPU memory the runs added over what was allocated before them (None on a CPU)."""
    cuda = device.type == "cuda"
    _sync(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    out = []
    for _ in range(runs):
        _sync(device)
        t = time.perf_counter()
        value = fn()
        _sync(device)
        out.append((time.perf_counter() - t, value))
    return out, (torch.cuda.max_memory_allocated(device) - base if cuda else None)


def copy_ceiling(total: int, bucket_bytes: int, device: torch.device, repeats: int) -> float:
    """A device copy of ``total`` bytes into fresh buckets of ``bucket_bytes`` (best of ``repeats``)."""
    src = torch.empty(min(total, bucket_bytes), dtype=torch.uint8, device=device)
    src.fill_(1)

    def copy_all() -> None:
        left = total
        while left > 0:
            n = min(left, bucket_bytes)
            torch.empty(n, dtype=torch.uint8, device=device).copy_(src[:n])
            left -= n

    runs, _ = _timed(device, repeats + 1, copy_all)
    return min(t for t, _ in runs)


def _trainer(cfg, dtype: str, tp: int = 1, ep: int = 1):
    from weightstream.checks.megatron_models import build_gpt_model, initialize_parallel

    initialize_parallel(tp, 1, ep=ep)
    chunks = build_gpt_model(cfg, dtype=getattr(torch, dtype))
    device = next(chunks[0].parameters()).device
    return chunks, device


def stream_job(cfg, dtype: str, bucket_bytes: int, repeats: int, reuse_buffers: bool = False,
               quantize: BlockFP8 | None = None) -> dict:
    """One rank: stream with no sink, cold then ``repeats`` warm; then the copy ceiling (of the bytes the
    stream reads: the unquantized model's)."""
    from weightstream.streaming.stream import stream_hf_weights

    chunks, device = _trainer(cfg, dtype)

    def stream_all():
        s = stream_hf_weights(chunks, cfg, bucket_bytes=bucket_bytes, reuse_buffers=reuse_buffers,
                              quantize=quantize)
        for _b in s:
            pass
        return s.stats

    runs, peak = _timed(device, repeats + 1, stream_all)
    stats = runs[-1][1]
    best = min(runs[1:], key=lambda r: r[0]) if len(runs) > 1 else runs[0]
    check, ok = _stream_check(chunks, cfg, bucket_bytes, reuse_buffers, quantize)
    read = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    return {"device": str(device), "cold_s": runs[0][0], "warm_s": [r[0] for r in runs[1:]], "bytes": stats.bytes,
            "tensors": stats.tensors, "buckets": stats.buckets, "peak_extra_bytes": peak,
            "phases": {"setup": best[1].setup_seconds, "pack": best[1].seconds},
            "ceiling_s": copy_ceiling(stats.bytes if quantize is None else read, bucket_bytes, device, repeats),
            "check": check, "check_ok": ok}


def _expected_hf_tensors(chunks, cfg) -> dict[str, torch.Tensor]:
    """Each HF tensor as the converter's op makes it from its Megatron parameter directly (one rank, TP 1): no
    plan, no batching, no kept buffers."""
    from weightstream.converters.ops import OpContext
    from weightstream.converters.registry import get_converter, model_spec
    from weightstream.sources.megatron import local_tensors
    from weightstream.sources.topology import Topology

    spec = model_spec(cfg)
    converter = get_converter(spec.model_type)
    expected: dict[str, torch.Tensor] = {}
    for local in local_tensors(chunks, Topology.current(), spec.num_experts):
        resolved = converter.resolve(local.name, spec)
        if resolved is not None and resolved.emit:
            outs = resolved.mapping.op.to_hf(local.tensor.detach(), OpContext(spec))
            expected.update(zip(resolved.hf_names, outs, strict=True))
    return expected


def _want(expected: dict[str, torch.Tensor], scales: dict[str, torch.Tensor], name: str,
          got: torch.Tensor, quantize: BlockFP8 | None) -> torch.Tensor | None:
    """What the stream should have yielded under ``name``: the converted tensor, or (block FP8) it quantized one
    by one, the scales kept until their own name comes (right after the values)."""
    if quantize is not None and name in scales:
        return scales.pop(name)
    want = expected.pop(name, None)
    if want is not None and quantize is not None and got.dtype == FP8:
        want, scales[name + SCALE_SUFFIX] = quantize_weight(quantize, want)
    return want


def _stream_check(chunks, cfg, bucket_bytes: int, reuse_buffers: bool,
                  quantize: BlockFP8 | None = None) -> tuple[str, bool]:
    """A stream row's check: one more stream through the plan and buffers the timed runs kept, each of its HF
    tensors compared bit for bit with :func:`_expected_hf_tensors` (quantized one by one where the stream
    quantizes), and none missing or extra."""
    from weightstream.streaming.stream import stream_hf_weights

    expected = _expected_hf_tensors(chunks, cfg)
    scales: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    same = 0
    for bucket in stream_hf_weights(chunks, cfg, bucket_bytes=bucket_bytes, reuse_buffers=reuse_buffers,
                                    quantize=quantize):
        for name, got in bucket.named_tensors():
            want = _want(expected, scales, name, got, quantize)
            if want is None:
                problems.append(f"{name}: streamed but not expected")
            elif want.dtype != got.dtype or want.shape != got.shape or not torch.equal(
                    want.contiguous().view(torch.uint8), got.contiguous().view(torch.uint8)):
                problems.append(f"{name}: differs")
            else:
                same += 1
    problems += [f"{name}: not streamed" for name in [*expected, *scales]]
    text = f"{same} HF tensors of one more stream bit-identical to the converter applied to each parameter directly"
    if quantize is not None:
        text += " (and quantized one by one)"
    if problems:
        text += f"; {len(problems)} problems: " + "; ".join(problems[:5])
    return text, not problems


def update_job(cfg_dir: str, url: str | list[str], transport: str, bucket_bytes: int, dtype: str, repeats: int,
               load: bool = False, ahead: bool = True, tp: int = 1, ep: int = 1, prepare: bool = False,
               direct: bool = True, quantize: BlockFP8 | None = None) -> dict:
    """Trainer rank (one device each, TP ``tp`` × EP ``ep``): update the engine (``url``: or every engine of a
    list, at once) cold then ``repeats`` warm; report each.
    ``load``: the trainer's weights are the checkpoint in ``cfg_dir`` (else Megatron's random initialisation).
    ``quantize``: in block FP8, into an engine whose model is (the IPC ceiling then the copy of the bf16 bytes
    read, as on stream rows)."""
    from weightstream.models.spec import load_hf_config
    from weightstream.update import WeightSync

    cfg = load_hf_config(cfg_dir)
    chunks, device = _trainer(cfg, dtype, tp, ep)
    if load:
        from weightstream.checks.megatron_models import load_hf_weights
        from weightstream.common.hf_files import CheckpointReader

        with CheckpointReader(cfg_dir) as reader:
            load_hf_weights(chunks, cfg, reader)
    # WEIGHTSTREAM_BENCH_FRESH_BUFFERS=1: a new buffer per bucket instead of the two kept ones (to compare).
    reuse = os.environ.get("WEIGHTSTREAM_BENCH_FRESH_BUFFERS", "0") != "1"
    urls = [url] if isinstance(url, str) else list(url)
    with WeightSync(urls, transport=transport, bucket_bytes=bucket_bytes, timeout_s=300,
                    reuse_buffers=reuse, metadata_ahead=ahead, direct=direct, quantize=quantize) as sync:
        prepared = None
        if prepare:
            ((prepared, _),), _ = _timed(device, 1, lambda: sync.prepare(chunks, cfg))
        runs: list[tuple[float, Any]] = []
        engine: list[dict[str, float]] = []
        peak: int | None = None
        for _ in range(repeats + 1):
            (one,), extra = _timed(device, 1, lambda: sync.update(chunks, cfg))
            runs.append(one)
            peak = extra if peak is None or extra is None else max(peak, extra)
            engine.append(_engine_phases(urls[0]) if dist.get_rank() == 0 else {})
        reshard = _reshard_pairs(sync.sinks.get("p2p"))
    verified = _checksummed_update(chunks, cfg, urls, transport, bucket_bytes, ahead, quantize)
    reports = [{"wall": t, "transport": rep.transport, "bytes": rep.bytes, "buckets": rep.buckets,
                "tensors": rep.tensors, "seconds": rep.seconds, "direct": rep.direct, "engine": phases}
               for (t, rep), phases in zip(runs, engine, strict=True)]
    read = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    ceiling = (copy_ceiling(reports[-1]["bytes"] if quantize is None else read, bucket_bytes, device, repeats)
               if transport == "ipc" else None)
    from weightstream.checks.megatron_models import megatron_logits

    logits: torch.Tensor | str
    try:
        if quantize is not None:
            _as_served(chunks, cfg, quantize)
        logits = megatron_logits(chunks, torch.tensor(IDS), cfg.vocab_size).float().cpu()
    except Exception as exc:  # noqa: BLE001 -- e.g. Megatron's MoE router needs Transformer Engine on GPUs
        logits = f"the Megatron model's own forward failed: {type(exc).__name__}: {exc}"
    return {"device": str(device), "reports": reports, "peak_extra_bytes": peak, "copy_ceiling_s": ceiling,
            "prepare_s": prepared, "logits": logits, "verified": verified, "reshard": reshard}


def _engine_phases(url: str) -> dict[str, float]:
    """Where the last update's time went on the engine's rank 0 (untimed; empty where it cannot say)."""
    from weightstream.engines import ReferenceEngine

    try:
        return ReferenceEngine(url).update_phases()[0]
    except Exception as exc:  # noqa: BLE001 -- a row without the engine's split, said so in the log
        print(f"weightstream bench: the engine's phases could not be read: {exc}", flush=True)
        return {}


def _reshard_pairs(sink: Any) -> tuple[int, list[tuple[int, int, int]]] | None:
    """A resharded P2P update's plan as bytes per pair: (senders, [(sender, engine rank, bytes of every bucket)]);
    None where the sink did not reshard (or each trainer rank sent its bucket to its own engine rank only)."""
    from weightstream.sinks.reshard import ReshardSink

    if not isinstance(sink, ReshardSink) or sink.roster is None or all(sink.identity):
        return None
    totals: dict[tuple[int, int], int] = {}
    for routes in sink.routes:
        for r in routes:
            totals[(r.sender, r.engine_rank)] = totals.get((r.sender, r.engine_rank), 0) + r.nbytes
    return len(sink.roster.senders), [(s, e, n) for (s, e), n in sorted(totals.items())]


def _as_served(chunks, cfg, quantize: BlockFP8) -> None:
    """The trainer's weights replaced by those a block-FP8 engine serves (each FP8 tensor ``fp8 × scale`` in the
    model's dtype, as the stream quantizes it), so that the Megatron model's own forward is the reference for the
    engine's logits. Held in host memory until loaded (next to a colocated engine a second copy of the model does
    not fit the device)."""
    from weightstream.checks.megatron_models import load_hf_weights
    from weightstream.streaming.stream import stream_hf_weights

    dtype = next(chunks[0].parameters()).dtype
    served: dict[str, torch.Tensor] = {}
    for bucket in stream_hf_weights(chunks, cfg, quantize=quantize):
        named = dict(bucket.named_tensors())
        for name, t in named.items():
            if t.dtype == FP8:
                served[name] = dequantize_block_fp8(t, named[name + SCALE_SUFFIX], quantize.block, dtype=dtype).cpu()
            elif not name.endswith(SCALE_SUFFIX):
                served[name] = t.cpu()
    load_hf_weights(chunks, cfg, served)


def _checksummed_update(chunks, cfg, urls: list[str], transport: str, bucket_bytes: int, ahead: bool,
                        quantize: BlockFP8 | None = None) -> str | None:
    """One more update of the same weights, untimed, with checksums: the engine checks every bucket it
    receives against the trainer's checksum of it. None when it passed, else why not."""
    from weightstream.update import WeightSync

    try:
        with WeightSync(urls, transport=transport, bucket_bytes=bucket_bytes, timeout_s=300, checksums=True,
                        metadata_ahead=ahead, quantize=quantize) as sync:
            sync.update(chunks, cfg)
    except Exception as exc:  # noqa: BLE001 -- the row reports it and fails
        return f"{type(exc).__name__}: {exc}"
    return None


def _logits_tolerance(dtype: str, scale: float) -> float:
    """How far the engine's logits (transformers' arithmetic) may be from the Megatron model's own forward
    with the same weights: float32 agrees to rounding; in bf16 the two implementations round differently
    layer after layer (0.29 on logits up to 6.9 seen for Qwen3-8B), while one wrong tensor moves logits by
    about their own scale."""
    return 1e-4 * max(1.0, scale) if dtype == "float32" else 0.1 * max(1.0, scale)


def _engine_check(url: str, rank0: dict, dtype: str, quantized: bool = False) -> tuple[str, bool]:
    """The row's check after its runs: every bucket of a checksummed update verified by the engine, and the
    engine's logits within :func:`_logits_tolerance` of the Megatron model's."""
    verified = rank0["verified"]
    served = " with the weights the engine serves (each FP8 tensor fp8 x scale)" if quantized else ""
    text, ok = logits_check(url, rank0["logits"], dtype, served)
    first = ("every bucket's checksum verified by the engine on one more update" if verified is None
             else f"the checksummed update failed: {verified}")
    return f"{first}; {text}", ok and verified is None


def logits_check(url: str, ours: torch.Tensor | str, dtype: str, served: str = "") -> tuple[str, bool]:
    """The engine's logits against ``ours`` (the Megatron model's forward, or why it failed), within
    :func:`_logits_tolerance`: what was found, and whether it passed."""
    from weightstream.engines import ReferenceEngine

    if isinstance(ours, str):
        return ours, False
    try:
        theirs = ReferenceEngine(url).logits(IDS).float()
    except Exception as exc:  # noqa: BLE001 -- the row reports it and fails
        return f"the engine's logits could not be read: {exc}", False
    diff, scale = (theirs - ours).abs().max().item(), ours.abs().max().item()
    tol = _logits_tolerance(dtype, scale)
    text = (f"engine logits vs the Megatron model's{served}: max |diff| {diff:.3g} (logits up to {scale:.3g}, "
            f"{dtype}, tolerance {tol:.3g})")
    return (text if diff <= tol else f"{text}: logits differ by more than {tol:.3g}"), diff <= tol


def _wire_job(total: int, chunk: int, repeats: int, move: Callable[[torch.Tensor], object]) -> dict:
    """Best time of moving ``total`` bytes in ``chunk``-byte pieces with ``move(piece)`` on every rank
    (after one warm-up), between barriers and device synchronisations."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    buf = torch.empty(max(1, min(total, chunk)), dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        _sync(device)
        t = time.perf_counter()
        left = total
        while left > 0:
            n = min(left, chunk)
            move(buf[:n])
            left -= n
        _sync(device)
        times.append(time.perf_counter() - t)
    return {"seconds": min(times[1:]) if len(times) > 1 else times[0]}


def raw_send_recv_job(per_rank: list[int], chunk: int, repeats: int) -> dict:
    """P2P's ceiling: rank r of the first half sends ``per_rank[r]`` bytes to rank r of the second half, in
    ``chunk``-byte pieces, all pairs at once (NCCL on GPUs, gloo on CPUs)."""
    half = dist.get_world_size() // 2
    rank = dist.get_rank()
    if rank < half:
        return _wire_job(per_rank[rank], chunk, repeats, lambda piece: dist.send(piece, dst=rank + half))
    return _wire_job(per_rank[rank - half], chunk, repeats, lambda piece: dist.recv(piece, src=rank - half))


def raw_reshard_job(pairs: list[tuple[int, int, int]], senders: int, chunk: int, repeats: int) -> dict:
    """Resharded P2P's ceiling: for each ``(sender, engine rank, bytes)``, rank ``sender`` sends rank ``senders +
    engine rank`` that many bytes in ``chunk``-byte pieces; every pair at once. Best of the warm runs."""
    rank = dist.get_rank()
    mine = ([(senders + e, n, True) for s, e, n in pairs if s == rank]
            + [(s, n, False) for s, e, n in pairs if senders + e == rank])
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    buffers = [torch.empty(max(1, min(n, chunk)), dtype=torch.uint8, device=device) for _, n, _ in mine]
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        _sync(device)
        t = time.perf_counter()
        works: list[Any] = []
        for (peer, n, send), buf in zip(mine, buffers, strict=True):
            for start in range(0, n, chunk):
                piece = buf[:min(chunk, n - start)]
                works.append(dist.isend(piece, dst=peer) if send else dist.irecv(piece, src=peer))
        for w in works:
            w.wait()
        _sync(device)
        times.append(time.perf_counter() - t)
    return {"seconds": min(times[1:]) if len(times) > 1 else times[0]}


def raw_broadcast_job(total: int, chunk: int, repeats: int) -> dict:
    """The wire's ceiling: a plain broadcast of ``total`` bytes in ``chunk``-byte pieces from rank 0 to the rest."""
    return _wire_job(total, chunk, repeats, lambda piece: dist.broadcast(piece, src=0))


def run_bench(preset: str, transport: str, *, tiny: bool = False, dtype: str = "bfloat16",
              bucket_bytes: int = 512 << 20, repeats: int = 3, engine_device: str | None = None,
              reuse_buffers: bool = False, rollback: bool = True, ahead: bool = True, tp: int = 1,
              engine_tp: int | None = None, ep: int = 1, prepare: bool = False, direct: bool = True,
              quantize: BlockFP8 | None = None, replicas: int = 1, wire: str = "default") -> BenchResult:
    """One row of the benchmark table (see the module docstring)."""
    from weightstream.launch import launch

    problems = [] if transport in TRANSPORTS else [f"transport must be one of {TRANSPORTS}, got {transport!r}"]
    problems += wire_problems(wire, transport)
    if problems:
        raise ValueError("bench: " + "; ".join(problems))
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    cfg = bench_config(preset, tiny, dtype)
    label = preset + (" (tiny widths)" if tiny else "")
    res = BenchResult(label, transport, "", dtype, bucket_bytes)
    if transport == "stream":
        (r,) = launch(1, stream_job, cfg, dtype, bucket_bytes, repeats, reuse_buffers, quantize, backend=backend)
        if reuse_buffers:
            res.transport = "stream (kept buffers)"
        if quantize is not None:
            res.transport += f" (block FP8 {quantize.block[0]}x{quantize.block[1]})"
        res.device, res.cold_s, res.warm_s = r["device"], r["cold_s"], r["warm_s"]
        res.bytes, res.tensors, res.buckets = r["bytes"], r["tensors"], r["buckets"]
        res.ceiling_s, res.ceiling = r["ceiling_s"], "device copy of the same bytes into fresh buckets"
        res.peak_extra_bytes, res.phases = r["peak_extra_bytes"], r["phases"]
        res.check, res.check_ok = r["check"], r["check_ok"]
        return res
    if quantize is not None and transport == "checkpoint":
        raise ValueError("--quantize is measured on stream and update rows (not --transport checkpoint)")
    if quantize is not None:
        res.transport += f" (block FP8 {quantize.block[0]}x{quantize.block[1]})"
        cfg.quantization_config = fp8_config(cfg, quantize)
    if transport == "checkpoint":
        return _checkpoint_bench(res, cfg, dtype, bucket_bytes, repeats)
    if not rollback:
        res.transport += " (engine without rollback)"
    if not ahead:
        res.transport += " (one request per bucket)"
    if tp > 1 or ep > 1 or engine_tp not in (None, 1):
        res.transport += f" (trainer TP {tp}{f' EP {ep}' if ep > 1 else ''}, engine TP {engine_tp or tp})"
    if replicas > 1:
        res.transport += f" ({replicas} engines)"
    if wire == "socket":
        res.transport += " (NCCL socket transport over loopback)"
    res.wire = wire
    with on_wire(wire):
        return _update_bench(res, cfg, transport, dtype, bucket_bytes, repeats, engine_device, backend, rollback,
                             ahead, tp, engine_tp or tp, ep, prepare, direct, quantize, replicas)


def wire_problems(wire: str, transport: str) -> list[str]:
    """What keeps a row of ``transport`` from running on ``wire`` (:data:`WIRES`)."""
    if wire not in WIRES:
        return [f"--wire must be one of {', '.join(WIRES)}, got {wire!r}"]
    if wire == "default":
        return []
    problems = []
    if transport not in ("broadcast", "p2p"):
        problems.append(f"--wire socket times a transfer between devices (broadcast, p2p), not --transport {transport}")
    if not torch.cuda.is_available():
        problems.append("--wire socket runs NCCL on its socket transport over loopback: NCCL only, and without a "
                        "CUDA device the bench runs gloo")
    return problems


@contextmanager
def on_wire(wire: str) -> Iterator[None]:
    """Inside, every process started (trainer ranks, engines and their workers, the ceiling's ranks: each takes this
    process's environment) runs on ``wire``: for "socket", NCCL with :data:`SOCKET_WIRE`. The environment as it was
    after."""
    env = SOCKET_WIRE if wire == "socket" else {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _engine_memory(url: str) -> tuple[int | None, str]:
    """The device bytes the engine's last update added at its peak (its largest rank; None off a GPU), and where
    that update kept its rollback copies."""
    from weightstream.engines import ReferenceEngine

    ranks = ReferenceEngine(url).get("/weightstream/memory")["ranks"]
    peaks = [m["session_peak_extra_cuda_bytes"] for m in ranks if m["session_peak_extra_cuda_bytes"] is not None]
    places = sorted({f"{m['backup_place']}, {m['backup_bytes'] / 2**20:.1f} MiB" for m in ranks})
    return (max(peaks) if peaks else None), "; ".join(places)


def fp8_config(cfg, quantize: BlockFP8) -> dict:
    """The ``quantization_config`` of ``cfg``'s model in block FP8 as its family declares it: what an engine
    started on the config serves (float8 values and scales), and takes updates in."""
    from weightstream.converters.expected import expected_hf_shapes
    from weightstream.converters.registry import get_converter

    return quantize.config(get_converter(cfg.model_type).not_quantized(expected_hf_shapes(cfg)))


def _update_bench(res: BenchResult, cfg, transport: str, dtype: str, bucket_bytes: int, repeats: int,
                  engine_device: str | None, backend: str, rollback: bool = True, ahead: bool = True,
                  tp: int = 1, engine_tp: int = 1, ep: int = 1, prepare: bool = False,
                  direct: bool = True, quantize: BlockFP8 | None = None, replicas: int = 1) -> BenchResult:
    from weightstream.launch import launch

    # P2P into several engines: the trainer has a data-parallel replica per engine, each sending to its own.
    trainer_ranks = tp * ep * (replicas if transport == "p2p" else 1)
    devices = _engine_devices(engine_device, transport, trainer_ranks, engine_tp, replicas)
    with serving(cfg, devices, engine_tp, dtype, rollback) as (tmp, urls):
        ranks = launch(trainer_ranks, update_job, tmp, urls if replicas > 1 else urls[0], transport, bucket_bytes,
                       dtype, repeats, False, ahead, tp, ep, prepare, direct, quantize, backend=backend, timeout_s=600)
        r = ranks[0]
        checks = [_engine_check(url, r, dtype, quantize is not None) for url in urls]
        res.engine_peak_extra_bytes, res.engine_backup = _engine_memory(urls[0])
    res.check = "; ".join(c if replicas == 1 else f"engine {k}: {c}" for k, (c, _) in enumerate(checks))
    res.check_ok = all(ok for _, ok in checks)
    reports = r["reports"]
    res.device = f"trainer {r['device']}, engine {' and '.join(devices)}"
    res.cold_s, res.warm_s = reports[0]["wall"], [x["wall"] for x in reports[1:]]
    if transport == "ipc":
        res.transport += (" (one copy: written into the engine's weights)" if reports[-1]["direct"] else
                          " (two copies: through buffers the engine copies out of)")
    res.prepare_s = r["prepare_s"]
    best = min(reports[1:], key=lambda x: x["wall"]) if len(reports) > 1 else reports[0]
    res.bytes, res.tensors, res.buckets = best["bytes"], best["tensors"], best["buckets"]
    res.phases = {k: v for k, v in best["seconds"].items() if k != "total"}
    res.cold_phases = {k: v for k, v in reports[0]["seconds"].items() if k != "total"}
    res.engine_phases, res.engine_cold_phases = best["engine"], reports[0]["engine"]
    res.peak_extra_bytes = r["peak_extra_bytes"]
    if transport == "ipc":
        res.ceiling_s = r["copy_ceiling_s"]
        res.ceiling = "device copy of the " + ("bf16 bytes read" if quantize is not None else "same bytes")
    elif best["transport"] == "p2p":
        _p2p_ceiling(res, ranks, engine_tp, bucket_bytes, repeats, backend)
    else:
        res.ceiling_s, res.ceiling = broadcast_ceiling(res.bytes, engine_tp * replicas, bucket_bytes, repeats, backend)
    if best["transport"] != transport:
        res.transport += f" (ran as {best['transport']})"
    return res


@contextmanager
def serving(cfg, devices: list[str], engine_tp: int, dtype: str, rollback: bool = True,
            ) -> Iterator[tuple[str, list[str]]]:
    """A reference engine at TP ``engine_tp`` on each of ``devices``, started on ``cfg`` saved in a temporary
    directory (its random weights replaced by the first update): that directory and the engines' URLs; every
    engine stopped and the directory removed after."""
    from weightstream.reference_engine.server import serve, stop

    tmp = tempfile.mkdtemp(prefix="ws-bench-")
    servers = []
    try:
        cfg.save_pretrained(tmp)
        for device in devices:
            servers.append(serve(tmp, engine_tp, device=device, dtype=dtype, rollback=rollback))
        yield tmp, [x.url for x in servers]
    finally:
        for server in servers:
            stop(server)
        shutil.rmtree(tmp, ignore_errors=True)


def _p2p_ceiling(res: BenchResult, ranks: list[dict], engine_tp: int, bucket_bytes: int, repeats: int,
                 backend: str) -> None:
    """A P2P row's ceiling: plain sends of the same bytes between the same pairs of ranks, every pair at once."""
    from weightstream.launch import launch

    reshard = ranks[0]["reshard"]
    if reshard is None:
        per_rank = [x["reports"][-1]["bytes"] for x in ranks]
        res.bytes = sum(per_rank)
        res.ceiling_s, res.ceiling = send_recv_ceiling(per_rank, bucket_bytes, repeats, backend)
        return
    senders, pairs = reshard
    res.bytes = sum(n for _, _, n in pairs)
    raw = launch(senders + engine_tp, raw_reshard_job, pairs, senders, bucket_bytes, repeats, backend=backend)
    res.ceiling = (f"plain {backend} sends of the resharding plan's bytes, {len(pairs)} pairs of trainer and "
                   "engine ranks at once, same buckets")
    res.ceiling_s = max(x["seconds"] for x in raw)


def broadcast_ceiling(nbytes: int, ranks_out: int, bucket_bytes: int, repeats: int, backend: str,
                      ) -> tuple[float, str]:
    """A plain broadcast of ``nbytes`` from one rank to ``ranks_out``, in buckets of ``bucket_bytes``: its time
    (best of ``repeats``) and what it was."""
    from weightstream.launch import launch

    raw = launch(1 + ranks_out, raw_broadcast_job, nbytes, bucket_bytes, repeats, backend=backend)
    return raw[0]["seconds"], f"plain {backend} broadcast of the same bytes to {ranks_out} ranks, same buckets"


def send_recv_ceiling(per_rank: list[int], bucket_bytes: int, repeats: int, backend: str) -> tuple[float, str]:
    """Plain sends of ``per_rank[r]`` bytes from rank r to its pair, every pair at once: the slowest pair's time
    (best of ``repeats``) and what it was."""
    from weightstream.launch import launch

    raw = launch(2 * len(per_rank), raw_send_recv_job, per_rank, bucket_bytes, repeats, backend=backend)
    return (max(x["seconds"] for x in raw),
            f"plain {backend} send/recv of each rank's bytes, {len(per_rank)} pairs at once, same buckets")


def _engine_devices(engine_device: str | None, transport: str, trainer_ranks: int, engine_tp: int,
                    replicas: int) -> list[str]:
    """Where each engine's ranks sit: ``engine_device`` for every engine where given; the CPU without a GPU;
    colocated (IPC) on the trainer's GPUs, else on the GPUs after the trainer's, one engine after the other
    (round the GPUs there are)."""
    if engine_device is not None:
        return [engine_device] * replicas
    if not torch.cuda.is_available():
        return ["cpu"] * replicas
    count = torch.cuda.device_count()
    first = trainer_ranks if transport != "ipc" and count >= trainer_ranks + engine_tp * replicas else 0
    return [",".join(f"cuda:{(first + k * engine_tp + r) % count}" for r in range(engine_tp)) for k in range(replicas)]


def _checkpoint_bench(res: BenchResult, cfg, dtype: str, bucket_bytes: int, repeats: int) -> BenchResult:
    from weightstream.launch import launch

    (r,) = launch(1, checkpoint_job, cfg, dtype, bucket_bytes, repeats, backend="gloo")
    res.device = "cpu"
    res.cold_s, res.warm_s = r["cold_s"], r["warm_s"]
    res.bytes, res.tensors, res.buckets = r["bytes"], r["tensors"], r["buckets"]
    res.ceiling_s, res.ceiling = r["ceiling_s"], "safetensors.torch.save_file of the same tensors (one file)"
    res.check = f"written files equal save_file's tensors bit for bit: {r['equal']}"
    res.check_ok = bool(r["equal"])
    return res


def checkpoint_job(cfg, dtype: str, bucket_bytes: int, repeats: int) -> dict:
    from safetensors.torch import load_file, save_file

    from weightstream.common.hf_files import CheckpointReader
    from weightstream.sinks.safetensors import save_hf_checkpoint

    chunks, _ = _trainer(cfg, dtype)
    tmp = tempfile.mkdtemp(prefix="ws-bench-ckpt-")
    try:
        times: list[float] = []
        for i in range(repeats + 1):  # the report of the last one is kept
            out = os.path.join(tmp, f"ours{i % 2}")
            shutil.rmtree(out, ignore_errors=True)
            t = time.perf_counter()
            report = save_hf_checkpoint(chunks, cfg, out, bucket_bytes=bucket_bytes)
            times.append(time.perf_counter() - t)
        with CheckpointReader(out) as reader:
            tensors = {n: reader.get(n).clone() for n in reader.keys()}
        ref_times = []
        for _ in range(repeats):
            path = os.path.join(tmp, "ref.safetensors")
            t = time.perf_counter()
            save_file(tensors, path)
            ref_times.append(time.perf_counter() - t)
        ref = load_file(path)
        equal = ref.keys() == tensors.keys() and all(torch.equal(ref[n].view(-1).view(torch.uint8),
                                                                 tensors[n].reshape(-1).view(torch.uint8))
                                                     for n in ref)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return {"cold_s": times[0], "warm_s": times[1:], "bytes": nbytes, "tensors": len(tensors),
                "buckets": report.stats.buckets, "ceiling_s": min(ref_times), "equal": equal}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json(results: list[BenchResult], path: str) -> None:
    with open(path, "w") as f:
        json.dump([r.as_dict() for r in results], f, indent=1)


def plot(results: list[BenchResult], path: str) -> str:
    """Bars: ours vs ceiling per row. Needs matplotlib; says so where it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot written (pip install matplotlib)"
    import textwrap

    labels = ["\n".join(textwrap.wrap(f"{r.preset}: {r.transport}", 24)) for r in results]
    xs = range(len(results))
    fig, ax = plt.subplots(figsize=(max(4, 2.2 * len(results)), 4.6))
    ours = ax.bar([x - 0.2 for x in xs], [r.best_s * 1e3 for r in results], width=0.4, label="weightstream")
    ax.bar([x + 0.2 for x in xs], [r.ceiling_s * 1e3 for r in results], width=0.4, label="ceiling, same run")
    ax.bar_label(ours, labels=[f"{r.ratio:.2f}x" for r in results], fontsize=8)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return f"plot written to {path}"

