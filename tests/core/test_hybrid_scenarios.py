"""Scenario tests of `HybridKVManager`: exact block ids per group, release as the window passes, the
eviction order that keeps prefixes hittable (vLLM #48435's workload), admission bounded by the window
(vLLM #39734), events with their group, and misuse."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.core.errors import CapacityError, InvalidArgumentError
from pagedkv.core.group import KVGroupSpec, group_layers, padded_layers
from pagedkv.core.group_keys import group_key, split_key
from pagedkv.core.hybrid import HybridKVManager
from pagedkv.core.hybrid_publish import OUT_OF_WINDOW_PRIORITY

FULL, SLIDE8 = KVGroupSpec(), KVGroupSpec("sliding", 8)


def _manager(num_blocks: int = 32, groups: tuple[KVGroupSpec, ...] = (FULL, SLIDE8), **kw: object) -> HybridKVManager:
    return HybridKVManager(num_blocks, 4, groups, **kw)  # type: ignore[arg-type]


def test_tables_per_group_and_release_as_the_window_passes() -> None:
    m = _manager()
    s = m.admit(list(range(1, 15))).seq_id  # 14 tokens: 4 blocks in each group
    assert (m.block_ids(s, 0), m.block_ids(s, 1)) == ([1, 2, 3, 4], [5, 6, 7, 8])
    m.mark_computed([s])  # a query at 14 reads from 7: block 0 of the sliding group goes
    assert (m.block_ids(s, 0), m.block_ids(s, 1)) == ([1, 2, 3, 4], [0, 6, 7, 8])
    assert m.num_blocks_held(s) == [4, 3] and m.num_used_blocks == 7
    assert m.pool.keyed[[1, 2, 3, 5, 6, 7]].all() and m.pool.ref[5] == 0  # published, then cached-free
    assert m.block_table([s], group=1).tolist() == [[0, 6, 7, 8]]
    assert m.slot_mapping([s], [12], [14], group=1).tolist() == [32, 33]
    m.append([s], [15], num_tokens=1)
    m.append([s], [16], num_tokens=1)
    m.append([s], [17], num_tokens=1)  # token 16 opens block 4 in both groups
    m.mark_computed([s])  # a query at 17 reads from 10: sliding block 1 goes too
    assert (m.block_ids(s, 0), m.block_ids(s, 1)) == ([1, 2, 3, 4, 9], [0, 0, 7, 8, 10])
    m.check_invariants()


def test_a_hit_needs_the_whole_prefix_in_full_groups_and_the_window_in_sliding_ones() -> None:
    m = _manager()
    s = m.admit(list(range(1, 15))).seq_id
    m.mark_computed([s])
    m.free(s)
    again = m.admit(list(range(1, 15)) + [99])  # 3 full blocks cached; the sliding group needs tokens 5..11
    assert again.num_cached_tokens == 12
    assert m.block_ids(again.seq_id, 0)[:3] == [1, 2, 3] and m.block_ids(again.seq_id, 1)[:3] == [0, 6, 7]
    m.free(again.seq_id)
    m.check_invariants()
    assert m.match_prefix(list(range(1, 13))) == 8  # a hit point is block aligned and leaves the last token


@pytest.mark.parametrize("evict_out_of_window_first", [True, False])
def test_out_of_window_blocks_are_evicted_before_a_finished_sequences_prefix(evict_out_of_window_first: bool) -> None:
    m = _manager(num_blocks=21, evict_out_of_window_first=evict_out_of_window_first)  # 20 usable
    a = m.admit(list(range(100, 114))).seq_id
    m.mark_computed([a])
    m.free(a)  # 6 cached blocks (full 1-3, sliding 5-7), the rest free
    b = m.admit(list(range(200, 224))).seq_id  # 6 blocks in each group: 2 left free
    m.mark_computed([b])  # a query at 24 reads from 17: sliding blocks 0-3 go, 0-1 far from the prompt's end
    assert m.block_ids(b, 1)[:4] == [0, 0, 0, 0] and m.pool.num_free == 2
    c = m.admit(list(range(300, 308)))  # 4 blocks: the 2 free ones, then 2 evicted
    assert c is not None
    hit = m.match_prefix(list(range(100, 114)) + [1])
    assert hit == (12 if evict_out_of_window_first else 0)
    m.check_invariants()


def _turn(m: HybridKVManager, prompt: list[int], out_len: int, chunk: int) -> int:
    adm = m.admit(prompt, chunk_tokens=chunk)
    assert adm is not None, "pool too small for one request"
    s, c = adm.seq_id, adm.num_cached_tokens
    while c < len(prompt):
        c = min(c + chunk, len(prompt))
        assert m.reserve([s], [c])
        m.mark_computed([s], [c])
    for i in range(out_len):
        assert m.append([s], [7 + i])
        m.mark_computed([s])
    m.free(s)
    return adm.num_cached_tokens


@pytest.mark.parametrize("evict_out_of_window_first", [True, False])
def test_round_robin_sessions_keep_their_prefix_hits(evict_out_of_window_first: bool) -> None:
    """vLLM #48435: N chat sessions fired round robin, each re-sent with its identical long prefix and a
    short new suffix. With one LRU for everything, the out-of-window blocks each request frees while it runs
    are more recent than older sessions' useful blocks, so those go first and every hit collapses while the
    pool could hold every session's useful blocks. Evicting out-of-window blocks first keeps the hits."""
    window, bs, chunk = 64, 4, 64
    groups = (FULL, KVGroupSpec("sliding", window))
    m = HybridKVManager(800, bs, groups, evict_out_of_window_first=evict_out_of_window_first)
    prefix_len, seats, rounds = 8 * window, 4, 4
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(1, 1000, prefix_len).tolist() for _ in range(seats)]
    # kept per session: ~132 full-group blocks + ~34 sliding (two windows before the prompt's end and the
    # tail): 4 x 166 fit in 799 blocks beside a running request; one LRU keeps all 132 sliding blocks
    # each turn frees too, and collapses (here it needs ~1200 blocks to hit at all)
    cached = prompt = 0
    for r in range(rounds):
        for s in range(seats):
            suffix = rng.integers(1, 1000, 8).tolist()
            got = _turn(m, prefixes[s] + suffix, out_len=8, chunk=chunk)
            if r:
                cached, prompt = cached + got, prompt + prefix_len + 8
    m.check_invariants()
    hit_rate = cached / prompt
    if evict_out_of_window_first:
        assert hit_rate > 0.95, f"hit rate {hit_rate:.2f}: prefixes were starved"
    else:
        assert hit_rate < 0.05, f"one LRU held the hits ({hit_rate:.2f}): the workload no longer reproduces #48435"


def test_admission_is_bounded_by_the_window_so_long_prompts_never_deadlock() -> None:
    """vLLM #39734: a windowed group needs its window plus one chunk per sequence, not the prompt."""
    slide = KVGroupSpec("sliding", 32)
    m = HybridKVManager(12, 16, (slide,))  # 11 usable blocks = 176 tokens
    prompt = list(range(1, 2001))
    with pytest.raises(CapacityError):
        m.admit(prompt)  # without a chunk size the whole prompt needs slots at once
    s = m.admit(prompt, chunk_tokens=64).seq_id
    peak = 0
    for end in range(64, 2001, 64):
        assert m.reserve([s], [min(end, 2000)])
        peak = max(peak, m.num_used_blocks)
        m.mark_computed([s], [min(end, 2000)])
    assert m.reserve([s], [2000]) and (m.mark_computed([s]) is None)
    assert peak <= slide.max_blocks_per_sequence(64, 16) == 7
    m.check_invariants()


def test_events_carry_the_group() -> None:
    m = _manager(record_events=True)
    s = m.admit(list(range(1, 10))).seq_id
    m.mark_computed([s])
    events = m.take_events()
    assert [(e.kind, e.block_id, e.group) for e in events] == [
        ("stored", 1, 0), ("stored", 2, 0), ("stored", 4, 1), ("stored", 5, 1),
    ]  # fmt: skip
    assert events[0].key == events[2].key  # the same content key, once per group
    m.reset_prefix_cache()
    assert [(e.kind, e.group) for e in m.take_events()] == [("cleared", None)]


def test_group_keys_round_trip() -> None:
    assert split_key(group_key(b"k" * 32, 3)) == (b"k" * 32, 3)
    assert split_key(group_key(-12345, 7)) == (-12345, 7)


def test_misuse_is_refused_and_changes_nothing() -> None:
    m = _manager()
    s = m.admit(list(range(1, 15))).seq_id
    m.mark_computed([s])
    before = m.snapshot()
    with pytest.raises(InvalidArgumentError, match="pass group"):
        m.block_table([s])
    with pytest.raises(InvalidArgumentError, match="group must be"):
        m.slot_mapping([s], [0], [1], group=2)
    with pytest.raises(InvalidArgumentError, match="released"):
        m.slot_mapping([s], [0], [4], group=1)
    with pytest.raises(InvalidArgumentError, match="roll back"):
        m.rollback(s, 10)  # the sliding group released tokens 0..3, which token 4 would read again
    with pytest.raises(InvalidArgumentError, match="past the sequence"):
        m.reserve([s], [15])
    assert m.snapshot() == before
    m.rollback(s, 2)
    m.check_invariants()


def test_grouping_layers_like_vllm() -> None:
    windows = [4096 if i % 6 != 5 else None for i in range(62)]  # Gemma 3 27B: 52 sliding, 10 full
    groups = group_layers(windows)
    assert [(g.spec.label(), len(g.layers)) for g in groups] == [("sliding-4096", 10)] * 5 + [("sliding-4096", 2), ("full", 10)]
    assert padded_layers(groups) == 8
    assert [g.spec.label() for g in group_layers([None] * 4)] == ["full"]
    assert OUT_OF_WINDOW_PRIORITY < 0


@pytest.mark.parametrize("groups", [(FULL,), (FULL, SLIDE8)])
def test_a_hit_stops_at_the_first_missing_block_though_later_ones_are_cached(groups: tuple[KVGroupSpec, ...]) -> None:
    """Blocks 0 and 2 of a prefix are cached, block 1 is not (its key dropped while its sequence runs):
    the hit is block 0 alone, in every group."""
    m, bs = _manager(40, groups), 4
    tokens = list(range(100, 100 + 3 * bs + 1))
    a = m.admit(tokens)
    assert a is not None
    m.mark_computed([a.seq_id])
    m.index.remove(m.block_ids(a.seq_id, 0)[1])  # full group 0's copy of block 1
    assert m.match_prefix(tokens) == bs
    b = m.admit(tokens)
    assert b is not None and b.num_cached_tokens == bs
    assert m.block_ids(b.seq_id, 0)[0] == m.block_ids(a.seq_id, 0)[0]
    m.check_invariants()


@pytest.mark.parametrize(
    ("policy", "hit"),
    # lru and priority order by retention priority, so out-of-window blocks (OUT_OF_WINDOW_PRIORITY) go
    # first and the finished prefix survives; slru, lfu and cost order by recency tiers, frequency and
    # recompute cost only, and evict the older prefix
    [("lru", 12), ("priority", 12), ("slru", 0), ("lfu", 0), ("cost", 0)],
)
def test_every_eviction_policy_orders_the_groups_blocks(policy: str, hit: int) -> None:
    m = _manager(num_blocks=21, groups=(FULL, KVGroupSpec("sliding", 6)), eviction=policy)
    assert m.pool.policy.name == policy
    a = m.admit(list(range(100, 114))).seq_id  # type: ignore[union-attr]
    m.mark_computed([a])
    m.free(a)
    b = m.admit(list(range(200, 224))).seq_id  # type: ignore[union-attr]
    m.mark_computed([b])
    assert m.admit(list(range(300, 308))) is not None
    assert m.pool.stats.evictions == 2
    assert m.match_prefix(list(range(100, 114)) + [1]) == hit
    m.check_invariants()


def test_an_unknown_eviction_policy_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="eviction policy"):
        _manager(eviction="mru")


def test_slot_mapping_refuses_a_start_in_a_released_block_and_only_there() -> None:
    m = _manager(num_blocks=64, groups=(FULL, KVGroupSpec("sliding", 5)))
    a = m.admit(list(range(1, 30))).seq_id  # type: ignore[union-attr]
    m.mark_computed([a])  # a query at 29 reads from 25: sliding blocks 0-5 (tokens 0-23) released
    assert m.block_ids(a, 1)[:6] == [0] * 6
    for start in (0, 4, 20, 23):
        with pytest.raises(InvalidArgumentError, match="released"):
            m.slot_mapping([a], [start], [29], group=1)
    b6, b7 = m.block_ids(a, 1)[6:8]
    assert m.slot_mapping([a], [24], [29], group=1).tolist() == [b6 * 4 + o for o in range(4)] + [b7 * 4]
    assert m.slot_mapping([a], [29], [29], group=1).tolist() == []  # an empty range past the last token
    assert len(m.slot_mapping([a], [0], [29], group=0)) == 29  # the full group released nothing
