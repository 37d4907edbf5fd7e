"""The engine under each eviction policy, and its miss counters: outputs never depend on what the cache keeps."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.core import InvalidArgumentError
from pagedkv.core.eviction import EVICTION_POLICIES
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.hf.tiny import VOCAB, tiny_model

MAX_NEW = 6


def prompts() -> list[list[int]]:
    """Two shared system prompts, users after them, and one-off documents that flush a small pool."""
    rng = np.random.default_rng(3)
    systems = [rng.integers(3, VOCAB, size=12).tolist() for _ in range(2)]
    out = []
    for i in range(8):
        out.append(systems[i % 2] + rng.integers(3, VOCAB, size=3).tolist())
        if i % 3 == 2:
            out.append(rng.integers(3, VOCAB, size=26).tolist())
    return out


def generate(**config: object) -> tuple[Engine, list[list[int]]]:
    engine = Engine(tiny_model("llama"), None, EngineConfig(**{"num_blocks": 14, "block_size": 4, **config}))  # type: ignore[arg-type]
    outs = [engine.generate([p], SamplingParams(max_new_tokens=MAX_NEW))[0].output_token_ids for p in prompts()]
    engine.manager.check_invariants()
    assert engine.manager.num_used_blocks == 0
    return engine, outs


@pytest.fixture(scope="module")
def lru() -> tuple[Engine, list[list[int]]]:
    return generate()


@pytest.mark.parametrize("policy", [p for p in EVICTION_POLICIES if p != "lru"])
def test_every_policy_gives_the_same_tokens(policy: str, lru: tuple[Engine, list[list[int]]]) -> None:
    engine, outs = generate(eviction=policy)
    assert outs == lru[1]
    assert engine.manager.pool.policy.name == policy and engine.manager.stats.evictions > 0


def test_the_engine_counts_why_prompts_missed(lru: tuple[Engine, list[list[int]]]) -> None:
    engine = lru[0]
    misses = engine.stats.cache_misses
    assert misses is not None and misses is engine.manager.misses
    s = engine.manager.stats
    assert sum(misses.tokens.values()) + s.cached_tokens + s.admissions == s.prompt_tokens
    assert misses.tokens["no_key"] > 0
    flat = misses.as_dict()
    assert flat["miss_tokens_no_key"] == misses.tokens["no_key"] and "miss_lookups_evicted" in flat


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="eviction must be one of"):
        EngineConfig(num_blocks=8, eviction="fifo")


# --- partial-block reuse ----------------------------------------------------------------------------------


def branching_prompts() -> list[list[int]]:
    """Prompts that share prefixes ending inside blocks of 4: 10 tokens, then branches at 6, 9 and 2."""
    rng = np.random.default_rng(7)
    base = rng.integers(3, VOCAB, size=10).tolist()
    tails = [rng.integers(3, VOCAB, size=5).tolist() for _ in range(4)]
    return [base, base[:6] + tails[0], base[:9] + tails[1], base[:2] + tails[2], base[:7], base + tails[3]]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_partial_reuse_gives_the_same_tokens_and_serves_more(family: str) -> None:
    runs = {}
    for on in (False, True):
        engine = Engine(tiny_model(family), None, EngineConfig(num_blocks=32, block_size=4, partial_block_reuse=on))
        outs = [engine.generate([p], SamplingParams(max_new_tokens=MAX_NEW))[0] for p in branching_prompts()]
        engine.manager.check_invariants()
        runs[on] = (engine.manager.stats, [o.output_token_ids for o in outs])
    (off, off_tokens), (on_stats, on_tokens) = runs[False], runs[True]
    assert on_tokens == off_tokens
    assert on_stats.partial_hits >= 4 and on_stats.cached_tokens > off.cached_tokens
    assert EngineConfig(num_blocks=8).partial_block_reuse  # on by default
