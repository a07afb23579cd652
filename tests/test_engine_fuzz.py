"""Every POST route of the reference engine under hostile bodies: each field of its schema given a value of a type
it does not take, required fields left out, bodies that are not a JSON object, and seeded random bytes. Every one
is answered 4xx (never 5xx, never a dropped connection), and afterwards the engine serves exactly the logits it
served before."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tests.test_engine_hardening import logits, request, server  # noqa: F401 -- the module's engine, reused
from weightstream.reference_engine.server import SCHEMAS

VALUES = (None, True, 7, 1.5, "text", [], {}, [[1, 2], "x"], {"nested": {"deeper": [None]}})
NOT_AN_OBJECT = (b"{", b"[]", b"null", b"1", b'"text"', b'{"a": ', b"\xff\xfe\x00", b"{}}")


def _wrong(types: tuple[type, ...]) -> list[object]:
    """Values of a type ``types`` does not admit (a bool is never offered where an int is taken)."""
    return [v for v in VALUES if not isinstance(v, types) and not (isinstance(v, bool) and int in types)]


def hostile_bodies(route: str, seed: int) -> list[bytes | dict]:
    schema = SCHEMAS[route]
    rng = random.Random(seed)
    valid_shape = {f: "x" for f in schema}
    out: list[bytes | dict] = [{**valid_shape, field: value} for field, (types, _) in schema.items()
                               for value in _wrong(types)]
    out += [{f: v for f, v in valid_shape.items() if f != field} for field, (_, required) in schema.items()
            if required]
    out += list(NOT_AN_OBJECT)
    out += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))) for _ in range(5)]
    return out


def test_hostile_bodies_on_every_route_are_refused_and_change_nothing(server):  # noqa: F811
    before = logits(server.url)
    wrong = []
    for i, route in enumerate(sorted(SCHEMAS)):
        for body in hostile_bodies(route, seed=i):
            try:
                status, reply = request(server.url, "POST", route, body, timeout=30)
            except (ConnectionError, OSError) as exc:
                wrong.append(f"{route} {body!r:.80}: no answer ({exc!r})")
                continue
            if not 400 <= status < 500 or status == 401:
                wrong.append(f"{route} {body!r:.80}: {status} {reply!r:.200}")
    assert wrong == []
    status, _ = request(server.url, "GET", "/health")
    assert status == 200
    np.testing.assert_array_equal(logits(server.url), before)


@pytest.mark.unit
def test_the_hostile_bodies_cover_each_field_of_each_route():
    for route, schema in SCHEMAS.items():
        bodies = [b for b in hostile_bodies(route, 0) if isinstance(b, dict)]
        for field, (types, _) in schema.items():
            offered = {type(b[field]) for b in bodies if field in b and b[field] != "x"}
            assert offered and not any(issubclass(t, types) and t is not bool for t in offered), (route, field)
