"""The cpinfer package has no import circles: no two modules import each other, and no longer loop either.

Every module is parsed with `ast`, so imports inside functions (late imports) and under TYPE_CHECKING count too.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "cpinfer"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _all_modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE_ROOT.rglob("*.py"))}


def _base_of(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a `from X import ...` names, resolving relative levels against `module`."""
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _targets(node: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The cpinfer modules one import statement names (`from pkg import sub` names pkg.sub when that is a module)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = _base_of(node, module, is_package)
    found = set()
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in known:
            found.add(sub)
        elif base in known:
            found.add(base)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the cpinfer modules it imports anywhere in its body (itself left out)."""
    modules = _all_modules()
    known = set(modules)
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(tree):
            edges |= _targets(node, module, is_package, known)
        graph[module] = edges - {module}
    return graph


def mutual_pairs(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, deps in graph.items() for b in deps if a < b and a in graph.get(b, ()))


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components, iteratively; only those of two or more modules (the loops) are returned."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        loops.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(loops)


def import_loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Groups of two or more modules that reach each other through imports."""
    return _strongly_connected(graph)


def test_the_graph_sees_late_and_relative_imports():
    graph = import_graph()
    assert len(graph) > 100
    assert "cpinfer.model.config" in graph["cpinfer.model.loader"]


def test_no_two_modules_import_each_other():
    pairs = mutual_pairs(import_graph())
    assert not pairs, "modules that import each other:\n" + "\n".join(f"  {a} <-> {b}" for a, b in pairs)


def test_no_longer_import_loops():
    loops = import_loops(import_graph())
    assert not loops, "import loops:\n" + "\n".join("  " + " -> ".join(loop) for loop in loops)


def test_the_kv_package_imports_nothing_above_it():
    """engine/kv/ sits below the model runner and the engine: no module of it imports them (a P/D role's runner
    start-up, which needs the runner, lives in engine/pd/ranks.py)."""
    above = {"cpinfer.engine.model_runner", "cpinfer.engine.llm_engine", "cpinfer.engine.startup"}
    graph = import_graph()
    kv = [m for m in graph if m == "cpinfer.engine.kv" or m.startswith("cpinfer.engine.kv.")]
    assert len(kv) > 5
    bad = sorted((m, t) for m in kv for t in graph[m] & above)
    assert not bad, "engine/kv/ imports from above it:\n" + "\n".join(f"  {m} -> {t}" for m, t in bad)
