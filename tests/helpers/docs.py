"""The fenced code blocks of README.md and docs/*.md, with the marker that says how each is checked.

A block in a language (```python, ```bash, ```toml) follows one of two markers on the line before it:

- ``<!-- example:NAME -->``: a test runs it as written; the test names ``example:NAME``.
- ``<!-- not-run: REASON -->``: it cannot run here as written, and the reason says why (and what checks it instead).

Blocks with no language (diagrams, a command's synopsis) are text; the synopsis is checked against the parser
by tests/test_cli_usage.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
MARKER = re.compile(r"<!-- (example|not-run):\s*(.*?)\s*-->")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    kind: str  # "example", "not-run" or "" (no marker)
    label: str  # the example's name, or why it is not run
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = MARKER.fullmatch(lines[i - 1].strip()) if i else None
        kind, label = (marker.group(1), marker.group(2)) if marker else ("", "")
        out.append(Block(path, i + 1, lines[i][3:].strip(), kind, label, "\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    return out


def all_blocks() -> list[Block]:
    return [b for path in DOCS for b in blocks(path)]


def example(name: str) -> Block:
    """The one block marked ``<!-- example:NAME -->``."""
    (found,) = [b for b in all_blocks() if b.kind == "example" and b.label == name]
    return found
