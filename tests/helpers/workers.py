"""Functions that run on every rank of a real local job (``weightstream.launch``)."""

from __future__ import annotations

import copy
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from tests.helpers.checks import INPUT_IDS  # (the prompts every logits check uses)
from tests.helpers.fp8_truth import same_bits, truth_of
from weightstream.checks.megatron_models import build_gpt_model, initialize_parallel, load_hf_weights, megatron_logits
from weightstream.common.hf_files import CheckpointReader
from weightstream.errors import WeightstreamError
from weightstream.jobs import Layout
from weightstream.models.spec import load_hf_config
from weightstream.sinks.safetensors import save_hf_checkpoint
from weightstream.sources.megatron import unwrap
from weightstream.streaming.stream import stream_hf_weights
from weightstream.wire.fp8 import BlockFP8


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
    grouped_experts: bool = False  # present routed experts under TE grouped-GEMM names
    router_dtype: str | None = None  # hold MoE routers' weights in this dtype (set before loading)
    quantize: BlockFP8 | None = None  # stream block FP8


def present_te_names(chunks: list[nn.Module]) -> None:
    """Re-register the norms under Transformer Engine's names (fused into the next linear; an MoE
    layer keeps its separate ``pre_mlp_layernorm``)."""
    for chunk in chunks:
        for layer in unwrap(chunk).decoder.layers:
            if hasattr(layer.self_attention, "linear_kv_up_proj"):
                present_te_mla(layer.self_attention)
            else:
                layer.self_attention.linear_qkv.layer_norm_weight = layer.input_layernorm.weight
                layer.input_layernorm = nn.Identity()
            if hasattr(layer.mlp, "linear_fc1"):
                layer.mlp.linear_fc1.layer_norm_weight = layer.pre_mlp_layernorm.weight
                layer.pre_mlp_layernorm = nn.Identity()


def present_te_mla(attn: nn.Module) -> None:
    """Multi-latent attention as Transformer Engine's spec holds it: the latent norms fused into the up
    projections (the input norm stays apart), the down projections whole on every TP rank (a duplicated
    ``TELinear``, not the local spec's column-parallel split): all-gathered here, the same values."""
    from megatron.core import parallel_state as ps

    for norm, up in (("q_layernorm", "linear_q_up_proj"), ("kv_layernorm", "linear_kv_up_proj")):
        if hasattr(attn, norm):
            getattr(attn, up).layer_norm_weight = getattr(attn, norm).weight
            setattr(attn, norm, nn.Identity())
    group = ps.get_tensor_model_parallel_group()
    for down in ("linear_q_down_proj", "linear_kv_down_proj"):
        linear = getattr(attn, down, None)
        if linear is None or dist.get_world_size(group) == 1:
            continue
        parts = [torch.empty_like(linear.weight) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, linear.weight.detach().contiguous(), group=group)
        linear.weight = nn.Parameter(torch.cat(parts, dim=0))


def present_grouped_experts(chunks: list[nn.Module]) -> None:
    """Re-register each MoE layer's SequentialMLP experts under Transformer Engine's grouped-GEMM
    names (``mlp.experts.linear_fc1.weight{e}``, local ``e``), the same tensors."""
    for chunk in chunks:
        for layer in unwrap(chunk).decoder.layers:
            experts = getattr(layer.mlp, "experts", None)
            if experts is None:
                continue
            grouped = nn.Module()
            grouped.linear_fc1, grouped.linear_fc2 = nn.Module(), nn.Module()
            for e, expert in enumerate(experts.local_experts):
                grouped.linear_fc1.register_parameter(f"weight{e}", expert.linear_fc1.weight)
                grouped.linear_fc2.register_parameter(f"weight{e}", expert.linear_fc2.weight)
            layer.mlp.experts = grouped


def hold_routers_in(chunks: list[nn.Module], dtype: torch.dtype) -> None:
    for chunk in chunks:
        for layer in unwrap(chunk).decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                router.weight.data = router.weight.data.to(dtype)


def _build(case: Case):
    layout = case.layout
    initialize_parallel(layout.tp, layout.pp, layout.vpp, layout.ep, layout.etp)
    cfg = load_hf_config(case.src)
    chunks = build_gpt_model(cfg, dtype=getattr(torch, case.dtype))
    if case.router_dtype:
        hold_routers_in(chunks, getattr(torch, case.router_dtype))
    if not case.random_init:
        with CheckpointReader(case.src) as reader:
            load_hf_weights(chunks, cfg, reader)
    return cfg, chunks


def _present(case: Case, chunks: list[nn.Module]) -> None:
    if case.te_names:
        present_te_names(chunks)
    if case.grouped_experts:
        present_grouped_experts(chunks)


def run_case(case: Case) -> dict:
    cfg, chunks = _build(case)
    logits = megatron_logits(chunks, torch.tensor(INPUT_IDS), cfg.vocab_size) if case.logits else None
    _present(case, chunks)  # after the forward: presented names are for streaming only
    stream = stream_hf_weights(chunks, cfg, bucket_bytes=case.bucket_bytes, mode=case.mode, quantize=case.quantize)
    out: dict = {"label": case.label, "rank": dist.get_rank()}
    names, mismatches, shards, bucket_sizes, counts = [], [], [], [], []
    largest = max(_megatron_bytes(it.entry) for it in stream.items)
    with truth_of(case.src, case.quantize) as truth:
        for bucket in stream:
            bucket_sizes.append(bucket.nbytes)
            counts.append(len(bucket))
            for meta, (name, tensor) in zip(bucket.metas, bucket.named_tensors(), strict=True):
                names.append(name)
                if case.mode == "per_rank":
                    shards.append((name, meta.shard, tensor.clone()))
                    continue
                if case.random_init:
                    continue
                if not same_bits(truth.get(name), tensor):
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
        ep_rank=stream.topology.ep_rank,
        etp_rank=stream.topology.etp_rank,
    )
    if logits is not None:
        out["logits"] = logits
    if case.save_to:
        report = save_hf_checkpoint(chunks, cfg, case.save_to, bucket_bytes=case.bucket_bytes, **case.save_kwargs)
        out["files"] = report.files
    return out


def _megatron_bytes(entry) -> int:
    n = entry.dtype.itemsize
    for d in entry.full_shape:
        n *= d
    return n


def run_cases(cases: list[Case], error_cases: list[tuple[Case, str, dict]] = ()) -> list[dict]:
    """``cases`` through :func:`run_case`, then ``error_cases`` through :func:`run_error_case`, in one job."""
    return [run_case(c) for c in cases] + [run_error_case(*e) for e in error_cases]


def _error(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": str(exc), "problems": getattr(exc, "problems", None)}


def run_error_case(case: Case, mutate: str, config_overrides: dict) -> dict:
    """Build a model, spoil it as ``mutate`` says, and report the error streaming raises.

    ``mutate="expert_bias"`` gives every MoE router Megatron's aux-loss-free ``expert_bias`` buffer
    (what ``moe_router_enable_expert_bias`` registers); the error loading the checkpoint into the
    model is then reported too, under ``"load"``."""
    cfg, chunks = _build(case)
    _present(case, chunks)
    out: dict = {}
    if mutate == "extra_param":
        layer = unwrap(chunks[0]).decoder.layers[0]
        layer.mlp.extra_scale = nn.Parameter(torch.ones(4))
        unwrap(chunks[-1]).decoder.final_layernorm.stray = nn.Parameter(torch.ones(2))
    if mutate == "expert_bias":
        for chunk in chunks:
            for layer in unwrap(chunk).decoder.layers:
                router = getattr(layer.mlp, "router", None)
                if router is not None:
                    del router.expert_bias  # None unless the model was built with the bias
                    router.register_buffer("expert_bias", torch.zeros(router.weight.shape[0]))
        try:
            with CheckpointReader(case.src) as reader:
                load_hf_weights(chunks, cfg, reader)
            out["load"] = {"type": None}
        except WeightstreamError as exc:
            out["load"] = _error(exc)
    stream_cfg = cfg
    if config_overrides:
        data = cfg.to_dict()
        data.update(config_overrides)
        stream_cfg = load_hf_config(data)
    out["label"] = case.label
    try:
        stream_hf_weights(chunks, stream_cfg, bucket_bytes=case.bucket_bytes, mode=case.mode, quantize=case.quantize)
    except WeightstreamError as exc:
        return {**out, **_error(exc)}
    except Exception:  # noqa: BLE001
        return {**out, "type": "unexpected", "message": traceback.format_exc()}
    return {**out, "type": None}


def run_update(case: Case, urls: list[str], updates: list[dict], one_sync: dict | None = None) -> list[dict]:
    """Build the trainer, then for each entry of ``updates`` (options for ``update_weights``, plus an
    optional ``reseed`` to change the weights first and ``save_to`` to write them), update the engines.
    ``one_sync``: the options of one ``WeightSync`` kept for every update (entries then give no options)."""
    from weightstream.update import WeightSync

    cfg, chunks = _build(case)
    out = []
    kept = WeightSync(urls, **one_sync) if one_sync is not None else None
    for u in updates:
        u = dict(u)
        reseed = u.pop("reseed", None)
        save_to = u.pop("save_to", None)
        version = u.pop("weight_version", None)
        if reseed is not None:
            # The same seed on every rank: a tensor Megatron replicates over TP ranks stays the same on each.
            gen = torch.Generator().manual_seed(reseed)
            with torch.no_grad():
                for c in chunks:
                    for p in c.parameters():
                        p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * 0.01)
        try:
            sync = kept or WeightSync(urls, **u)
            try:
                report = sync.update(chunks, cfg, weight_version=version)
            finally:
                if kept is None:
                    sync.close()
            entry = {"report": report}
            if dist.get_rank() == 0:
                from weightstream.engines import ReferenceEngine

                entry["engine_logits"] = ReferenceEngine(urls[0]).logits(INPUT_IDS)
                entry["engine_memory"] = ReferenceEngine(urls[0]).get("/weightstream/memory")["ranks"]
            out.append(entry)
        except Exception as exc:  # noqa: BLE001
            out.append({"error": f"{type(exc).__name__}: {exc}"})
        if save_to:
            save_hf_checkpoint(chunks, cfg, save_to, bucket_bytes=case.bucket_bytes)
    if kept is not None:
        kept.close()
    return out


def run_timed_updates(case: Case, targets: list[tuple[list[str], dict]]) -> list[dict]:
    """Build the trainer once, then one ``update_weights`` per target (engine URLs, options): the wall
    time this rank spent in it and the error it raised (type, phase, text), if any."""
    from weightstream.errors import UpdateError
    from weightstream.update import update_weights

    cfg, chunks = _build(case)
    out = []
    for urls, options in targets:
        dist.barrier()
        start = time.monotonic()
        entry: dict = {}
        try:
            entry["report"] = update_weights(chunks, cfg, urls, **options)
        except Exception as exc:  # noqa: BLE001
            entry.update(type=type(exc).__name__, error=str(exc), phase=getattr(exc, "phase", None))
            assert not isinstance(exc, UpdateError) or exc.phase in str(exc)
        entry["seconds"] = time.monotonic() - start
        out.append(entry)
    return out


def run_release_cycle(case: Case, url: str, transport: str, options: dict | None = None,
                      update_first: bool = False) -> dict:
    """A colocated RL round as users write it: the engine frees its memory while the trainer trains, then
    one update re-creates and refills it. Rank 0 reports the engine's memory and answers at each step.
    ``update_first``: one update before the release (whatever the engine and the trainer keep of it)."""
    from weightstream.engines import EngineError, ReferenceEngine
    from weightstream.update import WeightSync

    cfg, chunks = _build(case)
    eng = ReferenceEngine(url, timeout_s=120)
    out: dict = {}
    with WeightSync([url], transport=transport, timeout_s=60, **(options or {})) as sync:
        if update_first:
            out["first"] = sync.update(chunks, cfg, weight_version="first")
        if dist.get_rank() == 0:
            out["before"] = eng.get("/weightstream/memory")["ranks"]
        sync.release_memory()
        if dist.get_rank() == 0:
            out["released"] = eng.get("/weightstream/memory")["ranks"]
            try:
                eng.logits(INPUT_IDS)
                out["served_while_released"] = True
            except EngineError as exc:
                out["served_while_released"] = str(exc)
        report = sync.update(chunks, cfg, weight_version="after-release")
        out["report"] = report
        if dist.get_rank() == 0:
            out["after"] = eng.get("/weightstream/memory")["ranks"]
            out["logits"] = eng.logits(INPUT_IDS)
            out["generated"] = eng.generate(INPUT_IDS[0], max_new_tokens=4)["output_ids"]
    return out


def _snapshot(stream) -> dict[str, torch.Tensor]:
    return {name: t.clone() for b in stream for name, t in b.named_tensors()}


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype and a[n].shape == b[n].shape
        and torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8)) for n in a)


class PlanBuilds:
    """Counts the plans this process makes while it is entered: the stream module's plan maker, wrapped from
    the test side (an independent check of each stream's ``stats.planned``)."""

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self) -> PlanBuilds:
        from weightstream.streaming import kept_plans

        self._original = original = kept_plans.make_plan

        def counted(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        kept_plans.make_plan = counted
        return self

    def __exit__(self, *exc) -> None:
        from weightstream.streaming import kept_plans

        kept_plans.make_plan = self._original


def run_plan_reuse(src: str, tp: int) -> dict:
    """Streams of one live model, again and again, with the model changed in between in the ways a
    trainer changes it (values in place) and in ways that must re-plan (a parameter replaced, new
    storage on one rank only, other bucket settings, a new parallel layout)."""
    from weightstream.streaming import stream as stream_mod

    case = Case(src, Layout(tp, 1), dtype="bfloat16", router_dtype="float32")
    cfg, chunks = _build(case)
    rank = dist.get_rank()
    model = unwrap(chunks[0])
    steps: list[dict] = []

    def step(label: str, **kw) -> dict[str, torch.Tensor]:
        with PlanBuilds() as builds:
            s = stream_hf_weights(chunks, cfg, bucket_bytes=kw.pop("bucket_bytes", 32 << 10), **kw)
        got = _snapshot(s)
        steps.append({"label": label, "planned": s.stats.planned, "builds": builds.count,
                      "batched": s.stats.batched, "unbatched": s.stats.unbatched, "tensors": s.stats.tensors,
                      "copies": s.stats.copies, "gate_projs": sum("gate_proj" in n for n in got)})
        return got

    first = step("first")
    again = step("again")
    out: dict = {"rank": rank, "again_equal": _same_bits(first, again)}
    with torch.no_grad():  # what an optimizer step does: values change in place, storage stays
        for p in model.parameters():
            p.mul_(2)
    doubled = step("in place x2")
    out["doubled_equal"] = _same_bits(doubled, {n: t * 2 for n, t in first.items()})

    layer = model.decoder.layers[0]
    qkv = layer.self_attention.linear_qkv
    with torch.no_grad():
        qkv.weight = nn.Parameter(qkv.weight.detach() + 1)  # a parameter replaced
    replaced = step("parameter replaced")
    stream_mod.clear_plans()
    fresh = step("fresh plan after clear_plans")
    out["replaced_equal_fresh"] = _same_bits(replaced, fresh)

    if rank == tp - 1:  # new storage on one rank only: every rank must re-plan
        norm = layer.self_attention.linear_proj.weight
        norm.data = norm.data.clone()
    step("new storage on the last rank")
    step("kept again")
    norm = copy.deepcopy(layer.input_layernorm)  # a submodule replaced: every dict keeps its size
    with torch.no_grad():
        norm.weight.add_(1)
    layer.input_layernorm = norm
    swapped = step("submodule replaced")
    stream_mod.clear_plans()
    out["swapped_equal_fresh"] = _same_bits(swapped, step("fresh plan after the swap"))
    step("another bucket size", bucket_bytes=16 << 10)
    step("per_rank", mode="per_rank")
    step("first bucket size again")
    step("split dtypes", split_dtypes=True)
    split = stream_hf_weights(chunks, cfg, bucket_bytes=32 << 10, split_dtypes=True)
    dtypes = [sorted({str(m.dtype) for m in b.metas}) for b in split]
    out["split_dtypes_per_bucket"] = dtypes
    split_stream = stream_hf_weights(chunks, cfg, bucket_bytes=32 << 10, split_dtypes=True)
    out["split_equal"] = _same_bits(_snapshot(split_stream), step("unsplit"))

    initialize_parallel(tp, 1)  # new process groups: the layout key changes
    step("new parallel state")
    out["steps"] = steps
    return out


def run_prepared_update(case: Case, url: str, options: dict) -> dict:
    """``WeightSync.prepare`` then one update: how many plans the update itself made, and its report."""
    from weightstream.update import WeightSync

    cfg, chunks = _build(case)
    with WeightSync([url], **options) as sync:
        kind = sync.prepare(chunks, cfg)
        group_ready = all(getattr(s, "group", True) is not None for s in sync.sinks.values()) if dist.get_rank() == 0 \
            else True
        memory = []
        if dist.get_rank() == 0:
            from weightstream.engines import ReferenceEngine

            memory.append(ReferenceEngine(url).get("/weightstream/memory")["ranks"])
        with PlanBuilds() as builds:
            report = sync.update(chunks, cfg)
        if dist.get_rank() == 0:
            memory.append(ReferenceEngine(url).get("/weightstream/memory")["ranks"])
        return {"prepared": kind, "group_ready": group_ready, "builds_in_update": builds.count,
                "copies_in_update": report.copies_made, "report": report,
                "engine_memory": memory}
