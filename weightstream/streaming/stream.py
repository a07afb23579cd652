"""``stream_hf_weights``: a model's weights as lazy, bounded buckets of HF tensors.

Flow for one call (on every rank of the job):

1. source (:mod:`weightstream.sources`): the global table (same on all ranks) and this
   rank's live tensors: a Megatron-Core model, an FSDP2/DTensor model, or a Megatron checkpoint on disk;
2. plan: buckets of at most ``bucket_bytes``, and for each bucket its copy program;
3. per bucket, lazily: what the converter reads for the tensors this rank makes is taken as a view of a
   live tensor, or fetched from the source (one batched all-gather per group; read from disk); each is
   converted and packed into the flat buffer; then the source shares each rank's part of the bucket
   with the others (Megatron: over the EP and PP groups).

Steps 1-2 are made once and kept (:class:`StreamPlan`, cached per model by
:mod:`~weightstream.streaming.kept_plans`): a later call on the same
model, config, converter, parallel layout and bucket settings reuses them after checking, in a
few milliseconds, that no parameter was replaced, moved to new storage, added or removed (all ranks
agree through one all-reduce; a caller that confirms later, ``confirm_later``, has that full check made after the
copies by :func:`confirm_plan`, see :mod:`~weightstream.streaming.kept_plans`). Packing is then batched: the
converted tensors are views of the live parameters, prepared once, and each bucket is filled with one batched copy
per dtype (``_foreach_copy_``, or on a GPU one launch of :mod:`~weightstream.streaming.copies` into a kept buffer).

Mixture of experts: routed experts always carry their global index (``mlp.experts.{E}``, with
``E = ep_rank * experts_per_rank + e``). In full mode every rank yields every expert, gathered over expert-TP
and broadcast from its EP owner within the bucket. In per_rank mode there is no EP traffic: each rank yields
only the experts its own EP rank holds (cut by its expert-TP rank, the :class:`Shard` giving the placement),
plus the non-expert tensors (cut by its dense TP rank). This serves an engine whose expert parallelism equals
the trainer's: engine EP rank r loads the experts that trainer EP rank r yields, under the same global ids,
and takes the non-expert tensors from any one EP rank (they are the same on all); an engine with another
expert layout needs full mode.

What each rank emits per tensor (whole, or an engine TP rank's shards; block FP8 where declared) is
:mod:`~weightstream.streaming.items`; how each bucket is filled, :mod:`~weightstream.streaming.programs`; the
iterator of buckets, :mod:`~weightstream.streaming.bucket_stream`.

A receiver whose memory this process can write (a colocated engine's own weights, mapped through CUDA IPC)
may take the tensors there instead of in bucket buffers (:meth:`BucketStream.write_into`): the same batched
copies, with the receiver's tensors as their targets.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from torch import nn

from weightstream.common.layout import ALIGN
from weightstream.converters.registry import model_spec
from weightstream.models.spec import ModelSpec, load_hf_config
from weightstream.sources import as_source
from weightstream.sources.base import Mode, Source
from weightstream.sources.topology import Topology
from weightstream.streaming.bucket_stream import BucketStream, StreamStats
from weightstream.streaming.items import entry_mode
from weightstream.streaming.kept_plans import PlanSettings, StreamPlan, clear_plans, confirm_kept_plan, kept_or_new_plan
from weightstream.wire.fp8 import BlockFP8

__all__ = [
    "DEFAULT_BUCKET_BYTES", "StreamStats", "StreamPlan", "BucketStream", "stream_hf_weights", "stream_of",
    "confirm_plan", "clear_plans", "entry_mode", "Mode"
]


DEFAULT_BUCKET_BYTES = 512 << 20


def stream_hf_weights(
    model: nn.Module | Sequence[nn.Module] | Source,
    hf_config: Any,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    mode: Mode = "full",
    align: int = ALIGN,
    topology: Topology | None = None,
    split_dtypes: bool = False,
    reuse_buffers: bool = False,
    quantize: BlockFP8 | None = None,
    confirm_later: bool = False,
) -> BucketStream:
    """Stream a model's weights as buckets of HF tensors. Call on every rank.

    ``model``: Megatron-Core model chunks (a ``GPTModel``, possibly wrapped in DDP / Float16Module, or
    the list of VPP chunks); a transformers model (or an ``nn.Module`` with HF names) whose parameters
    are FSDP2 / tensor-parallel DTensors or plain tensors; or any :class:`Source`, such as
    :class:`~weightstream.sources.megatron_checkpoint.MegatronCheckpointSource` for a checkpoint on
    disk. ``hf_config``: a transformers config, a dict with ``model_type``, or a directory.

    ``mode="full"``: each HF tensor whole, on every rank (shards all-gathered once per bucket and
    group, PP stages and EP owners broadcast). ``mode="per_rank"``: no TP gather; TP rank r yields the
    HF shards an engine's TP rank r holds, each with its :class:`Shard` placement.

    Mixture of experts: see the module's doc.

    ``align``: each tensor's start in the bucket buffer is a multiple of it (default 256); ``align=1``
    packs tensors back to back, largest element size first (the layout SGLang's distributed
    receiver computes from names, dtypes and shapes alone).

    ``split_dtypes``: every bucket holds one dtype (for engines whose flat buckets are typed, LMDeploy's):
    the tensors are grouped by dtype (in order within each) and buckets are cut between groups.

    ``reuse_buffers``: buckets are packed into two buffers kept with the plan (bucket i into buffer
    ``i % 2``, with its copy views made once), so a bucket is valid only until bucket i + 2 is asked for: for
    consumers that are done with a bucket by then (every sink is; ``update_weights`` and
    ``save_hf_checkpoint`` use it). The two buffers stay allocated while the plan is kept
    (:func:`clear_plans` frees them).

    The table, checks and plan are made here, eagerly (so a bad model raises now, on every rank alike); the buckets
    are made one at a time as the returned iterator is advanced. ``confirm_later``: a kept plan is reused once its
    copies are memory safe to launch, and the caller confirms it in full after them (:func:`confirm_plan`).
    """
    if mode not in ("full", "per_rank"):
        raise ValueError(f"mode must be 'full' or 'per_rank', got {mode!r}")
    start = time.perf_counter()
    source = as_source(model, topology)
    cfg = load_hf_config(hf_config)
    return stream_of(source, cfg, model_spec(cfg), PlanSettings(mode, bucket_bytes, align, split_dtypes, quantize),
                     reuse_buffers=reuse_buffers, confirm_later=confirm_later, start=start)


def stream_of(source: Source, cfg: Any, spec: ModelSpec, settings: PlanSettings, *, reuse_buffers: bool = False,
              confirm_later: bool = False, start: float | None = None) -> BucketStream:
    """:func:`stream_hf_weights` for a caller that holds the source, the loaded config and its spec already (the
    spec must be ``model_spec(cfg)``: ``WeightSync`` makes them once per update). ``start``: when the caller began
    (``time.perf_counter()``), for the stream's ``stats.setup_seconds``."""
    start = time.perf_counter() if start is None else start
    plan, planned = kept_or_new_plan(source, cfg, spec, settings, confirm_later=confirm_later)
    modules = bool(list(source.modules()))
    stream = BucketStream(spec=spec, mode=settings.mode, topology=source.topology, source=plan.source,
                          plan=plan.buckets, items=plan.items, device=plan.device, align=settings.align, shared=plan,
                          reuse_buffers=reuse_buffers and modules, quantization=plan.quantization)
    stream.stats.planned = planned
    stream.stats.setup_seconds = time.perf_counter() - start
    return stream



def confirm_plan(stream: BucketStream) -> bool:
    """Whether what ``stream`` yielded was the model's: call on every rank, after iterating it (a vote, one
    all-reduce where its plan was kept). True where its plan was made for it, or reused after the full check (or
    confirmed since). A kept plan reused on the addresses check alone (``confirm_later``) is checked in full now:
    where a parameter was replaced or re-pointed (``p.data = x``) since the plan was made, its copies read the old
    storage (alive, unmoved: valid memory, stale bytes), and the answer is False; the plan is then forgotten, so the
    next stream of the model makes a new one."""
    plan = stream.shared
    if plan is None or stream.stats.planned:
        return True
    return confirm_kept_plan(plan, stream.topology)
