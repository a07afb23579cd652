"""A trainer as users write one: started by ``torchrun`` (or as a plain process), it builds a
Megatron-Core model, then updates running engines (``--engine`` once per engine) twice with
``weightstream.update_weights``, changing its weights in between. Rank 0 records each engine's logits after
each update.

    torchrun --nproc_per_node 2 train_and_update.py --src DIR --engine URL --transport broadcast --tp 2 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

INPUT_IDS = [[3, 14, 159, 265, 358, 979, 323, 846, 26, 433], [999, 0, 1, 2, 500, 501, 77, 88, 99, 111]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", required=True)
    ap.add_argument("--engine", required=True, action="append", help="an engine's URL (again for several engines)")
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--fp8-block", type=int, default=0, help="stream block FP8 with N x N blocks (0: unquantized)")
    ap.add_argument("--delta", action="store_true", help="one WeightSync(delta=True) for every update")
    args = ap.parse_args()

    if "RANK" in os.environ:  # torchrun, srun wrappers, anything that exports the env:// variables
        dist.init_process_group("gloo")
    else:  # a plain single process
        from weightstream.launch import free_port

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)

    import weightstream as ws
    from weightstream.checks.megatron_models import build_gpt_model, initialize_parallel, load_hf_weights
    from weightstream.common.hf_files import CheckpointReader
    from weightstream.engines import ReferenceEngine
    from weightstream.wire.fp8 import BlockFP8

    quantize = BlockFP8(block=(args.fp8_block, args.fp8_block)) if args.fp8_block else None
    initialize_parallel(args.tp, args.pp, ep=args.ep)
    chunks = build_gpt_model(args.src)
    with CheckpointReader(args.src) as reader:
        load_hf_weights(chunks, args.src, reader)

    sync = ws.WeightSync(args.engine, transport=args.transport, timeout_s=60, bucket_bytes=100_000,
                         delta=True) if args.delta else None
    reports = []
    for step in range(2):
        if step == 1:  # a training step's worth of change, the same on every rank
            gen = torch.Generator().manual_seed(7)
            with torch.no_grad():
                for chunk in chunks:
                    for _name, p in sorted(chunk.named_parameters()):
                        p.add_(torch.randn(p.shape, generator=gen) * 0.02)
            ws.save_hf_checkpoint(chunks, args.src, os.path.join(args.out, "step1"), quantize=quantize)
        if sync is not None:
            report = sync.update(chunks, args.src, weight_version=f"step-{step}")
        else:
            report = ws.update_weights(chunks, args.src, args.engine, transport=args.transport,
                                       weight_version=f"step-{step}", timeout_s=60, bucket_bytes=100_000,
                                       quantize=quantize)
        if dist.get_rank() == 0:
            for k, url in enumerate(args.engine):  # the first engine's as logits{step}.pt, the others' _k after it
                torch.save(ReferenceEngine(url).logits(INPUT_IDS),
                           os.path.join(args.out, f"logits{step}{f'_{k}' if k else ''}.pt"))
            reports.append({"transport": report.transport, "reason": report.reason, "tensors": report.tensors,
                            "ahead": report.metadata_ahead, "direct": report.direct,
                            "version": report.weight_version,
                            "launcher_env": "TORCHELASTIC_USE_AGENT_STORE" in os.environ,
                            "delta": None if report.delta is None else
                            {"full": report.delta.full, "reason": report.delta.reason,
                             "checked": report.delta.checked, "changed": report.delta.changed}})
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "reports.json"), "w") as f:
            json.dump(reports, f)
    if sync is not None:
        sync.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
