"""Checks of the bucket metadata an engine is sent (over HTTP, or on the IPC control channel, where the
frame's types are checked as it is read: :mod:`weightstream.wire.frames`): every problem listed, none raised
alone."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from weightstream.models.spec import dtype_from_name

__all__ = [
    "int_lists", "unknown_dtypes", "bucket_problems", "DELTA_ENCODINGS", "MAX_DELTA_BYTES", "delta_problems",
    "buckets_problems", "MAX_DURATION_S", "MAX_TEXT_CHARS", "duration_problem",
    "range_problem", "text_problem", "token_rows", "ep_problem", "EXPERT_COUNTS", "routed_experts"
]


def int_lists(value: Any, depth: int) -> bool:
    """``value`` is a non-negative integer (depth 0) or a list of such, ``depth`` deep."""
    if depth == 0:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return isinstance(value, list) and all(int_lists(v, depth - 1) for v in value)


def _is_dtype_name(name: Any) -> bool:
    try:
        dtype_from_name(name)
        return True
    except (ValueError, AttributeError, TypeError):
        return False


def unknown_dtypes(dtypes: Iterable[Any]) -> list[Any]:
    """The names in ``dtypes`` that name no dtype this engine knows."""
    return [d for d in dtypes if not _is_dtype_name(d)]


def bucket_problems(bucket: Any) -> list[str]:
    """What is wrong with one bucket's metadata (``names``, ``dtypes``, ``shapes``)."""
    if not isinstance(bucket, dict):
        return ["must be an object"]
    fields = ["names", "dtypes", "shapes"]
    missing = [f for f in fields if not isinstance(bucket.get(f), list)]
    if missing:
        return [f"field {f!r} must be a list" for f in missing]
    problems = []
    lengths = [len(bucket[f]) for f in fields]
    if len(set(lengths)) > 1:
        problems.append(f"{', '.join(fields)} differ in length ({', '.join(map(str, lengths))})")
    if not all(isinstance(n, str) for n in bucket["names"]):
        problems.append("names must be strings")
    bad = unknown_dtypes(bucket["dtypes"])
    if bad:
        problems.append(f"unknown dtypes {bad[:5]}")
    if not int_lists(bucket["shapes"], 2):
        problems.append("shapes must be lists of non-negative integers")
    return problems


DELTA_ENCODINGS = ("dense", "indices", "bitmap")
MAX_DELTA_BYTES = 1 << 40  # a delta bucket's size, decoded or encoded


def delta_problems(delta: Any) -> list[str]:
    """What is wrong with a delta bucket's header (``weightstream_delta``: encoding, word, total, count, nbytes,
    index), every problem listed."""
    if delta is None:
        return []
    if not isinstance(delta, dict):
        return ["field 'weightstream_delta' must be an object"]
    problems = [f"weightstream_delta.{f} must be a non-negative integer"
                for f in ("word", "total", "count", "nbytes", "index") if not int_lists(delta.get(f), 0)]
    if delta.get("encoding") not in DELTA_ENCODINGS:
        problems.append(f"weightstream_delta.encoding must be one of {list(DELTA_ENCODINGS)}, "
                        f"got {str(delta.get('encoding'))[:40]!r}")
    if problems:
        return problems
    if delta["word"] not in (1, 2, 4) or delta["total"] % delta["word"]:
        problems.append(f"weightstream_delta.word must be 1, 2 or 4 and divide total {delta['total']}")
    if max(delta["total"], delta["nbytes"]) > MAX_DELTA_BYTES:
        problems.append(f"weightstream_delta sizes must be at most {MAX_DELTA_BYTES} bytes")
    if delta["word"] and delta["count"] > delta["total"] // max(delta["word"], 1):
        problems.append(f"weightstream_delta.count {delta['count']} exceeds the bucket's words")
    return problems


def buckets_problems(buckets: Any) -> list[str]:
    if not isinstance(buckets, list):
        return ["buckets must be a list"]
    return [f"bucket {i}: {p}" for i, b in enumerate(buckets) for p in bucket_problems(b)]


# -- bounds on what one HTTP request may ask for (its JSON's depth: weightstream.common.http_server) -----------

MAX_DURATION_S = 3600.0  # any duration a request sets (``timeout_s``): seconds in (0, MAX_DURATION_S]
MAX_TEXT_CHARS = 256  # a weight version or a name a request sets (group, client, plan, ...)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def duration_problem(name: str, value: Any) -> str | None:
    """What is wrong with a duration in seconds (``None``: the engine's default)."""
    if value is None or 0 < value <= MAX_DURATION_S:  # NaN compares false: refused with the infinities
        return None
    return f"field {name!r} must be seconds in (0, {MAX_DURATION_S:g}], got {_shown(value)}"


def range_problem(name: str, value: int, low: int, high: int) -> str | None:
    if low <= value <= high:
        return None
    return f"field {name!r} must be in [{low}, {high}], got {_shown(value)}"


def text_problem(name: str, value: Any) -> str | None:
    """What is wrong with a short text field: at most :data:`MAX_TEXT_CHARS` printable characters."""
    if not isinstance(value, str):
        return None
    if len(value) > MAX_TEXT_CHARS:
        return f"field {name!r} has {len(value)} characters, more than {MAX_TEXT_CHARS}"
    if not value.isprintable():
        return f"field {name!r} must be printable text (no control characters, no lone surrogates)"
    return None


def token_rows(ids: Any, *, flat: bool) -> list[list[int]] | str:
    """The rows of ``input_ids``: a non-empty list of non-empty lists of token ids (``flat``: a list of ids is
    one row too); else what is wrong with it."""
    if flat and int_lists(ids, 1) and ids:
        return [ids]
    if not isinstance(ids, list) or not ids or not all(isinstance(r, list) and r for r in ids):
        one = "a non-empty list of token ids or " if flat else ""
        return f"input_ids must be {one}a non-empty list of non-empty lists of token ids"
    bad = [i for i, row in enumerate(ids) if not int_lists(row, 1)]
    if bad:
        return f"input_ids rows {bad[:5]} hold something other than non-negative integer token ids"
    return ids


def ep_problem(ep: int, tp: int, experts: int | None = None) -> str | None:
    """Why an engine of TP ``tp`` cannot run expert parallelism ``ep`` for a model of ``experts`` routed experts (0: a
    dense model; None: not known yet) (None: it can): EP runs over the TP group, each rank holding its routed
    experts whole, or not at all."""
    if ep < 1:
        return f"engine EP {ep}: expert parallelism must be 1 or more"
    if ep > 1 and experts == 0:
        return (f"engine EP {ep}: the model has no routed experts (a dense model), so expert parallelism has nothing "
                "to split: run it at EP 1")
    if ep not in (1, tp):
        allowed = "EP 1 only" if tp == 1 else f"EP 1 (experts split like the other layers) or EP {tp} (each rank " \
                                              "holds its experts whole)"
        return (f"engine EP {ep}: expert parallelism runs over the engine's TP group, so at TP {tp} it takes {allowed}"
                + (f"; for EP {ep}, run TP {ep}" if tp == 1 else ""))
    if ep > 1 and experts and experts % ep:
        return f"engine EP {ep}: the model's {experts} routed experts cannot be split evenly over {ep} ranks"
    return None


EXPERT_COUNTS = ("n_routed_experts", "num_local_experts", "num_experts")  # as the families' configs name them


def routed_experts(config: dict) -> int:
    """How many routed experts an HF ``config.json`` (as a dict; a multimodal one's ``text_config`` too) declares:
    0 for a dense model."""
    for section in (config, config.get("text_config") or {}):
        for key in EXPERT_COUNTS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return 0
