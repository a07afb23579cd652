"""SGLang 0.5.23's block-FP8 weight loaders against weightstream's FP8 buckets (a python with sglang; CPU).

    WEIGHTSTREAM_SGLANG_PYTHON tests/engines/sglang_fp8_check.py   ->  one JSON object on stdout's last line

For each scale format (``float``, ``ue8m0``): one decoder layer of a Qwen3 (hidden 256, 4 heads and 2 KV heads of
128, MLP 512) in HF names, quantized by weightstream (``BlockFP8.quantize``: ``X.weight`` float8_e4m3fn,
``X.weight_scale_inv`` float32 ``[ceil(out/128), ceil(in/128)]``), packed into one dense bucket, announced by
:class:`SGLangEngine` (``receive_broadcast``'s request body) and received by SGLang's own distributed receiver
(``WeightUpdater._receive_bucketed_weights_from_distributed``; the broadcast copies our buffer). The tensors it
hands out are loaded by SGLang's ``Qwen3ForCausalLM.load_weights`` (unbound, on a module that holds just the
layer: its stacked q/k/v and gate/up mapping, its ``maybe_remap_kv_scale_name`` for names with "scale") into
SGLang's ``QKVParallelLinear``, ``MergedColumnParallelLinear`` and ``RowParallelLinear`` built with SGLang's
``Fp8Config`` (``Fp8LinearMethod.create_weights``: a float8 ``ModelWeightParameter`` and a float32
``BlockQuantScaleParameter`` per layer, their ``weight_loader_v2``), once for each engine TP rank of 2 (SGLang's
``get_parallel().override(tp_size=2, tp_rank=r)``: each rank cuts its own shard of the whole tensors). Each
parameter must then hold exactly rank r's slice of our values and of our scales (block rows for column-parallel
layers, block columns for row-parallel ones). Nothing is stood in for but the broadcast;
``process_weights_after_loading`` (AMX or CUDA kernels) and a forward are not run.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace

warnings.filterwarnings("ignore")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # torchvision_standin, common
sys.path.insert(0, str(HERE.parents[1]))  # weightstream from this checkout

import torch  # noqa: E402
import torchvision_standin  # noqa: E402,F401  (before anything imports sglang.srt.managers.io_struct)
from common import FUSED, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, MLP, PREFIX, TP_SIZE, WEIGHTS, same_bits  # noqa: E402

BLOCK = 128


def hf_tensors(fp8) -> list[tuple[str, torch.Tensor]]:
    """A bf16 norm and every projection quantized by weightstream, each weight followed by its scales (the order
    the stream lays out a dense bucket)."""
    from weightstream.converters.fp8 import quantize_weight

    g = torch.Generator().manual_seed(2024)
    out = [(f"{PREFIX}.post_attention_layernorm.weight", torch.randn(HIDDEN, generator=g).to(torch.bfloat16))]
    for name, (shape, _) in WEIGHTS.items():
        q, s = quantize_weight(fp8, torch.randn(shape, generator=g).to(torch.bfloat16) * 0.05)
        out += [(f"{PREFIX}.{name}.weight", q), (f"{PREFIX}.{name}.weight_scale_inv", s)]
    return out


def sglang_layer(quant_config, rank: int) -> torch.nn.Module:
    """The stand-in model: just a decoder layer's linear layers, as SGLang builds them for TP rank ``rank``."""
    from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from sglang.srt.runtime_context import get_parallel

    kw = {"bias": False, "quant_config": quant_config, "params_dtype": torch.bfloat16}
    root = torch.nn.Module()
    layer = torch.nn.Module()
    attn, mlp = torch.nn.Module(), torch.nn.Module()
    with get_parallel().override(tp_size=TP_SIZE, tp_rank=rank):
        attn.qkv_proj = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, prefix=f"{PREFIX}.self_attn.qkv_proj",
                                          **kw)
        attn.o_proj = RowParallelLinear(HEADS * HEAD_DIM, HIDDEN, prefix=f"{PREFIX}.self_attn.o_proj",
                                        reduce_results=False, **kw)
        mlp.gate_up_proj = MergedColumnParallelLinear(HIDDEN, [MLP, MLP], prefix=f"{PREFIX}.mlp.gate_up_proj", **kw)
        mlp.down_proj = RowParallelLinear(MLP, HIDDEN, prefix=f"{PREFIX}.mlp.down_proj", reduce_results=False, **kw)
    layer.self_attn, layer.mlp = attn, mlp
    layer.post_attention_layernorm = torch.nn.Module()
    layer.post_attention_layernorm.weight = torch.nn.Parameter(torch.zeros(HIDDEN, dtype=torch.bfloat16),
                                                               requires_grad=False)
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList([layer])
    root.config = SimpleNamespace(tie_word_embeddings=False)
    root.pp_group = SimpleNamespace(is_last_rank=True)
    return root


def rank_slice(t: torch.Tensor, how: str, rank: int) -> torch.Tensor:
    dim = 0 if how == "rows" else 1
    size = t.shape[dim] // TP_SIZE
    return t.narrow(dim, rank * size, size)


def expected(named: dict, param: str, rank: int, suffix: str) -> torch.Tensor:
    parts = [rank_slice(named[f"{PREFIX}.{w}.{suffix}"], WEIGHTS[w][1], rank) for w in FUSED[param]]
    return torch.cat(parts, dim=0)


def receive(bucket, body: dict) -> list[tuple[str, torch.Tensor]]:
    """SGLang's distributed receiver for the announced bucket, the broadcast copying our buffer."""
    from sglang.srt.model_executor.model_runner_components import weight_updater as wu

    def broadcast(tensor, src=0, group=None, async_op=False):
        if tensor.numel() != bucket.buffer.numel():
            raise RuntimeError(f"SGLang receives {tensor.numel()} bytes, we send {bucket.buffer.numel()}")
        tensor.copy_(bucket.buffer)

    real = torch.distributed.broadcast
    torch.distributed.broadcast = broadcast
    try:
        return wu.WeightUpdater._receive_bucketed_weights_from_distributed(
            SimpleNamespace(device="cpu", _model_update_group={body["group_name"]: object()}),
            names=body["names"], dtypes=body["dtypes"], shapes=body["shapes"], group_name=body["group_name"])
    finally:
        torch.distributed.broadcast = real


def announced(bucket) -> dict:
    """The ``/update_weights_from_distributed`` body :class:`SGLangEngine` sends for ``bucket``."""
    from weightstream.engines.sglang import SGLangEngine

    sent: list = []

    class Recording(SGLangEngine):
        def request(self, method, path, body=None, *, step=None, timeout_s=None):
            sent.append(json.loads(json.dumps(body)))
            return {"success": True}

    Recording("http://sglang.invalid").receive_broadcast(bucket, None)
    return sent[0]


def check_format(scale_fmt: str) -> dict:
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM

    from weightstream.streaming.bucket import Bucket
    from weightstream.wire.fp8 import BlockFP8

    fp8 = BlockFP8((BLOCK, BLOCK), scale_fmt)  # type: ignore[arg-type]
    ours = hf_tensors(fp8)
    named = dict(ours)
    bucket = Bucket.pack(ours, index=0, align=1)
    body = announced(bucket)
    got = receive(bucket, body)
    res: dict = {"dtypes_sent": sorted(set(body["dtypes"])),
                 "received_equal": [n for n, _ in got] == [n for n, _ in ours]
                 and all(same_bits(a, b) for (_, a), (_, b) in zip(got, ours, strict=True)), "ranks": []}
    config = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic",
                       weight_block_size=[BLOCK, BLOCK], scale_fmt=None if scale_fmt == "float" else scale_fmt)
    for rank in range(TP_SIZE):
        model = sglang_layer(config, rank)
        Qwen3ForCausalLM.load_weights(model, got)
        layer = model.model.layers[0]
        methods = {type(vars(m)["quant_method"]).__name__ for m in layer.modules() if "quant_method" in vars(m)}
        r: dict = {"rank": rank, "methods": sorted(methods), "params": {}, "equal": {}}
        for param in FUSED:
            module = layer.get_submodule(param)
            for suffix in ("weight", "weight_scale_inv"):
                p = module.get_parameter(suffix)
                r["params"][f"{param}.{suffix}"] = [str(p.dtype), list(p.shape), type(p).__name__]
                r["equal"][f"{param}.{suffix}"] = same_bits(p.data, expected(named, param, rank, suffix))
        r["equal"]["post_attention_layernorm.weight"] = same_bits(
            layer.post_attention_layernorm.weight.data, named[f"{PREFIX}.post_attention_layernorm.weight"])
        res["ranks"].append(r)
    res["ok"] = res["received_equal"] and all(all(r["equal"].values()) for r in res["ranks"])
    return res


def main() -> None:
    import sglang

    result: dict = {"sglang_version": sglang.__version__, "formats": {}}
    for scale_fmt in ("float", "ue8m0"):
        try:
            result["formats"][scale_fmt] = check_format(scale_fmt)
        except Exception as exc:  # noqa: BLE001 -- reported, the test fails on it
            result["formats"][scale_fmt] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                            "traceback": traceback.format_exc()[-2500:]}
    result["ok"] = all(f["ok"] for f in result["formats"].values())
    print(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
