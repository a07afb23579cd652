"""A rank function for the DeepSeek-V3 family: a model reloaded under Transformer Engine's names (whole down
projections)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.helpers.fp8_truth import same_bits
from tests.helpers.workers import Case, _build, present_te_names
from weightstream.checks.megatron_models import load_hf_weights
from weightstream.common.hf_files import CheckpointReader
from weightstream.sources.megatron import unwrap
from weightstream.streaming.stream import stream_hf_weights


def run_te_reload(case: Case) -> dict:
    """Build and load the model, present it under Transformer Engine's names (the latent norms fused, the down
    projections whole on every TP rank), zero every tensor, load the checkpoint again into those names and
    stream it: the reverse direction and the stream through the whole-or-split declarations."""
    cfg, chunks = _build(case)
    present_te_names(chunks)
    with torch.no_grad():
        for chunk in chunks:
            for p in chunk.parameters():
                p.zero_()
    with CheckpointReader(case.src) as reader:
        load_hf_weights(chunks, cfg, reader)
    attn = unwrap(chunks[0]).decoder.layers[0].self_attention
    names, mismatches = [], []
    with CheckpointReader(case.src) as truth:
        for bucket in stream_hf_weights(chunks, cfg, bucket_bytes=case.bucket_bytes, mode=case.mode):
            for name, tensor in bucket.named_tensors():
                names.append(name)
                if not same_bits(truth.get(name), tensor):
                    mismatches.append(name)
    return {"label": case.label, "rank": dist.get_rank(), "names": names, "mismatches": mismatches,
            "kv_down_shape": tuple(attn.linear_kv_down_proj.weight.shape),
            "te_names": sorted(n for n, _ in attn.named_parameters())}

