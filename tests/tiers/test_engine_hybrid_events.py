"""KV events and tiers together with the hybrid allocator (issue #24): on tiny windowed models with a host
and a disk tier, the engine's event batches rebuild, after every step, exactly what each medium holds in
each KV cache group (the device's prefix index, the host and disk tiers' ready slots, under each group's
qualified key); every `BlockStored` carries its group, its tokens, and a parent only that group holds;
every key a group's log holds chains from its parent through its tokens; greedy output is unchanged. One
run adds a Redis tier (the keys it holds, under each group's qualified key)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from event_state import Consumer, State, check_chains, checker, drive, workload

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.events import CPU, DISK, REMOTE
from pagedkv.hf.tiny import tiny_model

BS = 4
PARAMS = SamplingParams(max_new_tokens=4)


@pytest.mark.parametrize(
    ("family", "num_blocks", "seed", "remote"),
    [("gemma2", 30, 0, False), ("gemma2", 30, 1, True), ("mistral", 14, 2, False)],
)
def test_hybrid_events_with_tiers_rebuild_every_group_and_medium(
    family: str, num_blocks: int, seed: int, remote: bool, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    config = dict(num_blocks=num_blocks, block_size=BS, allocator="hybrid", host_blocks=8,
                  disk_path=str(tmp_path), disk_bytes=12 * 4096)  # fmt: skip
    if remote:
        config["remote_url"] = request.getfixturevalue("redis_url")
    engine = Engine(tiny_model(family, 0), None, EngineConfig(**config, kv_events=True))  # type: ignore[arg-type]
    groups = engine.manager.num_groups
    consumer = Consumer(groups)

    def exact(got: State, real: State) -> None:
        assert got == real, "each group's events say what each medium holds"
        check_chains(engine)
        engine.manager.check_invariants()

    prompts = workload(np.random.default_rng(seed), 24, heads=4, head_len=(12, 30), tail=8)
    outs = drive(engine, np.random.default_rng(seed), prompts, checker(engine, consumer, exact), PARAMS)
    stats = engine.stats.tiers
    assert stats.stored_blocks[CPU] > 0 and stats.stored_blocks[DISK] > 0, stats.as_dict()
    assert consumer.stored[CPU] > 0 and consumer.stored[DISK] > 0 and consumer.with_parent > 0
    assert not remote or (stats.stored_blocks[REMOTE] > 0 and consumer.stored[REMOTE] > 0)
    assert stats.cached_tokens[CPU] + stats.cached_tokens[DISK] > 0, "the tiers served a hit"
    engine.tiering.store.check_invariants()
    engine.close()

    config.pop("remote_url", None)  # the store now holds this run's blocks: the twin runs without it
    plain = Engine(tiny_model(family, 0), None, EngineConfig(**config))  # type: ignore[arg-type]
    assert drive(plain, np.random.default_rng(seed), prompts, None, PARAMS) == outs, "events change no token"
    plain.close()


def test_hybrid_tiers_with_events_need_byte_keys() -> None:
    with pytest.raises(Exception, match="byte keys"):
        EngineConfig(num_blocks=40, block_size=BS, allocator="hybrid", host_blocks=8, kv_events=True, hash_fn="fast")
    EngineConfig(num_blocks=40, block_size=BS, allocator="hybrid", host_blocks=8, kv_events=True)


def test_a_device_reset_clears_every_group_once_and_reannounces_the_tiers(tmp_path: Path) -> None:
    """`reset_prefix_cache` on the device: one `AllBlocksCleared` for every group, then each group's tier
    copies again (parents first), so the consumer's view stays exact."""
    engine = Engine(tiny_model("gemma2", 0), None, EngineConfig(
        num_blocks=30, block_size=BS, allocator="hybrid", host_blocks=8, disk_path=str(tmp_path),
        disk_bytes=12 * 4096, kv_events=True))  # fmt: skip
    consumer = Consumer(engine.manager.num_groups)

    def exact(got: State, real: State) -> None:
        assert got == real
        check_chains(engine)

    step_check = checker(engine, consumer, exact)
    prompts = workload(np.random.default_rng(7), 16, heads=4, head_len=(12, 30), tail=8)
    drive(engine, np.random.default_rng(7), prompts[:8], step_check, PARAMS)
    assert all(consumer.state[g, m] for g in range(2) for m in (CPU, DISK)), "the tiers hold blocks of each group"
    assert engine.manager.reset_prefix_cache() > 0  # reported at the next step (the tiering drains it)
    first: list[bool] = []

    def after_reset() -> None:
        step_check()  # exact: the clear wiped the consumer's view, the tiers' copies came back after it
        if not first:
            first.append(True)
            assert consumer.cleared == 1
            assert all(consumer.state[g, m] for g in range(2) for m in (CPU, DISK)), "each group's tier copies again"

    drive(engine, np.random.default_rng(8), prompts[8:], after_reset, PARAMS)
    assert consumer.cleared == 1, "one AllBlocksCleared for every group"
    engine.close()
