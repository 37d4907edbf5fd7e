from __future__ import annotations

import numpy as np
import pytest

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.workloads import generators as gen


def _same(a: list[gen.GeneratedRequest], b: list[gen.GeneratedRequest]) -> bool:
    return all(
        x.arrival_s == y.arrival_s
        and np.array_equal(x.prompt_token_ids, y.prompt_token_ids)
        and np.array_equal(x.output_token_ids, y.output_token_ids)
        and x.parent == y.parent
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda s: gen.variable_length(50, seed=s, rate=2.0),
        lambda s: gen.fixed_length(20, seed=s),
        lambda s: gen.shared_prefix(20, seed=s),
        lambda s: gen.multi_turn(5, seed=s),
    ],
    ids=["variable", "fixed", "shared-prefix", "multi-turn"],
)
def test_same_seed_same_workload(make) -> None:
    assert _same(make(3), make(3)), "same seed must give the same workload"
    assert not _same(make(3), make(4)), "a different seed should differ"


def test_variable_length_matches_the_azure_fit() -> None:
    reqs = gen.variable_length(20000, seed=1)
    p = np.log([r.prompt_len for r in reqs])
    o = np.log([r.output_len for r in reqs])
    assert abs(p.mean() - 6.633) < 0.03 and abs(p.std() - 0.985) < 0.03, "prompt log-normal"
    assert abs(o.mean() - 5.019) < 0.03 and abs(o.std() - 0.859) < 0.03, "output log-normal"


def test_azure_fit_constants_come_from_the_trace() -> None:
    from pagedkv.workloads.traces import default_trace_path, load_trace

    rows = load_trace(default_trace_path())
    p = np.log([r.prompt_len for r in rows])
    o = np.log([r.output_len for r in rows])
    assert (round(p.mean(), 3), round(p.std(), 3)) == gen.AZURE_CONV_PROMPT_LOGNORMAL, "prompt fit"
    assert (round(o.mean(), 3), round(o.std(), 3)) == gen.AZURE_CONV_OUTPUT_LOGNORMAL, "output fit"


def test_fixed_length_is_fixed_and_private() -> None:
    reqs = gen.fixed_length(10, prompt_len=64, output_len=8)
    assert {(r.prompt_len, r.output_len) for r in reqs} == {(64, 8)}, "every request the same"
    assert all(r.arrival_s == 0.0 for r in reqs), "no rate: all at t=0"
    assert not np.array_equal(reqs[0].prompt_token_ids[:16], reqs[1].prompt_token_ids[:16]), "private prompts"


def test_token_ids_avoid_reserved_ids() -> None:
    for r in gen.variable_length(30, seed=2):
        ids = np.concatenate([r.prompt_token_ids, r.output_token_ids])
        assert ids.min() >= 1 and ids.max() < gen.VOCAB, "0 and >= VOCAB are reserved for markers"


def test_shared_prefix_shares_exactly_the_system_prompt() -> None:
    reqs = gen.shared_prefix(5, system_prompt_len=100)
    for r in reqs[1:]:
        assert np.array_equal(r.prompt_token_ids[:100], reqs[0].prompt_token_ids[:100]), "shared head"
        assert r.prompt_len > 100, "plus private user text"


def test_multi_turn_prompts_extend_the_history() -> None:
    reqs = gen.multi_turn(2, turns=3, think_s=4.0)
    assert len(reqs) == 6, "2 conversations x 3 turns"
    for prev, nxt in zip(reqs[:2], reqs[1:3]):
        history = np.concatenate([prev.prompt_token_ids, prev.output_token_ids])
        assert np.array_equal(nxt.prompt_token_ids[: len(history)], history), "turn k+1 starts with turn k"
        assert nxt.parent == prev.index and nxt.think_s == 4.0, "follows its parent"
    assert reqs[0].parent is None and reqs[3].parent is None, "first turns have no parent"


def test_multi_turn_respects_max_prompt_len() -> None:
    reqs = gen.multi_turn(4, turns=10, max_prompt_len=600)
    assert max(r.prompt_len for r in reqs) <= 600, "conversation stops before the limit"


def test_poisson_rate() -> None:
    t = gen.poisson_arrivals(20000, 5.0, np.random.default_rng(0))
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0), "sorted from 0"
    assert abs(len(t) / t[-1] - 5.0) < 0.15, "about 5 requests/s"


def test_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="num_requests"):
        gen.fixed_length(0)
    with pytest.raises(InvalidArgumentError, match="prompt_len"):
        gen.fixed_length(1, prompt_len=0)
    with pytest.raises(InvalidArgumentError, match="rate"):
        gen.poisson_arrivals(3, -1.0, np.random.default_rng(0))
