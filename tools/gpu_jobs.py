"""Correctness on the GPU machine, run by tools/gpu_run.sh: a trainer on GPU 0 updates the reference engine
(tiny Qwen3, float32) by IPC (engine on GPU 0) and by NCCL broadcast (engine on GPU 1); the engine's logits
then equal the HF model's loaded from the trainer's checkpoint. Speed is measured by ``weightstream bench``."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

import torch

from weightstream.bench.speed import update_job
from weightstream.launch import launch
from weightstream.models.presets import preset_config, save_random_checkpoint

IDS = [[3, 14, 159, 265, 358, 979, 323, 846, 26, 433]]


def hf_logits(model_dir: str):
    """The HF model of ``model_dir`` (float32, on GPU 0) and its logits of ``IDS``, on the CPU."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        return hf(torch.tensor(IDS).cuda()).logits.float().cpu(), hf


def check_transport(tmp: str, transport: str, engine_device: str, direct: bool = True) -> dict:
    from weightstream.engines import ReferenceEngine
    from weightstream.reference_engine.server import serve, stop

    cfg = preset_config("tiny-qwen3")
    src = save_random_checkpoint(cfg, os.path.join(tmp, "src"), seed=1)
    eng_dir = save_random_checkpoint(cfg, os.path.join(tmp, "eng"), seed=2)
    server = serve(eng_dir, 1, device=engine_device)
    try:
        before = ReferenceEngine(server.url).logits(IDS)
        (res,) = launch(1, update_job, src, server.url, transport, 100_000, "float32", 1, True, True, 1, 1, False,
                        direct, backend="nccl", timeout_s=180)
        after = ReferenceEngine(server.url).logits(IDS)
    finally:
        stop(server)
    ref, _ = hf_logits(src)
    return {"transport": res["reports"][-1]["transport"], "direct": [r["direct"] for r in res["reports"]],
            "max_diff_after": (after - ref).abs().max().item(),
            "max_diff_before": (before - ref).abs().max().item(), "updates": len(res["reports"])}


def release_job(src: str, url: str) -> dict:
    """Trainer: an update written into the engine's weights, then the engine releases its weights (the trainer
    lets go of its mapping of them first), then an update into the re-created weights; the engine's CUDA
    memory at each step."""
    from weightstream.bench.speed import _trainer
    from weightstream.checks.megatron_models import load_hf_weights
    from weightstream.common.hf_files import CheckpointReader
    from weightstream.engines import ReferenceEngine
    from weightstream.models.spec import load_hf_config
    from weightstream.update import WeightSync

    cfg = load_hf_config(src)
    chunks, _ = _trainer(cfg, "float32")
    with CheckpointReader(src) as reader:
        load_hf_weights(chunks, cfg, reader)
    eng = ReferenceEngine(url)

    def allocated() -> int:
        return sum(r["cuda_allocated_bytes"] for r in eng.get("/weightstream/memory")["ranks"])

    out = {}
    with WeightSync([url], transport="ipc", bucket_bytes=1 << 20) as sync:
        out["first_direct"] = sync.update(chunks, cfg).direct
        out["engine_bytes_before"] = allocated()
        sync.release_memory(["weights"])
        out["engine_bytes_released"] = allocated()
        out["second_direct"] = sync.update(chunks, cfg).direct
        out["engine_bytes_after"] = allocated()
    return out


def check_release(tmp: str) -> dict:
    """Direct writes and memory release on the GPU: releasing frees the engine's weights although a trainer had
    them mapped, and the next update writes into the re-created ones (logits vs HF after it)."""
    from transformers import Qwen3Config

    from weightstream.engines import ReferenceEngine
    from weightstream.reference_engine.server import serve, stop

    cfg = Qwen3Config(vocab_size=4096, hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=128, tie_word_embeddings=False)
    src = save_random_checkpoint(cfg, os.path.join(tmp, "src"), seed=3)
    eng_dir = save_random_checkpoint(cfg, os.path.join(tmp, "eng"), seed=4)
    server = serve(eng_dir, 1, device="cuda:0")
    try:
        (res,) = launch(1, release_job, src, server.url, backend="nccl", timeout_s=300)
        after = ReferenceEngine(server.url).logits(IDS)
    finally:
        stop(server)
    ref, hf = hf_logits(src)
    weights = sum(p.numel() * p.element_size() for p in hf.parameters())
    return {**res, "weights_bytes": weights, "max_diff_after": (after - ref).abs().max().item()}


def ipc_trainer_job(src: str, url: str, die: bool) -> dict:
    """One trainer process: its weights from ``src``, one IPC update into the engine; ``die``: exit at once
    after it, without closing anything (as a crashed trainer)."""
    from weightstream.bench.speed import _trainer
    from weightstream.checks.megatron_models import load_hf_weights
    from weightstream.common.hf_files import CheckpointReader
    from weightstream.models.spec import load_hf_config
    from weightstream.update import update_weights

    cfg = load_hf_config(src)
    chunks, _ = _trainer(cfg, "float32")
    with CheckpointReader(src) as reader:
        load_hf_weights(chunks, cfg, reader)
    report = update_weights(chunks, cfg, url, transport="ipc", bucket_bytes=1 << 20, timeout_s=60)
    if die:
        os._exit(9)
    return {"direct": report.direct, "transport": report.transport}


def check_separate_trainers(tmp: str, trainers: int = 4) -> dict:
    """CUDA IPC across trainers' lives: separate trainer processes one after another update one engine (one
    of them dies right after its update without closing anything); after each, the engine's logits equal the
    HF model's of that trainer's weights, and its allocated memory stays what it was."""
    from weightstream.engines import ReferenceEngine
    from weightstream.launch import LaunchError
    from weightstream.reference_engine.server import serve, stop

    cfg = preset_config("tiny-qwen3")
    eng_dir = save_random_checkpoint(cfg, os.path.join(tmp, "eng"), seed=2)
    server = serve(eng_dir, 1, device="cuda:0")
    eng = ReferenceEngine(server.url)
    rows = []
    try:
        for i in range(trainers):
            src = save_random_checkpoint(cfg, os.path.join(tmp, f"src{i}"), seed=20 + i)
            die = i == 1
            try:
                (res,) = launch(1, ipc_trainer_job, src, server.url, die, backend="nccl", timeout_s=180)
            except LaunchError as exc:
                res = {"died": die, "error": str(exc).splitlines()[0]}
            time.sleep(1.5)  # the engine lets go of a departed trainer within 1 s
            ref, _ = hf_logits(src)
            diff = (eng.logits(IDS) - ref).abs().max().item()  # its first forward's allocations come first
            memory = eng.get("/weightstream/memory")["ranks"]
            rows.append({**res, "max_diff": diff, "engine_allocated": sum(r["cuda_allocated_bytes"] for r in memory)})
    finally:
        stop(server)
    return {"trainers": rows, "ok": all(r["max_diff"] == 0.0 for r in rows)
            and len({r["engine_allocated"] for r in rows}) == 1}


def nonfinite_job(src: str, url: str) -> dict:
    """Trainer: three updates written into the engine's weights, by copies that check what they write: the
    checkpoint's weights; then with NaN put in one weight and an infinity in another (the engine serves them and
    names both, or refuses the update where it refuses them); then the checkpoint's weights again."""
    from weightstream.bench.speed import _trainer
    from weightstream.checks.megatron_models import load_hf_weights
    from weightstream.common.hf_files import CheckpointReader
    from weightstream.engines import ReferenceEngine
    from weightstream.errors import UpdateError
    from weightstream.models.spec import load_hf_config
    from weightstream.update import WeightSync

    cfg = load_hf_config(src)
    chunks, _ = _trainer(cfg, "float32")
    with CheckpointReader(src) as reader:
        load_hf_weights(chunks, cfg, reader)
    eng = ReferenceEngine(url)
    params = dict(chunks[0].named_parameters())
    fc2 = params["decoder.layers.0.mlp.linear_fc2.weight"]  # model.layers.0.mlp.down_proj.weight
    qkv = params["decoder.layers.1.self_attention.linear_qkv.weight"]  # strided into q, k and v
    out: dict = {"updates": []}
    with WeightSync([url], transport="ipc", bucket_bytes=1 << 20) as sync:
        for step in ("clean", "nonfinite", "clean again"):
            saved = (fc2[3, 5].item(), qkv[7, 2].item())
            if step == "nonfinite":
                with torch.no_grad():
                    fc2[3, 5], qkv[7, 2] = float("nan"), float("inf")
            try:
                report = sync.update(chunks, cfg)
                row = {"step": step, "direct": report.direct}
            except UpdateError as exc:
                row = {"step": step, "refused": str(exc)[:2000]}
            with torch.no_grad():
                fc2[3, 5], qkv[7, 2] = saved
            memory = eng.get("/weightstream/memory")["ranks"][0]
            row["checked_writes"] = memory["checked_writes"]
            row["engine_logits_finite"] = bool(torch.isfinite(eng.logits(IDS)).all())
            out["updates"].append(row)
    return out


def check_nonfinite(tmp: str) -> dict:
    """Writes into the engine's weights checked by the trainer's copies (the export's flag): an update with NaN and
    an infinity in two weights is served and named by the engine, and refused whole (logits as before it) by an
    engine that refuses them; the clean update after it loads, bit for bit (logits vs HF)."""
    from weightstream.engines import ReferenceEngine
    from weightstream.receiver.values import LoadChecks
    from weightstream.reference_engine.server import serve, stop

    cfg = preset_config("tiny-qwen3")
    src = save_random_checkpoint(cfg, os.path.join(tmp, "src"), seed=5)
    eng_dir = save_random_checkpoint(cfg, os.path.join(tmp, "eng"), seed=6)
    ref, _ = hf_logits(src)
    rows = {}
    for refuse in (False, True):
        server = serve(eng_dir, 1, device="cuda:0", checks=LoadChecks(refuse_nonfinite=refuse))
        try:
            (res,) = launch(1, nonfinite_job, src, server.url, backend="nccl", timeout_s=300)
            res["max_diff_after"] = (ReferenceEngine(server.url).logits(IDS) - ref).abs().max().item()
        finally:
            stop(server)
        rows["refuse_nonfinite" if refuse else "serve_nonfinite"] = res
    served, refused = rows["serve_nonfinite"]["updates"], rows["refuse_nonfinite"]["updates"]
    rows["ok"] = ([u["checked_writes"] for u in served] == [1, 2, 3] and "refused" not in served[1]
                  and not served[1]["engine_logits_finite"] and "refused" in refused[1]
                  and all(n in refused[1]["refused"] for n in ("layers.0.mlp.down_proj", "layers.1.self_attn.q_proj"))
                  and refused[1]["engine_logits_finite"] and all(r["max_diff_after"] == 0.0 for r in
                                                                 (rows["serve_nonfinite"], rows["refuse_nonfinite"])))
    return rows


def check_piece_copy() -> dict:
    """PieceCopy on this GPU: bit for bit what copy_ gives (odd offsets, three dtypes), and the time of one
    launch against _foreach_copy_ and one plain copy of the same bytes (2,000 expert-sized tensors)."""
    from weightstream.streaming.copies import PieceCopy

    out: dict = {}
    gen = torch.Generator(device="cuda").manual_seed(3)
    for dtype in (torch.bfloat16, torch.float32, torch.int8):
        pool = torch.randint(-100, 100, (3_000_000,), generator=gen, device="cuda").to(dtype)
        sizes = [1, 7, 4096, 1_000_003, 3, 500_000, 777_777]
        src, dst, at = [], [], 1
        target = torch.zeros(pool.numel(), dtype=dtype, device="cuda")
        for n in sizes:
            src.append(pool[at:at + n])
            dst.append(target[at + 2:at + 2 + n])
            at += n + 5
        PieceCopy(dst, src)()
        expect = torch.zeros_like(target)
        for d, s in zip(dst, src, strict=True):
            expect[d.storage_offset():d.storage_offset() + d.numel()].copy_(s)
        out[f"exact_{dtype}"] = bool(torch.equal(target.view(torch.uint8), expect.view(torch.uint8)))
    n, numel = 2000, 1_572_864  # 3 MiB bf16 each, as the experts of Qwen3-30B-A3B
    srcs = [torch.randn(numel, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    flat = torch.empty(n * numel, device="cuda", dtype=torch.bfloat16)
    dsts = list(flat.split(numel))
    piece = PieceCopy(dsts, srcs)
    big_src = torch.empty_like(flat)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return min(times)

    out["bytes"] = flat.numel() * 2
    out["piece_copy_s"] = best(piece)
    out["exact_timed"] = all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))
    out["foreach_copy_s"] = best(lambda: torch._foreach_copy_(dsts, srcs))
    out["one_copy_s"] = best(lambda: flat.copy_(big_src))
    return out


def main() -> None:
    out = os.environ.get("OUT", ".")
    results: dict = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
                     "torch": torch.__version__}
    tmp = tempfile.mkdtemp()
    try:
        try:
            results["piece_copy"] = check_piece_copy()
        except Exception as exc:  # noqa: BLE001 -- reported; the transport checks still run
            results["piece_copy"] = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(results["piece_copy"]), flush=True)
        results["check_ipc"] = check_transport(os.path.join(tmp, "c1"), "ipc", "cuda:0")
        print(json.dumps(results["check_ipc"]), flush=True)
        results["check_ipc_buffers"] = check_transport(os.path.join(tmp, "c3"), "ipc", "cuda:0", direct=False)
        print(json.dumps(results["check_ipc_buffers"]), flush=True)
        try:
            results["check_trainers"] = check_separate_trainers(os.path.join(tmp, "c5"))
        except Exception as exc:  # noqa: BLE001 -- reported; the rest still runs
            results["check_trainers"] = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(results["check_trainers"]), flush=True)
        try:
            results["check_nonfinite"] = check_nonfinite(os.path.join(tmp, "c6"))
        except Exception as exc:  # noqa: BLE001 -- reported; the rest still runs
            results["check_nonfinite"] = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(results["check_nonfinite"]), flush=True)
        try:
            results["check_release"] = check_release(os.path.join(tmp, "c4"))
        except Exception as exc:  # noqa: BLE001 -- reported; the rest still runs
            results["check_release"] = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(results["check_release"]), flush=True)
        if torch.cuda.device_count() > 1:
            results["check_broadcast"] = check_transport(os.path.join(tmp, "c2"), "broadcast", "cuda:1")
            print(json.dumps(results["check_broadcast"]), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        with open(os.path.join(out, "gpu_check.json"), "w") as f:
            json.dump(results, f, indent=2, default=str)


if __name__ == "__main__":
    sys.exit(main())
