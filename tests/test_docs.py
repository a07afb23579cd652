"""Every code block in README.md and docs/ is checked: run by a test as written (``<!-- example:NAME -->``), or
marked ``<!-- not-run: REASON -->`` with its reason; and every ``weightstream`` command in them parses with the
command line as it is."""

from __future__ import annotations

import re
import shlex

import pytest

from tests.helpers.docs import ROOT, all_blocks

pytestmark = pytest.mark.unit

LANGS = {"python", "bash", "toml"}


def _tests_text() -> str:
    return "\n".join(p.read_text() for p in sorted((ROOT / "tests").rglob("*.py")) if p.name != "docs.py")


def test_every_block_is_run_or_says_why_not():
    problems, names = [], []
    tests = _tests_text()
    for b in all_blocks():
        if b.lang and b.lang not in LANGS:
            problems.append(f"{b.where}: a block in {b.lang!r}, a language no test runs")
        if not b.lang:
            continue
        if b.kind == "":
            problems.append(f"{b.where}: no <!-- example:NAME --> or <!-- not-run: REASON --> before it")
        elif b.kind == "not-run" and len(b.label.split()) < 3:
            problems.append(f"{b.where}: not run, without a reason")
        elif b.kind == "example":
            names.append(b.label)
            if f"example:{b.label}" not in tests:
                problems.append(f"{b.where}: example:{b.label}, which no test names")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    assert not duplicates, f"examples named twice: {duplicates}"
    assert problems == []


def commands(text: str) -> list[str]:
    """The ``weightstream`` commands of a shell block, as a user would type one: continuations joined,
    comments dropped, ``[optional]`` parts left out and the first of ``a|b`` taken."""
    out = []
    for line in text.replace("\\\n", " ").split("\n"):
        line = line.split(" #", 1)[0].strip()
        words = line.split()
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
            words.pop(0)  # VAR=value before the command
        if not words or words[0] != "weightstream":
            continue
        line = " ".join(words)
        while re.search(r"\[[^\[\]]*\]", line):
            line = re.sub(r"\s*\[[^\[\]]*\]", "", line)
        out.append(re.sub(r"(\S+?)\|\S+", r"\1", line))
    return out


def test_every_documented_command_parses():
    from weightstream.cli import build_parser

    failed = []
    for b in all_blocks():
        if b.lang != "bash":
            continue
        for command in commands(b.text):
            try:
                build_parser().parse_args(shlex.split(command)[1:])
            except SystemExit:
                failed.append(f"{b.where}: {command}")
    assert failed == []


def test_commands_are_read_as_typed():
    text = "A=1 B=2 weightstream bench --transport p2p|broadcast [--tiny] \\\n  --repeats 3  # three\nls\n"
    assert commands(text) == ["weightstream bench --transport p2p --repeats 3"]
