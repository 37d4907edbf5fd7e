"""Partial-block reuse: a prompt that diverges inside a cached block copies that block and computes the rest.

Scenario tests pin the source, destination and counts; the state machine runs with it on (every admission
that reuses part of a block must copy from a block holding exactly those tokens), and so does the soak,
whose shadow KV store applies the copies and reads every sequence back.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule
from test_state_machine import BS, VOCAB, ManagerMachine

from pagedkv.bench.soak import run_soak
from pagedkv.core import BlockKeys, PagedKVManager


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


@pytest.fixture
def m() -> PagedKVManager:
    return PagedKVManager(num_blocks=9, block_size=BS, partial_reuse=True)


def cached(m: PagedKVManager, prompt: list[int]) -> list[int]:
    a = m.admit(prompt)
    assert a is not None
    m.take_copies()
    m.mark_computed([a.seq_id])
    blocks = m.block_ids(a.seq_id)
    m.free(a.seq_id)
    return blocks


def test_a_prompt_diverging_inside_a_block_copies_it(m: PagedKVManager) -> None:
    first = cached(m, toks(0, 9))  # blocks 1, 2 published; 3 partial
    assert first == [1, 2, 3]
    prompt = toks(0, 6) + [99, 98, 97]  # block 0 hits; block 1 shares 2 tokens (4, 5) with block 2
    assert m.match_prefix(prompt) == 6
    a = m.admit(prompt)
    assert a is not None and a.num_cached_tokens == 6
    assert m.block_ids(a.seq_id)[0] == 1 and m.num_computed_tokens(a.seq_id) == 6
    dst = m.block_ids(a.seq_id)[1]
    copies = m.take_copies()
    assert copies.src.tolist() == [2] and copies.dst.tolist() == [dst]
    assert m.stats.partial_hits == 1 and m.stats.cached_tokens == 6
    assert m.block_tokens[dst].tolist() == [4, 5, 99, 98]  # the mirror holds the prompt's own tokens
    m.check_invariants()
    m.free(a.seq_id)
    m.check_invariants()


def test_a_prompt_shorter_than_a_block_hits_partially(m: PagedKVManager) -> None:
    cached(m, toks(0, 5))  # block 1 = [0, 1, 2, 3] published
    a = m.admit(toks(0, 3))  # vLLM #54607: no full block, yet 2 tokens are served (the last is computed)
    assert a is not None and a.num_cached_tokens == 2
    assert m.take_copies().src.tolist() == [1]
    assert m.stats.miss_tokens["short_prompt"] == 0 and m.stats.miss_tokens["no_key"] == 4


def test_off_by_default_and_outputs_whole_blocks_only() -> None:
    m = PagedKVManager(num_blocks=9, block_size=BS)
    cached(m, toks(0, 9))
    a = m.admit(toks(0, 6) + [99, 98, 97])
    assert a is not None and a.num_cached_tokens == 4 and len(m.take_copies().src) == 0


def test_the_source_is_held_until_the_copy_is_handed_out(m: PagedKVManager) -> None:
    cached(m, toks(0, 9))  # 1, 2 cached-free; 3..8 free
    a = m.admit(toks(0, 6) + [99])  # holds block 2 as the source, takes a fresh block
    assert a is not None and a.num_cached_tokens == 6
    assert m.pool.ref[2] == 1 and m.pool.num_evictable == 0  # 1 hit (in use), 2 held
    b = m.admit(toks(200, 20))  # 5 blocks: exactly the free ones; 2 cannot be evicted under the copy
    assert b is not None and 2 not in m.block_ids(b.seq_id)
    assert m.admit(toks(300, 4)) is None
    copies = m.take_copies()
    assert copies.src.tolist() == [2]
    assert m.pool.num_evictable == 1  # released: cached-free again
    m.check_invariants()


def test_different_salts_and_block_extras_never_share(m: PagedKVManager) -> None:
    cached(m, toks(0, 9))
    a = m.admit(toks(0, 6) + [99], salt=b"other")
    assert a is not None and a.num_cached_tokens == 0
    b = m.admit(toks(0, 6) + [99], keys=BlockKeys(block_extra={1: b"img"}))
    assert b is not None and b.num_cached_tokens == 4  # the full block hits; no partial reuse with extras


def test_eviction_and_reset_drop_the_links(m: PagedKVManager) -> None:
    cached(m, toks(0, 9))
    assert m.index.children
    cached(m, toks(100, 32))  # the whole pool: evicts both cached blocks
    assert m.match_prefix(toks(0, 6) + [99]) == 0
    cached(m, toks(0, 9))
    m.reset_prefix_cache()
    assert not m.index.children
    m.check_invariants()


# --- the state machine with partial reuse ---------------------------------------------------------------


class PartialReuseMachine(ManagerMachine):
    partial_reuse = True

    @rule(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14))
    def admit_checking_the_copy(self, prompt: list[int]) -> None:
        """An admission that reuses part of a block copies from a block whose mirror holds those tokens."""
        pending = dict(self.m.copies.pending)
        adm = self.m.admit(prompt)
        if adm is None:
            return
        self.tokens[adm.seq_id] = list(prompt)
        r = adm.num_cached_tokens % BS
        if r:
            h = adm.num_cached_tokens // BS
            dst = self.m.block_ids(adm.seq_id)[h]
            src = self.m.copies.pending[dst]
            assert dst not in pending and self.m.block_tokens[src][:r].tolist() == prompt[h * BS : h * BS + r]


PartialReuseMachine.TestCase.settings = settings(  # 150 x 40 steps: every rule runs hundreds of times
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestPartialReuseMachine = PartialReuseMachine.TestCase


def test_the_soak_passes_with_partial_reuse() -> None:
    result = run_soak(8000, seed=5, kinds=("paged", "paged-python"), policies=("lru", "slru"), partial_reuse=True)
    assert result.violations == 0, result.message
    assert np.isfinite(result.ops_per_s)
