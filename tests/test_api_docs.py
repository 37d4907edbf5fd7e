"""docs/api.md is the one index of the public API: every name `pagedkv.core` exports, and the engine's entry
points, are in it, each importable from where the page says."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pagedkv.core

API = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()


def test_every_core_export_is_documented() -> None:
    missing = [name for name in pagedkv.core.__all__ if f"`{name}`" not in API]
    assert not missing, f"docs/api.md does not name {missing}"


def test_the_engine_rows_import_from_the_module_they_name() -> None:
    rows = re.findall(r"^\| `(\w+)` \| `(pagedkv\.engine\.\w+)` \|", API, flags=re.MULTILINE)
    assert {name for name, _ in rows} >= {"Engine", "EngineConfig", "SchedulerConfig", "SamplingParams"}, rows
    for name, module in rows:
        assert hasattr(importlib.import_module(module), name), f"{module} has no {name}"
