"""The structure docs/architecture.md draws, checked against the code.

- Every file under src/pagedkv has a row (what it owns, what it may call), and every row names a file that
  exists: a new file, or a renamed one, is placed there deliberately.
- Each row's "may call" cell is exactly what the file imports (`may_call`).
- No import circle between modules: the graph of every `import` (module-level, inside a function, or under
  `if TYPE_CHECKING`; a lazy import is still a dependency) has no cycle, of any length. A circle means neither
  module can be read, tested or moved without the other; what both need moves down to a third module, or one
  side receives it as an argument.
- Command modules are named after their command, class names do not repeat, docstrings hold no dates.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PKG = SRC / "pagedkv"
DOC = (ROOT / "docs" / "architecture.md").read_text()


def _files() -> list[str]:
    found = [p for p in PKG.rglob("*") if p.suffix in (".py", ".c") and "__pycache__" not in p.parts]
    return sorted(str(p.relative_to(PKG)) for p in found)


def test_every_file_under_src_pagedkv_is_in_the_architecture_doc() -> None:
    missing = [name for name in _files() if f"`{name}`" not in DOC]
    assert not missing, f"docs/architecture.md does not say what these files own and may call: {missing}"


def test_every_file_the_doc_tables_name_exists() -> None:
    rows = [line.split("`")[1] for line in DOC.splitlines() if line.startswith("| `") and line.count("`") >= 2]
    named = [r for r in rows if r.endswith((".py", ".c")) and "/" in r or r in ("cli.py", "demo.py")]
    stale = [r for r in named if not (PKG / r).exists()]
    assert named and not stale, f"docs/architecture.md names files that are gone: {stale}"


# Docstrings with a dated passage, each with its reason (the list only shrinks).
DATED_DOCSTRINGS = {
    "core/hotpath.py": "a measurement of the C hot path; moves to docs/ with the one group-based manager (issue 34)",
}


def test_docstrings_carry_no_dated_passage() -> None:
    """A docstring says what the code is; how it got there is in git, and a measurement goes in docs/ with its
    date, machine and command. A date (YYYY-MM-DD) in a docstring is either."""
    import ast
    import re

    dated = set()
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node) or ""
                if re.search(r"\b20\d\d-\d\d-\d\d\b", doc):
                    dated.add(str(path.relative_to(PKG)))
    assert dated == set(DATED_DOCSTRINGS), (
        f"docstrings with a date (move history to the commit message, measurements to docs/): "
        f"{sorted(dated - set(DATED_DOCSTRINGS))}; no longer dated (remove from DATED_DOCSTRINGS): "
        f"{sorted(set(DATED_DOCSTRINGS) - dated)}"
    )


def test_every_command_module_is_named_after_its_command() -> None:
    """`pagedkv generate` runs `engine/generate_command.py`, `pagedkv bench serve` `bench/serve.py`: a reader
    finds a command's code by its name."""
    from pagedkv.cli import COMMANDS

    unnamed = {
        " ".join(path): module
        for path, (module, _) in COMMANDS.items()
        if path[-1].replace("-", "_") not in module.rpartition(".")[2]
    }
    assert not unnamed, f"command modules not named after their command: {unnamed}"


# Class names that recur, each with its reason (the list only shrinks).
REPEATED_CLASS_NAMES = {
    "Engine": "bench/peers/openvino_shim.py runs in the OpenVINO peer's own Python and imports nothing of pagedkv",
}


def test_class_names_do_not_repeat() -> None:
    """One class per name in src/pagedkv (nested and private ones too): a name in a traceback, a log line or a
    review points at one class."""
    import ast
    from collections import defaultdict

    where: dict[str, list[str]] = defaultdict(list)
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(str(path.relative_to(PKG)))
    repeated = {name: files for name, files in where.items() if len(files) > 1}
    assert set(repeated) == set(REPEATED_CLASS_NAMES), {
        n: f for n, f in repeated.items() if n not in REPEATED_CLASS_NAMES
    } or f"no longer repeated (remove from REPEATED_CLASS_NAMES): {set(REPEATED_CLASS_NAMES) - set(repeated)}"


def may_call(path: str, graph: dict[str, set[str]]) -> str:
    """The "may call" cell of `path` (relative to src/pagedkv) as the code imports today: "own package (a, b)"
    first, then each other package "pkg (c, d)" in name order, `;`-separated; a package's own `__init__` is
    `__init__` among its modules, or the package's bare name when nothing else of it is imported (as a top-level
    module, `progress`, is); "nothing in pagedkv" when the file imports none."""
    parts = ["pagedkv", *path.removesuffix(".py").split("/")]
    module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    own = path.split("/")[0] if "/" in path else None
    groups: dict[str, set[str]] = {}
    for target in graph[module]:
        top, _, rest = target.removeprefix("pagedkv.").partition(".")
        is_package = (PKG / top).is_dir()
        groups.setdefault(top, set()).add(rest or ("__init__" if is_package else ""))
    cells = []
    for top in sorted(groups, key=lambda t: (t != own, t)):
        names = sorted(groups[top] - {""}, key=lambda n: (n != "__init__", n))
        name = "own package" if top == own else top
        cells.append(name if names in ([], ["__init__"]) and top != own else f"{name} ({', '.join(names)})")
    return "; ".join(cells) or "nothing in pagedkv"


def _rows() -> dict[str, str]:
    """file -> its "may call" cell, for every table row that names a .py file."""
    rows = {}
    for line in DOC.splitlines():
        cells = [c.strip() for c in line.replace("\\|", "\0").split("|")]
        if line.startswith("| `") and len(cells) == 5 and cells[1].endswith(".py`") and (PKG / cells[1].strip("`")).is_file():
            rows[cells[1].strip("`")] = cells[3].replace("\0", "|")
    return rows


def test_the_may_call_column_is_what_the_code_imports() -> None:
    """Each .py row's "may call" cell equals `may_call` of the file (module-level, lazy and TYPE_CHECKING
    imports alike, as tests/test_import_graph.py sees them)."""
    graph = import_graph()
    wrong = {f: (cell, may_call(f, graph)) for f, cell in _rows().items() if cell != may_call(f, graph)}
    assert not wrong, "docs/architecture.md's 'may call' cells differ from the imports (doc, code):\n" + "\n".join(
        f"  {f}: {doc!r} -> {code!r}" for f, (doc, code) in sorted(wrong.items())
    )


# Circles in files other sessions are changing, each with its reason; an entry that is gone fails too, so the
# list only shrinks.
ALLOWED_CYCLES: dict[tuple[str, ...], str] = {
    ("pagedkv.engine.lifecycle", "pagedkv.engine.llm_engine", "pagedkv.engine.speculative.draft",
     "pagedkv.engine.speculative.proposer"):
        "the draft model runs the target's forward preparation (llm_engine._prepare_forward) and lifecycle "
        "annotates its Engine; speculation and the lifecycle are being changed now (issues 35, 36)",
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
    assert not gone, f"these ALLOWED_CYCLES are gone: remove them from tests/test_architecture_docs.py: {gone}"


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


def test_every_file_name_that_recurs_is_in_the_one_name_table() -> None:
    """A file name used in two packages is listed, with why, under "One name, two packages"."""
    from collections import defaultdict

    where: dict[str, set[str]] = defaultdict(set)
    for path in PKG.rglob("*.py"):
        if path.name != "__init__.py":
            where[path.name].add(str(path.parent.relative_to(PKG)))
    section = DOC.split("## One name, two packages", 1)[1].split("\n## ", 1)[0]
    listed = {line.split("`")[1] for line in section.splitlines() if line.startswith("| `")}
    recurring = {name for name, dirs in where.items() if len(dirs) > 1}
    assert recurring == listed, f"recurring but not listed: {recurring - listed}; listed but not recurring: {listed - recurring}"
