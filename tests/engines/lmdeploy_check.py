"""weightstream's LMDeploy adapter against LMDeploy's own code (run by a python that has lmdeploy installed).

    WEIGHTSTREAM_LMDEPLOY_PYTHON tests/engines/lmdeploy_check.py   ->  one JSON object on stdout's last line

Run by tests/test_lmdeploy_protocol.py, not collected by pytest, in the environment of
tests/engines/requirements.txt (shared with the SGLang check). weightstream is imported from this checkout
(the repository root is put on ``sys.path``); it needs only torch here. No GPU and no model: what LMDeploy
runs on a GPU is replaced where it must be, and each replacement is named below. Checks:

a. Every request :class:`LMDeployEngine` sends goes, over real HTTP (the adapter's own
   ``HTTPEngine.request``: ``urllib``, ``Content-Type: application/json``, its query strings; the capturing
   subclass only records and passes the call on), to LMDeploy's REAL routes: a FastAPI app assembled the way
   ``lmdeploy.serve.openai.api_server.serve`` assembles it (``create_openai_router(ServerContext)``, which
   registers ``endpoints/management.py`` and ``endpoints/distserve.py``; its ``validation_exception_handler``
   and ``EngineSleepingMiddleware``), served by uvicorn on 127.0.0.1 in a thread. The ``ServerContext`` is
   LMDeploy's, its ``async_engine`` a real ``AsyncEngine`` (made with ``__new__``: its ``__init__`` loads a
   model) whose ``sleep`` / ``wakeup`` / ``stop_all_session`` run as they are, with LMDeploy's
   ``SessionManager`` and a ``PytorchEngineConfig(tp=2)`` as ``backend_config`` (what
   ``/distserve/engine_info`` reports). THE ONE STAND-IN is ``async_engine.engine``, LMDeploy's PyTorch
   ``Engine`` (GPU workers behind an executor): :class:`RecordingEngine` records the request objects the
   routes hand it and answers ``(True, message)``. Per request: route exists, status code, the request class
   the route built, fields sent that the class does not know (must be none), required fields missing (none),
   decoded values equal to what was sent, and what reached the engine (sleep level, wakeup tags, abort).
b. Broadcast: the ``UpdateWeightsFromDistributedRequest`` objects the route built go through LMDeploy's real
   ``BaseModelAgent.update_weights_from_distributed`` (the unbound function, unmodified), its
   ``_load_updated_weight_bucket`` / ``_split_updated_weights`` / ``_finalize_updated_weights`` bound to a
   ``SimpleNamespace`` agent and LMDeploy's ``process_weights_after_loading``; the model is a recording
   ``torch.nn.Module`` (``load_weights`` keeps copies, ``update_weights`` counts the post-load pass).
   Replaced for the CPU: ``torch.distributed.broadcast`` (copies OUR bucket buffer into the tensor LMDeploy
   allocated, after checking the byte size and dtype), ``torch.cuda.current_device`` (answers ``"cpu"``, so
   LMDeploy allocates its receive buffer on the CPU), ``torch.cuda.empty_cache`` / ``torch.cuda.synchronize``
   (no-ops); ``all_context`` is ``contextlib.nullcontext`` and the group a placeholder object. The received
   tensors must equal the originals bit for bit; the ``finished=True`` empty request must load nothing and run
   the post-load pass once.
c. IPC: the ``/update_weights`` JSON bodies (a bucket's, one payload per engine TP rank from
   ``LMDeployEngine.encode_ipc``, each rank its own ALIGN-padded bucket; then the ``finished=True`` empty one)
   are decoded in ANOTHER process (``file_system`` sharing strategy, as torch needs for CPU tensors between
   unrelated processes) into LMDeploy's ``UpdateParamsRequest`` (pydantic, as the route does) and run through
   LMDeploy's ``BaseModelAgent.update_params``, rank r with ``dist_ctx.tp_group.rank = r``. That method is
   compiled from LMDeploy's installed source with ONE statement removed: ``args[6] =
   torch.cuda.current_device()`` in its ``_construct``, which overwrites the device index of
   ``rebuild_cuda_tensor``'s arguments; a CPU tensor reduces to ``rebuild_tensor``'s three arguments, so on a
   CPU that line can only raise ``IndexError`` (the check fails if the line is not found exactly once).
   Everything else runs as installed: ``ForkingPickler.loads(pybase64.b64decode(...))``, the payload chosen by
   TP rank, ``func(*args)``, the ``require_clone`` choice, the cached IPC tensor, LMDeploy's
   ``FlattenedTensorBucket(flattened_tensor=, metadata=).reconstruct_tensors()``, weight renaming,
   ``model.load_weights``, ``process_weights_after_loading`` on ``finished``. ``torch.cuda.synchronize`` /
   ``empty_cache`` are no-ops there too. The tensors must equal the originals bit for bit.
d. LMDeploy's flattened bucket holds one dtype: ``encode_ipc`` / ``receive_broadcast`` of a mixed-dtype
   bucket raise weightstream's ``EngineError`` naming the dtypes, and nothing is sent.

Not provable on a CPU: the CUDA IPC handle itself (``reduce_tensor`` of a CUDA tensor and LMDeploy's device
override of it), NCCL's broadcast, the rendezvous of ``init_weights_update_group``, what ``sleep`` /
``wakeup`` do to GPU memory.
"""

from __future__ import annotations

import ast
import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
import typing
import warnings
from pathlib import Path
from types import SimpleNamespace

warnings.filterwarnings("ignore")
logging.disable(logging.CRITICAL)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))  # weightstream from this checkout
sys.path.insert(0, str(HERE))  # common

import torch  # noqa: E402
from common import ipc_in_child, same_bits  # noqa: E402

TP_SIZE = 2
GROUP = "weight_update_group"
AGENT_MODULE = "lmdeploy.pytorch.engine.model_agent.agent"


def original_tensors(rank: int = 0, dtype=torch.bfloat16) -> list[tuple[str, torch.Tensor]]:
    """Three tensors of ONE dtype (LMDeploy's bucket holds one), odd sizes so element offsets are not
    byte offsets, a NaN so equality is of bits, not numbers."""
    g = torch.Generator().manual_seed(4321 + rank)
    q = torch.randn(6, 5, generator=g).to(dtype)
    q[0, 0] = float("nan")
    norm = torch.randn(7, generator=g).to(dtype)
    o = torch.randn(3, 2, 3, generator=g).to(dtype)
    return [("model.layers.0.self_attn.q_proj.weight", q), ("model.layers.0.input_layernorm.weight", norm),
            ("model.layers.0.self_attn.o_proj.weight", o)]


@contextlib.contextmanager
def patched(obj, **attrs):
    old = {k: getattr(obj, k) for k in attrs}
    for k, v in attrs.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(obj, k, v)


class RecordingModel(torch.nn.Module):
    """Stands in for the model on the GPU: what LMDeploy loads into it, and its post-load pass."""

    def __init__(self):
        super().__init__()
        self.loaded: list[tuple[str, torch.Tensor]] = []
        self.post_load_passes = 0

    def load_weights(self, weights):
        self.loaded.extend((n, t.clone()) for n, t in weights)

    def update_weights(self):  # called by LMDeploy's process_weights_after_loading
        self.post_load_passes += 1


def fake_agent(model: RecordingModel, tp_rank: int = 0, groups=()) -> SimpleNamespace:
    """The ``self`` of BaseModelAgent's methods: LMDeploy's own helper methods bound to it, the GPU-side state
    replaced by placeholders."""
    from lmdeploy.pytorch.engine.model_agent.agent import BaseModelAgent

    me = SimpleNamespace(
        all_context=contextlib.nullcontext, _model_update_group={g: object() for g in groups},
        patched_model=SimpleNamespace(get_model=lambda: model, get_prefill_warmup_token_sizes=lambda: []),
        spec_agent=SimpleNamespace(get_model=lambda: None, is_enabled=lambda: False, method=None),
        dist_ctx=SimpleNamespace(tp_group=SimpleNamespace(rank=tp_rank)),
        state=SimpleNamespace(is_sleeping=False), reset_graph_runner=lambda: None,
        _update_params_ipc_tensor=None, _update_params_ipc_event=None,
    )
    for name in ("_split_updated_weights", "_load_updated_weight_bucket", "_finalize_updated_weights"):
        setattr(me, name, getattr(BaseModelAgent, name).__get__(me))
    return me


def cpu_cuda():
    """torch.cuda's calls in the agent, answered for a CPU-only torch."""
    return patched(torch.cuda, current_device=lambda: "cpu", empty_cache=lambda: None, synchronize=lambda *a: None)


# --------------------------------------------------------------------------------------- a: the server

class RecordingEngine:
    """THE stand-in: LMDeploy's PyTorch ``Engine`` (``AsyncEngine.engine``), which forwards to GPU workers.
    Records what the routes and AsyncEngine hand it; answers as the engine does when it succeeds."""

    def __init__(self):
        self.calls: list[tuple[str, object]] = []

    def update_params(self, request):
        self.calls.append(("update_params", request))

    async def init_weights_update_group(self, request):
        self.calls.append(("init_weights_update_group", request))
        return True, "Succeeded to initialize weights update group."

    async def update_weights_from_distributed(self, request):
        self.calls.append(("update_weights_from_distributed", request))
        return True, "Succeeded to update parameter online."

    async def destroy_weights_update_group(self, request):
        self.calls.append(("destroy_weights_update_group", request))
        return True, f"Succeeded to destroy group {request.group_name!r}."

    async def sleep(self, level: int = 1):
        self.calls.append(("sleep", level))

    def wakeup(self, tags=None):
        self.calls.append(("wakeup", list(tags) if tags is not None else None))


class Wire:
    """ASGI wrapper around LMDeploy's app: what arrived (method, path, query, content type) and the status
    and body of the answer."""

    def __init__(self, app):
        self.app, self.log = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        entry = {"method": scope["method"], "path": scope["path"], "query": scope["query_string"].decode(),
                 "content_type": headers.get(b"content-type", b"").decode(), "status": None, "reply": b""}
        self.log.append(entry)

        async def send_(msg):
            if msg["type"] == "http.response.start":
                entry["status"] = msg["status"]
            elif msg["type"] == "http.response.body":
                entry["reply"] += msg.get("body", b"")
            await send(msg)

        await self.app(scope, receive, send_)


def lmdeploy_server():
    """LMDeploy's app as ``api_server.serve`` assembles it, on a real AsyncEngine and ServerContext, served
    by uvicorn on 127.0.0.1 (a thread). Returns ``(url, ctx, engine, wire, router, stop)``."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.serve.core.async_engine import AsyncEngine
    from lmdeploy.serve.managers.session_manager import SessionManager
    from lmdeploy.serve.openai.api_server import ServerContext, validation_exception_handler
    from lmdeploy.serve.openai.endpoints.router import create_openai_router
    from lmdeploy.serve.utils.server_utils import EngineSleepingMiddleware

    engine = RecordingEngine()
    ae = AsyncEngine.__new__(AsyncEngine)  # __init__ loads a model and builds the GPU engine
    ae.engine, ae.backend = engine, "pytorch"
    ae.backend_config = PytorchEngineConfig(tp=TP_SIZE, device_type="cuda")
    ae.is_sleeping, ae.sleeping_tags, ae.epoch, ae.session_mgr = False, set(), 0, SessionManager()
    ctx = ServerContext()
    ctx.async_engine = ae

    app = FastAPI()
    router = create_openai_router(ctx)
    app.include_router(router)
    app.add_exception_handler(RequestValidationError, validation_exception_handler)
    app.add_middleware(EngineSleepingMiddleware, is_sleeping=lambda: ctx.async_engine.is_sleeping)
    wire = Wire(app)

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(wire, log_level="error", lifespan="off", loop="asyncio",
                                           http="h11", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)

    def stop():
        server.should_exit = True
        thread.join(10)
        sock.close()

    return f"http://127.0.0.1:{port}", ctx, engine, wire, router, stop


def route_table(router) -> dict[tuple[str, str], type | None]:
    """``(METHOD, path) -> the pydantic class the route reads its body into`` (None: no body), from the
    routes LMDeploy's ``create_openai_router`` registered (the endpoints' resolved type hints)."""
    from fastapi.routing import APIRoute
    from pydantic import BaseModel

    table = {}
    for r in router.routes:
        if not isinstance(r, APIRoute):
            continue
        try:
            hints = typing.get_type_hints(r.endpoint)
        except Exception:  # noqa: BLE001 -- routes this check does not use
            hints = {}
        body = next((t for n, t in hints.items() if n != "return" and isinstance(t, type)
                     and issubclass(t, BaseModel)), None)
        for m in r.methods:
            table[(m, r.path)] = body
    return table


def capture_requests(url, ctx, engine, wire, dense, mixed, ipc_payloads):
    from weightstream.engines.base import EngineError, GroupSpec
    from weightstream.engines.lmdeploy import LMDeployEngine

    class Recording(LMDeployEngine):
        """The adapter as it is; ``request`` records, then sends (HTTPEngine's real request)."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.sent: list[dict] = []
            self._call = None

        def request(self, method, path, body=None, *, step=None, timeout_s=None):
            rec = {"call": self._call, "method": method, "path": path,
                   "json": None if body is None else json.dumps(body), "step": step,
                   "wire_index": len(wire.log), "engine_index": len(engine.calls)}
            self.sent.append(rec)
            try:
                reply = super().request(method, path, body, step=step, timeout_s=timeout_s)
                rec["reply"] = reply
                return reply
            except EngineError as exc:
                rec["raised"] = exc.detail
                raise
            finally:
                rec["engine_calls"] = engine.calls[rec.pop("engine_index"):]
                rec["wire"] = wire.log[rec.pop("wire_index"):]

    eng = Recording(url, timeout_s=20.0, group_name=GROUP)
    fresh = Recording(url, timeout_s=20.0, group_name=GROUP)
    fresh.sent = eng.sent
    spec = GroupSpec(master_address="10.0.0.1", master_port=29511, rank_offset=1, world_size=1 + TP_SIZE,
                     backend="nccl", timeout_s=120.0, group_name=GROUP)
    ae = ctx.async_engine
    events: list[dict] = []

    def abort_on(flag):
        ctx.enable_abort_handling = flag

    calls = [
        ("info(refresh=True)", lambda: eng.info(refresh=True)),
        ("pause() [--enable-abort-handling]", lambda: (abort_on(True), eng.pause())),
        ("pause() [no abort handling: 501]", lambda: (abort_on(False), eng.pause())),
        ("release_memory()", lambda: eng.release_memory()),
        ("is_sleeping() [after sleep]", lambda: eng.is_sleeping()),
        ("resume_memory(['weights'])", lambda: eng.resume_memory(["weights"])),
        ("resume_memory(['kv_cache','cuda_graph'])", lambda: eng.resume_memory(["kv_cache", "cuda_graph"])),
        ("is_sleeping() [awake]", lambda: eng.is_sleeping()),
        ("release_memory(['kv_cache'])", lambda: eng.release_memory(["kv_cache"])),
        ("resume_memory(['kv_cache','cuda_graph']) [after level 1]",
         lambda: eng.resume_memory(["kv_cache", "cuda_graph"])),
        ("join_group", lambda: eng.join_group(spec)),
        ("begin_update('v1')", lambda: eng.begin_update("v1")),
        ("receive_broadcast", lambda: eng.receive_broadcast(dense, None)),
        ("commit_update [broadcast]", lambda: eng.commit_update()),
        ("begin_update('v2')", lambda: eng.begin_update("v2")),
        ("receive_ipc", lambda: eng.receive_ipc(0, ipc_payloads, None)),
        ("commit_update [ipc]", lambda: eng.commit_update()),
        ("begin_update('v3')", lambda: eng.begin_update("v3")),
        ("receive_broadcast [v3]", lambda: eng.receive_broadcast(dense, None)),
        ("abort_update", lambda: eng.abort_update(timeout_s=10.0)),
        ("abort_update [no session]", lambda: eng.abort_update()),
        ("begin_update('v4') + mixed-dtype receive_broadcast", lambda: eng.begin_update("v4")),
        ("receive_broadcast [mixed dtypes]", lambda: eng.receive_broadcast(mixed, None)),
        ("abort_update [after the refused bucket]", lambda: eng.abort_update()),
        ("leave_group", lambda: eng.leave_group()),
        ("resume", lambda: eng.resume()),
        # for information: LMDeploy answers 200 to waking what is awake, and does nothing
        ("resume_memory(['weights']) [awake, fresh adapter]", lambda: fresh.resume_memory(["weights"])),
    ]
    for label, fn in calls:
        eng._call = fresh._call = label
        before = len(eng.sent)
        ev = {"call": label, "requests": None, "raised": None, "result": None,
              "sleeping_tags_before": sorted(ae.sleeping_tags), "abort_epoch_before": ae.epoch}
        try:
            out = fn()
            if label.startswith("is_sleeping"):
                ev["result"] = out
            if label.startswith("info"):
                ev["result"] = {"engine": out.engine, "tp_size": out.tp_size, "pp_size": out.pp_size,
                                "ep_size": out.ep_size, "dp_size": out.dp_size,
                                "capabilities": sorted(out.capabilities)}
        except EngineError as exc:
            ev["raised"] = {"type": type(exc).__name__, "step": exc.step, "detail": exc.detail}
        ev["requests"] = len(eng.sent) - before
        ev["sleeping_tags_after"] = sorted(ae.sleeping_tags)
        ev["is_sleeping_after"] = ae.is_sleeping
        ev["abort_epoch_after"] = ae.epoch  # AsyncEngine.stop_all_session counts its aborts
        ev["engine_calls"] = [[n, type(o).__name__ if not isinstance(o, (int, list, type(None))) else o]
                              for s in eng.sent[before:] for n, o in s["engine_calls"]]
        events.append(ev)
    return eng, events


def decode_one(sent: dict, routes) -> dict:
    """What LMDeploy's route did with one request."""
    from pydantic import BaseModel

    wire = sent["wire"]
    w = wire[0] if len(wire) == 1 else None
    out = {"call": sent["call"], "method": sent["method"], "path": sent["path"],
           "http_requests": len(wire), "status": w and w["status"],
           "content_type": w and w["content_type"], "query": w and w["query"],
           "reply_text": w and w["reply"].decode(errors="replace")[:300], "raised": sent.get("raised")}
    key = (sent["method"], w["path"] if w else sent["path"].split("?")[0])
    out["route_exists"] = key in routes
    cls = routes.get(key)
    out["request_class"] = cls.__name__ if cls else None
    body = json.loads(sent["json"]) if sent["json"] is not None else None
    objs = [o for _, o in sent["engine_calls"] if isinstance(o, BaseModel)]
    out["engine_calls"] = [[n, type(o).__name__ if isinstance(o, BaseModel) else o]
                           for n, o in sent["engine_calls"]]
    out["unknown_fields"], out["missing_required"], out["mismatched_values"] = [], [], []
    if cls is None:
        out["unknown_fields"] = sorted(body or {})  # a body the route does not read
        out["decoded"] = out["route_exists"]
        return out
    fields = cls.model_fields
    out["unknown_fields"] = sorted(set(body) - set(fields))
    out["missing_required"] = sorted(n for n, f in fields.items() if f.is_required() and n not in body)
    if objs:  # the object the route built and handed to the engine
        obj = objs[0]
        out["built_by"] = "route (received by the engine)"
    else:  # the route consumed it itself (/abort_request), or refused it: validate as FastAPI does
        try:
            obj = cls.model_validate_json(sent["json"])
        except Exception as exc:  # noqa: BLE001 -- reported, the test fails on it
            out.update(decoded=False, error=f"{type(exc).__name__}: {exc}"[:1000])
            return out
        out["built_by"] = "validated with the route's class"
    status = w["status"] if w else None
    # 501 from /abort_request: the body was read (FastAPI validates it before the route answers 501)
    out["decoded"] = isinstance(obj, cls) and status is not None and (
        status < 400 or (sent["path"] == "/abort_request" and status == 501))
    out["built_class"] = type(obj).__name__
    for name, value in body.items():
        if name in fields and getattr(obj, name) != value:
            out["mismatched_values"].append({"field": name, "sent": repr(value)[:200],
                                             "decoded": repr(getattr(obj, name))[:200]})
    out["decoded_fields"] = {n: repr(getattr(obj, n))[:100] for n in fields if n != "serialized_named_tensors"}
    return out


# --------------------------------------------------------------------------------------- b: broadcast

def check_broadcast(bucket, named, bucket_req, finished_req) -> dict:
    from lmdeploy.pytorch.engine.model_agent.agent import BaseModelAgent
    from lmdeploy.utils import FlattenedTensorBucket

    res: dict = {"request_class": type(bucket_req).__name__, "load_format": bucket_req.load_format,
                 "finished_flags": [bucket_req.finished, finished_req.finished]}
    # LMDeploy's receive layout for these names/dtypes/shapes (element offsets) against ours (bytes).
    empties = [(n, torch.empty(s, dtype=getattr(torch, d)))
               for n, d, s in zip(bucket_req.names, bucket_req.dtypes, bucket_req.shapes, strict=True)]
    theirs = FlattenedTensorBucket(named_tensors=empties)
    size = theirs.get_flattened_tensor().element_size()
    res["lmdeploy_layout_bytes"] = [(m.name, m.start_idx * size, m.end_idx * size) for m in theirs.get_metadata()]
    res["our_layout_bytes"] = [(m.name, m.offset, m.offset + m.nbytes) for m in bucket.metas]
    res["layout_equal"] = res["lmdeploy_layout_bytes"] == res["our_layout_bytes"]

    broadcasts: list[dict] = []

    def fake_broadcast(tensor, src=0, group=None, async_op=False):
        nbytes = tensor.numel() * tensor.element_size()
        broadcasts.append({"lmdeploy_nbytes": nbytes, "our_nbytes": bucket.nbytes, "dtype": str(tensor.dtype),
                           "src": src})
        if nbytes != bucket.nbytes:
            raise RuntimeError(f"broadcast size mismatch: LMDeploy receives {nbytes} bytes, we send {bucket.nbytes}")
        if {tensor.dtype} != {m.dtype for m in bucket.metas}:
            raise RuntimeError(f"broadcast dtype mismatch: LMDeploy receives {tensor.dtype}, we send "
                               f"{sorted(str(m.dtype) for m in bucket.metas)}")
        tensor.view(torch.uint8).copy_(bucket.buffer)

    model = RecordingModel()
    agent = fake_agent(model, groups=[GROUP])
    steps = []
    try:
        with cpu_cuda(), patched(torch.distributed, broadcast=fake_broadcast):
            for label, req in (("bucket", bucket_req), ("finished", finished_req)):
                before_loaded, before_passes = len(model.loaded), model.post_load_passes
                ok, msg = BaseModelAgent.update_weights_from_distributed(agent, req)
                steps.append({"request": label, "success": bool(ok), "message": msg,
                              "loaded": len(model.loaded) - before_loaded,
                              "post_load_passes": model.post_load_passes - before_passes})
        res["error"] = None
    except Exception as exc:  # noqa: BLE001 -- reported, the test fails on it
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()[-1500:]
    res["steps"] = steps
    res["broadcasts"] = broadcasts
    res["nbytes_equal"] = bool(broadcasts) and all(b["lmdeploy_nbytes"] == b["our_nbytes"] for b in broadcasts)
    got = model.loaded
    res["received_names"] = [n for n, _ in got]
    res["received_dtypes"] = [str(t.dtype) for _, t in got]
    res["received_shapes"] = [list(t.shape) for _, t in got]
    res["tensors_equal"] = (len(got) == len(named) and all(
        n == n2 and same_bits(t, t2) for (n, t), (n2, t2) in zip(named, got, strict=True)))
    res["finished_loads_nothing_and_finalizes"] = (
        len(steps) == 2 and steps[0]["success"] and steps[0]["post_load_passes"] == 0
        and steps[1]["success"] and steps[1]["loaded"] == 0 and steps[1]["post_load_passes"] == 1
        and len(broadcasts) == 1)
    return res


# --------------------------------------------------------------------------------------- c: IPC (child side)

def lmdeploy_update_params():
    """LMDeploy's ``BaseModelAgent.update_params``, compiled from its installed source in its module's namespace,
    with the one statement that cannot run on a CPU removed (see the module docstring)."""
    import importlib
    import importlib.util

    mod = importlib.import_module(AGENT_MODULE)
    origin = importlib.util.find_spec(AGENT_MODULE).origin
    tree = ast.parse(Path(origin).read_text())
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BaseModelAgent")
    fn = next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == "update_params")
    removed = []

    class DropDeviceOverride(ast.NodeTransformer):
        def visit_Assign(self, node):
            t = node.targets[0]
            if (len(node.targets) == 1 and isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)
                    and t.value.id == "args" and isinstance(t.slice, ast.Constant) and t.slice.value == 6):
                removed.append(ast.unparse(node))
                return ast.Pass()
            return node

    fn = DropDeviceOverride().visit(fn)
    if removed != ["args[6] = torch.cuda.current_device()"]:
        raise RuntimeError(f"LMDeploy's update_params changed: removed {removed}")
    module = ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[]))
    glb = dict(vars(mod))
    exec(compile(module, origin, "exec"), glb)  # LMDeploy's installed source, the point
    return glb["update_params"], removed


def ipc_child(bodies_path: str, expected_path: str) -> None:
    """Another process: what LMDeploy's server does with the /update_weights bodies, rank by rank."""
    from multiprocessing.reduction import ForkingPickler

    import pybase64
    from lmdeploy.serve.openai.protocol import UpdateParamsRequest
    from lmdeploy.utils import FlattenedTensorMetadata

    bodies = json.loads(Path(bodies_path).read_text())  # [bucket body JSON, finished body JSON]
    expected = torch.load(expected_path)  # {rank: [(name, tensor)]}
    out: dict = {"pid": os.getpid(), "ranks": []}
    try:
        update_params, removed = lmdeploy_update_params()
        out["removed_statements"] = removed
        reqs = [UpdateParamsRequest.model_validate_json(b) for b in bodies]
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()[-1500:]
        print(json.dumps(out))
        return
    bucket_req, finished_req = reqs
    out["load_format"] = [r.load_format for r in reqs]
    out["finished"] = [r.finished for r in reqs]
    out["n_payloads"] = len(bucket_req.serialized_named_tensors) if isinstance(
        bucket_req.serialized_named_tensors, list) else None
    # The payload's form against LMDeploy's own FlattenedTensorMetadata (attributes its reconstruct reads).
    first = ForkingPickler.loads(pybase64.b64decode(bucket_req.serialized_named_tensors[0]))
    out["payload_keys"] = sorted(first)
    out["metadata_attributes"] = sorted(vars(first["metadata"][0]))
    out["lmdeploy_metadata_fields"] = sorted(FlattenedTensorMetadata.__dataclass_fields__)
    del first
    finished_payload = ForkingPickler.loads(pybase64.b64decode(finished_req.serialized_named_tensors))
    out["finished_payload"] = {k: (v if not isinstance(v, list) else f"list[{len(v)}]")
                               for k, v in finished_payload.items()}
    for rank, want in expected.items():
        r: dict = {"rank": rank}
        try:
            model = RecordingModel()
            agent = fake_agent(model, tp_rank=rank)
            with cpu_cuda():
                update_params(agent, bucket_req)
                r["cached_ipc_tensor_after_bucket"] = agent._update_params_ipc_tensor is not None
                r["loaded_by_bucket"] = len(model.loaded)
                r["post_load_passes_after_bucket"] = model.post_load_passes
                update_params(agent, finished_req)
            r["loaded_by_finished"] = len(model.loaded) - r["loaded_by_bucket"]
            r["post_load_passes_after_finished"] = model.post_load_passes
            r["cached_ipc_tensor_after_finished"] = agent._update_params_ipc_tensor is not None
            got = model.loaded
            r["names"] = [n for n, _ in got]
            r["dtypes"] = [str(t.dtype) for _, t in got]
            r["shapes"] = [list(t.shape) for _, t in got]
            r["names_equal"] = r["names"] == [n for n, _ in want]
            r["dtypes_equal"] = [t.dtype for _, t in got] == [t.dtype for _, t in want]
            r["shapes_equal"] = [tuple(t.shape) for _, t in got] == [tuple(t.shape) for _, t in want]
            r["tensors_equal"] = len(got) == len(want) and all(same_bits(a, b)
                                                              for (_, a), (_, b) in zip(got, want, strict=True))
            r["finished_semantics"] = (r["cached_ipc_tensor_after_bucket"] and r["post_load_passes_after_bucket"] == 0
                                       and r["loaded_by_finished"] == 0 and r["post_load_passes_after_finished"] == 1
                                       and not r["cached_ipc_tensor_after_finished"])
            r["error"] = None
        except Exception as exc:  # noqa: BLE001
            r.update(tensors_equal=False, error=f"{type(exc).__name__}: {exc}",
                     traceback=traceback.format_exc()[-1500:])
        out["ranks"].append(r)
    print(json.dumps(out))


def check_ipc(bucket_json: str, finished_json: str, expected: dict) -> dict:
    body = json.loads(bucket_json)
    res, child = ipc_in_child(__file__, body["serialized_named_tensors"], TP_SIZE,
                              json.dumps([bucket_json, finished_json]), expected)
    if child is not None:
        ranks = child.get("ranks", [])
        res["ok"] = (res["ok"] and not child.get("error") and child.get("n_payloads") == TP_SIZE
                     and len(ranks) == TP_SIZE
                     and all(r.get("error") is None and r.get("tensors_equal") and r.get("names_equal")
                             and r.get("dtypes_equal") and r.get("shapes_equal") and r.get("finished_semantics")
                             for r in ranks))
    return res


# --------------------------------------------------------------------------------------- d: single dtype

def check_guard(url, mixed) -> dict:
    """A mixed-dtype bucket: refused before anything is sent (the engine behind url would get it)."""
    from weightstream.engines.base import EngineError
    from weightstream.engines.lmdeploy import LMDeployEngine

    class Counting(LMDeployEngine):
        sent = 0

        def request(self, *a, **kw):
            Counting.sent += 1
            return super().request(*a, **kw)

    eng = Counting(url, timeout_s=5.0, group_name=GROUP)
    res: dict = {"bucket_dtypes": sorted({str(m.dtype).removeprefix("torch.") for m in mixed.metas})}
    for label, fn in (("encode_ipc", lambda: LMDeployEngine.encode_ipc(eng, mixed)),
                      ("receive_broadcast", lambda: eng.receive_broadcast(mixed, None)),
                      ("receive_ipc(encode_ipc(...))", lambda: eng.receive_ipc(0, [eng.encode_ipc(mixed)], None))):
        before = Counting.sent
        try:
            fn()
            res[label] = {"raised": None, "sent": Counting.sent - before}
        except EngineError as exc:
            res[label] = {"raised": "EngineError", "message": str(exc), "sent": Counting.sent - before,
                          "names_dtypes": all(d in str(exc) for d in res["bucket_dtypes"])}
        except Exception as exc:  # noqa: BLE001
            res[label] = {"raised": type(exc).__name__, "message": str(exc), "sent": Counting.sent - before}
    res["ok"] = all(res[k]["raised"] == "EngineError" and res[k]["sent"] == 0 and res[k]["names_dtypes"]
                    for k in ("encode_ipc", "receive_broadcast", "receive_ipc(encode_ipc(...))"))
    return res


# --------------------------------------------------------------------------------------- main

def main() -> None:
    t0 = time.monotonic()
    torch.multiprocessing.set_sharing_strategy("file_system")  # CPU tensors readable by an unrelated process
    import lmdeploy

    from weightstream.common.layout import ALIGN
    from weightstream.engines.lmdeploy import ipc_payload
    from weightstream.streaming.bucket import Bucket

    result: dict = {"lmdeploy_version": getattr(lmdeploy, "__version__", None), "torch_version": torch.__version__}
    named = original_tensors(0)
    dense = Bucket.pack(named, index=0, align=1)  # broadcast buckets are dense (update.py)
    ipc_named = {rank: original_tensors(rank + 1) for rank in range(TP_SIZE)}  # each TP rank its own bucket
    ipc_buckets = {rank: Bucket.pack(t, index=1) for rank, t in ipc_named.items()}  # ALIGN-padded
    result["ipc_bucket_align"] = ALIGN
    result["ipc_bucket_padded"] = any(b.nbytes > sum(m.nbytes for m in b.metas) for b in ipc_buckets.values())
    payloads = [ipc_payload(ipc_buckets[r]) for r in range(TP_SIZE)]
    mixed = Bucket.pack([("a.weight", torch.randn(4)), ("b.weight", torch.randn(3).to(torch.bfloat16))],
                        index=7, align=1)

    url, ctx, engine, wire, router, stop = lmdeploy_server()
    try:
        routes = route_table(router)
        eng, events = capture_requests(url, ctx, engine, wire, dense, mixed, payloads)
        result["guard"] = check_guard(url, mixed)
    finally:
        stop()
    result["t_server_s"] = round(time.monotonic() - t0, 2)
    decoded = [decode_one(s, routes) for s in eng.sent]
    result["requests"] = decoded
    result["events"] = events
    result["unknown_fields"] = sorted({f for d in decoded for f in d["unknown_fields"]})
    result["all_routes_exist"] = all(d["route_exists"] for d in decoded)
    result["all_decoded"] = all(d["decoded"] for d in decoded)
    result["all_json_content_type"] = all(d["content_type"] == "application/json" for d in decoded)
    result["missing_required"] = {d["call"]: d["missing_required"] for d in decoded if d["missing_required"]}
    result["mismatched_values"] = {d["call"]: d["mismatched_values"] for d in decoded if d["mismatched_values"]}
    result["routes_sent"] = sorted({f'{d["method"]} {d["path"].split("?")[0]}' for d in decoded})
    result["statuses"] = {f'{d["call"]} -> {d["method"]} {d["path"]}': d["status"] for d in decoded}

    def objs(path):
        return [o for s in eng.sent if s["path"] == path for n, o in s["engine_calls"]]

    dist = objs("/update_weights_from_distributed")
    result["broadcast"] = check_broadcast(dense, named, dist[0], dist[1])
    padded = Bucket.pack(named, align=ALIGN)  # for information: the IPC layout would not fit the receiver
    result["broadcast"]["padded_bucket_nbytes"] = int(padded.nbytes)
    ipc_sent = [s for s in eng.sent if s["path"] == "/update_weights"]
    result["ipc"] = check_ipc(ipc_sent[0]["json"], ipc_sent[1]["json"], ipc_named)
    result["ok"] = bool(
        result["all_routes_exist"] and result["all_decoded"] and result["all_json_content_type"]
        and not result["missing_required"] and not result["unknown_fields"] and not result["mismatched_values"]
        and result["broadcast"]["error"] is None and result["broadcast"]["layout_equal"]
        and result["broadcast"]["nbytes_equal"] and result["broadcast"]["tensors_equal"]
        and result["broadcast"]["finished_loads_nothing_and_finalizes"] and result["ipc"]["ok"]
        and result["guard"]["ok"])
    result["t_total_s"] = round(time.monotonic() - t0, 2)
    print(json.dumps(result, default=repr))
    del ipc_buckets, payloads  # the shared-memory buffers live until the child has read them


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--ipc-child":
        ipc_child(sys.argv[2], sys.argv[3])
    else:
        main()
