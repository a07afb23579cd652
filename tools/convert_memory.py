"""Peak memory of ``weightstream convert`` on a preset's shape, against the size of its largest layer.

A real Megatron-Core job (PP ranks, gloo, CPU) builds the preset with random weights and writes it in the
legacy per-rank layout, one stage at a time (so the machine holds one stage, not the model); then
``weightstream convert`` reads it in one fresh process and writes the HF checkpoint; its summary line (peak
RSS, largest layer, largest tensor) is printed and written to ``--json``.

    PYTHONPATH=. python tools/convert_memory.py --preset qwen3-8b --pp 8 --work /tmp/convert-mem --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import time
from argparse import Namespace


def save_stages(preset: str, pp: int, root: str, dtype: str) -> float:
    """On every rank of a PP job: build this stage, write its legacy file, free it; one stage at a time."""
    import torch
    import torch.distributed as dist

    from tests.helpers.megatron_saves import save_legacy
    from weightstream.checks.megatron_models import build_gpt_model, initialize_parallel
    from weightstream.models.presets import preset_config

    initialize_parallel(1, pp)
    cfg = preset_config(preset)
    args = Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp,
                     virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=1,
                     expert_tensor_parallel_size=1, num_layers=cfg.num_hidden_layers, ckpt_format="torch")
    start = time.perf_counter()
    for turn in range(pp):
        chunks = None
        if dist.get_rank() == turn:
            chunks = build_gpt_model(cfg, dtype=getattr(torch, dtype))
        # save_legacy meets every rank at its barriers; only this turn's rank has a model to write.
        save_legacy(chunks or [], args, root, 1) if chunks else _wait(root)
        del chunks
        gc.collect()
    return time.perf_counter() - start


def _wait(root: str) -> None:
    import torch.distributed as dist

    dist.barrier()
    dist.barrier()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--pp", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--work", default="/tmp/weightstream-convert-memory")
    p.add_argument("--json", default=None)
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    a = p.parse_args()
    from weightstream.launch import launch

    ckpt, out = os.path.join(a.work, "megatron"), os.path.join(a.work, "hf")
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    saved = launch(a.pp, save_stages, a.preset, a.pp, ckpt, a.dtype, timeout_s=3600)
    print(f"saved {a.preset} (PP {a.pp}, legacy) in {max(saved):.0f} s", file=sys.stderr)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt) for f in fs)
    cmd = [sys.executable, "-m", "weightstream.cli", "convert", ckpt, "--preset", a.preset, "--out", out]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        print(run.stdout, run.stderr, file=sys.stderr)
        return run.returncode
    line = run.stdout.strip().splitlines()[-1]
    print(line)
    gb = r"([\d.]+) GB"
    peak, before = map(float, re.search(rf"peak RSS {gb} \({gb} before\)", line).groups())
    layer = float(re.search(rf"largest layer \S+ {gb}", line).group(1))
    tensor = float(re.search(rf"largest tensor \S+ {gb}", line).group(1))
    result = {"preset": a.preset, "format": "legacy", "pp": a.pp, "dtype": a.dtype, "checkpoint_bytes": size,
              "peak_rss_gb": peak, "rss_before_gb": before, "largest_layer_gb": layer, "largest_tensor_gb": tensor,
              "peak_over_largest_layer": (peak - before) / max(layer, 1e-9), "summary": line, "command": " ".join(cmd)}
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    if not a.keep:
        shutil.rmtree(a.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
