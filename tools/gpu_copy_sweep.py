"""On a GPU: the piece copy's launch shape (elements a program moves per step, warps per program, bytes per piece)
against a device copy of the same bytes, plain and checked, over tensors of Qwen3-8B's and Qwen3-30B-A3B's shapes
written one by one into other tensors (as straight into an engine's weights), one launch per bucket of
``--bucket-mib`` (as an update launches them, back to back on one stream; 0: one launch for everything).

    PYTHONPATH=/tmp/site:$PWD python3 tools/gpu_copy_sweep.py [--gib 4] [--bucket-mib 512]"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from weightstream.streaming import copies, value_checks

DEFAULT = (copies._BLOCK, copies._WARPS, copies.PIECE_BYTES)


def _ms(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def _tensors(shapes: list[int], gib: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    src, total = [], 0
    for n in itertools.cycle(shapes):
        if total >= gib * 2**30:
            break
        src.append(torch.randn(n, device="cuda").to(torch.bfloat16))
        total += 2 * n
    return src, [torch.empty_like(t) for t in src]


def _buckets(src: list[torch.Tensor], dst: list[torch.Tensor], bucket_bytes: int
             ) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """The pairs cut into consecutive buckets of at most ``bucket_bytes`` (a tensor larger than one alone)."""
    out: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], [])]
    size = 0
    for s, d in zip(src, dst, strict=True):
        n = s.numel() * s.element_size()
        if out[-1][0] and bucket_bytes and size + n > bucket_bytes:
            out.append(([], []))
            size = 0
        out[-1][0].append(s)
        out[-1][1].append(d)
        size += n
    return out


def _rows(model: str, shapes: list[int], gib: float, bucket_bytes: int, flag: torch.Tensor) -> list[dict]:
    src, dst = _tensors(shapes, gib)
    whole = torch.cat([t.view(-1) for t in src])
    whole_dst = torch.empty_like(whole)
    floor = _ms(lambda: whole_dst.copy_(whole))
    buckets = _buckets(src, dst, bucket_bytes)
    rows = []
    for block, warps, piece in itertools.product((1024, 2048, 4096, 8192), (4, 8, 16),
                                                 (64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20)):
        copies._BLOCK, copies._WARPS, copies.PIECE_BYTES = block, warps, piece
        plain = [copies.PieceCopy(d, s) for s, d in buckets]
        checked = [copies.PieceCopy(d, s, copies.WordCheck(value_checks.KINDS[torch.bfloat16], flag))
                   for s, d in buckets]
        rows.append({"model": model, "gib": whole.numel() * 2 / 2**30, "launches": len(buckets), "block": block,
                     "warps": warps, "piece_kib": piece >> 10, "floor_ms": floor,
                     "plain_ms": _ms(lambda calls=plain: [c() for c in calls]),
                     "checked_ms": _ms(lambda calls=checked: [c() for c in calls])})
    copies._BLOCK, copies._WARPS, copies.PIECE_BYTES = DEFAULT
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--bucket-mib", type=int, default=512, help="bytes per launch (0: one launch)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    models = {"qwen3-8b": [4096 * 12288, 4096 * 12288, 12288 * 4096, 4096 * 4096, 1024 * 4096],
              "qwen3-30b-a3b": [768 * 2048] * 3}
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    rows = []
    for model, shapes in models.items():
        mine = _rows(model, shapes, args.gib, args.bucket_mib << 20, flag)
        torch.cuda.empty_cache()
        rows += mine
        best = min(mine, key=lambda r: r["checked_ms"])
        now = [r for r in mine if (r["block"], r["warps"], r["piece_kib"] << 10) == DEFAULT][0]
        print(f"{model}: {best['gib']:.1f} GiB in {best['launches']} launches, device copy {best['floor_ms']:.3f} ms; "
              f"checked now {DEFAULT} "
              f"{now['checked_ms']:.3f} ms, plain {now['plain_ms']:.3f}; best checked {best['checked_ms']:.3f} ms at "
              f"block {best['block']}, {best['warps']} warps, {best['piece_kib']} KiB")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    for r in sorted(rows, key=lambda r: (r["model"], r["checked_ms"]))[:8]:
        print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
