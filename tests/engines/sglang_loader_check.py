"""weightstream's custom weight loader inside SGLang's own code (run by a python that has sglang installed).

    WEIGHTSTREAM_SGLANG_PYTHON tests/engines/sglang_loader_check.py   ->  one JSON object on stdout

Run by tests/test_sglang_loader.py, not collected by pytest. This process is the trainer: an
:class:`SGLangEngine` made with ``custom_loader=LOADER``, its HTTP requests handed (as the JSON text it would
send) to one process per TP rank, each standing for that rank's scheduler. A rank process decodes the body with
SGLang's request class (pydantic's ``TypeAdapter``, as SGLang's HTTP server does), deserializes its own payload
with SGLang's ``BaseTpWorker.deserialize_own_rank`` (compiled from its source; its ``SafeUnpickler``), and calls
SGLang's ``WeightUpdater.update_weights_from_tensor`` (its ``custom_weight_loaders`` gate and ``dynamic_import``)
for two model runners, a target and a draft. Each runner's model is a small transformers Llama whose
``load_weights`` puts every tensor in with SGLang's ``default_weight_loader``; it holds bf16, float32, int8 and a
float8 weight with its float32 scales. Every round's weights are random bytes (NaN and infinity patterns too),
compared bit for bit with what the rank processes hold. Checks: ``--custom-weight-loader`` parsed by SGLang's
``ServerArgs``; a plain round, a delta round (dense, then sparse) with each rank's delta state (the base it holds,
the checksums of the bytes it applied) and commit read through the loader, a corrupted buffer on one rank, a delta
without held bytes and a malformed header, each reported by the ranks (the trainer's error names them) while
the rank processes go on; a ``load_format`` the server does not list refused by SGLang; an adapter refusing a
server started without the loader before it sends anything. Then ``WeightSync(transport="ipc", delta=True)`` from
two trainer ranks (this process and one more, a gloo group; trainer rank r colocated with engine rank r), one request
per bucket: a full update, a dense and a sparse delta, bit for bit and checked; and another trainer committing this
one's last version name, so the ranks name the expected base but hold other bytes: in another bucket plan every
rank refuses the delta, in the same plan the check catches it and the update goes again in full.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace

warnings.filterwarnings("ignore")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))  # torchvision_standin, common, sglang_check
sys.path.insert(0, str(ROOT))  # weightstream from this checkout

import torch  # noqa: E402
import torchvision_standin  # noqa: E402,F401  (before anything imports sglang.srt.managers.io_struct)
from common import same_bits  # noqa: E402

TP_SIZE = 2
MARK = "@@weightstream@@"  # the rank processes' answers, among whatever else they print
RUNNERS = ("target", "draft")


# --------------------------------------------------------------------------------------- the model (both sides)

def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)


def llama(cls, seed: int) -> torch.nn.Module:
    """A one-layer Llama of ``cls`` in bf16, its norms float32."""
    torch.manual_seed(seed)
    model = cls(llama_config()).to(torch.bfloat16)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data = p.data.float()
    return model


def make_model() -> torch.nn.Module:
    """A one-layer Llama in bf16 (norms float32) plus an int8 table and a float8 weight with float32 scales."""
    from sglang.srt.model_loader.weight_utils import default_weight_loader
    from transformers import LlamaForCausalLM

    class CheckModel(LlamaForCausalLM):
        def load_weights(self, weights):
            params = dict(self.named_parameters())
            for name, tensor in weights:
                default_weight_loader(params[name], tensor)

    model = llama(CheckModel, 0)
    fp8 = torch.nn.Module()
    fp8.weight = torch.nn.Parameter(torch.zeros(64, 32, dtype=torch.float8_e4m3fn), requires_grad=False)
    fp8.weight_scale_inv = torch.nn.Parameter(torch.ones(2, 2), requires_grad=False)
    model.model.layers[0].mlp.fp8_proj = fp8
    model.model.int8_table = torch.nn.Parameter(torch.zeros(5, 3, dtype=torch.int8), requires_grad=False)
    return model


def layout() -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return [(n, p.dtype, tuple(p.shape)) for n, p in make_model().named_parameters()]


def random_weights(spec, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Random bytes for every tensor (any bit pattern: NaN payloads, infinities)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, dtype, shape in spec:
        n = int(torch.Size(shape).numel()) * dtype.itemsize
        out.append((name, torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).view(dtype).view(shape)))
    return out


# --------------------------------------------------------------------------------------- a rank's process

def rank_process(rank: int) -> None:
    """One TP rank's scheduler: requests in on stdin (a file holding the JSON body), answers out on stdout."""
    import sglang.srt.managers.io_struct as io
    from pydantic import TypeAdapter
    from sglang.srt.model_executor.model_runner_components import weight_updater as wu
    from sglang_check import sglang_function

    from weightstream.engines.sglang_inside import LOADER

    wu.get_parallel = lambda: SimpleNamespace(tp_rank=rank)  # runtime_context is published by a server only
    wu.get_model = lambda: SimpleNamespace(weight_cache_mode="off")
    deserialize_own_rank = sglang_function("sglang.srt.managers.tp_worker", "BaseTpWorker", "deserialize_own_rank",
                                           get_parallel=lambda: SimpleNamespace(tp_rank=rank))
    models = {r: make_model() for r in RUNNERS}
    runners = {r: SimpleNamespace(get_model=lambda m=m: m, custom_weight_loaders=[LOADER], device="cpu",
                                  _assert_weight_cache_inactive=lambda op: None) for r, m in models.items()}
    print(MARK + json.dumps({"pid": os.getpid(), "ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "dump":
            torch.save({r: dict(m.named_parameters()) for r, m in models.items()}, cmd["path"])
            answer: dict = {"dumped": True}
        else:
            answer = _update(Path(cmd["body"]).read_text(), io, TypeAdapter, wu, deserialize_own_rank, runners)
        print(MARK + json.dumps(answer), flush=True)


def _update(body_json, io, type_adapter, wu, deserialize_own_rank, runners) -> dict:
    """What SGLang does with one /update_weights_from_tensor body on this rank, for each runner."""
    import msgspec

    fields = {f.name for f in msgspec.structs.fields(io.UpdateWeightsFromTensorReqInput)}
    out: dict = {"unknown_fields": sorted(set(json.loads(body_json)) - fields), "raised": None}
    try:
        req = type_adapter(io.UpdateWeightsFromTensorReqInput).validate_json(body_json)
        out["load_format"] = req.load_format
        named = deserialize_own_rank(None, req.serialized_named_tensors)
        out["names"] = [n[:60] for n, _ in named]
        out["answers"] = [list(wu.WeightUpdater.update_weights_from_tensor(runner, named_tensors=named,
                                                                           load_format=req.load_format))
                          for runner in runners.values()]
    except Exception as exc:  # noqa: BLE001 -- in SGLang this would end the scheduler: reported
        out["raised"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()[-1500:]
    return out


# --------------------------------------------------------------------------------------- the trainer's side

class Ranks:
    """The TP rank processes, each answering one request at a time."""

    def __init__(self, tmp: str):
        self.logs = [os.path.join(tmp, f"rank{r}.log") for r in range(TP_SIZE)]
        self.procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=open(self.logs[r], "w"), text=True)
                      for r in range(TP_SIZE)]
        self.ready = [self.answer(p) for p in self.procs]

    @staticmethod
    def answer(proc) -> dict:
        for line in proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise RuntimeError("a rank process ended")

    def ask(self, cmd: dict) -> list[dict]:
        for p in self.procs:
            p.stdin.write(json.dumps(cmd) + "\n")
            p.stdin.flush()
        return [self.answer(p) for p in self.procs]

    def dump(self, tmp: str) -> list[dict]:
        paths = [os.path.join(tmp, f"dump{r}.pt") for r in range(TP_SIZE)]
        for r, p in enumerate(self.procs):
            p.stdin.write(json.dumps({"cmd": "dump", "path": paths[r]}) + "\n")
            p.stdin.flush()
        for p in self.procs:
            self.answer(p)
        return [torch.load(path) for path in paths]

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()
            p.wait(timeout=60)


def harness(ranks: Ranks, tmp: str, server_info: dict):
    """An SGLangEngine whose requests go to the rank processes (as the JSON text it would send)."""
    from weightstream.engines.sglang import SGLangEngine

    class Harness(SGLangEngine):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.sent: list[dict] = []
            self.answers: list[list[dict]] = []

        def request(self, method, path, body=None, *, step=None, timeout_s=None):
            text = None if body is None else json.dumps(body)
            self.sent.append({"method": method, "path": path, "load_format": (body or {}).get("load_format")})
            if path == "/get_server_info":
                return server_info
            if path == "/model_info":
                return {"weight_version": self._version}
            if path != "/update_weights_from_tensor":
                return {}
            body_path = os.path.join(tmp, "body.json")
            Path(body_path).write_text(text)
            self.answers.append(ranks.ask({"cmd": "update", "body": body_path}))
            return {"success": True, "message": "Success"}  # SGLang's answer whatever the loader did

    return Harness("http://sglang.check", custom_loader=server_info["loader"], timeout_s=20.0)


def buckets(named, rank_count: int = TP_SIZE):
    """Two buckets of ``named``, packed once per trainer rank (each rank its own buffers)."""
    from weightstream.streaming.bucket import Bucket

    half = len(named) // 2
    return [[Bucket.pack(part, index=i) for i, part in enumerate((named[:half], named[half:]))]
            for _ in range(rank_count)]


def send(engine, per_rank) -> str | None:
    """Each bucket through ``receive_ipc``, each rank's payload made by ``encode_ipc``; the error, if any."""
    try:
        for i in range(len(per_rank[0])):
            engine.receive_ipc(i, [engine.encode_ipc(per_rank[r][i]) for r in range(TP_SIZE)], None)
    except Exception as exc:  # noqa: BLE001 -- the check reports it
        return str(exc)
    return None


def held_equal(dumps, want, ranks=range(TP_SIZE)) -> dict:
    """Whether each rank's target and draft hold ``want`` bit for bit."""
    return {f"{rank}/{runner}": all(same_bits(dumps[rank][runner][n], t) for n, t in want)
            for rank in ranks for runner in RUNNERS}


def delta_buckets(new, held, allowed=None):
    """``new``'s buckets as deltas against ``held`` (the same layout): dense where ``allowed`` says so."""
    from weightstream.streaming.bucket import Bucket
    from weightstream.streaming.delta import ENCODINGS, encode

    out = []
    for rank_new, rank_held in zip(new, held, strict=True):
        row = []
        for b, h in zip(rank_new, rank_held, strict=True):
            header, payload = encode(b.buffer, h.buffer, b.word, allowed or ENCODINGS)
            row.append(Bucket(b.index, payload.clone(), b.metas, delta=header))
        out.append(row)
    return out


def checks_match(engine, per_rank) -> bool:
    """Whether every rank's checksum of every bucket's bytes it applied (``delta_checks``) is the trainer's."""
    from weightstream.wire.handles import checksum

    want = {b.index: tuple(checksum(per_rank[r][k].buffer) for r in range(TP_SIZE)) for k, b in enumerate(per_rank[0])}
    return engine.delta_checks().buckets == want


def server_args() -> dict:
    """``--custom-weight-loader`` as SGLang's own argument parser reads it."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from weightstream.engines.sglang_inside import LOADER

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "m", "--custom-weight-loader", LOADER])
    return {"parsed": args.custom_weight_loader, "loader": LOADER}


def rounds(engine, ranks: Ranks, tmp: str, spec) -> dict:
    """Plain, dense-delta and sparse-delta rounds; a corrupted buffer; a delta without held bytes."""
    res: dict = {}
    w1, w2 = random_weights(spec, 1), random_weights(spec, 2)
    engine.begin_update("v1")
    res["plain_error"] = send(engine, buckets(w1))
    engine.commit_update()
    res["plain_equal"] = held_equal(ranks.dump(tmp), w1)
    engine.begin_update("v2")
    res["dense_base"] = engine.delta_base()  # a plain round leaves none
    full2 = buckets(w2)
    zeros = [[type(b)(b.index, torch.zeros_like(b.buffer), b.metas) for b in row] for row in full2]
    res["dense_error"] = send(engine, delta_buckets(full2, zeros, ("dense",)))
    res["dense_checks"] = checks_match(engine, full2)
    engine.commit_update()
    res["dense_equal"] = held_equal(ranks.dump(tmp), w2)
    w3 = [(n, t.clone()) for n, t in w2]
    for _, t in w3[::3]:
        t.view(-1).view(torch.uint8)[:5] ^= 0x5A  # a few bytes of some tensors change
    engine.begin_update("v3")
    res["sparse_base"] = engine.delta_base()  # the ranks' instances and v2
    sparse = delta_buckets(full3 := buckets(w3), full2)
    res["sparse_encodings"] = sorted({b.delta.encoding for b in sparse[0]})
    res["sparse_error"] = send(engine, sparse)
    res["sparse_checks"] = checks_match(engine, full3)
    engine.commit_update()
    res["sparse_equal"] = held_equal(ranks.dump(tmp), w3)
    res.update(corrupted(engine, ranks, tmp, spec, w3))
    return res


def corrupted(engine, ranks: Ranks, tmp: str, spec, before) -> dict:
    """Rank 1's buffer changes after its checksum was taken; then a delta no rank holds bytes for."""
    res: dict = {}
    w4 = random_weights(spec, 4)
    per_rank = buckets(w4)
    engine.begin_update("v4")
    payloads = [engine.encode_ipc(per_rank[r][0]) for r in range(TP_SIZE)]
    per_rank[1][0].buffer[0] ^= 0xFF  # shared with rank 1's process: its bytes are no longer those summed
    try:
        engine.receive_ipc(0, payloads, None)
        res["corrupt_error"] = None
    except Exception as exc:  # noqa: BLE001
        res["corrupt_error"] = str(exc)
    engine.abort_update()
    first = [n for n, _ in w4][: len(per_rank[0][0].metas)]
    dumps = ranks.dump(tmp)
    res["corrupt_rank0_loaded"] = held_equal(dumps, [(n, t) for n, t in w4 if n in first], [0])
    res["corrupt_rank1_unchanged"] = held_equal(dumps, [(n, t) for n, t in before if n in first], [1])
    engine.begin_update("v5")
    w5 = [(n, t.clone()) for n, t in w4]
    w5[0][1].view(-1).view(torch.uint8)[:2] ^= 0x11
    res["unheld_error"] = send(engine, delta_buckets(buckets(w5), per_rank))
    engine.abort_update()
    after = ranks.dump(tmp)
    res["unheld_unchanged"] = all(same_bits(after[r][m][n], dumps[r][m][n]) for r in range(TP_SIZE)
                                  for m in RUNNERS for n in dumps[r][m])
    res["ranks_alive"] = all(p.poll() is None for p in ranks.procs)
    return res


def refusals(engine, ranks: Ranks, tmp: str, server_info: dict) -> dict:
    """A malformed header (every problem named), a load_format SGLang does not list, a server without the
    loader."""
    from weightstream.engines.sglang_inside import PREFIX
    from weightstream.wire.handles import dumps_b64

    res: dict = {}
    bad = PREFIX + json.dumps({"op": "load", "op_id": "x", "index": 3, "names": ["a", "b"], "dtypes": ["float99"],
                               "shapes": [[2]], "offsets": [0], "nbytes": 4, "checksum": None, "delta": None})
    engine.begin_update("v6")
    buffer = torch.zeros(4, dtype=torch.uint8)  # alive until the ranks have read it
    try:
        engine.receive_ipc(3, [dumps_b64([(bad, buffer)])] * TP_SIZE, None)
        res["malformed_error"] = None
    except Exception as exc:  # noqa: BLE001
        res["malformed_error"] = str(exc)
    engine.abort_update()
    engine.post("/update_weights_from_tensor", {"serialized_named_tensors": [dumps_b64([])] * TP_SIZE,
                                                "load_format": "weightstream.integrations.sglang_loader.other"})
    res["unlisted_raised"] = [a["raised"] for a in engine.answers[-1]]
    without = harness(ranks, tmp, {**server_info, "custom_weight_loader": []})
    try:
        without.begin_update("v7")
        res["no_flag_error"] = None
    except Exception as exc:  # noqa: BLE001
        res["no_flag_error"] = str(exc)
    res["no_flag_sent"] = [s["path"] for s in without.sent]
    return res


# --------------------------------------------------------------------------------------- WeightSync end to end

SYNC_BUCKET_BYTES = 6000  # the trainer's 27 KB model in several buckets


def train_step(model, seed: int, every: int) -> None:
    """A step's change: every ``every``-th word of each tensor moves (1: all of them)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            flat[::every] += torch.randn(flat[::every].shape, generator=g).to(p.dtype)


def weights_of(model) -> list[tuple[str, torch.Tensor]]:
    return [(n, t.detach().clone()) for n, t in model.state_dict().items()]


def sync_update(sync, model, version: str, held) -> dict:
    """One ``WeightSync.update`` of ``model`` (every trainer rank): what its report says (or the error it raised),
    and ``held(model)``: on trainer rank 0, whether every engine rank's target and draft hold it bit for bit."""
    try:
        report = sync.update(model, llama_config(), weight_version=version)
    except Exception as exc:  # noqa: BLE001 -- the check reports it
        return {"error": str(exc), "equal": held(model)}
    d = report.delta
    return {"error": None, "transport": report.transport, "ahead": report.metadata_ahead, "buckets": report.buckets,
            "bytes": report.bytes, "full": d.full, "encoded": d.encoded, "checked": d.checked,
            "encodings": sorted(d.encodings), "wire_bytes": d.wire_bytes, "reason": d.reason, "mismatch": d.mismatch,
            "equal": held(model)}


def sync_rounds(engine_for, held) -> dict:
    """What both trainer ranks run, in step: ``WeightSync(transport="ipc", delta=True)`` into the TP 2 engine (trainer
    rank r colocated with engine rank r), every request through the loader: a full update, a dense delta (every word
    moved), a sparse one; then another trainer's updates under this one's version names (:func:`clashes`).
    ``engine_for()``: this rank's adapter (on rank 0 the one whose requests reach the rank processes)."""
    from transformers import LlamaForCausalLM

    from weightstream import WeightSync

    model = llama(LlamaForCausalLM, 11)
    res: dict = {"sync": {}}
    with WeightSync([engine_for()], transport="ipc", delta=True, bucket_bytes=SYNC_BUCKET_BYTES) as sync:
        for seed, (version, every) in enumerate((("s1", 1), ("s2", 1), ("s3", 89))):
            train_step(model, seed, every)
            res["sync"][version] = sync_update(sync, model, version, held)
        res.update(clashes(sync, model, engine_for, held))
    return res


def clashes(sync, model, engine_for, held) -> dict:
    """Another trainer commits the version this one committed last, so the ranks name the base this trainer
    expects while holding other bytes. In buckets of another plan: this trainer's next delta is refused by every
    rank (no bytes of that bucket in its layout), one error naming each, and the update after it is full. In
    buckets of the same plan: the deltas apply to the other bytes, the check finds every rank's checksums wrong,
    and the update is sent again in full."""
    from transformers import LlamaForCausalLM

    from weightstream import WeightSync

    res: dict = {}
    for name, bucket_bytes, last, seed in (("other_plan", 2 * SYNC_BUCKET_BYTES, "s3", 21),
                                           ("same_plan", SYNC_BUCKET_BYTES, "s5", 22)):
        with WeightSync([engine_for()], transport="ipc", delta=True, bucket_bytes=bucket_bytes) as second:
            res[name] = sync_update(second, llama(LlamaForCausalLM, seed), last, held)
        train_step(model, seed, 89)
        res[name]["next"] = sync_update(sync, model, f"s{int(last[1:]) + 1}", held)
        if name == "other_plan":
            train_step(model, seed + 100, 89)
            res[name]["after"] = sync_update(sync, model, "s5", held)
    return res


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_rank0(ranks: Ranks, tmp: str, server_info: dict) -> dict:
    """This process as trainer rank 0 of two (gloo), trainer rank 1 another process of this script: the
    :func:`sync_rounds`, and every answer SGLang's code gave their requests."""
    port, log = free_port(), os.path.join(tmp, "trainer1.log")
    peer = subprocess.Popen([sys.executable, __file__, "--trainer", str(port)], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    engines: list = []

    def engine_for():
        engines.append(harness(ranks, tmp, server_info))
        return engines[-1]

    try:
        res = sync_rounds(engine_for, lambda model: held_equal(ranks.dump(tmp), weights_of(model)))
    finally:
        torch.distributed.destroy_process_group()
        try:
            peer.wait(timeout=120)
        except subprocess.TimeoutExpired:
            peer.kill()
    answers = [a for e in engines for request in e.answers for a in request]
    res["sync_raised"] = [a["raised"] for a in answers if a["raised"]]
    res["sync_sglang_answers"] = sorted({tuple(x) for a in answers for x in a.get("answers", [])})
    res["sync_unknown_fields"] = sorted({f for a in answers for f in a["unknown_fields"]})
    res["trainer1"] = {"returncode": peer.returncode, "log": Path(log).read_text()[-3000:]}
    return res


def trainer_rank1(port: int) -> None:
    """Trainer rank 1: the same :func:`sync_rounds`; its adapter posts nothing (rank 0 does), it makes the payloads
    of engine rank 1."""
    from weightstream.engines.sglang import SGLangEngine
    from weightstream.engines.sglang_inside import LOADER

    torch.multiprocessing.set_sharing_strategy("file_system")
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    try:
        res = sync_rounds(lambda: SGLangEngine("http://sglang.check", custom_loader=LOADER, timeout_s=20.0),
                          lambda model: {})
        print(json.dumps(res, default=str))
    finally:
        torch.distributed.destroy_process_group()


def main() -> None:
    torch.multiprocessing.set_sharing_strategy("file_system")  # CPU tensors readable by an unrelated process
    import sglang

    result: dict = {"sglang_version": getattr(sglang, "__version__", None), "server_args": server_args()}
    server_info = {"tp_size": TP_SIZE, "dp_size": 1, "pp_size": 1, "loader": result["server_args"]["loader"],
                   "custom_weight_loader": result["server_args"]["parsed"]}
    with tempfile.TemporaryDirectory() as tmp:
        ranks = Ranks(tmp)
        try:
            engine = harness(ranks, tmp, server_info)
            result.update(rounds(engine, ranks, tmp, layout()))
            result.update(refusals(engine, ranks, tmp, server_info))
            answers = [a for request in engine.answers for a in request]
            result["load_formats"] = sorted({a.get("load_format") for a in answers})
            result["unknown_fields"] = sorted({f for a in answers for f in a["unknown_fields"]})
            result["raised_outside_unlisted"] = [a["raised"] for request in engine.answers[:-1] for a in request
                                                 if a["raised"]]
            result["sglang_answers"] = sorted({tuple(x) for a in answers for x in a.get("answers", [])})
            result["dtypes"] = sorted({str(d) for _, d, _ in layout()})
            result.update(trainer_rank0(ranks, tmp, server_info))
        finally:
            ranks.close()
            result["rank_logs"] = [Path(p).read_text()[-3000:] for p in ranks.logs]
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--rank":
        rank_process(int(sys.argv[2]))
    elif len(sys.argv) == 3 and sys.argv[1] == "--trainer":
        trainer_rank1(int(sys.argv[2]))
    else:
        main()
