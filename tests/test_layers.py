"""Imports point one way, and drivers stay short enough to read.

Layering: every ``pagedkv`` module may import its own package and any package on a lower rank, never one on a
higher rank, nor another package of its own rank. Top-level imports and imports inside functions both count
(a lazy import is still a dependency).

    rank 0   core                 torch-free block manager; imports no other pagedkv package
    rank 0   progress             progress on stderr (terminal only), for every layer that runs long work
    rank 0   percentiles          the one percentile of measured values, for every layer that reports them
    rank 1   workloads, events    torch-free, beside core: they import only core, everything above may use them
    rank 2   storage              KV tensors and their byte layout
    rank 3   tiers                torch-free byte tiers below the device (host, disk, remote); uses storage.kv_spec
    rank 4   ops                  attention kernels
    rank 5   hf                   the transformers integration
    rank 6   engine               continuous batching (uses hf, ops, storage, tiers)
    rank 7   router               requests across engines (imports core/events, and may use engine)
    rank 8   sim                  simulator and planner (may use router)
    rank 8   serve                online serving: async engine, OpenAI-compatible HTTP, metrics (uses engine,
                                  router); bench drives it
    rank 9   bench                benchmarks
    rank 10  cli                  the command line
    rank 11  demo                 the `python -m pagedkv.demo` tour, which drives the command line

``pagedkv/__init__.py`` only sets ``__version__`` (it imports nothing) and is not ranked; the public API is each
package's own ``__init__`` (``pagedkv.core``, ``pagedkv.engine``, ...), ranked with its package. A package
listed here that does not exist yet is simply absent from the walk; a package that exists but is missing from
``RANKS`` fails the test, so a new package has to be placed deliberately.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "pagedkv"

RANKS: dict[str, int] = {
    "core": 0,
    "progress": 0,
    "percentiles": 0,
    "workloads": 1,
    "events": 1,
    "storage": 2,
    "tiers": 3,
    "ops": 4,
    "hf": 5,
    "engine": 6,
    "router": 7,
    "sim": 8,
    "bench": 9,
    "serve": 8,
    "cli": 10,
    "demo": 11,
}

MAX_FUNCTION_LINES = 60
# Functions allowed over the limit, each with the reason (keep this list short).
LONG_FUNCTION_EXEMPT = {
    # A Triton kernel takes every pointer, stride and constexpr as its own parameter (no structs): the
    # signature alone is 56 lines. Its body is already split into @triton.jit helpers (_key_tile_range,
    # _key_rows, _scores, _store_rows); what is left is the online-softmax loop, which reads best whole.
    "pagedkv/ops/triton_kernels.py:_paged_attention_kernel",
}


def _modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if p != PKG / "__init__.py")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _top(module: str) -> str | None:
    """The first-level package under pagedkv (``pagedkv.sim.run`` -> ``sim``), or None outside pagedkv."""
    parts = module.split(".")
    if parts[0] != "pagedkv" or len(parts) < 2:
        return None
    return parts[1]


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in the file, at any depth (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "pagedkv":
                # ``from pagedkv import sim`` names a subpackage: rank each name
                found.extend((node.lineno, f"pagedkv.{alias.name}") for alias in node.names)
            else:
                found.append((node.lineno, module))
    return found


def upward_imports() -> list[str]:
    problems: list[str] = []
    for path in _modules():
        own = _top(_module_name(path))
        assert own is not None
        if own not in RANKS:
            problems.append(f"{path.relative_to(SRC)}: package {own!r} has no rank in tests/test_layers.py RANKS")
            continue
        for line, module in _imports(path):
            other = _top(module)
            if other is None or other == own or other not in RANKS:
                continue
            if RANKS[other] >= RANKS[own]:
                problems.append(
                    f"{path.relative_to(SRC)}:{line}: {own} (rank {RANKS[own]}) imports {module} "
                    f"(rank {RANKS[other]})"
                )
    return problems


def long_functions(root: Path = PKG) -> list[str]:
    found: list[str] = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                length = (node.end_lineno or node.lineno) - first + 1
                name = f"{path.relative_to(SRC)}:{node.name}"
                if length > MAX_FUNCTION_LINES and name not in LONG_FUNCTION_EXEMPT:
                    found.append(f"{path.relative_to(SRC)}:{node.lineno}: {node.name} is {length} lines")
    return found


def test_imports_point_one_way() -> None:
    problems = upward_imports()
    assert not problems, "upward imports (see the rank table in tests/test_layers.py):\n" + "\n".join(problems)


def test_every_package_is_ranked() -> None:
    packages = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    packages |= {p.stem for p in PKG.glob("*.py") if p.name != "__init__.py"}
    assert packages <= set(RANKS), f"unranked packages: {sorted(packages - set(RANKS))}"


def test_the_walk_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """The checker itself can fail: an import inside a function and a relative one are both found."""
    pkg = tmp_path / "pagedkv" / "hf"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text("def f():\n    from pagedkv.engine import Engine\n    from ..sim import run\n")
    global SRC
    saved = SRC
    try:
        SRC = tmp_path
        found = [m for _, m in _imports(pkg / "x.py")]
    finally:
        SRC = saved
    assert found == ["pagedkv.engine", "pagedkv.sim"]


def test_no_function_over_60_lines() -> None:
    found = long_functions()
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines (split them into named phases):\n" + "\n".join(found)


def test_the_length_check_can_fail(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def long():\n{body}\n")
    global SRC
    saved = SRC
    try:
        SRC = tmp_path
        assert len(long_functions(tmp_path)) == 1
    finally:
        SRC = saved


def test_the_top_level_init_only_sets_the_version() -> None:
    """What the module docstring says of ``pagedkv/__init__.py``: no imports (so ``import pagedkv`` is free)."""
    tree = ast.parse((PKG / "__init__.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)], "pagedkv/__init__ imports"
    assert any(isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "__version__" for n in tree.body)
