"""Several jobs of :mod:`tests.helpers.workers` in one launch (fewer process start-ups on a two-core machine)."""

from __future__ import annotations

from tests.helpers.workers import Case, run_update


def run_updates(jobs: list[tuple[Case, list[str], list[dict]]]) -> list[list[dict]]:
    """:func:`run_update` for each ``(case, engine URLs, updates)``, one after the other."""
    return [run_update(case, urls, updates) for case, urls, updates in jobs]
