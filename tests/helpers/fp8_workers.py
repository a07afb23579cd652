"""Trainer jobs (``weightstream.launch``) that update block-FP8 reference engines."""

from __future__ import annotations

import torch.distributed as dist

from tests.helpers.checks import INPUT_IDS
from tests.helpers.delta_workers import SeededAdam
from tests.helpers.workers import Case, _build
from weightstream.sinks.safetensors import save_hf_checkpoint


def run_fp8_updates(case: Case, steps: list[tuple[str, dict]], save_to: str) -> list[dict]:
    """Build the trainer, then per step one ``WeightSync(url, quantize=case.quantize, **options)`` (``prepare``
    in the options: ``WeightSync.prepare`` first) and one update; rank 0 reads the engine's logits after it.
    Last, the trainer writes its weights as the block-FP8 checkpoint ``save_to``."""
    from weightstream.engines import ReferenceEngine
    from weightstream.update import WeightSync

    cfg, chunks = _build(case)
    out: list[dict] = []
    for url, options in steps:
        options = dict(options)
        prepare = options.pop("prepare", False)
        entry: dict = {"url": url}
        try:
            with WeightSync([url], quantize=case.quantize, bucket_bytes=case.bucket_bytes, **options) as sync:
                if prepare:
                    sync.prepare(chunks, cfg)
                entry["report"] = sync.update(chunks, cfg, weight_version="fp8")
            if dist.get_rank() == 0:
                entry["logits"] = ReferenceEngine(url).logits(INPUT_IDS)
        except Exception as exc:  # noqa: BLE001 -- reported to the test
            entry["error"] = f"{type(exc).__name__}: {exc}"
        out.append(entry)
    save_hf_checkpoint(chunks, cfg, save_to, bucket_bytes=case.bucket_bytes, quantize=case.quantize)
    return out


def run_fp8_delta_updates(case: Case, url: str, steps: int, save_to: str) -> dict:
    """Block-FP8 delta updates: fp32 masters with Adam over them; per step one Adam step (each master's gradient
    seeded by the step, the same on every rank), the masters copied into the model, one update of a kept
    ``WeightSync(delta=True, quantize=case.quantize)``. Returns the reports and, on rank 0, the engine's logits after
    the last; the trainer then writes its weights as the block-FP8 checkpoint ``save_to``."""
    from weightstream.engines import ReferenceEngine
    from weightstream.update import WeightSync

    cfg, chunks = _build(case)
    adam = SeededAdam(chunks, lr=1e-3)
    reports = []
    with WeightSync([url], delta=True, quantize=case.quantize, bucket_bytes=case.bucket_bytes) as sync:
        for step in range(steps):
            if step:
                adam.step(step)
            reports.append(sync.update(chunks, cfg, weight_version=f"v{step}"))
    logits = ReferenceEngine(url).logits(INPUT_IDS) if dist.get_rank() == 0 else None
    save_hf_checkpoint(chunks, cfg, save_to, bucket_bytes=case.bucket_bytes, quantize=case.quantize)
    return {"reports": reports, "logits": logits}
