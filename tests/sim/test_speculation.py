"""Speculation in the simulator: the same requests finish with the same tokens, no block leaks, the
acceptance drawn is the one asked for, and the figures move as the roofline says: at low load (memory-bound
steps) accepted drafts are nearly free tokens, so speculation cuts TPOT; with nothing accepted and a costly
draft it only slows down; the contiguous allocators do not speculate."""

from __future__ import annotations

import pytest

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.speculative.adaptive import FIRST_COOLDOWN, MAX_COOLDOWN, AdaptiveK
from pagedkv.sim.catalog import BUILTIN_GPUS, BUILTIN_MODELS
from pagedkv.sim.commands_simulate import simulate_main
from pagedkv.sim.run_metrics import summarize
from pagedkv.sim.simulator import SimConfig, simulate
from pagedkv.sim.speculation import Drafter, SpecSim
from pagedkv.sim.workload import WorkloadSpec, build_workload

MODEL, GPU = BUILTIN_MODELS["llama-2-7b"], BUILTIN_GPUS["a100-40gb"]


@pytest.fixture(scope="module")
def light():
    """A light load: few requests at a time, memory-bound decode steps."""
    return build_workload(WorkloadSpec(num_requests=40, time_scale=2.0), 2048)


def run(workload, spec: SpecSim | None, allocator: str = "paged-prefix") -> tuple[dict, object]:
    config = SimConfig(MODEL, GPU, allocator, max_model_len=2048, speculation=spec)
    trace = simulate(config, workload, check_every=5)
    assert trace.final_used_blocks == 0, "speculation leaked blocks"
    return summarize(trace), trace


def test_accepted_drafts_cut_tpot_at_low_load(light) -> None:
    plain, _ = run(light, None)
    spec, trace = run(light, SpecSim(k=4, acceptance_rate=0.8, adaptive=False))  # the i.i.d. formula at fixed k
    assert spec["num_requests"] == plain["num_requests"] == len(light.requests)
    assert spec["spec_acceptance_rate"] == pytest.approx(0.8 * (1 - 0.8**4) / (1 - 0.8) / 4, abs=0.08)
    assert trace.spec_drafts > 0 and spec["num_steps"] < plain["num_steps"]
    assert spec["tpot_p50_s"] < 0.6 * plain["tpot_p50_s"], (spec["tpot_p50_s"], plain["tpot_p50_s"])
    assert "spec_acceptance_rate" not in plain


def test_nothing_accepted_with_a_costly_draft_only_slows_down(light) -> None:
    """At a fixed k it costs every step; the engine's adaptive k switches the missing proposer off, so the
    slowdown is bounded (a few wasted verifications per cool-down, each cool-down twice the last)."""
    plain, _ = run(light, None)
    fixed, fixed_trace = run(light, SpecSim(k=4, acceptance_rate=0.0, draft_cost=0.2, adaptive=False))
    assert fixed_trace.spec_drafts > 0 and fixed_trace.spec_accepted_tokens == 0
    assert fixed["tpot_p50_s"] > 1.5 * plain["tpot_p50_s"]
    assert fixed["spec_draft_time_fraction"] > 0.3
    adaptive, trace = run(light, SpecSim(k=4, acceptance_rate=0.0, draft_cost=0.2))
    assert trace.spec_drafts > 0 and trace.spec_accepted_tokens == 0
    assert trace.spec_draft_tokens < fixed_trace.spec_draft_tokens / 10
    assert adaptive["tpot_p50_s"] < 1.1 * plain["tpot_p50_s"], (adaptive["tpot_p50_s"], plain["tpot_p50_s"])
    assert adaptive["spec_draft_time_fraction"] < 0.1  # the fixed k's is over 0.3


class Scripted(Drafter):
    """Each verification's drafts agree with the target for the next `script[i]` tokens (then 0: every
    draft misses): a fixed acceptance sequence instead of the i.i.d. draws."""

    def __init__(self, spec: SpecSim, script: list[int]) -> None:
        super().__init__(spec)
        self.script = list(script)
        self.used = 0

    def accepted(self, limit: int) -> int:
        agree = self.script[self.used] if self.used < len(self.script) else 0
        self.used += 1
        return min(limit, agree)


def engine_rule(script: list[int], k: int, output_len: int, *, adaptive: bool) -> dict[str, int]:
    """One request decoding `output_len` tokens, its draft length by the engine's `AdaptiveK` (or a fixed k),
    each verification accepting what `script` says: its counters, steps and the draft length of each step."""
    rule = AdaptiveK(k)
    got = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "steps": 1}  # the prefill step samples token 1
    asks: list[int] = []
    produced, used = 1, 0
    while produced < output_len:
        n = min(rule.next_k() if adaptive else k, output_len - produced - 1)
        got["steps"] += 1
        if n <= 0:
            produced += 1
            asks.append(0)
            continue
        m = min(n, script[used] if used < len(script) else 0)
        used += 1
        rule.record(n, m)
        got["drafts"], got["draft_tokens"], got["accepted"] = got["drafts"] + 1, got["draft_tokens"] + n, got["accepted"] + m
        produced += m + 1
        asks.append(n)
    return {**got, "asks": asks}  # type: ignore[dict-item]


@pytest.mark.parametrize("adaptive", [True, False])
def test_one_request_follows_the_engines_adaptive_k_on_a_fixed_acceptance_sequence(adaptive: bool) -> None:
    """Full acceptance, a partial one (k shrinks to accepted + 1 and grows back), misses that switch the
    proposer off for cool-downs of 4, 8, 16 ... steps, then a run of misses to the end: the simulated
    verifications, drafted and accepted tokens, steps, mean accepted length and draft time are the ones the
    engine's rule (`AdaptiveK`, run here by hand) gives."""
    script = [4, 4, 1, 3, 0, 0, 0, 0, 2, 4, 4, 4, 0, 1, 0, 0]
    k, prompt_len, output_len, cost = 4, 64, 400, 0.1
    workload = build_workload(WorkloadSpec("fixed", num_requests=1, prompt_len=prompt_len, output_len=output_len), 2048)
    spec = SpecSim(k=k, acceptance_rate=0.5, draft_cost=cost, adaptive=adaptive)
    config = SimConfig(MODEL, GPU, "paged-prefix", max_model_len=2048, speculation=spec)
    drafter = Scripted(spec, script)
    trace = simulate(config, workload, drafter=drafter, check_every=1)
    want = engine_rule(script, k, output_len, adaptive=adaptive)
    assert (trace.spec_drafts, trace.spec_draft_tokens, trace.spec_accepted_tokens, len(trace.step_s)) == (
        want["drafts"], want["draft_tokens"], want["accepted"], want["steps"]
    )
    assert drafter.used == want["drafts"]
    assert int(trace.output_len[0]) == output_len and trace.final_used_blocks == 0
    row = summarize(trace)
    assert row["spec_mean_accepted_length"] == pytest.approx(1 + want["accepted"] / want["drafts"])
    # the draft model's time: each proposing step, its k forwards over the request's context (1 token each)
    step_model, produced, draft_s = config.step_model(), 1, 0.0
    for n, m in zip([a for a in want["asks"]], _accepted_per_step(want["asks"], script)):
        if n:
            draft_s += cost * n * step_model.step_seconds([prompt_len + produced - 1], [1])
        produced += m + 1
    assert trace.draft_s == pytest.approx(draft_s)
    if adaptive:  # off steps happened: whole cool-downs with nothing drafted, 4, 8, 16 ... up to 64
        assert 0 in want["asks"] and want["draft_tokens"] < k * want["drafts"]
        assert max(_runs_of_zeros(want["asks"])) == MAX_COOLDOWN and min(_runs_of_zeros(want["asks"])) == FIRST_COOLDOWN


def _accepted_per_step(asks: list[int], script: list[int]) -> list[int]:
    out, used = [], 0
    for n in asks:
        if n:
            out.append(min(n, script[used] if used < len(script) else 0))
            used += 1
        else:
            out.append(0)
    return out


def _runs_of_zeros(asks: list[int]) -> list[int]:
    runs, run = [], 0
    for n in asks:
        if n == 0:
            run += 1
        elif run:
            runs.append(run)
            run = 0
    return runs + ([run] if run else [])


@pytest.fixture(scope="module")
def burst():
    """Every request at t=0: saturated, compute-bound steps."""
    return build_workload(WorkloadSpec(num_requests=120, arrivals="burst"), 2048)


def test_at_saturation_adaptive_k_bounds_a_missing_drafts_cost(burst) -> None:
    """A draft model (cost 0.1) whose drafts all miss: a fixed k loses a quarter of the throughput to the
    draft forwards and the rejected drafts' FLOPs; the adaptive rule keeps it within 3% of the plain run."""
    plain, _ = run(burst, None)
    fixed, _ = run(burst, SpecSim(k=4, acceptance_rate=0.0, draft_cost=0.1, adaptive=False))
    adaptive, _ = run(burst, SpecSim(k=4, acceptance_rate=0.0, draft_cost=0.1))
    assert fixed["tokens_per_s"] < 0.8 * plain["tokens_per_s"], (fixed["tokens_per_s"], plain["tokens_per_s"])
    assert adaptive["tokens_per_s"] > 0.97 * plain["tokens_per_s"], (adaptive["tokens_per_s"], plain["tokens_per_s"])


def test_at_saturation_the_step_budget_drops_what_adaptive_k_still_pays(burst) -> None:
    """The same missing draft model: the engine's DraftBudget, fitted to the simulated steps, sees that no
    draft pays and cuts the misses AdaptiveK still verifies after each cool-down; within 0.5% of plain."""
    plain, _ = run(burst, None)
    alone, alone_trace = run(burst, SpecSim(k=4, acceptance_rate=0.0, draft_cost=0.1, budget=False))
    budget, trace = run(burst, SpecSim(k=4, acceptance_rate=0.0, draft_cost=0.1))
    assert trace.spec_draft_tokens < 0.5 * alone_trace.spec_draft_tokens
    assert budget["tokens_per_s"] > max(0.995 * plain["tokens_per_s"], alone["tokens_per_s"])


def test_under_iid_acceptance_adaptive_k_drafts_shorter_than_a_fixed_k(burst) -> None:
    """i.i.d. draws carry no memory, so the rule's shrinking k (one more than the last verification accepted)
    proposes fewer drafts than a fixed k and accepts fewer per verification: adaptive k buys nothing here
    but its switch-off (module docstring of pagedkv.sim.speculation)."""
    fixed, fixed_trace = run(burst, SpecSim(k=4, acceptance_rate=0.7, adaptive=False))
    adaptive, trace = run(burst, SpecSim(k=4, acceptance_rate=0.7))
    assert trace.spec_draft_tokens / trace.spec_drafts < 0.9 * fixed_trace.spec_draft_tokens / fixed_trace.spec_drafts
    assert 1.0 < adaptive["spec_mean_accepted_length"] < fixed["spec_mean_accepted_length"]
    assert adaptive["tokens_per_s"] < fixed["tokens_per_s"]


def test_the_contiguous_baseline_does_not_speculate(light) -> None:
    plain, _ = run(light, None, "contiguous-oracle")
    spec, trace = run(light, SpecSim(k=4, acceptance_rate=0.9), "contiguous-oracle")
    assert trace.spec_drafts == 0 and spec == plain


def test_bad_parameters_are_refused() -> None:
    for kw in ({"k": 0}, {"acceptance_rate": 1.5}, {"draft_cost": -1.0}, {"acceptance_rate": float("nan")},
               {"budget": 1}):  # fmt: skip
        with pytest.raises(InvalidArgumentError):
            SpecSim(**kw)  # type: ignore[arg-type]
    assert SpecSim(k=3, acceptance_rate=1.0).expected_tokens_per_verification == 4.0
    assert SpecSim(k=2, acceptance_rate=0.5).expected_tokens_per_verification == pytest.approx(1.75)


def test_simulate_flags(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "llama-2-7b", "--gpu", "a100-40gb", "--allocators", "paged-prefix", "--num-requests", "30",
            "--max-model-len", "2048", "--no-progress", "--spec-k", "3", "--spec-acceptance", "0.6", "--json"]  # fmt: skip
    assert simulate_main(argv) == 0
    import json

    row = json.loads(capsys.readouterr().out)["allocators"]["paged-prefix"]
    assert 0.3 < row["spec_acceptance_rate"] < 0.7 and row["spec_mean_accepted_length"] > 1.5
    assert simulate_main([*argv, "--spec-fixed-k"]) == 0  # every step proposes 3: longer drafts, more accepted
    fixed = json.loads(capsys.readouterr().out)["allocators"]["paged-prefix"]
    assert fixed["spec_mean_accepted_length"] > row["spec_mean_accepted_length"]
    assert simulate_main([*argv, "--spec-no-budget"]) == 0  # AdaptiveK alone
    alone = json.loads(capsys.readouterr().out)["allocators"]["paged-prefix"]
    assert alone["spec_mean_accepted_length"] > 1.0
    with pytest.raises(SystemExit) as bad:
        simulate_main([*argv[:-1], "--spec-acceptance", "2"])
    assert bad.value.code == 2
    assert "--spec-acceptance" in capsys.readouterr().err
