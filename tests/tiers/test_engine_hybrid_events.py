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

from pagedkv.core.group_keys import split_key
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
from pagedkv.tiers.keys import KEY_PREFIX

BS = 4
MEDIA = (GPU, CPU, DISK, REMOTE)
State = dict[tuple[int, str], set[int]]


def real_state(engine: Engine, groups: int) -> State:
    """(group, medium) -> the content hashes that medium holds for that group now."""
    out: State = {(g, m): set() for g in range(groups) for m in MEDIA}
    for key in engine.manager.index.all_keys():
        content, g = split_key(key)
        out[g, GPU].add(external_hash(content))
    for tier in engine.tiering.store.local:
        idx = tier.index
        for key, slot in idx.slot_of.items():
            if idx.ready[slot]:
                content, g = split_key(key)
                out[g, tier.medium].add(external_hash(content))
    remote = engine.tiering.store.remote
    if remote is not None:
        prefix = f"{KEY_PREFIX}{remote.fingerprint}:".encode()
        for k in remote.client.scan_iter(match=prefix + b"*"):
            content, g = split_key(bytes.fromhex(k[len(prefix) :].decode()))
            out[g, REMOTE].add(external_hash(content))
    return out


class GroupConsumer:
    """A router's view per (group, medium), checking each batch against the state right after its step."""

    def __init__(self, groups: int) -> None:
        self.state: State = {(g, m): set() for g in range(groups) for m in MEDIA}
        self.stored = {m: 0 for m in MEDIA}
        self.with_parent = 0

    def apply(self, batch: EventBatch | None, real: State) -> None:
        if batch is None:
            return
        wire = decode_batch(encode_batch(batch))
        assert len(wire.events) == len(batch.events)
        for j, e in enumerate(batch.events):
            g = getattr(e, "group_idx", None)
            assert isinstance(e, BlockStored | BlockRemoved) and g is not None, e
            held = self.state[g, e.medium]
            if isinstance(e, BlockStored):
                assert len(e.token_ids) == BS * len(e.block_hashes), "every medium reports the tokens"
                if e.parent_block_hash is not None:
                    assert any(e.parent_block_hash in self.state[g, m] for m in MEDIA), "a parent the group lacks"
                    self.with_parent += 1
                held.update(e.block_hashes)
                self.stored[e.medium] += len(e.block_hashes)
            else:
                later = {
                    h for f in batch.events[j + 1 :]
                    if isinstance(f, BlockStored) and f.medium == e.medium and getattr(f, "group_idx", None) == g
                    for h in f.block_hashes
                }  # fmt: skip
                kept = (set(e.block_hashes) - later) & real[g, e.medium]
                assert not kept, f"BlockRemoved({e.medium}, group {g}) while it still holds {len(kept)} of them"
                held.difference_update(e.block_hashes)


def check_chains(engine: Engine) -> None:
    root = root_key(sha256_key, engine.manager.epoch, b"", b"")
    for log in engine.kv_events.logs:
        for key in set().union(*(log.holds(m) for m in MEDIA)):
            info = log.known(key)
            assert info is not None
            parent, tokens = info
            data = np.asarray(tokens, dtype=np.int32).tobytes()
            assert sha256_key(root if parent is None else parent, data, b"") == key


def workload(rng: np.random.Generator, n: int) -> list[list[int]]:
    heads = [rng.integers(3, VOCAB, size=int(rng.integers(12, 30))).tolist() for _ in range(4)]
    return [
        heads[int(rng.integers(len(heads)))] + rng.integers(3, VOCAB, size=int(rng.integers(1, 8))).tolist()
        for _ in range(n)
    ]


def run(engine: Engine, prompts: list[list[int]], rng: np.random.Generator, check: object = None) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=4)
    todo = list(prompts)
    ids: list[str] = []
    outs: dict[str, list[int]] = {}
    while todo or engine.has_unfinished():
        for _ in range(int(rng.integers(0, 3))):
            if todo:
                ids.append(engine.add_request(todo.pop(0), params))
        for o in engine.step():
            outs[o.request_id] = o.output_token_ids
        if callable(check):
            check()
    return [outs[i] for i in ids]


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
    consumer = GroupConsumer(groups)

    def exact() -> None:
        real = real_state(engine, groups)
        consumer.apply(engine.take_event_batch(), real)
        assert consumer.state == real
        check_chains(engine)
        engine.manager.check_invariants()

    prompts = workload(np.random.default_rng(seed), 24)
    outs = run(engine, prompts, np.random.default_rng(seed), exact)
    stats = engine.stats.tiers
    assert stats.stored_blocks[CPU] > 0 and stats.stored_blocks[DISK] > 0, stats.as_dict()
    assert consumer.stored[CPU] > 0 and consumer.stored[DISK] > 0 and consumer.with_parent > 0
    assert not remote or (stats.stored_blocks[REMOTE] > 0 and consumer.stored[REMOTE] > 0)
    assert stats.cached_tokens[CPU] + stats.cached_tokens[DISK] > 0, "the tiers served a hit"
    engine.tiering.store.check_invariants()
    engine.close()

    config.pop("remote_url", None)  # the store now holds this run's blocks: the twin runs without it
    plain = Engine(tiny_model(family, 0), None, EngineConfig(**config))  # type: ignore[arg-type]
    assert run(plain, prompts, np.random.default_rng(seed)) == outs, "events change no token"
    plain.close()


def test_hybrid_tiers_with_events_need_byte_keys() -> None:
    with pytest.raises(Exception, match="byte keys"):
        EngineConfig(num_blocks=40, block_size=BS, allocator="hybrid", host_blocks=8, kv_events=True, hash_fn="fast")
    EngineConfig(num_blocks=40, block_size=BS, allocator="hybrid", host_blocks=8, kv_events=True)
