"""Two trainer jobs (``weightstream.launch``) at one engine under the same group name: the first updates it, waits
while the second tries, then updates it again."""

from __future__ import annotations

import os
import time

from tests.helpers.workers import Case, _build
from weightstream.streaming.stream import stream_hf_weights

WAIT_S = 240.0  # how long the first trainer waits for the second one to be done


def run_first_trainer(case: Case, url: str, transport: str, rendezvous: str) -> dict:
    """Update the engine at ``url`` (version ``a0``), say so (``rendezvous``/a-updated), wait until the second
    trainer is done (``rendezvous``/b-done), then update it again (``a1``, the weights changed) over the same
    ``WeightSync``. Returns both reports and the HF tensors it streams."""
    import torch

    from weightstream.update import WeightSync

    cfg, chunks = _build(case)
    with WeightSync([url], transport=transport, bucket_bytes=case.bucket_bytes, timeout_s=30) as sync:
        reports = [sync.update(chunks, cfg, weight_version="a0")]
        open(os.path.join(rendezvous, "a-updated"), "w").close()
        deadline = time.monotonic() + WAIT_S
        while not os.path.exists(os.path.join(rendezvous, "b-done")):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the second trainer was not done within {WAIT_S:.0f} s")
            time.sleep(0.1)
        with torch.no_grad():
            for p in chunks[0].parameters():
                p.add_(1.0 / 64)
        reports.append(sync.update(chunks, cfg, weight_version="a1"))
    tensors = {n: t.clone() for b in stream_hf_weights(chunks, cfg, bucket_bytes=case.bucket_bytes)
               for n, t in b.named_tensors()}
    return {"reports": reports, "tensors": tensors}


def run_second_trainer(case: Case, url: str, transport: str) -> dict:
    """One update of the engine at ``url`` (version ``b0``), under the default group name; the error it raised
    (its phase and text), or its report."""
    from weightstream.errors import UpdateError
    from weightstream.update import WeightSync

    cfg, chunks = _build(case)
    start = time.monotonic()
    try:
        with WeightSync([url], transport=transport, bucket_bytes=case.bucket_bytes, timeout_s=5) as sync:
            return {"report": sync.update(chunks, cfg, weight_version="b0")}
    except UpdateError as exc:
        return {"phase": exc.phase, "error": str(exc), "seconds": time.monotonic() - start}
