"""Miss reasons with `--allocator hybrid` (issues #24 and #25): an engine on a tiny windowed model reports
`stats.cache_misses` from the hybrid manager, the counts add up against the manager's own prompt and
cached tokens, and the server's `pagedkv:prefix_cache_miss_tokens_total{reason}` shows them."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.core.hybrid import HybridKVManager
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.hf.tiny import VOCAB, tiny_model

BS = 4


def _rounds(engine: Engine) -> None:
    """Long prompts, a prefix of each (hits up to its last full block), a short one, a salted re-send."""
    rng = np.random.default_rng(7)
    first = [rng.integers(3, VOCAB, size=n).tolist() for n in (30, 23)]
    batches = [
        [(p, None) for p in first],
        [(p[:26], None) for p in first] + [([9, 9, 9], None)],
        [(first[0] + [8], "tenant-b")],
    ]
    for batch in batches:
        for prompt, salt in batch:
            engine.add_request(prompt, SamplingParams(max_new_tokens=4), cache_salt=salt)
        while engine.has_unfinished():
            engine.step()


@pytest.mark.parametrize("family", ["gemma2", "mistral"])
def test_a_hybrid_engine_reports_miss_reasons(family: str) -> None:
    engine = Engine(tiny_model(family, 0), None, EngineConfig(num_blocks=64, block_size=BS, allocator="hybrid"))
    assert isinstance(engine.manager, HybridKVManager)
    _rounds(engine)
    misses, stats = engine.stats.cache_misses, engine.manager.stats
    assert misses is engine.manager.misses and misses is not None
    tokens = {r: n for r, n in misses.tokens.items() if n}
    # cold 30 and 23; then 26 (24 cached, 1 missed) and 23 again (20 cached, 2 missed); [9, 9, 9]; salted 31
    assert tokens == {"no_key": 29 + 22, "partial_block": 1 + 2, "short_prompt": 2, "salt": 30}, tokens
    assert sum(stats.miss_tokens.values()) + stats.cached_tokens + stats.admissions == stats.prompt_tokens
    assert stats.cached_tokens > 0 and engine.stats.num_preemptions == 0

    from pagedkv.serve.async_engine import EngineSnapshot
    from pagedkv.serve.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.observe_engine(EngineSnapshot(True, 0, 0, 0, 0, 64, 0, 0, 0, tuple(misses.tokens.items())))
    text = metrics.exposition().decode()
    salt = float(tokens["salt"])
    assert f'pagedkv:prefix_cache_miss_tokens_total{{model_name="m",reason="salt"}} {salt}' in text
