"""benchmarks/e2e_schedule_policies.py: the engine's schedule is reproduced and every policy is compared."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "e2e_schedule_policies.py"


def test_policies_replay_the_benchmark_schedule() -> None:
    spec = importlib.util.spec_from_file_location("e2e_schedule_policies", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lines: list[str] = []
    result = module.main(["--slices", "1", "--json"], emit=lines.append)
    assert json.loads(lines[0]) == result and result["workloads"] == 2
    engine = result["policies"]["engine"]
    # the engine's schedule of `pagedkv bench e2e` (the same scheduler, allocator and workload)
    assert engine["default_slice"]["steps"] == 138 and engine["default_slice"]["tokens"] == 3134
    assert engine["default_slice"]["preemptions"] == 0 and engine["relative_mean"] == 1.0
    # without the growth reserve (the engine before 2026-12): 13 preemptions re-run 510 tokens
    greedy = result["policies"]["no-growth-reserve"]["default_slice"]
    assert (greedy["steps"], greedy["tokens"], greedy["preemptions"]) == (134, 3644, 13)
    assert set(result["policies"]) == {
        "engine", "skip-ahead", "victim-cheapest", "victim-starved", "headroom-0.15", "no-growth-reserve",
    }
