"""LMDeploy 0.18's blocked-FP8 loaders against weightstream's FP8 buckets (a python with lmdeploy; CPU).

    WEIGHTSTREAM_LMDEPLOY_PYTHON tests/engines/lmdeploy_fp8_check.py   ->  one JSON object on stdout's last line

One decoder layer of a Qwen3 (hidden 256, 4 heads and 2 KV heads of 128, MLP 512) in HF names, quantized by
weightstream (``BlockFP8.quantize``), in the single-dtype buckets the stream makes for an engine that declares
``single_dtype`` (one of bf16, one of float8_e4m3fn weights, one of float32 scales), goes to LMDeploy two ways:

a. broadcast: :class:`LMDeployEngine` announces each bucket (its ``/update_weights_from_distributed`` body, as
   LMDeploy's ``UpdateWeightsFromDistributedRequest``) and LMDeploy's ``BaseModelAgent.update_weights_from_distributed``
   receives it (the broadcast copies our buffer; the agent is the one of tests/engines/lmdeploy_check.py), then
   the ``finished=True`` request runs LMDeploy's post-load pass (``process_weights_after_loading``: each
   blocked-FP8 layer's ``update_weights``);
b. IPC: the ``/update_weights`` payloads of those buckets (``LMDeployEngine.encode_ipc``) through LMDeploy's
   ``BaseModelAgent.update_params`` (compiled from its source without its one CUDA-only statement, as in
   lmdeploy_check.py), in another process.

Either way the model is LMDeploy's own layers for each engine TP rank of 2: ``build_qkv_proj``, ``build_o_proj``,
``build_gateup_linear`` and ``build_down_linear`` with LMDeploy's ``QuantizationConfig`` read from our
``quantization_config`` (in its ``build_model_context``, as it builds a model: ``QKVBlockedF8Linear``,
``BlockedF8Linear``, ``MergedBlockedF8Linear``: a float8 weight and a float32 ``weight_scale_inv`` each), built
in LMDeploy's ``DistContext`` for that rank (its ``DistConfig(tp=2)``; no process group is made), loaded by
LMDeploy's ``Qwen3ForCausalLM.load_weights``. Each parameter must hold exactly that rank's slice of our values and
scales.

c. LMDeploy quantizes what is not float8 itself (``weight_loader_with_quant`` -> ``quant_blocked_fp8``, which
   divides by the scale): the same bf16 weights sent unquantized are stored as LMDeploy's quantization, which
   differs from ours (DeepGEMM's multiply by the reciprocal) in the last bit of some values; sent as our FP8,
   they are stored as ours, untouched (no re-quantization).
d. FP8 sent to an LMDeploy model that is not FP8 (a wrong statement): LMDeploy's default linear layers cast the
   float8 weights into their bf16 parameters, and the scales have no parameter (``KeyError``).
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
sys.path.insert(0, str(HERE.parents[1]))  # weightstream from this checkout
sys.path.insert(0, str(HERE))  # common, lmdeploy_check

import torch  # noqa: E402
from common import FUSED, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, MLP, PREFIX, TP_SIZE, WEIGHTS, ipc_in_child, same_bits  # noqa: E402
from lmdeploy_check import GROUP, cpu_cuda, fake_agent, lmdeploy_update_params, patched  # noqa: E402

NORM = f"{PREFIX}.post_attention_layernorm.weight"


def bf16_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(77)
    return {f"{PREFIX}.{n}.weight": (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16)
            for n, (shape, _) in WEIGHTS.items()}


def fp8_tensors() -> list[tuple[str, torch.Tensor]]:
    from weightstream.converters.fp8 import quantize_weight
    from weightstream.wire.fp8 import BlockFP8

    g = torch.Generator().manual_seed(78)
    out = [(NORM, torch.randn(HIDDEN, generator=g).to(torch.bfloat16))]
    for name, w in bf16_weights().items():
        q, s = quantize_weight(BlockFP8(), w)
        out += [(name, q), (name + "_scale_inv", s)]
    return out


def single_dtype_buckets(named, align: int):
    """The stream's buckets for a single-dtype engine: one per dtype, in the order named."""
    from weightstream.streaming.bucket import Bucket

    by_dtype: dict = {}
    for n, t in named:
        by_dtype.setdefault(t.dtype, []).append((n, t))
    return [Bucket.pack(items, index=i, align=align) for i, items in enumerate(by_dtype.values())]


def lmdeploy_layer(rank: int, quantization_config: dict | None) -> torch.nn.Module:
    """LMDeploy's own linear layers of one decoder layer for engine TP rank ``rank``, under a stand-in root that
    has what ``Qwen3ForCausalLM.load_weights`` reads (``named_parameters``, ``config``)."""
    from lmdeploy.pytorch.config import DistConfig, QuantizationConfig
    from lmdeploy.pytorch.distributed import DistContext, DistGroup, get_dist_manager
    from lmdeploy.pytorch.model_inputs import BuildModelContext
    from lmdeploy.pytorch.models.patch import build_model_context
    from lmdeploy.pytorch.nn.linear import build_down_linear, build_gateup_linear, build_o_proj, build_qkv_proj

    qc = QuantizationConfig.from_config(SimpleNamespace(quantization_config=quantization_config))
    group = DistGroup(rank=rank)
    ctx = DistContext(rank=rank, tp_group=group, attn_tp_group=group, mlp_tp_group=group, moe_tp_group=group,
                      dist_config=DistConfig(tp=TP_SIZE, world_size=TP_SIZE))
    kw = {"dtype": torch.bfloat16, "device": "cpu", "quant_config": qc}
    attn, mlp = torch.nn.Module(), torch.nn.Module()
    with get_dist_manager().context(ctx), build_model_context(BuildModelContext(quant_config=qc)):
        attn.qkv_proj = build_qkv_proj(HIDDEN, num_q_heads=HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, bias=False,
                                       prefix=f"{PREFIX}.self_attn.qkv_proj", **kw)
        attn.o_proj = build_o_proj(HEADS * HEAD_DIM, HIDDEN, bias=False, is_tp=True,
                                   prefix=f"{PREFIX}.self_attn.o_proj", **kw)
        mlp.gate_up_proj = build_gateup_linear(HIDDEN, [MLP, MLP], bias=False, is_tp=True,
                                               prefix=f"{PREFIX}.mlp.gate_up_proj", **kw)
        mlp.down_proj = build_down_linear(MLP, HIDDEN, bias=False, is_tp=True, prefix=f"{PREFIX}.mlp.down_proj", **kw)
    layer = torch.nn.Module()
    layer.self_attn, layer.mlp = attn, mlp
    layer.post_attention_layernorm = torch.nn.Module()
    layer.post_attention_layernorm.weight = torch.nn.Parameter(torch.zeros(HIDDEN, dtype=torch.bfloat16),
                                                               requires_grad=False)
    return _root(layer)


def _root(layer: torch.nn.Module) -> torch.nn.Module:
    from lmdeploy.pytorch.models.qwen3 import Qwen3ForCausalLM

    class Root(torch.nn.Module):
        config = SimpleNamespace(tie_word_embeddings=False)
        load_weights = Qwen3ForCausalLM.load_weights  # LMDeploy's own, unbound

    root = Root()
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList([layer])
    return root


def expected(named: dict, param: str, rank: int, suffix: str) -> torch.Tensor:
    parts = []
    for w in FUSED[param]:
        t = named[f"{PREFIX}.{w}.{suffix}"]
        dim = 0 if WEIGHTS[w][1] == "rows" else 1
        size = t.shape[dim] // TP_SIZE
        parts.append(t.narrow(dim, rank * size, size))
    return torch.cat(parts, dim=0)


def compare(model: torch.nn.Module, named: dict, rank: int) -> dict:
    layer = model.model.layers[0]
    out: dict = {"classes": {}, "params": {}, "equal": {}}
    for param in FUSED:
        module = layer.get_submodule(param)
        out["classes"][param] = type(module).__name__
        for suffix in ("weight", "weight_scale_inv"):
            p = module.get_parameter(suffix)
            out["params"][f"{param}.{suffix}"] = [str(p.dtype), list(p.shape)]
            out["equal"][f"{param}.{suffix}"] = same_bits(p.data, expected(named, param, rank, suffix))
    out["equal"]["post_attention_layernorm.weight"] = same_bits(layer.post_attention_layernorm.weight.data, named[NORM])
    out["ok"] = all(out["equal"].values())
    return out


def bodies(buckets) -> tuple[list[dict], list[str]]:
    """What :class:`LMDeployEngine` sends: each bucket's broadcast body, each bucket's IPC body (both engine ranks
    take the same full-mode bucket), and the finished requests."""
    from weightstream.engines.lmdeploy import LMDeployEngine

    sent: list = []

    class Recording(LMDeployEngine):
        def request(self, method, path, body=None, *, step=None, timeout_s=None):
            sent.append((path, json.dumps(body)))
            return {"success": True}

    eng = Recording("http://lmdeploy.invalid", group_name=GROUP)
    eng.begin_update("v1")
    for b in buckets:
        eng.receive_broadcast(b, None)
    eng.commit_update()
    broadcast = [json.loads(j) for _, j in sent]
    sent.clear()
    eng.begin_update("v2")
    for b in buckets:
        eng.receive_ipc(b.index, [eng.encode_ipc(b)] * TP_SIZE, None)
    eng.commit_update()
    return broadcast, [j for _, j in sent]


def check_broadcast(buckets, named: dict, broadcast: list[dict]) -> dict:
    from lmdeploy.pytorch.engine.model_agent.agent import BaseModelAgent
    from lmdeploy.serve.openai.protocol import UpdateWeightsFromDistributedRequest

    res: dict = {"dtypes_per_bucket": [sorted(set(b["dtypes"])) for b in broadcast[:-1]], "ranks": []}
    queue = [b.buffer for b in buckets]

    def broadcast_fn(tensor, src=0, group=None, async_op=False):
        ours = queue.pop(0)
        if tensor.numel() * tensor.element_size() != ours.numel():
            raise RuntimeError(f"LMDeploy receives {tensor.numel() * tensor.element_size()} bytes, "
                               f"we send {ours.numel()}")
        tensor.view(torch.uint8).copy_(ours)

    for rank in range(TP_SIZE):
        queue[:] = [b.buffer for b in buckets]
        model = lmdeploy_layer(rank, named["quantization_config"])
        agent = fake_agent(model, tp_rank=rank, groups=[GROUP])
        answers = []
        with cpu_cuda(), patched(torch.distributed, broadcast=broadcast_fn):
            for body in broadcast:
                ok, msg = BaseModelAgent.update_weights_from_distributed(
                    agent, UpdateWeightsFromDistributedRequest.model_validate_json(json.dumps(body)))
                answers.append(bool(ok) or msg)
        r = compare(model, named, rank)
        r.update(rank=rank, answers=answers)
        r["ok"] = r["ok"] and all(a is True for a in answers)
        res["ranks"].append(r)
    res["ok"] = all(r["ok"] for r in res["ranks"])
    return res


def ipc_child(bodies_path: str, expected_path: str) -> None:
    """Another process: LMDeploy's update_params on each /update_weights body, into LMDeploy's layers per rank."""
    from lmdeploy.serve.openai.protocol import UpdateParamsRequest

    texts = json.loads(Path(bodies_path).read_text())
    named = torch.load(expected_path)
    named["quantization_config"] = json.loads(texts.pop(0))
    out: dict = {"pid": os.getpid(), "ranks": []}
    update_params, _ = lmdeploy_update_params()
    reqs = [UpdateParamsRequest.model_validate_json(t) for t in texts]
    for rank in range(TP_SIZE):
        try:
            model = lmdeploy_layer(rank, named["quantization_config"])
            agent = fake_agent(model, tp_rank=rank)
            with cpu_cuda():
                for req in reqs:
                    update_params(agent, req)
            r = compare(model, named, rank)
            r["rank"] = rank
        except Exception as exc:  # noqa: BLE001 -- reported, the test fails on it
            r = {"rank": rank, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                 "traceback": traceback.format_exc()[-2000:]}
        out["ranks"].append(r)
    print(json.dumps(out))


def check_ipc(ipc_bodies: list[str], named: dict) -> dict:
    tensors = {k: v for k, v in named.items() if k != "quantization_config"}
    first = json.loads(ipc_bodies[0])["serialized_named_tensors"]
    res, child = ipc_in_child(__file__, first, TP_SIZE,
                              json.dumps([json.dumps(named["quantization_config"])] + ipc_bodies), tensors)
    if child is not None:
        res["ranks"] = child["ranks"]
        res["ok"] = res["ok"] and len(child["ranks"]) == TP_SIZE and all(r["ok"] for r in child["ranks"])
    return res


def check_own_quantization(qc: dict) -> dict:
    """c: bf16 weights LMDeploy quantizes itself against the same weights sent as our FP8."""
    from lmdeploy.lite.quantization.weight.quant_utils import quant_blocked_fp8

    from weightstream.converters.fp8 import quantize_weight
    from weightstream.wire.fp8 import BlockFP8

    out: dict = {}
    for name, w in bf16_weights().items():
        q, s = quantize_weight(BlockFP8(), w)
        lq, ls = quant_blocked_fp8(w, torch.float8_e4m3fn, 128)
        out[name] = {"scales_differ": int((ls != s).sum()), "values_differ": int((lq.view(torch.uint8) != q.view(
            torch.uint8)).sum()), "blocks": s.numel()}
    model = lmdeploy_layer(0, qc)
    model.load_weights(list(bf16_weights().items()))  # unquantized: LMDeploy quantizes
    theirs = {n: quant_blocked_fp8(w, torch.float8_e4m3fn, 128) for n, w in bf16_weights().items()}
    named = {}
    for n, (q, s) in theirs.items():
        named[n], named[n + "_scale_inv"] = q, s
    named[NORM] = model.model.layers[0].post_attention_layernorm.weight.data.clone()
    return {"per_weight": out, "bf16_update_stored_as_lmdeploy_quantized": compare(model, named, 0)["ok"],
            "differs_somewhere": any(v["scales_differ"] or v["values_differ"] for v in out.values())}


def check_wrong_statement(named_fp8: list) -> dict:
    """d: FP8 into an LMDeploy model that is not FP8."""
    model = lmdeploy_layer(0, None)
    out: dict = {"classes": sorted({type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__})}
    weights = [(n, t) for n, t in named_fp8 if t.dtype == torch.float8_e4m3fn]
    model.load_weights(weights)
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    out["float8_weights_loaded_into"] = str(qkv.dtype)
    try:
        model.load_weights([(n, t) for n, t in named_fp8 if n.endswith("_scale_inv")][:1])
        out["scales_error"] = None
    except Exception as exc:  # noqa: BLE001 -- reported
        out["scales_error"] = f"{type(exc).__name__}: {exc}"
    return out


def main() -> None:
    import lmdeploy

    from weightstream.common.layout import ALIGN
    from weightstream.wire.fp8 import BlockFP8

    result: dict = {"lmdeploy_version": lmdeploy.__version__}
    named_list = fp8_tensors()
    named: dict = dict(named_list)
    named["quantization_config"] = BlockFP8().config(["lm_head"])
    try:
        broadcast, _ = bodies(single_dtype_buckets(named_list, 1))
        result["broadcast"] = check_broadcast(single_dtype_buckets(named_list, 1), named, broadcast)
        ipc_buckets = single_dtype_buckets(named_list, ALIGN)
        _, ipc = bodies(ipc_buckets)
        result["ipc"] = check_ipc(ipc, named)
        del ipc_buckets
        result["own_quantization"] = check_own_quantization(named["quantization_config"])
        result["wrong_statement"] = check_wrong_statement(named_list)
    except Exception as exc:  # noqa: BLE001 -- reported, the test fails on it
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-2500:]
    print(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    torch.multiprocessing.set_sharing_strategy("file_system")  # CPU tensors readable by an unrelated process
    if len(sys.argv) == 4 and sys.argv[1] == "--ipc-child":
        ipc_child(sys.argv[2], sys.argv[3])
    else:
        main()
