"""The packages the README calls torch-free load no torch: core, workloads, events, tiers, router (and the
percentiles every report shares). Each is imported, every module of it, in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "pagedkv"
TORCH_FREE = ["core", "workloads", "events", "tiers", "router", "percentiles"]


def _modules(name: str) -> list[str]:
    path = PKG / name
    if path.with_suffix(".py").exists():
        return [f"pagedkv.{name}"]
    found = sorted(p.relative_to(PKG.parent).with_suffix("") for p in path.rglob("*.py"))
    return [".".join(p.parts[:-1] if p.name == "__init__" else p.parts) for p in found]


@pytest.mark.parametrize("name", TORCH_FREE)
def test_torch_free_packages_load_no_torch(name: str) -> None:
    modules = _modules(name)
    assert modules, name
    code = f"import sys, importlib\nfor m in {modules!r}: importlib.import_module(m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", f"importing pagedkv.{name} loads torch"
