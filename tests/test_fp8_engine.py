"""The reference engine serving a block-FP8 model: started on a block-FP8 checkpoint it holds ``fp8 × scale``
(the same logits, bit for bit, as an engine started on those dequantized weights) and reports its
quantization_config; real Megatron-Core trainers (gloo jobs) update it in block FP8 over broadcast, P2P and
IPC, to exactly the weights of the FP8 checkpoint they write; what does not fit its layout is refused, whole,
and it serves its old weights."""

from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import torch

from tests.helpers.checks import INPUT_IDS
from weightstream.common.hf_files import CheckpointReader
from weightstream.converters.fp8 import FP8, SCALE_SUFFIX, BlockFP8, dequantize_block_fp8
from weightstream.engines import EngineError, ReferenceEngine
from weightstream.models.presets import preset_config, random_hf_model
from weightstream.reference_engine.server import serve, stop
from weightstream.sinks.safetensors import save_hf_checkpoint
from weightstream.streaming.bucket import Bucket

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
    model.load_state_dict(weights, strict=False)  # a tied lm_head is the embedding's
    save_hf_checkpoint(model, cfg, where / "dequantized")
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
    eng.begin_update("refused")
    with pytest.raises(EngineError, match=message):
        eng.receive_ipc(0, [eng.encode_ipc(Bucket.pack(named))], None)
    eng.abort_update()
    assert torch.equal(eng.logits(INPUT_IDS), before)
    assert eng.weight_version() == "default"


def test_what_does_not_fit_the_layout_is_refused(dense_dirs):
    norm = ("model.layers.0.input_layernorm.weight", torch.full((64,), 3.0))
    with CheckpointReader(dense_dirs["fp8"]) as reader:
        rows, cols = reader.shape(Q_PROJ)
    weight = torch.randn(rows, cols) * 0.02
    values, scales = SMALL.quantize(weight)
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
