"""weightstream's SGLang adapter against SGLang's own code (run by a python that has sglang installed).

    WEIGHTSTREAM_SGLANG_PYTHON tests/engines/sglang_check.py   ->  one JSON object on stdout

Run by tests/test_sglang_protocol.py, not collected by pytest. weightstream is imported from this checkout
(the repository root is put on ``sys.path``); it needs only torch here. Checks:

a. every request body :class:`SGLangEngine` sends (captured by overriding ``request``; the adapter is used
   as it is) decodes the way SGLang's HTTP server decodes it: the route's request class is read from
   ``sglang/srt/entrypoints/http_server.py`` (``obj: Annotated[Cls, Body()]``) and the JSON text is validated
   with pydantic's ``TypeAdapter(Cls)``, which FastAPI uses and which goes through SGLang's
   ``msgspec_struct_pydantic_core_schema``. Reported: missing required fields, fields SGLang does not know
   (allowed only for weightstream's own extras), decoded values that differ from what was sent.
b. the broadcast body's names/dtypes/shapes give, through SGLang's ``FlattenedTensorBucket.empty`` (the
   distributed receiver), the byte layout of our bucket; SGLang's receive path
   (``WeightUpdater._receive_bucketed_weights_from_distributed``, the broadcast replaced by a copy of our
   buffer) gives tensors equal bit for bit to the originals.
c. the IPC payloads (``SGLangEngine.encode_ipc``, one per engine TP rank) decode in ANOTHER process, from the
   ``/update_weights_from_tensor`` JSON body, through SGLang's ``BaseTpWorker.deserialize_own_rank`` (compiled
   from its source: importing the TP worker module needs the whole server stack)
   (``monkey_patch_torch_reductions`` + ``MultiprocessingSerializer.deserialize``, i.e. its
   ``SafeUnpickler``) and ``WeightUpdater._update_weights_from_flattened_bucket`` into the original tensors.
d. a block-FP8 bucket (a bf16 norm, ``X.weight`` float8_e4m3fn and ``X.weight_scale_inv`` float32 from
   ``quantize_block_fp8``) through b and c alike; and the scales' offset when an odd-length bf16 tensor
   precedes the pair in a dense bucket.
"""

from __future__ import annotations

import ast
import base64
import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace

warnings.filterwarnings("ignore")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))  # torchvision_standin
sys.path.insert(0, str(ROOT))  # weightstream from this checkout

import torch  # noqa: E402
import torchvision_standin  # noqa: E402,F401  (before anything imports sglang.srt.managers.io_struct)
from common import ipc_in_child, same_bits  # noqa: E402

# The extra fields weightstream sends that SGLang ignores (unknown JSON keys are dropped by its decoder).
OUR_EXTRAS = {"timeout_s", "weightstream_checksum", "weightstream_checksums"}
TP_SIZE = 2
GROUP = "weight_update_group"


def original_tensors(rank: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Three tensors of mixed dtypes, largest element size first (as the stream orders broadcast buckets)."""
    g = torch.Generator().manual_seed(1234 + rank)
    q = torch.randn(6, 5, generator=g, dtype=torch.float32)
    q[0, 0] = float("nan")  # bit-for-bit, not numeric, equality
    norm = torch.randn(7, generator=g).to(torch.bfloat16)
    emb = torch.randint(-128, 127, (3, 3), generator=g, dtype=torch.int8)
    return [("model.layers.0.self_attn.q_proj.weight", q), ("model.layers.0.input_layernorm.weight", norm),
            ("model.embed_tokens.weight_int8", emb)]


# --------------------------------------------------------------------------------------- routes (from source)

def http_routes() -> dict[tuple[str, str], str | None]:
    """``(METHOD, path) -> request class name`` (None: the route reads no body) from http_server.py's source."""
    import importlib.util

    spec = importlib.util.find_spec("sglang.srt.entrypoints.http_server")  # located, not imported
    tree = ast.parse(Path(spec.origin).read_text())
    routes: dict[tuple[str, str], str | None] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.AsyncFunctionDef, ast.FunctionDef)):
            continue
        body_cls = None
        for arg in fn.args.args + fn.args.kwonlyargs:
            ann = arg.annotation
            if (isinstance(ann, ast.Subscript) and getattr(ann.value, "id", None) == "Annotated"
                    and isinstance(ann.slice, ast.Tuple) and len(ann.slice.elts) == 2):
                typ, marker = ann.slice.elts
                if isinstance(marker, ast.Call) and getattr(marker.func, "id", None) == "Body":
                    body_cls = ast.unparse(typ)
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                    and getattr(dec.func.value, "id", None) == "app" and dec.args
                    and isinstance(dec.args[0], ast.Constant)):
                continue
            path, kind = dec.args[0].value, dec.func.attr
            if kind in ("get", "post", "put", "delete"):
                methods = [kind.upper()]
            elif kind == "api_route":
                methods = ["GET"]
                for kw in dec.keywords:
                    if kw.arg == "methods":
                        methods = [ast.literal_eval(kw.value)][0]
            else:
                continue
            for m in methods:
                routes[(m, path)] = body_cls
    return routes


# --------------------------------------------------------------------------------------- capture the bodies

def capture_requests(dense_bucket, ipc_payloads, ipc_checksums):
    from weightstream.engines.base import GroupSpec
    from weightstream.engines.sglang import SGLangEngine
    from weightstream.wire.handles import checksum

    class Recording(SGLangEngine):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.sent: list[dict] = []

        def request(self, method, path, body=None, *, step=None, timeout_s=None):
            # what HTTPEngine.request would put on the wire: json.dumps(body) (no body: none)
            self.sent.append({"call": self._call, "method": method, "path": path,
                              "json": None if body is None else json.dumps(body)})
            if path == "/model_info":
                return {"weight_version": "v2"}
            if path in ("/get_server_info", "/server_info"):
                return {"tp_size": TP_SIZE, "pp_size": 1, "dp_size": 1}
            return {"success": True, "message": "ok"}

    eng = Recording("http://sglang.invalid:30000", timeout_s=5.0, group_name=GROUP)
    spec = GroupSpec(master_address="10.0.0.1", master_port=29511, rank_offset=1, world_size=1 + TP_SIZE,
                     backend="nccl", timeout_s=120.0, group_name=GROUP)
    calls = [
        ("info", lambda: eng.info(refresh=True)),
        ("pause()", lambda: eng.pause()),
        ("pause('retract')", lambda: eng.pause("retract")),
        ("release_memory(['kv_cache','weights'])", lambda: eng.release_memory(["kv_cache", "weights"])),
        ("release_memory()", lambda: eng.release_memory()),
        ("resume_memory(['weights'])", lambda: eng.resume_memory(["weights"])),
        ("resume_memory()", lambda: eng.resume_memory()),
        ("join_group", lambda: eng.join_group(spec)),
        ("begin_update('v2', timeout_s=30)", lambda: eng.begin_update("v2", timeout_s=30.0)),
        ("receive_broadcast", lambda: eng.receive_broadcast(dense_bucket, checksum(dense_bucket.buffer))),
        ("receive_ipc", lambda: eng.receive_ipc(0, ipc_payloads, ipc_checksums)),
        ("receive_ipc(no checksums)", lambda: eng.receive_ipc(1, ipc_payloads, None)),
        ("commit_update", lambda: eng.commit_update()),
        ("begin_update('v3')", lambda: eng.begin_update("v3")),
        ("abort_update", lambda: eng.abort_update(timeout_s=10.0)),
        ("begin_update(None)", lambda: eng.begin_update(None)),
        ("commit_update(version None)", lambda: eng.commit_update()),
        ("weight_version", lambda: eng.weight_version()),
        ("leave_group", lambda: eng.leave_group()),
        ("resume", lambda: eng.resume()),
    ]
    for label, fn in calls:
        eng._call = label
        fn()
    return eng.sent


def decode_one(sent: dict, routes, io) -> dict:
    import msgspec
    from pydantic import TypeAdapter

    key = (sent["method"], sent["path"])
    out = {"call": sent["call"], "method": sent["method"], "path": sent["path"], "route_exists": key in routes}
    cls_name = routes.get(key)
    out["request_class"] = cls_name
    if not out["route_exists"]:
        out.update(decoded=False, error="SGLang's http_server.py has no such route")
        return out
    if cls_name is None:  # e.g. GET /model_info, /flush_cache (query parameters only): no body is read
        out.update(decoded=True, body_read=False, unknown_fields=sorted(json.loads(sent["json"] or "{}")),
                   missing_required=[], mismatched_values=[])
        return out
    cls = getattr(io, cls_name)
    body = json.loads(sent["json"] if sent["json"] is not None else "{}")
    fields = {f.name: f for f in msgspec.structs.fields(cls)}
    out["unknown_fields"] = sorted(set(body) - set(fields))
    out["missing_required"] = sorted(n for n, f in fields.items() if f.required and n not in body)
    try:
        obj = TypeAdapter(cls).validate_json(sent["json"] if sent["json"] is not None else "{}")
    except Exception as exc:  # noqa: BLE001 -- reported, the test fails on it
        out.update(decoded=False, error=f"{type(exc).__name__}: {exc}")
        return out
    out["decoded"] = isinstance(obj, cls)
    mism = []
    for name, value in body.items():
        if name not in fields:
            continue
        got = getattr(obj, name)
        if name == "serialized_named_tensors":  # Base64Bytes: the JSON strings arrive as bytes
            value = [base64.b64decode(v) for v in value]
        if got != value:
            mism.append({"field": name, "sent": repr(value)[:200], "decoded": repr(got)[:200]})
    out["mismatched_values"] = mism
    out["decoded_fields"] = {n: (repr(getattr(obj, n))[:120]) for n in fields
                             if n not in ("serialized_named_tensors",)}
    return out


# --------------------------------------------------------------------------------------- b: broadcast layout

def check_broadcast(bucket, body: dict, named) -> dict:
    from sglang.srt.model_executor.model_runner_components import weight_updater as wu
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    res: dict = {}
    empty = FlattenedTensorBucket.empty(body["names"], body["dtypes"], body["shapes"], "cpu")
    theirs = [(m.name, m.start_idx, m.end_idx) for m in empty.get_metadata()]
    ours = [(m.name, m.offset, m.offset + m.nbytes) for m in bucket.metas]
    res["sglang_layout"] = theirs
    res["our_layout"] = ours
    res["layout_equal"] = theirs == ours
    res["sglang_nbytes"] = int(empty.get_flattened_tensor().numel())
    res["our_nbytes"] = int(bucket.nbytes)
    res["nbytes_equal"] = res["sglang_nbytes"] == res["our_nbytes"]
    res["sglang_dtypes"] = [str(m.dtype) for m in empty.get_metadata()]
    res["dtypes_equal"] = [m.dtype for m in empty.get_metadata()] == [m.dtype for m in bucket.metas]
    res["shapes_equal"] = [tuple(m.shape) for m in empty.get_metadata()] == [tuple(m.shape) for m in bucket.metas]

    # SGLang's own receive path, with the broadcast from rank 0 carrying our buffer.
    def fake_broadcast(tensor, src=0, group=None, async_op=False):
        if tensor.numel() != bucket.buffer.numel():
            raise RuntimeError(f"broadcast size mismatch: SGLang receives {tensor.numel()} bytes, "
                               f"we send {bucket.buffer.numel()}")
        tensor.copy_(bucket.buffer)

    fake_self = SimpleNamespace(device="cpu", _model_update_group={body["group_name"]: object()})
    real = torch.distributed.broadcast
    torch.distributed.broadcast = fake_broadcast
    try:
        got = wu.WeightUpdater._receive_bucketed_weights_from_distributed(
            fake_self, names=body["names"], dtypes=body["dtypes"], shapes=body["shapes"],
            group_name=body["group_name"])
        res["received_names"] = [n for n, _ in got]
        res["tensors_equal"] = (len(got) == len(named) and all(
            n == n2 and same_bits(t, t2) for (n, t), (n2, t2) in zip(named, got, strict=True)))
        res["error"] = None
    except Exception as exc:  # noqa: BLE001
        res["tensors_equal"] = False
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        torch.distributed.broadcast = real
    return res


# --------------------------------------------------------------------------------------- c: IPC (child side)

def sglang_function(module: str, cls: str, name: str, **names):
    """SGLang's own ``module.cls.name``, compiled from its source without importing ``module`` (the TP worker
    module pulls the whole server: uvicorn, fastapi, opentelemetry, ...). Its globals are the module's own
    ``from sglang... import`` lines that the function needs, plus ``names`` (stand-ins for runtime state)."""
    import importlib
    import importlib.util

    origin = importlib.util.find_spec(module).origin
    tree = ast.parse(Path(origin).read_text())
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name)
    used = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
    glb: dict = {"__name__": module}
    for node in tree.body:  # the module's own imports of the names the function uses
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sglang") and not node.level:
            for alias in node.names:
                local = alias.asname or alias.name
                if local in used and local not in names:
                    glb[local] = getattr(importlib.import_module(node.module), alias.name)
    glb.update(names)
    code = compile(ast.Module(body=[fn], type_ignores=[]), origin, "exec")
    exec(code, glb)  # SGLang's installed source, the point of the check
    return glb[name]


def ipc_child(json_path: str, expected_path: str) -> None:
    """Another process: what SGLang's server does with the /update_weights_from_tensor body, rank by rank."""
    import sglang.srt.managers.io_struct as io
    from pydantic import TypeAdapter
    from sglang.srt.model_executor.model_runner_components import weight_updater as wu

    body_json = Path(json_path).read_text()
    expected = torch.load(expected_path)  # {rank: [(name, tensor)]}
    req = TypeAdapter(io.UpdateWeightsFromTensorReqInput).validate_json(body_json)
    out = {"pid": os.getpid(), "n_payloads": len(req.serialized_named_tensors),
           "load_format": req.load_format, "ranks": []}
    for rank, want in expected.items():
        r: dict = {"rank": rank}
        try:
            deserialize_own_rank = sglang_function(
                "sglang.srt.managers.tp_worker", "BaseTpWorker", "deserialize_own_rank",
                get_parallel=lambda rank=rank: SimpleNamespace(tp_rank=rank))
            data = deserialize_own_rank(None, req.serialized_named_tensors)
            r["payload_type"] = type(data).__name__
            r["payload_keys"] = sorted(data) if isinstance(data, dict) else None
            r["metadata_types"] = sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in data["metadata"]})
            loaded: list = []
            fake_self = SimpleNamespace(get_model=lambda loaded=loaded: SimpleNamespace(load_weights=loaded.extend))
            ok, msg = wu.WeightUpdater._update_weights_from_flattened_bucket(
                fake_self, flattened_tensor_bucket_dict=data)
            r["success"], r["message"] = bool(ok), msg
            r["names"] = [n for n, _ in loaded]
            r["dtypes"] = [str(t.dtype) for _, t in loaded]
            r["shapes"] = [list(t.shape) for _, t in loaded]
            r["names_equal"] = r["names"] == [n for n, _ in want]
            r["dtypes_equal"] = [t.dtype for _, t in loaded] == [t.dtype for _, t in want]
            r["shapes_equal"] = [tuple(t.shape) for _, t in loaded] == [tuple(t.shape) for _, t in want]
            r["tensors_equal"] = len(loaded) == len(want) and all(
                same_bits(a, b) for (_, a), (_, b) in zip(loaded, want, strict=True))
            r["error"] = None
        except Exception as exc:  # noqa: BLE001
            r.update(success=False, tensors_equal=False, error=f"{type(exc).__name__}: {exc}",
                     traceback=traceback.format_exc()[-1500:])
        out["ranks"].append(r)
    print(json.dumps(out))


def check_ipc(sent_ipc: dict, expected: dict) -> dict:
    body = json.loads(sent_ipc["json"])
    res, child = ipc_in_child(__file__, body["serialized_named_tensors"], TP_SIZE, sent_ipc["json"], expected)
    if child is not None:
        res["ok"] = (res["ok"] and child["n_payloads"] == TP_SIZE and len(child["ranks"]) == TP_SIZE
                     and all(r.get("success") and r.get("tensors_equal") and r.get("names_equal")
                             and r.get("dtypes_equal") and r.get("shapes_equal") for r in child["ranks"]))
    return res


# --------------------------------------------------------------------------------------- d: block FP8

def fp8_tensors(rank: int = 0, norm_numel: int = 256) -> list[tuple[str, torch.Tensor]]:
    """A bf16 norm and one block-FP8 pair (``quantize_block_fp8``), in the order the stream lays out a dense
    bucket: items by their source dtype's element size (both bf16 here), each FP8 weight followed by its scales."""
    from weightstream.converters.fp8 import quantize_block_fp8

    g = torch.Generator().manual_seed(99 + rank)
    q, scale = quantize_block_fp8(torch.randn(320, 200, generator=g).to(torch.bfloat16))
    norm = torch.randn(norm_numel, generator=g).to(torch.bfloat16)
    return [("model.layers.0.post_attention_layernorm.weight", norm),
            ("model.layers.0.mlp.down_proj.weight", q), ("model.layers.0.mlp.down_proj.weight_scale_inv", scale)]


def check_fp8(named_by_rank: dict) -> dict:
    """The FP8 bucket through the same paths as the others: SGLang's distributed receiver and its IPC path.
    Also what an odd-length bf16 tensor ahead of the pair does to the scales' offset in a dense bucket."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from weightstream.engines.sglang import SGLangEngine
    from weightstream.streaming.bucket import Bucket
    from weightstream.wire.handles import checksum

    named = named_by_rank[0]
    dense = Bucket.pack(named, index=0, align=1)
    ipc_buckets = {rank: Bucket.pack(t, index=1) for rank, t in named_by_rank.items()}
    payloads = [SGLangEngine("http://sglang.check").encode_ipc(ipc_buckets[r]) for r in range(TP_SIZE)]
    sent = capture_requests(dense, payloads, [checksum(ipc_buckets[r].buffer) for r in range(TP_SIZE)])
    body = json.loads(next(s for s in sent if s["path"] == "/update_weights_from_distributed")["json"])
    res: dict = {"dtypes_sent": body["dtypes"], "shapes_sent": body["shapes"],
                 "offsets": [m.offset for m in dense.metas],
                 "aligned": all(m.offset % m.dtype.itemsize == 0 for m in dense.metas)}
    res["broadcast"] = check_broadcast(dense, body, named)
    res["ipc"] = check_ipc(next(s for s in sent if s["path"] == "/update_weights_from_tensor"), named_by_rank)
    try:  # 7 bf16 elements = 14 bytes, so the scales would start at 14 + 320 * 200, not a multiple of 4
        odd = Bucket.pack(fp8_tensors(0, norm_numel=7), align=1)
        FlattenedTensorBucket(flattened_tensor=odd.buffer, metadata=FlattenedTensorBucket.empty(
            [m.name for m in odd.metas], [str(m.dtype).split(".")[-1] for m in odd.metas],
            [list(m.shape) for m in odd.metas], "cpu").get_metadata()).reconstruct_tensors()
        res["odd_norm_error"] = None
    except Exception as exc:  # noqa: BLE001 -- reported
        res["odd_norm_error"] = f"{type(exc).__name__}: {exc}"[:300]
        res["odd_norm_raised_in"] = traceback.extract_tb(exc.__traceback__)[-1].filename.split("site-packages/")[-1]
    res["ok"] = bool(res["aligned"] and res["broadcast"]["layout_equal"] and res["broadcast"]["tensors_equal"]
                     and res["broadcast"]["dtypes_equal"] and res["broadcast"]["shapes_equal"] and res["ipc"]["ok"])
    del ipc_buckets, payloads
    return res


# --------------------------------------------------------------------------------------- main

def main() -> None:
    torch.multiprocessing.set_sharing_strategy("file_system")  # CPU tensors readable by an unrelated process
    import sglang
    import sglang.srt.managers.io_struct as io

    from weightstream.common.layout import ALIGN
    from weightstream.engines.sglang import SGLangEngine
    from weightstream.streaming.bucket import Bucket
    from weightstream.wire.handles import checksum

    result: dict = {"sglang_version": getattr(sglang, "__version__", None), "torch_version": torch.__version__,
                    "our_extras": sorted(OUR_EXTRAS)}
    named = original_tensors(0)
    # Broadcast buckets are dense (align=1, largest element size first: update.py); IPC buckets keep ALIGN.
    dense = Bucket.pack(named, index=0, align=1)
    ipc_named = {rank: original_tensors(rank) for rank in range(TP_SIZE)}  # each TP rank its own bucket
    ipc_buckets = {rank: Bucket.pack(t, index=1) for rank, t in ipc_named.items()}
    payloads = [SGLangEngine("http://sglang.check").encode_ipc(ipc_buckets[r]) for r in range(TP_SIZE)]
    sums = [checksum(ipc_buckets[r].buffer) for r in range(TP_SIZE)]

    sent = capture_requests(dense, payloads, sums)
    routes = http_routes()
    decoded = [decode_one(s, routes, io) for s in sent]
    result["requests"] = decoded
    unknown = sorted({f for d in decoded for f in d.get("unknown_fields", [])})
    result["unknown_fields"] = unknown
    result["unknown_beyond_extras"] = sorted(set(unknown) - OUR_EXTRAS)
    result["all_routes_exist"] = all(d["route_exists"] for d in decoded)
    result["all_decoded"] = all(d.get("decoded") for d in decoded)
    result["missing_required"] = {d["call"]: d["missing_required"] for d in decoded if d.get("missing_required")}
    result["mismatched_values"] = {d["call"]: d["mismatched_values"] for d in decoded if d.get("mismatched_values")}
    result["routes_sent"] = sorted({f'{d["method"]} {d["path"]}' for d in decoded})

    bc = next(s for s in sent if s["path"] == "/update_weights_from_distributed")
    result["broadcast"] = check_broadcast(dense, json.loads(bc["json"]), named)
    # For information: an ALIGN-padded bucket (the IPC layout) would not match SGLang's dense receiver.
    padded = Bucket.pack(named, align=ALIGN)
    result["broadcast"]["padded_bucket_layout_equal"] = (
        [(m.offset, m.offset + m.nbytes) for m in padded.metas]
        == [(m.offset, m.offset + m.nbytes) for m in dense.metas])

    ipc = next(s for s in sent if s["path"] == "/update_weights_from_tensor")
    result["ipc"] = check_ipc(ipc, ipc_named)
    result["ok"] = bool(result["all_routes_exist"] and result["all_decoded"] and not result["missing_required"]
                        and not result["unknown_beyond_extras"] and not result["mismatched_values"]
                        and result["broadcast"]["layout_equal"] and result["broadcast"]["nbytes_equal"]
                        and result["broadcast"]["tensors_equal"] and result["ipc"]["ok"])
    result["fp8"] = check_fp8({rank: fp8_tensors(rank) for rank in range(TP_SIZE)})
    print(json.dumps(result))
    del ipc_buckets, payloads  # the shared-memory buffers live until the child has read them


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--ipc-child":
        ipc_child(sys.argv[2], sys.argv[3])
    else:
        main()
