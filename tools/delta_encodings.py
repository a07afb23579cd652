"""Which delta encoding is smaller and faster on real optimizer steps (the measurement behind
:mod:`weightstream.streaming.delta`).

A transformers Qwen3 model (random weights, real shapes of a small model) trains with Adam on fp32 master
weights, copied to bf16 after each step as a trainer sends them; each step's bf16 bytes are compared with the
previous step's, per bucket, and every encoding is timed and sized: ``indices``, ``bitmap``, and XOR of the
two steps' bytes through zlib (level 1; the only compressor installed here: zstd and lz4 are not). Every
payload is applied back and checked bit for bit.

``python tools/delta_encodings.py [--steps 5] [--hidden 512] [--layers 4] [--lr 1e-6 1e-5] [--device cuda]``
(on a GPU the encodings are timed there, each after a synchronisation; XOR + zlib still runs on the CPU)
"""

from __future__ import annotations

import argparse
import time
import zlib

import torch

from weightstream.models.presets import preset_config
from weightstream.streaming.delta import apply, encode

BUCKET_BYTES = 8 << 20


def _model(hidden: int, layers: int, seed: int):
    from transformers import AutoModelForCausalLM

    cfg = preset_config("tiny-qwen3")
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = hidden, hidden * 3, layers
    cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads = 64, hidden // 64, max(1, hidden // 128)
    cfg.layer_types = ["full_attention"] * layers
    cfg.vocab_size = 4096
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def _buckets(model) -> list[torch.Tensor]:
    """The model's weights as bf16 bytes, cut into buckets of about BUCKET_BYTES."""
    flat = torch.cat([p.detach().to(torch.bfloat16).reshape(-1) for p in model.parameters()]).view(torch.uint8)
    return list(flat.split(BUCKET_BYTES))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, repeat: int = 3):
    best, out = float("inf"), None
    for _ in range(repeat):
        _sync()
        t = time.perf_counter()
        out = fn()
        _sync()
        best = min(best, time.perf_counter() - t)
    return best, out


def _measure(old: list[torch.Tensor], new: list[torch.Tensor]) -> dict[str, float]:
    row = {"bytes": 0, "changed": 0, "indices": 0, "bitmap": 0, "xor_zlib": 0, "t_indices": 0.0, "t_bitmap": 0.0,
           "t_xor_zlib": 0.0, "t_apply_indices": 0.0, "t_apply_bitmap": 0.0}
    for a, b in zip(old, new, strict=True):
        row["bytes"] += b.numel()
        for enc in ("indices", "bitmap"):
            t, (header, payload) = _timed(lambda enc=enc, a=a, b=b: encode(b, a, 2, (enc,)))
            row[enc] += payload.numel()
            row[f"t_{enc}"] += t
            row["changed"] += header.count if enc == "indices" else 0
            ta, back = _timed(lambda h=header, p=payload, a=a: apply(a.clone(), h, p), 1)
            row[f"t_apply_{enc}"] += ta
            assert torch.equal(back, b), "a delta did not give back the new bytes"
        t, packed = _timed(lambda a=a, b=b: zlib.compress((a.view(torch.int16) ^ b.view(torch.int16))
                                                             .cpu().numpy().tobytes(), 1), 1)
        row["xor_zlib"] += len(packed)
        row["t_xor_zlib"] += t
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(2)
    for lr in args.lr:
        model = _model(args.hidden, args.layers, seed=0).to(args.device)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        gen = torch.Generator().manual_seed(1)
        before = _buckets(model)
        for step in range(args.steps):
            ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=gen).to(args.device)
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            after = _buckets(model)
            r = _measure(before, after)
            n = r["bytes"]
            print(f"lr {lr:g} step {step + 1}: {n / 1e6:.1f} MB bf16, {2 * r['changed'] / n:.2%} of elements changed; "
                  f"indices {r['indices'] / n:.2%} of dense in {r['t_indices'] * 1e3:.0f} ms "
                  f"(apply {r['t_apply_indices'] * 1e3:.0f} ms), bitmap {r['bitmap'] / n:.2%} in "
                  f"{r['t_bitmap'] * 1e3:.0f} ms (apply {r['t_apply_bitmap'] * 1e3:.0f} ms), XOR + zlib-1 "
                  f"{r['xor_zlib'] / n:.2%} in {r['t_xor_zlib'] * 1e3:.0f} ms", flush=True)
            before = after


if __name__ == "__main__":
    main()
