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
