"""Miss reasons: every admission's uncached tokens are counted under why they missed, and the counts add up."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from native_support import REF, SETTINGS, native
from test_native_batch import copy_forget, forget_cases, outcome

from pagedkv.core import BlockKeys, PagedKVManager
from pagedkv.core.group import KVGroupSpec
from pagedkv.core.hotpath import evicted_slot
from pagedkv.core.hybrid import HybridKVManager
from pagedkv.core.misses import MISS_REASONS

BS = 4


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


Manager = PagedKVManager | HybridKVManager
FULL, SLIDE8, CHUNK8 = KVGroupSpec(), KVGroupSpec("sliding", 8), KVGroupSpec("chunked", 8)
HYBRID = {"full": (FULL,), "full+sliding": (FULL, SLIDE8), "sliding": (SLIDE8,), "full+chunked": (FULL, CHUNK8)}


def run(m: Manager, prompt: list[int], salt: bytes = b"", keys: BlockKeys | None = None) -> int:
    """Admit, compute, free; returns the cached tokens."""
    a = m.admit(prompt, salt=salt, keys=keys) if keys is not None else m.admit(prompt, salt=salt)
    assert a is not None
    m.mark_computed([a.seq_id])
    m.free(a.seq_id)
    return a.num_cached_tokens


def tokens_of(m: Manager) -> dict[str, int]:
    return {r: n for r, n in m.stats.miss_tokens.items() if n}


@pytest.fixture(params=["sha256", "fast", *(f"hybrid:{g}" for g in HYBRID)])
def m(request: pytest.FixtureRequest) -> Manager:
    """The paged manager (both key functions) and the hybrid one over four group sets: the same scenarios,
    the same reasons (`HybridKVManager` counts by the first block after the hit in the group that lacks it)."""
    if request.param.startswith("hybrid:"):
        return HybridKVManager(17, BS, HYBRID[request.param.removeprefix("hybrid:")])
    return PagedKVManager(num_blocks=9, block_size=BS, hash_fn=request.param)


def test_a_prompt_shorter_than_a_block(m: Manager) -> None:
    run(m, toks(0, 3))
    run(m, toks(0, 3))
    assert tokens_of(m) == {"short_prompt": 4} and m.stats.miss_lookups["short_prompt"] == 2


def test_cold_then_partial_block_then_hit(m: Manager) -> None:
    run(m, toks(0, 10))  # cold: 9 of 10 tokens missed (the last is always computed)
    assert tokens_of(m) == {"no_key": 9}
    assert run(m, toks(0, 10)) == 8  # both full blocks hit; token 8 lies in a partial block
    assert tokens_of(m) == {"no_key": 9, "partial_block": 1}
    assert run(m, toks(0, 9)) == 8  # nothing missed but the last token
    assert tokens_of(m) == {"no_key": 9, "partial_block": 1}


def test_evicted_earlier(m: Manager) -> None:
    run(m, toks(0, 9))
    groups = m.num_groups if isinstance(m, HybridKVManager) else 1
    run(m, toks(100, m.num_blocks * BS // groups))  # the whole pool: evicts the first prompt's blocks
    assert m.stats.evictions >= 2
    run(m, toks(0, 9))
    assert m.stats.miss_tokens["evicted"] == 8


def test_a_different_salt(m: Manager) -> None:
    run(m, toks(0, 9), salt=b"tenant-a")
    run(m, toks(0, 9), salt=b"tenant-b")
    assert m.stats.miss_tokens["salt"] == 8


def test_invalidated_by_an_epoch(m: Manager) -> None:
    run(m, toks(0, 9))
    m.bump_epoch()
    run(m, toks(0, 9))
    assert m.stats.miss_tokens["epoch"] == 8 and m.stats.miss_tokens["no_key"] == 8


def test_a_miss_after_some_hits_is_counted_from_the_first_missing_block(m: Manager) -> None:
    run(m, toks(0, 9))
    assert run(m, toks(0, 4) + toks(50, 9)) == 4
    assert m.stats.miss_tokens["no_key"] == 8 + 8


def test_verify_hits_refusing_a_collision_is_a_verify_miss() -> None:
    m = PagedKVManager(num_blocks=9, block_size=BS, hash_fn=lambda parent, data, extra: b"same", verify_hits=True)
    run(m, toks(0, 5))
    run(m, toks(10, 5))  # every key collides; the content differs
    assert m.stats.miss_tokens["verify"] == 4 and m.prefix.verify_failures == 1


def test_the_counts_add_up_and_refused_admissions_count_nothing() -> None:
    rng = np.random.default_rng(0)
    m = PagedKVManager(num_blocks=12, block_size=BS)
    for i in range(300):
        prompt = rng.integers(0, 3, size=int(rng.integers(1, 30))).tolist()
        before = m.stats
        a = m.admit(prompt, salt=[b"", b"x"][i % 2])
        if a is None:
            assert m.stats == before
            continue
        if i % 3:
            m.mark_computed([a.seq_id])
        m.free(a.seq_id)
        if i % 50 == 49:
            m.bump_epoch()
    s = m.stats
    assert sum(s.miss_tokens.values()) + s.cached_tokens + s.admissions == s.prompt_tokens
    assert sum(s.miss_lookups.values()) <= s.admissions and set(s.miss_tokens) == set(MISS_REASONS)
    assert s.miss_tokens["evicted"] > 0 and s.miss_tokens["salt"] > 0 and s.miss_tokens["epoch"] > 0


def test_the_evicted_memory_is_bounded_and_forgets_old_evictions() -> None:
    m = PagedKVManager(num_blocks=9, block_size=BS)
    run(m, toks(0, 9))
    for i in range(1, 3000):
        run(m, toks(1000 * i, 9))
    assert 8 * len(m.index._evicted) == 1 << 16 and m.stats.evictions > 2 * 1024
    run(m, toks(0, 9))  # evicted more than two generations ago: forgotten (a false positive is ~1 in 32)
    assert m.stats.miss_tokens["no_key"] >= 8


# --- the memory of evicted keys lives in forget_keys, in both backends ---------------------------------------


@SETTINGS
@given(case=forget_cases())
def test_forget_keys_remembers_dropped_keys_alike_in_both_backends(case: dict[str, Any]) -> None:
    got = []
    for backend in (native, REF):
        c, dropped = copy_forget(case), np.zeros(64, dtype=np.uint8)
        dropped[5] = 1  # marked earlier
        result = outcome(backend.forget_keys, (c["index"], c["key_of"], None), c["ids"], dropped)
        got.append((result, dropped.tolist(), [id(k) for k in c["key_of"]]))
        if result is None:  # every key the ids held is marked
            held = [case["key_of"][b] for b in np.asarray(case["ids"], dtype=np.int64).tolist()]
            slots = [evicted_slot(k) & (8 * 64 - 1) for k in held if k is not None]  # one bit per slot
            assert all(dropped[s >> 3] >> (s & 7) & 1 for s in slots)
        else:
            assert dropped.tolist() == [int(i == 5) for i in range(64)]
    assert got[0] == got[1]
    for backend in (native, REF):
        for bad in ([], np.zeros(6, np.uint8), np.zeros(8, np.int64), np.zeros(8, np.uint8)[::2], {}):
            with pytest.raises(TypeError, match="dropped"):
                backend.forget_keys(({b"a": 0}, [b"a"], None), [0], bad)


def test_the_evicted_slot_does_not_depend_on_the_hash_seed() -> None:
    """`hash()` of bytes is salted per process: the memory of evicted keys reads the key's own bytes, so a
    replay's miss reasons are the same in every process (two interpreters, two seeds)."""
    import subprocess
    import sys

    code = "from pagedkv.core.hotpath import evicted_slot; print([evicted_slot(bytes([i]) * 33) for i in range(8)])"
    outs = {
        subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                       capture_output=True, text=True, check=True).stdout  # fmt: skip
        for seed in ("1", "2")
    }
    assert len(outs) == 1
    key = bytes(range(32))
    assert evicted_slot(key) != evicted_slot(key + b"\x01"), "a hybrid key's group moves its slot"


def test_a_tier_loss_moves_tokens_from_the_admissions_reason_and_never_more_than_it_missed() -> None:
    m = PagedKVManager(num_blocks=16, block_size=BS)
    a = m.admit(toks(0, 13))
    assert a is not None and m.stats.miss_tokens["no_key"] == 12
    m.count_tier_miss(a.seq_id, 4)
    m.count_tier_miss(a.seq_id, 4)
    st = m.stats
    assert (st.miss_tokens["no_key"], st.miss_tokens["tier"]) == (4, 8)
    assert (st.miss_lookups["no_key"], st.miss_lookups["tier"]) == (0, 1), "the lookup moves once"
    m.count_tier_miss(a.seq_id, 100)  # at most what the admission missed
    assert (m.stats.miss_tokens["no_key"], m.stats.miss_tokens["tier"]) == (0, 12)
    assert sum(m.stats.miss_tokens.values()) + m.stats.cached_tokens + m.stats.admissions == m.stats.prompt_tokens
    m.free(a.seq_id)
    b = m.admit(toks(100, 1))  # one token: nothing missed, nothing to move
    assert b is not None
    m.count_tier_miss(b.seq_id, 4)
    assert m.stats.miss_tokens["tier"] == 12
