"""The distributed jobs behind the CLI: each runs on every rank of a local job (see ``launch``).

``Layout`` lives in :mod:`weightstream.models.parallel` (imported here as it always was)."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from weightstream.checks.megatron_models import build_gpt_model, initialize_parallel, load_hf_weights, megatron_logits
from weightstream.common.hf_files import CheckpointReader
from weightstream.common.progress import ProgressFile
from weightstream.models.parallel import Layout
from weightstream.models.spec import dtype_from_name, load_hf_config
from weightstream.sinks.safetensors import CheckpointReport, save_hf_checkpoint
from weightstream.wire.fp8 import BlockFP8

__all__ = ["dump_job"]


def _progress_bar(total_desc: str):
    if dist.get_rank() != 0:
        return None, None
    from tqdm import tqdm

    bar = tqdm(desc=total_desc, unit="bucket", leave=False, disable=None)  # drawn on a terminal only

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    return bar, update


def _built(hf_dir: str, cfg: Any, layout: Layout, dtype: str, reporter: ProgressFile) -> list[nn.Module]:
    """The Megatron-Core model of ``cfg`` under ``layout``, holding the weights of ``hf_dir``, on every rank."""
    initialize_parallel(layout.tp, layout.pp, layout.vpp, layout.ep, layout.etp)
    reporter.phase(f"building the Megatron-Core model on {dist.get_world_size()} ranks")
    chunks = build_gpt_model(cfg, dtype=dtype_from_name(dtype))
    reporter.phase("loading the weights into it")
    with CheckpointReader(hf_dir) as reader:
        load_hf_weights(chunks, cfg, reader)
    dist.barrier()
    return chunks


def dump_job(
    hf_dir: str,
    layout: Layout,
    out_dir: str,
    bucket_bytes: int,
    dtype: str = "float32",
    logits_input: list[list[int]] | None = None,
    writers: str = "rank0",
    engine_url: str | None = None,
    overwrite: bool = False,
    engine_key: str | None = None,
    quantize: BlockFP8 | None = None,
    progress_file: str | None = None,
) -> dict[str, Any]:
    """Build the Megatron model under ``layout`` from the HF checkpoint, stream it, write it out;
    with ``engine_url``, first update that engine's weights (``update_weights``, transport auto).
    ``overwrite``: replace a non-empty ``out_dir`` (refused otherwise; see ``save_hf_checkpoint``).
    ``engine_key``: the engine's API key. ``quantize``: write block FP8 (see ``save_hf_checkpoint``).
    ``progress_file``: rank 0 reports its phases and buckets there (:class:`~weightstream.common.progress.
    ProgressFile`) instead of drawing a bar."""
    reporter = ProgressFile(progress_file if dist.get_rank() == 0 else None)
    cfg = load_hf_config(hf_dir)
    start = time.perf_counter()
    chunks = _built(hf_dir, cfg, layout, dtype, reporter)
    built = time.perf_counter() - start
    update_report = None
    if engine_url is not None:
        reporter.phase("updating the engine")
        update_report = _update_engine(chunks, cfg, engine_url, bucket_bytes, engine_key)
    reporter.phase("streaming to disk")
    bar, update = _progress_bar("streaming") if progress_file is None else (None, reporter.count)
    start = time.perf_counter()
    report = save_hf_checkpoint(chunks, hf_dir, out_dir, bucket_bytes=bucket_bytes, writers=writers, progress=update,
                                overwrite=overwrite, quantize=quantize)
    seconds = time.perf_counter() - start
    if bar is not None:
        bar.close()
    reporter.close()
    result = _result(report, seconds, built, update_report)
    if logits_input is not None:
        ids = torch.tensor(logits_input, dtype=torch.long)
        result["logits"] = megatron_logits(chunks, ids, cfg.vocab_size)
    return result


def _update_engine(chunks: list[nn.Module], cfg: Any, url: str, bucket_bytes: int, api_key: str | None) -> Any:
    """The engine at ``url`` updated with the model's weights (transport chosen, every bucket checked); its
    :class:`~weightstream.update.UpdateReport`."""
    from weightstream.update import EngineOptions, SafetyOptions, SyncOptions, TransferOptions, update_weights

    options = SyncOptions(EngineOptions(api_key=api_key), TransferOptions(transport="auto", bucket_bytes=bucket_bytes),
                          safety=SafetyOptions(checksums=True))
    return update_weights(chunks, cfg, url, options=options)


def _result(report: CheckpointReport, seconds: float, built: float, update_report: Any) -> dict[str, Any]:
    """What a dump job returns on every rank: what was written, how long it took, the engine update's report."""
    return {
        "tensors": report.tensors,
        "bytes": report.total_size,
        "buckets": report.stats.buckets,
        "files": len(report.files),
        "seconds": seconds,
        "stream_seconds": report.stats.seconds,
        "build_seconds": built,
        "stats": asdict(report.stats),
        "update": update_report,
        "copied": report.copied,  # the HF directory's other files (tokenizer, ...), copied beside the shards
    }
