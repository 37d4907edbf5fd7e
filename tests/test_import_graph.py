"""No import circle between the modules of src/pagedkv: the graph of every `import` (module-level, inside a
function, or under `if TYPE_CHECKING`; a lazy import is still a dependency) has no cycle, of any length.

A circle means neither module can be read, tested or moved without the other; what both need moves down to a
third module, or one side receives it as an argument.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "pagedkv"

# Circles in files other sessions are changing, each with its reason; an entry that is gone fails too, so the
# list only shrinks.
ALLOWED_CYCLES: dict[tuple[str, ...], str] = {
    ("pagedkv.core.hybrid", "pagedkv.core.hybrid_check"):
        "goes with the one group-based manager (issue 34)",
    ("pagedkv.engine.lifecycle", "pagedkv.engine.llm_engine", "pagedkv.engine.speculative.draft",
     "pagedkv.engine.speculative.proposer"):
        "the draft model runs the target's forward preparation (llm_engine._prepare_forward) and lifecycle "
        "annotates its Engine; speculation and the lifecycle are being changed now (issues 35, 36)",
    ("pagedkv.hf.cpu_linear", "pagedkv.hf.invariant"):
        "the batch-invariant linear backend, being written now",
    ("pagedkv.bench.peers", "pagedkv.bench.peers.llama_cpp", "pagedkv.bench.peers.openvino",
     "pagedkv.bench.peers.vllm"):
        "the peers' shared types live in the package __init__, which imports every peer (issue 32's bench)",
}  # fmt: skip


def module_name(path: Path, src: Path = SRC) -> str:
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str], src: Path = SRC) -> set[str]:
    """The pagedkv modules `path` imports: `import a.b`, `from a.b import c` (the module a.b.c when it is one,
    else a.b) and relative imports, wherever they stand in the file."""
    name = module_name(path, src)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph(root: Path = PKG) -> dict[str, set[str]]:
    paths = [p for p in sorted(root.rglob("*.py")) if "__pycache__" not in p.parts]
    modules = {module_name(p, root.parent) for p in paths}
    return {module_name(p, root.parent): imports_of(p, modules, root.parent) for p in paths}


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Every strongly connected component of more than one module (Tarjan), as a sorted tuple."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                found.append(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_circle_in_src_pagedkv() -> None:
    found = cycles(import_graph())
    new = [c for c in found if c not in ALLOWED_CYCLES]
    assert not new, "import circles (move what both need down a layer): " + "; ".join(" <-> ".join(c) for c in new)


def test_every_allowed_circle_still_exists() -> None:
    gone = sorted(set(ALLOWED_CYCLES) - set(cycles(import_graph())))
    assert not gone, f"these ALLOWED_CYCLES are gone: remove them from tests/test_import_graph.py: {gone}"


def test_the_walk_finds_lazy_relative_and_long_circles(tmp_path: Path) -> None:
    pkg = tmp_path / "pagedkv"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pagedkv.sub import b\n")  # a lazy import
    (pkg / "sub" / "b.py").write_text("from . import c\n")  # relative: pagedkv.sub.c
    (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pagedkv.a\n")
    (pkg / "d.py").write_text("import pagedkv.a\n")  # into the circle, not on it
    assert cycles(import_graph(pkg)) == [("pagedkv.a", "pagedkv.sub.b", "pagedkv.sub.c")]
