"""An output directory appears complete or not at all, and a killed command leaves no process behind.

``convert`` / ``dump`` / ``save_hf_checkpoint`` write beside the output directory and move the result into
place whole: a SIGKILL mid-write leaves the older checkpoint that was there, bit for bit; a non-empty
directory is refused unless ``--overwrite``, which replaces it whole (stale shards of an older layout
gone); write errors end in one line naming the directory and the cause. Real Megatron-Core saves, real
processes, real filesystems (tmpfs mounts in a private mount namespace for the full and read-only cases).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from weightstream.checks.compare import compare_checkpoints
from weightstream.common.hf_files import INDEX_NAME
from weightstream.convert import convert_checkpoint
from weightstream.jobs import Layout
from weightstream.launch import launch
from weightstream.models.presets import preset_config, save_random_checkpoint

ROOT = Path(__file__).resolve().parents[1]
BUCKET, SHARD = 10_000, 100_000  # tiny-qwen3 (47 tensors, 1.2 MB): dozens of buckets, a dozen files
TENSORS = 47

# A conversion slowed by 50 ms per bucket (its progress callback), so that it can be killed mid-write.
SLOW_CONVERT = f"""
import sys, time
from weightstream.convert import convert_checkpoint
save, hf, out = sys.argv[1:4]
convert_checkpoint(save, hf, out, bucket_bytes={BUCKET}, shard_bytes={SHARD}, overwrite=True,
                   progress=lambda done, total: time.sleep(0.05))
"""

# Two ranks that say who they are, then sleep: launched from the main thread, as the CLI does.
SLEEPERS = """
import sys
from tests.test_atomic_output import mark_and_sleep
from weightstream.launch import launch
if __name__ == "__main__":
    launch(2, mark_and_sleep, sys.argv[1], 300.0)
"""

# The command's entry point on each case, in one process: its exit status and what it printed on stderr.
CLI_CASES = """
import contextlib, io, json, sys
from weightstream.cli import main
if __name__ == "__main__":
    for argv in json.loads(sys.argv[1]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except BaseException as exc:
                rc = f"raised {type(exc).__name__}: {exc}"
        print(json.dumps({"rc": rc, "stderr": err.getvalue()}), flush=True)
"""


def mark_and_sleep(directory: str, seconds: float) -> None:
    """A launched rank: writes its pid to ``rank-<r>.pid``, then sleeps."""
    import torch.distributed as dist

    Path(directory, f"rank-{dist.get_rank()}.pid").write_text(str(os.getpid()))
    time.sleep(seconds)


@pytest.fixture(scope="module")
def saves(tmp_path_factory) -> dict[str, tuple[str, Path]]:
    """Two tiny Qwen3 models of the same shapes with different weights ("old", "new"), each saved by a real
    Megatron-Core TP 2 job in torch_dist format: name -> (HF source directory, Megatron save)."""
    from tests.helpers.megatron_saves import run_saves
    from tests.helpers.workers import Case

    root = tmp_path_factory.mktemp("atomic")
    hf = {name: save_random_checkpoint(preset_config("tiny-qwen3"), root / f"hf-{name}", seed=seed)
          for name, seed in (("old", 61), ("new", 62))}
    launch(2, run_saves, [(Case(hf[name], Layout(2, 1)), str(root / name)) for name in hf])
    return {name: (hf[name], root / name / "torch_dist") for name in hf}


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _env(**extra: str) -> dict[str, str]:
    """This checkout's code in the processes a test starts, whatever their script's directory."""
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "weightstream.cli", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300, check=False)


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid``, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_a_kill_mid_write_leaves_the_old_checkpoint(saves, tmp_path):
    old_hf, old_save = saves["old"]
    new_hf, new_save = saves["new"]
    out = tmp_path / "out"
    convert_checkpoint(old_save, old_hf, out, bucket_bytes=BUCKET, shard_bytes=SHARD)
    before = _files(out)
    shards = set(json.loads(before[INDEX_NAME])["weight_map"].values())
    assert len(shards) > 4 and set(before) == {"config.json", "generation_config.json", INDEX_NAME} | shards
    script = tmp_path / "slow.py"
    script.write_text(SLOW_CONVERT)
    with open(tmp_path / "slow.log", "w") as log:
        proc = subprocess.Popen([sys.executable, str(script), str(new_save), new_hf, str(out)], cwd=ROOT,
                                env=_env(), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while not list(tmp_path.glob("out.partial-*/model-*.safetensors")):  # the first file of the new one
        assert proc.poll() is None, (tmp_path / "slow.log").read_text()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    # Exactly the old checkpoint, file for file and byte for byte; and it loads as the old weights.
    assert _files(out) == before
    cmp = compare_checkpoints(old_hf, out)
    assert cmp.ok and cmp.compared == TENSORS, cmp.render(old_hf, str(out))
    # Beside it, the killed run's staging directory, named as such, with no index: never a checkpoint.
    (leftover,) = [p for p in tmp_path.iterdir() if p.name.startswith("out.")]
    assert re.fullmatch(rf"out\.partial-{proc.pid}-[0-9a-f]{{8}}", leftover.name), leftover.name
    assert not (leftover / INDEX_NAME).exists()
    # The next run to the same place removes it and replaces the old checkpoint whole.
    convert_checkpoint(new_save, new_hf, out, bucket_bytes=BUCKET, shard_bytes=SHARD, overwrite=True)
    cmp = compare_checkpoints(new_hf, out)
    assert cmp.ok and cmp.compared == TENSORS, cmp.render(new_hf, str(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "slow.log", "slow.py"]


def test_a_non_empty_directory_is_refused_unless_overwrite(saves, tmp_path):
    old_hf, old_save = saves["old"]
    new_hf, new_save = saves["new"]
    # An empty directory is fine.
    (tmp_path / "empty").mkdir()
    convert_checkpoint(new_save, new_hf, tmp_path / "empty", bucket_bytes=BUCKET)
    assert compare_checkpoints(new_hf, tmp_path / "empty").ok
    # A directory holding an older layout (a dozen files) and a file of the user's.
    out = tmp_path / "out"
    convert_checkpoint(old_save, old_hf, out, bucket_bytes=BUCKET, shard_bytes=SHARD)
    (out / "notes.txt").write_text("mine")
    before = _files(out)
    run = _cli("convert", str(new_save), "--hf", new_hf, "--out", str(out))
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines() == [
        (f"error: {out} is not empty (it holds {len(before)} files); refusing to write the checkpoint into it: "
         f"pass overwrite=True (--overwrite) to replace it, or choose an empty or new directory")]
    assert _files(out) == before
    # --overwrite, written by two processes (each its own files of one staging directory): replaced whole.
    run = _cli("convert", str(new_save), "--hf", new_hf, "--out", str(out), "--overwrite", "--procs", "2",
               "--shard-mb", "0.4")
    assert run.returncode == 0, run.stderr
    shards = set(json.loads((out / INDEX_NAME).read_text())["weight_map"].values())
    assert len(shards) == 3
    assert set(os.listdir(out)) == {"config.json", "generation_config.json", INDEX_NAME} | shards
    cmp = compare_checkpoints(new_hf, out)
    assert cmp.ok and cmp.compared == TENSORS, cmp.render(new_hf, str(out))
    assert sorted(os.listdir(tmp_path)) == ["empty", "out"]


def test_a_path_under_a_file_is_one_clear_error(saves, tmp_path):
    from weightstream.common.staging import OutputDirectoryError

    new_hf, new_save = saves["new"]
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(OutputDirectoryError) as err:
        convert_checkpoint(new_save, new_hf, blocker / "out")
    assert str(err.value) == f"cannot create {blocker / 'out'}: {blocker} is a file, not a directory"
    with pytest.raises(OutputDirectoryError) as err:
        convert_checkpoint(new_save, new_hf, blocker)
    assert str(err.value) == f"{blocker} exists and is not a directory"
    assert sorted(os.listdir(tmp_path)) == ["a-file"]


def _private_mounts() -> bool:
    """Whether this machine lets a process mount tmpfs in a mount namespace of its own (``unshare``)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            "mount -t tmpfs -o size=64k none /mnt"], capture_output=True, check=False)
    return probe.returncode == 0


@pytest.mark.skipif(not _private_mounts(), reason="needs unshare and tmpfs mounts in a user namespace")
def test_a_full_or_read_only_disk_is_one_clear_error(saves, tmp_path):
    """``convert`` and ``dump`` (TP 2: the error comes from a rank) onto a 256 KiB tmpfs (the 1.2 MB
    checkpoint does not fit) and into a read-only tmpfs: exit status 2, one line naming the directory and
    the cause, nothing left on either filesystem."""
    new_hf, new_save = saves["new"]
    full, read_only = tmp_path / "full", tmp_path / "ro"
    full.mkdir()
    read_only.mkdir()
    cases = [
        ["convert", str(new_save), "--hf", new_hf, "--out", str(full / "out")],
        ["convert", str(new_save), "--hf", new_hf, "--out", str(read_only / "out")],
        ["dump", "--preset", "tiny-qwen3", "--tp", "2", "--out", str(full / "dump")],
        ["dump", "--preset", "tiny-qwen3", "--tp", "2", "--out", str(read_only / "dump")],
    ]
    script = tmp_path / "cases.py"
    script.write_text(CLI_CASES)
    shell = (f"mount -t tmpfs -o size=256k none {full} && mount -t tmpfs -o ro none {read_only} && "
             f"{sys.executable} {script} '{json.dumps(cases)}' && ls -A {full} {read_only}")
    run = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", shell], cwd=ROOT,
                         env=_env(), capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    results = [json.loads(line) for line in lines[:len(cases)]]
    assert [r["rc"] for r in results] == [2, 2, 2, 2], results
    assert [r["stderr"].splitlines()[-1] for r in results] == [
        (f"error: cannot write the checkpoint to {full / 'out'}: No space left on device "
         f"(writing model-00001-of-00001.safetensors)"),
        f"error: cannot create {read_only / 'out'}: {read_only} is on a read-only file system",
        (f"error: cannot write the checkpoint to {full / 'dump'}: No space left on device "
         f"(writing model-00001-of-00001.safetensors)"),
        f"error: cannot create {read_only / 'dump'}: {read_only} is on a read-only file system",
    ], results
    assert all("Traceback" not in r["stderr"] for r in results), results
    # ``ls -A`` of the two mounts after the runs: their names, and nothing in them.
    assert lines[len(cases):] == [f"{full}:", "", f"{read_only}:"], lines


def test_leftovers_are_removed_kept_or_put_back(tmp_path):
    """What killed runs left beside the target: removed when their writer is dead, kept while it runs; an
    old directory set aside by a run killed between its two renames is put back (and then refused)."""
    from weightstream.common.staging import OutputDirectoryError, StagedDirectory

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    alive = subprocess.Popen(["sleep", "60"])
    try:
        out = tmp_path / "out"
        for name in (f"out.old-{dead_pid}-0a0b0c0d", f"out.partial-{dead_pid}-01020304",
                     f"out.partial-{alive.pid}-05060708"):
            (tmp_path / name).mkdir()
            (tmp_path / name / "model.safetensors.index.json").write_text(name)
        with pytest.raises(OutputDirectoryError, match=re.escape(f"{out} is not empty (it holds 1 file)")):
            StagedDirectory.create(out)
        assert (out / INDEX_NAME).read_text() == f"out.old-{dead_pid}-0a0b0c0d"
        assert sorted(os.listdir(tmp_path)) == ["out", f"out.partial-{alive.pid}-05060708"]
        staged = StagedDirectory.create(out, overwrite=True)
        assert staged.path.parent == tmp_path and staged.path.name.startswith(f"out.partial-{os.getpid()}-")
        (staged.path / "config.json").write_text("{}")
        staged.commit()
        assert sorted(os.listdir(out)) == ["config.json"]
        assert sorted(os.listdir(tmp_path)) == ["out", f"out.partial-{alive.pid}-05060708"]
    finally:
        alive.kill()
        alive.wait()


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_killed_launcher_leaves_no_process(tmp_path, start_method):
    """SIGKILL the process that launched two ranks: its fork server (if any), the ranks and multiprocessing's
    helpers are gone within seconds, not left waiting out their collectives' timeout."""
    script = tmp_path / "sleepers.py"
    script.write_text(SLEEPERS)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], cwd=ROOT,
                            env=_env(WEIGHTSTREAM_START_METHOD=start_method),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while len(list(tmp_path.glob("rank-*.pid"))) < 2:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    while not all(p.read_text().strip().isdigit() for p in tmp_path.glob("rank-*.pid")):  # each file complete
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ranks = {int(p.read_text()) for p in tmp_path.glob("rank-*.pid")}
    below = _descendants(proc.pid)
    assert ranks <= below and len(below) >= (4 if start_method == "forkserver" else 3), (ranks, below)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    killed = time.monotonic()
    while any(_running(pid) for pid in below) and time.monotonic() < killed + 10:
        time.sleep(0.05)
    left = sorted(pid for pid in below if _running(pid))
    assert left == [], [Path(f"/proc/{pid}/cmdline").read_bytes()[:120] for pid in left]
    assert time.monotonic() - killed < 5
