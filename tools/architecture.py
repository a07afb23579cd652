"""The architecture of the package, measured: its layers and the imports between them, import circles,
capability probes (``getattr``/``hasattr``), the longest functions and the lines per folder.

``python tools/architecture.py`` prints the report; ``tests/test_architecture.py`` holds the package to it
(imports only downward, no circle, no probe outside the declared exceptions, no function over 60 lines).
"""

from __future__ import annotations

import ast
import functools
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "weightstream"

# The layers, bottom first: a module imports only from its own layer or the ones below it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("weightstream._version", "weightstream.errors", "weightstream.common")),
    ("wire", ("weightstream.wire",)),
    ("models", ("weightstream.models",)),
    ("converters", ("weightstream.converters",)),
    ("sources", ("weightstream.sources",)),
    ("checks", ("weightstream.checks",)),
    ("streaming", ("weightstream.streaming",)),
    ("receiver", ("weightstream.receiver",)),
    ("engines", ("weightstream.engines",)),
    ("sinks", ("weightstream.sinks",)),
    ("reference_engine", ("weightstream.reference_engine",)),
    ("integrations", ("weightstream.integrations",)),
    ("operations", ("weightstream.launch", "weightstream.update", "weightstream.convert", "weightstream.jobs",
                    "weightstream.example")),
    ("bench", ("weightstream.bench",)),
    ("entry", ("weightstream.cli", "weightstream")),
)

# Imports the layer order allows but the design does not: what runs inside another engine (integrations) and
# what any engine runs to take an update (receiver) stand on the receiver layer, never on the engine we ship.
FORBIDDEN_IMPORTS: dict[str, tuple[str, ...]] = {
    "weightstream.integrations": ("weightstream.reference_engine",),
    "weightstream.receiver": ("weightstream.reference_engine",),
}

# Where reading an attribute by name is the point, not a probe of what an object of ours can do: the
# optional fields of a transformers config (a family's config declares only its own), torch's dtypes by
# name, Megatron-Core's argument namespace and vLLM's own objects (their classes vary by version).
PROBE_EXCEPTIONS: dict[str, str] = {
    "weightstream.common.lazy": "a package's names, imported on first use (its __getattr__)",
    "weightstream.models.spec": "optional fields of an HF config",
    "weightstream.models.presets": "optional fields of an HF config",
    "weightstream.converters.qwen3": "optional fields of an HF config",
    "weightstream.converters.qwen_moe": "optional fields of an HF config",
    "weightstream.converters.llama": "optional fields of an HF config",
    "weightstream.converters.deepseek_v3": "optional fields of an HF config",
    "weightstream.wire.handles": "torch's dtypes and builtins by name (the unpickler's allow-list)",
    "weightstream.sources.megatron_checkpoint": "Megatron-Core's saved argument namespace",
    "weightstream.integrations.vllm_backend": "vLLM's own objects inside vLLM",
    "weightstream.cli": "a torch dtype by name",
    "weightstream.bench.speed": "a torch dtype by name; optional fields of an HF config",
}

MAX_FUNCTION_LINES = 60


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _tree(path: Path) -> ast.Module:
    """The syntax tree of ``path``, parsed once per version of the file (every measure walks every module)."""
    return _parsed(path, path.stat().st_mtime_ns)


@functools.cache
def _parsed(path: Path, mtime_ns: int) -> ast.Module:
    return ast.parse(path.read_text())


def layer_of(module: str) -> int:
    best, index = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, index = len(prefix), i
    if index < 0:
        raise ValueError(f"{module} is in no layer: add it to LAYERS in tools/architecture.py")
    return index


def _imported(tree: ast.AST, module: str, known: set[str]) -> Iterator[tuple[str, int]]:
    """(imported weightstream module, line) for every import anywhere in the file (function bodies and
    ``TYPE_CHECKING`` blocks included: a type is a dependency too)."""
    package = module if (PACKAGE / Path(*module.split(".")[1:]) / "__init__.py").exists() else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "weightstream":
                    yield _nearest(alias.name, known), node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            if base.split(".")[0] != "weightstream":
                continue
            for alias in node.names:
                child = f"{base}.{alias.name}"
                yield (child if child in known else _nearest(base, known)), node.lineno


def _nearest(name: str, known: set[str]) -> str:
    while name not in known and "." in name:
        name = name.rpartition(".")[0]
    return name


def import_graph() -> dict[str, set[tuple[str, int]]]:
    mods = modules()
    known = set(mods)
    return {m: {(d, line) for d, line in _imported(_tree(p), m, known) if d != m}
            for m, p in mods.items()}


def upward_imports() -> list[str]:
    out = []
    for m, deps in import_graph().items():
        for d, line in sorted(deps):
            if layer_of(d) > layer_of(m):
                out.append(f"{m}:{line} imports {d} ({LAYERS[layer_of(m)][0]} -> {LAYERS[layer_of(d)][0]})")
    return out


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def forbidden_imports(graph: dict[str, set[tuple[str, int]]] | None = None) -> list[str]:
    """Imports :data:`FORBIDDEN_IMPORTS` forbids in ``graph`` (None: the package's), whatever the layers allow."""
    out = []
    for m, deps in (import_graph() if graph is None else graph).items():
        banned = [b for prefix, bs in FORBIDDEN_IMPORTS.items() if _within(m, prefix) for b in bs]
        out += [f"{m}:{line} imports {d}" for d, line in sorted(deps) if any(_within(d, b) for b in banned)]
    return out


def circles() -> list[list[str]]:
    """Import circles between modules (strongly connected components of more than one module; a package's
    ``__init__`` importing its own modules is not one unless they import it back). Iterative (Kosaraju): the
    interpreter's recursion limit is left as it is."""
    graph = {m: sorted({d for d, _ in deps}) for m, deps in import_graph().items()}
    order: list[str] = []
    seen: set[str] = set()
    for root in sorted(graph):
        if root in seen:
            continue
        seen.add(root)
        stack = [(root, iter(graph.get(root, ())))]
        while stack:
            node, children = stack[-1]
            child = next((c for c in children if c not in seen), None)
            if child is None:
                stack.pop()
                order.append(node)
            else:
                seen.add(child)
                stack.append((child, iter(graph.get(child, ()))))
    reverse: dict[str, list[str]] = defaultdict(list)
    for m, deps in graph.items():
        for d in deps:
            reverse[d].append(m)
    out: list[list[str]] = []
    assigned: set[str] = set()
    for root in reversed(order):
        if root in assigned:
            continue
        component, todo = [], [root]
        assigned.add(root)
        while todo:
            node = todo.pop()
            component.append(node)
            for m in reverse.get(node, ()):
                if m not in assigned:
                    assigned.add(m)
                    todo.append(m)
        if len(component) > 1:
            out.append(sorted(component))
    return out


@dataclass(frozen=True)
class Probe:
    module: str
    line: int
    call: str


def probes() -> list[Probe]:
    out = []
    for m, path in modules().items():
        for node in ast.walk(_tree(path)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr")):
                out.append(Probe(m, node.lineno, ast.unparse(node)))
    return out


def long_functions(limit: int = MAX_FUNCTION_LINES) -> list[tuple[int, str]]:
    out = []
    for m, path in modules().items():
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > limit:
                    out.append((n, f"{m}.{node.name}"))
    return sorted(out, reverse=True)


def _defined(tree: ast.Module) -> set[str]:
    """The names a module's top level binds (definitions, assignments, imports)."""
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.If):  # TYPE_CHECKING imports of a package's lazy names
            out.update(_defined(ast.Module(body=node.body, type_ignores=[])))
    return out


def _exported(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, (ast.List, ast.Tuple))
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)):
            return [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
    return None


def export_problems() -> list[str]:
    """Modules that define public names but no ``__all__``, and names an ``__all__`` lists that the module does not
    bind."""
    out = []
    for m, path in modules().items():
        tree = _tree(path)
        defined = _defined(tree)
        exported = _exported(tree)
        public = {n for n in defined if not n.startswith("_")} - _imported_names(tree)
        if exported is None:
            if public:
                out.append(f"{m}: no __all__ (it defines {', '.join(sorted(public)[:3])}, ...)")
            continue
        out += [f"{m}: __all__ names {n!r}, which it does not bind" for n in exported if n not in defined]
    return out


def _imported_names(tree: ast.Module) -> set[str]:
    return {(a.asname or a.name).split(".")[0] for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
            for a in node.names}


def lines_per_folder() -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT)
        folder = str(rel.parent) if rel.parent != Path("weightstream") else f"weightstream/{rel.name}"
        out[folder] += len(path.read_text().splitlines())
    return dict(sorted(out.items()))


def main() -> int:
    print("lines per folder (top-level modules by name):")
    for folder, n in lines_per_folder().items():
        print(f"  {n:6d}  {folder}")
    print(f"  {sum(lines_per_folder().values()):6d}  total")
    print("longest functions:")
    for n, name in long_functions(0)[:10]:
        print(f"  {n:4d}  {name}")
    found = probes()
    crossing = [p for p in found if p.module not in PROBE_EXCEPTIONS]
    print(f"getattr/hasattr calls: {len(found)}, outside the declared exceptions: {len(crossing)}")
    for p in crossing:
        print(f"  {p.module}:{p.line}  {p.call}")
    up = upward_imports()
    print(f"upward imports: {len(up)}")
    for line in up:
        print("  " + line)
    banned = forbidden_imports()
    print(f"forbidden imports: {len(banned)}")
    for line in banned:
        print("  " + line)
    exports = export_problems()
    print(f"modules whose __all__ is missing or wrong: {len(exports)}")
    for line in exports:
        print("  " + line)
    loops = circles()
    print(f"import circles: {len(loops)}")
    for loop in loops:
        print("  " + " <-> ".join(loop))
    return 1 if crossing or up or banned or loops or exports or long_functions() else 0


if __name__ == "__main__":
    sys.exit(main())
