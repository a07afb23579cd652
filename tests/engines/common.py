"""What the engine checks (sglang_check.py, lmdeploy_check.py) share: comparing bits, and decoding IPC
payloads in another process (the check script run again with ``--ipc-child``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

# One decoder layer of a Qwen3-like model, as the block-FP8 loader checks build it at engine TP 2: each HF weight's
# shape and how an engine's TP rank r cuts it ("rows": column-parallel, "cols": row-parallel), and each fused engine
# parameter with the HF weights it holds, in order.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 256, 4, 2, 128, 512
TP_SIZE = 2
PREFIX = "model.layers.0"
WEIGHTS = {
    "self_attn.q_proj": ((HEADS * HEAD_DIM, HIDDEN), "rows"),
    "self_attn.k_proj": ((KV_HEADS * HEAD_DIM, HIDDEN), "rows"),
    "self_attn.v_proj": ((KV_HEADS * HEAD_DIM, HIDDEN), "rows"),
    "self_attn.o_proj": ((HIDDEN, HEADS * HEAD_DIM), "cols"),
    "mlp.gate_proj": ((MLP, HIDDEN), "rows"), "mlp.up_proj": ((MLP, HIDDEN), "rows"),
    "mlp.down_proj": ((HIDDEN, MLP), "cols"),
}
FUSED = {"self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
         "self_attn.o_proj": ["self_attn.o_proj"], "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
         "mlp.down_proj": ["mlp.down_proj"]}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def ipc_in_child(script: str, payloads: list, tp_size: int, body_text: str, expected: dict) -> tuple[dict, dict | None]:
    """Run ``script --ipc-child BODY EXPECTED`` (another process, reading our shared-memory buffers) and
    return the common part of the report and the child's JSON (None when it printed none)."""
    res = {"n_payloads_sent": len(payloads), "engine_tp_size": tp_size,
           "one_payload_per_rank": len(payloads) == tp_size,
           "payloads_are_base64_str": all(isinstance(p, str) for p in payloads)}
    with tempfile.TemporaryDirectory() as tmp:
        bp, ep = os.path.join(tmp, "body.json"), os.path.join(tmp, "expected.pt")
        Path(bp).write_text(body_text)
        torch.save(expected, ep)
        proc = subprocess.run([sys.executable, script, "--ipc-child", bp, ep], capture_output=True, text=True,
                              timeout=240)
    res["child_rc"] = proc.returncode
    try:
        child = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        res.update(child=None, child_stderr=proc.stderr[-3000:], ok=False)
        return res, None
    res["child"] = child
    res["other_process"] = child["pid"] != os.getpid()
    res["ok"] = proc.returncode == 0 and res["other_process"] and res["one_payload_per_rank"]
    return res, child
