"""The C extension's batch helpers against their specification, `hotpath.PythonBackend`.

`forget_keys` (eviction), `check_rows` (validating sequence handles) and `growth` / `grow` (a decode step's
append) are checked on random states: index/key_of states with live, stale, None and hash-colliding
entries; device masks with invalid, negative, too large and repeated rows; block tables padded with 0,
with lookahead blocks, over every block size. Return values (or error types) and the complete resulting
state are compared with the reference, and `grow` also with a per-row model written out here.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from native_support import REF, SETTINGS, native


def outcome(call: Any, *args: Any) -> Any:
    """What a call returns, or the type of the error it raises."""
    try:
        return call(*args)
    except (IndexError, ValueError, TypeError) as exc:
        return type(exc)


def as_ids(draw: st.DrawFn, values: list[int]) -> Any:
    """The same ids as a C-contiguous int64 array or as a list (both backends take either)."""
    if draw(st.booleans()):
        return np.array(values, dtype=np.int64)
    return list(values)


# ------------------------------------------------------------------------------------------------ forget_keys

RARELY = st.sampled_from([False, False, False, False, True])

# bytes and ints (as the pool's keys), equal keys of different types (1 == 1.0), and -1 / -2 (same hash)
KEYS: list[Any] = [b"k" * 32, b"other", b"", 7, 10**20, -1, -2, 1, 1.0, ("model", 3)]


@st.composite
def forget_cases(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(0, 12))
    key_of: list[Any] = [None] * n
    index: dict[Any, Any] = {}
    block = st.integers(0, n - 1) if n else st.nothing()
    modes = ["live", "stale", "elsewhere", "keyed", "none", "odd"] if n else ["none", "odd"]
    for key, mode in draw(st.lists(st.tuples(st.sampled_from(KEYS), st.sampled_from(modes)), max_size=14)):
        if mode == "live":  # indexed and held by its block
            b = draw(block)
            index[key], key_of[b] = b, key
        elif mode == "stale":  # indexed, but its block holds another key (or none)
            index[key] = draw(block)
            key_of[index[key]] = draw(st.sampled_from([None, *KEYS]))
        elif mode == "elsewhere":  # held by a block, indexed to another block holding it too
            b, other = draw(block), draw(block)
            key_of[b] = key_of[other] = key
            index[key] = other
        elif mode == "keyed":  # held by a private block, not indexed
            key_of[draw(block)] = key
        elif mode == "none":  # an entry whose block id is None
            index[key] = None
        else:  # an entry whose block id is negative or out of range
            index[key] = draw(st.sampled_from([-1, -n - 1, n, n + 5, 2**70]))
    held = [b for b, key in enumerate(key_of) if key is not None]
    values = draw(st.lists(st.sampled_from(held) | block if held else block, max_size=10)) if n else []
    if values and draw(st.booleans()):  # repeats
        values += draw(st.lists(st.sampled_from(values), max_size=4))
        values = draw(st.permutations(values))
    if draw(RARELY):  # an id out of range: IndexError, nothing changes
        bad = draw(st.sampled_from([-1, -2, n, n + 1, 2**40, -(2**63)]))
        values.insert(draw(st.integers(0, len(values))), bad)
    return {"index": index, "key_of": key_of, "ids": as_ids(draw, values)}


def copy_forget(case: dict[str, Any]) -> dict[str, Any]:
    return {"index": dict(case["index"]), "key_of": list(case["key_of"]), "ids": copy.copy(case["ids"])}


def same_dict(a: dict[Any, Any], b: dict[Any, Any]) -> bool:
    """Same items in the same insertion order, the keys and values being the very same objects."""
    return [(id(k), v) for k, v in a.items()] == [(id(k), v) for k, v in b.items()]


def same_list(a: list[Any], b: list[Any]) -> bool:
    return [id(x) for x in a] == [id(x) for x in b]


@SETTINGS
@given(case=forget_cases())
def test_forget_keys_matches_reference(case: dict[str, Any]) -> None:
    ours, before = copy_forget(case), copy_forget(case)
    expected = outcome(REF.forget_keys, (case["index"], case["key_of"], None), case["ids"])
    assert outcome(native.forget_keys, (ours["index"], ours["key_of"], None), ours["ids"]) == expected
    assert expected in (None, IndexError)
    assert same_dict(ours["index"], case["index"]) and same_list(ours["key_of"], case["key_of"])
    if expected is IndexError:  # every id is checked before anything changes
        assert same_dict(ours["index"], before["index"]) and same_list(ours["key_of"], before["key_of"])
    else:  # the blocks hold no key any more, no entry maps a key to a forgotten block holding it
        forgotten = set(np.asarray(case["ids"], dtype=np.int64).tolist())
        assert all(ours["key_of"][b] is None for b in forgotten)
        for b in forgotten:
            key = before["key_of"][b]
            if key is not None and before["index"].get(key) == b:
                assert key not in ours["index"]
        # everything else stays
        for b, key in enumerate(before["key_of"]):
            if b not in forgotten:
                assert ours["key_of"][b] is key


def test_forget_keys_errors_from_hashing_propagate() -> None:
    """A key whose hash fails: both raise it, with the ids before forgotten and the rest untouched."""

    class Unhashable:
        def __hash__(self) -> int:
            raise RuntimeError("no hash")

    for backend in (native, REF):
        bad = Unhashable()
        index: dict[Any, int] = {b"a": 0, b"c": 2}
        key_of: list[Any] = [b"a", bad, b"c"]
        with pytest.raises(RuntimeError, match="no hash"):
            backend.forget_keys((index, key_of, None), [0, 1, 2])
        assert index == {b"c": 2} and key_of[0] is None and key_of[1] is bad and key_of[2] == b"c"


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (([], [None], [0]), TypeError),  # index not a dict
        (({}, (None,), [0]), TypeError),  # key_of not a list
        (({}, [None], np.array([0], dtype=np.int32)), TypeError),
        (({}, [None] * 4, np.array([0, 1, 2, 3], dtype=np.int64)[::2]), TypeError),  # not contiguous
        (({}, [None], [0, "1"]), TypeError),
        (({}, [None], None), TypeError),
    ],
)
def test_forget_keys_type_errors(args: tuple[Any, ...], error: type[Exception]) -> None:
    with pytest.raises(error):
        native.forget_keys((args[0], args[1], None), args[2])


@pytest.mark.parametrize("prefix", [[{0: 0}, [0]], ({0: 0}, [0]), ({0: 0}, [0], None, None), None])
def test_forget_keys_prefix_must_be_a_triple(prefix: Any) -> None:
    """`prefix` is the owner's (index, key_of, keyed) as one tuple: anything else is a TypeError, before
    anything changes, in both backends."""
    for backend in (native, REF):
        index, key_of = {b"a": 0}, [b"a"]
        bad = [index, key_of] if isinstance(prefix, list) else None if prefix is None else (index, key_of, *prefix[2:])
        with pytest.raises(TypeError, match="prefix must be"):
            backend.forget_keys(bad, [0])
        assert index == {b"a": 0} and key_of == [b"a"]


# -------------------------------------------------------------------------------------------- reference counts


def test_forget_keys_releases_the_keys() -> None:
    key = b"a key built at run time: %d" % 12345  # not interned, referenced only here
    held = b"another key: %d" % 678
    block, other = 500, 700  # beyond the small-int cache
    index: dict[Any, int] = {}
    key_of: list[Any] = [None] * 1000
    base_key, base_held = sys.getrefcount(key), sys.getrefcount(held)

    index[key], key_of[block] = block, key  # live: the index entry and key_of both go
    native.forget_keys((index, key_of, None), np.array([block], dtype=np.int64))
    assert index == {} and key_of[block] is None
    assert sys.getrefcount(key) == base_key

    # indexed to another block that holds it too: only key_of[block] lets go
    index[held], key_of[block], key_of[other] = other, held, held
    native.forget_keys((index, key_of, None), [block])
    assert index == {held: other} and key_of[other] is held
    assert sys.getrefcount(held) == base_held + 2
    native.forget_keys((index, key_of, None), [other, other])
    assert index == {} and sys.getrefcount(held) == base_held


def test_forget_keys_reference_counts_are_exact() -> None:
    """Many rounds of index, forget (and fail to forget): no reference gained or lost."""
    keys = [b"key %d" % i for i in range(8)] + [10**6 + i for i in range(8)]
    blocks = [300 + 40 * i for i in range(len(keys))]  # int objects held by the index
    ids = np.array(blocks, dtype=np.int64)
    bad = np.array([*blocks, 1000], dtype=np.int64)
    key_of: list[Any] = [None] * 1000
    index: dict[Any, int] = {}
    watched: list[Any] = [*keys, *blocks, ids, bad, key_of, index]
    before = [sys.getrefcount(x) for x in watched]
    for i in range(2000):
        for j, (key, b) in enumerate(zip(keys, blocks)):
            key_of[b] = key
            if (i + j) % 3:  # some keys indexed, some private, some indexed to another block
                index[key] = b if (i + j) % 3 == 1 else blocks[(j + 1) % len(blocks)]
        with pytest.raises(IndexError):
            native.forget_keys((index, key_of, None), bad)
        native.forget_keys((index, key_of, None), ids if i % 2 else ids.tolist())
        assert all(key_of[b] is None for b in blocks)
        index.clear()
    del key, b
    assert [sys.getrefcount(x) for x in watched] == before


# ------------------------------------------------------------------------------------------------ check_rows

SHARED_MARK = np.zeros(40, dtype=np.int64)  # one scratch for every example: old stamps must never count


def expected_status(on_device: np.ndarray, rows: list[int]) -> int:
    if any(not (0 <= r < len(on_device)) or not on_device[r] for r in rows):
        return 1
    return 2 if len(set(rows)) < len(rows) else 0


@st.composite
def check_cases(draw: st.DrawFn) -> tuple[np.ndarray, list[int]]:
    n = draw(st.integers(0, 32))
    on_device = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    live = np.flatnonzero(on_device).tolist()
    row = st.sampled_from(live) if live and draw(st.integers(0, 3)) else st.integers(0, max(n - 1, 0))
    if draw(st.booleans()):  # distinct rows
        rows = draw(st.lists(row, unique=True, max_size=12))
    else:
        rows = draw(st.lists(row, max_size=12))
    if draw(RARELY):  # rows out of range, negative or far too large
        for _ in range(draw(st.integers(1, 2))):
            bad = draw(st.sampled_from([-1, -n, n, n + 1, 2**40, 2**63 - 1, -(2**63)]))
            rows.insert(draw(st.integers(0, len(rows))), bad)
    if rows and draw(RARELY):  # a repeat (possibly of an invalid row)
        rows.insert(draw(st.integers(0, len(rows))), draw(st.sampled_from(rows)))
    return on_device, rows


@SETTINGS
@given(case=check_cases(), extra=st.integers(0, 3), shared=st.booleans())
def test_check_rows_matches_reference(case: tuple[np.ndarray, list[int]], extra: int, shared: bool) -> None:
    on_device, values = case
    rows = np.array(values, dtype=np.int64)
    status = expected_status(on_device, values)
    mark = SHARED_MARK if shared else np.zeros(len(on_device) + extra, dtype=np.int64)
    device_before, rows_before = on_device.copy(), rows.copy()
    assert native.check_rows(on_device, mark, rows) == status
    assert native.check_rows(on_device, mark, values) == status  # a list of ints does too
    assert np.array_equal(on_device, device_before) and np.array_equal(rows, rows_before)
    ref_mark = np.zeros(len(on_device) + extra, dtype=np.int64)
    assert REF.check_rows(on_device, ref_mark, rows) == status


@pytest.mark.parametrize("rows", [[-1], [-3], [-1, 3], [-4, 0]])
def test_check_rows_reference_rejects_negative_rows(rows: list[int]) -> None:
    on_device = np.array([True, True, False, True])
    assert native.check_rows(on_device, np.zeros(4, dtype=np.int64), np.array(rows, dtype=np.int64)) == 1
    assert REF.check_rows(on_device, np.zeros(4, dtype=np.int64), np.array(rows, dtype=np.int64)) == 1


def test_check_rows_many_calls_on_one_mark() -> None:
    """The same scratch, thousands of calls in a row: stamps of calls before never read as duplicates."""
    rng = np.random.default_rng(7)
    n = 50
    on_device = rng.random(n) < 0.8
    mark = np.zeros(n, dtype=np.int64)
    ref_mark = np.zeros(n, dtype=np.int64)
    live = np.flatnonzero(on_device)
    counts = [0, 0, 0]
    for i in range(5000):
        size = int(rng.integers(0, 12))
        if i % 4 == 0:  # the same distinct rows again and again
            rows = live[:size].copy()
        else:
            rows = rng.choice(live, size=size, replace=bool(i % 3 == 0)).astype(np.int64)
        if i % 7 == 0 and size:
            rows[int(rng.integers(0, size))] = rng.choice([-1, n, int(np.flatnonzero(~on_device)[0])])
        status = expected_status(on_device, rows.tolist())
        counts[status] += 1
        assert native.check_rows(on_device, mark, rows) == status
        assert REF.check_rows(on_device, ref_mark, rows) == status
    assert min(counts) > 100  # every answer came up


def test_check_rows_invalid_wins_over_duplicate() -> None:
    on_device = np.array([True, True, False, True])
    for backend in (native, REF):
        mark = np.zeros(4, dtype=np.int64)
        for rows, status in [
            ([0, 0, 2], 1),  # a duplicate, then a row not on the device
            ([0, 1, 3, 1, 4], 1),  # out of range after the repeat
            ([3, 3, -5], 1),
            ([3, 3, 2**63 - 1], 1),
            ([3, 1, 3], 2),
            ([], 0),
            ([1, 0, 3], 0),
        ]:
            assert backend.check_rows(on_device, mark, np.array(rows, dtype=np.int64)) == status
    rows = np.array([-1, 3, 3], dtype=np.int64)
    for backend in (native, REF):
        assert backend.check_rows(on_device, np.zeros(4, dtype=np.int64), rows) == 1


@given(contents=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=4, max_size=4), rows=st.lists(st.integers(0, 3), max_size=6))
def test_check_rows_mark_with_arbitrary_contents(contents: list[int], rows: list[int]) -> None:
    """The scratch may hold anything (e.g. what the other backend left): the answer does not depend on it."""
    on_device = np.ones(4, dtype=bool)
    status = expected_status(on_device, rows)
    for backend in (native, REF):
        assert backend.check_rows(on_device, np.array(contents, dtype=np.int64), np.array(rows, dtype=np.int64)) == status


@pytest.mark.parametrize(
    ("on_device", "mark"),
    [
        (np.ones(4, dtype=bool), np.zeros(3, dtype=np.int64)),  # mark shorter
        (np.ones(4, dtype=bool), np.zeros(4, dtype=np.int32)),
        (np.ones(4, dtype=bool), np.zeros(4, dtype=np.float64)),
        (np.ones(4, dtype=np.int64), np.zeros(4, dtype=np.int64)),  # 8-byte device flags
        (None, np.zeros(4, dtype=np.int64)),
    ],
)
def test_check_rows_type_errors(on_device: Any, mark: Any) -> None:
    with pytest.raises(TypeError):
        native.check_rows(on_device, mark, np.array([0], dtype=np.int64))


@pytest.mark.parametrize(
    ("on_device", "mark"),
    [
        (np.ones(8, dtype=bool)[::2], np.zeros(4, dtype=np.int64)),  # not contiguous
        (np.ones(4, dtype=bool), np.zeros(8, dtype=np.int64)[::2]),
        (np.ones(4, dtype=bool), bytes(32)),  # read-only
    ],
)
def test_check_rows_rejects_buffers_it_cannot_use(on_device: Any, mark: Any) -> None:
    """Refused, though (unlike the rest of the module) with the buffer protocol's own error."""
    with pytest.raises((TypeError, ValueError, BufferError)):
        native.check_rows(on_device, mark, np.array([0], dtype=np.int64))


@pytest.mark.parametrize(
    "rows", [np.array([0], dtype=np.int32), np.array([[0]], dtype=np.int64), [0.5], None]
)
def test_check_rows_rows_type_errors(rows: Any) -> None:
    with pytest.raises(TypeError):
        native.check_rows(np.ones(4, dtype=bool), np.zeros(4, dtype=np.int64), rows)


# ------------------------------------------------------------------------------------------- growth and grow


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@st.composite
def grow_cases(draw: st.DrawFn) -> dict[str, Any]:
    """A block table state and a batch of distinct rows to grow by k tokens each.

    Every row holds at least ceil(num_tokens / bs) blocks (sometimes lookahead blocks more), the blocks of
    all rows are distinct, and the table is padded with 0 (itself a valid block id). `ids` are fresh
    distinct block ids, exactly as many as growth says; `tokens` is [B, k] int32 or None.
    """
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    k = draw(st.integers(0, 5))
    num_rows = draw(st.integers(1, 8))
    num_tokens = draw(st.lists(st.integers(0, 3 * bs + 3), min_size=num_rows, max_size=num_rows))
    extra = st.integers(0, 0) | st.integers(0, 2)  # lookahead blocks now and then
    num_blocks = [cdiv(t, bs) + draw(extra) for t in num_tokens]
    size = draw(st.sampled_from([num_rows, num_rows, 1, 0]) | st.integers(0, num_rows))
    rows = draw(st.permutations(range(num_rows)))[:size]
    need = {r: max(cdiv(num_tokens[r] + k, bs) - num_blocks[r], 0) for r in rows}
    total = sum(need.values())
    widest = max((num_blocks[r] + need[r] for r in rows), default=0)
    cols = max([widest, *num_blocks, 1]) + draw(st.integers(0, 0) | st.integers(0, 3))
    spare = draw(st.integers(0, 4))
    num_ids = sum(num_blocks) + total + spare
    perm = np.array(draw(st.permutations(range(num_ids))), dtype=np.int64)
    table = np.zeros((num_rows, cols), dtype=np.int32)
    at = 0
    for r in range(num_rows):
        table[r, : num_blocks[r]] = perm[at : at + num_blocks[r]]
        at += num_blocks[r]
    ids = perm[at : at + total].copy()
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    with_tokens = draw(st.sampled_from([True, False]))
    block_tokens = rng.integers(-(2**31), 2**31, size=(num_ids, bs), dtype=np.int32) if with_tokens else None
    tokens = rng.integers(-(2**31), 2**31, size=(len(rows), k), dtype=np.int32) if with_tokens else None
    return {
        "rows": np.array(rows, dtype=np.int64),
        "num_tokens": np.array(num_tokens, dtype=np.int64),
        "num_blocks": np.array(num_blocks, dtype=np.int64),
        "table": table,
        "k": k,
        "block_size": bs,
        "ids": ids if draw(st.booleans()) else ids.tolist(),
        "tokens": tokens,
        "block_tokens": block_tokens,
        "expected_growth": (total, widest),
    }


STATE = ("num_tokens", "num_blocks", "table", "block_tokens")


def call_grow(backend: Any, case: dict[str, Any]) -> Any:
    names = ("rows", "num_tokens", "num_blocks", "table", "k", "block_size", "ids", "tokens", "block_tokens")
    return backend.grow(*(case[name] for name in names))


def assert_same_arrays(a: dict[str, Any], b: dict[str, Any]) -> None:
    for name in STATE:
        if a[name] is None or b[name] is None:
            assert a[name] is None and b[name] is None, name
        else:
            assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name


def model_grow(case: dict[str, Any]) -> dict[str, Any]:
    """Row after row: the row's new blocks are the next ids, its tokens land at their slots."""
    out = copy.deepcopy(case)
    bs, k = case["block_size"], case["k"]
    ids = list(case["ids"])
    p = 0
    for i, r in enumerate(case["rows"].tolist()):
        old, held = int(out["num_tokens"][r]), int(out["num_blocks"][r])
        need = max(cdiv(old + k, bs) - held, 0)
        for j in range(need):
            out["table"][r, held + j] = ids[p]
            p += 1
        out["num_blocks"][r] = held + need
        if case["tokens"] is not None:
            for j in range(k):
                pos = old + j
                block = int(out["table"][r, pos // bs])
                out["block_tokens"][block, pos % bs] = case["tokens"][i, j]
        out["num_tokens"][r] = old + k
    assert p == len(ids)
    return out


@SETTINGS
@given(case=grow_cases())
def test_growth_and_grow_match_reference(case: dict[str, Any]) -> None:
    args = (case["rows"], case["num_tokens"], case["num_blocks"], case["k"], case["block_size"])
    before = copy.deepcopy(case)
    assert native.growth(*args) == REF.growth(*args) == case["expected_growth"]
    assert native.growth(case["rows"].tolist(), *args[1:]) == case["expected_growth"]  # rows as a list
    assert_same_arrays(case, before)  # growth only reads

    ours, theirs = copy.deepcopy(case), copy.deepcopy(case)
    assert call_grow(native, ours) is None
    assert call_grow(REF, theirs) is None
    assert_same_arrays(ours, theirs)
    assert_same_arrays(ours, model_grow(case))
    assert np.array_equal(ours["rows"], case["rows"])
    if case["ids"] is not None and isinstance(case["ids"], np.ndarray):
        assert np.array_equal(ours["ids"], case["ids"])
    if case["tokens"] is not None:
        assert np.array_equal(ours["tokens"], case["tokens"])
    # rows outside the batch are untouched
    others = np.setdiff1d(np.arange(len(case["num_tokens"])), case["rows"])
    for name in ("num_tokens", "num_blocks", "table"):
        assert np.array_equal(ours[name][others], case[name][others])
    # every grown row holds its tokens, and nothing more than it needs beyond its lookahead
    rows = case["rows"]
    assert np.array_equal(ours["num_tokens"][rows], case["num_tokens"][rows] + case["k"])
    assert np.all(ours["num_blocks"][rows] * case["block_size"] >= ours["num_tokens"][rows])
    # growing by the answer again needs what growth says from the new state, in both
    again = (rows, ours["num_tokens"], ours["num_blocks"], case["k"], case["block_size"])
    assert native.growth(*again) == REF.growth(*again)


@SETTINGS
@given(case=grow_cases(), delta=st.sampled_from([-2, -1, 1, 3]))
def test_grow_wrong_number_of_ids(case: dict[str, Any], delta: int) -> None:
    ids = list(case["ids"])
    if delta < 0 and len(ids) >= -delta:
        ids = ids[:delta]
    else:
        ids = ids + [len(case["table"]) * 1000 + i for i in range(abs(delta))]  # ids that would also fit
    case["ids"] = np.array(ids, dtype=np.int64)
    ours, theirs = copy.deepcopy(case), copy.deepcopy(case)
    with pytest.raises(ValueError, match="ids for"):
        call_grow(native, ours)
    assert_same_arrays(ours, case)  # checked before anything changes
    with pytest.raises(ValueError):
        call_grow(REF, theirs)


def small_grow(**changes: Any) -> dict[str, Any]:
    """Rows 0 and 1 (bs 4): row 0 holds 5 tokens in blocks 3 and 7, row 1 holds 4 tokens in block 5.

    Growing both by 3 tokens needs no new block for row 0 and one for row 1 (id 2), 2 columns."""
    case: dict[str, Any] = {
        "rows": np.array([1, 0], dtype=np.int64),
        "num_tokens": np.array([5, 4, 0], dtype=np.int64),
        "num_blocks": np.array([2, 1, 0], dtype=np.int64),
        "table": np.array([[3, 7], [5, 0], [0, 0]], dtype=np.int32),
        "k": 3,
        "block_size": 4,
        "ids": np.array([2], dtype=np.int64),
        "tokens": np.arange(6, dtype=np.int32).reshape(2, 3) + 100,
        "block_tokens": np.zeros((8, 4), dtype=np.int32),
    }
    case.update(changes)
    return case


def test_small_grow_by_hand() -> None:
    for backend in (native, REF):
        case = small_grow()
        assert backend.growth(case["rows"], case["num_tokens"], case["num_blocks"], 3, 4) == (1, 2)
        call_grow(backend, case)
        assert case["table"].tolist() == [[3, 7], [5, 2], [0, 0]]
        assert case["num_tokens"].tolist() == [8, 7, 0] and case["num_blocks"].tolist() == [2, 2, 0]
        mirror = case["block_tokens"]
        assert mirror[7].tolist() == [0, 103, 104, 105]  # row 0: tokens 5, 6, 7
        assert mirror[2].tolist() == [100, 101, 102, 0]  # row 1: tokens 4, 5, 6, in its new block
        assert not mirror[5].any() and not mirror[3].any()
        none = np.array([], dtype=np.int64)
        assert backend.growth(none, case["num_tokens"], case["num_blocks"], 3, 4) == (0, 0)


@pytest.mark.parametrize(
    "changes",
    [
        {"table": np.array([[3, 7], [5, 0], [0, 0]], dtype=np.int32)[:, :1].copy()},  # 1 column: row 0 holds 2
        {"table": np.array([[3], [5], [0]], dtype=np.int32), "num_blocks": np.array([1, 1, 0], dtype=np.int64),
         "num_tokens": np.array([4, 4, 0], dtype=np.int64), "ids": np.array([2, 6], dtype=np.int64)},
        {"rows": np.array([2], dtype=np.int64), "k": 9, "ids": np.array([1, 2, 6], dtype=np.int64),
         "tokens": np.zeros((1, 9), dtype=np.int32)},
    ],
)  # fmt: skip
def test_grow_table_too_narrow(changes: dict[str, Any]) -> None:
    case = small_grow(**changes)
    before = copy.deepcopy(case)
    with pytest.raises(ValueError, match="table columns"):
        call_grow(native, case)
    assert_same_arrays(case, before)


@pytest.mark.parametrize(
    "changes",
    [
        {"tokens": None},
        {"block_tokens": None},
        {"tokens": None, "ids": np.array([], dtype=np.int64)},  # even before the count of ids
    ],
)
def test_grow_tokens_and_block_tokens_together(changes: dict[str, Any]) -> None:
    for backend in (native, REF):
        case = small_grow(**changes)
        before = copy.deepcopy(case)
        with pytest.raises(ValueError, match="together"):
            call_grow(backend, case)
        assert_same_arrays(case, before)


def read_only(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


@pytest.mark.parametrize(
    "changes",
    [
        {"num_tokens": np.array([5, 4, 0], dtype=np.int32)},
        {"num_blocks": np.array([2, 1, 0], dtype=np.int32)},
        {"num_blocks": np.array([2, 1, 0], dtype=np.uint32)},
        {"table": np.array([[3, 7], [5, 0], [0, 0]], dtype=np.float64)},
        {"table": np.array([[3, 7], [5, 0], [0, 0]], dtype=np.float32)},
        {"table": np.array([[3, 7], [5, 0], [0, 0]], dtype=np.int64)},
        {"table": np.array([[3, 5, 0], [7, 0, 0]], dtype=np.int32).T},  # Fortran order
        {"table": np.array([3, 7, 5, 0, 0, 0], dtype=np.int32)},  # 1-D
        {"num_tokens": np.array([5, 0, 4, 0, 0, 0], dtype=np.int64)[::2]},  # not contiguous
        {"num_blocks": np.array([2, 0, 1, 0, 0, 0], dtype=np.int64)[::2]},
        {"num_tokens": read_only(np.array([5, 4, 0], dtype=np.int64))},
        {"num_tokens": [5, 4, 0]},
        {"tokens": np.arange(6, dtype=np.int64).reshape(2, 3)},
        {"tokens": np.arange(12, dtype=np.int32).reshape(2, 6)[:, ::2]},
        {"block_tokens": np.zeros((8, 4), dtype=np.int64)},
        {"block_tokens": np.zeros((4, 8), dtype=np.int32).T},
        {"block_tokens": read_only(np.zeros((8, 4), dtype=np.int32))},
        {"rows": np.array([1, 0], dtype=np.int32)},
        {"rows": np.array([1, 9, 0, 9], dtype=np.int64)[::2]},
        {"ids": np.array([2], dtype=np.int32)},
        {"ids": ["2"]},
        {"k": 3.0},
        {"block_size": "4"},
    ],
)
def test_grow_type_errors(changes: dict[str, Any]) -> None:
    case = small_grow(**changes)
    before = copy.deepcopy(case)
    with pytest.raises(TypeError):
        call_grow(native, case)
    for name in STATE:  # nothing changed (compare as given: some are of the wrong dtype)
        if case[name] is not None:
            assert np.array_equal(np.asarray(case[name]), np.asarray(before[name])), name
    if {"num_tokens", "num_blocks", "rows", "k", "block_size"}.isdisjoint(changes):
        return
    # growth checks the same arguments
    args = (case["rows"], case["num_tokens"], case["num_blocks"], case["k"], case["block_size"])
    if not (isinstance(case["num_tokens"], np.ndarray) and case["num_tokens"].flags.writeable is False):
        with pytest.raises(TypeError):
            native.growth(*args)


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"ids": np.array([8], dtype=np.int64)}, IndexError),  # past block_tokens
        ({"ids": np.array([-1], dtype=np.int64)}, IndexError),
        ({"ids": np.array([2**31], dtype=np.int64), "tokens": None, "block_tokens": None}, IndexError),
        ({"table": np.array([[3, 9], [5, 0], [0, 0]], dtype=np.int32)}, IndexError),  # row 0's block 9 past N
        ({"rows": np.array([1, 3], dtype=np.int64)}, IndexError),
        ({"rows": np.array([-1, 0], dtype=np.int64)}, IndexError),
        ({"tokens": np.zeros((2, 2), dtype=np.int32)}, ValueError),  # [B, k] expected
        ({"tokens": np.zeros((1, 3), dtype=np.int32)}, ValueError),
        ({"block_tokens": np.zeros((8, 2), dtype=np.int32)}, ValueError),  # [N, bs] expected
        ({"k": -1}, ValueError),
        ({"block_size": 0}, ValueError),
    ],
)
def test_grow_checks_before_changing_anything(changes: dict[str, Any], error: type[Exception]) -> None:
    case = small_grow(**changes)
    before = copy.deepcopy(case)
    with pytest.raises(error):
        call_grow(native, case)
    assert_same_arrays(case, before)


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"rows": np.array([1, 3], dtype=np.int64)}, IndexError),
        ({"rows": np.array([-1], dtype=np.int64)}, IndexError),
        ({"k": -1}, ValueError),
        ({"block_size": 0}, ValueError),
        ({"k": None}, TypeError),
    ],
)
def test_growth_errors(changes: dict[str, Any], error: type[Exception]) -> None:
    case = small_grow(**changes)
    with pytest.raises(error):
        native.growth(case["rows"], case["num_tokens"], case["num_blocks"], case["k"], case["block_size"])
