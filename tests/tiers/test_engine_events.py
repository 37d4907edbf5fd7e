"""`EngineConfig(kv_events=True)`: the engine's event batches rebuild, after every step of a random workload
with host, disk and Redis tiers on, exactly what each medium holds (the device's prefix index, the host and
disk tiers' ready slots, the Redis keys); no `BlockRemoved` goes out while a copy remains in that medium; no
event names a parent the consumer does not hold. Keys Redis drops by itself are reported when found gone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from event_state import Consumer, State, check_chains, checker, drive, real_state, workload

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.events import CPU, DISK, GPU, REMOTE, external_hash
from pagedkv.hf.tiny import tiny_model
from pagedkv.router.index import ReplicaIndex
from pagedkv.tiers.keys import KEY_PREFIX

BS = 4
PARAMS = SamplingParams(max_new_tokens=3, ignore_eos=True)


@pytest.mark.parametrize("seed", [0, 1])
def test_event_batches_rebuild_every_medium(seed: int, redis_url: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(seed)
    config = EngineConfig(
        num_blocks=20, block_size=BS, host_blocks=6, disk_path=str(tmp_path), disk_bytes=8 * 2048,
        remote_url=redis_url, kv_events=True,
    )  # fmt: skip
    engine = Engine(tiny_model("llama"), None, config)
    consumer = Consumer()

    def exact(got: State, real: State) -> None:
        assert got == real
        check_chains(engine)

    drive(engine, rng, workload(rng, 30), checker(engine, consumer, exact), PARAMS)
    stats = engine.stats.tiers
    assert all(stats.stored_blocks[m] > 0 for m in (CPU, DISK, REMOTE)), stats.as_dict()
    assert consumer.removed[GPU] > 0 and consumer.removed[CPU] > 0 and consumer.removed[DISK] > 0
    assert sum(stats.cached_tokens[m] for m in (CPU, DISK, REMOTE)) > 0

    # Redis drops keys by itself (allkeys-lru): the view may keep them until a lookup finds them gone,
    # but never loses a key the store still holds; an audit makes it exact again
    remote = engine.tiering.store.remote
    prefix = f"{KEY_PREFIX}{remote.fingerprint}:".encode()
    stored = sorted(remote.client.scan_iter(match=prefix + b"*"))
    dropped = [stored[int(i)] for i in rng.choice(len(stored), size=3 * len(stored) // 4, replace=False)]
    remote.client.delete(*dropped)

    def superset(got: State, real: State) -> None:
        assert got[0, REMOTE] >= real[0, REMOTE]
        assert {m: got[0, m] for m in (GPU, CPU, DISK)} == {m: real[0, m] for m in (GPU, CPU, DISK)}

    drive(engine, rng, workload(np.random.default_rng(seed), 6), checker(engine, consumer, superset), PARAMS)
    # a hole a lookup or write-through meets is reported removed, then stored again once recomputed (in one
    # batch the pair cancels); keys nobody asked for again are found by the audit
    assert engine.kv_events.audit_remote() > 0
    consumer.apply(engine.take_event_batch(), real_state(engine))
    assert consumer.state == real_state(engine)
    engine.tiering.store.check_invariants()
    engine.close()


@pytest.mark.parametrize("seed", [2, 3])
def test_local_tiers_alone_report_parents_and_tokens(seed: int, tmp_path: Path) -> None:
    """Without a store, a block written back to the host leaves the device in the same step: its parent
    and tokens must still go out with its CPU (and later DISK) `BlockStored`."""
    rng = np.random.default_rng(seed)
    config = EngineConfig(
        num_blocks=16, block_size=BS, host_blocks=5, disk_path=str(tmp_path), disk_bytes=6 * 2048, kv_events=True
    )
    engine = Engine(tiny_model("llama"), None, config)
    consumer = Consumer()

    def exact(got: State, real: State) -> None:
        assert got == real
        check_chains(engine)

    drive(engine, rng, workload(rng, 30), checker(engine, consumer, exact), PARAMS)
    assert consumer.removed[CPU] > 0 and consumer.removed[DISK] > 0
    engine.close()


def test_device_only_events_and_config() -> None:
    engine = Engine(tiny_model("llama"), None, EngineConfig(num_blocks=12, block_size=BS, kv_events=True))
    consumer = ReplicaIndex()
    rng = np.random.default_rng(4)
    for prompts in (workload(rng, 3), workload(rng, 3)):
        engine.generate(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True))
        batch = engine.take_event_batch()
        assert batch is not None
        consumer.apply("r", batch)
        assert consumer.state("r").get(GPU, set()) == {external_hash(k) for k in engine.manager.index.all_keys()}
    assert engine.take_event_batch() is None
    with pytest.raises(InvalidArgumentError, match="kv_events"):
        Engine(tiny_model("llama"), None, EngineConfig(num_blocks=12, block_size=BS)).take_event_batch()
    with pytest.raises(InvalidArgumentError, match="kv_events"):
        EngineConfig(num_blocks=12, kv_events=True, enable_prefix_caching=False)
    with pytest.raises(InvalidArgumentError, match="kv_events"):
        EngineConfig(num_blocks=12, kv_events=1)
