"""Checks of the bucket metadata an engine is sent (over HTTP, or on the IPC control channel): every
problem listed, none raised alone."""

from __future__ import annotations

from typing import Any

from weightstream.models.spec import dtype_from_name


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


def bucket_problems(bucket: Any, *, offsets: bool = False) -> list[str]:
    """What is wrong with one bucket's metadata (``names``, ``dtypes``, ``shapes``, and ``offsets`` where
    asked for)."""
    if not isinstance(bucket, dict):
        return ["must be an object"]
    fields = ["names", "dtypes", "shapes"] + (["offsets"] if offsets else [])
    missing = [f for f in fields if not isinstance(bucket.get(f), list)]
    if missing:
        return [f"field {f!r} must be a list" for f in missing]
    problems = []
    lengths = [len(bucket[f]) for f in fields]
    if len(set(lengths)) > 1:
        problems.append(f"{', '.join(fields)} differ in length ({', '.join(map(str, lengths))})")
    if not all(isinstance(n, str) for n in bucket["names"]):
        problems.append("names must be strings")
    bad = [d for d in bucket["dtypes"] if not _is_dtype_name(d)]
    if bad:
        problems.append(f"unknown dtypes {bad[:5]}")
    if not int_lists(bucket["shapes"], 2):
        problems.append("shapes must be lists of non-negative integers")
    if offsets and not int_lists(bucket["offsets"], 1):
        problems.append("offsets must be non-negative integers")
    return problems


def buckets_problems(buckets: Any, *, offsets: bool = False) -> list[str]:
    if not isinstance(buckets, list):
        return ["buckets must be a list"]
    return [f"bucket {i}: {p}" for i, b in enumerate(buckets) for p in bucket_problems(b, offsets=offsets)]
