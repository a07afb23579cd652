"""Reading a Megatron checkpoint runs no code from it, and bad files get one clear error.

A real Megatron-Core job (one rank) saves a tiny Qwen3 in both formats, the legacy files with everything
Megatron-LM's save_checkpoint adds (optimizer, scheduler and RNG state). The globals those pickles name are
exactly what the allow-lists expect; crafted files that would run code are refused (and run nothing) unless
trusted; truncated, emptied, random and bit-flipped files, a bad tracker, bad metadata and a bad config each
end ``weightstream convert`` / ``verify`` with one ``error:`` line naming the file, exit status 2."""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from weightstream.cli import main
from weightstream.convert import convert_checkpoint
from weightstream.jobs import Layout
from weightstream.launch import launch
from weightstream.models.presets import preset_config, save_random_checkpoint
from weightstream.sources.megatron_checkpoint import (
    DCP_METADATA_GLOBALS,
    LEGACY_GLOBALS,
    CheckpointFormatError,
    read_dcp_metadata,
)

RANK_FILE = Path("iter_0000007") / "mp_rank_00" / "model_optim_rng.pt"
EMBEDDING = "embedding.word_embeddings.weight"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A tiny Qwen3 (HF, random weights) and the Megatron-Core model built from it, saved by a one-rank job as
    ``meg/torch_dist`` and ``meg/legacy`` (with Megatron-LM's training state)."""
    from tests.helpers.megatron_saves import run_saves
    from tests.helpers.workers import Case

    root = tmp_path_factory.mktemp("safety")
    hf = save_random_checkpoint(preset_config("tiny-qwen3"), root / "hf", seed=91)
    launch(1, run_saves, [(Case(hf, Layout(1, 1)), str(root / "meg"))], 7, True)
    return {"hf": Path(hf), "legacy": root / "meg" / "legacy", "torch_dist": root / "meg" / "torch_dist"}


class _Names(pickle.Unpickler):
    """Unpickles into inert stand-ins, recording every global the pickle names: it runs nothing."""

    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data))
        self.names: set[str] = set()

    def find_class(self, module: str, name: str) -> type:
        self.names.add(f"{module}.{name}")
        return _Inert

    def persistent_load(self, pid: object) -> object:
        return _Inert()


class _Inert:
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __setstate__(self, state: object) -> None:
        pass

    def __setitem__(self, key: object, value: object) -> None:
        pass


def _pickled_names(data: bytes) -> set[str]:
    reader = _Names(data)
    reader.load()
    return reader.names


def _legacy_pickle(file: Path) -> bytes:
    with zipfile.ZipFile(file) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith("/data.pkl")]
        return zf.read(name)


def test_real_saves_name_only_allowed_globals_and_convert_untrusted(saved, tmp_path):
    torch_globals = {"collections.OrderedDict", "torch._utils._rebuild_tensor_v2", "torch.FloatStorage",
                     "torch.ByteStorage", "torch.LongStorage", "torch.float32", "_codecs.encode"}
    megatron_lm = {"argparse.Namespace", "numpy._core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype",
                   "megatron.core.transformer.enums.AttnBackend", "megatron.core.enums.ModelType", "signal.Signals"}
    names = _pickled_names(_legacy_pickle(saved["legacy"] / RANK_FILE))
    assert names - torch_globals == megatron_lm
    assert megatron_lm <= set(LEGACY_GLOBALS)
    metadata = (saved["torch_dist"] / "iter_0000007" / ".metadata").read_bytes()
    assert _pickled_names(metadata) == set(DCP_METADATA_GLOBALS) | {"torch.float32"}
    # torch_dist here; legacy from the command, in a process where Megatron-Core has not registered its own list
    # with torch (as it does on import, as in this one): the allow-list alone lets the file through.
    report = convert_checkpoint(saved["torch_dist"], saved["hf"], tmp_path / "dist", verify=saved["hf"],
                                bucket_bytes=40_000)
    assert report.verify is not None and report.verify.ok and report.verify.compared == 47
    run = subprocess.run([sys.executable, "-m", "weightstream.cli", "convert", str(saved["legacy"]), "--hf",
                          str(saved["hf"]), "--out", str(tmp_path / "legacy"), "--verify", str(saved["hf"]),
                          "--bucket-mb", "0.04"], capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    assert [line for line in run.stderr.splitlines() if not line.startswith("convert: ")] == [], run.stderr
    assert run.stdout.startswith("identical: 47 tensors compared")


def _system_call(marker: Path) -> object:
    """An object whose unpickling runs ``touch marker`` through os.system."""
    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)
    return Payload()


@dataclass
class TrainingNote:
    """A benign global of our own that Megatron never saves."""

    text: str


def _with_legacy_extra(saved: dict[str, Path], root: Path, extra: object) -> Path:
    """A copy of the legacy save whose rank file also holds ``extra``."""
    copy = root / "legacy"
    shutil.copytree(saved["legacy"], copy)
    state = torch.load(copy / RANK_FILE, weights_only=False)
    state["extra"] = extra
    torch.save(state, copy / RANK_FILE)
    return copy


def _with_metadata_extra(saved: dict[str, Path], root: Path, extra: object) -> Path:
    """A copy of the torch_dist save whose ``.metadata`` also holds ``extra`` (as its planner data)."""
    copy = root / "torch_dist"
    shutil.copytree(saved["torch_dist"], copy)
    path = copy / "iter_0000007" / ".metadata"
    metadata = read_dcp_metadata(path)
    metadata.planner_data = extra
    path.write_bytes(pickle.dumps(metadata))
    return copy


CRAFTED = {"legacy": (_with_legacy_extra, RANK_FILE),
           "torch_dist": (_with_metadata_extra, Path("iter_0000007/.metadata"))}


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_code_in_a_checkpoint_is_refused(saved, tmp_path, capsys, fmt):
    marker = tmp_path / "pwned"
    craft, file = CRAFTED[fmt]
    crafted = craft(saved, tmp_path, _system_call(marker))
    code = main(["convert", str(crafted), "--hf", str(saved["hf"]), "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    (line,) = err.splitlines()
    assert line.startswith(f"error: refused to read {crafted / file}: it names posix.system, which ")
    assert line.endswith("; read only checkpoints you trust: trust_checkpoint=True (weightstream convert "
                         "--trust-checkpoint) reads it anyway and lets it run any code")
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_a_trusted_checkpoint_is_read(saved, tmp_path, fmt):
    craft, file = CRAFTED[fmt]
    crafted = craft(saved, tmp_path, TrainingNote("lr warm-up done"))
    with pytest.raises(CheckpointFormatError) as err:
        convert_checkpoint(crafted, saved["hf"], tmp_path / "refused")
    assert f"refused to read {crafted / file}: it names tests.test_checkpoint_safety.TrainingNote, " in str(err.value)
    report = convert_checkpoint(crafted, saved["hf"], tmp_path / "out", verify=saved["hf"], trust_checkpoint=True)
    assert report.verify is not None and report.verify.ok and report.verify.compared == 47


# -- corrupt inputs ------------------------------------------------------------------------------------------

def _cut(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _flip(path: Path, start: int, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    for i in range(start, start + count):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def _data_offset(zf: zipfile.ZipFile, raw: bytes, info: zipfile.ZipInfo) -> int:
    """Where a stored member's data starts in ``raw`` (after its local header)."""
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26: info.header_offset + 30])
    return info.header_offset + 30 + name_len + extra_len


def _flip_legacy_embedding(root: Path) -> str:
    """Flip bytes in the middle of the embedding's storage in the legacy rank file."""
    file = root / "legacy" / RANK_FILE
    raw = file.read_bytes()
    weight = torch.load(file, weights_only=False)["model"][EMBEDDING]
    crc = zlib.crc32(weight.contiguous().view(torch.uint8).numpy().tobytes())
    with zipfile.ZipFile(file) as zf:
        (info,) = [i for i in zf.infolist() if i.CRC == crc and i.file_size == weight.numel() * 4]
        start = _data_offset(zf, raw, info) + info.file_size // 2
    _flip(file, start)
    return f"damaged tensor data \\(not the CRC-32 its file records\\): {re.escape(EMBEDDING)} in {{legacy}}"


def _flip_legacy_index(root: Path) -> str:
    file = root / "legacy" / RANK_FILE
    raw = file.read_bytes()
    with zipfile.ZipFile(file) as zf:
        (info,) = [i for i in zf.infolist() if i.filename.endswith("/data.pkl")]
        _flip(file, _data_offset(zf, raw, info) + info.file_size // 2, 4)
    member = re.escape(info.filename)
    return f"{{legacy}} is damaged: {member}: Bad CRC-32 for file '{member}'"


def _flip_distcp_embedding(root: Path) -> str:
    """Flip bytes in the middle of the embedding's data in its .distcp item (a zip archive of its own)."""
    directory = root / "torch_dist" / "iter_0000007"
    metadata = read_dcp_metadata(directory / ".metadata")
    (item,) = [s for i, s in metadata.storage_data.items() if i.fqn == EMBEDDING]
    file = directory / item.relative_path
    raw = file.read_bytes()[item.offset: item.offset + item.length]
    with zipfile.ZipFile(io.BytesIO(raw)) as zf:
        (info,) = [i for i in zf.infolist() if "/data/" in i.filename]
        data = _data_offset(zf, raw, info)
    _flip(file, item.offset + data + info.file_size // 2)
    flipped = zlib.crc32(file.read_bytes()[item.offset + data: item.offset + data + info.file_size])
    assert zlib.crc32(raw[data: data + info.file_size]) == info.CRC != flipped
    end = item.offset + item.length
    return (f"the checkpoint {{dist}} holds damaged tensor data: {re.escape(EMBEDDING)} "
            f"\\(bytes {item.offset}\\.\\.{end} "
            f"of {re.escape(item.relative_path)}\\): {re.escape(info.filename)}: CRC-32 {flipped:08x}, recorded "
            f"{info.CRC:08x}")


def _sharded(root: Path, hf: Path) -> Path:
    """``hf`` as two safetensors files and an index."""
    out = root / "sharded"
    out.mkdir()
    tensors = load_file(hf / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (out / "model.safetensors.index.json").write_text(
        '{"metadata": {}, "weight_map": ' + str(weight_map).replace("'", '"') + "}")
    shutil.copy(hf / "config.json", out)
    return out


def _write(path: Path, data: bytes) -> None:
    path.write_bytes(data)


# Each case: what it converts (or verifies), and how it spoils the copies in tmp_path (``root``: the Megatron
# saves, ``hf``: the HF checkpoint), returning the one error line expected, with {legacy}, {dist}, {root} and
# {hf} standing for those paths.
Spoil = Callable[[Path, Path], str]
CASES: dict[str, tuple[str, Spoil]] = {}


def _case(name: str, target: str) -> Callable[[Spoil], Spoil]:
    def register(spoil: Spoil) -> Spoil:
        CASES[name] = (target, spoil)
        return spoil
    return register


NOT_A_ZIP = ("{legacy} is not a complete torch.save archive \\(truncated, emptied or not a checkpoint\\): "
             "File is not a zip file")
NOT_METADATA = "{dist}/\\.metadata cannot be read as torch_dist metadata: [^\\n]+"


@_case("legacy truncated", "legacy")
def _legacy_truncated(root: Path, hf: Path) -> str:
    _cut(root / "legacy" / RANK_FILE, 0.5)
    return NOT_A_ZIP


@_case("legacy emptied", "legacy")
def _legacy_emptied(root: Path, hf: Path) -> str:
    _cut(root / "legacy" / RANK_FILE, 0.0)
    return NOT_A_ZIP


@_case("legacy random", "legacy")
def _legacy_random(root: Path, hf: Path) -> str:
    _write(root / "legacy" / RANK_FILE, os.urandom(100_000))
    return NOT_A_ZIP


@_case("legacy bit flip in a tensor", "legacy")
def _legacy_flip(root: Path, hf: Path) -> str:
    return _flip_legacy_embedding(root)


@_case("legacy bit flip in data.pkl", "legacy")
def _legacy_index_flip(root: Path, hf: Path) -> str:
    return _flip_legacy_index(root)


@_case("distcp truncated", "torch_dist")
def _distcp_truncated(root: Path, hf: Path) -> str:
    _cut(root / "torch_dist/iter_0000007/__0_0.distcp", 0.5)
    return ("the checkpoint {dist} has 1 truncated shard file\\(s\\): __0_0\\.distcp \\([0-9]+ bytes, its items "
            "need [0-9]+\\)")


@_case("distcp emptied", "torch_dist")
def _distcp_emptied(root: Path, hf: Path) -> str:
    _cut(root / "torch_dist/iter_0000007/__0_0.distcp", 0.0)
    return ("the checkpoint {dist} has 1 truncated shard file\\(s\\): "
            "__0_0\\.distcp \\(0 bytes, its items need [0-9]+\\)")


@_case("distcp bit flip", "torch_dist")
def _distcp_flip(root: Path, hf: Path) -> str:
    return _flip_distcp_embedding(root)


@_case(".metadata truncated", "torch_dist")
def _metadata_truncated(root: Path, hf: Path) -> str:
    _cut(root / "torch_dist/iter_0000007/.metadata", 0.5)
    return NOT_METADATA


@_case(".metadata random", "torch_dist")
def _metadata_random(root: Path, hf: Path) -> str:
    _write(root / "torch_dist/iter_0000007/.metadata", os.urandom(5000))
    return NOT_METADATA


@_case("metadata.json not JSON", "torch_dist")
def _metadata_json_bad(root: Path, hf: Path) -> str:
    _write(root / "torch_dist/iter_0000007/metadata.json", b"{")
    return ("{dist}/metadata\\.json cannot be read: Expecting property name enclosed in double quotes: line 1 "
            "column 2 \\(char 1\\)")


@_case("metadata.json a list", "torch_dist")
def _metadata_json_list(root: Path, hf: Path) -> str:
    _write(root / "torch_dist/iter_0000007/metadata.json", b"[]")
    return "{dist}/metadata\\.json holds a JSON list, not an object"


@_case("tracker reads abc", "legacy")
def _tracker(root: Path, hf: Path) -> str:
    _write(root / "legacy/latest_checkpointed_iteration.txt", b"abc")
    return ("{root}/legacy/latest_checkpointed_iteration\\.txt reads 'abc', not an iteration number or 'release' "
            "\\(give --iteration, or the iteration's directory\\)")


@_case("config.json truncated", "torch_dist")
def _config_truncated(root: Path, hf: Path) -> str:
    _cut(hf / "config.json", 0.5)
    return "--hf {hf}: {hf}/config\\.json is not JSON: Expecting .+ \\(char \\d+\\)"


@_case("verify: safetensors truncated", "verify")
def _safetensors_truncated(root: Path, hf: Path) -> str:
    _cut(hf / "model.safetensors", 0.5)
    return ("the checkpoint {hf} cannot be read: {hf}/model\\.safetensors: Error while deserializing header: "
            "incomplete metadata, file not fully covered")


@_case("verify: header of 1e12 bytes", "verify")
def _safetensors_huge_header(root: Path, hf: Path) -> str:
    data = (hf / "model.safetensors").read_bytes()
    _write(hf / "model.safetensors", struct.pack("<Q", 10**12) + data[8:])
    return ("the checkpoint {hf} cannot be read: {hf}/model\\.safetensors: Error while deserializing header: "
            "header too large")


@_case("verify: missing shard", "verify sharded")
def _safetensors_missing_shard(root: Path, hf: Path) -> str:
    os.remove(root / "sharded/model-00002-of-00002.safetensors")
    return "the checkpoint {root}/sharded cannot be read: model-00002-of-00002\\.safetensors is missing"


@pytest.mark.parametrize("case", list(CASES))
def test_bad_files_get_one_clear_line(saved, tmp_path, capsys, case):
    target, spoil = CASES[case]
    root = tmp_path / "copy"
    shutil.copytree(saved["legacy"].parent, root)
    hf = tmp_path / "hf"
    shutil.copytree(saved["hf"], hf)
    sharded = _sharded(root, hf) if target == "verify sharded" else None
    paths = {"legacy": root / "legacy" / RANK_FILE, "dist": root / "torch_dist" / "iter_0000007", "root": root,
             "hf": hf}
    expected = spoil(root, hf).format(**{k: re.escape(str(v)) for k, v in paths.items()})
    if target.startswith("verify"):
        argv = ["verify", str(saved["hf"]), str(sharded or hf)]
    else:
        argv = ["convert", str(root / target), "--hf", str(hf), "--out", str(tmp_path / "out")]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (code, out, err)
    (line,) = err.splitlines()
    assert re.fullmatch("error: " + expected, line), (line, expected)
    assert not (tmp_path / "out").exists()
