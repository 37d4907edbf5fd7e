"""The Redis tier against a private redis-server: one round trip per verb, holes, corruption, failures."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest
import redis

from pagedkv.tiers.events import TierEvent
from pagedkv.tiers.keys import store_key
from pagedkv.tiers.remote import RedisTier
from pagedkv.tiers.store import TieredStore
from pagedkv.tiers.value import BlockLayout

LAYOUT = BlockLayout("bfloat16", (2, 2, 4, 2, 8))
FP = "00ff00ff00ff00ff"


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def rows(ids: list[int]) -> np.ndarray:
    return np.stack([np.random.default_rng(i).integers(0, 256, LAYOUT.nbytes, dtype=np.uint8) for i in ids])


def test_put_lookup_get_in_one_round_trip_each(redis_url: str) -> None:
    tier = RedisTier(redis_url, LAYOUT, FP)
    assert tier.put([k(0), k(1), k(2)], rows([0, 1, 2])).num_stored == 3
    assert tier.put([k(1)], rows([7])).num_stored == 0  # SET NX: another replica's copy stays
    assert tier.take_events() == [TierEvent("stored", k(i), "REMOTE") for i in range(3)]
    before = tier.round_trips
    assert tier.lookup([k(0), k(1), k(2), k(3)]) == 3
    out = np.zeros((3, LAYOUT.nbytes), np.uint8)
    assert tier.get([k(0), k(1), k(2)], out) == [None, None, None]
    assert np.array_equal(out, rows([0, 1, 2]))
    assert tier.round_trips - before == 2
    raw = redis.Redis.from_url(redis_url)
    assert raw.exists(store_key(FP, k(0))) == 1  # the documented key format
    assert raw.get(store_key(FP, k(0)))[:4] == b"PKVB"  # type: ignore[index]


def test_a_hole_stops_the_chain_and_a_vanished_value_is_evicted(redis_url: str) -> None:
    tier = RedisTier(redis_url, LAYOUT, FP)
    tier.put([k(i) for i in range(4)], rows([0, 1, 2, 3]))
    raw = redis.Redis.from_url(redis_url)
    raw.delete(store_key(FP, k(2)))  # the store's own eviction made a hole
    store = TieredStore(LAYOUT, [], tier)
    assert store.lookup([k(i) for i in range(4)]) == ["REMOTE", "REMOTE"]
    out = np.zeros((2, LAYOUT.nbytes), np.uint8)
    raw.delete(store_key(FP, k(1)))  # gone between lookup and get
    assert tier.get([k(0), k(1)], out) == [None, "evicted"]


def test_corrupt_value_is_a_checksum_miss_and_is_deleted(redis_url: str) -> None:
    tier = RedisTier(redis_url, LAYOUT, FP)
    tier.put([k(0), k(1)], rows([0, 1]))
    raw = redis.Redis.from_url(redis_url)
    value = bytearray(raw.get(store_key(FP, k(1))))  # type: ignore[arg-type]
    value[-5] ^= 0xFF
    raw.set(store_key(FP, k(1)), bytes(value))
    store = TieredStore(LAYOUT, [], tier)
    out = np.zeros((2, LAYOUT.nbytes), np.uint8)
    plan = store.prepare_load([k(0), k(1)], out)
    assert plan.keys == [k(0)] and store.stats.losses == {"checksum": 1}
    assert raw.exists(store_key(FP, k(1))) == 0


def test_other_fingerprint_never_sees_the_blocks(redis_url: str) -> None:
    RedisTier(redis_url, LAYOUT, FP).put([k(0)], rows([0]))
    assert RedisTier(redis_url, LAYOUT, "1111111111111111").lookup([k(0)]) == 0


def test_unreachable_and_silent_servers_are_misses_not_exceptions(tmp_path: Path) -> None:
    gone = RedisTier(f"unix://{tmp_path}/nothing.sock", LAYOUT, FP, timeout_s=0.2)
    out = np.zeros((1, LAYOUT.nbytes), np.uint8)
    assert gone.lookup([k(0)]) == 0 and gone.get([k(0)], out) == ["error"]
    assert gone.put([k(0)], rows([0])).num_stored == 0
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # accepts connections, never answers
    silent.bind(str(tmp_path / "silent.sock"))
    silent.listen(8)
    try:
        tier = RedisTier(f"unix://{tmp_path}/silent.sock", LAYOUT, FP, timeout_s=0.2)
        store = TieredStore(LAYOUT, [], tier)
        assert store.lookup([k(0)]) == []
        assert tier.get([k(0)], out) == ["timeout"]
        assert tier.failures["timeout"] >= 2
    finally:
        silent.close()


def test_keys_redis_drops_by_itself_are_reported_once_found_gone(redis_url: str) -> None:
    """Only keys this tier wrote are reported; a silent eviction is reported when a call meets the hole
    (or by `audit`), and a key another replica wrote is that replica's to report."""
    a, b = RedisTier(redis_url, LAYOUT, FP), RedisTier(redis_url, LAYOUT, FP)
    a.put([k(0), k(1), k(2), k(3)], rows([0, 1, 2, 3]))
    assert b.put([k(1), k(4)], rows([1, 4])).num_stored == 1
    assert b.take_events() == [TierEvent("stored", k(4), "REMOTE")]
    a.take_events()
    raw = redis.Redis.from_url(redis_url)
    raw.delete(store_key(FP, k(1)), store_key(FP, k(3)), store_key(FP, k(4)))  # allkeys-lru, unseen
    assert a.take_events() == [] and b.take_events() == []
    assert a.lookup([k(0), k(1), k(2)]) == 1
    assert a.take_events() == [TierEvent("removed", k(1), "REMOTE")]
    assert b.lookup([k(0), k(1)]) == 1 and b.take_events() == []  # b never reported k(1)
    assert a.put([k(1)], rows([1])).num_stored == 1
    assert a.take_events() == [TierEvent("stored", k(1), "REMOTE")]  # held again: reported again
    assert a.audit() == 1 and a.take_events() == [TierEvent("removed", k(3), "REMOTE")]
    assert a.audit() == 0 and a.take_events() == []
    assert b.audit() == 1 and b.take_events() == [TierEvent("removed", k(4), "REMOTE")]


BIG = BlockLayout("float32", (4, 2, 16, 4, 64))  # 128 KiB values


def test_a_batch_written_in_part_reports_exactly_what_was_written(redis_url: str) -> None:
    """Under maxmemory with noeviction, one pipelined SET NX batch gets OK for some keys and OOM for the
    rest: every reply is read, and only the keys written are counted and announced."""
    raw = redis.Redis.from_url(redis_url)
    raw.config_set("maxmemory-policy", "noeviction")
    raw.config_set("maxmemory", int(raw.info("memory")["used_memory"]) + 6 * BIG.nbytes)
    tier = RedisTier(redis_url, BIG, FP)
    values = np.stack([np.random.default_rng(i).integers(0, 256, BIG.nbytes, dtype=np.uint8) for i in range(20)])
    spill = tier.put([k(i) for i in range(20)], values)
    written = [k(i) for i in range(20) if raw.exists(store_key(FP, k(i)))]
    assert 0 < len(written) < 20 and spill.num_stored == len(written)
    assert tier.take_events() == [TierEvent("stored", key, "REMOTE") for key in written]
    assert tier.failures["oom"] == 20 - len(written)


WRONG_SIZES = {
    "empty": lambda v: b"",
    "header only": lambda v: v[:56],
    "one byte short": lambda v: v[:-1],
    "one byte long": lambda v: v + b"\0",
}


@pytest.mark.parametrize("damage", list(WRONG_SIZES))
def test_a_value_of_the_wrong_size_is_found_by_the_lookup_counted_deleted_and_healed(redis_url: str, damage: str) -> None:
    """An empty (or cut, or grown) value at chain position 5: the 5 intact blocks before it are still
    served, the value is counted as a loss and deleted by the lookup that meets it, and the next put of
    that block (the next engine that computes it) writes it again."""
    tier = RedisTier(redis_url, LAYOUT, FP)
    keys = [k(i) for i in range(8)]
    tier.put(keys, rows(list(range(8))))
    raw = redis.Redis.from_url(redis_url)
    value = raw.get(store_key(FP, k(5)))
    assert isinstance(value, bytes)
    raw.set(store_key(FP, k(5)), WRONG_SIZES[damage](value))
    store = TieredStore(LAYOUT, [], tier)
    out = np.zeros((8, LAYOUT.nbytes), np.uint8)
    plan = store.prepare_load(keys, out)
    assert plan.keys == keys[:5] and plan.num_lost >= 1  # the lost block counts under the miss reason tier
    assert np.array_equal(out[:5], rows([0, 1, 2, 3, 4]))
    assert store.stats.losses == {"header": 1}
    assert raw.exists(store_key(FP, k(5))) == 0
    plan = store.prepare_store([], keys)  # the engine computed the chain again and writes it through
    assert [plan.keys[i] for i in plan.write_through] == [k(5)]
    plan.rows[:] = rows([5])
    store.complete_store(plan)
    assert tier.lookup(keys) == 8 and raw.strlen(store_key(FP, k(5))) == len(value)


def test_the_write_through_check_finds_a_wrong_size_value_it_would_otherwise_keep(redis_url: str) -> None:
    """A block computed rather than loaded (a chunk's own block) is never read; the write-through check
    still finds its empty value, counts it, and writes the block again."""
    tier = RedisTier(redis_url, LAYOUT, FP)
    tier.put([k(0), k(1)], rows([0, 1]))
    raw = redis.Redis.from_url(redis_url)
    raw.set(store_key(FP, k(1)), b"")
    store = TieredStore(LAYOUT, [], tier)
    plan = store.prepare_store([], [k(0), k(1)])
    assert [plan.keys[i] for i in plan.write_through] == [k(1)] and store.stats.losses == {"header": 1}
    plan.rows[:] = rows([1])
    store.complete_store(plan)
    out = np.zeros((2, LAYOUT.nbytes), np.uint8)
    assert store.prepare_load([k(0), k(1)], out).num_blocks == 2 and np.array_equal(out, rows([0, 1]))
