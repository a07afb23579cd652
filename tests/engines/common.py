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
