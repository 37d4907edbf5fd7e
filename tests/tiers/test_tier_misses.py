"""The miss reason `tier` (issue #25): prompt tokens a tier held and lost are counted under `tier` in the
engine's `stats.cache_misses`, and so in the server's `pagedkv:prefix_cache_miss_tokens_total{reason="tier"}`:
moved there from the admission's own reason, so the reasons still add up to the misses.

Three rounds on a paged engine whose device pool cannot keep round 1's prompts: round 2 pushes them into
the tier, round 3 re-sends them with a new suffix. Lost: a disk tier whose file is overwritten behind the
engine's back (every load fails its checksum), a host tier too small to keep them (they fall off it).
Kept (a tier large enough): nothing counts under `tier`. Output never changes (a lost block is recomputed).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.hf.tiny import VOCAB, tiny_model

BS = 4


def rounds(engine: Engine, between: Any = None) -> tuple[list[list[int]], int]:
    """The three rounds; `between(engine)` runs before round 3. Returns the outputs and round 3's prompt
    tokens the device cache did not serve (all but the last of each prompt, less its device hits)."""
    rng = np.random.default_rng(5)
    first = [rng.integers(3, VOCAB, size=n).tolist() for n in (33, 29)]
    other = [rng.integers(3, VOCAB, size=n).tolist() for n in (30, 34, 31, 27)]
    outs: list[list[int]] = []
    missed = 0
    for i, batch in enumerate((first, other, [p + [7, 8] for p in first])):
        if i == 2 and between is not None:
            between(engine)
        got: dict[str, list[int]] = {}
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=5)) for p in batch]
        while engine.has_unfinished():
            for o in engine.step():
                got[o.request_id] = o.output_token_ids
                if i == 2 and o.finished:
                    missed += o.num_prompt_tokens - 1 - o.num_cached_tokens_by_tier["GPU"]
        outs += [got[r] for r in ids]
    return outs, missed


def make(tmp_path: Path | None = None, **tiers: Any) -> Engine:
    config = EngineConfig(num_blocks=16, block_size=BS, **tiers)
    return Engine(tiny_model("llama", 0), None, config)


def assert_reasons_partition_the_misses(engine: Engine) -> None:
    """A tier's loss moves tokens from the admission's reason to `tier`: the reasons still add up (a
    Prometheus sum over `reason` is the total), and none goes negative."""
    st = engine.manager.stats
    assert sum(st.miss_tokens.values()) + st.cached_tokens + st.admissions == st.prompt_tokens, st
    assert min(st.miss_tokens.values()) >= 0 and min(st.miss_lookups.values()) >= 0, st


def corrupt_disk(engine: Engine) -> None:
    """Overwrite the disk tier's file in place (its entries stay indexed; every read fails its checksum)."""
    (disk,) = [t for t in engine.tiering.store.local if t.medium == "DISK"]
    size = os.path.getsize(disk.path)
    with open(disk.path, "r+b") as f:
        f.write(np.random.default_rng(0).integers(0, 256, size=size, dtype=np.uint8).tobytes())


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    outs, _ = rounds(make())
    return outs


def test_a_corrupted_disk_tier_counts_its_lost_tokens_under_tier(tmp_path: Path, reference: list[list[int]]) -> None:
    engine = make(disk_path=str(tmp_path), disk_bytes=64 * 4096)
    outs, missed = rounds(engine, corrupt_disk)
    stats, misses = engine.stats.tiers, engine.stats.cache_misses
    assert outs == reference, "a lost block is recomputed, never served wrong"
    lost_loads = stats.losses["checksum"] + stats.losses["header"]
    assert lost_loads > 0 and stats.cached_tokens["DISK"] == 0, stats.as_dict()
    # every key the lookup found failed its load: each is one block of tokens the tier should have served
    assert misses.tokens["tier"] == BS * lost_loads, (misses.tokens, stats.as_dict())
    assert 0 < misses.tokens["tier"] <= missed
    assert misses.lookups["tier"] == 2, "one lookup per re-sent prompt met the loss"
    assert_reasons_partition_the_misses(engine)
    engine.close()


def test_blocks_that_fell_off_a_small_host_tier_count_under_tier(reference: list[list[int]]) -> None:
    engine = make(host_blocks=2)
    outs, missed = rounds(engine)
    stats, misses = engine.stats.tiers, engine.stats.cache_misses
    assert outs == reference
    assert stats.losses["evicted"] > 0, stats.as_dict()
    assert 0 < misses.tokens["tier"] <= missed and misses.tokens["tier"] % BS == 0, misses.tokens
    assert_reasons_partition_the_misses(engine)
    engine.close()


def test_a_tier_that_keeps_everything_counts_nothing_under_tier(reference: list[list[int]]) -> None:
    engine = make(host_blocks=64)
    outs, _ = rounds(engine)
    assert outs == reference
    assert engine.stats.tiers.cached_tokens["CPU"] > 0
    assert engine.stats.cache_misses.tokens["tier"] == 0
    assert_reasons_partition_the_misses(engine)
    engine.close()


def test_the_server_metric_reports_tier_misses(tmp_path: Path) -> None:
    from pagedkv.serve.async_engine import EngineSnapshot
    from pagedkv.serve.metrics import ServerMetrics

    engine = make(disk_path=str(tmp_path), disk_bytes=64 * 4096)
    rounds(engine, corrupt_disk)
    tier = engine.stats.cache_misses.tokens["tier"]
    assert tier > 0
    metrics = ServerMetrics("m")
    # what the serving loop publishes after a turn (AsyncEngine._take_snapshot)
    metrics.observe_engine(EngineSnapshot(True, 0, 0, 0, 0, 16, 0, 0, 0, tuple(engine.stats.cache_misses.tokens.items())))
    text = metrics.exposition().decode()
    assert f'pagedkv:prefix_cache_miss_tokens_total{{model_name="m",reason="tier"}} {float(tier)}' in text
    engine.close()


@pytest.mark.parametrize(("family", "num_blocks"), [("gemma2", 36), ("mistral", 12)])
def test_the_hybrid_allocator_counts_lost_tier_tokens_too(tmp_path: Path, family: str, num_blocks: int) -> None:
    """With `allocator="hybrid"` (a block has one copy per KV cache group in the tiers) the same loss counts
    once per block, under `tier`, in the hybrid manager's own counter; outputs as without tiers."""
    def hybrid(**tiers: Any) -> Engine:
        config = EngineConfig(num_blocks=num_blocks, block_size=BS, allocator="hybrid", **tiers)
        return Engine(tiny_model(family, 0), None, config)

    reference, _ = rounds(hybrid())
    engine = hybrid(disk_path=str(tmp_path), disk_bytes=64 * 4096)
    outs, missed = rounds(engine, corrupt_disk)
    stats, misses = engine.stats.tiers, engine.stats.cache_misses
    assert outs == reference
    assert misses is engine.manager.misses and stats is not None
    lost_loads = stats.losses["checksum"] + stats.losses["header"]
    assert lost_loads > 0 and stats.cached_tokens["DISK"] == 0, stats.as_dict()
    groups = engine.manager.num_groups
    assert 0 < misses.tokens["tier"] <= missed and misses.tokens["tier"] % BS == 0, (misses.tokens, missed)
    assert misses.tokens["tier"] == BS * lost_loads // groups, "a block counts once, not once per group's copy"
    assert misses.lookups["tier"] == 2 and misses.tokens["evicted"] > 0, misses.tokens
    assert_reasons_partition_the_misses(engine)
    engine.close()
