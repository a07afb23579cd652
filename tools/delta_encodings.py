"""Which delta encoding is smaller and faster on real optimizer steps (the measurement behind
:mod:`weightstream.streaming.delta`).

A transformers Qwen3 model (random weights, real shapes of a small model) trains with Adam on fp32 master
weights, copied to bf16 after each step as a trainer sends them; each step's bf16 bytes are compared with the
previous step's, per bucket, and every encoding is timed and sized: ``indices`` and ``bitmap`` (the encodings
weightstream sends, :func:`~weightstream.streaming.delta.encode_into`), ``bitmap/bitmap`` (the bitmap encoding
whose bitmap is itself sent by the bitmap encoding, against zeros), and the XOR of the two steps' words
through general compressors: on the host zlib (level 1), and zstd and lz4 where their Python packages are
installed (``zstandard``, ``lz4``); on a GPU, nvCOMP's codecs where ``nvidia-nvcomp`` is installed (ANS,
Bitcomp, Cascaded, LZ4, Zstd, GDeflate), run on the device. Each compressor also runs on the XOR split into byte
planes (every word's low bytes, then its high bytes: ``/planes``), which puts the bf16 words' rarely changing
sign and exponent bits together. Every payload is decoded or applied back and checked bit for bit.

``python tools/delta_encodings.py [--steps 5] [--hidden 512] [--layers 4] [--lr 1e-6 1e-5] [--device cuda]
[--bucket-mb 8] [--host zstd-1 lz4] [--json out.json]``

Times are the best of three runs of each bucket's encoding (after a synchronisation on a GPU) and one decoding,
summed over the buckets; the host compressors are timed on the host, from bytes already there.
"""

from __future__ import annotations

import argparse
import json
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from weightstream.models.presets import preset_config
from weightstream.streaming.delta import apply, encode_into

Encode = Callable[[torch.Tensor], object]  # the XOR'd bucket (flat uint8) -> a payload
Decode = Callable[[object], torch.Tensor]  # the payload -> the XOR'd bucket, flat uint8, on the same device
Size = Callable[[object], int]


@dataclass(frozen=True)
class Compressor:
    name: str
    encode: Encode
    decode: Decode
    size: Size


@dataclass
class Tally:
    """One method's sums over the buckets of one step."""

    nbytes: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0
    failed: str = ""


@dataclass
class Step:
    lr: float
    step: int
    bytes: int = 0
    changed: int = 0
    methods: dict[str, Tally] = field(default_factory=dict)


def _model(hidden: int, layers: int, seed: int):
    from transformers import AutoModelForCausalLM

    cfg = preset_config("tiny-qwen3")
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = hidden, hidden * 3, layers
    cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads = 64, hidden // 64, max(1, hidden // 128)
    cfg.layer_types = ["full_attention"] * layers
    cfg.vocab_size = 4096
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def _buckets(model, bucket_bytes: int) -> list[torch.Tensor]:
    """The model's weights as bf16 bytes, cut into buckets of about ``bucket_bytes``."""
    flat = torch.cat([p.detach().to(torch.bfloat16).reshape(-1) for p in model.parameters()]).view(torch.uint8)
    return [b.clone() for b in flat.split(bucket_bytes)]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        _sync()
        t = time.perf_counter()
        out = fn()
        _sync()
        best = min(best, time.perf_counter() - t)
    return best, out


def _planes(x: torch.Tensor) -> torch.Tensor:
    """A flat uint8 buffer of 2-byte words as its low bytes, then its high bytes."""
    return x.view(-1, 2).t().contiguous().view(-1)


def _unplanes(x: torch.Tensor) -> torch.Tensor:
    return x.view(2, -1).t().contiguous().view(-1)


def _on_host(name: str, pack: Callable[[bytes], bytes], unpack: Callable[[bytes], bytes]) -> list[Compressor]:
    """A host compressor, on the XOR as it is and on its byte planes."""

    def encode(x: torch.Tensor) -> bytes:
        return pack(x.cpu().numpy().tobytes())

    def decode(payload: object) -> torch.Tensor:
        assert isinstance(payload, bytes)
        return torch.frombuffer(bytearray(unpack(payload)), dtype=torch.uint8)

    def size(payload: object) -> int:
        assert isinstance(payload, bytes)
        return len(payload)

    return [Compressor(name, encode, decode, size),
            Compressor(f"{name}/planes", lambda x: encode(_planes(x)), lambda p: _unplanes(decode(p)), size)]


def host_compressors() -> list[Compressor]:
    out = _on_host("zlib-1", lambda b: zlib.compress(b, 1), zlib.decompress)
    try:
        import zstandard
    except ImportError:
        print("zstandard is not installed: no zstd row")
    else:
        for level in (1, 3):
            c, d = zstandard.ZstdCompressor(level=level, threads=-1), zstandard.ZstdDecompressor()
            out += _on_host(f"zstd-{level}", c.compress, d.decompress)
    try:
        import lz4.frame
    except ImportError:
        print("lz4 is not installed: no lz4 row")
    else:
        out += _on_host("lz4", lz4.frame.compress, lz4.frame.decompress)
    return out


# nvCOMP's codecs and the options tried (data_type: the XOR's 2-byte words, where the codec reads it)
NVCOMP_CODECS: dict[str, dict[str, object]] = {
    "ANS": {},
    "Bitcomp": {"data_type": "<u2"},
    "Bitcomp-sparse": {"data_type": "<u2", "algorithm_type": 1},
    "Cascaded": {"data_type": "<u2"},
    "LZ4": {"data_type": "<u2"},
    "Zstd": {},
    "GDeflate-0": {"algorithm_type": 0},
}


def device_compressors() -> list[Compressor]:
    try:
        from nvidia import nvcomp
    except ImportError as e:
        print(f"no GPU compressor rows: nvidia-nvcomp could not be imported ({e})")
        return []
    stream = torch.cuda.current_stream().cuda_stream
    out: list[Compressor] = []
    for label, options in NVCOMP_CODECS.items():
        algorithm = label.split("-")[0]
        codec = nvcomp.Codec(algorithm=algorithm, cuda_stream=stream, uncomp_chunk_size=1 << 16, **options)

        def encode(x: torch.Tensor, codec=codec) -> object:
            return codec.encode(nvcomp.as_array(x))

        def decode(payload: object, codec=codec) -> torch.Tensor:
            return torch.as_tensor(codec.decode(payload), device="cuda").view(torch.uint8).view(-1)

        def size(payload: object) -> int:
            return int(payload.buffer_size)  # type: ignore[attr-defined]

        out += [Compressor(f"nvcomp-{label}", encode, decode, size),
                Compressor(f"nvcomp-{label}/planes", lambda x, e=encode: e(_planes(x)),
                           lambda p, d=decode: _unplanes(d(p)), size)]
    return out


def _ours(row: Step, old: torch.Tensor, new: torch.Tensor) -> None:
    """weightstream's own encodings, each allowed alone, encoded into a copy of the old bytes and applied back."""
    for enc in ("indices", "bitmap"):
        tally = row.methods.setdefault(enc, Tally())
        t, (header, payload) = _timed(lambda enc=enc: encode_into(new, old.clone(), 2, (enc,)), 3)
        tally.nbytes += payload.numel()
        tally.encode_s += t
        if enc == "indices":
            row.changed += header.count
        ta, back = _timed(lambda h=header, p=payload: apply(old.clone(), h, p), 1)
        tally.decode_s += ta
        assert torch.equal(back, new), f"{enc}: the delta did not give back the new bytes"


def _two_level(row: Step, old: torch.Tensor, new: torch.Tensor) -> None:
    """The ``bitmap`` encoding with its bitmap encoded again, as 2-byte words against zeros, by the ``bitmap``
    encoding (one bit per 16 words, then each 16 words' bits where any changed): sized, decoded and checked."""
    tally = row.methods.setdefault("bitmap/bitmap", Tally())

    def encode() -> tuple:
        header, payload = encode_into(new, old.clone(), 2, ("bitmap",))
        split = (new.numel() // 2 + 7) // 8
        bitmap = payload[:split] if split % 2 == 0 else torch.cat([payload[:split], payload.new_zeros(1)])
        inner, packed = encode_into(bitmap, torch.zeros_like(bitmap), 2, ("bitmap",))
        return header, inner, packed, payload[split:]

    def decode(header, inner, packed, values) -> torch.Tensor:
        bitmap = apply(torch.zeros(inner.total, dtype=torch.uint8, device=new.device), inner, packed)
        split = (new.numel() // 2 + 7) // 8
        return apply(old.clone(), header, torch.cat([bitmap[:split], values]))

    t, parts = _timed(encode, 3)
    td, back = _timed(lambda: decode(*parts), 1)
    assert torch.equal(back, new), "bitmap/bitmap: the delta did not give back the new bytes"
    tally.nbytes += parts[2].numel() + parts[3].numel()
    tally.encode_s += t
    tally.decode_s += td


def _compressed(row: Step, old: torch.Tensor, new: torch.Tensor, compressors: list[Compressor]) -> None:
    """Each compressor on the XOR of the two steps' words; decoded, XOR'd back and checked bit for bit."""
    xor = (old.view(torch.int16) ^ new.view(torch.int16)).view(torch.uint8)
    host = xor.cpu()
    for c in compressors:
        tally = row.methods.setdefault(c.name, Tally())
        if tally.failed:
            continue
        source = xor if c.name.startswith("nvcomp") else host
        try:
            t, payload = _timed(lambda c=c, s=source: c.encode(s), 3)
            td, back = _timed(lambda c=c, p=payload: c.decode(p), 1)
        except Exception as e:  # noqa: BLE001 -- a codec the installed nvCOMP refuses: reported, the others go on
            tally.failed = f"{type(e).__name__}: {e}"
            continue
        assert isinstance(back, torch.Tensor)
        restored = (back.to(old.device).view(torch.int16) ^ old.view(torch.int16)).view(torch.uint8)
        assert torch.equal(restored, new), f"{c.name}: decoding did not give back the new bytes"
        tally.nbytes += c.size(payload)
        tally.encode_s += t
        tally.decode_s += td


def _print(row: Step) -> None:
    n = row.bytes
    print(f"lr {row.lr:g} step {row.step}: {n / 1e6:.1f} MB bf16, {2 * row.changed / n:.2%} of words changed",
          flush=True)
    for name, t in row.methods.items():
        if t.failed:
            print(f"  {name:24s} failed: {t.failed}")
            continue
        print(f"  {name:24s} {t.nbytes / n:7.2%} of dense   encode {t.encode_s * 1e3:8.2f} ms "
              f"({n / max(t.encode_s, 1e-9) / 1e9:7.1f} GB/s)   decode {t.decode_s * 1e3:8.2f} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--bucket-mb", type=float, default=8)
    ap.add_argument("--host", nargs="*", help="only these host compressors (default: every one)")
    ap.add_argument("--json", help="write every row here")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(2)
    host = [c for c in host_compressors() if args.host is None or c.name in args.host]
    compressors = host + (device_compressors() if args.device.startswith("cuda") else [])
    bucket_bytes = int(args.bucket_mb * (1 << 20))
    rows: list[Step] = []
    for lr in args.lr:
        model = _model(args.hidden, args.layers, seed=0).to(args.device)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        gen = torch.Generator().manual_seed(1)
        before = _buckets(model, bucket_bytes)
        for step in range(args.steps):
            ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=gen).to(args.device)
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            after = _buckets(model, bucket_bytes)
            row = Step(lr, step + 1)
            for old, new in zip(before, after, strict=True):
                row.bytes += new.numel()
                _ours(row, old, new)
                _two_level(row, old, new)
                _compressed(row, old, new, compressors)
            _print(row)
            rows.append(row)
            before = after
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
                       "rows": [{"lr": r.lr, "step": r.step, "bytes": r.bytes, "changed_words": r.changed,
                                 "methods": {k: vars(v) for k, v in r.methods.items()}} for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
