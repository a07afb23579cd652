"""Jobs run on the GPU machine by tools/gpu_run.sh: correctness of IPC and NCCL broadcast into the
reference engine (tiny Qwen3), and benchmarks with the Qwen3-8B shape, each against the raw ceiling
of the same machine in the same run."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from weightstream.launch import launch
from weightstream.models.megatron import build_gpt_model, initialize_parallel, load_hf_weights
from weightstream.models.presets import preset_config, save_random_checkpoint

IDS = [[3, 14, 159, 265, 358, 979, 323, 846, 26, 433]]


def _trainer(src_or_preset: str, dtype: str, load: bool):
    initialize_parallel(1, 1)
    cfg = preset_config(src_or_preset) if not os.path.isdir(src_or_preset) else src_or_preset
    chunks = build_gpt_model(cfg, dtype=getattr(torch, dtype))
    if load:
        from weightstream.disk import CheckpointReader

        with CheckpointReader(src_or_preset) as r:
            load_hf_weights(chunks, src_or_preset, r)
    return cfg, chunks


def update_job(src: str, url: str, transport: str, bucket_bytes: int, dtype: str, load: bool, repeats: int) -> dict:
    """Trainer rank (one GPU): build, then update the engine ``repeats`` times; report each."""
    from weightstream.update import WeightSync

    cfg, chunks = _trainer(src, dtype, load)
    torch.cuda.synchronize()
    reports = []
    with WeightSync([url], transport=transport, bucket_bytes=bucket_bytes, timeout_s=300) as sync:
        for _ in range(repeats):
            torch.cuda.synchronize()
            t = time.perf_counter()
            rep = sync.update(chunks, cfg)
            torch.cuda.synchronize()
            reports.append({"wall": time.perf_counter() - t, "transport": rep.transport, "reason": rep.reason,
                            "bytes": rep.bytes, "buckets": rep.buckets, "tensors": rep.tensors,
                            "seconds": rep.seconds, "version": rep.weight_version})
    return {"reports": reports, "peak_gb": torch.cuda.max_memory_allocated() / 1e9}


def stream_job(preset: str, bucket_bytes: int, dtype: str, repeats: int) -> dict:
    """Stream (no sink) a randomly initialised model on one GPU; ceiling: device copy of the same bytes."""
    from weightstream.streaming.stream import stream_hf_weights

    cfg, chunks = _trainer(preset, dtype, load=False)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times, total, buckets, setup = [], 0, 0, 0.0
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        s = stream_hf_weights(chunks, cfg, bucket_bytes=bucket_bytes)
        for b in s:
            pass
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        total, buckets, setup = s.stats.bytes, s.stats.buckets, s.stats.setup_seconds
    peak_extra = torch.cuda.max_memory_allocated() - base
    # Ceiling: copy the same bytes device to device, bucket by bucket.
    src = torch.empty(bucket_bytes, dtype=torch.uint8, device="cuda")
    ctimes = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        left = total
        while left > 0:
            n = min(left, bucket_bytes)
            dst = torch.empty(n, dtype=torch.uint8, device="cuda")
            dst.copy_(src[:n])
            left -= n
        torch.cuda.synchronize()
        ctimes.append(time.perf_counter() - t)
    return {"bytes": total, "buckets": buckets, "setup_s": setup, "stream_s": min(times), "copy_s": min(ctimes),
            "ratio": min(times) / min(ctimes), "peak_extra_gb": peak_extra / 1e9, "bucket_gb": bucket_bytes / 1e9}


def raw_broadcast_job(total: int, chunk: int, repeats: int) -> dict:
    """Ceiling of the wire: plain NCCL broadcast of ``total`` bytes in ``chunk``-byte pieces, rank 0 -> 1."""
    buf = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        torch.cuda.synchronize()
        t = time.perf_counter()
        left = total
        while left > 0:
            n = min(left, chunk)
            dist.broadcast(buf[:n], src=0)
            left -= n
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return {"seconds": min(times[1:]), "gbps": total / min(times[1:]) / 1e9}


def check_transport(tmp: str, transport: str, engine_device: str) -> dict:
    """Tiny Qwen3: update an engine on ``engine_device`` from a trainer on GPU 0; compare its logits
    with the HF model loaded from the source checkpoint."""
    from transformers import AutoModelForCausalLM

    from weightstream.engine.server import serve, stop
    from weightstream.streaming.adapters import ReferenceEngine

    cfg = preset_config("tiny-qwen3")
    src = save_random_checkpoint(cfg, os.path.join(tmp, "src"), seed=1)
    eng_dir = save_random_checkpoint(cfg, os.path.join(tmp, "eng"), seed=2)
    print(f"  starting engine on {engine_device}", flush=True)
    server = serve(eng_dir, 1, device=engine_device)
    print(f"  engine up at {server.url}", flush=True)
    try:
        before = ReferenceEngine(server.url).logits(IDS)
        (res,) = launch(1, update_job, src, server.url, transport, 100_000, "float32", True, 1, backend="nccl",
                        timeout_s=180)
        after = ReferenceEngine(server.url).logits(IDS)
    finally:
        stop(server)
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        ref = hf(torch.tensor(IDS).cuda()).logits.float().cpu()
    return {"transport": res["reports"][0]["transport"], "reason": res["reports"][0]["reason"],
            "max_diff_after": (after - ref).abs().max().item(), "max_diff_before": (before - ref).abs().max().item()}


def bench_update(tmp: str, transport: str, engine_device: str, bucket_bytes: int, repeats: int) -> dict:
    """Qwen3-8B shape, bf16: trainer on GPU 0 -> engine on ``engine_device``."""
    from weightstream.engine.server import serve, stop

    cfg = preset_config("qwen3-8b")
    d = os.path.join(tmp, "q8b")
    os.makedirs(d, exist_ok=True)
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(d)
    server = serve(d, 1, device=engine_device, dtype="bfloat16")
    try:
        (res,) = launch(1, update_job, "qwen3-8b", server.url, transport, bucket_bytes, "bfloat16", False, repeats,
                        backend="nccl")
    finally:
        stop(server)
    return res


def main() -> None:
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ.get("GPU_JOBS_DEADLINE", "500")), exit=True)
    out = os.environ.get("OUT", ".")
    what = sys.argv[1:] or ["check", "stream", "update"]
    results: dict = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
                     "torch": torch.__version__}
    tmp = tempfile.mkdtemp()
    try:
        if "check" in what:
            results["check_ipc"] = check_transport(os.path.join(tmp, "c1"), "ipc", "cuda:0")
            print(json.dumps(results["check_ipc"]), flush=True)
            if torch.cuda.device_count() > 1:
                results["check_broadcast"] = check_transport(os.path.join(tmp, "c2"), "broadcast", "cuda:1")
                print(json.dumps(results["check_broadcast"]), flush=True)
        if "stream" in what:
            (r,) = launch(1, stream_job, "qwen3-8b", 512 << 20, "bfloat16", 3, backend="nccl")
            results["stream_qwen3_8b"] = r
            print(json.dumps(r), flush=True)
        if "update" in what:
            r = bench_update(tmp, "ipc", "cuda:0", 512 << 20, 2)
            results["update_ipc_qwen3_8b"] = r
            print(json.dumps(r), flush=True)
            if torch.cuda.device_count() > 1:
                r = bench_update(tmp, "broadcast", "cuda:1", 512 << 20, 2)
                results["update_broadcast_qwen3_8b"] = r
                print(json.dumps(r), flush=True)
                total = r["reports"][-1]["bytes"]
                raw = launch(2, raw_broadcast_job, total, 512 << 20, 3, backend="nccl")
                results["raw_broadcast_same_bytes"] = raw[0]
                print(json.dumps(raw[0]), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        with open(os.path.join(out, "gpu_results.json"), "w") as f:
            json.dump(results, f, indent=2, default=str)


if __name__ == "__main__":
    main()
