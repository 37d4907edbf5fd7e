"""`make demo`: what it runs, what it explains, and how it leaves the user able to run `pagedkv` next."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from pagedkv import demo

ROOT = Path(__file__).resolve().parent.parent


def test_the_demo_explains_each_figure_it_prints(monkeypatch: pytest.MonkeyPatch, capsys: Any, tmp_path: Path) -> None:
    ran: list[list[str]] = []
    monkeypatch.setattr("pagedkv.cli.main", lambda argv: ran.append(argv) or 0)
    monkeypatch.chdir(tmp_path)
    assert demo.main() == 0
    assert [argv[0] for argv in ran] == ["simulate", "bench", "generate"]
    out = capsys.readouterr().out
    assert '"prefix hit" counts prompt tokens served from the cache at a request\'s first' in out
    assert '"prefill saved" counts every admission, re-admissions after a preemption included' in out
    assert "The contiguous\nbaseline is cheaper per token" in out
    assert "pagedkv generate" in out and "serves" not in out.split("=== pagedkv generate")[1].split("\n")[0]


def _recipe(target: str) -> list[str]:
    text = (ROOT / "Makefile").read_text()
    match = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", text, re.M)
    assert match, f"Makefile has no {target} recipe"
    return match.group(1).splitlines()


def test_make_demo_ends_by_saying_how_to_run_pagedkv() -> None:
    lines = _recipe("demo")
    after = "\n".join(lines[[i for i, line in enumerate(lines) if "pagedkv.demo" in line][0] :])
    assert "source $(VENV)/bin/activate" in after and "$(VENV)/bin/pagedkv" in after


def test_the_install_says_what_it_installs_and_shows_pips_progress() -> None:
    lines = _recipe("$(STAMP)")
    big = [line for line in lines if "pip install" in line and "-e '." in line]
    assert big and " -q " not in big[0], "the big install runs without -q: pip's lines are its progress"
    assert any("echo" in line and "torch" in line and "minutes" in line for line in lines)


def test_the_readme_first_hour_runs_pagedkv_from_the_venv() -> None:
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "source .venv/bin/activate" in quick and ".venv/bin/pagedkv" in quick
