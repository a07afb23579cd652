"""The ``weightstream`` command line, in this process: the README's synopsis against the parser, one vocabulary,
examples in every ``--help``, the presets, the layout checks, ``verify``'s cap and the plain progress lines."""

from __future__ import annotations

import argparse
import io
import re
from pathlib import Path

import pytest

from weightstream.cli import build_parser, layout_problems, main, preset_size

README = Path(__file__).resolve().parents[1] / "README.md"


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}


def _synopsis() -> list[str]:
    """The commands of the README's "## Command line" block, each with its continuation lines joined."""
    section = README.read_text().split("\n## Command line\n", 1)[1]
    block = section.split("```\n", 2)[1]
    lines: list[str] = []
    for line in block.splitlines():
        if line.startswith("weightstream "):
            lines.append(line)
        elif line.strip():
            lines[-1] += " " + line.strip()
    return lines


def _stated(line: str) -> list[tuple[str, str | None]]:
    """Each ``--flag`` a synopsis line names, with the value it states (None: none)."""
    out = []
    for flag, value in re.findall(r"(--[a-z0-9-]+)(?: ([^\s\[\]()]+))?", line):
        out.append((flag, None if not value or value.startswith("--") or value in ("|", "...") else value))
    return out


@pytest.mark.unit
def test_readme_synopsis_names_every_option_of_every_command_with_its_real_default():
    parser = build_parser()
    commands = _commands(parser)
    global_options = set(_options(parser))
    seen: dict[str, set[str]] = {}
    for line in _synopsis()[1:]:
        name = line.split()[1]
        assert name in commands, line
        options = _options(commands[name])
        for flag, value in _stated(line):
            assert flag in options, (name, flag)
            action = options[flag]
            assert action.help != argparse.SUPPRESS, f"{name} {flag} is a deprecated spelling"
            seen.setdefault(name, set()).add(action.dest)
            if value is None or any(c.isupper() for c in value):
                continue  # a placeholder (N, DIR, F.json, T[,T...])
            if "|" in value or action.choices is not None and action.default is None:
                if action.choices is not None:
                    assert set(value.split("|")) == set(action.choices), (name, flag, value)
                continue
            convert = action.type if callable(action.type) else type(action.default)
            assert convert(value) == action.default, (name, flag, value, action.default)
    for name, command in commands.items():
        named = {a.dest for a in command._actions if a.option_strings and a.help != argparse.SUPPRESS
                 and not set(a.option_strings) & global_options}
        assert named <= seen.get(name, set()), (name, named - seen.get(name, set()))


@pytest.mark.unit
def test_every_help_ends_with_an_example(capsys):
    parser = build_parser()
    for args in ([], *([name] for name in _commands(parser))):
        with pytest.raises(SystemExit) as stop:
            main([*args, "--help"])
        assert stop.value.code == 0
        text = capsys.readouterr().out
        tail = text.rstrip().split("\n\nexample:\n", 1)
        assert len(tail) == 2, (args, text[-300:])
        assert all(line.startswith("  weightstream ") for line in tail[1].splitlines()), (args, tail[1])


@pytest.mark.unit
def test_one_vocabulary_and_the_former_spellings(capsys):
    parser = build_parser()
    commands = _commands(parser)
    for name in ("dump", "engine", "convert"):
        assert _options(commands[name])["--hf"].metavar == "DIR", name
    assert _options(commands["dump"])["--megatron-dtype"].default == "float32"
    assert _options(commands["convert"])["--dtype"].default is None  # the dtype written
    for name in ("demo", "dump", "convert", "bench"):
        usage = commands[name].format_usage()
        assert "tiny-qwen3," not in usage and "--preset NAME" in usage, usage
        assert "weightstream presets" in " ".join(commands[name].format_help().split())
    former = [
        (["convert", "C", "--hf-config", "tiny-qwen3", "--out", "o"], "--hf-config", "hf_config", "tiny-qwen3"),
        (["engine", "--model", "m"], "--model", "hf", "m"),
        (["dump", "--preset", "tiny-qwen3", "--dtype", "bfloat16", "--out", "o"], "--dtype", "megatron_dtype",
         "bfloat16"),
        (["bench", "--soak", "4", "--transports", "broadcast,p2p"], "--transports", "transport", ("broadcast", "p2p")),
    ]
    for argv, flag, dest, want in former:
        assert getattr(parser.parse_args(argv), dest) == want
        (note,) = capsys.readouterr().err.splitlines()
        assert note.startswith(f"note: {flag} is deprecated; use --"), note
        assert "deprecated" not in commands[argv[0]].format_help()
    # Lists: comma-separated, repeatable, given values replacing the default.
    args = parser.parse_args(["bench", "--transport", "stream,ipc", "--transport", "p2p", "--lr", "1e-4"])
    assert args.transport == ("stream", "ipc", "p2p") and args.lr == (1e-4,)
    assert parser.parse_args(["bench", "--delta", "--transport", "p2p"]).lr == (1e-6, 1e-5)


@pytest.mark.unit
def test_a_bad_command_line_is_one_error_line(capsys):
    for argv in (["dump", "--preset", "nope", "--out", "o"], ["dump", "--hf", "d", "--out", "o", "--tp", "0"],
                 ["bench", "--transport", "stream,udp"], ["verify"], ["nope"]):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), (argv, err)


@pytest.mark.unit
def test_presets_lists_every_preset_with_its_type_and_size(capsys):
    from weightstream.models.presets import PRESETS

    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["preset", "model_type", "size"] and lines[-1].startswith("20 presets")
    rows = {line.split()[0]: line.split(None, 2) for line in lines[1:-1]}
    assert sorted(rows) == sorted(PRESETS)
    assert rows["qwen3-30b-a3b"][1:] == ["qwen3_moe", "48 layers, hidden 2048, 32 heads (4 kv), 128 experts (top 8), "
                                                      "vocab 151,936"]
    assert rows["tiny-qwen3"][2] == preset_size(PRESETS["tiny-qwen3"]) == ("4 layers, hidden 64, 8 heads (4 kv), "
                                                                             "vocab 1,000")


@pytest.mark.unit
def test_layouts_are_checked_against_the_model_with_every_problem():
    from weightstream.converters.registry import model_spec
    from weightstream.models.parallel import Layout
    from weightstream.models.presets import preset_config

    qwen3, moe = model_spec(preset_config("tiny-qwen3")), model_spec(preset_config("tiny-qwen3-moe"))
    for ok in (Layout(2, 2), Layout(4, 1), Layout(8, 1), Layout(1, 2, 2), Layout(1, 4)):
        assert layout_problems(qwen3, ok) == [], ok
    assert layout_problems(qwen3, Layout(5, 3, ep=2)) == [
        "--tp 5 does not divide the 8 attention heads", "--tp 5 neither divides the 4 key/value heads nor is a "
        "multiple of them", "--tp 5 does not divide the MLP width 96", "--pp 3 does not divide the 4 layers",
        "--ep / --etp need a mixture-of-experts model; qwen3 has no experts"]
    assert layout_problems(qwen3, Layout(1, 1, 2)) == ["--vpp needs --pp of 2 or more"]
    assert layout_problems(qwen3, Layout(1, 2, 4)) == ["--vpp 4 does not divide the 2 layers of each stage"]
    assert layout_problems(moe, Layout(2, 1, ep=4)) == []
    assert layout_problems(moe, Layout(1, 1, ep=3, etp=3)) == [
        "--ep 3 does not divide the 8 experts", "expert TP 3 (--etp, else --tp) does not divide the experts' width 32"]


@pytest.mark.unit
def test_verify_lists_the_first_of_each_kind_then_the_count():
    from weightstream.checks.compare import Comparison

    cmp = Comparison(differ=[f"t{i}: max abs difference 1" for i in range(25)], compared=25)
    lines = cmp.render("a", "b").splitlines()
    assert lines[0] == "values differ (25):" and lines[1:21] == [f"  - t{i}: max abs difference 1" for i in range(20)]
    assert lines[21:] == ["  … and 5 more", "DIFFERENT: 25 tensors compared, 0.0 MB"]
    assert len(cmp.render("a", "b", limit=None).splitlines()) == 27


@pytest.mark.unit
def test_soak_report_says_when_no_window_follows_the_warm_up():
    from weightstream.bench.soak import SoakReport, _measure_growth

    sample = {"update": 4, "shm": 0, "trainer_rss_mb": 1.0, "trainer_fds": 1, "trainer_threads": 1,
              "engine_rss_mb": 1.0, "engine_fds": 1, "engine_threads": 1}
    report = SoakReport(4, ["broadcast"], "tiny-qwen3", 1, 1 << 18, warmup=10, samples=[sample])
    _measure_growth(report, 10)
    assert "growth not measured: no resource sample falls after a warm-up of 10 updates and before the last of 4" \
        in report.render()
    report = SoakReport(40, ["broadcast"], "tiny-qwen3", 1, 1 << 18, warmup=10,
                        samples=[{**sample, "update": u} for u in (10, 20, 30, 40)])
    report.samples[-1]["trainer_fds"] = 3
    report.samples[-2]["trainer_fds"] = 2
    _measure_growth(report, 10)
    assert "growth after warm-up (10 updates): trainer RSS +0.0 MB, fds +1," in report.render()


@pytest.mark.unit
def test_plain_progress_lines_at_each_phase_and_after_silence():
    import time

    from weightstream.common.progress import Progress

    out = io.StringIO()
    with Progress("dump", stream=out, every=0.2, quiet=0.0, terminal=False) as progress:
        progress.phase("building")
        for done in range(1, 4):
            progress.count(done, 3)
        time.sleep(0.5)
    lines = out.getvalue().splitlines()
    assert re.fullmatch(r"dump: building, 0\.\d s", lines[0]), lines
    assert re.fullmatch(r"dump: bucket 3/3, 0\.\d s", lines[1]), lines  # 1/3 and 2/3 within 0.2 s: skipped
    assert len(lines) >= 3 and all(re.fullmatch(r"dump: bucket 3/3, \d\.\d s", line) for line in lines[2:]), lines
    quiet = io.StringIO()
    with Progress("dump", stream=quiet, every=0.2, quiet=10.0, terminal=False) as progress:
        progress.phase("building")
    assert quiet.getvalue() == ""  # a step that ends at once prints nothing
