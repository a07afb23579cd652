"""The ``weightstream`` command run as a user runs it (a process of its own, stderr a pipe): every user error
is one line, ``--help`` answers at once, and a long step is never silent."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest


def run(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "weightstream.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Directories a user might point the command at: empty, a config.json of a model type nobody knows, a
    config.json that is not JSON, and a tiny Qwen3's config without weights."""
    from weightstream.models.presets import preset_config

    root = tmp_path_factory.mktemp("inputs")
    out = {name: root / name for name in ("empty", "unknown", "not-json", "qwen3")}
    for d in out.values():
        d.mkdir()
    (out["unknown"] / "config.json").write_text(json.dumps({"model_type": "no_such_model", "hidden_size": 8}))
    (out["not-json"] / "config.json").write_text('{"model_type": ')
    preset_config("tiny-qwen3").save_pretrained(out["qwen3"])
    return {k: str(v) for k, v in out.items()}


def _bad_inputs(d: dict[str, str], out: str) -> list[tuple[list[str], str]]:
    """(command line, what its one error line says) for each kind of bad input to each command."""
    cases = [
        (["dump", "--hf", "/no/such/dir", "--out", out], "--hf /no/such/dir: no such directory"),
        (["dump", "--hf", d["empty"], "--out", out], "has no config.json"),
        (["dump", "--hf", d["unknown"], "--out", out], "no converter is registered for model_type 'no_such_model'"),
        (["dump", "--hf", d["not-json"], "--out", out], "config.json is not JSON"),
        (["dump", "--preset", "tiny-qwen3", "--tp", "3", "--out", out], "--tp 3 does not divide the 8 attention"),
        (["dump", "--preset", "tiny-qwen3-moe", "--ep", "3", "--out", out], "--ep 3 does not divide the 8 experts"),
        (["dump", "--preset", "tiny-qwen3", "--tp", "0", "--out", out], "argument --tp: must be at least 1"),
        (["dump", "--preset", "no-such-preset", "--out", out], "unknown preset 'no-such-preset'"),
        (["dump", "--preset", "tiny-qwen3", "--megatron-dtype", "int8", "--out", out], "invalid choice: 'int8'"),
        (["dump", "--preset", "tiny-qwen3", "--out", d["qwen3"]], "is not empty"),
        (["demo", "--engine-tp", "3"], "engine TP 3 does not divide the attention heads (8)"),
        (["demo", "--pp", "3"], "--pp 3 does not divide the 4 layers"),
        (["demo", "--preset", "no-such-preset"], "unknown preset"),
        (["convert", "/no/such/ckpt", "--preset", "tiny-qwen3", "--out", out], "/no/such/ckpt: no such directory"),
        (["convert", d["empty"], "--preset", "tiny-qwen3", "--out", out], "not a Megatron checkpoint"),
        (["convert", d["empty"], "--hf", d["unknown"], "--out", out], "no converter is registered"),
        (["convert", d["empty"], "--preset", "tiny-qwen3", "--dtype", "fp7", "--out", out], "invalid choice"),
        (["verify", "/no/such/dir", d["empty"]], "not a directory: /no/such/dir"),
        (["verify", d["empty"], d["qwen3"]], d["empty"]),
        (["engine", "--hf", "/no/such/dir"], "has no config.json"),
        (["engine", "--hf", d["qwen3"], "--tp", "3"], "engine TP 3 does not divide"),
        (["engine", "--hf", d["unknown"]], "no_such_model"),
        (["bench"], "one of --transport T, --soak N or --from-json F.json is required"),
        (["bench", "--soak", "3", "--transport", "stream"], "--soak rotates through broadcast, ipc, p2p only"),
        (["bench", "--transport", "stream", "--preset", "no-such-preset"], "unknown preset"),
        (["bench", "--from-json", "/no/such.json"], "no such file: /no/such.json"),
    ]
    if importlib.util.find_spec("matplotlib") is None:
        cases.append((["bench", "--transport", "stream", "--plot", out + ".png"], "--plot needs matplotlib"))
    return cases


# A few cases through the entry point in a process of its own (argparse's own check, two of bench's, and the
# engine's check of a model's config, which imports torch and transformers first): the real process prints the
# one line and exits 2. The others call ``main`` in this process (:func:`_in_process`), with the same assertions.
_IN_A_PROCESS = ("argument --tp: must be at least 1",
                 "one of --transport T, --soak N or --from-json F.json is required",
                 "no such file: /no/such.json", "engine TP 3 does not divide")


# What ``main`` sets for the processes a command starts (weightstream.common.quiet), put back after each case.
_CHILD_ENV = ("PYTHONWARNINGS", "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY", "TOKENIZERS_PARALLELISM")


def _in_process(argv: list[str], capfd: pytest.CaptureFixture[str]) -> SimpleNamespace:
    """``main(argv)``, the function the console script calls, in this process: its exit status, stdout and
    stderr (at the descriptors). The environment and warning filters it sets are put back."""
    from weightstream.cli import main

    saved = {name: os.environ.get(name) for name in _CHILD_ENV}
    capfd.readouterr()
    try:
        with warnings.catch_warnings():
            try:
                status = main(argv)
            except SystemExit as exc:  # argparse's own errors end in sys.exit, as in the console script
                status = exc.code
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    out, err = capfd.readouterr()
    return SimpleNamespace(returncode=status, stdout=out, stderr=err)


def test_every_user_error_of_every_command_is_one_line_and_exit_status_2(dirs, tmp_path, capfd):
    out = str(tmp_path / "out")
    cases = _bad_inputs(dirs, out)
    apart = [case for case in cases if case[1] in _IN_A_PROCESS]
    assert len(apart) == len(_IN_A_PROCESS)
    with ThreadPoolExecutor(2) as pool:
        separate = list(pool.map(lambda case: run(*case[0]), apart))
    results = [separate[apart.index(case)] if case in apart else _in_process(case[0], capfd)
               for case in cases]
    wrong = []
    for (argv, says), res in zip(cases, results, strict=True):
        lines = res.stderr.splitlines()
        if not (res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0]
                and res.stdout == ""):
            wrong.append((argv, res.returncode, res.stderr[-2000:]))
    assert wrong == []
    assert not os.path.exists(out) and not os.path.exists(out + ".png")  # nothing started, nothing written


def test_with_v_the_error_comes_after_its_traceback(dirs, tmp_path, capfd):
    """The first in a process of its own, the second through ``main`` in this one."""
    for argv, how in ((["-v", "dump", "--preset", "tiny-qwen3", "--tp", "3", "--out", str(tmp_path / "o")], "process"),
                      (["engine", "--hf", dirs["unknown"], "-v"], "main")):
        res = run(*argv) if how == "process" else _in_process(argv, capfd)
        lines = res.stderr.splitlines()
        assert res.returncode == 2 and lines[0] == "Traceback (most recent call last):", res.stderr
        assert lines[-1].startswith("error: ") and sum(line.startswith("error: ") for line in lines) == 1


def test_help_answers_at_once_and_import_loads_no_torch():
    for args in (["--help"], ["dump", "--help"], ["presets"]):
        start = time.perf_counter()
        res = run(*args)
        seconds = time.perf_counter() - start
        assert res.returncode == 0 and res.stderr == "", res.stderr
        assert seconds < 5, (args, seconds)  # a sanity bound: about 0.2 s on a 2-core machine
    probe = ("import sys, weightstream, weightstream.cli; weightstream.cli.build_parser(); "
             "assert 'torch' not in sys.modules")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).returncode == 0


def test_dump_with_stderr_a_pipe_prints_progress_lines_never_far_apart(tmp_path):
    out = tmp_path / "dump"
    proc = subprocess.Popen([sys.executable, "-m", "weightstream.cli", "dump", "--preset", "tiny-qwen3", "--tp", "2",
                             "--bucket-mb", "0.1", "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    arrivals: list[tuple[float, str]] = [(time.monotonic(), line.rstrip("\n")) for line in proc.stderr]
    assert proc.wait(timeout=300) == 0, arrivals
    lines = [line for _, line in arrivals]
    pattern = re.compile(r"dump: (.+), (\d+\.\d) s")
    assert all(pattern.fullmatch(line) for line in lines), lines
    said = [pattern.fullmatch(line).group(1) for line in lines]  # type: ignore[union-attr]
    for phase in ("starting 2 local processes (TP 2 × PP 1)", "building the Megatron-Core model on 2 ranks",
                  "loading the weights into it", "streaming to disk"):
        assert any(s.startswith(phase) for s in said), (phase, said)
    buckets = [s for s in said if s.startswith("bucket ")]
    assert len(buckets) >= 1 and re.fullmatch(r"bucket (\d+)/\1", buckets[-1]), said  # down to the last
    # Never silent for long: lines at most every 3 s, so no gap near 5 s (printed and received).
    stamps = [float(pattern.fullmatch(line).group(2)) for line in lines]  # type: ignore[union-attr]
    assert max(b - a for a, b in zip(stamps, stamps[1:], strict=False)) <= 4.5, lines
    received = [t for t, _ in arrivals]
    assert max(b - a for a, b in zip(received, received[1:], strict=False)) <= 5.0, arrivals


def test_a_reader_that_stops_early_is_not_an_error():
    """``weightstream presets | head -1``: the command ends quietly when its reader goes away."""
    proc = subprocess.Popen([sys.executable, "-m", "weightstream.cli", "presets"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().split() == ["preset", "model_type", "size"]
    proc.stdout.close()
    assert (proc.wait(timeout=60), proc.stderr.read()) == (0, "")
