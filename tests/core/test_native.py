"""The C extension `pagedkv.core._native` against its specification, `hotpath.PythonBackend`.

Equivalence is checked on random cache states (stale index entries, blocks already keyed, keys shared by
rows, rows whose keys already reach past their stop, negative block ids), comparing the return values
and the complete resulting index, key_of and key lists. Its SHA-256 is checked against hashlib, both the
portable C and (where the CPU has it) the SHA-NI path.
"""

from __future__ import annotations

import gc
import hashlib
import os
import shutil
import sys
import tracemalloc
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.core.hotpath import FAST, SHA256, PythonBackend

try:
    from pagedkv.core import _native as native
except ImportError as exc:  # a machine with a C compiler must have built it: fail rather than skip
    if os.environ.get("PAGEDKV_NATIVE", "1") != "0" and (shutil.which("cc") or shutil.which("gcc")):
        pytest.fail(
            f"pagedkv.core._native is not built although a C compiler is present: {exc}", pytrace=False
        )
    pytest.skip("pagedkv.core._native is not built (no C compiler, or PAGEDKV_NATIVE=0)", allow_module_level=True)

REF = PythonBackend()
NUM_BLOCKS = 24
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------------------------------------- SHA-256

NIST = [
    (b"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
    (b"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
    (
        b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
    ),
    (
        b"abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrs"
        b"mnopqrstnopqrstu",
        "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1",
    ),
]


@pytest.mark.parametrize("portable", [True, False])
@pytest.mark.parametrize(("message", "digest"), NIST)
def test_sha256_nist_vectors(message: bytes, digest: str, portable: bool) -> None:
    assert native.sha256(message, portable=portable).hex() == digest


@pytest.mark.parametrize("portable", [True, False])
@SETTINGS
@given(data=st.binary(min_size=0, max_size=400))
def test_sha256_matches_hashlib(data: bytes, portable: bool) -> None:
    assert native.sha256(data, portable=portable) == hashlib.sha256(data).digest()


def test_sha256_accepts_buffers_and_sha_ni_flag() -> None:
    tokens = np.arange(48, dtype=np.int32).reshape(3, 16)
    assert native.sha256(tokens) == hashlib.sha256(tokens.tobytes()).digest()
    assert native.sha256(memoryview(b"abc")) == hashlib.sha256(b"abc").digest()
    assert isinstance(native.has_sha_ni(), bool)
    assert native.NAME == "native"
    with pytest.raises(TypeError):
        native.sha256("abc")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        native.sha256(b"abc", True)  # type: ignore[misc]


# ----------------------------------------------------------------------------------------- random states


def chain(kind: int, parent: Any, chunk: bytes) -> Any:
    """The key contract of hotpath's module docstring, written out independently."""
    if kind == SHA256:
        return hashlib.sha256(parent + chunk).digest()
    return hash((parent, chunk, b""))


def block_tokens(content: int, block_size: int) -> np.ndarray:
    return (np.arange(block_size, dtype=np.int64) * 7919 + content * 1_000_003).astype(np.int32)


def keys_of(kind: int, root: Any, contents: list[int], block_size: int) -> list[Any]:
    keys = [root]
    for c in contents:
        keys.append(chain(kind, keys[-1], block_tokens(c, block_size).tobytes()))
    return keys


def as_data(draw: st.DrawFn, tokens: np.ndarray) -> Any:
    """The same bytes as a 2-D int32 array (what prefix_cache passes), bytes or a memoryview."""
    form = draw(st.sampled_from(["array", "bytes", "memoryview"]))
    if form == "array":
        return np.ascontiguousarray(tokens)
    return tokens.tobytes() if form == "bytes" else memoryview(tokens.tobytes())


@st.composite
def cache_states(
    draw: st.DrawFn, rows: list[tuple[list[int], int]], cached: list[Any] | None = None
) -> tuple[dict[Any, int], list[Any]]:  # fmt: skip
    """Index and key_of with live, stale and private entries, on keys of the given rows and junk keys.

    The keys `cached` are indexed first, live (unless the random entries drawn next disturb them).
    """
    kind, root, block_size = draw(st.shared(kinds(), key="kind"))
    candidates: list[Any] = [b"junk" * 8 if kind == SHA256 else 987654321]
    for contents, _ in rows:
        candidates.extend(keys_of(kind, root, contents, block_size)[1:])
    index: dict[Any, int] = {}
    key_of: list[Any] = [None] * NUM_BLOCKS
    blocks = draw(st.permutations(range(NUM_BLOCKS)))
    for key, b in zip(cached or [], blocks):
        if key not in index:
            index[key], key_of[b] = b, key
    block = st.integers(-2, NUM_BLOCKS - 1)
    entries = st.tuples(
        st.sampled_from(candidates), block, st.sampled_from(["live", "stale", "keyed", "none"])
    )
    for key, b, mode in draw(st.lists(entries, max_size=12)):
        if mode == "live":  # indexed and held
            index[key], key_of[b] = b, key
        elif mode == "stale":  # indexed, but the block now holds another key (or none)
            index[key], key_of[b] = b, draw(st.sampled_from([None, candidates[0]]))
        elif mode == "keyed":  # a private block holding the key, not indexed
            key_of[b] = key
        else:  # an index entry whose block id is None
            index[key] = None  # type: ignore[assignment]
    return index, key_of


@st.composite
def kinds(draw: st.DrawFn) -> tuple[int, Any, int]:
    """(kind, root key, block size): roots of unusual lengths or types included."""
    kind = draw(st.sampled_from([SHA256, FAST]))
    if kind == SHA256:
        root = draw(st.sampled_from([hashlib.sha256(b"root").digest(), b"", b"r" * 61]))
    else:
        root = draw(st.sampled_from([0, hash("root"), b"root", ("model", 3)]))
    return kind, root, draw(st.sampled_from([1, 2, 16]))


def row_contents() -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, 3), max_size=7)  # four block contents: rows share keys


@st.composite
def publish_cases(draw: st.DrawFn) -> dict[str, Any]:
    kind, root, block_size = draw(st.shared(kinds(), key="kind"))
    rows: list[tuple[list[int], int]] = []
    key_lists, starts, stops, ids, tokens = [], [], [], [], []
    for _ in range(draw(st.integers(0, 4) | st.just(3))):
        contents = draw(row_contents())
        if rows and draw(st.booleans()):  # continue another row's prefix
            contents = rows[-1][0][: draw(st.integers(0, len(rows[-1][0])))] + contents
        start = draw(st.integers(0, len(contents)))
        stop = draw(st.just(len(contents)) | st.integers(start, len(contents)))
        have = draw(st.integers(start, len(contents)))  # may reach past stop
        rows.append((contents, have))
        key_lists.append(keys_of(kind, root, contents, block_size)[: have + 1])
        starts.append(start)
        stops.append(stop)
        ids.extend(
            draw(st.lists(st.integers(-2, NUM_BLOCKS - 1), min_size=stop - start, max_size=stop - start))
        )
        tokens.extend(block_tokens(c, block_size) for c in contents[start:stop])
    index, key_of = draw(cache_states(rows))
    data = np.array(tokens, dtype=np.int32).reshape(len(tokens), block_size)
    return {
        "kind": kind,
        "index": index,
        "key_of": key_of,
        "key_lists": key_lists,
        "starts": np.array(starts, dtype=np.int64),
        "stops": np.array(stops, dtype=np.int64),
        "data": as_data(draw, data),
        "width": 4 * block_size,
        "ids": np.array(ids, dtype=np.int64),
    }


@st.composite
def match_cases(draw: st.DrawFn) -> dict[str, Any]:
    kind, root, block_size = draw(st.shared(kinds(), key="kind"))
    contents = draw(row_contents().filter(bool))
    others = draw(st.lists(row_contents(), max_size=2))
    cached = keys_of(kind, root, contents, block_size)[1 : draw(st.integers(0, len(contents))) + 1]
    index, key_of = draw(cache_states([(contents, 0)] + [(c, 0) for c in others], cached))
    tokens = np.array([block_tokens(c, block_size) for c in contents], dtype=np.int32).reshape(-1, block_size)
    return {
        "kind": kind,
        "index": index,
        "key_of": key_of,
        "known": keys_of(kind, root, contents, block_size)[: draw(st.integers(1, len(contents) + 1))],
        "data": as_data(draw, tokens),
        "width": 4 * block_size,
        "max_blocks": draw(st.just(len(contents)) | st.integers(-1, len(contents))),
    }


def copy_case(case: dict[str, Any]) -> dict[str, Any]:
    """An independent copy of the mutable state (keys themselves are immutable)."""
    out = dict(case, index=dict(case["index"]), key_of=list(case["key_of"]))
    if "known" in case:
        out["known"] = list(case["known"])
    else:
        out["key_lists"] = [list(k) for k in case["key_lists"]]
    return out


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert list(a["index"].items()) == list(b["index"].items())  # insertion order too
    assert a["key_of"] == b["key_of"]
    assert a.get("known") == b.get("known")
    assert a.get("key_lists") == b.get("key_lists")


# ---------------------------------------------------------------------------------------------- equivalence


@SETTINGS
@given(case=publish_cases())
def test_publish_rows_matches_reference(case: dict[str, Any]) -> None:
    ours = copy_case(case)
    expected = REF.publish_rows(**case)
    assert native.publish_rows(**ours) == expected
    assert_same_state(ours, case)
    again = copy_case(ours)  # publishing the same blocks again stores nothing new, in both
    assert native.publish_rows(**again) == REF.publish_rows(**ours) == []
    assert_same_state(again, ours)


@SETTINGS
@given(case=match_cases())
def test_match_matches_reference(case: dict[str, Any]) -> None:
    ours = copy_case(case)
    before = copy_case(case)
    expected = REF.match(**case)
    assert native.match(**ours) == expected
    assert_same_state(ours, case)
    assert list(ours["index"].items()) == list(before["index"].items())
    assert ours["key_of"] == before["key_of"]


def test_publish_then_match_a_prompt() -> None:
    """A prompt published by the extension is found by it (and by the reference)."""
    for kind, root in [(SHA256, hashlib.sha256(b"r").digest()), (FAST, 0)]:
        tokens = np.arange(37 * 16, dtype=np.int32).reshape(37, 16)
        index: dict[Any, int] = {}
        key_of: list[Any] = [None] * 64
        keys = [root]
        ids = np.arange(10, 47, dtype=np.int64)
        stored = native.publish_rows(kind, index, key_of, [keys], [0], [37], tokens, 64, ids)
        assert stored == ids.tolist() and len(keys) == 38 and len(index) == 37
        for backend in (native, REF):
            assert backend.match(kind, index, key_of, [root], tokens, 64, 37) == stored


def test_positional_lists_and_keywords() -> None:
    """Lists of ints stand for the int64 arrays; arguments may be passed by keyword."""
    root = hashlib.sha256(b"r").digest()
    data = np.arange(32, dtype=np.int32)
    key_of: list[Any] = [None] * 4
    index: dict[Any, int] = {}
    stored = native.publish_rows(
        kind=SHA256, index=index, key_of=key_of, key_lists=[[root]], starts=[0], stops=[2], data=data,
        width=64, ids=(3, 1),
    )  # fmt: skip
    assert stored == [3, 1]
    assert native.match(SHA256, index, key_of, [root], data, width=64, max_blocks=2) == [3, 1]
    with pytest.raises(TypeError, match="unexpected keyword"):
        native.match(SHA256, index, key_of, [root], data, 64, max_block=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="missing required argument 'max_blocks'"):
        native.match(SHA256, index, key_of, [root], data, 64)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="multiple values"):
        native.match(SHA256, index, key_of, [root], data, 64, 2, width=64)  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------- errors


def small_publish(**changes: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "kind": SHA256,
        "index": {},
        "key_of": [None] * 4,
        "key_lists": [[hashlib.sha256(b"r").digest()]],
        "starts": np.array([0], dtype=np.int64),
        "stops": np.array([2], dtype=np.int64),
        "data": np.arange(8, dtype=np.int32),
        "width": 16,
        "ids": np.array([0, 1], dtype=np.int64),
    }
    args.update(changes)
    return args


def small_match(**changes: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "kind": FAST,
        "index": {},
        "key_of": [None] * 4,
        "known": [0],
        "data": np.arange(8, dtype=np.int32),
        "width": 16,
        "max_blocks": 2,
    }
    args.update(changes)
    return args


class DictSubclass(dict[Any, int]):
    pass


@pytest.mark.parametrize(
    "changes",
    [
        {"kind": "0"},
        {"index": DictSubclass()},
        {"index": []},
        {"key_of": (None,) * 4},
        {"key_lists": [(hashlib.sha256(b"r").digest(),)]},
        {"key_lists": 3},
        {"starts": np.array([0], dtype=np.int32)},
        {"starts": np.array([0.0])},
        {"starts": np.array([[0]], dtype=np.int64)},
        {"stops": np.array([2, 0, 2, 0], dtype=np.int64)[::2]},  # not contiguous
        {"ids": [0, "1"]},
        {"ids": None},
        {"data": 12},
        {"data": np.arange(16, dtype=np.int32)[::2]},
        {"width": 16.0},
        {"key_lists": [[12]]},  # a SHA256 key must chain from bytes
    ],
)
def test_publish_rows_type_errors(changes: dict[str, Any]) -> None:
    with pytest.raises(TypeError):
        native.publish_rows(**small_publish(**changes))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"kind": 2}, "kind must be"),
        ({"width": -4}, "width must be"),
        ({"data": np.arange(7, dtype=np.int32)}, "data .* ends before block 1"),
        ({"starts": np.array([0, 0], dtype=np.int64)}, "starts"),
        ({"stops": np.array([], dtype=np.int64)}, "stops"),
        ({"starts": np.array([-1], dtype=np.int64)}, "row 0 has blocks"),
        (
            {"starts": np.array([2], dtype=np.int64), "stops": np.array([1], dtype=np.int64)},
            "row 0 has blocks",
        ),
        ({"ids": np.array([0], dtype=np.int64)}, "ids holds 1"),
        ({"starts": np.array([1], dtype=np.int64)}, "keys end before its first block"),
    ],
)
def test_publish_rows_value_errors(changes: dict[str, Any], message: str) -> None:
    args = small_publish(**changes)
    with pytest.raises(ValueError, match=message):
        native.publish_rows(**args)
    if changes.keys() != {"data"}:  # checked before anything changes
        assert args["index"] == {} and args["key_of"] == [None] * 4
        assert all(len(k) == 1 for k in args["key_lists"])


def test_publish_rows_reference_error_on_short_keys_too() -> None:
    args = small_publish(starts=np.array([1], dtype=np.int64))
    with pytest.raises(ValueError, match="keys end before its first block"):
        REF.publish_rows(**args)


@pytest.mark.parametrize("bad", [4, -5, 2**62])
def test_publish_rows_index_error(bad: int) -> None:
    args = small_publish(ids=np.array([0, bad], dtype=np.int64))
    with pytest.raises(IndexError, match="out of range of key_of"):
        native.publish_rows(**args)
    # block 0 was published before block `bad` failed, as in the reference (documented partial state)
    assert list(args["index"].values()) == [0] and args["key_of"][0] is not None


@pytest.mark.parametrize(
    "changes",
    [
        {"kind": None},
        {"index": DictSubclass()},
        {"key_of": None},
        {"known": (0,)},
        {"data": "tokens"},
        {"max_blocks": 2.0},
        {"kind": SHA256},  # a SHA256 key must chain from bytes (the root here is an int)
    ],
)
def test_match_type_errors(changes: dict[str, Any]) -> None:
    with pytest.raises(TypeError):
        native.match(**small_match(**changes))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"kind": -1}, "kind must be"),
        ({"width": -1}, "width must be"),
        ({"known": []}, "root key"),
        ({"data": b"\0" * 15}, "ends before block 0"),
    ],
)
def test_match_value_errors(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        native.match(**small_match(**changes))


def test_match_index_error_for_a_block_id_out_of_range() -> None:
    args = small_match()
    key = chain(FAST, 0, np.arange(4, dtype=np.int32).tobytes())
    args["index"][key] = 9
    with pytest.raises(IndexError, match="out of range of key_of"):
        native.match(**args)
    args["index"][key] = -1  # a negative id counts from the end, as in the reference
    args["key_of"][-1] = key
    assert (
        native.match(**args)
        == REF.match(**small_match(index=dict(args["index"]), key_of=args["key_of"]))
        == [-1]
    )


def test_errors_from_key_comparison_propagate() -> None:
    class Unequal:
        def __ne__(self, other: object) -> bool:
            raise RuntimeError("no comparison")

    args = small_match()
    key = chain(FAST, 0, np.arange(4, dtype=np.int32).tobytes())
    args["index"][key] = 1
    args["key_of"][1] = Unequal()
    with pytest.raises(RuntimeError, match="no comparison"):
        native.match(**args)


# ------------------------------------------------------------------------------------- reference counts


def test_reference_counts_are_exact() -> None:
    # block ids and the FAST root beyond the small-int cache, whose reference counts move all the time
    for kind, root in [(SHA256, hashlib.sha256(b"root").digest()), (FAST, 10**6 + 7)]:
        tokens = np.arange(5 * 4, dtype=np.int32).reshape(5, 4)
        keys = keys_of(kind, root, [], 4)
        index: dict[Any, int] = {}
        key_of: list[Any] = [None] * 1000
        ids = np.arange(500, 505, dtype=np.int64)
        starts, stops = np.array([0], dtype=np.int64), np.array([5], dtype=np.int64)
        native.publish_rows(kind, index, key_of, [keys], starts, stops, tokens, 16, ids)
        watched: list[Any] = [root, index, key_of, keys, tokens, ids, starts, stops, *keys, *index.values()]
        before = [sys.getrefcount(x) for x in watched]
        for _ in range(2000):
            native.publish_rows(kind, index, key_of, [keys], starts, stops, tokens, 16, ids)
            assert native.match(kind, index, key_of, keys, tokens, 16, 5) == ids.tolist()
            known = [root]
            native.match(kind, index, key_of, known, tokens, 16, 5)
            with pytest.raises(IndexError):
                native.publish_rows(kind, index, key_of, [[root]], starts, stops, tokens, 16, ids + 1000)
        del known
        assert [sys.getrefcount(x) for x in watched] == before


def test_memory_stays_flat() -> None:
    """Fresh states published and matched over and over: no allocation outlives its call."""
    tokens = np.arange(8 * 16, dtype=np.int32).reshape(8, 16)
    ids = np.arange(8, dtype=np.int64)
    starts, stops = np.array([0, 0], dtype=np.int64), np.array([3, 5], dtype=np.int64)
    roots = {SHA256: hashlib.sha256(b"root").digest(), FAST: 7}

    def rounds(n: int) -> None:
        for i in range(n):
            kind = i & 1
            index: dict[Any, int] = {}
            key_of: list[Any] = [None] * 8
            native.publish_rows(
                kind, index, key_of, [[roots[kind]], [roots[kind]]], starts, stops, tokens, 64, ids
            )
            native.match(kind, index, key_of, [roots[kind]], tokens, 64, 8)
            native.sha256(tokens)

    rounds(200)
    gc.collect()
    tracemalloc.start()
    try:
        rounds(200)
        gc.collect()
        start = tracemalloc.get_traced_memory()[0]
        rounds(20_000)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, grown
