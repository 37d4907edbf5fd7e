"""The allocator benchmark's loop: exact schedule on a small trace, both allocators, the JSON contract."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from pagedkv.bench.allocator import replay
from pagedkv.core import hotpath
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


# ../shared/data beside the repository (or beside a folder above it, for a worktree nested one level deeper)
MOONCAKE = next(
    (
        p
        for d in Path(__file__).resolve().parents
        if (p := d / "shared/data/mooncake-fast25/synthetic_trace.jsonl").is_file()
    ),
    Path(__file__).resolve().parents[3] / "shared/data/mooncake-fast25/synthetic_trace.jsonl",
)


@pytest.mark.skipif(
    hotpath.NATIVE is None, reason="the C extension is not built: only one backend to compare"
)
@pytest.mark.parametrize(("trace", "limit", "num_blocks", "hash_fn"), [
    ("azure", 300, 2048, "sha256"), ("azure", 300, 2048, "fast"), ("mooncake", 60, 1024, "sha256"),
])  # fmt: skip
def test_both_backends_replay_identically(trace: str, limit: int, num_blocks: int, hash_fn: str) -> None:
    """The C hot path and its Python reference give the same schedule, hits and per-step pool use."""
    reqs = load_trace(default_trace_path() if trace == "azure" else MOONCAKE, limit=limit)
    runs = [
        replay(reqs, "paged", num_blocks=num_blocks, hash_fn=hash_fn, check_every=10, native=native)
        for native in (True, False)
    ]
    assert runs[0].backend == "native" and runs[1].backend == "python"
    volatile = {"wall_s", "us_per_token", "backend"}
    c, py = ({k: v for k, v in asdict(r).items() if k not in volatile} for r in runs)
    assert c == py
    assert runs[0].preemptions > 0 and runs[0].prefix_hit_rate > 0  # the interesting paths ran
    assert runs[0].series == runs[1].series


def test_progress_counts_every_finished_request_of_every_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    reqs = load_trace(default_trace_path(), limit=120)
    seen: list[int] = []
    result = replay(reqs, "paged", num_blocks=1024, progress=seen.append)
    assert sum(seen) == result.requests == 120 and all(n > 0 for n in seen)
    import pagedkv.cli as cli

    # piped (pytest's capture is not a terminal): no bar at all
    assert cli.main(["bench", "allocator", "--limit", "60", "--repeat", "2", "--num-blocks", "1024"]) == 0
    assert "paged run" not in capsys.readouterr().err
    monkeypatch.setattr(cli, "on_terminal", lambda: True)  # as on a terminal
    assert cli.main(["bench", "allocator", "--limit", "60", "--repeat", "2", "--num-blocks", "1024"]) == 0
    assert "paged run 2/2" in capsys.readouterr().err, "the bar names the run on stderr"
    assert cli.main(["bench", "allocator", "--limit", "60", "--num-blocks", "1024", "--no-progress"]) == 0
    assert "paged run" not in capsys.readouterr().err


@pytest.mark.parametrize("max_running", [0, -1])
def test_replay_refuses_a_loop_that_could_never_run(max_running: int) -> None:
    """`bench allocator --max-running 0` hung forever (issue 20 item 8): the replay itself refuses it."""
    from pagedkv.core.errors import InvalidArgumentError

    reqs = load_trace(default_trace_path(), limit=5)
    with pytest.raises(InvalidArgumentError, match="max_running"):
        replay(reqs, "paged", num_blocks=64, max_running=max_running)
    with pytest.raises(InvalidArgumentError, match="no requests"):
        replay([], "paged", num_blocks=64)
