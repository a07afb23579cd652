"""On a GPU: the block-FP8 kernel (weightstream.streaming.fp8_cast.BlockCast) against the whole-tensor arithmetic
(weightstream.converters.fp8.quantize_block_fp8, which the CPU tests prove against vLLM's and SGLang's own
functions), bit for bit, over shapes on and off the block grid, strided sources, three source dtypes, both scale
formats and edge values; then the time of each on the weights of one Qwen3-8B layer stack.

    python3 tools/gpu_fp8_kernel.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from weightstream.converters.fp8 import quantize_block_fp8
from weightstream.streaming.fp8_cast import BlockCast, CastJob
from weightstream.wire.fp8 import FP8, BlockFP8


def _sources(dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(7)
    out = [torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)
           for shape in ((256, 384), (300, 130), (5, 7), (128, 128), (1024, 4096))]
    out.append(torch.randn(640, 512, generator=g, device=device).to(dtype).t())  # strided (a transposed view)
    out.append(torch.randn(768, 256, generator=g, device=device).to(dtype)[128:512])  # a row slice
    fused = torch.randn(4, 6, 128, 512, generator=g, device=device).to(dtype)  # [groups, q + k + v heads, d, hidden]
    out += [fused[:, :4], fused[:, 4:5]]  # the q and k of a fused projection: rows of two strides
    edge = torch.zeros(256, 256, device=device, dtype=dtype)
    edge[:128, :128] = 1e-30 if dtype == torch.float32 else 1e-7  # tiny: subnormal fp8 values, floor on the amax
    edge[128:, :128] = torch.finfo(dtype).max / 4
    edge[:128, 128:] = torch.randn(128, 128, generator=g, device=device).to(dtype) * 1e-3
    out.append(edge)  # the last block stays zero
    return out


def check_bits(device: str) -> list[str]:
    problems = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        sources = _sources(dtype, device)
        for fp8 in (BlockFP8((128, 128), "float"), BlockFP8((128, 128), "ue8m0"), BlockFP8((64, 96), "float")):
            shapes = [(s.numel() // s.shape[-1], s.shape[-1]) for s in sources]
            jobs = [CastJob(s, torch.empty(shape, dtype=FP8, device=device),
                            torch.empty(fp8.scale_shape(shape), dtype=torch.float32, device=device))
                    for s, shape in zip(sources, shapes, strict=True)]
            BlockCast(jobs, fp8)()
            for s, job in zip(sources, jobs, strict=True):
                values, scales = quantize_block_fp8(s.reshape(job.values.shape), fp8.block,
                                                    ue8m0=fp8.scale_fmt == "ue8m0")
                differ = int((values.view(torch.uint8) != job.values.view(torch.uint8)).sum())
                scale_differ = int((scales.view(torch.int32) != job.scales.view(torch.int32)).sum())
                if differ or scale_differ:
                    problems.append(f"{dtype} {fp8} {tuple(s.shape)} stride {s.stride()}: "
                                    f"{differ} values and {scale_differ} scales differ")
    return problems


def _timed(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def _shapes(model: str) -> list[tuple[int, int]]:
    """The linear weights of Qwen3-8B's 36 layers, or of 8 of Qwen3-30B-A3B's 48 (128 experts each)."""
    if model == "qwen3-8b":
        one = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (12288, 4096), (12288, 4096), (4096, 12288)]
        return one * 36
    one = [(4096, 2048), (512, 2048), (512, 2048), (2048, 4096)] + [(768, 2048), (768, 2048), (2048, 768)] * 128
    return one * 8


def speed(device: str, model: str) -> dict:
    """Those weights (bf16) quantized by the kernel in several launch shapes (warps per program, rows of a block
    read at a time), against a device copy of the same bytes."""
    sources = [torch.randn(s, device=device, dtype=torch.bfloat16) for s in _shapes(model)]
    fp8 = BlockFP8()
    jobs = [CastJob(s, torch.empty(s.shape, dtype=FP8, device=device),
                    torch.empty(fp8.scale_shape(tuple(s.shape)), dtype=torch.float32, device=device)) for s in sources]
    copies = [torch.empty_like(s) for s in sources]
    nbytes = sum(s.numel() * 2 for s in sources)
    out: dict = {"bytes": nbytes, "copy_s": _timed(lambda: torch._foreach_copy_(copies, sources))}
    for warps in (2, 4, 8):
        for step in (16, 32, 64, 128):
            out[f"kernel_s_{warps}_warps_{step}_rows"] = _timed(BlockCast(jobs, fp8, num_warps=warps,
                                                                          rows_per_step=step))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    device = "cuda"
    problems = check_bits(device)
    report = {"device": torch.cuda.get_device_name(), "bits": "passed" if not problems else "failed",
              "problems": problems, **{model: speed(device, model) for model in ("qwen3-8b", "qwen3-30b-a3b")}}
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    raise SystemExit(1 if problems else 0)


if __name__ == "__main__":
    main()
