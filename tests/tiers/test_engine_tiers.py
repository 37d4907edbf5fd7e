"""The engine with tiers: greedy outputs identical with tiers on and off, for a prefix evicted from the
device to each tier (host, disk, Redis) and brought back; corrupt copies are recomputed, never served."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.scheduler import SchedulerConfig
from pagedkv.hf.tiny import VOCAB, tiny_model

BS = 4
PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)
RNG = np.random.default_rng(7)
SHARED = RNG.integers(3, VOCAB, size=40).tolist()  # 10 blocks; 9 can be served (the last token is computed)
OTHERS = [RNG.integers(3, VOCAB, size=40).tolist() for _ in range(3)]
AGAIN = SHARED[:36] + RNG.integers(3, VOCAB, size=4).tolist()  # same 9 blocks, new tail


def run(config: EngineConfig, between: Any = None) -> tuple[Engine, list[Any]]:
    """SHARED, then three other prompts that evict it from the 11-block device, then SHARED and AGAIN."""
    engine = Engine(tiny_model("llama"), None, config)
    outputs = [engine.generate([SHARED], PARAMS)[0]]
    outputs += engine.generate(OTHERS, PARAMS)
    if between is not None:
        between(engine)
    outputs += [engine.generate([p], PARAMS)[0] for p in (SHARED, AGAIN)]
    engine.manager.check_invariants()
    if engine.tiering is not None:
        engine.tiering.store.check_invariants()
    return engine, outputs


@pytest.fixture(scope="module")
def baseline() -> list[list[int]]:
    engine, outputs = run(EngineConfig(num_blocks=12, block_size=BS))
    assert [o.num_cached_tokens for o in outputs[-2:]] == [0, 36]  # the device alone lost the prefix
    return [o.output_token_ids for o in outputs]


def served(outputs: list[Any], medium: str) -> list[int]:
    return [o.num_cached_tokens_by_tier[medium] for o in outputs[-2:]]


def test_host_tier_brings_an_evicted_prefix_back(baseline: list[list[int]]) -> None:
    engine, outputs = run(EngineConfig(num_blocks=12, block_size=BS, host_blocks=64))
    assert [o.output_token_ids for o in outputs] == baseline
    assert served(outputs, "CPU") == [36, 0] and served(outputs, "GPU") == [0, 36]
    assert outputs[-2].num_cached_tokens == 36
    stats = engine.stats.tiers
    assert stats is not None and stats.hit_rate("CPU") > 0 and stats.stored_blocks["CPU"] > 0
    assert outputs[-2].as_dict()["num_cached_tokens_by_tier"] == outputs[-2].num_cached_tokens_by_tier


def test_disk_tier_behind_a_tiny_host_tier(baseline: list[list[int]], tmp_path: Path) -> None:
    config = EngineConfig(
        num_blocks=12, block_size=BS, host_blocks=2, disk_path=str(tmp_path), disk_bytes=1 << 20
    )
    engine, outputs = run(config)
    assert [o.output_token_ids for o in outputs] == baseline
    assert served(outputs, "DISK")[0] >= 28 and served(outputs, "DISK")[0] + served(outputs, "CPU")[0] == 36
    engine.close()
    assert not list(tmp_path.iterdir())  # the disk tier's file goes with the engine


def test_corrupt_disk_blocks_are_recomputed_not_served(baseline: list[list[int]], tmp_path: Path) -> None:
    def corrupt(engine: Engine) -> None:
        disk = engine.tiering.store.local[0]
        with open(disk.path, "r+b") as f:
            f.write(b"\xff" * disk.path.stat().st_size)

    config = EngineConfig(num_blocks=12, block_size=BS, disk_path=str(tmp_path), disk_bytes=1 << 20)
    engine, outputs = run(config, corrupt)
    assert [o.output_token_ids for o in outputs] == baseline
    assert served(outputs, "DISK")[0] == 0
    assert engine.stats.tiers is not None and engine.stats.tiers.losses["header"] >= 1


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG, errno.EIO])
def test_a_full_disk_is_a_counted_loss_not_an_outage(
    baseline: list[list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    def refuse(*args: object) -> int:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr("pagedkv.tiers.disk.os.pwritev", refuse)
    config = EngineConfig(num_blocks=12, block_size=BS, disk_path=str(tmp_path), disk_bytes=1 << 20)
    engine, outputs = run(config)  # the engine keeps serving from the device
    assert [o.output_token_ids for o in outputs] == baseline
    assert served(outputs, "DISK") == [0, 0]
    stats = engine.stats.tiers
    assert stats is not None and stats.local_failures[f"DISK {errno.errorcode[code]}"] >= 10
    assert stats.losses["error"] == stats.local_failures[f"DISK {errno.errorcode[code]}"]
    engine.close()


def test_redis_tier_brings_an_evicted_prefix_back(baseline: list[list[int]], redis_url: str) -> None:
    engine, outputs = run(EngineConfig(num_blocks=12, block_size=BS, remote_url=redis_url))
    assert [o.output_token_ids for o in outputs] == baseline
    assert served(outputs, "REMOTE")[0] == 36
    # every distinct full block once: SHARED's 10, OTHERS' 30, AGAIN's new tail block (its 9 others are SHARED's)
    assert engine.stats.tiers is not None and engine.stats.tiers.stored_blocks["REMOTE"] == 41
    events = engine.tiering.take_events()
    assert {e.medium for e in events} == {"REMOTE"} and {e.kind for e in events} == {"stored"}
    assert len(events) == len({e.key for e in events}) == engine.stats.tiers.stored_blocks["REMOTE"]


def test_device_events_stay_readable_for_an_event_log() -> None:
    """The tiering is the one reader of the manager's events; the engine's event log takes what it drained
    through `take_device_events` (nothing to set from outside): every block evicted from the device is
    reported removed from GPU and stored in CPU, with its parent."""
    config = EngineConfig(num_blocks=12, block_size=BS, host_blocks=8, kv_events=True)
    engine = Engine(tiny_model("llama"), None, config)
    assert engine.tiering is not None and engine.tiering.take_device_events() == []
    batches = []
    for prompts in ([SHARED], OTHERS[:1]):
        engine.generate(prompts, PARAMS)
        batches.append(engine.take_event_batch())
    events = [e for b in batches if b is not None for e in b.events]

    def hashes(kind: str, medium: str) -> list[Any]:
        return [h for e in events if type(e).__name__ == kind and e.medium == medium for h in e.block_hashes]

    published = [e for e in events if type(e).__name__ == "BlockStored" and e.medium == "GPU"]
    assert [e.token_ids for e in published] == [SHARED, OTHERS[0]]  # each prompt's 10 blocks, one event each
    assert [len(e.block_hashes) for e in published] == [10, 10] and len(set(hashes("BlockStored", "GPU"))) == 20
    shared = list(published[0].block_hashes)
    assert hashes("BlockRemoved", "GPU") == shared[::-1]  # OTHERS[0] evicts all of SHARED, tail first
    # each written back to the host as it leaves (tail first; the head last, in a later step); the log sends
    # a step's write-backs parents first, each naming its parent (in the device's order all but the one whose
    # parent was still on the device went out as roots)
    assert hashes("BlockStored", "CPU") == shared[1:] + shared[:1]
    cpu = [e for e in events if type(e).__name__ == "BlockStored" and e.medium == "CPU"]
    assert [e.parent_block_hash for e in cpu] == [*shared[:-1], None]
    assert hashes("BlockRemoved", "CPU") == shared[:-3:-1]  # the 8-block host drops the two oldest
    assert engine.tiering.take_device_events() == []  # the log took them


def test_a_redis_that_goes_away_is_a_miss_not_a_crash(baseline: list[list[int]], redis_server: Any) -> None:
    config = EngineConfig(num_blocks=12, block_size=BS, host_blocks=0, remote_url=redis_server.url)
    engine, outputs = run(config, lambda engine: redis_server.stop())
    assert [o.output_token_ids for o in outputs] == baseline
    assert served(outputs, "REMOTE") == [0, 0]
    assert engine.stats.tiers is not None and engine.stats.tiers.remote_failures["error"] > 0


@pytest.mark.parametrize("budget", [512, 8], ids=["one step", "chunks of 8 tokens"])
def test_an_empty_redis_value_is_counted_deleted_and_healed(redis_url: str, budget: int) -> None:
    """An empty value at chain position 5 (the bytes another writer left): the next fresh engine still serves
    the 20 intact tokens before it, counts the loss, and writes the block again (chunks of 8 tokens compute
    block 5 rather than load it: the write-through check finds it); the engine after it is served as before."""
    import redis

    from pagedkv.tiers.keys import store_key

    config = EngineConfig(num_blocks=12, block_size=BS, remote_url=redis_url,
                          scheduler=SchedulerConfig(max_num_batched_tokens=budget))  # fmt: skip
    first = Engine(tiny_model("llama"), None, config)
    expected = first.generate([SHARED], PARAMS)[0]
    assert first.tiering is not None and first.tiering.store.remote is not None
    chain = [e.key for e in first.tiering.take_events() if e.kind == "stored"]
    raw = redis.Redis.from_url(redis_url)
    name = store_key(first.tiering.store.remote.fingerprint, chain[5])  # type: ignore[attr-defined]
    size = raw.strlen(name)
    raw.set(name, b"")
    healer = Engine(tiny_model("llama"), None, config)
    out = healer.generate([SHARED], PARAMS)[0]
    assert out.output_token_ids == expected.output_token_ids
    assert out.num_cached_tokens_by_tier["REMOTE"] == 20
    assert healer.stats.tiers is not None and healer.stats.tiers.losses == {"header": 1}
    assert raw.strlen(name) == size  # written again by the engine that computed it
    after = Engine(tiny_model("llama"), None, config)
    out = after.generate([SHARED], PARAMS)[0]
    assert out.output_token_ids == expected.output_token_ids
    assert out.num_cached_tokens_by_tier["REMOTE"] == (36 if budget == 512 else 20)  # chunks load every other block
    assert after.stats.tiers is not None and after.stats.tiers.losses == {}


def test_chunked_prefill_loads_chunk_by_chunk(baseline: list[list[int]]) -> None:
    config = EngineConfig(
        num_blocks=12, block_size=BS, host_blocks=64, scheduler=SchedulerConfig(max_num_batched_tokens=8)
    )
    _, outputs = run(config)
    assert [o.output_token_ids for o in outputs] == baseline
    assert served(outputs, "CPU")[0] > 0


def test_all_tiers_together(baseline: list[list[int]], redis_url: str, tmp_path: Path) -> None:
    config = EngineConfig(num_blocks=12, block_size=BS, host_blocks=3, disk_path=str(tmp_path),
                          disk_bytes=1 << 20, remote_url=redis_url)  # fmt: skip
    engine, outputs = run(config)
    assert [o.output_token_ids for o in outputs] == baseline
    by_tier = outputs[-2].num_cached_tokens_by_tier
    assert by_tier["CPU"] + by_tier["DISK"] + by_tier["REMOTE"] + by_tier["GPU"] == 36
    engine.close()


def test_parallel_sampling_and_preemption_with_tiers() -> None:
    """Forked children and preempted requests run as without tiers; only first admissions are counted."""
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=1, n=2, ignore_eos=True)
    prompts = [SHARED[:20], OTHERS[0][:20], OTHERS[1][:20]]
    runs = []
    for host_blocks in (0, 32):
        engine = Engine(
            tiny_model("llama"), None, EngineConfig(num_blocks=16, block_size=BS, host_blocks=host_blocks)
        )
        runs.append([o.output_token_ids for o in engine.generate(prompts, params)])
        engine.manager.check_invariants()
    assert runs[0] == runs[1]
    assert engine.stats.tiers is not None and engine.stats.tiers.prompt_tokens == 60
    assert engine.stats.num_preemptions > 0


@pytest.mark.parametrize(
    "kwargs",
    [dict(host_blocks=-1), dict(disk_path="/tmp/x"), dict(disk_bytes=10), dict(remote_url="http://x"),
     dict(host_blocks=4, enable_prefix_caching=False), dict(host_blocks=4, allocator="contiguous")],
)  # fmt: skip
def test_bad_tier_configs_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        EngineConfig(num_blocks=8, **kwargs)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_shared_prefix_workload_is_identical_with_all_tiers(
    seed: int, redis_url: str, tmp_path: Path
) -> None:
    """Requests drawn from three shared prefixes with random tails, a few at a time, on a device too small
    to keep them: every greedy output equals the tiers-off engine's, and the tiers serve some tokens."""
    rng = np.random.default_rng(seed)
    heads = [rng.integers(3, VOCAB, size=int(rng.integers(8, 28))).tolist() for _ in range(3)]
    batches = [
        [
            heads[int(rng.integers(3))] + rng.integers(3, VOCAB, size=int(rng.integers(1, 9))).tolist()
            for _ in range(3)
        ]
        for _ in range(5)
    ]
    results = []
    for tiers in (False, True):
        extra: dict[str, Any] = (
            dict(host_blocks=4, disk_path=str(tmp_path), disk_bytes=1 << 20, remote_url=redis_url)
            if tiers
            else {}
        )
        engine = Engine(tiny_model("qwen2"), None, EngineConfig(num_blocks=20, block_size=BS, **extra))
        results.append([[o.output_token_ids for o in engine.generate(batch, PARAMS)] for batch in batches])
        engine.manager.check_invariants()
    assert results[0] == results[1]
    stats = engine.stats.tiers
    assert stats is not None and sum(stats.cached_tokens[m] for m in ("CPU", "DISK", "REMOTE")) > 0
    engine.tiering.store.check_invariants()
    engine.close()
