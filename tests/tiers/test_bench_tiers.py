"""`pagedkv bench tiers` runs end to end and reports every tier's figures (values are machine noise)."""

from __future__ import annotations

import json

import pytest

from pagedkv.cli import main


def test_bench_tiers_quick_json(capsys: pytest.CaptureFixture[str], redis_url: str) -> None:
    assert main(["bench", "tiers", "--quick", "--json", "--redis-url", redis_url]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["tier"]: r for r in report["results"]}
    assert set(rows) == {"host", "disk", "redis"}
    assert all(r["put_MBps"] > 0 and r["get_MBps"] > 0 and r["lookup_us"] > 0 for r in rows.values())
    assert rows["redis"]["round_trips_per_request"] == 2 and rows["host"]["round_trips_per_request"] == 0


def test_bench_tiers_local_only_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "tiers", "--quick", "--tiers", "host", "disk"]) == 0
    out = capsys.readouterr().out
    assert "host" in out and "disk" in out and "redis " not in out.splitlines()[-1]
