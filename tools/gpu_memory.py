"""On the GPU machine (tools/gpu_run.sh memory): the reference engine's GPU memory before and after
releasing its weights, after resuming them, and after an update that reloads them; the engine's logits
then equal the HF model's (tiny Qwen3 in float32, and the Qwen3-8B shape in bf16 for the memory figures)."""

from __future__ import annotations

import json
import os
import tempfile

import torch

from weightstream.bench.speed import update_job
from weightstream.engines import ReferenceEngine
from weightstream.launch import launch
from weightstream.models.presets import preset_config, save_random_checkpoint
from weightstream.reference_engine.server import serve, stop

IDS = [[3, 14, 159, 265, 358, 979, 323, 846, 26, 433]]


def cycle(model_dir: str, src: str | None, dtype: str) -> dict:
    server = serve(model_dir, 1, device="cuda:0", dtype=dtype)
    try:
        eng = ReferenceEngine(server.url)
        out = {"before": eng.get("/weightstream/memory")}
        eng.release_memory(["weights", "kv_cache"])
        out["released"] = eng.get("/weightstream/memory")
        eng.resume_memory(["weights"])
        out["resumed"] = eng.get("/weightstream/memory")
        if src is not None:
            (res,) = launch(1, update_job, src, server.url, "ipc", 100_000, dtype, 0, True, backend="nccl",
                            timeout_s=180)
            out["after_update"] = eng.get("/weightstream/memory")
            got = eng.logits(IDS)
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).cuda().eval()
            with torch.no_grad():
                ref = hf(torch.tensor(IDS).cuda()).logits.float().cpu()
            out["logits_max_diff_vs_hf"] = (got - ref).abs().max().item()
        return out
    finally:
        stop(server)


def main() -> None:
    tmp = tempfile.mkdtemp()
    cfg = preset_config("tiny-qwen3")
    src = save_random_checkpoint(cfg, os.path.join(tmp, "src"), seed=1)
    eng = save_random_checkpoint(cfg, os.path.join(tmp, "eng"), seed=2)
    results = {"tiny-qwen3": cycle(eng, src, "float32")}
    big = preset_config("qwen3-8b")
    big.dtype = "bfloat16"
    big.save_pretrained(os.path.join(tmp, "q8b"))
    results["qwen3-8b"] = cycle(os.path.join(tmp, "q8b"), None, "bfloat16")
    print(json.dumps(results, indent=1))
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_memory.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
