"""The soak in CI: 100 consecutive updates through one WeightSync into a reference engine running as its
own service (broadcast and IPC over shared memory in turn, alternating weights, checksums on), the
engine's logits checked, no /dev/shm entry and no more than a lazily started thread or descriptor gained
after warm-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_soak_100_updates(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "weightstream.cli", "bench", "--soak", "100", "--check-every", "25",
         "--sample-every", "10", "--json", str(out)],
        capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(out.read_text())
    print(proc.stdout)
    assert report["ok"] and report["updates"] == 100 and not report["failures"]
    assert [c["update"] for c in report["logits_checks"]] == [25, 50, 75, 100]
    assert all(c["max_abs_diff"] <= 1e-4 for c in report["logits_checks"])
    assert {k: int(v["count"]) for k, v in report["seconds_per_update"].items()} == {"broadcast": 50, "ipc": 50}
    growth = report["growth"]
    assert growth["shm"] <= 0, growth
    for key in ("trainer_fds", "engine_fds", "trainer_threads", "engine_threads"):
        assert growth[key] <= 2, (key, growth)  # a lazily started thread (and its descriptor) is a constant
    for key in ("trainer_rss_mb", "engine_rss_mb"):
        assert growth[key] <= 48, (key, growth)
