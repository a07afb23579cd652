"""Correctness on the GPU machine, run by tools/gpu_run.sh: a trainer on GPU 0 updates the reference engine
(tiny Qwen3, float32) by IPC (engine on GPU 0) and by NCCL broadcast (engine on GPU 1); the engine's logits
then equal the HF model's loaded from the trainer's checkpoint. Speed is measured by ``weightstream bench``."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import torch

from weightstream.bench.speed import update_job
from weightstream.launch import launch
from weightstream.models.presets import preset_config, save_random_checkpoint

IDS = [[3, 14, 159, 265, 358, 979, 323, 846, 26, 433]]


def check_transport(tmp: str, transport: str, engine_device: str) -> dict:
    from transformers import AutoModelForCausalLM

    from weightstream.engine.server import serve, stop
    from weightstream.streaming.adapters import ReferenceEngine

    cfg = preset_config("tiny-qwen3")
    src = save_random_checkpoint(cfg, os.path.join(tmp, "src"), seed=1)
    eng_dir = save_random_checkpoint(cfg, os.path.join(tmp, "eng"), seed=2)
    server = serve(eng_dir, 1, device=engine_device)
    try:
        before = ReferenceEngine(server.url).logits(IDS)
        (res,) = launch(1, update_job, src, server.url, transport, 100_000, "float32", 1, True, backend="nccl",
                        timeout_s=180)
        after = ReferenceEngine(server.url).logits(IDS)
    finally:
        stop(server)
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        ref = hf(torch.tensor(IDS).cuda()).logits.float().cpu()
    return {"transport": res["reports"][-1]["transport"], "max_diff_after": (after - ref).abs().max().item(),
            "max_diff_before": (before - ref).abs().max().item(), "updates": len(res["reports"])}


def main() -> None:
    out = os.environ.get("OUT", ".")
    results: dict = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
                     "torch": torch.__version__}
    tmp = tempfile.mkdtemp()
    try:
        results["check_ipc"] = check_transport(os.path.join(tmp, "c1"), "ipc", "cuda:0")
        print(json.dumps(results["check_ipc"]), flush=True)
        if torch.cuda.device_count() > 1:
            results["check_broadcast"] = check_transport(os.path.join(tmp, "c2"), "broadcast", "cuda:1")
            print(json.dumps(results["check_broadcast"]), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        with open(os.path.join(out, "gpu_check.json"), "w") as f:
            json.dump(results, f, indent=2, default=str)


if __name__ == "__main__":
    sys.exit(main())
