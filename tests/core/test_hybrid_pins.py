"""Retention on `HybridKVManager`: `pin` keeps every group's blocks of a cached prefix (the whole prefix in a
full group, the window before the hit point in a sliding one) from eviction until `unpin`; epochs and
per-block extra keys qualify every group's keys as they do `PagedKVManager`'s."""

from __future__ import annotations

import pytest

from pagedkv.core.errors import InvalidArgumentError, PinError
from pagedkv.core.group import KVGroupSpec
from pagedkv.core.hybrid import HybridKVManager
from pagedkv.core.prefix import BlockKeys

FULL, SLIDE8 = KVGroupSpec(), KVGroupSpec("sliding", 8)
PROMPT = list(range(1, 15))  # 14 tokens, block size 4: 3 full blocks cached per group after it runs


def _cached(num_blocks: int = 21) -> HybridKVManager:
    m = HybridKVManager(num_blocks, 4, (FULL, SLIDE8))
    s = m.admit(PROMPT).seq_id
    m.mark_computed([s])
    m.free(s)
    return m


def _flood(m: HybridKVManager, first: int) -> None:
    """Admit and free other prompts until the pool has evicted everything it could."""
    for i in range(6):
        s = m.admit(list(range(first + 100 * i, first + 100 * i + 24)))
        assert s is not None
        m.mark_computed([s.seq_id])
        m.free(s.seq_id)
        m.check_invariants()


def test_pinned_prefix_survives_a_flood_and_unpin_lets_it_go() -> None:
    m = _cached()
    assert m.match_prefix([*PROMPT, 99]) == 12
    handle = m.pin(PROMPT)
    assert sorted(handle.block_ids) == [1, 2, 3, 6, 7], "full 1-3, sliding 6-7 (the window before token 12)"
    m.check_invariants()
    _flood(m, 1000)
    assert m.match_prefix([*PROMPT, 99]) == 12, "pinned: still served"
    m.unpin(handle)
    m.check_invariants()
    _flood(m, 5000)
    assert m.match_prefix([*PROMPT, 99]) == 0, "unpinned: evicted like any cached block"
    assert m.num_used_blocks == 0


def test_unpinned_prefix_is_evicted_by_the_same_flood() -> None:
    m = _cached()
    _flood(m, 1000)
    assert m.match_prefix([*PROMPT, 99]) == 0


def test_pin_misuse_is_refused_and_changes_nothing() -> None:
    m = _cached()
    with pytest.raises(PinError, match="no full block"):
        m.pin([500, 501, 502, 503, 504])
    with pytest.raises(InvalidArgumentError, match="PinHandle"):
        m.unpin((1, 2))  # type: ignore[arg-type]
    handle = m.pin(PROMPT)
    m.unpin(handle)
    after_pair = m.snapshot()
    with pytest.raises(PinError, match="not pinned"):
        m.unpin(handle)
    assert m.snapshot() == after_pair
    with pytest.raises(PinError, match="prefix caching"):
        HybridKVManager(8, 4, (FULL,), enable_prefix_caching=False).pin(PROMPT)
    m.check_invariants()


def test_epoch_bump_makes_every_groups_keys_unmatchable() -> None:
    m = _cached()
    running = m.admit(list(range(50, 64))).seq_id  # computed after the bump: keyed under the new epoch
    assert m.bump_epoch() == 1 and m.epoch == 1
    assert m.match_prefix([*PROMPT, 99]) == 0, "keys of epoch 0 match nothing"
    m.mark_computed([running])
    m.free(running)
    assert m.match_prefix([*range(50, 64), 99]) == 12, "the new epoch's keys serve"
    s = m.admit(PROMPT).seq_id
    m.mark_computed([s])
    m.free(s)
    assert m.match_prefix([*PROMPT, 99]) == 12
    m.check_invariants()


def test_extra_keys_qualify_every_group() -> None:
    m = HybridKVManager(21, 4, (FULL, SLIDE8))
    s = m.admit(PROMPT, keys=BlockKeys(b"", block_extra={1: b"img"})).seq_id
    m.mark_computed([s])
    m.free(s)
    assert m.match_prefix([*PROMPT, 99]) == 4, "block 1 carried an extra key: a plain prompt stops before it"
    assert m.match_prefix([*PROMPT, 99], keys=BlockKeys(b"", block_extra={1: b"img"})) == 12
    assert m.match_prefix([*PROMPT, 99], keys=BlockKeys(b"", extra=b"other")) == 0
