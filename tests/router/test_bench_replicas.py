"""`pagedkv bench replicas` without Ray: its trace, its figures, and the simulator's prediction for a run."""

from __future__ import annotations

import argparse

import pytest

from pagedkv.bench.replicas import BLOCK_SIZE, RouterRun, TraceSpec, Turn, add_arguments, predict
from pagedkv.core.errors import InvalidArgumentError


def test_the_trace_shares_system_prompts_and_stays_in_the_tiny_vocabulary() -> None:
    spec = TraceSpec(conversations=6, turns=3, systems=2, system_len=8, output_len=4, seed=1)
    trace = spec.build()
    assert trace == spec.build() and len(trace) == 6 and all(len(c) == 3 for c in trace)
    assert trace[0][0][:8] == trace[2][0][:8] != trace[1][0][:8]  # conversation c opens with system c % 2
    assert all(3 <= t < 128 for c in trace for turn in c for t in turn)
    with pytest.raises(InvalidArgumentError):
        TraceSpec(turns=0)


def test_figures_and_the_simulators_prediction_of_a_run() -> None:
    system, out = list(range(10, 26)), [50, 51, 52, 53]
    run = RouterRun("pagedkv", wall_s=2.0)
    history: dict[int, list[int]] = {}
    for c in range(2):  # two conversations of two turns, both on replica "a", the second turn hitting its history
        first = system + [60 + c] * 5
        run.turns.append(Turn(c, 0, "a", first, out, 16 * c, 0.01))
        history[c] = first + out + [70 + c] * 6
        run.turns.append(Turn(c, 1, "a", history[c], out, 24, 0.03))
    s = run.summary()
    prompts = 2 * 21 + 2 * 31
    assert s["prefix_hit_rate"] == pytest.approx((16 + 24 + 24) / prompts)
    assert s["requests_per_replica"] == [4] and s["imbalance"] == 1.0 and s["tokens_per_s"] == 8.0
    args = argparse.ArgumentParser()
    add_arguments(args)
    ns = args.parse_args(["--replicas", "2"])
    sim = predict(run, ns)
    assert sim["router"] == "cost" and sum(sim["requests_per_replica"]) == 4
    # the most the simulator can find: the shared system prompt once, each second turn's history
    assert 0 < sim["prefix_hit_rate"] <= (16 + 2 * ((31 - 1) // BLOCK_SIZE) * BLOCK_SIZE) / prompts
