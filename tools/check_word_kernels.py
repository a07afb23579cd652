"""The word kernels (``weightstream.common.word_kernels``) against the torch operations they stand for, bit for
bit: the checksum's sums, the comparison with its bitmap and counts, the packed values and positions, a bitmap
applied; then, on a CUDA device, the paths that use them (``encode_into``, ``apply``, ``checksum``) against the
same paths with ``WEIGHTSTREAM_DELTA_KERNEL=0``. Exits non-zero on the first difference.

    python tools/check_word_kernels.py                      # on the GPU
    TRITON_INTERPRET=1 python tools/check_word_kernels.py --device cpu   # Triton's interpreter, small sizes
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from weightstream.common import word_kernels as wk
from weightstream.streaming.delta import (
    ENCODINGS,
    _count,
    _pack_bits,
    _unpack_bits,
    _words,
    apply,
    encode,
    encode_into,
)
from weightstream.wire.handles import checksum

DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@contextmanager
def torch_path() -> Iterator[None]:
    """Within: the torch operations, not the word kernels (``WEIGHTSTREAM_DELTA_KERNEL=0``)."""
    os.environ["WEIGHTSTREAM_DELTA_KERNEL"] = "0"
    try:
        yield
    finally:
        del os.environ["WEIGHTSTREAM_DELTA_KERNEL"]


def _pair(n: int, word: int, frac: float, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Held and new words (``n`` of ``word`` bytes, as bytes), ``frac`` of them changed."""
    held = torch.randint(0, 256, (n * word,), dtype=torch.uint8, generator=gen).to(device)
    new = held.clone()
    where = (torch.rand(n, generator=gen) < frac).to(device)
    w = _words(new, word)
    w[where] = w[where] ^ 1  # changed words: one bit flipped
    return new, held


def _fail(what: str) -> None:
    raise SystemExit(f"DIFFERS: {what}")


def check_direct(device: torch.device, sizes: list[int]) -> int:
    """The kernels called directly, against the torch operations."""
    gen = torch.Generator().manual_seed(0)
    cases = 0
    for word in (1, 2, 4):
        for n in sizes:
            for frac in (0.0, 0.01, 0.3, 1.0):
                new, held = _pair(n, word, frac, device, gen)
                a, b = _words(new, word), _words(held, word)
                mask = a != b
                kept = b.clone()
                count, bitmap, counts = wk.compare_pack(a, kept)
                if count != _count(mask) or not torch.equal(kept, a):
                    _fail(f"compare_pack count/held, word {word} n {n} frac {frac}")
                if not torch.equal(bitmap, _pack_bits(mask)):
                    _fail(f"compare_pack bitmap, word {word} n {n} frac {frac}")
                values = torch.empty(count, dtype=DTYPES[word], device=device)
                positions = torch.empty(count, dtype=torch.int32, device=device)
                wk.compact(a, bitmap, counts, values, positions)
                if not torch.equal(values, a[mask]) or not torch.equal(positions, mask.nonzero().view(-1).int()):
                    _fail(f"compact, word {word} n {n} frac {frac}")
                flagged = wk.flagged(bitmap, n)
                if int(flagged.sum()) != count or not torch.equal(flagged, counts):
                    _fail(f"flagged, word {word} n {n} frac {frac}")
                target = b.clone()
                wk.expand_into(target, bitmap, values, flagged)
                if not torch.equal(target, a):
                    _fail(f"expand_into, word {word} n {n} frac {frac}")
                if word == 4:
                    s1, s2 = wk.checksum_sums(a)
                    with torch_path():
                        ours = checksum(new)
                    if ours != f"{new.numel():x}-{s1 & 0xFFFFFFFFFFFF:x}-{s2 & 0xFFFFFFFFFFFF:x}":
                        _fail(f"checksum sums, n {n}")
                cases += 1
    # bits set past the last word are not counted (the torch path drops them too)
    bitmap = torch.tensor([0xFF], dtype=torch.uint8, device=device)
    if int(wk.flagged(bitmap, 5).sum()) != int(_unpack_bits(bitmap, 5).sum()):
        _fail("flagged counts bits past the last word")
    return cases


def check_paths(device: torch.device, sizes: list[int]) -> int:
    """``encode_into``, ``apply`` and ``checksum`` with the kernels against themselves without (CUDA only)."""
    gen = torch.Generator().manual_seed(1)
    cases = 0
    for word in (1, 2, 4):
        for n in sizes:
            for frac in (0.0, 0.002, 0.05, 0.3, 1.0):
                for allowed in (ENCODINGS, ("indices",), ("bitmap",)):
                    new, held = _pair(n, word, frac, device, gen)
                    want_header, want_payload = encode(new, held, word, allowed)
                    kept = held.clone()
                    header, payload = encode_into(new, kept, word, allowed)
                    if header != want_header or not torch.equal(payload, want_payload) or not torch.equal(kept, new):
                        _fail(f"encode_into, word {word} n {n} frac {frac} {allowed}")
                    if not torch.equal(apply(held.clone(), header, payload), new):
                        _fail(f"apply, word {word} n {n} frac {frac} {allowed}")
                    with torch_path():
                        torch_sum = checksum(new)
                    if checksum(new) != torch_sum:
                        _fail(f"checksum, n {n}")
                    cases += 1
    return cases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    device = torch.device(args.device)
    small = [1, 7, 8, 9, wk.BLOCK - 1, wk.BLOCK, wk.BLOCK + 1, 3 * wk.BLOCK + 5]
    print(f"direct: {check_direct(device, small)} cases equal")
    if device.type == "cuda":
        if not wk.available(device):
            raise SystemExit("the word kernels are not available here (Triton missing, or switched off)")
        print(f"paths: {check_paths(device, small + [1 << 20, (1 << 22) + 3])} cases equal")
    print("word kernels: every result equal to the torch operations'")


if __name__ == "__main__":
    main()
