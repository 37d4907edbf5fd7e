"""The tiers' counters with the hybrid allocator (issue #24): a block has one copy per KV cache group in the
tiers, but a token served from a tier counts once (`TierStats.cached_tokens` equals the requests' own
`num_cached_tokens_by_tier`, not `groups` times it)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.hf.tiny import VOCAB, tiny_model

BS = 4


def tier_rounds(engine: Engine) -> dict[str, int]:
    """Round 1: long prompts; round 2: others that push them off the device; round 3: round 1's prompts
    with a new suffix (their prefix is in the host tier). Returns the tokens served per medium, summed
    over the requests' outputs."""
    rng = np.random.default_rng(11)
    first = [rng.integers(3, VOCAB, size=n).tolist() for n in (33, 29)]
    other = [rng.integers(3, VOCAB, size=n).tolist() for n in (30, 34, 31)]
    by_tier: dict[str, int] = {}
    for batch in (first, other, [p + [7, 8] for p in first]):
        for p in batch:
            engine.add_request(p, SamplingParams(max_new_tokens=6))
        while engine.has_unfinished():
            for o in engine.step():
                for medium, n in o.num_cached_tokens_by_tier.items():
                    by_tier[medium] = by_tier.get(medium, 0) + n
    return by_tier


@pytest.mark.parametrize(("family", "num_blocks"), [("gemma2", 36), ("mistral", 12)])
def test_tier_tokens_count_once_per_block_not_per_group(family: str, num_blocks: int) -> None:
    engine = Engine(tiny_model(family, 0), None,
                    EngineConfig(num_blocks=num_blocks, block_size=BS, allocator="hybrid", host_blocks=96))  # fmt: skip
    by_tier = tier_rounds(engine)
    stats = engine.stats.tiers
    assert stats is not None and engine.stats.num_preemptions == 0, "every load is a first admission's"
    assert by_tier.get("CPU", 0) >= 16, by_tier
    assert stats.cached_tokens["CPU"] == by_tier["CPU"], (engine.manager.num_groups, stats.as_dict(), by_tier)
    assert stats.hit_rate("CPU") <= 1.0
    engine.close()
