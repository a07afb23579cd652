"""Two HF checkpoints compared tensor by tensor: what ``weightstream verify`` and ``convert --verify`` run.

:func:`compare_checkpoints` reads both directories one tensor at a time and returns a :class:`Comparison` that
lists every difference it found, of every kind (it never stops at the first); :meth:`Comparison.render` is the
report the command prints.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from weightstream.common.hf_files import CheckpointReader, HFCheckpointError

__all__ = ["Comparison", "compare_checkpoints"]

# The kinds of finding about a tensor both checkpoints hold, as Comparison names its fields.
_SHAPE, _DTYPE, _DIFFER, _NOTE = "shape", "dtype", "differ", "dtype_notes"


@dataclass(frozen=True, slots=True)
class Comparison:
    """What :func:`compare_checkpoints` found: every tensor of each kind of difference, sorted by name.

    ``missing``: names in A, not in B; ``extra``: names in B, not in A; ``shape``, ``dtype``, ``differ``: one line
    per tensor held by both (``name: what differs``); ``dtype_notes``: with a tolerance, tensors of different
    dtypes whose values were compared as float (a note, not a difference); ``compared``: the tensors whose values
    were compared; ``bytes``: their size in A."""

    missing: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    shape: tuple[str, ...] = ()
    dtype: tuple[str, ...] = ()
    differ: tuple[str, ...] = ()
    dtype_notes: tuple[str, ...] = ()
    compared: int = 0
    bytes: int = 0

    @property
    def ok(self) -> bool:
        """True when the checkpoints hold the same names, shapes, dtypes (or, with a tolerance, dtypes noted) and
        values; False when any difference was found."""
        return not (self.missing or self.extra or self.shape or self.dtype or self.differ)

    def render(self, a: str, b: str, limit: int | None = 20) -> str:
        """The report, as lines: each kind of difference with its first ``limit`` tensors (None: all) and how
        many more, then the verdict (``identical`` or ``DIFFERENT``), the tensors compared and their megabytes.
        ``a`` and ``b`` name the two checkpoints in the headings."""
        lines = []
        for title, items in (
            (f"in {a} but not in {b}", self.missing),
            (f"in {b} but not in {a}", self.extra),
            ("shapes differ", self.shape),
            ("dtypes differ", self.dtype),
            ("values differ", self.differ),
            ("note: dtypes differ, values compared as float within the tolerance", self.dtype_notes),
        ):
            if items:
                lines.append(f"{title} ({len(items)}):")
                lines.extend(f"  - {x}" for x in items[:limit])
                if limit is not None and len(items) > limit:
                    lines.append(f"  … and {len(items) - limit} more")
        verdict = "identical" if self.ok else "DIFFERENT"
        lines.append(f"{verdict}: {self.compared} tensors compared, {self.bytes / 1e6:.1f} MB")
        return "\n".join(lines)


def compare_checkpoints(a: str | os.PathLike[str], b: str | os.PathLike[str], *, atol: float = 0.0) -> Comparison:
    """Compare every tensor of two HF checkpoint directories; returns the :class:`Comparison`, every difference
    listed.

    With ``atol`` 0 (the default) the values are compared bit for bit and a dtype that differs is a difference.
    With ``atol`` > 0 the values are compared as float (float64 where either is) within ``atol``, and a dtype that
    differs is only a note. A negative or NaN ``atol`` raises ValueError. A directory that cannot be read (no
    weights, a missing, truncated or damaged file) raises :class:`~weightstream.common.hf_files.HFCheckpointError`;
    when both cannot be read, one error names both."""
    if not atol >= 0.0:
        raise ValueError(f"atol must be 0 or more, got {atol}")
    with _readers(a, b) as (ra, rb):
        return _compare(ra, rb, atol)


@contextlib.contextmanager
def _readers(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> Iterator[tuple[CheckpointReader,
                                                                                      CheckpointReader]]:
    """Both checkpoints opened, or one error for what cannot be read (the only one's own when one fails)."""
    with contextlib.ExitStack() as stack:
        readers, errors = [], []
        for directory in (a, b):
            try:
                readers.append(stack.enter_context(CheckpointReader(directory)))
            except HFCheckpointError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise HFCheckpointError("; ".join(str(e) for e in errors))
        yield readers[0], readers[1]


def _compare(ra: CheckpointReader, rb: CheckpointReader, atol: float) -> Comparison:
    ka, kb = set(ra.keys()), set(rb.keys())
    found: dict[str, list[str]] = {_SHAPE: [], _DTYPE: [], _DIFFER: [], _NOTE: []}
    compared = nbytes = 0
    for name in sorted(ka & kb):
        ta, tb = ra.get(name), rb.get(name)
        findings, values_compared = _compare_tensor(name, ta, tb, atol)
        for kind, line in findings:
            found[kind].append(line)
        if values_compared:
            compared += 1
            nbytes += ta.numel() * ta.element_size()
    return Comparison(missing=tuple(sorted(ka - kb)), extra=tuple(sorted(kb - ka)), shape=tuple(found[_SHAPE]),
                      dtype=tuple(found[_DTYPE]), differ=tuple(found[_DIFFER]), dtype_notes=tuple(found[_NOTE]),
                      compared=compared, bytes=nbytes)


def _compare_tensor(name: str, ta: torch.Tensor, tb: torch.Tensor, atol: float) -> tuple[list[tuple[str, str]], bool]:
    """One tensor both checkpoints hold: its findings as ``(kind, line)`` pairs, and whether its values were
    compared (not when the shapes differ, nor the dtypes bit for bit)."""
    if ta.shape != tb.shape:
        return [(_SHAPE, f"{name}: {tuple(ta.shape)} vs {tuple(tb.shape)}")], False
    findings = []
    if ta.dtype != tb.dtype:
        if atol == 0.0:
            return [(_DTYPE, f"{name}: {ta.dtype} vs {tb.dtype}")], False
        findings.append((_NOTE, f"{name}: {ta.dtype} vs {tb.dtype}"))
    wide = torch.float64 if torch.float64 in (ta.dtype, tb.dtype) else torch.float32
    if atol == 0.0:
        same = torch.equal(ta.view(-1).view(torch.uint8), tb.view(-1).view(torch.uint8)) if ta.numel() else True
    else:
        same = torch.allclose(ta.to(wide), tb.to(wide), atol=atol, rtol=0.0)
    if not same:
        diff = (ta.to(wide) - tb.to(wide)).abs().max().item() if ta.numel() else 0.0
        findings.append((_DIFFER, f"{name}: max abs difference {diff:.3g}"))
    return findings, True
