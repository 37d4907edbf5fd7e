"""The GPU scripts do not rot on a CPU: their smoke modes run here (the full runs need a GPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from pagedkv.ops.dispatch import triton_available

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_serving_tiny_smoke_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    serving = _load("gpu_serving")
    assert serving.main(["--tiny", "--out", str(tmp_path), "--num-requests", "5"]) == 0
    report = json.loads((tmp_path / "serving.json").read_text())
    assert report["planned_kv_budget_bytes"] == 24515960832, "pagedkv plan no longer gives 22.83 GiB for the A100-40GB"
    assert set(report["results"]) == set(serving.SYSTEMS)
    for system, r in report["results"].items():
        assert r["num_finished"] == 5 and r["output_tokens"] > 0, system
        assert system in report["simulated"], f"no simulator prediction for {system}"
    # the tiny budget binds the contiguous baseline that reserves the maximum length
    results = report["results"]
    assert results["contiguous-max"]["peak_concurrency"] < results["paged"]["peak_concurrency"]
    assert "measured (simulated)" in capsys.readouterr().out


@pytest.mark.skipif(not triton_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs triton and TRITON_INTERPRET=1 (tests/conftest.py sets it)")
def test_gpu_attention_checks_run_on_the_interpreter() -> None:
    attention = _load("gpu_attention")
    ok, rows = attention.check_correctness("cpu")
    assert ok, rows
    assert len(rows) == len(attention.SMOKE_CASES) + 1  # + the write check


def test_gpu_all_wrapper_is_valid_bash_and_names_existing_files() -> None:
    script = ROOT / "benchmarks" / "gpu_all.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    for path in ("tests/ops/test_gpu.py", "benchmarks/gpu_attention.py", "benchmarks/gpu_serving.py"):
        assert path in text and (ROOT / path).exists(), path
