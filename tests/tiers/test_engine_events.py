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


@pytest.mark.parametrize("seed", [7, 8])
@pytest.mark.parametrize("hash_fn", ["sha256", "fast"])
def test_tier_events_name_each_blocks_true_parent_and_tokens(hash_fn: str, seed: int, tmp_path: Path) -> None:
    """A shadow of what a consumer should read: every block's parent and tokens come from the sequences
    themselves (`request_hashes` over prompt + output). Every `BlockStored`, on the device and on the host
    and disk tiers, names its first block's true parent (or none only where the chain begins there or no
    medium holds the parent, then or after the batch) and carries the true tokens. Write-backs arrive tail first: they once
    went out parentless, as if each began a chain; and with `hash_fn="fast"` (int keys, which the tiers hold
    as bytes) the tiers' events carried neither parent nor tokens."""
    from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored
    from pagedkv.router.policy import request_hashes

    config = EngineConfig(
        num_blocks=14, block_size=BS, host_blocks=10, disk_path=str(tmp_path), disk_bytes=12 * 2048,
        kv_events=True, hash_fn=hash_fn,
    )  # fmt: skip
    engine = Engine(tiny_model("llama"), None, config)
    rng = np.random.default_rng(seed)
    truth: dict[int, tuple[int | None, list[int]]] = {}
    held: dict[str, set[int]] = {}
    checked = {GPU: 0, CPU: 0, DISK: 0}
    parented = {CPU: 0, DISK: 0}
    prompts: dict[str, list[int]] = {}
    finals: dict[str, list[int]] = {}
    batches = []
    todo = workload(rng, 40)

    def add_truth(tokens: list[int]) -> None:
        """Every full block of `tokens` (a sequence so far), with its parent and tokens."""
        hashes = request_hashes(tokens + [0], BS, hash_fn=hash_fn, epoch=engine.manager.epoch)
        for i, h in enumerate(hashes):
            truth[h] = (hashes[i - 1] if i else None, tokens[i * BS : (i + 1) * BS])

    while todo or engine.has_unfinished():
        for _ in range(int(rng.integers(0, 3))):
            if todo:
                prompt = todo.pop()
                prompts[engine.add_request(prompt, PARAMS)] = prompt
        for out in engine.step():
            finals[out.request_id] = list(prompts[out.request_id]) + list(out.output_token_ids)
        batches.append(engine.take_event_batch())  # one step's events
    for tokens in finals.values():  # every block published is a prefix of a finished sequence
        add_truth(tokens)
    for batch in batches:
        orphans = []  # parents the step's parentless stores left out: held nowhere then, nor after the step
        for ev in batch.events if batch is not None else ():
            if isinstance(ev, AllBlocksCleared):
                held.clear()
            elif isinstance(ev, BlockRemoved):
                held.setdefault(ev.medium or GPU, set()).difference_update(ev.block_hashes)
            elif isinstance(ev, BlockStored):
                medium = ev.medium or GPU
                first_parent = truth[ev.block_hashes[0]][0]
                if ev.parent_block_hash is None:
                    assert first_parent is None or all(first_parent not in s for s in held.values()), medium
                    orphans.append((medium, first_parent))
                else:
                    assert ev.parent_block_hash == first_parent, medium
                    parented[medium] = parented.get(medium, 0) + 1
                for prev, h in zip(ev.block_hashes, ev.block_hashes[1:]):
                    assert truth[h][0] == prev
                assert ev.token_ids == [t for h in ev.block_hashes for t in truth[h][1]], medium
                held.setdefault(medium, set()).update(ev.block_hashes)
                checked[medium] += 1
        for medium, parent in orphans:  # a parent stored later in the same step: the event should name it
            assert parent is None or all(parent not in s for s in held.values()), (medium, "parent stored after")
    assert all(n > 0 for n in checked.values()), checked
    assert parented[CPU] > 0 and parented[DISK] > 0, parented
    engine.close()
