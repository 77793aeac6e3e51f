"""The shape of the house: no import circles, arrows only downward, files small enough to read.

The import graph is static: every ``.py`` under the four packages is parsed with ``ast`` and every
``import``/``from ... import`` statement counts, including those inside functions (a lazy import is
still an arrow). Relative imports are resolved against the importing module's package, and
``from pkg import name`` counts as an arrow to ``pkg.name`` when that is a module.

Layering (DESIGN.md, principles 3 and 4): ``dmuon`` imports nothing from ``simulator``, ``harness``
or ``experiments``; ``simulator`` imports nothing from ``harness``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dmuon", "simulator", "harness", "experiments")
SIZE_DIRS = ("dmuon", "simulator", "harness", "experiments", "scripts", "tests")
MAX_LINES = 500




def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            mods[_module_name(path)] = path
    return mods


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _owning_module(name: str, mods: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is one of our modules."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in mods:
            return candidate
    return None


def import_graph() -> dict[str, set[str]]:
    """module -> set of in-tree modules it imports (anywhere in the file)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, path, node)
                # `from pkg import sub` arrows to pkg.sub when sub is a module, else to pkg
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for target in targets:
                owner = _owning_module(target, mods)
                if owner and owner != module:
                    graph[module].add(owner)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def _cycle_path(comp: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One concrete loop inside a strongly connected component, for the failure message."""
    members = set(comp)
    start = comp[0]
    path = [start]
    seen = {start}
    node = start
    while True:
        nxt = sorted(w for w in graph[node] if w in members)
        back = [w for w in nxt if w == start]
        if back and len(path) > 1:
            return path + [start]
        fresh = [w for w in nxt if w not in seen]
        if not fresh:
            return path + [nxt[0]] if nxt else path
        node = fresh[0]
        seen.add(node)
        path.append(node)


def test_no_import_cycles():
    graph = import_graph()
    unexpected = find_cycles(graph)
    assert not unexpected, "import circles:\n" + "\n".join(
        " -> ".join(_cycle_path(c, graph)) for c in unexpected
    )


def _arrows_into(source_pkg: str, forbidden: tuple[str, ...]) -> list[str]:
    graph = import_graph()
    return sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        if a.split(".")[0] == source_pkg
        for b in targets
        if b.split(".")[0] in forbidden
    )


def test_library_stands_alone():
    assert _arrows_into("dmuon", ("simulator", "harness", "experiments")) == []


def test_simulator_never_imports_harness():
    assert _arrows_into("simulator", ("harness",)) == []


def test_graph_sees_lazy_and_relative_imports():
    """The checker itself: an import inside a function body and a relative import are arrows."""
    graph = import_graph()
    assert "simulator.setup" in graph["simulator.api"]  # `from .setup import make_spec` inside run()
    assert "harness.experiment" in graph["harness.sweep"]  # `from .experiment import ...`
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_files_small_enough_to_read():
    long = {}
    for d in SIZE_DIRS:
        for path in sorted(p for ext in ("py", "c", "h") for p in (ROOT / d).rglob(f"*.{ext}")):
            n = len(path.read_text().splitlines())
            rel = path.relative_to(ROOT).as_posix()
            if n > MAX_LINES:
                long[rel] = n
    assert not long, f"files over {MAX_LINES} lines: {long}"
