"""What a warm broadcast update sent ahead by its plan's key costs before its first bucket can be received, from the
engine's server taking the request to each worker holding every bucket's copy program: for a plan shaped like
Qwen3-30B-A3B's (48 layers, 128 experts, bf16 buckets of 512 MiB: 18,867 tensors) and its block-FP8 form (each
quantized weight with its ``<name>_scale_inv``: 37,491 tensors), on this machine's CPU.

Two ways, each timed the same (the median of 30): the server's part (the plan looked up by its key, each rank's
command made), the command over a real pipe to each of two worker processes (pickled, sent, unpickled, as the engine's
ranks are sent theirs), each worker's programs in hand, and a word back from each. ``with buckets``: the command names
every bucket's metadata and the worker looks each bucket's program up by its names, dtypes and shapes (what every warm
update did before the workers kept plans by key; what a rank that does not hold the plan is still sent); ``by key``:
the command names the key alone and the worker takes the plan it keeps
(:meth:`~weightstream.receiver.collective.CollectiveReceiver.held_plan`). The workers' programs are made without a
model (no targets): the lookups are the engine's, the copies are not part of this.

    python tools/keyed_plan_cost.py
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

import torch

from weightstream.common.phases import PhaseClock
from weightstream.receiver.ahead_plans import AheadPlans, HeldPlan, KeyedReceive, plan_key
from weightstream.receiver.collective import CollectiveReceiver
from weightstream.receiver.plan import DenseBucket, Receive
from weightstream.receiver.programs import CopyProgram, ProgramCache, copy_program
from weightstream.receiver.requests import BroadcastUpdate
from weightstream.receiver.session import Facilities
from weightstream.receiver.transfer import ReceiveBuffers
from weightstream.reference_engine.protocol import Command

BUCKET_BYTES = 512 << 20
TP = 2
RUNS = 30

LAYERS, EXPERTS, HIDDEN, MOE_FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 48, 128, 2048, 768, 32, 4, 128, 151936
SIZES = {"bfloat16": 2, "float8_e4m3fn": 1, "float32": 4}


def qwen3_30b_a3b(fp8: bool) -> list[tuple[str, str, tuple[int, ...]]]:
    """Every tensor of the checkpoint, in order: (name, dtype, shape); ``fp8``: the attention and expert weights in
    float8 with their 128 x 128 block scales (float32) after each."""
    def weight(name: str, shape: tuple[int, ...]) -> list[tuple[str, str, tuple[int, ...]]]:
        if not fp8:
            return [(name, "bfloat16", shape)]
        blocks = tuple(-(-d // 128) for d in shape)
        return [(name, "float8_e4m3fn", shape), (f"{name}_scale_inv", "float32", blocks)]

    out = [("model.embed_tokens.weight", "bfloat16", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        out.append((f"{p}.input_layernorm.weight", "bfloat16", (HIDDEN,)))
        for proj, shape in (("q", (HEADS * HEAD_DIM, HIDDEN)), ("k", (KV_HEADS * HEAD_DIM, HIDDEN)),
                            ("v", (KV_HEADS * HEAD_DIM, HIDDEN)), ("o", (HIDDEN, HEADS * HEAD_DIM))):
            out += weight(f"{p}.self_attn.{proj}_proj.weight", shape)
        out += [(f"{p}.self_attn.q_norm.weight", "bfloat16", (HEAD_DIM,)),
                (f"{p}.self_attn.k_norm.weight", "bfloat16", (HEAD_DIM,)),
                (f"{p}.post_attention_layernorm.weight", "bfloat16", (HIDDEN,)),
                (f"{p}.mlp.gate.weight", "bfloat16", (EXPERTS, HIDDEN))]
        for e in range(EXPERTS):
            for proj, shape in (("gate", (MOE_FFN, HIDDEN)), ("up", (MOE_FFN, HIDDEN)), ("down", (HIDDEN, MOE_FFN))):
                out += weight(f"{p}.mlp.experts.{e}.{proj}_proj.weight", shape)
    return out + [("model.norm.weight", "bfloat16", (HIDDEN,)), ("lm_head.weight", "bfloat16", (VOCAB, HIDDEN))]


def plan_of(fp8: bool) -> tuple[DenseBucket, ...]:
    """The tensors in buckets of at most :data:`BUCKET_BYTES` (a larger tensor alone), in order."""
    buckets: list[list[tuple[str, str, tuple[int, ...]]]] = [[]]
    size = 0
    for t in qwen3_30b_a3b(fp8):
        n = SIZES[t[1]] * int(torch.Size(t[2]).numel())
        if buckets[-1] and size + n > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += n
    return tuple(DenseBucket(tuple(n for n, _, _ in b), tuple(d for _, d, _ in b), tuple(s for _, _, s in b))
                 for b in buckets)


@dataclass
class ProgramsOnly:
    """What a worker's receives read of its update session here: the rank's facilities and the programs kept, each
    made without targets (there is no model)."""

    at: Facilities
    programs: ProgramCache

    def program(self, metas: Any, key: tuple | None = None) -> CopyProgram:
        return copy_program(metas, None, key)


def worker(rank: int, fp8: bool, conn: Connection) -> None:
    """A worker after its first update of the plan: every bucket's program kept by its layout, and the plan kept by
    its key; then each command answered once its programs are in hand."""
    plan = plan_of(fp8)
    session = ProgramsOnly(Facilities(rank, TP, torch.device("cpu"), PhaseClock(), {}), ProgramCache(1 << 30))
    receiver = CollectiveReceiver(session, ReceiveBuffers(torch.device("cpu")))  # type: ignore[arg-type]
    programs = tuple(receiver._dense_program(b) for b in plan)
    for b, p in zip(plan, programs, strict=True):
        session.programs.put(b.key, p, len(p.metas))
    receiver.plans.put(plan_key(plan), HeldPlan(plan, programs))
    conn.send("ready")
    while (command := conn.recv()) is not None:
        r = command.request
        if isinstance(r, KeyedReceive):
            in_hand = receiver.held_plan(r).programs or ()
        else:
            in_hand = tuple(receiver._dense_program(b) for b in r.buckets)
        conn.send(len(in_hand))


def commands(update: BroadcastUpdate, plans: AheadPlans, by_key: bool) -> list[Receive | KeyedReceive]:
    """The server's part: the plan by its key, then each rank's command."""
    assert update.plan_key is not None
    r = replace(update, buckets=plans.get(update.plan_key))
    if by_key:
        return list(r.keyed_receives(update.plan_key, [frozenset({update.plan_key})] * TP))
    return list(r.receives(TP, 60.0).per_rank)


def timed(fp8: bool) -> dict[str, Any]:
    plan = plan_of(fp8)
    key = plan_key(plan)
    plans: AheadPlans[tuple[DenseBucket, ...]] = AheadPlans()
    plans.put(key, plan)
    update = BroadcastUpdate((), True, load_format="flattened_bucket", plan_key=key)
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(TP)]
    procs = [ctx.Process(target=worker, args=(rank, fp8, child)) for rank, (_, child) in enumerate(pipes)]
    for p in procs:
        p.start()
    conns = [parent for parent, _ in pipes]
    assert [c.recv() for c in conns] == ["ready"] * TP
    out: dict[str, Any] = {"tensors": sum(len(b.names) for b in plan), "buckets": len(plan)}
    for way, by_key in (("with buckets", False), ("by key", True)):
        times = []
        for n in range(RUNS):
            start = time.perf_counter()
            for conn, request in zip(conns, commands(update, plans, by_key), strict=True):
                conn.send(Command(n, request))
            assert [c.recv() for c in conns] == [len(plan)] * TP
            times.append(time.perf_counter() - start)
        pickled = len(mp.reduction.ForkingPickler.dumps(Command(0, commands(update, plans, by_key)[0])))
        out[way] = {"ms (median)": round(statistics.median(times) * 1e3, 2),
                    "ms (min)": round(min(times) * 1e3, 2), "command bytes per rank": pickled}
    for conn, p in zip(conns, procs, strict=True):
        conn.send(None)
        p.join()
    return out


if __name__ == "__main__":
    print(json.dumps({"bf16": timed(False), "block FP8": timed(True)}, indent=1))
