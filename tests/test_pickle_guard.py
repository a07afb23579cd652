"""Pickles from outside are measured before they are unpickled, and one that would build out of proportion to
its length is refused at once with one clear error: in an IPC payload to a real reference engine, in a
torch_dist ``.metadata`` and in a legacy rank file read by ``weightstream convert``. The pickles that real
senders and real Megatron-Core saves write pass, well inside the bound."""

from __future__ import annotations

import base64
import collections
import dataclasses
import io
import pickle
import shutil
import subprocess
import sys
import time
import types
import zipfile
from pathlib import Path

import pytest
import torch

from weightstream.cli import main
from weightstream.common.pickle_guard import PickleBoundError, PickleBounds, check_pickle
from weightstream.sources.megatron_checkpoint import (
    CheckpointFormatError,
    MegatronCheckpointSource,
    read_dcp_metadata,
)

DEPTHS = range(33, 41)
EMBEDDING = "embedding.word_embeddings.weight"


def bomb(depth: int) -> bytes:
    """A dictionary keyed by ``(t, t)`` nested ``depth`` deep: 2**depth items in 2 * depth + 10 bytes; hashing
    the key takes hours at depth 40."""
    return b"\x80\x02}K\x00\x85" + b"2\x86" * depth + b"K\x01s."


def memo_bomb(depth: int) -> bytes:
    """The same through the memo (``BINPUT``, ``BINGET``) instead of ``DUP``, which torch's weights-only loader
    takes too."""
    return b"\x80\x02}K\x00\x85" + b"q\x00h\x00\x86" * depth + b"K\x01s."


BOMBS = [bomb(d) for d in DEPTHS] + [memo_bomb(d) for d in DEPTHS]


def _refusal(data: bytes) -> str:
    """The one line the measure refuses ``data`` with."""
    with pytest.raises(PickleBoundError) as err:
        check_pickle(data)
    return str(err.value)


# -- the measure itself --------------------------------------------------------------------------------------

@pytest.mark.unit
@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize(("make", "at"), [(bomb, 42), (memo_bomb, 98)])
def test_a_bomb_is_refused_at_once(depth, make, at):
    data = make(depth)
    start = time.perf_counter()
    with pytest.raises(PickleBoundError) as err:
        check_pickle(data)
    assert time.perf_counter() - start < 0.1
    (line,) = str(err.value).splitlines()
    assert line == (f"its pickle expands to more than {(1 << 20) + 32 * len(data):,} items (objects and bytes of "
                    f"strings, a shared object counted at each reference) by byte {at} of {len(data)}; the bound is "
                    "1,048,576 + 32 per byte of pickle")


@pytest.mark.unit
def test_below_the_bound_the_same_shape_passes_and_is_measured_exactly():
    # (0,) is 2 items, each level 1 + twice the one below (3 * 2**d - 1 at level d); each DUP counts a level
    # again, so the sum checked is the expanded size of everything built.
    measure = check_pickle(bomb(10))
    assert pickle.loads(bomb(10)) == {_nested(10): 1}
    # The dictionary, 0, (0,) and the final 1 count 1 each; level d adds the DUP of one of size 3 * 2**d - 1 and
    # the tuple of two such (1).
    assert measure.expanded == 4 + sum(3 * 2**d for d in range(10))
    assert measure.depth == 12 and measure.opcodes == 2 * 10 + 7


def _nested(depth: int) -> tuple:
    t: tuple = (0,)
    for _ in range(depth):
        t = (t, t)
    return t


@pytest.mark.unit
def test_references_to_a_long_string_count_its_length_each_time():
    text = "x" * 10_000
    data = pickle.dumps([text] * 200, protocol=4)  # one string, then 199 memo references to it
    assert len(data) < 11_000
    with pytest.raises(PickleBoundError, match="expands to more than 1,3"):
        check_pickle(data)
    assert check_pickle(data, PickleBounds(floor=3_000_000)).expanded == 200 * 10_001 + 1  # + the list


@pytest.mark.unit
@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_ordinary_pickles_pass_in_every_protocol(protocol):
    obj = {"names": [f"model.layers.{i}.mlp.down_proj.weight" for i in range(200)], "shape": (4, 8),
           "frozen": frozenset({1, 2}), "set": {3}, "float": 1.5, "big": 1 << 100, "bytes": b"\x00" * 300,
           "ordered": collections.OrderedDict(a=1), "ns": types.SimpleNamespace(x=[1, 2]), "none": None,
           "flag": True}
    data = pickle.dumps(obj, protocol=protocol)
    measure = check_pickle(data)
    assert measure.expanded < 3 * len(data) and pickle.loads(data) == obj


@pytest.mark.unit
def test_a_structure_that_contains_itself_is_refused():
    loop: list = [1]
    loop.append(loop)
    with pytest.raises(PickleBoundError, match="changes an object after referring to it again .*: a structure "
                                               "that contains itself"):
        check_pickle(pickle.dumps(loop, protocol=2))


@pytest.mark.unit
def test_depth_and_length_are_bounded():
    deep: list = []
    for _ in range(300):
        deep = [deep]
    with pytest.raises(PickleBoundError, match="nests objects more than 256 deep"):
        check_pickle(pickle.dumps(deep))
    with pytest.raises(PickleBoundError, match="its pickle is 1,000 bytes long, more than the 999 allowed"):
        check_pickle(b"." * 1000, PickleBounds(max_bytes=999))


@pytest.mark.unit
@pytest.mark.parametrize(("data", "problem"), [
    (bomb(3)[:-4], "ends after 12 bytes without its STOP opcode"),
    (b"\x80\x02X\xff\x00\x00\x00ab.", "ends inside the argument of BINUNICODE at byte 2"),
    (b"\x80\x02\xff.", "byte 2 of the pickle \\(0xff\\) is not an opcode"),
    (b"\x80\x02h\x07.", "BINGET at byte 2 reads memo entry 7, never written"),
    (b"\x80\x02K\x01s.", "the opcode at byte 4 needs more objects than the stack holds"),
])
def test_malformed_pickles_are_refused_before_unpickling(data, problem):
    with pytest.raises(pickle.UnpicklingError, match=problem) as err:
        check_pickle(data)
    assert not isinstance(err.value, PickleBoundError)


# -- checkpoints ---------------------------------------------------------------------------------------------

def _torch_dist(root: Path, metadata: bytes) -> Path:
    """A torch_dist checkpoint directory whose ``.metadata`` is ``metadata``."""
    it = root / "iter_0000001"
    it.mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    (it / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    (it / ".metadata").write_bytes(metadata)
    return it / ".metadata"


def _legacy(root: Path, state: dict, index: bytes | None = None) -> Path:
    """A legacy checkpoint of one rank file holding ``state`` (as torch.save writes it), its pickle replaced by
    ``index`` if given."""
    rank = root / "iter_0000001" / "mp_rank_00"
    rank.mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    file = rank / "model_optim_rng.pt"
    torch.save(state, file)
    if index is not None:
        with zipfile.ZipFile(file) as zf:
            members = [(info, zf.read(info)) for info in zf.infolist()]
        with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED) as zf:
            for info, body in members:
                zf.writestr(info, index if info.filename.endswith("/data.pkl") else body)
    return file


@pytest.mark.parametrize("fmt", ["torch_dist", "legacy"])
def test_a_bomb_in_a_checkpoint_is_refused_at_once(tmp_path, capsys, fmt):
    import torch.distributed.checkpoint.metadata  # noqa: F401 -- imported once, not timed below
    for n, data in enumerate(BOMBS):
        root = tmp_path / f"{fmt}{n}"
        if fmt == "torch_dist":
            file = _torch_dist(root, data)
            expected = f"refused to read {file}: {_refusal(data)}"
        else:
            file = _legacy(root, {"checkpoint_version": 3.0, "model": {}}, data)
            expected = f"refused to read {file} (model_optim_rng/data.pkl): {_refusal(data)}"
        for trust in (False, True):
            start = time.perf_counter()
            with pytest.raises(CheckpointFormatError) as err:
                MegatronCheckpointSource(root, trust_checkpoint=trust)
            assert time.perf_counter() - start < 1.0
            assert str(err.value) == expected
        code = main(["convert", str(root), "--preset", "tiny-qwen3", "--out", str(tmp_path / "out")])
        out, err = capsys.readouterr()
        assert code == 2 and out == "", (code, out, err)
        assert [line for line in err.splitlines() if line.startswith("error:")] == [f"error: {expected}"]
        assert err.splitlines()[-1] == f"error: {expected}" and "Traceback" not in err
        assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A tiny Qwen3 (HF, random weights) and the torch_dist checkpoint a one-rank Megatron-Core job saves of it."""
    from tests.helpers.megatron_saves import run_saves
    from tests.helpers.workers import Case
    from weightstream.jobs import Layout
    from weightstream.launch import launch
    from weightstream.models.presets import preset_config, save_random_checkpoint

    root = tmp_path_factory.mktemp("guard")
    hf = save_random_checkpoint(preset_config("tiny-qwen3"), root / "hf", seed=93)
    launch(1, run_saves, [(Case(hf, Layout(1, 1)), str(root / "meg"))])
    return {"hf": Path(hf), "torch_dist": root / "meg" / "torch_dist"}


def test_a_bomb_in_a_distcp_item_is_refused_before_torch_reads_it(saved, tmp_path, capsys):
    """Each tensor of a ``.distcp`` file is a torch.save archive whose pickle torch unpickles: the embedding's,
    replaced by the bomb (an intact archive, its CRC-32s right), is refused, naming the tensor and where it is."""
    copy = tmp_path / "torch_dist"
    shutil.copytree(saved["torch_dist"], copy)
    directory = copy / "iter_0000007"
    metadata = read_dcp_metadata(directory / ".metadata")
    ((index, item),) = [(i, s) for i, s in metadata.storage_data.items() if i.fqn == EMBEDDING]
    file = directory / item.relative_path
    raw = file.read_bytes()
    with zipfile.ZipFile(io.BytesIO(raw[item.offset: item.offset + item.length])) as zf:
        members = [(info, zf.read(info)) for info in zf.infolist()]
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as zf:
        for info, body in members:
            zf.writestr(info, memo_bomb(40) if info.filename.endswith("data.pkl") else body)
    file.write_bytes(raw + archive.getvalue())
    end = len(raw) + len(archive.getvalue())
    metadata.storage_data[index] = dataclasses.replace(item, offset=len(raw), length=end - len(raw))
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    (member,) = [info.filename for info, _ in members if info.filename.endswith("data.pkl")]
    expected = (f"error: refused to read the checkpoint {directory}: {EMBEDDING} (bytes {len(raw)}..{end} of "
                f"{item.relative_path}): {member}: {_refusal(memo_bomb(40))}")
    start = time.perf_counter()
    code = main(["convert", str(copy), "--hf", str(saved["hf"]), "--out", str(tmp_path / "out"), "--bucket-mb",
                 "0.04"])
    assert time.perf_counter() - start < 60  # the whole conversion up to the embedding's bucket
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (code, out, err)
    assert [line for line in err.splitlines() if line.startswith("error:")] == [expected]
    assert err.splitlines()[-1] == expected and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "weightstream.cli", *argv], capture_output=True, text=True,
                          timeout=300, check=False)


def _error_lines(stderr: str) -> list[str]:
    """The lines of ``stderr`` but the progress lines of ``convert`` (``convert: reading ...``)."""
    return [line for line in stderr.splitlines() if not line.startswith("convert: ")]


def test_weightstream_convert_refuses_a_metadata_bomb_in_one_line(tmp_path):
    file = _torch_dist(tmp_path / "ckpt", bomb(40))
    run = _cli("convert", str(tmp_path / "ckpt"), "--preset", "tiny-qwen3", "--out", str(tmp_path / "out"))
    assert run.returncode == 2 and run.stdout == "", (run.returncode, run.stderr)
    assert _error_lines(run.stderr) == [f"error: refused to read {file}: {_refusal(bomb(40))}"]


def test_a_legacy_state_dict_with_a_tuple_key_is_one_error_line(tmp_path):
    state = {"checkpoint_version": 3.0, "iteration": 1,
             "model": {"embedding.word_embeddings.weight": torch.zeros(4, 2), ("decoder", 0): torch.zeros(2)}}
    file = _legacy(tmp_path / "ckpt", state)
    run = _cli("convert", str(tmp_path / "ckpt"), "--preset", "tiny-qwen3", "--out", str(tmp_path / "out"))
    assert run.returncode == 2 and run.stdout == "", (run.returncode, run.stderr)
    assert _error_lines(run.stderr) == [
        f"error: {file} is not a Megatron rank file as this reader knows it: 'model' has 1 key(s) that are not "
        "parameter names (strings): ('decoder', 0)"]
    with pytest.raises(CheckpointFormatError, match="'model' has 1 key"):
        MegatronCheckpointSource(tmp_path / "ckpt")


# -- an engine -----------------------------------------------------------------------------------------------

def test_an_engine_refuses_a_bomb_payload_at_once_and_keeps_serving(tmp_path):
    from tests.helpers.checks import INPUT_IDS
    from weightstream.engines import EngineError, ReferenceEngine
    from weightstream.models.presets import preset_config, save_random_checkpoint
    from weightstream.reference_engine.server import serve, stop

    server = serve(save_random_checkpoint(preset_config("tiny-qwen3"), tmp_path / "m", seed=5), 1)
    try:
        eng = ReferenceEngine(server.url)
        before = eng.logits(INPUT_IDS)
        for n, data in enumerate(BOMBS):
            eng.begin_update(f"bomb {n}")
            start = time.perf_counter()
            with pytest.raises(EngineError) as err:
                eng.receive_ipc(0, [base64.b64encode(data).decode()], None)
            assert time.perf_counter() - start < 1.0
            assert f"refused a payload of {len(data)} bytes: {_refusal(data)}" in str(err.value)
            eng.abort_update()
        assert torch.equal(eng.logits(INPUT_IDS), before)
        assert eng.weight_version() == "default"
        assert server.engine.alive()
    finally:
        stop(server)
