"""Misuse gets a typed error and changes nothing; capacity shortfalls change nothing; tenants never share."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from pagedkv.core import (
    BlockKeys,
    CapacityError,
    ContiguousKVManager,
    InvalidArgumentError,
    KVManager,
    NotSupportedError,
    PagedKVManager,
    PinError,
    PinHandle,
    UnknownSequenceError,
)


def busy_manager() -> tuple[PagedKVManager, int, int]:
    m = PagedKVManager(num_blocks=10, block_size=4, num_host_blocks=4)
    a = m.admit(list(range(10)))
    b = m.admit(list(range(7)))
    assert a is not None and b is not None
    m.mark_computed([a.seq_id])
    return m, a.seq_id, b.seq_id


MISUSE = [
    ("admit empty", lambda m, a, b: m.admit([]), InvalidArgumentError),
    ("admit floats", lambda m, a, b: m.admit([1.5, 2.0]), InvalidArgumentError),
    ("admit strings", lambda m, a, b: m.admit(["a"]), InvalidArgumentError),
    ("admit 2-D", lambda m, a, b: m.admit([[1, 2]]), InvalidArgumentError),
    ("admit negative id", lambda m, a, b: m.admit([1, -3]), InvalidArgumentError),
    ("admit negative max_new", lambda m, a, b: m.admit([1], max_new_tokens=-1), InvalidArgumentError),
    ("admit str salt", lambda m, a, b: m.admit([1], salt="t"), InvalidArgumentError),
    ("admit never fits", lambda m, a, b: m.admit(list(range(100))), CapacityError),
    ("append unknown", lambda m, a, b: m.append([99], [1]), UnknownSequenceError),
    ("append negative seq", lambda m, a, b: m.append([-1], [1]), UnknownSequenceError),
    ("append duplicates", lambda m, a, b: m.append([a, a], [1, 2]), InvalidArgumentError),
    ("append wrong token shape", lambda m, a, b: m.append([a, b], [1]), InvalidArgumentError),
    ("append negative count", lambda m, a, b: m.append([a], None, num_tokens=-2), InvalidArgumentError),
    ("append float seq ids", lambda m, a, b: m.append([0.5], [1]), InvalidArgumentError),
    ("free twice", lambda m, a, b: (m.free(a), m.free(a)), UnknownSequenceError),
    ("free unknown", lambda m, a, b: m.free(42), UnknownSequenceError),
    ("free bool", lambda m, a, b: m.free(True), InvalidArgumentError),
    ("fork unknown", lambda m, a, b: m.fork(42), UnknownSequenceError),
    ("rollback too far", lambda m, a, b: m.rollback(a, 11), InvalidArgumentError),
    ("rollback negative", lambda m, a, b: m.rollback(a, -1), InvalidArgumentError),
    ("mark past tokens", lambda m, a, b: m.mark_computed([b], [8]), InvalidArgumentError),
    ("mark backwards", lambda m, a, b: m.mark_computed([a], [3]), InvalidArgumentError),
    ("unpin twice", lambda m, a, b: m.unpin(PinHandle((1,))), PinError),
    ("unpin junk", lambda m, a, b: m.unpin((1,)), InvalidArgumentError),
    ("slot range past blocks", lambda m, a, b: m.slot_mapping([b], [0], [9]), InvalidArgumentError),
    ("slot range reversed", lambda m, a, b: m.slot_mapping([b], [3], [1]), InvalidArgumentError),
    ("swap in a running seq", lambda m, a, b: m.swap_in(a), InvalidArgumentError),
    ("views of a swapped seq", lambda m, a, b: (m.swap_out(b), m.block_table([b])), InvalidArgumentError),
]


@pytest.mark.parametrize("name,call,error", MISUSE, ids=[c[0] for c in MISUSE])
def test_misuse_raises_typed_error_and_changes_nothing(name: str, call, error) -> None:
    m, a, b = busy_manager()
    if name == "free twice":
        m.free(a)
    if name == "views of a swapped seq":
        m.swap_out(b)
        call = lambda m, a, b: m.block_table([b])  # noqa: E731
    before = m.snapshot()
    with pytest.raises(error) as info:
        call(m, a, b)
    assert str(info.value), "errors must say what is wrong"
    assert m.snapshot() == before, f"{name}: a failed call changed state"
    m.check_invariants()


def test_capacity_shortfall_returns_none_or_false_and_changes_nothing() -> None:
    m, a, b = busy_manager()
    c = m.admit(list(range(100, 116)))  # takes the remaining 4 blocks (5 of 9 used)
    assert c is not None and m.num_free_blocks == 0
    before = m.snapshot()
    assert m.admit(list(range(200, 205))) is None
    assert m.append([a, b, c.seq_id], [1, 2, 3]) is False
    assert not m.can_admit([5, 6, 7])
    assert m.snapshot() == before


def test_tenant_salt_isolates_and_same_salt_shares() -> None:
    m = PagedKVManager(num_blocks=16, block_size=4)
    prompt = list(range(9))
    a = m.admit(prompt, salt=b"tenant-a")
    assert a is not None
    m.mark_computed([a.seq_id])
    b = m.admit(prompt, salt=b"tenant-b")
    assert b is not None and b.num_cached_tokens == 0
    assert not set(m.block_ids(a.seq_id)) & set(m.block_ids(b.seq_id))
    c = m.admit(prompt, salt=b"tenant-a")
    assert c is not None and c.num_cached_tokens == 8
    assert m.block_ids(c.seq_id)[:2] == m.block_ids(a.seq_id)[:2]
    d = m.admit(prompt)  # no salt is a tenant of its own
    assert d is not None and d.num_cached_tokens == 0


@pytest.mark.parametrize("hash_fn", ["sha256", "fast"])
def test_extra_keys_separate_equal_tokens(hash_fn: str) -> None:
    m = PagedKVManager(num_blocks=16, block_size=4, hash_fn=hash_fn)
    prompt = list(range(9))
    a = m.admit(prompt, keys=BlockKeys(extra=b"lora:1"))
    assert a is not None
    m.mark_computed([a.seq_id])
    assert m.match_prefix(prompt, keys=BlockKeys(extra=b"lora:2")) == 0
    assert m.match_prefix(prompt, keys=BlockKeys(extra=b"lora:1")) == 8
    image = BlockKeys(block_extra={1: b"image-hash-1"})
    assert m.match_prefix(prompt, keys=image) == 0  # request extra "lora:1" differs from none: nothing shared
    m2 = PagedKVManager(num_blocks=16, block_size=4, hash_fn=hash_fn)
    e = m2.admit(prompt, keys=BlockKeys(block_extra={1: b"img-A"}))
    assert e is not None
    m2.mark_computed([e.seq_id])
    assert m2.match_prefix(prompt, keys=BlockKeys(block_extra={1: b"img-B"})) == 4  # block 0 shared, 1 not
    assert m2.match_prefix(prompt, keys=BlockKeys(block_extra={1: b"img-A"})) == 8


def test_verify_on_hit_catches_a_forced_collision() -> None:
    def colliding(parent, data, extra):  # every block of a chain gets the same key
        return b"same"

    plain = PagedKVManager(num_blocks=16, block_size=4, hash_fn=colliding)
    checked = PagedKVManager(num_blocks=16, block_size=4, hash_fn=colliding, verify_hits=True)
    for m in (plain, checked):
        a = m.admit([1, 2, 3, 4, 5])
        assert a is not None
        m.mark_computed([a.seq_id])
    assert plain.match_prefix([9, 9, 9, 9, 9]) == 4  # the weak hash serves the wrong KV...
    b = checked.admit([9, 9, 9, 9, 9])
    assert b is not None and b.num_cached_tokens == 0  # ...verification refuses it
    assert checked.stats.verify_failures == 1
    c = checked.admit([1, 2, 3, 4, 7])
    assert c is not None and c.num_cached_tokens == 4


def test_fast_and_sha256_keys_give_the_same_hits() -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 3, size=rng.integers(5, 40)).tolist() for _ in range(60)]
    results = []
    for hash_fn in ("sha256", "fast"):
        m = PagedKVManager(num_blocks=400, block_size=4, hash_fn=hash_fn)
        got = []
        for p in prompts:
            adm = m.admit(p)
            assert adm is not None
            m.mark_computed([adm.seq_id])
            got.append(adm.num_cached_tokens)
        results.append(got)
    assert results[0] == results[1] and sum(results[0]) > 0


def test_contiguous_baseline_reserves_first_fit_and_fragments() -> None:
    m = ContiguousKVManager(num_blocks=11, block_size=4)  # 10 usable blocks: 1..10
    a = m.admit([1] * 4, max_new_tokens=4)  # 2 blocks: 1, 2
    b = m.admit([1] * 8, max_new_tokens=8)  # 4 blocks: 3..6
    c = m.admit([1] * 4, max_new_tokens=4)  # 2 blocks: 7, 8
    assert a and b and c
    assert m.block_ids(b.seq_id) == [3, 4, 5, 6]
    m.free(a.seq_id)
    m.free(c.seq_id)  # holes: [1, 2], [7, 10]: 6 blocks free, largest hole 4
    assert m.num_free_blocks == 6
    assert m.admit([1] * 20, max_new_tokens=0) is None  # 5 blocks fit in total but not contiguously
    d = m.admit([1], max_new_tokens=7)
    assert d is not None and m.block_ids(d.seq_id) == [1, 2]  # first fit
    assert m.append([d.seq_id], [5], num_tokens=1)
    assert not m.append([d.seq_id], None, num_tokens=7)  # past the reservation
    m.check_invariants()
    with pytest.raises(CapacityError):
        m.admit([1] * 41)


def test_both_managers_speak_the_protocol_with_stats_and_swap() -> None:
    """Swapping is in the protocol: the contiguous manager refuses it with a typed error, changing nothing."""
    paged, contiguous = PagedKVManager(num_blocks=10, block_size=4, num_host_blocks=4), ContiguousKVManager(10, 4)
    assert isinstance(paged, KVManager) and isinstance(contiguous, KVManager)
    assert paged.supports_swap and not contiguous.supports_swap
    a = contiguous.admit(list(range(6)), max_new_tokens=2)
    assert a is not None and contiguous.preempt(a.seq_id) == 6
    b = contiguous.admit(list(range(5)))
    assert b is not None
    before = (contiguous.tables.table.tobytes(), contiguous.runs.holes(), contiguous.stats)
    for swap in (contiguous.swap_out, contiguous.swap_in):
        with pytest.raises(NotSupportedError, match="cannot swap"):
            swap(b.seq_id)
    assert (contiguous.tables.table.tobytes(), contiguous.runs.holes(), contiguous.stats) == before
    stats = contiguous.stats
    assert (stats.admissions, stats.preemptions, stats.prompt_tokens, stats.hit_rate) == (2, 1, 11, 0.0)
    assert (stats.blocks_in_use, stats.num_blocks) == (2, 9)


def test_importing_core_loads_no_torch() -> None:
    code = (
        "import sys, pagedkv, pagedkv.core, pagedkv.workloads.traces, pagedkv.bench.allocator, "
        "pagedkv.engine.scheduler; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
