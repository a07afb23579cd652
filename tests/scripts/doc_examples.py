"""Runs code blocks of README.md and docs/ as written, on every rank of a ``torchrun`` job, in the names they use.

    torchrun --nproc-per-node 2 doc_examples.py PLAN.json

PLAN.json: ``{"example": DIR (what ``weightstream example`` wrote), "engines": [URL, ...], "blocks": [{"name",
"code", "cwd"}, ...]}``. Each rank loads DIR's Megatron checkpoint into a TP-2 Megatron-Core model; each block then
runs in a fresh namespace holding what the documentation calls ``model_chunks``, ``hf_config``, ``steps`` and
``train_one_round`` (a step's worth of change to every parameter, the same on every rank), in its own working
directory. After a block, rank 0 writes each engine's logits (``logits_<k>.pt``) and every rank the model's own HF
checkpoint (``expected/``) into that directory, for the test to compare.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

INPUT_IDS = [[3, 14, 159, 265, 358, 979, 323, 846, 26, 433], [999, 0, 1, 2, 500, 501, 77, 88, 99, 111]]


def train_one_round(chunks, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for chunk in chunks:
            for _name, p in sorted(chunk.named_parameters()):
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)


def run_block(block: dict, chunks, hf: str, engines: list[str]) -> None:
    import weightstream as ws
    from weightstream.engines import ReferenceEngine

    rounds = iter(range(1000))
    names = {"ws": ws, "model_chunks": chunks, "hf_config": hf, "steps": 2, "url": engines[0], "urls": engines,
             "train_one_round": lambda: train_one_round(chunks, next(rounds)), "__name__": "__main__"}
    cwd = Path(block["cwd"])
    os.chdir(cwd)
    exec(compile(block["code"], f"<{block['name']}>", "exec"), names)
    dist.barrier()
    ws.save_hf_checkpoint(chunks, hf, cwd / "expected", overwrite=True)
    if dist.get_rank() == 0:
        for k, url in enumerate(engines):
            torch.save(ReferenceEngine(url, timeout_s=60).logits(INPUT_IDS), cwd / f"logits_{k}.pt")
        print(f"block {block['name']}: ran", flush=True)


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    from weightstream.checks.megatron_models import build_gpt_model, initialize_parallel
    from weightstream.example import load_megatron_checkpoint

    example = Path(plan["example"])
    hf = str(example / "hf")
    initialize_parallel(tp=dist.get_world_size())
    chunks = build_gpt_model(hf)
    load_megatron_checkpoint(chunks, example / "checkpoint")
    for block in plan["blocks"]:
        run_block(block, chunks, hf, plan["engines"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
