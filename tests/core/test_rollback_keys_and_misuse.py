"""Issue 20 items 6 and 10 (core): rollback then re-admission with the request's own keys works with prefix
caching on and off alike; malformed `BlockKeys` extras and `PinHandle`s are typed errors that change nothing."""

from __future__ import annotations

import pytest

from pagedkv.core import PagedKVManager, PinHandle
from pagedkv.core.errors import InvalidArgumentError, PinError
from pagedkv.core.prefix import BlockKeys


@pytest.mark.parametrize("caching", [True, False])
def test_rollback_then_readmit_with_own_keys(caching: bool) -> None:
    m = PagedKVManager(num_blocks=64, block_size=4, enable_prefix_caching=caching)
    k = BlockKeys()
    first = list(range(1, 13))
    seq = m.admit(first, keys=k)
    assert seq is not None
    m.mark_computed([seq.seq_id])
    m.rollback(seq.seq_id, 6)
    others = [50, 51, 52, 53, 54, 55]
    for t in others:
        assert m.append([seq.seq_id], [t])
    m.mark_computed([seq.seq_id])
    m.check_invariants()
    m.preempt(seq.seq_id)
    again = m.admit(first[:6] + others, keys=k)
    assert again is not None
    m.check_invariants()
    # the keys still refuse a prompt that disagrees with what they now hold
    m.preempt(again.seq_id)
    with pytest.raises(InvalidArgumentError):
        m.admit(first, keys=k)


def test_block_extra_must_be_bytes_by_block_index() -> None:
    with pytest.raises(InvalidArgumentError):
        BlockKeys(block_extra={0: "img"})  # type: ignore[dict-item]
    with pytest.raises(InvalidArgumentError):
        BlockKeys(block_extra={-1: b"img"})
    with pytest.raises(InvalidArgumentError):
        BlockKeys(block_extra={"0": b"img"})  # type: ignore[dict-item]
    with pytest.raises(InvalidArgumentError):
        BlockKeys(block_extra=[b"x"])  # type: ignore[arg-type]
    assert BlockKeys(block_extra={0: b"img"}).block_extra == {0: b"img"}


@pytest.mark.parametrize("ids", [(10**6,), (-1,), ("a",), (1.5,), (2**70,), (True,)])
def test_unpin_of_a_malformed_handle_is_typed_and_changes_nothing(ids: tuple[object, ...]) -> None:
    m = PagedKVManager(num_blocks=16, block_size=4)
    seq = m.admit(list(range(8)))
    assert seq is not None
    m.mark_computed([seq.seq_id])
    handle = m.pin(list(range(8)))
    before = m.snapshot()
    with pytest.raises((InvalidArgumentError, PinError)):
        m.unpin(PinHandle(ids))  # type: ignore[arg-type]
    assert m.snapshot() == before
    m.unpin(handle)
    m.check_invariants()
