"""A DeepSeek-V3 (MLA, local spec) job at TP 2: its per-rank stream, then a per-rank P2P update of an engine at TP 2."""

from __future__ import annotations

from tests.helpers.workers import Case, run_case, run_update


def run_per_rank_then_update(case: Case, url: str) -> dict:
    """``case`` streamed (:func:`run_case`: every rank's tensors and their shards), then one ``transport="p2p"``
    update of the engine at ``url`` from the same layout."""
    return {"case": run_case(case),
            "update": run_update(Case(case.src, case.layout), [url], [{"transport": "p2p", "bucket_bytes": 120_000}])}
