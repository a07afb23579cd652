"""The soak in CI: 100 consecutive updates through one WeightSync into a reference engine running as its
own service, the transport switched on every update (broadcast, IPC over shared memory, P2P in turn, so
each carries both sets of weights and the logits are checked after each), checksums on. Nothing may grow
after warm-up: no /dev/shm entry, no more than a lazily started thread or descriptor, and no weight-update
group formed again (the broadcast and P2P sinks share the one group; forming it on each switch grew the
trainer's heap by about 0.17 MB a time). Where the two groups differ (several engines, TP > 1) nothing is
handed over: checked without processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from weightstream.engines import ReferenceEngine
from weightstream.engines.base import EngineInfo
from weightstream.sinks import BroadcastSink, P2PSink
from weightstream.sources.topology import Topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Known(ReferenceEngine):
    """An engine whose layout is known without asking it."""

    def __init__(self, url: str, tp: int):
        super().__init__(url)
        self.tp = tp

    def info(self, refresh: bool = False) -> EngineInfo:
        return EngineInfo("weightstream-reference", tp_size=self.tp)


def test_broadcast_and_p2p_hand_one_group_over_only_where_it_is_the_same():
    one = _Known("http://127.0.0.1:9", 1)
    broadcast, p2p = BroadcastSink([one]), P2PSink([one], Topology())  # this trainer: one rank, TP 1
    group, pool = object(), object()
    broadcast.group, broadcast._pool = group, pool
    assert broadcast.layout() == p2p.layout() and broadcast.hand_over(p2p)
    assert (p2p.group, p2p._pool, broadcast.group, broadcast._pool) == (group, pool, None, None)
    back = BroadcastSink([one])
    assert p2p.hand_over(back) and back.group is group and p2p.group is None
    for other in (BroadcastSink([one, _Known("http://127.0.0.1:10", 1)]), BroadcastSink([_Known(one.url, 2)])):
        other.group = group
        target = P2PSink([one], Topology())
        assert not other.hand_over(target) and target.group is None and other.group is group


def test_soak_100_updates(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "weightstream.cli", "bench", "--soak", "100", "--transport", "broadcast,ipc,p2p",
         "--switch-every", "1", "--check-every", "25", "--sample-every", "10", "--json", str(out)],
        check=False, capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(out.read_text())
    print(proc.stdout)
    assert report["ok"] and report["updates"] == 100 and not report["failures"]
    checks = report["logits_checks"]
    assert [c["update"] for c in checks] == [25, 50, 75, 100]
    assert {c["transport"] for c in checks} == {"broadcast", "ipc", "p2p"}
    assert all(c["max_abs_diff"] <= 1e-4 for c in checks)
    assert {k: int(v["count"]) for k, v in report["seconds_per_update"].items()} == {"broadcast": 34, "ipc": 33,
                                                                                     "p2p": 33}
    # One group, formed by the first update and handed between the broadcast and P2P sinks ever since.
    assert report["groups_formed"] == 1, report["groups_formed"]
    growth = report["growth"]
    assert growth["trainer_groups"] == 0 and growth["shm"] <= 0, growth
    for key in ("trainer_fds", "engine_fds", "trainer_threads", "engine_threads"):
        assert growth[key] <= 2, (key, growth)  # a lazily started thread (and its descriptor) is a constant
    for key in ("trainer_rss_mb", "engine_rss_mb"):
        assert growth[key] <= 16, (key, growth)
