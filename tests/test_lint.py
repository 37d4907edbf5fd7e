"""The repository's own promises: ruff-clean everywhere, mypy strict on core, engine, sim and storage (the
same targets as `make lint`; pyproject's `[tool.mypy]` overrides make those packages strict)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: run `make test`, which installs the dev extra")
    return path


def test_ruff_clean() -> None:
    out = subprocess.run([_tool("ruff"), "check", "src", "tests", "benchmarks"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
def test_mypy_strict_on_core_engine_sim_and_storage() -> None:
    targets = [f"src/pagedkv/{package}" for package in ("core", "engine", "sim", "storage")]
    makefile = (ROOT / "Makefile").read_text()
    assert f"mypy {' '.join(targets)}" in makefile, "make lint and this test must check the same packages"
    out = subprocess.run([_tool("mypy"), *targets], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
