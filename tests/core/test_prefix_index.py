"""The prefix index has one owner: `core/prefix_index.py` alone writes keys and emits events; the pool alone
changes reference counts. Checked on the source (so a new writer elsewhere fails here) and on behaviour."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from pagedkv.core import InvariantError, PagedKVManager, hotpath
from pagedkv.core.prefix_index import CacheEvent, PrefixIndex

SRC = Path(__file__).resolve().parents[2] / "src" / "pagedkv"


def _sources() -> dict[str, str]:
    return {str(p.relative_to(SRC)): p.read_text() for p in SRC.rglob("*.py")}


def test_only_the_prefix_index_and_its_backend_touch_keys() -> None:
    touching = {name for name, text in _sources().items() if re.search(r"\bkey_of\b|\.keyed\[[^\]]*\]\s*=", text)}
    assert touching <= {"core/prefix_index.py", "core/hotpath.py"}, touching
    emitting = {name for name, text in _sources().items() if re.search(r"\bCacheEvent\(\s*\"", text)}
    assert emitting == {"core/prefix_index.py"}, emitting


def test_only_the_pool_changes_reference_counts() -> None:
    writes = re.compile(r"\bref\[[^\]]*\]\s*[-+]?=(?!=)|subtract\.at\(\s*[\w.]*ref\b|add\.at\(\s*[\w.]*ref\b")
    writers = {name for name, text in _sources().items() if writes.search(text)}
    assert writers == {"core/pool.py"}, writers


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
