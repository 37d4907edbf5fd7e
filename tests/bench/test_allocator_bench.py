"""The allocator benchmark's loop: exact schedule on a small trace, both allocators, the JSON contract."""

from __future__ import annotations

import json
import subprocess
import sys

from pagedkv.bench.allocator import replay
from pagedkv.workloads.traces import TraceRequest, default_trace_path, load_trace


def test_replay_matches_peers_schedule_on_azure_prefix() -> None:
    reqs = load_trace(default_trace_path(), limit=300)
    paged = replay(reqs, "paged", num_blocks=2048, check_every=25)
    contiguous = replay(reqs, "contiguous", num_blocks=2048, check_every=25)
    total = sum(r.prompt_len + r.output_len for r in reqs)
    assert paged.scheduled_tokens >= total and contiguous.scheduled_tokens == total  # no preemption
    assert paged.preemptions > 0  # the pool is tight: preempted requests re-find their own blocks
    assert 0 < paged.prefix_hit_rate < 0.5
    assert paged.steps < contiguous.steps  # more requests run at once
    assert abs(paged.mean_kv_utilization - paged.utilization_floor) < 0.01
    assert contiguous.mean_kv_utilization < paged.mean_kv_utilization - 0.05


def test_requests_that_never_fit_are_skipped_not_hung() -> None:
    reqs = [TraceRequest(0, 0.0, 100, 10), TraceRequest(1, 0.0, 10_000, 10), TraceRequest(2, 0.0, 50, 5)]
    res = replay(reqs, "paged", num_blocks=64, block_size=16)
    assert res.skipped == 1 and res.requests == 2
    assert res.scheduled_tokens == 100 + 10 + 50 + 5


def test_cli_json_contract() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", "bench", "allocator", "--limit", "200", "--num-blocks", "2048",
         "--allocator", "paged", "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    row = json.loads(out.stdout)
    for key in ("requests", "steps", "scheduled_tokens", "wall_s", "us_per_token", "admissions", "preemptions",
                "prefix_hit_rate", "peak_blocks_in_use", "mean_kv_utilization", "utilization_floor"):  # fmt: skip
        assert key in row, key
    assert row["requests"] == 200 and row["us_per_token"] > 0


def test_plot_is_written(tmp_path) -> None:
    from pagedkv.bench.allocator import plot_replay

    reqs = load_trace(default_trace_path(), limit=100)
    results = [replay(reqs, name, num_blocks=1024) for name in ("paged", "contiguous")]
    assert len(results[0].series["blocks_in_use"]) == results[0].steps
    path = plot_replay(results, tmp_path / "a.png")
    assert path.stat().st_size > 10_000 and path.read_bytes()[:4] == b"\x89PNG"
