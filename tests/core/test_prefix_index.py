"""The prefix index has one owner: `core/prefix_index.py` alone writes keys and emits events; the pool alone
changes reference counts; the block tables and the one publishing rule alone change the per-row counts.
Checked at run time (every write to those structures, through any alias or view, is
recorded with the module that made it) and on behaviour."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedkv.core import InvariantError, PagedKVManager, hotpath
from pagedkv.core.prefix_index import CacheEvent, PrefixIndex

SRC = Path(__file__).resolve().parents[2] / "src" / "pagedkv"


def _index(record_events: bool = True) -> PrefixIndex:
    return PrefixIndex(8, record_events=record_events, hot=hotpath.PYTHON)


def test_a_key_held_by_another_block_leaves_the_block_private() -> None:
    ix = _index()
    assert ix.insert([b"a", b"b", b"a"], [1, 2, 3]) == [1, 2]
    assert ix.insert([b"c"], [1]) == []  # block 1 holds a key already
    assert ix.lookup(b"a") == 1 and ix.lookup(b"c") is None and len(ix) == 2
    assert ix.keyed.tolist() == [False, True, True, False, False, False, False, False]
    assert ix.take_events() == [CacheEvent("stored", b"a", 1), CacheEvent("stored", b"b", 2)]
    ix.check_invariants()


def test_remove_forget_and_clear_drop_keys_at_once_with_events() -> None:
    ix = _index()
    ix.insert([b"a", b"b", b"c"], [1, 2, 3])
    ix.take_events()
    ix.remove(2)
    ix.remove(4)  # no key: nothing
    ix.forget(np.array([3], dtype=np.int64))
    assert ix.index == {b"a": 1} and ix.key_of[2] is None and ix.key_of[3] is None
    assert ix.take_events() == [CacheEvent("removed", b"b", 2), CacheEvent("removed", b"c", 3)]
    assert ix.clear() == 1 and ix.take_events() == [CacheEvent("cleared", None, None)]
    assert len(ix) == 0 and not ix.keyed.any()
    ix.check_invariants()


def test_check_invariants_catches_a_stale_entry() -> None:
    ix = _index(record_events=False)
    ix.insert([b"a"], [1])
    ix.key_of[1] = None  # what an eviction that forgot the index would leave
    ix.keyed[1] = False
    with pytest.raises(InvariantError, match="stale"):
        ix.check_invariants()


@pytest.mark.parametrize("native", [False, None])
def test_the_manager_publishes_and_evicts_through_its_index(native: bool | None) -> None:
    m = PagedKVManager(num_blocks=5, block_size=2, record_events=True, native=native)
    a = m.admit([1, 2, 3, 4, 5])
    assert a is not None
    m.mark_computed([a.seq_id])
    assert m.index is m.pool.prefix_index and len(m.index) == 2
    m.free(a.seq_id)
    b = m.admit([9, 8, 7, 6, 5, 4, 3])  # takes every block: the cached ones are evicted
    assert b is not None and len(m.index) == 0
    kinds = [e.kind for e in m.take_events()]
    assert kinds == ["stored", "stored", "removed", "removed"]
    m.check_invariants()


# --- who writes, seen at run time: every write to the pool's reference counts and to the index's keys is
# recorded with the module whose code made it, aliases and views included (a grep misses `r = pool.ref; r[i] = 0`)

WRITERS: dict[str, set[str]] = {}
ROOTS: dict[str, np.ndarray] = {}  # the watched arrays' own memory: writes into a copy are no one's concern


def _record(what: str, target: object = None) -> None:
    if target is None or np.may_share_memory(target, ROOTS[what]):
        WRITERS.setdefault(what, set()).add(sys._getframe(2).f_globals["__name__"])


class _WatchedArray(np.ndarray):  # type: ignore[type-arg]
    """A view of an owner's array recording the module of every write into its memory (views share it)."""

    name = ""

    def __array_finalize__(self, obj: object) -> None:
        self.name = getattr(obj, "name", "")

    def __setitem__(self, key: Any, value: Any) -> None:
        _record(self.name, self)
        super().__setitem__(key, value)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        targets = ([inputs[0]] if method == "at" else []) + list(kwargs.get("out") or ())
        for target in targets:
            if isinstance(target, _WatchedArray):
                _record(target.name, target)
        plain = [x.view(np.ndarray) if isinstance(x, _WatchedArray) else x for x in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(x.view(np.ndarray) if isinstance(x, _WatchedArray) else x for x in kwargs["out"])
        return getattr(ufunc, method)(*plain, **kwargs)


class _WatchedList(list):  # type: ignore[type-arg]
    name = ""

    def __setitem__(self, key: Any, value: Any) -> None:
        _record(self.name)
        super().__setitem__(key, value)

    def append(self, value: Any) -> None:
        _record(self.name)
        super().append(value)

    def extend(self, values: Any) -> None:
        _record(self.name)
        super().extend(values)


def _watched_list(items: list[Any], name: str) -> _WatchedList:
    watched = _WatchedList(items)
    watched.name = name
    return watched


class _WatchedDict(dict):  # type: ignore[type-arg]
    def __setitem__(self, key: Any, value: Any) -> None:
        _record("index")
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        _record("index")
        super().__delitem__(key)

    def pop(self, *args: Any) -> Any:
        _record("index")
        return super().pop(*args)


def _watched(array: np.ndarray, name: str) -> _WatchedArray:
    view = array.view(_WatchedArray)
    view.name = name
    ROOTS[name] = array
    return view


def _watch(m: PagedKVManager) -> None:
    """Swap the owners' structures for watched ones holding the same contents (the Python backend reads them)."""
    pool, ix, t = m.pool, m.pool.prefix_index, m.tables
    pool.ref = _watched(pool.ref, "ref")
    ix.keyed = _watched(ix.keyed, "keyed")  # the pool reads the index's own (`BlockPool.keyed` is a view of it)
    ix.key_of = _watched_list(ix.key_of, "key_of")
    ix.events = _watched_list(ix.events, "events")
    ix.index = _WatchedDict(ix.index)
    ix.arrays = hotpath.IndexArrays(ix.index, ix.key_of, ix.keyed)
    for name in ("num_tokens", "num_computed", "num_published", "hashable_tokens"):
        setattr(t, name, _watched(getattr(t, name), name))
    m.prefix.block_tokens = _watched(m.prefix.block_tokens, "block_tokens")


def _workload(m: PagedKVManager) -> None:
    """Admit, share, fork, grow, publish, roll back, pin, free and evict: every verb that moves a block."""
    a = m.admit(list(range(1, 10)))
    assert a is not None
    m.mark_computed([a.seq_id])
    b = m.admit(list(range(1, 8)) + [50, 51])  # shares 3 blocks
    assert b is not None
    m.mark_computed([b.seq_id])
    c = m.fork(a.seq_id)
    assert m.append([c], [[70, 71, 72]], num_tokens=3)
    m.mark_computed([c])
    m.rollback(c, 2)
    handle = m.pin(list(range(1, 5)))
    for seq_id in (a.seq_id, b.seq_id, c):
        m.free(seq_id)
    d = m.admit(list(range(100, 130)))  # needs every free block: the cached ones are evicted
    assert d is not None
    m.unpin(handle)
    m.free(d.seq_id)
    e = m.admit(list(range(200, 208)))
    assert e is not None
    m.mark_computed([e.seq_id], [4])
    assert m.append([e.seq_id], None) and m.swap_out(e.seq_id) is not None and m.swap_in(e.seq_id) is not None
    m.mark_computed([e.seq_id])
    m.free(e.seq_id)
    m.check_invariants()


def test_at_run_time_only_the_pool_writes_reference_counts_and_only_the_index_writes_keys_and_events() -> None:
    WRITERS.clear()
    m = PagedKVManager(num_blocks=20, block_size=3, record_events=True, native=False, num_host_blocks=8)
    _watch(m)
    _workload(m)
    assert m.pool.ref.__class__ is _WatchedArray and m.pool.prefix_index.key_of.__class__ is _WatchedList
    # the pool, and `hotpath.release_refs` that only the pool calls (its release loop in one pass)
    assert "pagedkv.core.pool" in WRITERS["ref"] and WRITERS["ref"] <= {"pagedkv.core.pool", "pagedkv.core.hotpath"}, WRITERS
    index_owners = {"pagedkv.core.prefix_index", "pagedkv.core.hotpath"}
    assert WRITERS["keyed"] and WRITERS["key_of"] and WRITERS["index"], WRITERS  # the workload wrote them all
    assert WRITERS["keyed"] | WRITERS["key_of"] | WRITERS["index"] <= index_owners, WRITERS
    assert WRITERS["events"] == {"pagedkv.core.prefix_index"}, WRITERS


@pytest.mark.parametrize("hash_fn", ["sha256", "custom"])
def test_at_run_time_the_tables_and_the_publishing_rule_alone_write_the_per_row_counts(hash_fn: str) -> None:
    """`num_computed` and `num_published` change only in `table.py` (a row's life: start, copy, truncate,
    move, drop) and in the one publishing rule, `hotpath.Backend.publish_computed` (whatever the key
    function: a custom one keys the blocks afterwards, the counts advance there all the same); the token
    mirror only in the prefix cache and growth's `hotpath.Backend.grow`. Writes through any alias count."""
    WRITERS.clear()
    key_fn = (lambda parent, data, extra: hash((parent, data, extra))) if hash_fn == "custom" else hash_fn
    m = PagedKVManager(num_blocks=20, block_size=3, native=False, num_host_blocks=8, hash_fn=key_fn)
    _watch(m)
    _workload(m)
    assert m.tables.num_published.__class__ is _WatchedArray, "a resize replaced the watched arrays"
    for name in ("num_computed", "num_published"):
        assert WRITERS[name] == {"pagedkv.core.table", "pagedkv.core.hotpath"}, WRITERS
    assert WRITERS["num_tokens"] == {"pagedkv.core.table", "pagedkv.core.hotpath"}, WRITERS
    assert WRITERS["hashable_tokens"] == {"pagedkv.core.table"}, WRITERS
    assert WRITERS["block_tokens"] == {"pagedkv.core.prefix_cache", "pagedkv.core.hotpath"}, WRITERS
