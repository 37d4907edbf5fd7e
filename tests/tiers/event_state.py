"""What an engine's media hold per KV cache group, and a consumer of its KV event batches that checks them
(shared by the uniform engine's and the hybrid engine's event tests).

A uniform engine is one group (0). A hybrid engine's device index and tiers hold each group's copy under
its group-qualified key (`pagedkv.core.group_keys`); its events carry the plain content key and `group_idx`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np

from pagedkv.core.group_keys import split_key
from pagedkv.core.hybrid import HybridKVManager
from pagedkv.core.prefix import Key, root_key, sha256_key
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.events import (
    CPU,
    DISK,
    GPU,
    REMOTE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
    external_hash,
)
from pagedkv.hf.tiny import VOCAB
from pagedkv.tiers.keys import KEY_PREFIX

MEDIA = (GPU, CPU, DISK, REMOTE)
State = dict[tuple[int, str], set[int]]  # (group, medium) -> published hashes


def num_groups(engine: Engine) -> int:
    return engine.manager.num_groups if isinstance(engine.manager, HybridKVManager) else 1


def real_state(engine: Engine) -> State:
    """What each (group, medium) really holds now, as published hashes."""
    hybrid = isinstance(engine.manager, HybridKVManager)
    out: State = {(g, m): set() for g in range(num_groups(engine)) for m in MEDIA}

    def add(key: Key, medium: str) -> None:
        content, g = split_key(key) if hybrid else (key, 0)
        out[g, medium].add(external_hash(content))

    for key in engine.manager.index.all_keys():
        add(key, GPU)
    store = engine.tiering.store
    for tier in store.local:
        idx = tier.index
        for key, slot in idx.slot_of.items():
            if idx.ready[slot]:
                add(key, tier.medium)
    remote = store.remote
    if remote is not None:
        prefix = f"{KEY_PREFIX}{remote.fingerprint}:".encode()
        for k in remote.client.scan_iter(match=prefix + b"*"):
            add(bytes.fromhex(k[len(prefix) :].decode()), REMOTE)
    return out


class Consumer:
    """A router's view per (group, medium), checking each batch against the real state right after the step
    that made it: every `BlockStored` carries its tokens and only a parent its group holds; no
    `BlockRemoved` goes out while a copy remains in that medium; batches survive the wire."""

    def __init__(self, groups: int = 1) -> None:
        self.state: State = {(g, m): set() for g in range(groups) for m in MEDIA}
        self.stored: Counter[str] = Counter()
        self.removed: Counter[str] = Counter()
        self.with_parent = 0
        self.cleared = 0

    def apply(self, batch: EventBatch | None, real: State) -> None:
        if batch is None:
            return
        wire = decode_batch(encode_batch(batch))
        assert len(wire.events) == len(batch.events), "every event survives the wire"
        for j, e in enumerate(batch.events):
            if isinstance(e, AllBlocksCleared):  # this replica holds nothing; what it still holds follows
                for held in self.state.values():
                    held.clear()
                self.cleared += 1
                continue
            assert isinstance(e, BlockStored | BlockRemoved), e
            g, medium = getattr(e, "group_idx", None) or 0, e.medium or GPU
            held = self.state[g, medium]
            if isinstance(e, BlockStored):
                assert len(e.token_ids) == e.block_size * len(e.block_hashes), "every medium reports the tokens"
                if e.parent_block_hash is not None:
                    assert any(e.parent_block_hash in self.state[g, m] for m in MEDIA), "a parent never reported"
                    self.with_parent += 1
                held.update(e.block_hashes)
                self.stored[medium] += len(e.block_hashes)
                continue
            later = {
                h for f in batch.events[j + 1 :]
                if isinstance(f, BlockStored) and f.medium == e.medium and (getattr(f, "group_idx", None) or 0) == g
                for h in f.block_hashes
            }  # fmt: skip
            kept = (set(e.block_hashes) - later) & real[g, medium]
            assert not kept, f"BlockRemoved({medium}, group {g}) while the medium still holds {len(kept)} of them"
            held.difference_update(e.block_hashes)
            self.removed[medium] += len(e.block_hashes)


def check_chains(engine: Engine) -> None:
    """Every key any group's log holds, in any medium, chains from its recorded parent through its tokens."""
    events = engine.kv_events
    root = root_key(sha256_key, engine.manager.epoch, b"", b"")
    for log in events.logs:
        for key in set().union(*(log.holds(m) for m in MEDIA)):
            info = log.known(key)
            assert info is not None
            parent, tokens = info
            data = np.asarray(tokens, dtype=np.int32).tobytes()
            assert sha256_key(root if parent is None else parent, data, b"") == key
    assert events.feed.orphans == 0


def workload(
    rng: np.random.Generator, n: int, *, heads: int = 5, head_len: tuple[int, int] = (8, 30), tail: int = 10
) -> list[list[int]]:
    """`n` prompts, each one of a few shared heads plus a private tail."""
    shared = [rng.integers(3, VOCAB, size=int(rng.integers(*head_len))).tolist() for _ in range(heads)]
    return [
        shared[int(rng.integers(len(shared)))] + rng.integers(3, VOCAB, size=int(rng.integers(1, tail))).tolist()
        for _ in range(n)
    ]


def checker(engine: Engine, consumer: Consumer, check: Callable[[State, State], None]) -> Callable[[], None]:
    """A check for `drive`: the step's batch into `consumer`, then `check(consumer.state, real state)`."""

    def step_check() -> None:
        real = real_state(engine)
        consumer.apply(engine.take_event_batch(), real)
        check(consumer.state, real)

    return step_check


def drive(
    engine: Engine, rng: np.random.Generator, prompts: list[list[int]], check: Callable[[], None] | None,
    params: SamplingParams,
) -> list[list[int]]:  # fmt: skip
    """Requests arrive a few per step while earlier ones run; `check()` after every step. Returns the
    outputs in the order the prompts were added (last prompt first)."""
    todo = list(prompts)
    ids: list[str] = []
    outs: dict[str, list[int]] = {}
    while todo or engine.has_unfinished():
        for _ in range(int(rng.integers(0, 3))):
            if todo:
                ids.append(engine.add_request(todo.pop(), params))
        for o in engine.step():
            outs[o.request_id] = o.output_token_ids
        if check is not None:
            check()
    return [outs[i] for i in ids]
