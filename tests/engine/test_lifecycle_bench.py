"""`pagedkv bench rl` (pagedkv.bench.rl): the loop runs through the CLI, its stale-KV check passes, and sleep
gives memory back at both levels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.cli import main


@pytest.mark.parametrize("level", [1, 2])
def test_bench_rl_runs_the_loop_and_passes_the_stale_kv_check(level: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rl.json"
    argv = ["bench", "rl", "--prompts", "2", "--samples", "2", "--iterations", "2", "--max-tokens", "6",
            "--prompt-len", "20", "--num-blocks", "64", "--host-blocks", "32", "--sleep-level", str(level),
            "--threads", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "stale-KV check" in printed and "pass" in printed
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["weight_version"] for r in rows] == ["0", "1"] and result["stale_kv_check"] == "pass"
    assert all(r["rollout_tokens"] == 2 * 2 * 6 and r["kv_bytes_freed"] > 0 for r in rows)
    assert all((r["weight_bytes_freed"] > 0) == (level == 2) for r in rows)
