"""The package keeps its architecture: each layer imports only from the layers below it (no circle), no
``getattr``/``hasattr`` probes of what an object can do outside the declared exceptions, no function over 60
lines, sinks reach engines only through the adapter protocols, and every capability an adapter declares is
one it implements. ``python tools/architecture.py`` prints the same measures."""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import sys

import pytest

from weightstream.engines import ADAPTERS
from weightstream.engines.base import CAPABILITY_PROTOCOLS

pytestmark = pytest.mark.unit  # in-process, no peer processes: the fast subset

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _architecture():
    spec = importlib.util.spec_from_file_location("architecture", ROOT / "tools" / "architecture.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["architecture"] = module
    spec.loader.exec_module(module)
    return module


ARCH = _architecture()


def test_every_module_is_in_a_layer_and_imports_only_downward():
    for module in ARCH.modules():
        ARCH.layer_of(module)  # raises for a module in no layer
    assert ARCH.upward_imports() == []


def test_integrations_and_the_receiver_never_import_the_reference_engine():
    assert ARCH.forbidden_imports() == []
    assert ARCH.FORBIDDEN_IMPORTS["weightstream.integrations"] == ("weightstream.reference_engine",)
    assert ARCH.FORBIDDEN_IMPORTS["weightstream.receiver"] == ("weightstream.reference_engine",)
    # the layer order puts the receiver below the engines and above what it stands on
    names = [name for name, _ in ARCH.LAYERS]
    assert names.index("streaming") + 1 == names.index("receiver") < names.index("engines")


def test_a_forbidden_import_is_found():
    graph = {"weightstream.integrations.x": {("weightstream.reference_engine.schema", 3)},
             "weightstream.receiver.y": {("weightstream.streaming.bucket", 4)}}
    assert ARCH.forbidden_imports(graph) == [
        "weightstream.integrations.x:3 imports weightstream.reference_engine.schema"]


def test_no_import_circle():
    limit = sys.getrecursionlimit()
    assert ARCH.circles() == []
    assert sys.getrecursionlimit() == limit  # the measure leaves the interpreter as it found it


def test_the_graph_sees_imports_inside_functions_and_type_checking_blocks():
    graph = ARCH.import_graph()
    assert "weightstream.sources.megatron" in {d for d, _ in graph["weightstream.sources"]}  # module level
    deps = {d for d, _ in graph["weightstream.cli"]}
    assert "weightstream.reference_engine.server" in deps  # imported inside a function


def test_no_probe_outside_the_declared_exceptions():
    crossing = [f"{p.module}:{p.line} {p.call}" for p in ARCH.probes() if p.module not in ARCH.PROBE_EXCEPTIONS]
    assert crossing == []
    stale = set(ARCH.PROBE_EXCEPTIONS) - {p.module for p in ARCH.probes()}
    assert not stale, f"exceptions declared for modules that no longer probe: {sorted(stale)}"


def test_no_function_over_sixty_lines():
    assert ARCH.long_functions() == []


def test_sinks_reach_engines_only_through_the_adapter_protocols():
    sinks = ROOT / "weightstream" / "sinks"
    paths = sorted(sinks.glob("*.py"))
    assert len(paths) >= 5, paths  # base, broadcast, ipc, p2p, safetensors
    for path in paths:
        tree = ast.parse(path.read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        engines = {m for m in imported if m == "weightstream.engines" or m.startswith("weightstream.engines.")}
        assert engines <= {"weightstream.engines.base"}, (path.name, engines)


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_every_declared_capability_is_implemented(name):
    adapter = ADAPTERS[name]("http://127.0.0.1:9")
    declared = adapter.capabilities({})
    missing = {c for c in declared if c in CAPABILITY_PROTOCOLS and not isinstance(adapter, CAPABILITY_PROTOCOLS[c])}
    assert not missing, f"{name} declares {sorted(missing)} without implementing them"


def test_every_module_says_what_it_exports():
    """A module that defines public names lists them in ``__all__``, and ``__all__`` lists only names it binds."""
    assert ARCH.export_problems() == []
