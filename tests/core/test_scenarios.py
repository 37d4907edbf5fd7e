"""Scenario tests: exact block ids, eviction order and counts after each operation."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.core import BlockKeys, PagedKVManager

BS = 4


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


@pytest.fixture
def m() -> PagedKVManager:
    return PagedKVManager(num_blocks=9, block_size=BS, record_events=True)  # block 0 is the null block


def test_admission_allocates_prompt_blocks_only_in_ascending_order(m: PagedKVManager) -> None:
    a = m.admit(toks(0, 9), max_new_tokens=100)
    assert a is not None and a.num_cached_tokens == 0
    assert m.block_ids(a.seq_id) == [1, 2, 3]  # ceil(9 / 4) blocks, nothing reserved for max_new_tokens
    assert m.num_free_blocks == 5 and m.num_used_blocks == 3
    m.check_invariants()


def test_decode_takes_a_block_only_at_a_boundary(m: PagedKVManager) -> None:
    a = m.admit(toks(0, 7))
    assert a is not None
    assert m.append([a.seq_id], [7])  # 8 tokens: still 2 blocks
    assert m.block_ids(a.seq_id) == [1, 2]
    assert m.append([a.seq_id], [8])  # 9th token crosses into a new block
    assert m.block_ids(a.seq_id) == [1, 2, 3]
    assert m.slot_mapping([a.seq_id], [0], [9]).tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 12]
    m.check_invariants()


def test_prefix_hit_shares_full_blocks_but_never_the_last_token(m: PagedKVManager) -> None:
    a = m.admit(toks(0, 8))
    assert a is not None
    m.mark_computed([a.seq_id])
    b = m.admit(toks(0, 8))  # two full blocks cached, but the last token must be computed
    assert b is not None and b.num_cached_tokens == 4
    assert m.block_ids(b.seq_id) == [1, 3]
    c = m.admit(toks(0, 10))
    assert c is not None and c.num_cached_tokens == 8
    assert m.block_ids(c.seq_id) == [1, 2, 4]
    assert m.pool.ref[[1, 2, 3, 4]].tolist() == [3, 2, 1, 1]
    assert m.stats.cached_tokens == 12 and m.stats.prompt_tokens == 26
    m.check_invariants()


def test_blocks_are_not_hittable_before_mark_computed(m: PagedKVManager) -> None:
    a = m.admit(toks(0, 9))
    assert a is not None
    b = m.admit(toks(0, 9))
    assert b is not None and b.num_cached_tokens == 0
    m.mark_computed([a.seq_id], [4])  # only the first block's KV is written
    c = m.admit(toks(0, 9))
    assert c is not None and c.num_cached_tokens == 4


def test_free_is_tail_first_and_eviction_is_lru(m: PagedKVManager) -> None:
    a = m.admit(toks(0, 12))  # blocks 1, 2, 3
    b = m.admit(toks(100, 8))  # blocks 4, 5
    assert a is not None and b is not None
    m.mark_computed([a.seq_id, b.seq_id])
    m.free(a.seq_id)  # cached-free order: 3, 2, 1 (tail first)
    m.free(b.seq_id)  # then 5, 4
    assert m.pool.num_free == 3 and m.pool.num_evictable == 5
    c = m.admit(toks(200, 20))  # 5 blocks: 3 free (6, 7, 8) then evict 3, 2
    assert c is not None
    assert m.block_ids(c.seq_id) == [6, 7, 8, 3, 2]
    assert m.match_prefix(toks(0, 12)) == 4  # block 1 (the head) survived, block 2 did not
    removed = [e.block_id for e in m.take_events() if e.kind == "removed"]
    assert removed == [3, 2]
    m.check_invariants()


def test_a_hit_takes_a_cached_block_out_of_the_eviction_order(m: PagedKVManager) -> None:
    a = m.admit(toks(0, 9))
    assert a is not None
    m.mark_computed([a.seq_id])
    m.free(a.seq_id)  # 1, 2 cached-free; 3 (partial) free
    b = m.admit(toks(0, 9))  # hits 1, 2
    assert b is not None and b.num_cached_tokens == 8
    assert m.pool.num_evictable == 0 and m.pool.ref[1] == 1
    m.check_invariants()


def test_lower_retention_priority_is_evicted_first(m: PagedKVManager) -> None:
    hi = m.admit(toks(0, 8), priority=5)
    lo = m.admit(toks(100, 8), priority=0)
    assert hi is not None and lo is not None
    m.mark_computed([hi.seq_id, lo.seq_id])
    m.free(hi.seq_id)  # released first, but more important
    m.free(lo.seq_id)
    c = m.admit(toks(200, 24))  # 6 blocks: 4 free + 2 evicted
    assert c is not None
    assert m.block_ids(c.seq_id)[-2:] == [4, 3]  # lo's blocks (3, 4), tail first
    assert m.match_prefix(toks(0, 8) + [1]) == 8


def test_pinned_prefix_survives_eviction(m: PagedKVManager) -> None:
    a = m.admit(toks(0, 9))
    assert a is not None
    m.mark_computed([a.seq_id])
    m.free(a.seq_id)
    handle = m.pin(toks(0, 8))
    assert handle.block_ids == (1, 2)
    assert m.admit(toks(100, 28)) is None  # 7 blocks needed, only 6 takeable: pinned blocks are not
    c = m.admit(toks(100, 24))
    assert c is not None
    assert 1 not in m.block_ids(c.seq_id) and 2 not in m.block_ids(c.seq_id)
    m.free(c.seq_id)
    m.unpin(handle)
    assert m.pool.num_evictable >= 2
    m.check_invariants()


def test_fork_shares_then_copy_on_write(m: PagedKVManager) -> None:
    a = m.admit(toks(0, 6))  # blocks 1, 2 (second partial)
    assert a is not None
    child = m.fork(a.seq_id)
    assert m.block_ids(child) == [1, 2] and m.pool.ref[[1, 2]].tolist() == [2, 2]
    assert m.append([a.seq_id, child], [[60], [61]])
    copies = m.take_copies()  # both holders write: the first moves, the last keeps the original
    assert copies.src.tolist() == [2] and copies.dst.tolist() == [3]
    assert m.block_ids(a.seq_id) == [1, 3] and m.block_ids(child) == [1, 2]
    assert m.pool.ref[[2, 3]].tolist() == [1, 1]
    assert m.take_copies().src.size == 0  # handed out once
    m.check_invariants()


def test_copy_on_write_when_only_one_holder_writes(m: PagedKVManager) -> None:
    a = m.admit(toks(0, 6))
    assert a is not None
    child = m.fork(a.seq_id)
    grandchild = m.fork(child)
    assert m.append([grandchild, a.seq_id], [7, 8])  # the third holder (child) still reads block 2
    copies = m.take_copies()
    assert copies.src.tolist() == [2, 2] and copies.dst.tolist() == [3, 4]
    assert m.block_ids(child) == [1, 2] and m.pool.ref[2] == 1
    m.check_invariants()


def test_fork_on_a_block_boundary_copies_nothing(m: PagedKVManager) -> None:
    a = m.admit(toks(0, 8))
    assert a is not None
    child = m.fork(a.seq_id)
    assert m.append([a.seq_id, child], [1, 2])
    assert m.take_copies().src.size == 0
    assert m.block_ids(a.seq_id) == [1, 2, 3] and m.block_ids(child) == [1, 2, 4]


def test_rollback_releases_blocks_and_unpublishes_a_block_that_will_change(m: PagedKVManager) -> None:
    a = m.admit(toks(0, 12))
    assert a is not None
    m.mark_computed([a.seq_id])
    assert len(m.index) == 3
    m.rollback(a.seq_id, 6)  # 6 tokens left: block 3 released, block 2 now partial
    assert m.block_ids(a.seq_id) == [1, 2] and m.num_tokens(a.seq_id) == 6
    assert m.pool.keyed[[1, 2, 3]].tolist() == [True, False, True]  # 3 stays cached: its content is intact
    assert m.match_prefix(toks(0, 12) + [0]) == 4
    assert m.append([a.seq_id], [[99, 98]], num_tokens=2)
    m.check_invariants()


def test_rollback_into_a_shared_block_copies_on_next_write(m: PagedKVManager) -> None:
    a = m.admit(toks(0, 8))
    assert a is not None
    m.mark_computed([a.seq_id])
    b = m.admit(toks(0, 9))  # shares blocks 1, 2
    assert b is not None and b.num_cached_tokens == 8
    m.rollback(b.seq_id, 3)  # b now ends inside shared block 2
    assert m.pool.keyed[2]  # still a's full block: keep its key
    assert m.append([b.seq_id], [77])
    copies = m.take_copies()
    assert copies.src.tolist() == [2]
    assert m.block_ids(b.seq_id)[1] == copies.dst[0]
    m.check_invariants()


def test_duplicate_computation_keeps_one_published_copy(m: PagedKVManager) -> None:
    a = m.admit(toks(0, 9))
    b = m.admit(toks(0, 9))  # same step: no sharing, computed twice
    assert a is not None and b is not None
    m.mark_computed([a.seq_id, b.seq_id])
    stored = [e for e in m.take_events() if e.kind == "stored"]
    assert [e.block_id for e in stored] == [1, 2]  # b's copies (4, 5) stay private
    m.free(b.seq_id)
    assert m.pool.num_evictable == 0  # private duplicates go straight to the free list
    m.free(a.seq_id)
    assert m.pool.num_evictable == 2
    assert [e.kind for e in m.take_events()] == []
    m.check_invariants()


def test_decode_blocks_are_published_too(m: PagedKVManager) -> None:
    keys = BlockKeys()
    a = m.admit(toks(0, 3), keys=keys)
    assert a is not None
    for t in range(3, 9):
        assert m.append([a.seq_id], [t])
        m.mark_computed([a.seq_id])
    assert m.match_prefix(toks(0, 9)) == 8
    assert keys.num_keys() == 2  # the request kept the keys: re-admission hashes nothing


def test_epoch_bump_makes_earlier_keys_unmatchable(m: PagedKVManager) -> None:
    a = m.admit(toks(0, 9))
    assert a is not None
    m.mark_computed([a.seq_id])
    m.free(a.seq_id)
    assert m.match_prefix(toks(0, 9)) == 8
    m.bump_epoch()
    assert m.match_prefix(toks(0, 9)) == 0
    b = m.admit(toks(0, 9))
    assert b is not None and b.num_cached_tokens == 0
    m.check_invariants()


def test_keys_rebound_while_attached_publish_under_the_new_epoch(m: PagedKVManager) -> None:
    """One `BlockKeys` attached to a live sequence and re-admitted after an epoch bump is rebound: the key
    lists and epochs the hot path reads follow it, so both sequences publish under the new epoch."""
    keys = BlockKeys()
    a = m.admit(toks(0, 9), keys=keys)
    m.bump_epoch()
    b = m.admit(toks(0, 9), keys=keys)
    assert a is not None and b is not None and keys.epoch == m.epoch
    m.check_invariants()  # checks the hot path's view of the keys against the keys
    m.mark_computed([a.seq_id, b.seq_id])
    assert m.match_prefix(toks(0, 9)) == 8
    m.check_invariants()


def test_reset_prefix_cache_emits_cleared(m: PagedKVManager) -> None:
    a = m.admit(toks(0, 9))
    assert a is not None
    m.mark_computed([a.seq_id])
    m.take_events()
    assert m.reset_prefix_cache() == 2
    assert [e.kind for e in m.take_events()] == ["cleared"]
    assert m.match_prefix(toks(0, 9)) == 0
    m.free(a.seq_id)
    assert m.pool.num_free == 8
    m.check_invariants()


def test_batch_views(m: PagedKVManager) -> None:
    a = m.admit(toks(0, 5))  # 1, 2
    b = m.admit(toks(50, 9))  # 3, 4, 5
    assert a is not None and b is not None
    ids = [a.seq_id, b.seq_id]
    assert m.block_table(ids).tolist() == [[1, 2, 0], [3, 4, 5]]
    assert m.block_table(ids, pad_id=7).tolist() == [[1, 2, 7], [3, 4, 5]]
    assert m.seq_lens(ids).tolist() == [5, 9]
    csr = m.csr(ids)
    assert csr.indptr.tolist() == [0, 2, 5]
    assert csr.indices.tolist() == [1, 2, 3, 4, 5]
    assert csr.last_page_len.tolist() == [1, 1]
    assert m.slot_mapping(ids, [4, 7], [5, 9]).tolist() == [8, 19, 20]
    assert m.block_table(ids).dtype == np.int32 and m.slot_mapping(ids, 0, 1).dtype == np.int64


def test_swap_round_trip_keeps_tokens_and_frees_device_blocks() -> None:
    m = PagedKVManager(num_blocks=9, block_size=BS, num_host_blocks=4)
    a = m.admit(toks(0, 6))
    assert a is not None
    out = m.swap_out(a.seq_id)
    assert out is not None and out.src.tolist() == [1, 2] and out.dst.tolist() == [0, 1]
    assert m.num_used_blocks == 0 and m.is_swapped(a.seq_id)
    back = m.swap_in(a.seq_id)
    assert back is not None and back.src.tolist() == [0, 1] and len(back.dst) == 2
    assert m.num_tokens(a.seq_id) == 6 and m.host_pool is not None and m.host_pool.num_free == 4
    m.check_invariants()


def test_invariants_hold_with_more_host_blocks_than_device_blocks() -> None:
    # A swapped row's table holds host block ids, which may be past the device pool's last block.
    m = PagedKVManager(num_blocks=8, block_size=BS, num_host_blocks=32)
    for i in range(6):
        a = m.admit(toks(10 * i, 6))
        assert a is not None
        m.mark_computed([a.seq_id])
        assert m.swap_out(a.seq_id) is not None
        m.check_invariants()
    assert m.host_pool is not None and m.host_pool.num_free == 32 - 12


def test_lookahead_slots() -> None:
    m = PagedKVManager(num_blocks=9, block_size=BS)
    a = m.admit(toks(0, 4), num_lookahead=3)
    assert a is not None and m.block_ids(a.seq_id) == [1, 2]
    assert m.num_blocks_to_append([a.seq_id], 3) == 0
