"""What an engine worker checks of the values it is about to load, besides each tensor's name, shape and dtype:

- every block-FP8 scale (a tensor named ``*_scale_inv``) is finite, positive and at most :data:`MAX_FP8_SCALE`;
  a bucket holding any other is refused whole, with one error naming every bad scale and what is wrong with it;
- a weight holding NaN or an infinity is found and named: the update reports it (and the engine logs it), or,
  where the engine was started with ``--refuse-nonfinite`` (:attr:`LoadChecks.refuse_nonfinite`), refuses its
  bucket whole, naming every such weight.

Each check is a few reductions per tensor, on the device the bucket is on (one host synchronisation per bucket); a
tensor is examined element by element only where a reduction says it may hold something wrong. A bucket cut into
runs of one dtype (:func:`check_runs`) is looked at one reduction per run: the span a run's tensors tile, gaps and
all, whatever the number of tensors; only a run that may hold something wrong is looked at tensor by tensor."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from weightstream.receiver import value_kernel
from weightstream.streaming.bucket import typed_views
from weightstream.wire.fp8 import SCALE_SUFFIX

__all__ = ["DEFAULT_CHECKS", "MAX_FP8_SCALE", "LoadChecks", "ValuesReport", "check_values", "check_runs",
           "nonfinite_names", "scale_problems", "warm_checks"]

# A block-FP8 scale multiplies float8 values of at most 448: 448 * 2**32 (about 1.9e12) is far beyond any weight, and a
# larger scale is a corrupted one (1e38 would make every dequantized value of its block infinite in float32).
MAX_FP8_SCALE = 2.0**32
Named = Sequence[tuple[str, Tensor]]
# One dtype's run of a bucket (:func:`~weightstream.streaming.bucket.typed_runs`): its split sizes (gap, tensor, gap,
# tensor, ...) in elements, and each tensor's name with what it loads into.
TypedRun = tuple[torch.dtype, list[int], list[tuple[str, Tensor]]]


@dataclass(frozen=True, slots=True)
class LoadChecks:
    """How an engine treats the values of an update (``weightstream engine --refuse-nonfinite``):
    ``refuse_nonfinite``: a weight holding NaN or an infinity refuses its bucket (by default it is loaded and
    reported). Block-FP8 scales outside (0, :data:`MAX_FP8_SCALE`] are refused either way."""

    refuse_nonfinite: bool = False


DEFAULT_CHECKS = LoadChecks()


@dataclass(frozen=True, slots=True)
class ValuesReport:
    """What :func:`check_values` found in one bucket: ``bad_scales`` (each ``"name: what is wrong"``) and the names
    of the weights holding NaN or an infinity (``nonfinite``)."""

    bad_scales: tuple[str, ...] = ()
    nonfinite: tuple[str, ...] = ()

    def refusal(self, checks: LoadChecks) -> str | None:
        """Why ``checks`` refuse the bucket (every problem), or None."""
        problems = list(self.bad_scales)
        if checks.refuse_nonfinite:
            problems += [f"{name}: holds NaN or an infinity" for name in self.nonfinite]
        if not problems:
            return None
        return f"{len(problems)} tensors hold values this engine refuses, nothing of the bucket loaded: " + "; ".join(
            problems)


def check_values(named: Named) -> ValuesReport:
    """The scales of ``named`` (name, tensor as it arrived) checked, and its non-finite weights found."""
    scales = [(n, t) for n, t in named if n.endswith(SCALE_SUFFIX)]
    weights = [(n, t) for n, t in named if not n.endswith(SCALE_SUFFIX)]
    return ValuesReport(tuple(scale_problems(scales)), tuple(nonfinite_names(weights)))


def check_runs(raw: Tensor, runs: Sequence[TypedRun]) -> ValuesReport:
    """:func:`check_values` of a bucket held in ``raw`` (a :func:`~weightstream.streaming.bucket.typed_buffer`) and cut
    by ``runs``: one reduction over each stretch of the buffer that tensors of one floating-point dtype tile, padding
    and all (:func:`~weightstream.receiver.value_kernel.stretches`; one host synchronisation for the bucket), the runs
    then looked at tensor by tensor only where a stretch may hold NaN or an infinity (only tensors are named: a
    stretch's padding may be anything). A run holding block-FP8 scales, or of a float dtype no stretch takes, is
    looked at tensor by tensor. On a CUDA device with Triton, one kernel launch looks at the whole bucket first
    (:mod:`~weightstream.receiver.value_kernel`)."""
    if value_kernel.available(raw.device) and (flag := value_kernel.bucket_flag(raw, runs)) is not None:
        # one launch looked at every tensor: only where it raised its flag are they named
        return check_values(_named(raw, runs, range(len(runs)))) if bool(flag) else ValuesReport()
    spans = [raw.narrow(0, start, end - start).view(value_kernel.DTYPES[kind])
             for kind, start, end in value_kernel.stretches(runs) if kind != value_kernel.SCALE]
    looked = [i for i, (dtype, _, payload) in enumerate(runs) if dtype.is_floating_point and (
        dtype not in value_kernel.KINDS or any(n.endswith(SCALE_SUFFIX) for n, _ in payload))]
    if spans and _may_hold_nonfinite(spans):
        looked = [i for i, (dtype, _, _) in enumerate(runs) if dtype.is_floating_point]
    return check_values(_named(raw, runs, looked)) if looked else ValuesReport()


def _named(raw: Tensor, runs: Sequence[TypedRun], which: Iterable[int]) -> list[tuple[str, Tensor]]:
    """The tensors of runs ``which`` of ``raw``, by name, as they arrived."""
    return [(n, v) for i in which for dtype, sizes, payload in [runs[i]]
            for (n, _), v in zip(payload, typed_views(raw, dtype, sizes), strict=True)]


def warm_checks(device: torch.device) -> None:
    """Run every check once on ``device`` (a GPU's), on a few elements of each dtype an update brings, finite and not:
    each kernel's first launch loads it (tens of milliseconds in all), which then falls before the first update."""
    if device.type != "cuda":
        return
    raw = torch.zeros(64, dtype=torch.uint8, device=device)
    runs: list[TypedRun] = [(torch.bfloat16, [0, 4], [("b.weight", raw)]), (torch.float16, [4, 4], [("h.weight", raw)]),
                            (torch.float32, [4, 2], [("f.weight", raw)]),
                            (torch.float8_e4m3fn, [40, 8], [("e.weight", raw)]),
                            (torch.float32, [12, 2], [("e.weight" + SCALE_SUFFIX, raw)])]
    for fill in (0, 0xFF):  # zeros, then NaN in every dtype (each then looked at tensor by tensor)
        raw.fill_(fill)
        check_runs(raw, runs)


def scale_problems(scales: Named) -> list[str]:
    """``"name: what is wrong"`` for each of ``scales`` holding a value that is NaN, infinite, not positive, or above
    :data:`MAX_FP8_SCALE`."""
    scales = [(n, t) for n, t in scales if t.numel()]
    if not scales:
        return []
    flat = torch.cat([t.detach().reshape(-1).float() for _, t in scales])
    if bool(((flat > 0) & (flat <= MAX_FP8_SCALE)).all()):  # NaN compares false: found below
        return []
    return [f"{name}: {', '.join(what)}" for name, t in scales if (what := _scale_faults(t.detach().float()))]


def _scale_faults(v: Tensor) -> list[str]:
    what = []
    if bool(v.isnan().any()):
        what.append("NaN")
    if bool(v.isinf().any()):
        what.append("infinite")
    finite = v[v.isfinite()]
    if finite.numel() and bool((finite <= 0).any()):
        what.append(f"not positive (min {float(finite.min()):g})")
    if finite.numel() and bool((finite > MAX_FP8_SCALE).any()):
        what.append(f"above {MAX_FP8_SCALE:g} (max {float(finite.max()):g})")
    return what


def nonfinite_names(weights: Named) -> list[str]:
    """The names of ``weights`` holding NaN or an infinity. First one answer for all of them
    (:func:`_may_hold_nonfinite`: a few batched reductions, one host synchronisation); only where it says some may,
    each tensor is looked at."""
    floats = [(n, t.detach()) for n, t in weights if t.is_floating_point() and t.numel()]
    if not floats or not _may_hold_nonfinite([t for _, t in floats]):
        return []
    return [n for n, t in floats if _nonfinite(t)]


def _may_hold_nonfinite(tensors: list[Tensor]) -> bool:
    """Whether any of ``tensors`` may hold NaN or an infinity: per dtype of two bytes or more, the largest magnitude
    of each tensor in one multi-tensor reduction (non-finite exactly where the tensor holds NaN or an infinity, and
    never overflowing); float8 e4m3 values, whose only non-finite values are the NaN bytes 0x7f and 0xff, looked at
    together as bytes (joined first: one launch, however many tensors, where a block-FP8 bucket's values alternate
    with their scales); other float8 formats as float32."""
    flags: list[Tensor] = []
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype, group in by_dtype.items():
        if dtype == torch.float8_e4m3fn:
            flags.append(_e4m3_nan(torch.cat([t.reshape(-1) for t in group])).reshape(1))
        elif dtype.itemsize == 1:
            flags += [~t.float().isfinite().all().reshape(1) for t in group]
        else:
            flags.append(~torch.stack(torch._foreach_norm(group, ord=math.inf)).isfinite())
    return bool(torch.cat(flags).any())


def _e4m3_nan(values: Tensor) -> Tensor:
    """Whether float8 e4m3 ``values`` hold a NaN: the bytes 0x7f and 0xff (as int8, 127 and -1), its only
    non-finite values."""
    v = values.view(torch.int8)
    return ((v == 127) | (v == -1)).any()


def _nonfinite(t: Tensor) -> bool:
    if t.dtype == torch.float8_e4m3fn:
        return bool(_e4m3_nan(t))
    return not bool(t.float().isfinite().all()) if t.element_size() == 1 else not bool(t.isfinite().all())
