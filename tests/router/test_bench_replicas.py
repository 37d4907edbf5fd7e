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
    run.replicas = 2  # a replica that served nothing counts: everything on one of two is 2x the mean
    assert run.summary()["requests_per_replica"] == [4, 0] and run.summary()["imbalance"] == 2.0
    run.replicas = 0
    args = argparse.ArgumentParser()
    add_arguments(args)
    ns = args.parse_args(["--replicas", "2"])
    sim = predict(run, ns)
    assert sim["router"] == "cost" and sum(sim["requests_per_replica"]) == 4
    # the most the simulator can find: the shared system prompt once, each second turn's history
    assert 0 < sim["prefix_hit_rate"] <= (16 + 2 * ((31 - 1) // BLOCK_SIZE) * BLOCK_SIZE) / prompts


class _Handle:
    """A stand-in for the replicas' Ray handle: answers each request after a short wait on replica "a" or "b"
    (by conversation), and counts the requests in flight."""

    def __init__(self) -> None:
        self.in_flight = self.most = 0
        self.first_turns: list[int] = []

    def options(self, stream: bool) -> _Handle:
        return self

    @property
    def generate(self) -> _Handle:
        return self

    def remote(self, request):  # noqa: ANN001, ANN201
        return self._answer(request)

    async def _answer(self, request):  # noqa: ANN001, ANN202
        import asyncio
        from types import SimpleNamespace

        if len(request.prompt_token_ids) == 9:  # a first turn: the system prompt and its number
            self.first_turns.append(request.prompt_token_ids[-1])
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        await asyncio.sleep(0.001)
        self.in_flight -= 1
        out = SimpleNamespace(finished=True, output_token_ids=[5, 6], num_cached_tokens=4)
        yield "ab"[request.prompt_token_ids[-1] % 2], out


def test_conversations_run_at_most_concurrency_at_once_in_order_and_quick_runs_them_all() -> None:
    import asyncio

    from pagedkv.bench.replicas import _drive, trace_spec

    spec = TraceSpec(conversations=10, turns=3, systems=2, system_len=8, output_len=2, concurrency=3)
    trace = [[turns[0][:8] + [c], *turns[1:]] for c, turns in enumerate(spec.build())]
    for c in range(10):  # every turn ends with its conversation's number (the stand-in routes on it)
        trace[c] = [trace[c][0], *([t + [c] for t in trace[c][1:]])]
    handle = _Handle()
    run = asyncio.run(_drive(handle, trace, spec, "pagedkv"))
    assert len(run.turns) == 30 and handle.most == 3 and handle.first_turns == list(range(10))
    s = run.summary()
    assert s["stayed"] == 1.0 and s["requests_per_replica"] == [15, 15]
    assert s["first_turn_hit_rate"] == pytest.approx(4 / 9)
    assert all(t.sent_s >= 0 for t in run.turns) and run.turns[-1].sent_s > run.turns[0].sent_s
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    quick = trace_spec(parser.parse_args(["--quick"]))
    assert (quick.conversations, quick.concurrency) == (32, 32)
    full = trace_spec(parser.parse_args(["--concurrency", "8"]))
    assert (full.conversations, full.concurrency) == (TraceSpec().conversations, 8)
    with pytest.raises(InvalidArgumentError, match="--concurrency 0"):
        TraceSpec(concurrency=0)


def test_the_bench_models_tiny_is_the_test_models_llama_and_small_is_bigger() -> None:
    """`--model tiny` is `tiny_model("llama", 0)` (the figures before `--model` existed used it): the same
    logits; `small` is the 3.2M-parameter Llama the default runs; anything else is a one-line error."""
    import torch

    from pagedkv.bench.replicas import BENCH_MODELS, bench_model
    from pagedkv.hf.tiny import tiny_model

    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(bench_model("tiny")(ids).logits, tiny_model("llama", 0)(ids).logits)
        small = bench_model("small")
        assert small(ids).logits.shape == (1, 40, 128)
    assert sum(p.numel() for p in small.parameters()) == pytest.approx(3.2e6, rel=0.05)
    assert set(BENCH_MODELS) == {"tiny", "small"}
    with pytest.raises(InvalidArgumentError, match="unknown bench model 'huge'"):
        bench_model("huge")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).model == "small"
