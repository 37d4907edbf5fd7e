"""`EngineConfig(kv_events=True)`: the engine's event batches rebuild, after every step of a random workload
with host, disk and Redis tiers on, exactly what each medium holds (the device's prefix index, the host and
disk tiers' ready slots, the Redis keys); no `BlockRemoved` goes out while a copy remains in that medium; no
event names a parent the consumer does not hold. Keys Redis drops by itself are reported when found gone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.prefix import root_key, sha256_key
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.events import (
    CPU,
    DISK,
    GPU,
    REMOTE,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
    external_hash,
)
from pagedkv.hf.tiny import VOCAB, tiny_model
from pagedkv.router.index import ReplicaIndex
from pagedkv.tiers.keys import KEY_PREFIX

BS = 4


def real_state(engine: Engine) -> dict[str, set[int]]:
    """What each medium really holds now, as published hashes."""
    store = engine.tiering.store
    out = {GPU: {external_hash(k) for k in engine.manager.index.all_keys()}}
    for tier in store.local:
        idx = tier.index
        out[tier.medium] = {external_hash(k) for k, s in idx.slot_of.items() if idx.ready[s]}
    remote = store.remote
    if remote is None:
        return {**out, REMOTE: set()}
    prefix = f"{KEY_PREFIX}{remote.fingerprint}:".encode()
    out[REMOTE] = {
        external_hash(bytes.fromhex(k[len(prefix) :].decode()))
        for k in remote.client.scan_iter(match=prefix + b"*")
    }
    return out


class Consumer:
    """The router's index, checking each batch against the real state right after the step that made it."""

    def __init__(self) -> None:
        self.index = ReplicaIndex()
        self.removed = {m: 0 for m in (GPU, CPU, DISK, REMOTE)}

    def apply(self, batch: EventBatch | None, real: dict[str, set[int]]) -> None:
        if batch is None:
            return
        batch = decode_batch(encode_batch(batch))
        for j, e in enumerate(batch.events):
            if isinstance(e, BlockStored):
                if e.parent_block_hash is not None:
                    assert self.index.holders(e.parent_block_hash).get("r"), "a parent never reported"
                assert len(e.token_ids) == BS * len(e.block_hashes), "every medium reports the tokens"
            if isinstance(e, BlockRemoved):
                later = {
                    h for f in batch.events[j + 1 :] if isinstance(f, BlockStored) and f.medium == e.medium
                    for h in f.block_hashes
                }  # fmt: skip
                kept = (set(e.block_hashes) - later) & real[e.medium or GPU]
                assert not kept, f"BlockRemoved({e.medium}) while the medium still holds {len(kept)} of them"
                self.removed[e.medium or GPU] += len(e.block_hashes)
            self.index.apply("r", EventBatch(batch.ts, [e], batch.data_parallel_rank))

    def state(self) -> dict[str, set[int]]:
        got = self.index.state("r")
        return {m: got.get(m, set()) for m in (GPU, CPU, DISK, REMOTE)}


def check_chains(engine: Engine) -> None:
    """Every key the log holds, in any medium, chains from its recorded parent through its recorded tokens."""
    log = engine.kv_events.log
    root = root_key(sha256_key, engine.manager.epoch, b"", b"")
    held = set().union(*(log.holds(m) for m in (GPU, CPU, DISK, REMOTE)))
    for key in held:
        info = log.known(key)
        assert info is not None
        parent, tokens = info
        data = np.asarray(tokens, dtype=np.int32).tobytes()
        assert sha256_key(root if parent is None else parent, data, b"") == key
    assert engine.kv_events.feed.orphans == 0


def workload(rng: np.random.Generator, n: int) -> list[list[int]]:
    heads = [rng.integers(3, VOCAB, size=int(rng.integers(8, 30))).tolist() for _ in range(5)]
    return [
        heads[int(rng.integers(len(heads)))] + rng.integers(3, VOCAB, size=int(rng.integers(1, 10))).tolist()
        for _ in range(n)
    ]


def drive(
    engine: Engine, consumer: Consumer, rng: np.random.Generator, prompts: list[list[int]], check: Any
) -> None:
    """Requests arrive a few per step while earlier ones run; after every step the batch is checked."""
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    todo = list(prompts)
    while todo or engine.has_unfinished():
        for _ in range(int(rng.integers(0, 3))):
            if todo:
                engine.add_request(todo.pop(), params)
        engine.step()
        real = real_state(engine)
        consumer.apply(engine.take_event_batch(), real)
        check(consumer.state(), real)


@pytest.mark.parametrize("seed", [0, 1])
def test_event_batches_rebuild_every_medium(seed: int, redis_url: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(seed)
    config = EngineConfig(
        num_blocks=20, block_size=BS, host_blocks=6, disk_path=str(tmp_path), disk_bytes=8 * 2048,
        remote_url=redis_url, kv_events=True,
    )  # fmt: skip
    engine = Engine(tiny_model("llama"), None, config)
    consumer = Consumer()

    def exact(got: dict[str, set[int]], real: dict[str, set[int]]) -> None:
        assert got == real
        check_chains(engine)

    drive(engine, consumer, rng, workload(rng, 30), exact)
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

    def superset(got: dict[str, set[int]], real: dict[str, set[int]]) -> None:
        assert got[REMOTE] >= real[REMOTE]
        assert {m: got[m] for m in (GPU, CPU, DISK)} == {m: real[m] for m in (GPU, CPU, DISK)}

    drive(engine, consumer, rng, workload(np.random.default_rng(seed), 6), superset)
    # a hole a lookup or write-through meets is reported removed, then stored again once recomputed (in one
    # batch the pair cancels); keys nobody asked for again are found by the audit
    assert engine.kv_events.audit_remote() > 0
    consumer.apply(engine.take_event_batch(), real_state(engine))
    assert consumer.state() == real_state(engine)
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

    def exact(got: dict[str, set[int]], real: dict[str, set[int]]) -> None:
        assert got == real
        check_chains(engine)

    drive(engine, consumer, rng, workload(rng, 30), exact)
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
        EngineConfig(num_blocks=12, kv_events=1)  # type: ignore[arg-type]
