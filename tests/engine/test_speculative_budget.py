"""`DraftBudget` and `plan_drafts`: the draft length per request that maximises a step's expected tokens per
second, from a step cost model and each request's acceptance per position. Deterministic, torch-free."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.speculative.adaptive import FIRST_COOLDOWN
from pagedkv.engine.speculative.budget import PRIOR, DraftBudget, StepCostFit, plan_drafts


def rate(
    acceptance: list[list[float]],
    ks: list[int],
    fixed_s: float,
    per_token_s: float,
    base: int,
    per_request_s: float,
) -> float:
    """Expected tokens per second of a step where request i verifies ks[i] drafts."""
    gain = float(len(ks)) + sum(float(np.prod(a[: j + 1])) for a, k in zip(acceptance, ks) for j in range(k))
    return gain / (fixed_s + per_token_s * (base + sum(ks)) + per_request_s * sum(k > 0 for k in ks))


def test_a_large_batch_with_low_acceptance_drafts_nothing() -> None:
    """Compute-bound step (64 requests, F = 10 ms, 1 ms a token): a 0.3-acceptance draft costs a token's
    compute and returns 0.3 of one; none pays."""
    ks = plan_drafts([[0.3] * 4] * 64, [4] * 64, fixed_s=0.010, per_token_s=0.001, base_tokens=64)
    assert ks == [0] * 64


def test_batch_one_with_high_acceptance_drafts_the_full_k() -> None:
    """Fixed-cost step (F = 20 ms, 0.5 ms a token): every 0.9-acceptance draft pays."""
    assert plan_drafts([[0.9] * 4], [4], fixed_s=0.020, per_token_s=0.0005, base_tokens=1) == [4]
    capped = plan_drafts([[0.9] * 4], [2], fixed_s=0.020, per_token_s=0.0005, base_tokens=1)
    assert capped == [2]  # the cap holds


def test_at_saturation_only_the_nearly_sure_requests_draft() -> None:
    acceptance = [[0.98] * 4] * 4 + [[0.4] * 4] * 60
    ks = plan_drafts(acceptance, [4] * 64, fixed_s=0.010, per_token_s=0.001, base_tokens=64)
    assert all(k > 0 for k in ks[:4]) and ks[4:] == [0] * 60


def test_plan_is_the_best_of_every_choice_on_small_batches() -> None:
    rng = np.random.default_rng(7)
    for _ in range(60):
        b = int(rng.integers(1, 4))
        acceptance = [rng.uniform(0.0, 1.0, size=3).tolist() for _ in range(b)]
        caps = rng.integers(0, 4, size=b).tolist()
        f, c = float(rng.uniform(0.0, 0.02)), float(rng.uniform(0.0001, 0.005))
        s = float(rng.choice([0.0, rng.uniform(0.0, 0.01)]))
        base = b + int(rng.integers(0, 20))
        ks = plan_drafts(acceptance, caps, fixed_s=f, per_token_s=c, base_tokens=base, per_request_s=s)
        assert all(0 <= k <= cap for k, cap in zip(ks, caps))
        best = max(rate(acceptance, list(choice), f, c, base, s)
                   for choice in itertools.product(*(range(cap + 1) for cap in caps)))  # fmt: skip
        assert rate(acceptance, ks, f, c, base, s) == pytest.approx(best, rel=1e-12)


def test_a_verifying_requests_own_cost_takes_the_drafts_that_do_not_repay_it() -> None:
    """Batch 8, F = 40 ms, c = 1 ms: a 0.6-acceptance request pays for its drafts when verifying costs
    nothing more, not when each verifying request also costs 20 ms (its own attention call)."""
    acceptance, caps = [[0.6] * 4] * 8, [4] * 8
    assert plan_drafts(acceptance, caps, fixed_s=0.040, per_token_s=0.001, base_tokens=8) != [0] * 8
    dear = plan_drafts(acceptance, caps, fixed_s=0.040, per_token_s=0.001, base_tokens=8, per_request_s=0.020)
    assert dear == [0] * 8


def test_the_cost_fit_finds_fixed_and_per_token_cost() -> None:
    fit = StepCostFit()
    for n in [1, 1, 1]:
        fit.observe(n, 0.010 + 0.001 * n)
    assert not fit.known  # steps of one size cannot tell F from c
    for n in [5, 40, 12, 64, 3]:
        fit.observe(n, 0.010 + 0.001 * n)
    assert fit.known
    assert fit.fixed_s == pytest.approx(0.010) and fit.per_token_s == pytest.approx(0.001, rel=1e-4)
    assert fit.per_request_s == 0.0  # no step verified drafts: held at 0
    fit.observe(0, 1.0)  # nothing scored, or no time: ignored
    fit.observe(5, 0.0)
    assert fit.per_token_s == pytest.approx(0.001, rel=1e-4)
    for n, r in [(20, 4), (8, 0), (30, 6), (16, 1), (50, 2), (9, 3)]:  # verifying requests cost 5 ms each
        fit.observe(n, 0.010 + 0.001 * n + 0.005 * r, r)
    assert (fit.fixed_s, fit.per_token_s, fit.per_request_s) == pytest.approx((0.010, 0.001, 0.005), rel=1e-3)
    negative = StepCostFit()
    for n in [5, 40, 12, 64, 3]:  # bigger steps faster (noise): c held at 0, F the mean
        negative.observe(n, 0.1 - 0.001 * n)
    assert negative.per_token_s == 0.0 and negative.fixed_s == pytest.approx(0.1 - 0.001 * 24.8, rel=0.1)


def test_draft_budget_keeps_adaptive_k_and_learns_acceptance() -> None:
    budget = DraftBudget(4)
    assert budget.plan(["a"], [4], 1) == [4]  # no cost fit yet: the caps as they are
    assert budget.acceptance("a") == [PRIOR] * 4
    assert budget.next_k("a") == 4
    budget.record("a", 4, 1)  # accepted position 0, rejected position 1
    own = budget.acceptance("a")
    assert own[0] > PRIOR and own[1] < PRIOR and own[2:] == budget.overall[2:]
    budget.next_k("a")  # a step without verification: back towards everyone's
    assert budget.acceptance("a")[1] > own[1]
    budget.record("a", 2, 0)
    budget.record("a", 1, 0)  # two misses in a row: AdaptiveK's cool-down
    assert [budget.next_k("a") for _ in range(FIRST_COOLDOWN + 1)] == [0] * FIRST_COOLDOWN + [1]
    budget.forget("a")
    assert budget.next_k("a") == 4


def test_draft_budget_plans_from_its_fit_and_acceptance() -> None:
    budget = DraftBudget(4)
    for n in [8, 70, 20, 64, 3, 40]:
        budget.observe_step(n, 0.010 + 0.001 * n)
    ids = [str(i) for i in range(64)]
    for rid in ids:
        budget.next_k(rid)
        for _ in range(5):
            budget.record(rid, 4, 0 if rid != "0" else 4)  # "0" is always right, the rest never
    ks = budget.plan(ids, [1] * 64, 64)
    assert ks[0] == 1 and ks[1:] == [0] * 63
    assert budget.plan(["0"], [4], 1) == [4]  # alone, a sure request drafts its cap


def test_bad_input_is_refused() -> None:
    with pytest.raises(InvalidArgumentError):
        DraftBudget(0)
    with pytest.raises(InvalidArgumentError):
        DraftBudget(4).plan(["a", "b"], [1], 2)
    with pytest.raises(InvalidArgumentError):
        plan_drafts([[0.5]], [1], fixed_s=-1.0, per_token_s=0.001, base_tokens=1)
