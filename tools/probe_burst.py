"""A burst of simultaneous POSTs against a reference engine on loopback (the listen-backlog probe):
``python tools/probe_burst.py [N]`` starts an engine on a tiny random Qwen3, opens N connections, releases
them at once with one ``POST /flush_cache`` each, and prints how the answers came back (status or error)."""

from __future__ import annotations

import collections
import concurrent.futures
import http.client
import sys
import tempfile
import threading
import time


def _post(host: str, port: int, barrier: threading.Barrier) -> int | str:
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        barrier.wait(timeout=30)
        conn.request("POST", "/flush_cache", body=b"{}", headers={"Content-Type": "application/json"})
        return conn.getresponse().status
    except (OSError, threading.BrokenBarrierError) as exc:
        return type(exc).__name__
    finally:
        conn.close()


def main(n: int) -> int:
    from weightstream.models.presets import preset_config, save_random_checkpoint
    from weightstream.reference_engine.server import serve, stop

    with tempfile.TemporaryDirectory() as tmp:
        server = serve(save_random_checkpoint(preset_config("tiny-qwen3"), tmp, seed=1), 1)
        host, port = server.server_address[:2]
        barrier = threading.Barrier(n)
        start = time.perf_counter()
        try:
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                answers = list(pool.map(lambda _: _post(host, port, barrier), range(n)))
        finally:
            stop(server)
    counts = collections.Counter(answers)
    print(f"{n} simultaneous POST /flush_cache: {dict(counts)} in {time.perf_counter() - start:.1f} s")
    return 0 if set(counts) == {200} else 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 600))
