"""Issue 9: every failed call changes nothing, in both managers, and every bad input gets a one-line typed
error naming the argument; the fork/rollback corruption; pending copies and swaps in one step; verify_hits
checks everything a key stands for."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pagedkv.core import (
    BlockKeys,
    ContiguousKVManager,
    InvalidArgumentError,
    PagedKVError,
    PagedKVManager,
    PinError,
    UnknownSequenceError,
    hotpath,
)

BACKENDS = [None, False] if hotpath.NATIVE is not None else [False]


def paged() -> tuple[Any, int, int]:
    m = PagedKVManager(num_blocks=12, block_size=4, num_host_blocks=4)
    a = m.admit(list(range(10)), keys=BlockKeys())
    b = m.admit(list(range(7)))
    assert a is not None and b is not None
    m.mark_computed([a.seq_id])
    return m, a.seq_id, b.seq_id


def contiguous() -> tuple[Any, int, int]:
    m = ContiguousKVManager(num_blocks=12, block_size=4)
    a = m.admit(list(range(10)), max_new_tokens=2, keys=BlockKeys())
    b = m.admit(list(range(7)), max_new_tokens=1)
    assert a is not None and b is not None
    m.mark_computed([a.seq_id])
    return m, a.seq_id, b.seq_id


def state(m: Any) -> object:
    """A snapshot both managers can give: every table array, the free space, the counters."""
    t = m.tables
    rows = tuple(getattr(t, name).tobytes() for name in t._ROW_ARRAYS)
    if isinstance(m, PagedKVManager):
        return m.snapshot()
    return (t.table.tobytes(), rows, m.runs.holes(), m._admissions, m._prompt_tokens, tuple(m._pending.items()))


# (name, call, error, the word the message must name)
BOTH = [
    # several bad arguments: both managers name the first in one order (core/validate.as_admission)
    ("all bad", lambda m, a, b: m.admit([-1], max_new_tokens=-1, num_lookahead=-1, keep_free=-1, priority="x"),
     InvalidArgumentError, "token_ids"),  # fmt: skip
    ("max_new, lookahead, keep_free, priority bad",
     lambda m, a, b: m.admit([1], max_new_tokens=-1, num_lookahead=-1, keep_free=-1, priority="x"),
     InvalidArgumentError, "max_new_tokens"),  # fmt: skip
    ("lookahead, keep_free, priority bad", lambda m, a, b: m.admit([1], num_lookahead=-1, keep_free=-1, priority="x"),
     InvalidArgumentError, "num_lookahead"),  # fmt: skip
    ("keep_free, priority bad", lambda m, a, b: m.admit([1], keep_free=-1, priority="x"),
     InvalidArgumentError, "keep_free"),  # fmt: skip
    ("priority 2**70", lambda m, a, b: m.admit([1, 2], priority=2**70), InvalidArgumentError, "priority"),
    ("priority str", lambda m, a, b: m.admit([1, 2], priority="x"), InvalidArgumentError, "priority"),
    ("priority None", lambda m, a, b: m.admit([1, 2], priority=None), InvalidArgumentError, "priority"),
    ("priority bool", lambda m, a, b: m.admit([1, 2], priority=True), InvalidArgumentError, "priority"),
    ("token 2**63", lambda m, a, b: m.admit([1, 2**63]), InvalidArgumentError, "token_ids"),
    ("token 2**64", lambda m, a, b: m.admit([1, 2**64]), InvalidArgumentError, "token_ids"),
    ("max_new 2**63", lambda m, a, b: m.admit([1], max_new_tokens=2**63), InvalidArgumentError, "max_new_tokens"),
    ("lookahead 2**63", lambda m, a, b: m.admit([1], num_lookahead=2**63), InvalidArgumentError, "num_lookahead"),
    ("keys junk", lambda m, a, b: m.admit([1, 2], keys="junk"), InvalidArgumentError, "keys"),
    ("keys reused for another prompt", lambda m, a, b: m.admit([5] * 10, keys=m._k), InvalidArgumentError, "keys"),
    ("salt str", lambda m, a, b: m.admit([1], salt="t"), InvalidArgumentError, "salt"),
    ("append 2**63-1", lambda m, a, b: m.append([a], None, num_tokens=2**63 - 1), InvalidArgumentError, "num_tokens"),
    ("append 2**63", lambda m, a, b: m.append([a], None, num_tokens=2**63), InvalidArgumentError, "num_tokens"),
    ("append bool", lambda m, a, b: m.append([a], None, num_tokens=True), InvalidArgumentError, "num_tokens"),
    ("append float", lambda m, a, b: m.append([a], None, num_tokens=1.0), InvalidArgumentError, "num_tokens"),
    ("append ragged", lambda m, a, b: m.append([a, b], [[1], [1, 2]]), InvalidArgumentError, "token_ids"),
    ("seq id 2**63", lambda m, a, b: m.append([2**63], [1]), InvalidArgumentError, "seq_ids"),
    ("seq id 2**70", lambda m, a, b: m.append([2**70], [1]), InvalidArgumentError, "seq_ids"),
    ("mark past length", lambda m, a, b: m.mark_computed([b], [8]), InvalidArgumentError, "num_computed_tokens"),
    ("mark backwards", lambda m, a, b: m.mark_computed([a], [3]), InvalidArgumentError, "num_computed_tokens"),
    ("mark float", lambda m, a, b: m.mark_computed([b], [2.5]), InvalidArgumentError, "num_computed_tokens"),
    ("mark str", lambda m, a, b: m.mark_computed([b], ["x"]), InvalidArgumentError, "num_computed_tokens"),
    ("mark bool", lambda m, a, b: m.mark_computed([b], [True]), InvalidArgumentError, "num_computed_tokens"),
    ("mark 2**63", lambda m, a, b: m.mark_computed([b], [2**63]), InvalidArgumentError, "num_computed_tokens"),
    ("mark wrong shape", lambda m, a, b: m.mark_computed([a, b], [10, 7, 1]), InvalidArgumentError, "num_computed_tokens"),
    ("slot float end", lambda m, a, b: m.slot_mapping([b], [0], [1.5]), InvalidArgumentError, "ends"),
    ("slot str end", lambda m, a, b: m.slot_mapping([b], [0], ["x"]), InvalidArgumentError, "ends"),
    ("slot float start", lambda m, a, b: m.slot_mapping([b], [0.0], [1]), InvalidArgumentError, "starts"),
    ("slot wrong shape", lambda m, a, b: m.slot_mapping([a, b], [0, 0, 0], [1, 1]), InvalidArgumentError, "starts"),
    ("slot 2**63 end", lambda m, a, b: m.slot_mapping([b], [0], [2**63]), InvalidArgumentError, "ends"),
    ("pad_id float", lambda m, a, b: m.block_table([a], pad_id=1.5), InvalidArgumentError, "pad_id"),
    ("pad_id bool", lambda m, a, b: m.block_table([a], pad_id=True), InvalidArgumentError, "pad_id"),
    ("can_admit -1", lambda m, a, b: m.can_admit([1], max_new_tokens=-1), InvalidArgumentError, "max_new_tokens"),
    ("free unknown", lambda m, a, b: m.free(99), UnknownSequenceError, "sequence"),
    ("fork str", lambda m, a, b: m.fork("x"), InvalidArgumentError, "sequence id"),
]
PAGED_ONLY = [
    ("pin uncached", lambda m, a, b: m.pin([9, 9, 9, 9, 9]), PinError, "pin"),
    ("rollback 2**63", lambda m, a, b: m.rollback(a, 2**63), InvalidArgumentError, "num_tokens"),
    ("match keys junk", lambda m, a, b: m.match_prefix([1, 2], keys=object()), InvalidArgumentError, "keys"),
]
CONSTRUCTORS = [
    ("native yes", lambda cls: cls(16, 4, native="yes"), "native"),
    ("block_size 2**40", lambda cls: cls(16, 2**40), "block_size"),
    ("block_size 0", lambda cls: cls(16, 0), "block_size"),
    ("num_blocks 2**63", lambda cls: cls(2**63, 4), "num_blocks"),
    ("num_blocks float", lambda cls: cls(16.0, 4), "num_blocks"),
    ("num_host_blocks -1", lambda cls: cls(16, 4, num_host_blocks=-1), "num_host_blocks"),
    ("hash_fn junk", lambda cls: cls(16, 4, hash_fn=3), "hash_fn"),
    ("verify_hits str", lambda cls: cls(16, 4, verify_hits="yes"), "verify_hits"),
]

CASES = [(kind, *c) for kind in ("paged", "contiguous") for c in BOTH] + [("paged", *c) for c in PAGED_ONLY]


@pytest.mark.parametrize("kind,name,call,error,names", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_bad_input_raises_one_typed_line_naming_the_argument_and_changes_nothing(
    kind: str, name: str, call: Any, error: type[Exception], names: str
) -> None:
    m, a, b = paged() if kind == "paged" else contiguous()
    m._k = BlockKeys()
    assert m.admit(list(range(20, 30)), keys=m._k) is not None  # the keys now belong to that prompt
    before = state(m)
    with pytest.raises(error) as info:
        call(m, a, b)
    assert isinstance(info.value, PagedKVError)
    message = str(info.value)
    assert message and "\n" not in message and names in message, message
    assert state(m) == before, f"{name}: a failed call changed state"
    m.check_invariants()


@pytest.mark.parametrize("name,build,names", CONSTRUCTORS, ids=[c[0] for c in CONSTRUCTORS])
def test_constructor_misuse_is_typed(name: str, build: Any, names: str) -> None:
    classes = [PagedKVManager] if "hash" in name or "host" in name or "native" in name or "verify" in name else [PagedKVManager, ContiguousKVManager]
    for cls in classes:
        with pytest.raises(InvalidArgumentError, match=names):
            build(cls)


def test_numpy_integers_are_ints_everywhere() -> None:
    m = PagedKVManager(np.int64(16), np.int32(4), num_host_blocks=np.int64(4))
    a = m.admit(np.arange(9), priority=np.int64(2), max_new_tokens=np.int16(3), num_lookahead=np.uint8(1))
    assert a is not None
    assert m.append(np.array([a.seq_id]), np.array([5]), num_tokens=np.int64(1))
    m.mark_computed([a.seq_id], np.array([10]))
    m.rollback(np.int64(a.seq_id), np.int32(1))
    assert m.slot_mapping([a.seq_id], np.int64(0), np.int32(3)).tolist() == [4, 5, 6]
    c = ContiguousKVManager(np.int64(16), np.int64(4))
    b = c.admit([1, 2], priority=np.int64(1), max_new_tokens=np.int64(2))
    assert b is not None
    c.mark_computed([b.seq_id], np.int64(2))
    m.check_invariants()
    c.check_invariants()


def test_contiguous_validates_exactly_like_paged() -> None:
    """Every BOTH case gives the same error type and message on both managers."""
    for name, call, _error, _names in BOTH:
        got = []
        for make in (paged, contiguous):
            m, a, b = make()
            m._k = BlockKeys()
            m.admit(list(range(20, 30)), keys=m._k)
            with pytest.raises(PagedKVError) as info:
                call(m, a, b)
            got.append((type(info.value), str(info.value).split(":")[0]))
        if name not in ("free unknown",):
            assert got[0][0] is got[1][0], name
        if name.endswith("bad"):  # the shared admit checks: the same words from both
            assert got[0] == got[1], (name, got)


@pytest.mark.parametrize("native", BACKENDS)
def test_pin_of_an_uncached_prefix_raises_pin_error(native: bool | None) -> None:
    m = PagedKVManager(16, 4, native=native)
    with pytest.raises(PinError):
        m.pin([1, 2, 3, 4, 5])
    a = m.admit([1, 2, 3, 4, 5])
    assert a is not None
    m.mark_computed([a.seq_id])
    assert m.pin([1, 2, 3, 4, 5]).num_blocks == 1


# --- the fork/rollback corruption ---------------------------------------------------------------


def _shared_published(native: bool | None) -> tuple[PagedKVManager, int, int]:
    kv = PagedKVManager(num_blocks=16, block_size=4, native=native)
    a = kv.admit([1, 2, 3, 4, 5, 6, 7, 8])
    assert a is not None
    kv.mark_computed([a.seq_id])  # both blocks published
    return kv, a.seq_id, kv.fork(a.seq_id)


def _served(kv: PagedKVManager) -> list[int]:
    adm = kv.admit([1, 2, 3, 4, 5, 6, 7, 8, 99])
    assert adm is not None
    slots = kv.slot_mapping([adm.seq_id], [0], [adm.num_cached_tokens])
    return kv.block_tokens.reshape(-1)[slots].tolist()


@pytest.mark.parametrize("native", BACKENDS)
def test_issue_reproduction_all_holders_roll_back_and_write_in_one_batch(native: bool | None) -> None:
    kv, a, c = _shared_published(native)
    kv.rollback(a, 2)
    kv.rollback(c, 2)
    assert kv.append([a, c], [9, 10])
    kv.check_invariants()
    assert _served(kv) == [1, 2, 3, 4]  # the rewritten block is no longer served as [5, 6, 7, 8]


@pytest.mark.parametrize("native", BACKENDS)
@pytest.mark.parametrize("order", ["one then other", "other freed", "across swap", "three children"])
def test_rollback_into_a_shared_published_block_never_serves_changed_kv(native: bool | None, order: str) -> None:
    kv = PagedKVManager(num_blocks=24, block_size=4, num_host_blocks=8, native=native)
    a = kv.admit([1, 2, 3, 4, 5, 6, 7, 8])
    assert a is not None
    kv.mark_computed([a.seq_id])
    kids = [kv.fork(a.seq_id) for _ in range(3 if order == "three children" else 1)]
    family = [a.seq_id, *kids]
    for s in family:
        kv.rollback(s, 2)
        kv.check_invariants()
    if order == "one then other":
        assert kv.append([family[0]], [9]) and kv.append([family[1]], [10])
    elif order == "other freed":
        kv.free(family[1])
        assert kv.append([family[0]], [9])
    elif order == "across swap":
        assert kv.swap_out(family[0]) is not None
        assert kv.append([family[1]], [10])
        assert kv.swap_in(family[0]) is not None
        assert kv.append([family[0]], [9])
    else:
        assert kv.append(family, [9, 10, 11, 12])
    kv.check_invariants()
    kv.take_copies()
    served = _served(kv)
    assert served == [1, 2, 3, 4, 5, 6, 7, 8][: len(served)], "a hit served KV that is not the prompt's"
    kv.check_invariants()


# --- block moves: swap + fork + copy-on-write in one step ---------------------------------------


@pytest.mark.parametrize("native", BACKENDS)
def test_a_pending_copy_keeps_its_blocks_from_swap_in(native: bool | None) -> None:
    """The soak's failure: a copy's destination was freed and reused by swap_in before the copy ran."""
    bs = 4
    kv = PagedKVManager(num_blocks=7, block_size=bs, num_host_blocks=8, native=native)  # 6 usable
    dev = np.full(7 * bs, -1)
    host = np.full(8 * bs, -1)

    def write(seq: int, tokens: list[int]) -> None:
        dev[kv.slot_mapping([seq], [0], [len(tokens)])] = tokens

    s = kv.admit([7, 7, 7, 7, 7, 7])
    assert s is not None
    write(s.seq_id, [7] * 6)
    kv.mark_computed([s.seq_id])
    w = kv.admit([5, 5, 5, 5, 5])
    assert w is not None
    write(w.seq_id, [5] * 5)
    kv.mark_computed([w.seq_id])
    plan = kv.swap_out(w.seq_id)
    assert plan is not None
    host.reshape(-1, bs)[plan.dst] = dev.reshape(-1, bs)[plan.src]
    # one step: fork + copy-on-write, the child freed, then a swap-in needing blocks
    child = kv.fork(s.seq_id)
    assert kv.append([child], [8])  # moves the child to a copy of block 1
    kv.free(child)  # the copy's destination is free again... but held until the copy is handed out
    plan = kv.swap_in(w.seq_id)
    assert plan is not None
    dev.reshape(-1, bs)[plan.dst] = host.reshape(-1, bs)[plan.src]  # swaps first (protocol order)
    copies = kv.take_copies()
    assert not set(copies.dst.tolist()) & set(plan.dst.tolist())
    dev.reshape(-1, bs)[copies.dst] = dev.reshape(-1, bs)[copies.src]
    assert dev[kv.slot_mapping([w.seq_id], [0], [5])].tolist() == [5] * 5
    assert dev[kv.slot_mapping([s.seq_id], [0], [6])].tolist() == [7] * 6
    kv.check_invariants()


@pytest.mark.parametrize("native", BACKENDS)
def test_swap_out_of_a_fresh_copy_reads_its_source_and_chained_copies_flatten(native: bool | None) -> None:
    bs = 4
    kv = PagedKVManager(num_blocks=16, block_size=bs, num_host_blocks=8, native=native)
    dev = np.full(16 * bs, -1)
    s = kv.admit([1, 2, 3, 4, 5, 6])
    assert s is not None
    dev[kv.slot_mapping([s.seq_id], [0], [6])] = [1, 2, 3, 4, 5, 6]
    kv.mark_computed([s.seq_id])
    c1 = kv.fork(s.seq_id)
    assert kv.append([c1], [0], num_tokens=1)  # copy: s's block 1 -> c1's new block
    c2 = kv.fork(c1)
    assert kv.append([c2], [0], num_tokens=1)  # its source is a pending destination: copies from s's block
    plan = kv.swap_out(c1)  # c1's block 1 is not filled yet: the plan reads s's block
    assert plan is not None
    copies = kv.take_copies()
    assert not set(copies.src.tolist()) & set(copies.dst.tolist())
    assert len(set(copies.dst.tolist())) == len(copies.dst)
    src_block = kv.block_ids(s.seq_id)[1]
    assert set(copies.src.tolist()) == {src_block} and plan.src.tolist()[1] == src_block
    kv.check_invariants()


# --- verify_hits verifies everything the key covers --------------------------------------------


def colliding(parent: object, data: bytes, extra: bytes) -> bytes:
    return b"same"  # every key of every chain collides


@pytest.mark.parametrize("what", ["tokens", "salt", "extra", "block extra", "epoch"])
def test_verify_hits_refuses_a_colliding_key_that_differs_in(what: str) -> None:
    m = PagedKVManager(num_blocks=16, block_size=4, hash_fn=colliding, verify_hits=True)
    prompt = [1, 2, 3, 4, 5]
    a = m.admit(prompt, keys=BlockKeys(b"t1", extra=b"x", block_extra={0: b"img"}))
    assert a is not None
    m.mark_computed([a.seq_id])
    same = dict(salt=b"t1", extra=b"x", block_extra={0: b"img"})
    other = {
        "tokens": (same, [9, 9, 9, 9, 5]),
        "salt": ({**same, "salt": b"t2"}, prompt),
        "extra": ({**same, "extra": b"y"}, prompt),
        "block extra": ({**same, "block_extra": {0: b"other"}}, prompt),
        "epoch": (same, prompt),
    }[what]
    if what == "epoch":
        m.bump_epoch()
    kw, tokens = other
    salt = kw.pop("salt")
    b = m.admit(tokens, keys=BlockKeys(salt, **kw))
    assert b is not None and b.num_cached_tokens == 0
    assert m.stats.verify_failures == 1
    if what != "epoch":
        c = m.admit(prompt, keys=BlockKeys(b"t1", extra=b"x", block_extra={0: b"img"}))
        assert c is not None and c.num_cached_tokens == 4  # the matching request still hits
