"""Functions that run on every rank of a real FSDP2 job (``weightstream.launch``, gloo): a transformers
model loaded from an HF checkpoint, tensor parallel over a ``tp`` mesh dimension where asked, then
sharded with ``fully_shard`` over the ``dp`` dimension."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.helpers.checks import INPUT_IDS


def build_fsdp(src: str, mesh_shape: tuple[int, ...], *, reshard_after_forward: bool = True):
    """The model of ``src`` under FSDP2 on a ``(dp,)`` or ``(dp, tp)`` mesh (TP: q/k/v and gate/up
    column-wise, o/down row-wise, dense MLPs only); ``("hf", dp, tp)``: transformers' own tensor parallel
    plan and FSDP (``DistributedConfig``; fused experts split over TP too)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    if mesh_shape[0] == "hf":
        from transformers.distributed import DistributedConfig

        config = DistributedConfig(fsdp_size=mesh_shape[1], tp_size=mesh_shape[2])
        return AutoModelForCausalLM.from_pretrained(src, distributed_config=config, dtype=torch.float32).eval()

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    names = ("dp", "tp")[: len(mesh_shape)]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    if len(mesh_shape) == 2:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for layer in model.model.layers:
            plan = {f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
            plan["self_attn.o_proj"] = RowwiseParallel()
            if hasattr(layer.mlp, "gate_proj"):
                plan.update({"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                             "mlp.down_proj": RowwiseParallel()})
            parallelize_module(layer, mesh["tp"], plan)
    dp = mesh["dp"]
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp, reshard_after_forward=reshard_after_forward)
    return model


def _collect(stream) -> dict:
    tensors, shards = {}, {}
    for bucket in stream:
        for meta, (name, tensor) in zip(bucket.metas, bucket.named_tensors(), strict=True):
            tensors[name] = tensor.clone()
            if meta.shard is not None:
                shards[name] = meta.shard
    return {"tensors": tensors, "shards": shards, "gathers": stream.stats.gathers,
            "batched": stream.stats.batched, "planned": stream.stats.planned}


def run_fsdp_stream(src: str, mesh_shape: tuple, modes: list[str], forward: bool = False,
                    bucket_bytes: int = 60_000) -> dict:
    """Stream the FSDP2 model once per mode (twice for the first: the second reuses the plan); with
    ``forward``, after a forward that leaves the parameters unsharded. What this rank yielded, and what
    the DTensor placements were."""
    import weightstream as ws

    model = build_fsdp(src, mesh_shape, reshard_after_forward=not forward)
    from torch.distributed.tensor import DTensor

    placements = {n: str(p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    out: dict = {"placements": placements}
    if forward:
        with torch.no_grad():
            out["logits"] = model(torch.tensor(INPUT_IDS)).logits.float()
        out["plain_after_forward"] = not any(isinstance(p, DTensor) for p in model.parameters())
    for mode in modes:
        out[mode] = _collect(ws.stream_hf_weights(model, src, bucket_bytes=bucket_bytes, mode=mode))
    out["again"] = _collect(ws.stream_hf_weights(model, src, bucket_bytes=bucket_bytes, mode=modes[0]))
    return out


def run_fsdp_update(src: str, mesh_shape: tuple, url: str, transports: list[str], save_to: str) -> list[dict]:
    """``update_weights`` of the FSDP2 model into the engine by each transport, then (rank 0) the engine's
    logits; and the model written with ``save_hf_checkpoint``."""
    import weightstream as ws
    from weightstream.engines import ReferenceEngine

    model = build_fsdp(src, mesh_shape)
    out = []
    for i, transport in enumerate(transports):
        report = ws.update_weights(model, src, url, transport=transport, bucket_bytes=60_000,
                                   weight_version=f"fsdp-{i}")
        entry = {"report": report}
        if dist.get_rank() == 0:
            entry["engine_logits"] = ReferenceEngine(url).logits(INPUT_IDS)
        out.append(entry)
    ws.save_hf_checkpoint(model, src, save_to, bucket_bytes=60_000)
    return out


def run_fsdp_cases(cases: list[tuple]) -> list:
    """Several of the above in one job: ``(function name, args...)`` each."""
    return [globals()[name](*args) for name, *args in cases]
