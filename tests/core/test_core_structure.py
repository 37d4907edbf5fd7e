"""The core's shape: no import circle between its modules, and no function written twice.

Both are read from the source (ast), imports under `TYPE_CHECKING` and inside functions included: a circle
that only types close is still two modules that need each other. A twin is two functions of core or
events whose bodies (docstrings aside) are the same code: one of them should call the other.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "src" / "pagedkv"
MIN_TWIN_NODES = 30  # smaller bodies (a three-line `preempt`) may repeat


def _module(path: Path) -> str:
    return ".".join(path.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__")


def _imports(packages: tuple[str, ...]) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports (a `from pkg import mod` names the module)."""
    paths = {_module(p): p for pkg in packages for p in sorted((PKG / pkg).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    deps.add(sub if sub in paths else node.module)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in paths and d != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected set of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_core_or_events() -> None:
    circles = _circles(_imports(("core", "events")))
    assert not circles, f"modules that import each other (types included): {circles}"


def test_the_circle_check_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def _twins(paths: list[Path]) -> list[list[str]]:
    bodies: dict[str, list[str]] = defaultdict(list)
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring may differ
            if sum(1 for stmt in body for _ in ast.walk(stmt)) >= MIN_TWIN_NODES:
                bodies[ast.dump(ast.Module(body=body, type_ignores=[]))].append(f"{path.relative_to(PKG)}:{node.name}")
    return [names for names in bodies.values() if len(names) > 1]


def test_no_function_of_core_or_events_is_written_twice() -> None:
    paths = sorted(p for pkg in ("core", "events") for p in (PKG / pkg).rglob("*.py"))
    twins = _twins(paths)
    assert not twins, f"the same function body twice (one should call the other): {twins}"


def test_the_twin_check_finds_a_twin(tmp_path: Path) -> None:
    body = "    x = [i * 2 for i in range(n) if i % 3]\n    y = {k: v for k, v in zip(x, x[1:])}\n    return sum(y) + len(x)\n"
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text(f"def f(n):\n    '''one'''\n{body}")
    b.write_text(f"class C:\n    def g(self, n):\n        '''two'''\n{body.replace('    ', '        ')}")
    global PKG
    saved, PKG = PKG, tmp_path
    try:
        assert _twins([a, b]) == [["a.py:f", "b.py:g"]]
    finally:
        PKG = saved
