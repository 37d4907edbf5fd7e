"""The contiguous baseline's fork copies: a copy never goes from a block onto itself."""

from __future__ import annotations

import numpy as np

from pagedkv.core.contiguous import ContiguousKVManager


def test_fork_preempt_fork_emits_no_copy_from_a_block_onto_itself() -> None:
    """Fork a into b (b's blocks wait for a's KV), preempt a, fork b: the grandchild takes a's freed run
    first fit, and its blocks already hold the KV b's copies read from. Those copies are left out."""
    m = ContiguousKVManager(num_blocks=9, block_size=4)  # blocks 1..8
    a = m.admit(list(range(8)), max_new_tokens=0)  # blocks 1, 2
    assert a is not None
    m.mark_computed([a.seq_id])
    b = m.fork(a.seq_id)  # blocks 3, 4, copied from 1, 2
    assert b is not None and m.block_ids(b) == [3, 4]
    m.preempt(a.seq_id)  # run 1..2 free again; b's copies still pending (1, 2 are intact until the step)
    c = m.fork(b)  # first fit: blocks 1, 2, whose KV is what b's pending copies read
    assert c is not None and m.block_ids(c) == [1, 2]
    copies = m.take_copies()
    pairs = sorted(zip(copies.src.tolist(), copies.dst.tolist()))
    assert pairs == [(1, 3), (2, 4)], pairs
    assert not np.any(copies.src == copies.dst)
    m.check_invariants()


def test_random_forks_preemptions_and_frees_never_copy_a_block_onto_itself() -> None:
    rng = np.random.default_rng(0)
    m = ContiguousKVManager(num_blocks=33, block_size=4)
    live: list[int] = []
    for _ in range(5_000):
        op = int(rng.choice(4, p=[0.3, 0.3, 0.3, 0.1]))  # copies taken rarely: forks and preemptions pile up
        if op == 0 or not live:
            adm = m.admit(rng.integers(0, 50, int(rng.integers(1, 12))).tolist(), max_new_tokens=int(rng.integers(0, 8)))
            if adm is not None:
                m.mark_computed([adm.seq_id])
                live.append(adm.seq_id)
        elif op == 1:
            child = m.fork(live[int(rng.integers(len(live)))])
            if child is not None:
                live.append(child)
        elif op == 2:
            m.preempt(live.pop(int(rng.integers(len(live)))))
        else:
            copies = m.take_copies()
            assert not np.any(copies.src == copies.dst), "contiguous: a copy from a block onto itself"
            assert len(set(copies.dst.tolist())) == len(copies.dst)
        m.check_invariants()


def test_rollback_drops_tokens_inside_the_reservation_and_refuses_more_than_held() -> None:
    """The speculative verb every manager has: the last tokens go, the reservation stays, computed follows."""
    import pytest

    from pagedkv.core.errors import InvalidArgumentError

    m = ContiguousKVManager(num_blocks=9, block_size=4)
    a = m.admit(list(range(6)), max_new_tokens=6)
    assert a is not None
    m.mark_computed([a.seq_id])
    assert m.append([a.seq_id], num_tokens=3)
    blocks = m.block_ids(a.seq_id)
    m.rollback(a.seq_id, 4)
    assert m.num_tokens(a.seq_id) == 5 and m.block_ids(a.seq_id) == blocks
    with pytest.raises(InvalidArgumentError, match="cannot roll back 6"):
        m.rollback(a.seq_id, 6)
    assert m.num_tokens(a.seq_id) == 5
    assert m.append([a.seq_id], num_tokens=7)  # the whole reservation is there again
    m.check_invariants()
