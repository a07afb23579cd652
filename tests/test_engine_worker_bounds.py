"""What an engine worker keeps and what it loads, against hostile or broken updates: refused buckets leave no program
behind and the programs kept stay within their bound; a per-bucket delta header that does not fit its bucket is
refused before anything is received; block-FP8 scales that are not finite and positive are refused, naming each;
a weight holding NaN or an infinity is reported, or refused under ``--refuse-nonfinite``; a shared-memory object
named after a process that did not make it is neither mapped nor unlinked; and an engine's EP is checked against its
model. Real reference engines (tiny Qwen3, float32 and block FP8) on loopback; this process is the trainer's rank 0
of a gloo weight-update group."""

from __future__ import annotations

import base64
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from tests.test_engine_hardening import KEY, in_thread, logits, request, trainer_group
from weightstream.models.presets import preset_config, random_hf_model, save_random_checkpoint
from weightstream.models.spec import dtype_name
from weightstream.receiver.programs import ProgramCache
from weightstream.receiver.schema import ep_problem, routed_experts
from weightstream.receiver.values import DEFAULT_CHECKS, MAX_FP8_SCALE, LoadChecks, check_runs, check_values
from weightstream.reference_engine.server import EngineServer, serve, stop
from weightstream.sinks.safetensors import save_hf_checkpoint
from weightstream.streaming.bucket import TensorMeta, typed_runs, typed_views
from weightstream.streaming.delta import DeltaHeader
from weightstream.wire.fp8 import SCALE_SUFFIX, BlockFP8

HIDDEN = preset_config("tiny-qwen3").hidden_size
NORM = "model.norm.weight"
SMALL = BlockFP8(block=(16, 16))  # divides every dimension of tiny-qwen3
LINEARS = [f"model.layers.{layer}.mlp.{part}_proj.weight" for layer in (0, 1) for part in ("gate", "up", "down")][:5]


@contextmanager
def _engine(model: str, checks: LoadChecks = DEFAULT_CHECKS) -> Iterator[EngineServer]:
    srv = serve(model, 1, api_key=KEY, checks=checks)
    try:
        yield srv
    finally:
        stop(srv)


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory) -> str:
    return save_random_checkpoint(preset_config("tiny-qwen3"), tmp_path_factory.mktemp("bounds") / "m", seed=5)


@pytest.fixture(scope="module")
def server(dense_model) -> Iterator[EngineServer]:
    with _engine(dense_model) as srv:
        yield srv


def _memory(url: str) -> dict:
    status, reply = request(url, "GET", "/weightstream/memory")
    assert status == 200, reply
    return reply["ranks"][0]


def _checksums(url: str, names: list[str]) -> dict[str, str]:
    status, reply = request(url, "POST", "/weightstream/weight_checksums", {"names": names})
    assert status == 200, reply
    return reply["ranks"][0]


def _bucket(tensors: dict[str, torch.Tensor]) -> tuple[dict, torch.Tensor]:
    """The metadata of a dense bucket of ``tensors`` (back to back) and its bytes."""
    meta = {"names": list(tensors), "dtypes": [dtype_name(t.dtype) for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()]}
    flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()])
    return meta, flat


def _send(url: str, group, tensors: dict[str, torch.Tensor], session: bool = True) -> tuple[int, dict]:
    """One per-bucket broadcast update of ``tensors`` (in a session of its own, aborted after, unless ``session`` is
    False): the engine's answer."""
    meta, flat = _bucket(tensors)
    if session:
        assert request(url, "POST", "/begin_weight_update", {"timeout_s": 60})[0] == 200
    try:
        answer = in_thread(lambda: request(url, "POST", "/update_weights_from_distributed",
                                           {**meta, "group_name": "hardening", "load_format": "flattened_bucket"}))
        dist.broadcast(flat, group=group, group_src=0)
        return answer()
    finally:
        if session:
            assert request(url, "POST", "/weightstream/abort_weight_update", {})[0] == 200


# -- the program cache -----------------------------------------------------------------------------------


@pytest.mark.unit
def test_program_cache_drops_the_least_recently_used_within_its_tensors():
    cache = ProgramCache(10)
    for i in range(8):
        cache.put(("b", i), f"program {i}", 3)
        assert cache.tensors <= 10 and cache.tensors == 3 * len(cache)
    assert len(cache) == 3 and all(("b", i) in cache for i in (5, 6, 7))
    assert cache.get(("b", 5)) == "program 5"  # now the most recently used: ("b", 6) goes next
    cache.put(("b", 8), "program 8", 3)
    assert ("b", 6) not in cache and ("b", 5) in cache and cache.get(("b", 0)) is None
    cache.clear()
    assert len(cache) == 0 and cache.tensors == 0


def test_refused_buckets_leave_the_program_cache_as_it_was(server):
    """60 per-bucket requests each naming 2,000 tensors the model does not have are refused, and the worker keeps
    exactly the programs it kept before (a bucket that loads is kept, once), within its stated bound."""
    url = server.url
    with trainer_group(url) as group:
        status, reply = _send(url, group, {NORM: torch.full((HIDDEN,), 2.0)})
        assert status == 200, reply
        before = _memory(url)
        assert before["programs_kept"] >= 1
        assert _send(url, group, {NORM: torch.full((HIDDEN,), 2.0)})[0] == 200
        assert _memory(url)["programs_kept"] == before["programs_kept"]  # the same layout: kept once
        for i in range(60):
            unknown = {f"model.nothing.{i}.{k}.weight": torch.zeros(1) for k in range(2000)}
            status, reply = _send(url, group, unknown)
            assert status != 200 and "the model has no such tensor" in reply["message"], (status, reply)
        after = _memory(url)
    assert (after["programs_kept"], after["program_tensors_kept"]) == (before["programs_kept"],
                                                                       before["program_tensors_kept"])
    assert after["program_tensors_kept"] <= after["program_tensors_bound"] == 4 * 47, after


# -- a per-bucket delta header is checked against its bucket, as one sent ahead is --------------------------


@pytest.mark.unit
def test_a_delta_header_is_read_by_one_check_ahead_or_per_bucket():
    header = {"encoding": "dense", "word": 4, "total": 256, "count": 0, "nbytes": 248, "index": 3}
    with pytest.raises(ValueError) as per_bucket:
        DeltaHeader.from_request(header, 256, 256)
    with pytest.raises(ValueError) as ahead:
        DeltaHeader.from_words([0, 4, 256, 0, 248, 3], 256, 256)
    assert str(per_bucket.value) == str(ahead.value) == ("bad delta header for bucket 3: 248 payload bytes, dense of "
                                                         "0 words takes 256")
    with pytest.raises(ValueError, match="encoding 'gzip' is none of .*; word of 3 bytes .*; 100 bucket bytes, its "
                                         "tensors take 256; a payload of 4096 bytes"):
        DeltaHeader.from_request({**header, "encoding": "gzip", "word": 3, "total": 100, "nbytes": 4096}, 256, 256)
    good = {**header, "nbytes": 256}
    assert DeltaHeader.from_request(good, 256, 256) == (DeltaHeader("dense", 4, 256, 0, 256), 3)


def test_a_malformed_per_bucket_delta_header_is_refused_and_nothing_committed(server):
    """``model.norm.weight`` (256 bytes) announced as a dense delta of 248 bytes: refused before its payload is
    received, naming the header's fault; the session cannot commit and the weights stay bit for bit."""
    url = server.url
    before, served = _checksums(url, [NORM]), logits(url)
    delta = {"encoding": "dense", "word": 4, "total": 4 * HIDDEN, "count": 0, "nbytes": 4 * HIDDEN - 8, "index": 0}
    with trainer_group(url) as group:
        assert request(url, "POST", "/begin_weight_update", {"timeout_s": 60})[0] == 200
        out: list = []
        body = {"names": [NORM], "dtypes": ["float32"], "shapes": [[HIDDEN]], "group_name": "hardening",
                "load_format": "flattened_bucket", "weightstream_delta": delta}
        thread = threading.Thread(target=lambda: out.append(request(url, "POST", "/update_weights_from_distributed",
                                                                    body)), daemon=True)
        thread.start()
        thread.join(timeout=15)
        if not out:  # the engine took the header and waits for its payload: give it one, so that it answers
            dist.broadcast(torch.full((HIDDEN - 2,), 7.0), group=group, group_src=0)
            thread.join(timeout=30)
        status, reply = out[0]
        ended = request(url, "POST", "/end_weight_update", {})
        request(url, "POST", "/weightstream/abort_weight_update", {})
    assert status != 200 and "bad delta header for bucket 0: 248 payload bytes, dense of 0 words takes 256" in \
        reply["message"], (status, reply)
    assert ended[0] != 200, ended
    assert _checksums(url, [NORM]) == before
    assert torch.equal(torch.from_numpy(logits(url)), torch.from_numpy(served))


# -- values: block-FP8 scales, and weights holding NaN or an infinity --------------------------------------


@pytest.mark.unit
def test_scales_out_of_bounds_and_nonfinite_weights_are_named():
    w = torch.ones(4, 4)
    w[1, 1] = float("nan")
    f8 = torch.ones(8).to(torch.float8_e4m3fn)
    f8_nan = f8.clone()
    f8_nan.view(torch.uint8)[3] = 0xFF
    big_but_finite = torch.full((1000,), 1000.0, dtype=torch.float16)  # its sum overflows float16; no element does
    report = check_values([
        ("a.weight", w), ("b.weight", big_but_finite), ("c.weight", f8), ("d.weight", f8_nan),
        ("x.weight" + SCALE_SUFFIX, torch.tensor([float("nan"), 1.0])),
        ("y.weight" + SCALE_SUFFIX, torch.tensor([-1.0, 0.0, 1e38, float("inf")])),
        ("z.weight" + SCALE_SUFFIX, torch.tensor([0.5, MAX_FP8_SCALE])),
    ])
    assert report.nonfinite == ("a.weight", "d.weight")
    assert report.bad_scales == ("x.weight_scale_inv: NaN", "y.weight_scale_inv: infinite, not positive (min -1), "
                                 f"above {MAX_FP8_SCALE:g} (max 1e+38)")
    default = report.refusal(LoadChecks())
    assert default is not None and "a.weight" not in default
    strict = report.refusal(LoadChecks(refuse_nonfinite=True))
    assert strict is not None and "a.weight: holds NaN or an infinity; d.weight: holds NaN" in strict


def _bucket_of(named: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list]:
    """``named`` packed into one bucket (each tensor at an 8-byte boundary: gaps between them), and its runs."""
    metas, offset = [], 0
    for name, t in named:
        offset = -(-offset // 8) * 8
        metas.append(TensorMeta(name, t.dtype, tuple(t.shape), offset))
        offset += t.numel() * t.element_size()
    raw = torch.zeros(-(-offset // 8) * 8, dtype=torch.uint8)
    for m, (_, t) in zip(metas, named, strict=True):
        raw[m.offset:m.offset + m.nbytes].copy_(t.reshape(-1).view(torch.uint8))
    runs = typed_runs((m.dtype, m.offset, m.numel, (m.name, None)) for m in metas)
    return raw, runs


@pytest.mark.unit
@pytest.mark.parametrize("case", ["clean", "nan weight", "inf half", "nan fp8", "nan in a gap", "bad scale"])
def test_a_bucket_checked_by_runs_finds_what_the_per_tensor_check_finds(case):
    """:func:`check_runs` (one reduction per run) finds exactly what :func:`check_values` finds of the same tensors,
    and names no tensor for a NaN between two tensors."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(5, 3, generator=gen)
    h = torch.randn(7, generator=gen).half()
    f8 = torch.randn(9, generator=gen).to(torch.float8_e4m3fn)
    scale = torch.rand(2, generator=gen) + 0.5
    if case == "nan weight":
        w[2, 1] = float("nan")
    if case == "inf half":
        h[6] = float("-inf")
    if case == "nan fp8":
        f8.view(torch.uint8)[4] = 0x7F
    if case == "bad scale":
        scale[1] = -2.0
    named = [("a.weight", w), ("a2.weight", torch.randn(2, generator=gen)), ("h.weight", h), ("f.weight", f8),
             ("f.weight" + SCALE_SUFFIX, scale),
             ("b.weight", torch.randn(3, generator=gen))]
    raw, runs = _bucket_of(named)
    if case == "nan in a gap":  # between a.weight's 60 bytes and a2.weight (float32 too) at byte 64
        raw.view(torch.float32)[15] = float("nan")
    views = [(n, v) for dtype, sizes, payload in runs
             for (n, _), v in zip(payload, typed_views(raw, dtype, sizes), strict=True)]
    assert check_runs(raw, runs) == check_values(views)
    expected = {"clean": (), "nan weight": ("a.weight",), "inf half": ("h.weight",), "nan fp8": ("f.weight",),
                "nan in a gap": (), "bad scale": ()}[case]
    assert check_runs(raw, runs).nonfinite == expected
    assert bool(check_runs(raw, runs).bad_scales) == (case == "bad scale")


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory) -> str:
    cfg = preset_config("tiny-qwen3")
    where = tmp_path_factory.mktemp("bounds-fp8") / "fp8"
    save_hf_checkpoint(random_hf_model(cfg, seed=9, dtype=torch.float32), cfg, where, quantize=SMALL)
    return str(where)


def test_fp8_scales_that_are_not_finite_and_positive_are_refused_naming_each(fp8_model):
    """One bucket of five FP8 weights whose scales hold NaN, inf, -1, 0 and 1e38: refused with one error naming all
    five, nothing loaded; each alone is refused too, and a bucket of sane scales loads."""
    bad = [float("nan"), float("inf"), -1.0, 0.0, 1e38]
    with _engine(fp8_model) as srv:
        url = srv.url
        names = LINEARS + [n + SCALE_SUFFIX for n in LINEARS]
        before, served = _checksums(url, names), logits(url)
        shapes = {"gate": (96, 64), "up": (96, 64), "down": (64, 96)}
        bucket: dict[str, torch.Tensor] = {}
        for name, value in zip(LINEARS, bad, strict=True):
            rows, cols = shapes[name.rsplit(".", 2)[-2].removesuffix("_proj")]
            bucket[name] = torch.full((rows, cols), 0.5).to(torch.float8_e4m3fn)
            bucket[name + SCALE_SUFFIX] = torch.full((rows // 16, cols // 16), value)
        with trainer_group(url) as group:
            status, reply = _send(url, group, bucket)
            assert status != 200, reply
            message = reply["message"]
            assert "5 tensors hold values this engine refuses, nothing of the bucket loaded" in message, message
            for name, what in zip(LINEARS, ["NaN", "infinite", "not positive (min -1)", "not positive (min 0)",
                                            "above 4.29497e+09 (max 1e+38)"], strict=True):
                assert f"{name}{SCALE_SUFFIX}: {what}" in message, (name, message)
            for name in LINEARS:  # each alone
                pair = {name: bucket[name], name + SCALE_SUFFIX: bucket[name + SCALE_SUFFIX]}
                status, reply = _send(url, group, pair)
                assert status != 200 and f"{name}{SCALE_SUFFIX}: " in reply["message"], reply
            assert _checksums(url, names) == before
            assert torch.equal(torch.from_numpy(logits(url)), torch.from_numpy(served))
            sane = {n: t if t.dtype == torch.float8_e4m3fn else torch.full_like(t, 0.25) for n, t in bucket.items()}
            status, reply = _send(url, group, sane)
            assert status == 200, reply


def test_a_nonfinite_weight_is_reported_and_refused_with_the_option(dense_model, server):
    """A bucket whose ``model.norm.weight`` holds a NaN and whose first layer's norm holds an infinity: loaded and
    both named in the update's answer by default; refused, naming both, by an engine started with
    ``refuse_nonfinite``, whose weights stay bit for bit."""
    norm = torch.ones(HIDDEN)
    norm[3] = float("nan")
    layer_norm = torch.ones(HIDDEN)
    layer_norm[0] = float("-inf")
    bucket = {NORM: norm, "model.layers.0.input_layernorm.weight": layer_norm}
    with trainer_group(server.url) as group:
        status, reply = _send(server.url, group, bucket)
    assert status == 200, reply
    assert reply["message"].endswith("NaN or an infinity in 2 tensors of this session: "
                                     "model.layers.0.input_layernorm.weight, model.norm.weight"), reply
    with _engine(dense_model, LoadChecks(refuse_nonfinite=True)) as strict:
        info = request(strict.url, "GET", "/get_server_info")[1]
        assert info["refuse_nonfinite"] is True
        before, served = _checksums(strict.url, list(bucket)), logits(strict.url)
        with trainer_group(strict.url) as group:
            status, reply = _send(strict.url, group, bucket)
        assert status != 200, reply
        assert ("2 tensors hold values this engine refuses, nothing of the bucket loaded: model.norm.weight: holds "
                "NaN or an infinity; model.layers.0.input_layernorm.weight: holds NaN or an infinity") in \
            reply["message"], reply
        assert _checksums(strict.url, list(bucket)) == before
        assert torch.equal(torch.from_numpy(logits(strict.url)), torch.from_numpy(served))


# -- /dev/shm: a name is only a name --------------------------------------------------------------------

IMPOSTOR = r"""
import sys
name, nbytes = sys.argv[1], int(sys.argv[2])
with open("/dev/shm" + name, "wb") as f:  # torch's layout: a 64-byte header (reference count 1 first), then the data
    f.write((1).to_bytes(4, "little") + bytes(60) + b"W" * nbytes)
"""


class _Rebuild:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def test_shared_memory_named_after_the_engine_but_made_by_another_process_is_refused_not_unlinked(server, tmp_path):
    """``/dev/shm/torch_<engine pid>_99_99``, made by another process in torch's layout, named by a payload: refused
    (the engine's process does not map it), and left as it was: neither mapped, nor counted down, nor unlinked."""
    from torch.multiprocessing import reductions

    engine_pid = os.getpid()  # serve() runs the engine's process here; its workers are its children
    name, nbytes = f"/torch_{engine_pid}_99_{time.monotonic_ns() % 10**9}", 4 * HIDDEN
    script = tmp_path / "impostor.py"
    script.write_text(IMPOSTOR)
    subprocess.run([sys.executable, str(script), name, str(nbytes)], check=True, timeout=60)
    with open("/dev/shm" + name, "rb") as f:
        made = f.read()
    evil = _Rebuild(reductions.rebuild_storage_filename, torch.storage.UntypedStorage, b"/torch_manager",
                    name.encode(), nbytes)
    payload = base64.b64encode(pickle.dumps({"flattened_tensor": evil, "metadata": []}, protocol=5)).decode()
    url = server.url
    try:
        assert request(url, "POST", "/begin_weight_update", {"timeout_s": 60})[0] == 200
        try:
            status, reply = request(url, "POST", "/update_weights_from_tensor",
                                    {"serialized_named_tensors": [payload], "load_format": "flattened_bucket"})
        finally:
            request(url, "POST", "/weightstream/abort_weight_update", {})
        assert status != 200 and f"process {engine_pid}, whose pid the name gives, does not map it: another process " \
            "made it" in reply["message"], (status, reply)
        with open("/dev/shm" + name, "rb") as f:
            assert f.read() == made
    finally:
        if os.path.exists("/dev/shm" + name):
            os.unlink("/dev/shm" + name)


# -- the engine's EP -------------------------------------------------------------------------------------


@pytest.mark.unit
def test_engine_ep_is_checked_against_the_model_and_the_tp():
    assert routed_experts(preset_config("tiny-qwen3").to_dict()) == 0
    assert routed_experts({"text_config": {"n_routed_experts": 8}}) == 8
    assert ep_problem(2, 2, 0) == ("engine EP 2: the model has no routed experts (a dense model), so expert "
                                   "parallelism has nothing to split: run it at EP 1")
    assert ep_problem(2, 1, 8) == ("engine EP 2: expert parallelism runs over the engine's TP group, so at TP 1 it "
                                   "takes EP 1 only; for EP 2, run TP 2")
    assert ep_problem(3, 2, 8) == ("engine EP 3: expert parallelism runs over the engine's TP group, so at TP 2 it "
                                   "takes EP 1 (experts split like the other layers) or EP 2 (each rank holds its "
                                   "experts whole)")
    assert ep_problem(4, 4, 6) == "engine EP 4: the model's 6 routed experts cannot be split evenly over 4 ranks"
    assert ep_problem(0, 1, 8) == "engine EP 0: expert parallelism must be 1 or more"
    assert ep_problem(2, 2, 8) is None and ep_problem(1, 4, 0) is None and ep_problem(2, 2) is None


def test_the_engine_command_refuses_ep_on_a_dense_model(dense_model):
    """``weightstream engine --ep 2`` on a dense model: one ``error:`` line, exit status 2, nothing started."""
    proc = subprocess.run([sys.executable, "-m", "weightstream.cli", "engine", "--model", dense_model, "--port", "0",
                           "--ep", "2"], capture_output=True, text=True, timeout=120, env={**os.environ})
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == proc.stderr.strip().splitlines()[-1:] == [
        "error: engine EP 2: the model has no routed experts (a dense model), so expert parallelism has nothing to "
        "split: run it at EP 1"], proc.stderr
