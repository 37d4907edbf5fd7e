"""Eviction policies: exact eviction order per policy, the hit count that drives LFU, SLRU's segments,
priority retention that decays, cost's chain order; every policy under the manager's state machine."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from test_state_machine import ManagerMachine

from pagedkv.core import InvalidArgumentError, PagedKVManager
from pagedkv.core.eviction import (
    EVICTION_POLICIES,
    CostPolicy,
    LFUPolicy,
    LRUPolicy,
    PriorityPolicy,
    SLRUPolicy,
    eviction_policy,
)

BS = 4
POLICIES = tuple(EVICTION_POLICIES)


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def ids(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def manager(policy: str, num_blocks: int = 9) -> PagedKVManager:
    return PagedKVManager(num_blocks=num_blocks, block_size=BS, record_events=True, eviction=policy)


def cache(m: PagedKVManager, start: int, n: int, priority: int = 0) -> list[int]:
    """Admit, compute and free a prompt: its full blocks stay cached-free. Returns its blocks."""
    a = m.admit(toks(start, n), priority=priority)
    assert a is not None
    m.mark_computed([a.seq_id])
    blocks = m.block_ids(a.seq_id)
    m.free(a.seq_id)
    m.check_invariants()
    return blocks


def hit(m: PagedKVManager, start: int, n: int) -> int:
    """Admit a prompt that hits, then free it again; returns the cached tokens."""
    a = m.admit(toks(start, n))
    assert a is not None
    m.free(a.seq_id)
    return a.num_cached_tokens


# --- the registry and the default ----------------------------------------------------------------------


def test_lru_is_the_default_and_every_name_builds() -> None:
    assert isinstance(PagedKVManager(9, BS).pool.policy, LRUPolicy)
    for name in POLICIES:
        assert manager(name).pool.policy.name == name
    with pytest.raises(InvalidArgumentError, match="unknown eviction policy"):
        PagedKVManager(9, BS, eviction="mru")


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_keeps_the_pool_whole_through_evictions(policy: str) -> None:
    m = manager(policy)
    for i in range(30):
        cache(m, 100 * (i % 7), 4 + (i * 5) % 20)
        if i % 4 == 0:
            hit(m, 0, 9)
    assert m.stats.evictions > 0
    m.check_invariants()
    assert m.reset_prefix_cache() >= 0 and m.pool.num_evictable == 0
    m.check_invariants()


# --- LFU: the hit count really counts ----------------------------------------------------------------------


def test_lfu_counts_every_hit() -> None:
    m = manager("lfu")
    blocks = cache(m, 0, 9)  # blocks 1, 2 keyed; 3 partial, private
    policy = m.pool.policy
    assert isinstance(policy, LFUPolicy)
    assert policy.hits[blocks[:2]].tolist() == [0, 0]
    for _ in range(3):
        assert hit(m, 0, 9) == 8
    assert policy.hits[blocks[:2]].tolist() == [3, 3]  # an inert LFU (no increment) leaves these at 0
    a = m.admit(toks(0, 9))  # a hit on blocks in use counts too
    b = m.admit(toks(0, 9))
    assert a is not None and b is not None
    assert policy.hits[blocks[:2]].tolist() == [5, 5]


def test_lfu_evicts_the_least_hit_block_first_not_the_oldest() -> None:
    m = manager("lfu")
    hot = cache(m, 0, 9)[:2]  # cached first: the oldest, LRU would evict it first
    hit(m, 0, 9)
    hit(m, 0, 9)
    cold = cache(m, 100, 9)[:2]
    assert m.pool.num_free == 4 and m.pool.num_evictable == 4
    c = m.admit(toks(200, 24))  # 6 blocks: 4 free, then 2 evicted
    assert c is not None
    assert m.block_ids(c.seq_id)[-2:] == cold[::-1]  # the never-hit blocks, tail first
    assert m.match_prefix(toks(0, 9)) == 8 and hot == [1, 2]


def test_lru_evicts_the_hot_block_in_the_same_scenario() -> None:
    m = manager("lru")
    cache(m, 0, 9)
    hit(m, 0, 9)
    hit(m, 0, 9)
    cache(m, 100, 9)
    c = m.admit(toks(200, 24))
    assert c is not None
    assert m.match_prefix(toks(0, 9)) == 0  # LRU dropped the hot prefix


def test_lfu_ages_so_old_popular_blocks_do_not_stay_forever() -> None:
    p = LFUPolicy(16)
    p.hit(ids(1))
    p.hit(ids(1))
    p.release(ids(1), 0)  # score 2
    for b in range(2, 6):  # each new block evicted at once: the age L rises to 0, then stays
        p.release(ids(b), 0)
        assert p.evict(1).tolist() == [b]
    p.age = 5.0  # as after evicting blocks scored 5
    p.release(ids(7), 0)  # score 5 + 0 > 2: the old popular block goes first
    assert p.evict(2).tolist() == [1, 7]
    p.check_invariants()


# --- SLRU -----------------------------------------------------------------------------------------------


def test_slru_keeps_hit_blocks_over_one_off_ones() -> None:
    m = manager("slru")
    shared = cache(m, 0, 9)[:2]
    hit(m, 0, 9)  # hit once: protected when released
    cache(m, 100, 9)  # a one-off prompt, released later: probationary
    policy = m.pool.policy
    assert isinstance(policy, SLRUPolicy) and policy.num_protected == 2
    c = m.admit(toks(200, 24))
    assert c is not None
    assert m.match_prefix(toks(0, 9)) == 8 and shared == [1, 2]
    m.check_invariants()


def test_slru_demotes_beyond_its_protected_fraction() -> None:
    p = SLRUPolicy(4, protected_fraction=0.25)
    p.hit(ids(1, 2, 3))
    p.release(ids(1, 2, 3), 0)  # all hit, but at most a quarter of 4 blocks stays protected: 1, 2 demoted
    assert p.num_protected == 1
    p.check_invariants()
    assert p.evict(3).tolist() == [1, 2, 3]
    with pytest.raises(InvalidArgumentError):
        SLRUPolicy(4, protected_fraction=1.5)


# --- priority with retention ------------------------------------------------------------------------------


def test_priority_holds_until_its_retention_runs_out() -> None:
    p = PriorityPolicy(32, retention=4)
    p.release(ids(1, 2), 5)  # tick 2: retained until tick 6
    p.release(ids(3), 0)  # tick 3
    assert p.evict(1).tolist() == [3]  # priority 0 goes first
    p.release(ids(4, 5), 0)  # tick 5: still retained
    assert p.evict(1).tolist() == [4]
    p.release(ids(6), 0)  # tick 6: 1 and 2 decay to priority 0's newest end, just before 6
    assert p.evict(4).tolist() == [5, 1, 2, 6]  # without the decay: 5, 6, 1, 2
    p.check_invariants()


def test_priority_without_retention_is_todays_order() -> None:
    p, lru = PriorityPolicy(32), LRUPolicy(32)
    for q in (p, lru):
        q.release(ids(1, 2), 5)
        q.release(ids(3, 4), 0)
        q.release(ids(5), -1)
        q.take(ids(4))
    assert p.evict(4).tolist() == lru.evict(4).tolist() == [5, 3, 1, 2]


def test_priority_follows_a_given_clock() -> None:
    now = [0.0]
    p = PriorityPolicy(8, retention=10.0, clock=lambda: now[0])
    p.release(ids(1), 3)
    p.release(ids(2), 0)
    assert p.evict(1).tolist() == [2]
    p.release(ids(3), 0)
    now[0] = 10.0
    assert p.evict(2).tolist() == [3, 1]


# --- cost ---------------------------------------------------------------------------------------------------


def test_cost_weighs_depth_and_evicts_a_chain_from_its_tail() -> None:
    p = CostPolicy(64, 16, balance_tokens=16)  # work(d) = 1 + d
    p.hit(ids(3, 2, 1))
    p.release(ids(3, 2, 1), 0)  # one chain hit once, tail first: scores would be 3, 2, 1 -> capped at 1
    p.hit(ids(9))
    p.hit(ids(9))
    p.release(ids(9), 0)  # alone, depth 0, hit twice: 2 x 1 = 2
    p.hit(ids(5, 4))
    p.release(ids(5, 4), 0)  # a chain hit once: 2, 1 -> 1, 1; released later than 3, 2, 1
    p.release(ids(7), 0)  # never hit: 0, evicted first
    assert p.evict(7).tolist() == [7, 3, 2, 1, 5, 4, 9]
    p.check_invariants()


def test_policy_objects_and_bad_names() -> None:
    assert eviction_policy(LFUPolicy(9), 9).name == "lfu"
    with pytest.raises(InvalidArgumentError):
        eviction_policy(LFUPolicy(5), 9)
    with pytest.raises(InvalidArgumentError):
        eviction_policy("nope", 9)
    with pytest.raises(InvalidArgumentError):
        PriorityPolicy(4, retention=-1)


# --- every policy under the state machine --------------------------------------------------------------------


_settings = settings(max_examples=120, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _machine(policy: str, max_examples: int = 120) -> type[ManagerMachine]:
    cls = type(f"{policy.upper()}Machine", (ManagerMachine,), {"eviction": policy})
    cls.TestCase.settings = settings(_settings, max_examples=max_examples)
    return cls


TestSLRUMachine = _machine("slru").TestCase
TestLFUMachine = _machine("lfu").TestCase
TestPriorityMachine = _machine("priority").TestCase
TestCostMachine = _machine("cost", max_examples=60).TestCase  # the slowest policy to run: half the examples


# --- the soak draws every policy ------------------------------------------------------------------------------


def test_the_soak_runs_every_policy_without_violation() -> None:
    from pagedkv.bench.soak import draw_config, run_soak

    rng = np.random.default_rng(0)
    drawn = {draw_config(rng, ("paged",), POLICIES).eviction for _ in range(60)}
    assert drawn == set(POLICIES)
    result = run_soak(6000, seed=1, kinds=("paged", "paged-python"), policies=POLICIES)
    assert result.violations == 0, result.message


def test_the_soak_catches_an_eviction_that_forgets_keys() -> None:
    from pagedkv.bench.soak import run_soak

    def patch(m: object) -> object:
        pool = getattr(m, "pool", None)
        if pool is not None:  # evicted blocks keep their keys: a later hit would read overwritten KV
            pool._evict = lambda n, pool=pool: pool.policy.evict(n)
        return m

    result = run_soak(20000, seed=2, kinds=("paged",), policies=("slru", "lfu"), patch=patch, shrink_s=2.0)
    assert result.violations == 1
