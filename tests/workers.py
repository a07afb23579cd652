"""Functions that run on every rank of a real local job (``weightstream.launch``)."""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from weightstream.disk import CheckpointReader
from weightstream.errors import WeightstreamError
from weightstream.jobs import Layout
from weightstream.models.megatron import build_gpt_model, initialize_parallel, load_hf_weights, megatron_logits
from weightstream.models.spec import load_hf_config
from weightstream.streaming.checkpoint import save_hf_checkpoint
from weightstream.streaming.source import unwrap
from weightstream.streaming.stream import stream_hf_weights

INPUT_IDS = [[3, 14, 159, 265, 358, 979, 323, 846, 26, 433], [999, 0, 1, 2, 500, 501, 77, 88, 99, 111]]


@dataclass
class Case:
    src: str
    layout: Layout
    mode: str = "full"
    bucket_bytes: int = 64 << 10
    dtype: str = "float32"
    te_names: bool = False
    logits: bool = False
    random_init: bool = False  # keep Megatron's own random weights (do not load src)
    save_to: str | None = None  # also write a checkpoint here
    save_kwargs: dict = field(default_factory=dict)
    label: str = ""


def present_te_names(chunks: list[nn.Module]) -> None:
    """Re-register the norms under Transformer Engine's names (fused into the next linear)."""
    for chunk in chunks:
        for layer in unwrap(chunk).decoder.layers:
            layer.self_attention.linear_qkv.layer_norm_weight = layer.input_layernorm.weight
            layer.input_layernorm = nn.Identity()
            layer.mlp.linear_fc1.layer_norm_weight = layer.pre_mlp_layernorm.weight
            layer.pre_mlp_layernorm = nn.Identity()


def _build(case: Case):
    layout = case.layout
    initialize_parallel(layout.tp, layout.pp, layout.vpp, layout.ep, layout.etp)
    cfg = load_hf_config(case.src)
    chunks = build_gpt_model(cfg, dtype=getattr(torch, case.dtype))
    if not case.random_init:
        with CheckpointReader(case.src) as reader:
            load_hf_weights(chunks, cfg, reader)
    if case.te_names:
        present_te_names(chunks)
    return cfg, chunks


def run_case(case: Case) -> dict:
    cfg, chunks = _build(case)
    stream = stream_hf_weights(chunks, cfg, bucket_bytes=case.bucket_bytes, mode=case.mode)
    out: dict = {"label": case.label, "rank": dist.get_rank()}
    names, mismatches, shards, bucket_sizes, counts = [], [], [], [], []
    largest = max(_megatron_bytes(it.entry) for it in stream.items)
    with CheckpointReader(case.src) as truth:
        for bucket in stream:
            bucket_sizes.append(bucket.nbytes)
            counts.append(len(bucket))
            for meta, (name, tensor) in zip(bucket.metas, bucket.named_tensors()):
                names.append(name)
                if case.mode == "per_rank":
                    shards.append((name, meta.shard, tensor.clone()))
                    continue
                if case.random_init:
                    continue
                ref = truth.get(name)
                if ref.dtype != tensor.dtype or ref.shape != tensor.shape or not torch.equal(
                    ref.view(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)
                ):
                    mismatches.append(name)
    out.update(
        names=names,
        mismatches=mismatches,
        shards=shards,
        bucket_sizes=bucket_sizes,
        tensors_per_bucket=counts,
        stats=stream.stats,
        largest_tensor=largest,
        tp_rank=stream.topology.tp_rank,
        pp_rank=stream.topology.pp_rank,
    )
    if case.logits:
        out["logits"] = megatron_logits(chunks, torch.tensor(INPUT_IDS), cfg.vocab_size)
    if case.save_to:
        report = save_hf_checkpoint(chunks, cfg, case.save_to, bucket_bytes=case.bucket_bytes, **case.save_kwargs)
        out["files"] = report.files
    return out


def _megatron_bytes(entry) -> int:
    n = entry.dtype.itemsize
    for d in entry.full_shape:
        n *= d
    return n


def run_cases(cases: list[Case]) -> list[dict]:
    return [run_case(c) for c in cases]


def run_error_case(case: Case, mutate: str, config_overrides: dict) -> dict:
    """Build a model, spoil it as ``mutate`` says, and report the error streaming raises."""
    cfg, chunks = _build(case)
    if mutate == "extra_param":
        layer = unwrap(chunks[0]).decoder.layers[0]
        layer.mlp.extra_scale = nn.Parameter(torch.ones(4))
        unwrap(chunks[-1]).decoder.final_layernorm.stray = nn.Parameter(torch.ones(2))
    stream_cfg = cfg
    if config_overrides:
        data = cfg.to_dict()
        data.update(config_overrides)
        stream_cfg = load_hf_config(data)
    try:
        stream_hf_weights(chunks, stream_cfg, bucket_bytes=case.bucket_bytes)
    except WeightstreamError as exc:
        return {"type": type(exc).__name__, "message": str(exc), "problems": getattr(exc, "problems", None)}
    except Exception:  # noqa: BLE001
        return {"type": "unexpected", "message": traceback.format_exc()}
    return {"type": None}
