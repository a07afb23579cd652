"""The reference engine serving a block-FP8 model: started on a block-FP8 checkpoint it holds the float8 values
and their scales, as engines do, and computes with ``fp8 × scale`` (the same logits, bit for bit, as an engine
started on those dequantized weights) and reports its
quantization_config; real Megatron-Core trainers (gloo jobs) update it in block FP8 over broadcast, P2P and
IPC, to exactly the weights of the FP8 checkpoint they write; what does not fit its layout is refused, whole,
and it serves its old weights."""

from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers.checks import INPUT_IDS, assert_experts_held_by_owners, expert_checksums
from tests.helpers.fp8_workers import run_fp8_delta_updates, run_fp8_updates
from tests.helpers.workers import Case
from weightstream.common.hf_files import CheckpointReader
from weightstream.converters.fp8 import dequantize_block_fp8, quantize_weight
from weightstream.engines import EngineError, ReferenceEngine
from weightstream.jobs import Layout
from weightstream.launch import launch
from weightstream.models.presets import preset_config, random_hf_model, save_random_checkpoint
from weightstream.reference_engine.server import serve, stop
from weightstream.sinks.safetensors import save_hf_checkpoint
from weightstream.streaming.bucket import Bucket
from weightstream.wire.fp8 import FP8, SCALE_SUFFIX, BlockFP8

SMALL = BlockFP8(block=(16, 16))  # divides every dimension of the tiny presets (and their TP-2 shards)
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def _fp8_checkpoint(preset: str, where: Path, seed: int) -> dict[str, str]:
    """A random model's block-FP8 checkpoint (``fp8``) and an unquantized float32 one holding exactly its
    dequantized weights (``dequantized``)."""
    cfg = preset_config(preset)
    model = random_hf_model(cfg, seed=seed, dtype=torch.float32)
    save_hf_checkpoint(model, cfg, where / "fp8", quantize=SMALL)
    with CheckpointReader(where / "fp8") as reader:
        held = {n: reader.get(n) for n in reader.keys()}
    weights = {n: dequantize_block_fp8(t, held[n + SCALE_SUFFIX], SMALL.block, dtype=torch.float32)
               if t.dtype == FP8 else t for n, t in held.items() if not n.endswith(SCALE_SUFFIX)}
    # Written under the checkpoint's names (transformers holds MoE experts fused, under other names).
    (where / "dequantized").mkdir()
    cfg.save_pretrained(where / "dequantized")
    save_file({n: t.contiguous() for n, t in weights.items()}, str(where / "dequantized" / "model.safetensors"))
    return {"fp8": str(where / "fp8"), "dequantized": str(where / "dequantized")}


@pytest.fixture(scope="module")
def dense_dirs(tmp_path_factory) -> dict[str, str]:
    return _fp8_checkpoint("tiny-qwen3", tmp_path_factory.mktemp("fp8engine"), seed=123)


@contextmanager
def engines(*specs: tuple[str, int]):
    """Reference engines serving (model directory, TP) each, stopped on the way out."""
    with ExitStack() as stack:
        servers = []
        for model_dir, tp in specs:
            server = serve(str(model_dir), tp)
            stack.callback(stop, server)
            servers.append(server)
        yield servers


def _logits(server) -> torch.Tensor:
    return ReferenceEngine(server.url).logits(INPUT_IDS)


def test_engine_loads_a_block_fp8_checkpoint_dequantized(dense_dirs):
    written = json.loads((Path(dense_dirs["fp8"]) / "config.json").read_text())["quantization_config"]
    with engines((dense_dirs["fp8"], 1), (dense_dirs["dequantized"], 1),
                 (dense_dirs["fp8"], 2), (dense_dirs["dequantized"], 2)) as (fp8_1, plain_1, fp8_2, plain_2):
        for fp8, plain in ((fp8_1, plain_1), (fp8_2, plain_2)):
            assert torch.equal(_logits(fp8), _logits(plain))  # bit for bit, both float32
            info = ReferenceEngine(fp8.url).server_info()
            assert info["quantization_config"] == written
            assert ReferenceEngine(fp8.url).info().fp8 == SMALL
            assert ReferenceEngine(plain.url).server_info()["quantization_config"] is None
            assert ReferenceEngine(plain.url).info().fp8 is None


def _refused(server, named: list[tuple[str, torch.Tensor]], message: str) -> None:
    """One IPC bucket of ``named`` in a session of its own: refused with ``message``, the session aborted, and
    the engine serving what it served before."""
    eng = ReferenceEngine(server.url)
    before = eng.logits(INPUT_IDS)
    bucket = Bucket.pack(named)  # kept mapped until the engine has answered, as a sender does
    eng.begin_update("refused")
    with pytest.raises(EngineError, match=message):
        eng.receive_ipc(0, [eng.encode_ipc(bucket)], None)
    eng.abort_update()
    assert torch.equal(eng.logits(INPUT_IDS), before)
    assert eng.weight_version() == "default"


def test_what_does_not_fit_the_layout_is_refused(dense_dirs):
    norm = ("model.layers.0.input_layernorm.weight", torch.full((64,), 3.0))
    with CheckpointReader(dense_dirs["fp8"]) as reader:
        rows, cols = reader.shape(Q_PROJ)
    weight = torch.randn(rows, cols) * 0.02
    values, scales = quantize_weight(SMALL, weight)
    scale = (Q_PROJ + SCALE_SUFFIX, scales)
    with engines((dense_dirs["fp8"], 1), (dense_dirs["dequantized"], 1)) as (fp8, plain):
        _refused(fp8, [norm, (Q_PROJ, values)], f"{Q_PROJ}: float8 without its scale {Q_PROJ + SCALE_SUFFIX} "
                                                 "in the same bucket")
        _refused(fp8, [norm, scale], f"{Q_PROJ + SCALE_SUFFIX}: a scale without its float8 weight {Q_PROJ}")
        _refused(fp8, [norm, (Q_PROJ, weight)], f"{Q_PROJ}: arrived as torch.float32, but this engine holds it "
                                                "in block FP8")
        _refused(fp8, [norm, (Q_PROJ, values), (scale[0], scales[:-1])],
                 rf"{Q_PROJ}: its scale is torch.float32 of shape \({scales.shape[0] - 1}, {scales.shape[1]}\)")
        _refused(plain, [norm, (Q_PROJ, values), scale], "block-FP8 tensors for a model this engine holds "
                                                         "unquantized")


def _updated(results: list[list[dict]]) -> list[dict]:
    for rank in results:
        for entry in rank:
            assert "error" not in entry, entry["error"]
    return results[0]


def test_trainers_update_fp8_engines_over_every_transport(sources, dense_dirs, tmp_path):
    """Megatron-Core at TP 2 into FP8 engines over P2P (engine TP 2), IPC (engine TP 2) and broadcast (engine
    TP 1, metadata ahead); at TP 1 over IPC (one copy: the stream quantizes straight into the engine's own float8
    values and scales) and IPC with kept buffers prepared ahead. Each engine's logits then equal, bit for bit,
    those of an engine of its TP started on the FP8 checkpoint the trainer writes."""
    src, start = sources["tiny-qwen3"], dense_dirs["fp8"]
    with engines((start, 2), (start, 2), (start, 1)) as (p2p, ipc, bcast):
        before = _logits(bcast)
        tp2 = _updated(launch(2, run_fp8_updates, Case(src, Layout(2, 1), quantize=SMALL),
                              [(p2p.url, {"transport": "p2p"}), (ipc.url, {"transport": "ipc"}),
                               (bcast.url, {"transport": "broadcast"})], str(tmp_path / "tp2")))
    with engines((start, 1), (start, 1)) as (ipc1, kept):
        tp1 = _updated(launch(1, run_fp8_updates, Case(src, Layout(1, 1), quantize=SMALL),
                              [(ipc1.url, {"transport": "ipc"}),
                               (kept.url, {"transport": "ipc", "direct": False, "prepare": True})],
                              str(tmp_path / "tp1")))
    reports = [e["report"] for e in tp2 + tp1]
    assert [r.transport for r in reports] == ["p2p", "ipc", "broadcast", "ipc", "ipc"]
    assert reports[0].mode == "per_rank" and reports[2].metadata_ahead and reports[3].direct and not reports[4].direct
    with engines((tmp_path / "tp2", 2), (tmp_path / "tp2", 1), (tmp_path / "tp1", 1)) as (ref2, ref21, ref1):
        want2, want21, want1 = _logits(ref2), _logits(ref21), _logits(ref1)
    assert torch.equal(tp2[0]["logits"], want2) and torch.equal(tp2[1]["logits"], want2)
    assert torch.equal(tp2[2]["logits"], want21)
    assert torch.equal(tp1[0]["logits"], want1) and torch.equal(tp1[1]["logits"], want1)
    assert (want1 - before).abs().max() > 1e-2  # the update changed what the engines serve
    assert all(r.tensors > 40 for r in reports), [r.tensors for r in reports]


def test_moe_trainer_updates_an_fp8_engine(tmp_path):
    """tiny-qwen3-moe: every expert's projections in FP8, broadcast into an FP8 engine at TP 2 (each expert
    split over its ranks)."""
    src = save_random_checkpoint(preset_config("tiny-qwen3-moe"), tmp_path / "src", seed=41)
    start = _fp8_checkpoint("tiny-qwen3-moe", tmp_path / "start", seed=42)["fp8"]
    with engines((start, 2)) as (server,):
        before = _logits(server)
        (entry,) = _updated(launch(1, run_fp8_updates, Case(src, Layout(1, 1), quantize=SMALL),
                                   [(server.url, {"transport": "broadcast"})], str(tmp_path / "saved")))
    with engines((tmp_path / "saved", 2)) as (ref,):
        assert torch.equal(entry["logits"], _logits(ref))
    assert (entry["logits"] - before).abs().max() > 1e-2 and entry["report"].tensors > 100


@pytest.mark.parametrize("preset,layout,engine_tp", [("tiny-qwen3", Layout(2, 1), 1), ("tiny-qwen3", Layout(1, 1), 2),
                                                     ("tiny-qwen3-moe", Layout(1, 1, ep=2), 2)])
def test_block_fp8_resharded_p2p_into_an_engine_of_another_layout(preset, layout, engine_tp, tmp_path):
    """Block FP8 by resharded P2P (``auto``): each trainer rank's float8 values and scales, quantized in its own
    blocks, which are the whole tensor's, sent to the engine ranks that hold them; trainer TP 2 into TP 1, TP 1 into
    TP 2, and a MoE trainer of EP 2 into TP 2 (each expert split over the engine's ranks). The engine's logits then
    equal, bit for bit, those of an engine of its TP started on the FP8 checkpoint the trainer writes."""
    src = save_random_checkpoint(preset_config(preset), tmp_path / "src", seed=51)
    start = _fp8_checkpoint(preset, tmp_path / "start", seed=52)["fp8"]
    with engines((start, engine_tp)) as (server,):
        before = _logits(server)
        (entry,) = _updated(launch(layout.tp * layout.ep, run_fp8_updates, Case(src, layout, quantize=SMALL),
                                   [(server.url, {"transport": "auto"})], str(tmp_path / "saved")))
    report = entry["report"]
    assert report.transport == "p2p" and "resharded P2P" in report.reason and report.gathers == 0
    with engines((tmp_path / "saved", engine_tp)) as (ref,):
        assert torch.equal(entry["logits"], _logits(ref))
    assert (entry["logits"] - before).abs().max() > 1e-2


def test_block_fp8_deltas_by_resharded_p2p(sources, dense_dirs, tmp_path):
    """Block-FP8 delta updates on Adam steps, a trainer at TP 2 into an FP8 engine at TP 1 (resharded P2P): the
    first update full, the next two deltas of the float8 values and scales, each checked (the engine's checksums of
    what it applied equal the trainer's); the engine then serves, bit for bit, what an engine started on the
    trainer's FP8 checkpoint does."""
    with engines((dense_dirs["fp8"], 1)) as (server,):
        (result, _) = launch(2, run_fp8_delta_updates, Case(sources["tiny-qwen3"], Layout(2, 1), quantize=SMALL),
                             server.url, 3, str(tmp_path / "saved"))
    reports = result["reports"]
    assert all(r.transport == "p2p" and "resharded P2P" in r.reason for r in reports)
    deltas = [r.delta for r in reports]
    assert [d.full for d in deltas] == [True, False, False] and all(d.checked and d.mismatch is None for d in deltas)
    assert all(0 < d.changed < d.words and d.wire_bytes < d.snapshot_bytes for d in deltas[1:])
    with engines((tmp_path / "saved", 1)) as (ref,):
        assert torch.equal(result["logits"], _logits(ref))


def test_block_fp8_off_the_engines_block_grid_is_refused_before_any_bytes(dense_dirs, sources, tmp_path):
    """Blocks of 32 × 32 where an engine at TP 2 holds 48 rows of each MLP projection (96 over 2 ranks): its ranks
    hold those dequantized, which resharded pieces cannot give them. Resharded P2P fails before any bytes move,
    naming every such weight and the way out (broadcast), and the engine serves what it had; a broadcast of the
    same update then serves what the engine started on the trainer's checkpoint does."""
    big = BlockFP8(block=(32, 32))
    cfg = preset_config("tiny-qwen3")
    save_hf_checkpoint(random_hf_model(cfg, seed=61, dtype=torch.float32), cfg, tmp_path / "start", quantize=big)
    case = Case(sources["tiny-qwen3"], Layout(1, 1), quantize=big)
    with engines((tmp_path / "start", 2)) as (server,):
        before = _logits(server)
        ((refused,),) = launch(1, run_fp8_updates, case, [(server.url, {"transport": "p2p"})], str(tmp_path / "a"))
        assert torch.equal(_logits(server), before) and ReferenceEngine(server.url).weight_version() == "default"
        ((sent,),) = launch(1, run_fp8_updates, case, [(server.url, {"transport": "broadcast"})],
                            str(tmp_path / "saved"))
    assert "block FP8 cannot be resharded into this engine's layout" in refused["error"]
    for layer in range(cfg.num_hidden_layers):
        for proj, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
            assert (f"model.layers.{layer}.mlp.{proj}.weight: 96 along dim {dim} over 2 engine ranks is not in whole "
                    "blocks of 32") in refused["error"]
    assert "q_proj" not in refused["error"] and "transport='broadcast'" in refused["error"]
    assert "error" not in sent and sent["report"].transport == "broadcast"
    with engines((tmp_path / "saved", 2)) as (ref,):
        assert torch.equal(sent["logits"], _logits(ref))
    assert (sent["logits"] - before).abs().max() > 1e-2


def test_an_fp8_engine_started_without_weights_knows_its_fp8_weights_from_the_family(dense_dirs, tmp_path):
    """Only config.json on disk: which weights the model holds in FP8 comes from the family's declaration
    (Converter.fp8), so an unquantized norm is taken and an unquantized projection refused."""
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(Path(dense_dirs["fp8"]) / "config.json", bare / "config.json")
    norm = ("model.layers.0.input_layernorm.weight", torch.full((64,), 3.0))
    with CheckpointReader(dense_dirs["fp8"]) as reader:
        rows, cols = reader.shape(Q_PROJ)
    weight = torch.randn(rows, cols) * 0.02
    values, scales = quantize_weight(SMALL, weight)
    with engines((bare, 1)) as (server,):
        eng = ReferenceEngine(server.url)
        assert eng.info().fp8 == SMALL
        quantized = Bucket.pack([norm, (Q_PROJ, values), (Q_PROJ + SCALE_SUFFIX, scales)])
        unquantized = Bucket.pack([norm, (Q_PROJ, weight)])  # both kept mapped until the engine has answered
        eng.begin_update("bare")
        eng.receive_ipc(0, [eng.encode_ipc(quantized)], None)
        with pytest.raises(EngineError, match=f"{Q_PROJ}: arrived as torch.float32, but this engine holds it in "
                                              "block FP8"):
            eng.receive_ipc(1, [eng.encode_ipc(unquantized)], None)
        eng.abort_update()


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_the_engine_holds_float8_values_and_scales_as_loaded(preset, tmp_path):
    """In the engine's model (engine TP 1 and each rank of TP 2): every FP8 weight is held in float8 (projections as
    Float8Linear, transformers' fused experts with Float8Experts), its values and scales the checkpoint's own bytes
    (this rank's blocks), loaded as they are; and the model computes what an engine started on the dequantized
    weights computes."""
    from transformers import AutoConfig

    from weightstream.reference_engine.model import Float8Linear, ShardedCausalLM

    dirs = _fp8_checkpoint(preset, tmp_path, seed=5)
    config = AutoConfig.from_pretrained(dirs["fp8"])
    with CheckpointReader(dirs["fp8"]) as reader:
        held = {n: reader.get(n) for n in reader.keys()}
    with CheckpointReader(dirs["dequantized"]) as reader:
        plain_weights = {n: reader.get(n) for n in reader.keys()}
    plain = ShardedCausalLM(config, 0, 1, None, torch.device("cpu"))
    assert not plain.load_weights((n, t, None) for n, t in plain_weights.items()).problems
    for size in (1, 2):
        for rank in range(size):
            model = ShardedCausalLM(config, rank, size, None, torch.device("cpu"))
            model.quantized(SMALL, held)
            report = model.load_weights((n, t, None) for n, t in held.items())
            assert not report.problems and set(report.loaded) == set(held)
            stored = [n for n in held if n.endswith(SCALE_SUFFIX)]
            assert model.stored_fp8 == {n[: -len(SCALE_SUFFIX)] for n in stored}
            for scale in stored:
                name = scale[: -len(SCALE_SUFFIX)]
                values, scales = model.params[name], model.params[scale]
                dim = values[1]
                want_values, want_scales = held[name], held[scale]
                if dim is not None and size > 1:
                    want_values = want_values.chunk(size, dim)[rank]
                    want_scales = want_scales.chunk(size, dim)[rank]
                assert values[0].dtype == FP8
                assert torch.equal(values[0].view(torch.uint8), want_values.view(torch.uint8)), name
                assert torch.equal(scales[0], want_scales), scale
            projections = 28 if preset == "tiny-qwen3" else 16  # 4 layers of q, k, v, o (and gate, up, down)
            assert sum(isinstance(m, Float8Linear) for m in model.model.modules()) == projections
            if size == 1:
                ids = torch.tensor(INPUT_IDS)
                assert torch.equal(model.logits(ids), plain.logits(ids))


def test_block_fp8_experts_into_an_engine_with_expert_parallelism(tmp_path):
    """Block FP8 into an FP8 engine at TP 2 with EP 2, whose ranks hold their experts whole (always on the block
    grid): a MoE trainer at EP 2 by resharded P2P (each expert's float8 values and scales to its owner alone) and by
    broadcast (each rank takes its own experts). Each engine rank then holds its experts' float8 values and scales,
    bit for bit those of the FP8 checkpoint the trainer writes, and none of the others'; and serves what an EP
    engine started on that checkpoint serves."""
    src = save_random_checkpoint(preset_config("tiny-qwen3-moe"), tmp_path / "src", seed=51)
    start = _fp8_checkpoint("tiny-qwen3-moe", tmp_path / "start", seed=52)["fp8"]
    servers = [serve(start, 2, ep=2), serve(start, 2, ep=2)]
    try:
        before = _logits(servers[0])
        steps = [(servers[0].url, {"transport": "auto"}), (servers[1].url, {"transport": "broadcast"})]
        (p2p, bcast), _ = launch(2, run_fp8_updates, Case(src, Layout(1, 1, ep=2), quantize=SMALL), steps,
                                 str(tmp_path / "saved"))
        want = expert_checksums(tmp_path / "saved")
        held = [ReferenceEngine(s.url).weight_checksums(list(want)) for s in servers]
    finally:
        for s in servers:
            stop(s)
    assert p2p.get("error") is None and bcast.get("error") is None, (p2p.get("error"), bcast.get("error"))
    assert p2p["report"].transport == "p2p" and "resharded P2P" in p2p["report"].reason
    assert bcast["report"].transport == "broadcast"
    assert any(n.endswith(SCALE_SUFFIX) for n in want) and any(not n.endswith(SCALE_SUFFIX) for n in want)
    for ranks in held:
        assert_experts_held_by_owners(ranks, want, 2)
    ref = serve(str(tmp_path / "saved"), 2, ep=2)
    try:
        served = _logits(ref)
    finally:
        stop(ref)
    assert torch.equal(p2p["logits"], served) and torch.equal(bcast["logits"], served)
    assert (served - before).abs().max() > 1e-2
