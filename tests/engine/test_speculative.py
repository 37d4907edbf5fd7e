"""Speculative decoding on the engine: proposers, adaptive k, and the engine's promises with it on.

Greedy output is token-identical with and without speculation (a Hypothesis search over prompts, k,
chunking, preemption by recompute and by swap, and tiers), the rejected drafts never reach the prefix
cache, a prompt's cache hit is the same with speculation on, and the log-probabilities of accepted tokens
are the ones a non-speculative run reports. Two proposers drive it: the real n-gram lookup, and an oracle
that proposes the reference continuation with seeded corruptions, so every step mixes accepted and
rejected drafts and the rollback runs at every offset inside a block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.request import Request
from pagedkv.engine.scheduler import SchedulerConfig
from pagedkv.engine.speculative import AdaptiveK, NgramProposer, SpeculativeConfig, parse_speculative
from pagedkv.engine.speculative.budget import StepCostFit
from pagedkv.hf.tiny import VOCAB, tiny_model

_MODELS: dict[int, Any] = {}


def model(seed: int = 0) -> Any:
    if seed not in _MODELS:
        _MODELS[seed] = tiny_model("llama", seed)
    return _MODELS[seed]


def copying_prompts(lengths: Sequence[int], seed: int) -> list[list[int]]:
    """Random prompts that repeat a span of themselves, so prompt lookup finds matches."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        p = rng.integers(3, VOCAB, size=n).tolist()
        out.append(p + p[: max(2, n // 2)])
    return out


class OracleProposer:
    """Proposes the reference continuation, corrupted at a seeded random position half the time."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], seed: int) -> None:
        self.reference = reference
        self.rng = np.random.default_rng(seed)
        self.num_proposed = 0

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        out = []
        for r, k in zip(requests, num_tokens):
            ref = self.reference[tuple(r.prompt_token_ids)]
            pos = len(r.output_token_ids)
            d = list(ref[pos : pos + int(self.rng.integers(1, k + 1))])
            if d and self.rng.random() < 0.5:
                j = int(self.rng.integers(0, len(d)))
                d[j] = (d[j] + 1 + int(self.rng.integers(0, VOCAB - 4))) % VOCAB
            self.num_proposed += len(d)
            out.append(d)
        return out

    def forget(self, request_id: str) -> None:
        return None


def run(prompts: list[list[int]], max_new: int, spec: SpeculativeConfig | None, proposer: Any = None,
        params: SamplingParams | None = None, **config: Any) -> tuple[Engine, list[Any]]:  # fmt: skip
    sched = {k: config.pop(k) for k in list(config) if k in SchedulerConfig.__dataclass_fields__}
    cfg = EngineConfig(**{"num_blocks": 64, "block_size": 4, **config}, scheduler=SchedulerConfig(**sched),
                       speculative=spec)  # fmt: skip
    engine = Engine(model(), None, cfg)
    if proposer is not None:
        engine.proposer = proposer
    outs = engine.generate(prompts, params or SamplingParams(max_new_tokens=max_new))
    engine.manager.check_invariants()
    assert engine.manager.num_used_blocks == 0, "speculation leaked KV blocks"
    return engine, outs


# --- proposers and settings -------------------------------------------------------------------------


def test_ngram_proposes_the_tokens_after_the_latest_longest_match() -> None:
    ngram = NgramProposer(2, 4)
    #            0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [9, 1, 2, 3, 7, 8, 1, 2, 3, 5, 6, 1, 2, 3]
    assert ngram.propose(tokens, 2) == [5, 6]  # "1 2 3" matched at 6 (latest), not at 1
    assert ngram.propose(tokens, 10) == [5, 6, 1, 2, 3]  # up to the end, never past it
    assert ngram.propose([4, 5, 6, 7], 3) == []  # no 2-gram repeats
    assert NgramProposer(1, 1).propose([4, 5, 6, 4], 2) == [5, 6]
    assert ngram.propose([1, 2, 1, 2], 3) == [1, 2]  # the match may overlap the suffix
    assert ngram.propose(tokens, 0) == []
    # the longest n wins over a later shorter match: "7 1 2" (n=3) beats the latest "1 2"
    assert NgramProposer(2, 3).propose([7, 1, 2, 4, 0, 1, 2, 5, 7, 1, 2], 1) == [4]


def test_adaptive_k_switches_off_after_misses_and_comes_back() -> None:
    a = AdaptiveK(4)
    assert a.next_k() == 4
    a.record(4, 4)
    assert a.current == 4
    a.record(4, 1)
    assert a.next_k() == 2
    a.record(2, 0)
    a.record(1, 0)  # two misses in a row: off for 4 steps
    assert [a.next_k() for _ in range(5)] == [0, 0, 0, 0, 1]
    a.record(1, 0)
    a.record(1, 0)  # off again, twice as long
    assert [a.next_k() for _ in range(9)] == [0] * 8 + [1]
    a.record(1, 1)  # an accepted token resets the cool-down
    assert a.current == 2 and a.cooldown == 4


def test_parse_speculative_reads_the_cli_forms() -> None:
    assert parse_speculative("ngram:k=4") == SpeculativeConfig("ngram", 4)
    assert parse_speculative("ngram:k=4,budget=0") == SpeculativeConfig("ngram", 4, budget=False)
    assert parse_speculative("ngram:k=4,budget=1") == SpeculativeConfig("ngram", 4)
    s = parse_speculative("ngram:k=3,min=1,max=5,off_above=8")
    assert (s.k, s.prompt_lookup_min, s.prompt_lookup_max, s.disable_by_batch_size) == (3, 1, 5, 8)
    d = parse_speculative("draft:some/model,k=3")
    assert (d.method, d.draft_model, d.k) == ("draft", "some/model", 3)
    for text in ("ngram", "ngram:k=0", "ngram:k=x", "ngram:q=1", "draft:k=3", "beam:k=2", "ngram:min=5,max=2",
                 "draft:m,min=2"):  # fmt: skip
        with pytest.raises(InvalidArgumentError):
            parse_speculative(text)
    assert parse_speculative(s.describe()) == s and parse_speculative(d.describe()) == d


def test_speculation_needs_the_paged_allocator() -> None:
    with pytest.raises(InvalidArgumentError, match="paged"):
        EngineConfig(num_blocks=8, allocator="contiguous", speculative=SpeculativeConfig())


# --- greedy identity ----------------------------------------------------------------------------------

_REFS: dict[tuple[Any, ...], list[list[int]]] = {}


def reference(prompts: list[list[int]], max_new: int) -> list[list[int]]:
    key = (tuple(map(tuple, prompts)), max_new)
    if key not in _REFS:
        _REFS[key] = [o.output_token_ids for o in run(prompts, max_new, None, num_blocks=256)[1]]
    return _REFS[key]


def test_ngram_greedy_is_identical_and_accepts_drafts() -> None:
    prompts = copying_prompts((5, 17, 9, 30, 3), seed=0)
    engine, outs = run(prompts, 24, SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, budget=False))
    assert [o.output_token_ids for o in outs] == reference(prompts, 24)
    spec = engine.stats.spec
    assert spec is not None and spec.num_accepted_tokens > 0 and spec.num_accepted_tokens < spec.num_draft_tokens
    # fewer steps than tokens: several tokens per step
    assert engine.stats.num_steps < max(len(o.output_token_ids) for o in outs) + len(prompts)


def test_rollback_over_block_scaled_pages() -> None:
    """Rejected drafts roll back into blocks with one scale per block (`kv_scale_scheme="block"`): the rewrite
    from offset k > 0 keeps the block's scale (precision only); on these prompts the tokens stay the
    non-speculative ones and nothing leaks."""
    prompts = copying_prompts((5, 17, 9, 30, 3), seed=0)
    kv = {"kv_cache_dtype": "int8", "kv_scale_scheme": "block"}
    _, plain = run(prompts, 24, None, **kv)
    engine, outs = run(prompts, 24, SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, budget=False), **kv)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in plain]
    spec = engine.stats.spec
    assert spec is not None and 0 < spec.num_accepted_tokens < spec.num_draft_tokens, "no draft was rejected"


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    k=st.integers(1, 5),
    budget=st.sampled_from([512, 7, 12]),
    blocks=st.sampled_from([64, 16, 13]),
    mode=st.sampled_from(["recompute", "swap"]),
    tiers=st.booleans(),
    step_budget=st.booleans(),
)
def test_greedy_identical_with_oracle_drafts(seed: int, k: int, budget: int, blocks: int, mode: str,
                                             tiers: bool, step_budget: bool) -> None:  # fmt: skip
    """Half-corrupted oracle drafts: accepted runs, rejections at every offset, preemption and tiers; with
    the step's draft budget cutting drafts by measured step times, or without it."""
    rng = np.random.default_rng(seed)
    lengths = tuple(int(n) for n in rng.integers(2, 14, size=int(rng.integers(2, 5))))
    prompts = copying_prompts(lengths, seed)
    max_new = int(rng.integers(6, 16))
    expected = reference(prompts, max_new)
    oracle = OracleProposer({tuple(p): e for p, e in zip(prompts, expected)}, seed)
    engine, outs = run(
        prompts, max_new, SpeculativeConfig(num_speculative_tokens=k, budget=step_budget), proposer=oracle,
        num_blocks=blocks,
        max_num_batched_tokens=budget, preemption_mode=mode, host_blocks=8 if tiers else 0,
    )  # fmt: skip
    assert [o.output_token_ids for o in outs] == expected
    assert oracle.num_proposed > 0


# --- the prefix cache sees verified tokens only -----------------------------------------------------


class WrongProposer:
    """Always proposes k tokens the model will not pick (the reference's next token + 1...)."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]]) -> None:
        self.reference = reference
        self.proposed: list[tuple[tuple[int, ...], list[int]]] = []

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        out = []
        for r, k in zip(requests, num_tokens):
            ref = self.reference[tuple(r.prompt_token_ids)]
            pos = len(r.output_token_ids)
            d = [(t + 1) % VOCAB for t in ref[pos : pos + k]]
            self.proposed.append((tuple(r.all_token_ids), d))
            out.append(d)
        return out

    def forget(self, request_id: str) -> None:
        return None


def test_rejected_drafts_never_reach_the_prefix_cache() -> None:
    prompts = copying_prompts((13,), seed=3)
    expected = reference(prompts, 20)
    wrong = WrongProposer({tuple(prompts[0]): expected[0]})
    engine, outs = run(prompts, 20, SpeculativeConfig(num_speculative_tokens=4, budget=False), proposer=wrong,
                       params=SamplingParams(max_new_tokens=20, ignore_eos=True))  # fmt: skip
    assert outs[0].output_token_ids[: len(expected[0])] == expected[0]
    verified = prompts[0] + outs[0].output_token_ids
    bs = engine.manager.block_size
    # every full block of verified tokens whose KV was computed is cached (all but the last token's)
    assert engine.manager.match_prefix(verified) == (len(verified) - 1) // bs * bs
    assert wrong.proposed and engine.stats.spec is not None and engine.stats.spec.num_accepted_tokens == 0
    for tokens, drafts in wrong.proposed:  # no draft token ever hits (partial reuse included)
        path = list(tokens) + drafts
        hit = engine.manager.match_prefix(path)
        assert hit <= len(tokens), (tokens, drafts, hit)
    engine.manager.check_invariants()


def test_a_cached_prompt_keeps_its_cache_hit_with_speculation() -> None:
    """The second copy of a prompt takes the same cached tokens with and without speculation, its last
    cached block included (no re-prefill of it), and generates the same tokens."""
    prompts = copying_prompts((23,), seed=5) * 2
    hits = []
    for spec in (None, SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, budget=False)):
        cfg = EngineConfig(num_blocks=64, block_size=4, speculative=spec)
        engine = Engine(model(), None, cfg)
        first = engine.generate(prompts[:1], SamplingParams(max_new_tokens=12))
        second = engine.generate(prompts[1:], SamplingParams(max_new_tokens=12))
        hits.append((second[0].num_cached_tokens, first[0].output_token_ids, second[0].output_token_ids))
    assert hits[0] == hits[1]
    assert hits[0][0] == len(prompts[0]) - 1  # all but the last token (partial-block reuse on)


# --- log-probabilities ------------------------------------------------------------------------------


def test_logprobs_of_accepted_tokens_equal_the_non_speculative_ones() -> None:
    prompts = copying_prompts((9, 21), seed=1)
    params = SamplingParams(max_new_tokens=16, logprobs=3)
    _, plain = run(prompts, 16, None, params=params)
    spec_config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, budget=False)
    engine, spec = run(prompts, 16, spec_config, params=params)
    assert engine.stats.spec is not None and engine.stats.spec.num_accepted_tokens > 0
    for a, b in zip(plain, spec):
        assert a.output_token_ids == b.output_token_ids
        assert a.logprobs is not None and b.logprobs is not None and len(a.logprobs) == len(b.logprobs)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token_id == y.token_id
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


class _PinnedCost(StepCostFit):
    """A step cost that measured steps do not move."""

    def observe(self, num_tokens: int, seconds: float, num_verifying: int = 0) -> None:
        return None


@pytest.mark.parametrize("dear", [True, False])
def test_the_engine_verifies_the_drafts_its_step_budget_plans(dear: bool) -> None:
    """Drafts whose cost no acceptance repays (a verifying request costs 100 steps): the engine verifies
    none, and the output is the same; drafts that cost nothing: it verifies them as AdaptiveK asks."""
    prompts = copying_prompts((5, 17, 9, 30, 3), seed=0)
    cfg = EngineConfig(num_blocks=64, block_size=4, speculative=SpeculativeConfig("ngram", 4, prompt_lookup_min=1))
    engine = Engine(model(), None, cfg)
    assert engine.draft_budget is not None
    cost = (0.001, 0.001, 0.1) if dear else (0.001, 0.0, 0.0)
    engine.draft_budget.cost = _PinnedCost(fixed_s=cost[0], per_token_s=cost[1], per_request_s=cost[2], known=True)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=24))
    assert [o.output_token_ids for o in outs] == reference(prompts, 24)
    spec = engine.stats.spec
    assert spec is not None and (spec.num_drafts == 0) == dear, spec.as_dict()
