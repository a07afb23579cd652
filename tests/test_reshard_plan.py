"""The resharding plan, from metadata alone: what each trainer rank sends each engine rank."""

from __future__ import annotations

import pytest
import torch

from weightstream.common.layout import layout
from weightstream.converters.registry import model_spec
from weightstream.engines import EngineInfo, ReferenceEngine
from weightstream.engines.base import BROADCAST, IPC, P2P, RESHARD
from weightstream.errors import ConversionError
from weightstream.models.presets import preset_config
from weightstream.receiver.pieces import assemble
from weightstream.sinks.p2p import served_by
from weightstream.sinks.reshard import _packed, pick_senders
from weightstream.sources.topology import Topology
from weightstream.streaming.bucket import Bucket, Shard, TensorMeta, view_tensor
from weightstream.streaming.reshard import EngineLayout, is_identity, plan_bucket, tiling_problems
from weightstream.update import choose_transport

pytestmark = pytest.mark.unit

F32 = torch.float32
# A tiny layer as HF names it: q split by rows, o by columns (Megatron's column / row parallel), a norm whole.
SHAPES = {"q.weight": (8, 4), "o.weight": (4, 8), "norm.weight": (4,)}
DIMS = {"q.weight": 0, "o.weight": 1}


def _held(name: str, shape: tuple[int, ...], dim: int | None, tp: int, rank: int):
    """``name`` as TP rank ``rank`` of ``tp`` holds it: whole (no split dim, or TP 1), or its shard along ``dim``."""
    if dim is None or tp == 1:
        return name, shape, None
    n = shape[dim] // tp
    local = list(shape)
    local[dim] = n
    return name, tuple(local), Shard(dim, rank * n, n, shape[dim])


def trainer_bucket(tp: int, rank: int) -> list[TensorMeta]:
    """The bucket a trainer TP rank yields per rank: its shard of q and o, the norm whole."""
    out = [_held(name, shape, DIMS.get(name), tp, rank) for name, shape in SHAPES.items()]
    offsets, _ = layout([[4 * _numel(s)] for _, s, _ in out])
    return [TensorMeta(name, F32, shape, off, shard) for (name, shape, shard), (off,) in zip(out, offsets, strict=True)]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def routes(tp: int, engine_tp: int):
    senders = [trainer_bucket(tp, r) for r in range(tp)]
    return senders, plan_bucket(senders, EngineLayout(engine_tp, DIMS))


def by_pair(plan):
    return {(r.sender, r.engine_rank): r for r in plan}


def engine_pieces(plan, e):
    """Per tensor name, the placements engine rank e receives."""
    out: dict[str, list] = {}
    for r in plan:
        if r.engine_rank == e:
            for m in r.metas:
                out.setdefault(m.name, []).append(m.shard)
    return out


def test_equal_tp_is_each_rank_its_own_bucket():
    senders, plan = routes(2, 2)
    assert is_identity(plan, 2)
    assert [(r.sender, r.engine_rank, r.whole_bucket) for r in plan] == [(0, 0, True), (1, 1, True)]
    assert by_pair(plan)[(1, 1)].metas == tuple(senders[1])


def test_tp2_to_tp1_each_sends_its_shards_and_one_sends_the_norm():
    senders, plan = routes(2, 1)
    pairs = by_pair(plan)
    assert set(pairs) == {(0, 0), (1, 0)}
    assert pairs[(0, 0)].whole_bucket and pairs[(0, 0)].metas == tuple(senders[0])
    # Rank 1 sends its shards, not the norm (rank 0 sends it): packed anew, shards placed in the whole.
    assert not pairs[(1, 0)].whole_bucket
    assert [(m.name, m.shape, m.shard) for m in pairs[(1, 0)].metas] == [
        ("q.weight", (4, 4), Shard(0, 4, 4, 8)), ("o.weight", (4, 4), Shard(1, 4, 4, 8))]
    got = engine_pieces(plan, 0)
    for name, dests in got.items():
        assert tiling_problems(name, dests, None, SHAPES[name]) == []


def test_tp1_to_tp2_cuts_rows_and_columns():
    senders, plan = routes(1, 2)
    pairs = by_pair(plan)
    assert set(pairs) == {(0, 0), (0, 1)}
    r1 = pairs[(0, 1)]
    assert [(p.name, p.cut, p.shape, p.dest) for p in r1.pieces] == [
        ("q.weight", (0, 4, 4), (4, 4), Shard(0, 4, 4, 8)),
        ("o.weight", (1, 4, 4), (4, 4), Shard(1, 4, 4, 8)),
        ("norm.weight", None, (4,), None),
    ]
    assert r1.nbytes == r1.metas[-1].offset + 16 and r1.metas[0].offset == 0


@pytest.mark.parametrize("tp,engine_tp", [(2, 4), (4, 2), (2, 1), (1, 4), (4, 1)])
def test_every_engine_rank_gets_exactly_its_part(tp, engine_tp):
    senders, plan = routes(tp, engine_tp)
    layout_ = EngineLayout(engine_tp, DIMS)
    for e in range(engine_tp):
        got = engine_pieces(plan, e)
        assert set(got) == set(SHAPES)
        for name, dests in got.items():
            assert tiling_problems(name, dests, layout_.part(name, SHAPES[name], e), SHAPES[name]) == []
    # Every byte a sender sends is one of its own (a cut of a tensor it holds), and no pair sends twice.
    assert len({(r.sender, r.engine_rank) for r in plan}) == len(plan)
    for r in plan:
        for p in r.pieces:
            held = senders[r.sender][p.source]
            assert held.name == p.name
            if p.cut is not None:
                dim, start, length = p.cut
                assert 0 <= start and start + length <= held.shape[dim]


def test_tp2_to_tp4_each_engine_rank_hears_one_sender_for_split_tensors():
    _, plan = routes(2, 4)
    for e in range(4):
        senders_of_q = [r.sender for r in plan if r.engine_rank == e and any(p.name == "q.weight" for p in r.pieces)]
        assert senders_of_q == [e // 2]
    # The norm, on both trainer ranks: engine ranks 0 and 2 take it from rank 0, 1 and 3 from rank 1.
    norm_from = {r.engine_rank: r.sender for r in plan for p in r.pieces if p.name == "norm.weight"}
    assert norm_from == {0: 0, 1: 1, 2: 0, 3: 1}


def test_experts_over_ep_ranks_into_one_engine_rank():
    """EP 2 -> one engine rank: each EP rank sends its own experts; the dense tensor, on both, comes from one."""
    def bucket(ep):
        names = [f"experts.{ep * 2 + x}.w" for x in range(2)] + ["dense.w"]
        return [TensorMeta(n, F32, (4, 4), 256 * k) for k, n in enumerate(names)]

    senders = [bucket(0), bucket(1)]
    plan = plan_bucket(senders, EngineLayout(1, {}))
    pairs = by_pair(plan)
    assert pairs[(0, 0)].whole_bucket
    assert [m.name for m in pairs[(1, 0)].metas] == ["experts.2.w", "experts.3.w"]


def test_unplannable_buckets_name_every_problem():
    senders = [trainer_bucket(2, 0)]  # rank 1's shards never arrive
    with pytest.raises(ConversionError) as err:
        plan_bucket(senders, EngineLayout(1, DIMS))
    text = str(err.value)
    assert "q.weight: dim 0 [4, 8) missing" in text and "o.weight: dim 1 [4, 8) missing" in text
    crossed = [TensorMeta("q.weight", F32, (8, 2), 0, Shard(1, 0, 2, 4))]
    with pytest.raises(ConversionError, match="q.weight: the trainer splits dim 1, the engine dim 0"):
        plan_bucket([crossed], EngineLayout(2, DIMS))


def test_tiling_names_what_is_missing_overlapping_or_outside():
    want = Shard(0, 4, 4, 8)
    assert tiling_problems("q", [Shard(0, 4, 2, 8), Shard(0, 6, 2, 8)], want, (8, 4)) == []
    assert tiling_problems("q", [Shard(0, 4, 2, 8)], want, (8, 4)) == ["q: dim 0 [6, 8) missing"]
    assert tiling_problems("q", [Shard(0, 4, 3, 8), Shard(0, 6, 2, 8)], want, (8, 4)) == [
        "q: dim 0 [6, 7) given twice"]
    assert tiling_problems("q", [Shard(0, 2, 4, 8), Shard(0, 6, 2, 8)], want, (8, 4)) == [
        "q: the pieces give dim 0 [2, 6), outside [4, 8)", "q: dim 0 [2, 4) given twice"]
    assert tiling_problems("q", [Shard(1, 0, 4, 4)], want, (8, 4)) == [
        "q: the pieces split dims [1], the part wanted is on dim 0"]
    assert tiling_problems("n", [None, None], None, (4,)) == ["n: the pieces give the whole tensor more than once"]
    assert tiling_problems("n", [None], None, (4,)) == []
    assert tiling_problems("n", [Shard(0, 0, 2, 4), Shard(0, 2, 2, 4)], None, (4,)) == []


MOE, DEEPSEEK = model_spec(preset_config("tiny-qwen3-moe")), model_spec(preset_config("tiny-deepseek-v3"))


class Declared(ReferenceEngine):
    """An adapter whose engine declares ``info`` without being asked over HTTP (the choice is pure)."""

    def __init__(self, info: EngineInfo, url: str = "http://e"):
        super().__init__(url)
        self._info = info


def _params(rank: int, size: int) -> dict:
    """An engine rank's table as the reference engine keeps it: q split by rows, o by columns, the norm whole."""
    return {"q.weight": (torch.zeros(8 // size, 4), 0), "o.weight": (torch.zeros(4, 8 // size), 1),
            "norm.weight": (torch.zeros(4), None)}


def test_engine_puts_the_pieces_of_its_part_together():
    """TP 2 -> TP 1, through the plan: the engine rank's tensors are the trainer's, put together bit for bit."""

    whole = {n: torch.arange(_numel(s), dtype=F32).reshape(s) for n, s in SHAPES.items()}
    senders = [trainer_bucket(2, r) for r in range(2)]
    buffers = []
    for metas in senders:
        buf = torch.zeros(max(m.offset + m.nbytes for m in metas), dtype=torch.uint8)
        for m in metas:
            part = whole[m.name] if m.shard is None else whole[m.name].narrow(m.shard.dim, m.shard.start,
                                                                              m.shard.length)
            view_tensor(buf, m).copy_(part)
        buffers.append(buf)

    for e, size in ((0, 1), (1, 2)):
        plan = plan_bucket(senders, EngineLayout(size, DIMS))
        pieces = []
        for r in plan:
            if r.engine_rank != e:
                continue
            bucket = Bucket(0, buffers[r.sender], tuple(senders[r.sender]))
            sent = bucket.buffer if r.whole_bucket else _packed(bucket, r)
            pieces += [(m, view_tensor(sent, m)) for m in r.metas]
        weights, problems = assemble(pieces, _params(e, size), e, size)
        assert problems == []
        for name, tensor, part in weights:
            want = whole[name] if part is None else whole[name].narrow(part.dim, part.start, part.length)
            assert torch.equal(tensor, want), name


def test_engine_refuses_a_bucket_whose_pieces_do_not_tile_its_part():

    def piece(name, shape, shard):
        return TensorMeta(name, F32, shape, 0, shard), torch.zeros(shape)

    got = [piece("q.weight", (3, 4), Shard(0, 0, 3, 8)), piece("q.weight", (4, 4), Shard(0, 2, 4, 8)),
           piece("o.weight", (4, 4), Shard(1, 0, 4, 8)), piece("norm.weight", (4,), None),
           piece("norm.weight", (4,), None), piece("extra.weight", (4,), None),
           piece("o.weight", (4, 3), Shard(1, 4, 4, 8))]
    weights, problems = assemble(got, _params(0, 1), 0, 1)
    assert weights == []  # nothing of the bucket is loaded; every problem is named
    assert problems == [
        "q.weight: dim 0 [2, 3) given twice", "q.weight: dim 0 [6, 8) missing",
        "o.weight: a piece of shape (4, 3) placed at Shard(dim=1, start=4, length=4, full=8) in (4, 8)",
        "norm.weight: the senders give the whole tensor more than once",
        "extra.weight: the model has no such tensor",
    ]


def test_senders_are_one_rank_per_coordinate_of_the_first_stage():

    # (pp, dp, tp, etp, ep) per rank: TP 2 x PP 2 (ranks 2, 3 the second stage), then TP 1 x EP 2 x DP 2.
    assert pick_senders([(0, 0, 0, 0, 0), (0, 0, 1, 1, 0), (1, 0, 0, 0, 0), (1, 0, 1, 1, 0)]) == (0, 1)
    assert pick_senders([(0, 0, 0, 0, 0), (0, 1, 0, 0, 1), (0, 2, 0, 0, 0), (0, 3, 0, 0, 1)]) == (0, 1)


def test_auto_reshards_into_an_engine_that_declares_its_layout_and_says_why_not_otherwise():

    spec = MOE
    ep2 = Topology(tp_size=2, ep_size=2, etp_size=1)

    def choose(caps, engine_tp):
        engine = Declared(EngineInfo("x", tp_size=engine_tp, capabilities=frozenset(caps)))
        return choose_transport("auto", [engine], ep2, spec, colocated=False)

    kind, reason = choose({BROADCAST, IPC, P2P, RESHARD}, 1)  # (bf16 or block FP8 alike)
    assert kind == "p2p" and reason.startswith("engine TP 1, trainer TP 2 EP 2: ") and "resharded P2P" in reason
    kind, reason = choose({BROADCAST, IPC, P2P}, 1)
    assert kind == "broadcast" and "(the x engine does not declare its layout: no resharding)" in reason


def test_deepseek_v3_at_tp2_goes_by_p2p_resharded_or_per_rank():
    """Megatron's local spec splits MLA's down projections over TP, engines hold them whole: a per-rank stream yields
    them whole (gathered). An engine that declares its layout gets them resharded; one that does not, by P2P per
    rank, as any family at the trainer's TP."""

    spec = DEEPSEEK
    engine = Declared(EngineInfo("x", tp_size=2, capabilities=frozenset({BROADCAST, P2P, RESHARD})))
    kind, reason = choose_transport("auto", [engine], Topology(tp_size=2, etp_size=2), spec, colocated=False)
    assert kind == "p2p" and "resharded P2P" in reason
    undeclared = Declared(EngineInfo("x", tp_size=2, capabilities=frozenset({BROADCAST, P2P})))
    kind, reason = choose_transport("auto", [undeclared], Topology(tp_size=2, etp_size=2), spec, colocated=False)
    assert kind == "p2p" and "resharded" not in reason, reason
    engine1 = Declared(EngineInfo("x", tp_size=1, capabilities=frozenset({BROADCAST, P2P})))
    assert choose_transport("auto", [engine1], Topology(tp_size=1), spec, colocated=False)[0] == "p2p"


def test_several_engines_take_p2p_at_the_trainers_tp_each_from_its_own_replica():
    """Several engines at the trainer's TP: P2P, engine j sent by data-parallel replica j % dp (every engine served
    once, the replicas sharing them); one of another TP, or MoE engines with expert parallelism (whole experts, where
    per-rank buckets carry TP shards of them), are sent by broadcast, saying why (resharding serves one engine)."""
    spec = model_spec(preset_config("tiny-qwen3"))
    caps = frozenset({BROADCAST, IPC, P2P, RESHARD})
    tp2 = Topology(tp_size=2, dp_size=2)

    def engines(*tps):
        return [Declared(EngineInfo("x", tp_size=t, capabilities=caps), f"http://e{j}") for j, t in enumerate(tps)]

    kind, reason = choose_transport("auto", engines(2, 2, 2), tp2, spec, colocated=False)
    assert kind == "p2p" and reason.startswith("3 engines at the trainer's TP 2, PP 1: ") and "mod 2" in reason
    kind, reason = choose_transport("auto", engines(2, 1), tp2, spec, colocated=False)
    assert kind == "broadcast" and "engine http://e1 TP 1 != trainer TP 2 (resharding serves one engine; 2 given)" \
        in reason
    moe = [Declared(EngineInfo("x", tp_size=2, ep_size=2, capabilities=caps), f"http://m{j}") for j in range(2)]
    kind, reason = choose_transport("auto", moe, Topology(tp_size=2, dp_size=2, etp_size=2), MOE, colocated=False)
    assert kind == "broadcast" and ("engine http://m1 EP 2 holds whole experts, which per-rank buckets carry as TP "
                                    "shards (resharding serves one engine; 2 given)") in reason
    for n, dp in ((1, 1), (3, 1), (2, 2), (5, 2), (2, 4)):
        served = [served_by(n, dp, d) for d in range(dp)]
        assert sorted(j for js in served for j in js) == list(range(n))
        assert max(map(len, served)) - min(map(len, served)) <= 1
    assert served_by(5, 2, 0) == [0, 2, 4] and served_by(5, 2, 1) == [1, 3] and served_by(2, 4, 3) == []


# Four routed experts, as HF names them: gate and up (6, 4), down (4, 6); an engine at EP 2 holds experts 0 and 1 on
# rank 0, 2 and 3 on rank 1, each whole (attention still split as DIMS says).
EXPERT_SHAPES = {f"e{x}.{p}.weight": ((4, 6) if p == "down" else (6, 4))
                 for x in range(4) for p in ("gate", "up", "down")}
EXPERT_DIMS = {n: (1 if ".down." in n else 0) for n in EXPERT_SHAPES}  # Megatron's split at expert-TP > 1
OWNERS = {n: int(n[1]) // 2 for n in EXPERT_SHAPES}
EP_ENGINE = EngineLayout(2, DIMS, OWNERS)


def _metas(held: list[tuple[str, tuple[int, ...], Shard | None]]) -> list[TensorMeta]:
    offsets, _ = layout([[4 * _numel(s)] for _, s, _ in held])
    return [TensorMeta(n, F32, s, off, shard) for (n, s, shard), (off,) in zip(held, offsets, strict=True)]


def moe_bucket(tp: int, ep: int, rank: int) -> list[TensorMeta]:
    """The bucket trainer rank ``rank`` (TP ``tp`` x EP ``ep``, one of them 1) yields per rank: its shards of q and o
    and the norm whole (as :func:`trainer_bucket`), and its experts (EP: its own, whole; TP: a slice of each)."""
    tp_rank, ep_rank = rank % tp, rank // tp
    held = [(m.name, m.shape, m.shard) for m in trainer_bucket(tp, tp_rank)]
    mine = range(ep_rank * 4 // ep, (ep_rank + 1) * 4 // ep)
    for name, shape in EXPERT_SHAPES.items():
        if int(name[1]) not in mine:
            continue
        held.append(_held(name, shape, EXPERT_DIMS[name], tp, tp_rank))
    return _metas(held)


def _part_bytes(name: str, rank: int) -> int:
    """What engine rank ``rank`` of :data:`EP_ENGINE` holds of ``name``, in bytes (0: none of it)."""
    shape = {**SHAPES, **EXPERT_SHAPES}[name]
    if rank not in EP_ENGINE.ranks(name):
        return 0
    part = EP_ENGINE.part(name, shape, rank)
    return 4 * (_numel(shape) if part is None else _numel(shape) // part.full * part.length)


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 1)])
def test_every_expert_goes_to_its_owner_alone(tp, ep):
    """Trainer EP 2 (each rank its experts whole) and TP 2 (each rank a slice of every expert) into an engine at TP 2
    with EP 2: every piece of an expert goes to the engine rank that owns it, none to another; and the bytes each
    engine rank receives are exactly those of what it holds (its half of q and o, the norm, its experts whole)."""
    senders = [moe_bucket(tp, ep, r) for r in range(tp * ep)]
    plan = plan_bucket(senders, EP_ENGINE)
    got: dict[int, int] = {0: 0, 1: 0}
    for route in plan:
        for meta in route.metas:
            assert meta.name not in OWNERS or OWNERS[meta.name] == route.engine_rank, (meta.name, route.engine_rank)
            got[route.engine_rank] += meta.nbytes
    names = list(SHAPES) + list(EXPERT_SHAPES)
    assert got == {e: sum(_part_bytes(n, e) for n in names) for e in (0, 1)}
    assert sum(_part_bytes(n, 0) for n in EXPERT_SHAPES) == sum(_part_bytes(n, 1) for n in EXPERT_SHAPES) == 6 * 96
    for e in (0, 1):  # each engine rank's pieces tile exactly what it holds
        pieces = [(m, torch.zeros(m.shape)) for r in plan if r.engine_rank == e for m in r.metas]
        held = {**_params(e, 2), **{n: (torch.zeros(s), None) for n, s in EXPERT_SHAPES.items() if OWNERS[n] == e}}
        theirs = {n: r for n, r in OWNERS.items() if r != e}
        weights, problems = assemble(pieces, held, e, 2, elsewhere=theirs)
        assert problems == [] and {n for n, _, _ in weights} == set(held)


def test_an_expert_sent_to_a_rank_that_does_not_own_it_is_refused():
    """The engine rank names the owner of an expert a piece of which reaches it; an unknown name stays unknown."""
    held = {**_params(0, 2), **{n: (torch.zeros(s), None) for n, s in EXPERT_SHAPES.items() if OWNERS[n] == 0}}
    theirs = {n: r for n, r in OWNERS.items() if r != 0}
    pieces = [(TensorMeta("e2.up.weight", F32, (6, 4), 0), torch.zeros(6, 4)),
              (TensorMeta("e9.up.weight", F32, (6, 4), 0), torch.zeros(6, 4))]
    weights, problems = assemble(pieces, held, 0, 2, elsewhere=theirs)
    assert weights == [] and problems == ["e2.up.weight: held by engine rank 1 alone, not by this rank (0)",
                                          "e9.up.weight: the model has no such tensor"]


def test_an_engine_layout_that_cannot_be_is_refused():
    with pytest.raises(ValueError) as err:
        EngineLayout(2, {"q.weight": 0}, {"q.weight": 1, "e0.up.weight": 2})
    assert str(err.value) == ("an engine layout of 2 ranks that cannot be: e0.up.weight: owned by engine rank 2, "
                              "outside 0..1; q.weight: split on dim 0 and owned by engine rank 1 alone")
    assert EP_ENGINE.ranks("e3.down.weight") == range(1, 2) and EP_ENGINE.ranks("q.weight") == range(2)
    with pytest.raises(ValueError, match="e3.down.weight: held by engine rank 1 alone, not by rank 0"):
        EP_ENGINE.part("e3.down.weight", (4, 6), 0)
