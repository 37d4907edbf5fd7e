"""EventLog: copy counting per medium, parents never dangling, clears re-announcing the other media."""

from __future__ import annotations

import pytest

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.events import (
    CPU,
    GPU,
    REMOTE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventLog,
    decode_batch,
    encode_batch,
    external_hash,
)
from pagedkv.router.index import ReplicaIndex

K = [bytes([i]) * 32 for i in range(10)]
H = [external_hash(k) for k in K]


def events(log: EventLog) -> list[object]:
    batch = log.take_batch()
    return [] if batch is None else list(batch.events)


def test_external_hash_is_low_64_bits() -> None:
    key = bytes(range(32))
    assert external_hash(key) == int.from_bytes(bytes(range(24, 32)), "big")
    assert external_hash(-1) == 2**64 - 1
    with pytest.raises(InvalidArgumentError):
        external_hash(b"short")


def test_wire_format_is_vllm_tagged_arrays() -> None:
    import msgspec

    log = EventLog(2, clock=lambda: 7.0)
    log.stored(GPU, K[:2], token_ids=[1, 2, 3, 4])
    log.removed(GPU, K[1:2])
    log.cleared(GPU)
    raw = msgspec.msgpack.decode(encode_batch(log.take_batch()))
    assert raw[0] == 7.0 and raw[2] == 0
    assert raw[1][0][:7] == ["BlockStored", H[:2], None, [1, 2, 3, 4], 2, None, "GPU"]
    assert raw[1][1] == ["BlockRemoved", [H[1]], "GPU"]
    assert raw[1][2] == ["AllBlocksCleared"]
    assert decode_batch(encode_batch(EventLog(2).take_batch() or _empty())) == _empty()


def _empty():
    from pagedkv.events import EventBatch

    return EventBatch(0.0, [], 0)


def test_removed_only_when_the_last_copy_in_a_medium_goes() -> None:
    log = EventLog(1)
    log.stored(GPU, K[:1], token_ids=[5])
    log.stored(GPU, K[:1], token_ids=[5])  # a second physical copy: not re-reported
    log.stored(CPU, K[:1], token_ids=[5])  # another medium: reported
    ev = events(log)
    assert [type(e) for e in ev] == [BlockStored, BlockStored] and ev[1].medium == CPU
    log.removed(GPU, K[:1])
    assert events(log) == []  # one GPU copy left
    log.removed(GPU, K[:1])
    assert events(log) == [BlockRemoved([H[0]], GPU)]
    assert log.holds(CPU) == {K[0]} and log.holds(GPU) == set()


def test_a_key_stored_again_after_removal_is_reported_again() -> None:
    log = EventLog(1)
    log.stored(GPU, K[:1])
    log.removed(GPU, K[:1])
    log.stored(GPU, K[:1])
    assert [type(e) for e in events(log)] == [BlockStored, BlockRemoved, BlockStored]


def test_chain_splits_around_blocks_already_held_and_parents_are_live() -> None:
    log = EventLog(1)
    log.stored(GPU, [K[1]], parent=K[0])  # parent never reported: sent as a root
    assert events(log)[0].parent_block_hash is None
    log.stored(GPU, K[0:4], token_ids=[0, 1, 2, 3])  # K[1] already held: two runs
    ev = events(log)
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in ev] == [
        ([H[0]], None, [0]),
        ([H[2], H[3]], H[1], [2, 3]),
    ]


def test_removing_what_is_not_held_raises_and_changes_nothing() -> None:
    log = EventLog(1)
    log.stored(GPU, K[:2])
    events(log)
    with pytest.raises(InvalidArgumentError):
        log.removed(GPU, [K[0], K[5]])
    with pytest.raises(InvalidArgumentError):
        log.removed(GPU, [K[0], K[0]])
    with pytest.raises(InvalidArgumentError):
        log.stored("HBM", K[:1])
    assert log.holds(GPU) == {K[0], K[1]} and events(log) == []


def test_clear_reannounces_other_media_parents_first() -> None:
    log = EventLog(1)
    log.stored(REMOTE, K[0:2], token_ids=[0, 1])
    log.stored(CPU, K[2:4], parent=K[1], token_ids=[2, 3])
    log.stored(GPU, K[0:4], token_ids=[0, 1, 2, 3])
    events(log)
    log.cleared(GPU)
    ev = events(log)
    assert isinstance(ev[0], AllBlocksCleared)
    seen: set[int] = set()
    for e in ev[1:]:
        assert isinstance(e, BlockStored) and e.medium in (CPU, REMOTE)
        assert e.parent_block_hash is None or e.parent_block_hash in seen
        seen.update(e.block_hashes)
    assert seen == set(H[:4])
    idx = ReplicaIndex()
    idx.apply("a", _batch(ev))
    assert idx.state("a") == {CPU: {H[2], H[3]}, REMOTE: {H[0], H[1]}}
    assert [e.token_ids for e in ev[1:] if e.block_hashes == [H[3]]] == [[3]]


def _batch(ev):
    from pagedkv.events import EventBatch

    return EventBatch(0.0, ev, 0)
