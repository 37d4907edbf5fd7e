"""Host and disk tiers and the policy over them: exact LRU order, spills, two-phase stores, corruption.

A Hypothesis state machine runs random store/load sequences against a shadow model (every byte served
must be the bytes stored under that key) and checks the invariants after each step.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.tiers.disk import DiskTier
from pagedkv.tiers.events import TierEvent
from pagedkv.tiers.host import HostTier
from pagedkv.tiers.slot_index import LruClock, SlotIndex
from pagedkv.tiers.store import TieredStore
from pagedkv.tiers.value import MAX_KEY_BYTES, BlockLayout

LAYOUT = BlockLayout("float32", (1, 2, 2, 1, 4))  # 64 bytes


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def value_of(key: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key, "big")).integers(0, 256, LAYOUT.nbytes, dtype=np.uint8)


def rows_of(keys: list[bytes]) -> np.ndarray:
    return np.stack([value_of(key) for key in keys]) if keys else np.empty((0, LAYOUT.nbytes), np.uint8)


def make_store(tmp: Path, host: int, disk_blocks: int) -> TieredStore:
    clock = LruClock()
    local = [HostTier(host, LAYOUT, clock)] if host else []
    if disk_blocks:
        local.append(DiskTier(tmp / "blocks", disk_blocks * LAYOUT.value_bytes(MAX_KEY_BYTES), LAYOUT, clock))
    return TieredStore(LAYOUT, local)


def write_back(store: TieredStore, keys: list[bytes]) -> None:
    plan = store.prepare_store(keys, [])
    plan.rows[:] = rows_of(plan.keys)
    store.complete_store(plan)


def test_slot_index_reserve_commit_pin_and_lru_order() -> None:
    index = SlotIndex(3, "CPU", LruClock())
    slots = [index.reserve(k(i)) for i in range(3)]
    assert slots == [0, 1, 2] and index.reserve(k(9)) is None
    assert index.get(k(0)) is None  # reserved: invisible
    for s in slots:
        index.commit(s)
    assert index.take_events() == [TierEvent("stored", k(i), "CPU") for i in range(3)]
    index.touch(k(0))
    assert index.keys() == [k(1), k(2), k(0)]
    assert index.victim() == (k(1), 1, index.stamp[1])
    index.pin(1)
    assert index.victim() is not None and index.victim()[0] == k(2)  # type: ignore[index]
    with pytest.raises(InvalidArgumentError):
        index.remove(k(1))  # pinned: a load is in flight
    index.unpin(1)
    assert index.remove(k(1)) and index.take_events() == [TierEvent("removed", k(1), "CPU")]
    with pytest.raises(InvalidArgumentError):
        index.reserve(k(0))  # already stored
    index.check_invariants()


def test_evicted_device_blocks_go_to_host_then_disk_in_lru_order(tmp_path: Path) -> None:
    store = make_store(tmp_path, host=2, disk_blocks=2)
    host, disk = store.local
    write_back(store, [k(1), k(2)])
    assert list(host.index.keys()) == [k(1), k(2)]
    write_back(store, [k(1)])  # already held: touched, not copied again
    assert host.index.keys() == [k(2), k(1)]
    write_back(store, [k(3), k(4)])  # host full: its LRU (2, then 1) moves to disk with its stamp
    assert host.index.keys() == [k(3), k(4)] and disk.index.keys() == [k(2), k(1)]
    write_back(store, [k(5)])  # host spills 3 to disk; disk drops its LRU (2)
    assert disk.index.keys() == [k(1), k(3)]
    assert store.stats.losses["evicted"] == 1 and store.stats.stored_blocks == {"CPU": 5, "DISK": 3}
    events = store.take_events()
    assert TierEvent("removed", k(2), "DISK") in events and TierEvent("stored", k(3), "DISK") in events
    store.check_invariants()
    assert store.lookup([k(4), k(1), k(3), k(2), k(5)]) == ["CPU", "DISK", "DISK"]  # stops at the first miss
    rows = np.zeros((4, LAYOUT.nbytes), np.uint8)
    plan = store.prepare_load([k(4), k(1), k(3), k(2)], rows)
    assert plan.media == ["CPU", "DISK", "DISK"] and np.array_equal(rows[:3], rows_of([k(4), k(1), k(3)]))
    store.complete_load(plan, block_size=2)
    assert dict(store.stats.cached_tokens) == {"CPU": 2, "DISK": 4}


def test_store_is_invisible_until_complete(tmp_path: Path) -> None:
    store = make_store(tmp_path, host=4, disk_blocks=0)
    plan = store.prepare_store([k(1), k(2)], [])
    assert plan.keys == [k(1), k(2)] and plan.write_back == [0, 1]
    assert store.lookup([k(1)]) == []
    plan.rows[:] = rows_of(plan.keys)
    store.complete_store(plan)
    assert store.lookup([k(1), k(2)]) == ["CPU", "CPU"]


def test_corrupt_disk_value_is_a_checksum_miss_and_is_deleted(tmp_path: Path) -> None:
    store = make_store(tmp_path, host=0, disk_blocks=3)
    disk = store.local[0]
    assert isinstance(disk, DiskTier)
    write_back(store, [k(1), k(2), k(3)])
    slot = disk.index.get(k(2))
    assert slot is not None
    with open(disk.path, "r+b") as f:  # flip one payload byte of block 2
        f.seek(slot * disk.slot_bytes + LAYOUT.value_bytes(64) - 1)  # 64: the hex key
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    rows = np.zeros((3, LAYOUT.nbytes), np.uint8)
    plan = store.prepare_load([k(1), k(2), k(3)], rows)
    assert plan.keys == [k(1)]  # the chain stops at the corrupt block; 3 is recomputed too
    assert store.stats.losses == {"checksum": 1}
    assert k(2) not in disk.index and TierEvent("removed", k(2), "DISK") in store.take_events()
    disk.close()
    assert not disk.path.exists()


def test_disk_too_small_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="disk_bytes"):
        DiskTier(tmp_path / "x", 10, LAYOUT, LruClock())


class TieredStoreMachine(RuleBasedStateMachine):
    """Random write-backs and loads over host (3) + disk (3); bytes served always match the key."""

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.tmp = Path(tempfile.mkdtemp())
        self.store = make_store(self.tmp, host=3, disk_blocks=3)

    @rule(ids=st.lists(st.integers(0, 9), min_size=1, max_size=4))
    def evict_from_device(self, ids: list[int]) -> None:
        write_back(self.store, [k(i) for i in ids])
        held = sum(len(t.index) for t in self.store.local)
        assert held <= 6

    @rule(ids=st.lists(st.integers(0, 9), min_size=1, max_size=5))
    def load(self, ids: list[int]) -> None:
        keys = [k(i) for i in ids]
        rows = np.zeros((len(keys), LAYOUT.nbytes), np.uint8)
        plan = self.store.prepare_load(keys, rows)
        assert plan.keys == keys[: plan.num_blocks]
        assert np.array_equal(rows[: plan.num_blocks], rows_of(plan.keys))
        if plan.num_blocks < len(keys):
            assert all(keys[plan.num_blocks] not in t.index for t in self.store.local)
        self.store.complete_load(plan, 1)

    @invariant()
    def consistent(self) -> None:
        self.store.check_invariants()

    def teardown(self) -> None:
        self.store.close()


TestTieredStoreMachine = TieredStoreMachine.TestCase
TestTieredStoreMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG, errno.EIO])
def test_a_failing_disk_write_is_a_counted_loss_not_an_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    store = make_store(tmp_path, host=1, disk_blocks=4)
    disk = store.local[1]

    def full(*args: object) -> int:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr("pagedkv.tiers.disk.os.pwritev", full)
    for i in range(3):  # each but the first evicts the host's block to the disk, whose write fails
        write_back(store, [k(i)])
    name = errno.errorcode[code]
    assert store.stats.local_failures == {f"DISK {name}": 2} and store.stats.losses["error"] == 2
    assert len(disk.index) == 0 and disk.index.num_free == disk.num_blocks  # reservations given back
    store.check_invariants()
    monkeypatch.undo()  # space is back: the disk tier stores again
    write_back(store, [k(9)])
    assert k(2) in disk.index


def test_a_failing_disk_read_is_a_miss_and_drops_the_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store(tmp_path, host=0, disk_blocks=4)
    write_back(store, [k(0), k(1)])

    def broken(*args: object) -> int:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr("pagedkv.tiers.disk.os.preadv", broken)
    out = np.zeros((2, LAYOUT.nbytes), np.uint8)
    assert store.prepare_load([k(0), k(1)], out).keys == []
    assert store.stats.losses["error"] == 2 and len(store.local[0].index) == 0  # both read, both dropped
    store.check_invariants()
