"""Compare two HF checkpoints tensor by tensor."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from weightstream.common.hf_files import CheckpointReader

__all__ = ["Comparison", "compare_checkpoints"]


@dataclass
class Comparison:
    missing: list[str] = field(default_factory=list)  # in A, not in B
    extra: list[str] = field(default_factory=list)  # in B, not in A
    shape: list[str] = field(default_factory=list)
    dtype: list[str] = field(default_factory=list)
    differ: list[str] = field(default_factory=list)
    # With a tolerance: tensors of different dtypes whose values were compared as float (not a difference).
    dtype_notes: list[str] = field(default_factory=list)
    compared: int = 0
    bytes: int = 0

    @property
    def ok(self) -> bool:
        return not (self.missing or self.extra or self.shape or self.dtype or self.differ)

    def render(self, a: str, b: str, limit: int | None = 20) -> str:
        """The report: each kind of difference with its first ``limit`` tensors (None: all) and how many more."""
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


def compare_checkpoints(a: str | os.PathLike, b: str | os.PathLike, *, atol: float = 0.0) -> Comparison:
    """Compare every tensor of two checkpoint directories: bit for bit when ``atol`` is 0, a dtype that differs
    then a difference; with ``atol``, values as float (float64 where either is), a dtype that differs only a
    note. A directory that cannot be read (a missing, truncated or damaged file) raises
    :class:`~weightstream.common.hf_files.HFCheckpointError`."""
    out = Comparison()
    with CheckpointReader(a) as ra, CheckpointReader(b) as rb:
        ka, kb = set(ra.keys()), set(rb.keys())
        out.missing = sorted(ka - kb)
        out.extra = sorted(kb - ka)
        for name in sorted(ka & kb):
            ta, tb = ra.get(name), rb.get(name)
            if ta.shape != tb.shape:
                out.shape.append(f"{name}: {tuple(ta.shape)} vs {tuple(tb.shape)}")
                continue
            if ta.dtype != tb.dtype:
                (out.dtype if atol == 0.0 else out.dtype_notes).append(f"{name}: {ta.dtype} vs {tb.dtype}")
                if atol == 0.0:
                    continue
            out.compared += 1
            out.bytes += ta.numel() * ta.element_size()
            wide = torch.float64 if torch.float64 in (ta.dtype, tb.dtype) else torch.float32
            if atol == 0.0:
                same = torch.equal(ta.view(-1).view(torch.uint8), tb.view(-1).view(torch.uint8)) if ta.numel() else True
            else:
                same = torch.allclose(ta.to(wide), tb.to(wide), atol=atol, rtol=0.0)
            if not same:
                diff = (ta.to(wide) - tb.to(wide)).abs().max().item() if ta.numel() else 0.0
                out.differ.append(f"{name}: max abs difference {diff:.3g}")
    return out
