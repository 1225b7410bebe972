"""The package's layout stays one-way: no import cycle (imports inside functions count), no module reaching
into another module's private names, and no import hidden inside a function outside bench/replay (which
runs inside vLLM's environment and imports vLLM lazily) and the CLI's per-command imports (see LAZY_OK). lint-imports (pyproject's layers contract) and mypy
check the same from outside; this test needs neither and names the offending line."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvforge"
# bench/replay runs in the target's env and imports vLLM/torch where used. cli imports each command's module in
# that command (`kvforge --help` 0.07 s instead of 0.35-0.41 s); nothing imports cli, so that can close no cycle.
LAZY_OK = ("kvforge.bench.replay", "kvforge.cli")


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        if "data" in rel.parts:  # files kvforge installs into other environments, not part of the package
            continue
        parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
        mods[".".join(parts)] = path
    return mods


def _imports(mods: dict[str, Path]):
    """(importer, imported module, imported name or None, line, at top level) for every kvforge import."""
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in mods:
                        yield name, alias.name, None, node.lineno, id(node) in top
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in mods:
                        yield name, full, None, node.lineno, id(node) in top
                    elif base in mods:
                        yield name, base, alias.name, node.lineno, id(node) in top


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_counting_imports_inside_functions():
    mods = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for importer, imported, _name, _line, _top in _imports(mods):
        # A package's __init__ importing its own submodules, or a submodule its package, is not a loop of concepts.
        if imported != importer and not imported.startswith(importer + ".") and not importer.startswith(imported + "."):
            graph[importer].add(imported)
    for m in mods:
        graph.setdefault(m, set())
    assert _cycles(graph) == []


def test_no_module_uses_another_modules_private_names():
    mods = _modules()
    used = [f"{mods[importer].relative_to(PACKAGE.parent)}:{line}: {imported}.{name}"
            for importer, imported, name, line, _top in _imports(mods)
            if name and name.startswith("_") and not name.startswith("__") and imported != importer]
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = {a.asname or a.name.rpartition(".")[2] for n in ast.walk(tree)  # kvforge's modules and names
                   if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("kvforge"))
                   for a in n.names}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                used.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert used == []


def test_imports_sit_at_the_top_of_their_file():
    mods = _modules()
    hidden = [f"{mods[importer].relative_to(PACKAGE.parent)}:{line}: {imported}"
              for importer, imported, _name, line, top in _imports(mods)
              if not top and not importer.startswith(LAZY_OK)]
    assert hidden == []
