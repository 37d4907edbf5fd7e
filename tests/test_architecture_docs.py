"""docs/architecture.md names every file under src/pagedkv (its tables say what each owns and may call), and
the files the ownership rules name exist: a new file, or a renamed one, must be placed there deliberately."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "pagedkv"
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
