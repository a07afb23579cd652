"""A model family's whole job in one launch (fewer process start-ups on a two-core machine): its layouts, the
models reloaded under Transformer Engine's names, the refusals, Megatron checkpoints saved, an update into an
engine and transformers' model under FSDP2."""

from __future__ import annotations

from tests.helpers.fsdp_workers import run_fsdp_cases
from tests.helpers.megatron_saves import run_saves
from tests.helpers.mla import run_te_reload
from tests.helpers.workers import Case, run_case, run_error_case, run_update


def run_family_cases(cases: list[Case], te_reloads: list[Case] = (), errors: list[tuple] = ()) -> list[dict]:
    """``cases`` through :func:`run_case`, ``te_reloads`` through :func:`run_te_reload`, then the error cases."""
    return ([run_case(c) for c in cases] + [run_te_reload(c) for c in te_reloads]
            + [run_error_case(*e) for e in errors])


def run_family_job(cases: list[Case], te_reloads: list[Case], errors: list[tuple], saves: list[tuple[Case, str]],
                   update: tuple, fsdp: list[tuple]) -> dict:
    """One job: the family's cases, Megatron checkpoints saved (both formats), an update into an engine, and
    transformers' model under FSDP2 streamed."""
    return {"cases": run_family_cases(cases, te_reloads, errors), "saves": run_saves(saves),
            "update": run_update(*update), "fsdp": run_fsdp_cases(fsdp)}
