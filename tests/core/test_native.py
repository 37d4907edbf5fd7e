"""The C extension `pagedkv.core._native` against its specification, `hotpath.PythonBackend`.

Equivalence is checked on random cache states (indexed and private entries, no stale one, blocks already keyed, keys shared by
rows, rows whose keys already reach past their stop, negative block ids in the index, repeated ids, block
ids out of range of key_of or of a short block store), comparing the return values or errors and the
complete resulting index, key_of, keyed flags and key lists. Its SHA-256 is checked against hashlib, both the
portable C and (where the CPU has it) the SHA-NI path.
"""

from __future__ import annotations

import gc
import hashlib
import os
import subprocess
import sys
import tracemalloc
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from native_support import REF, SETTINGS, chain, content_tokens, native, prefixed

from pagedkv.core.hotpath import FAST, SHA256

NUM_BLOCKS = 24


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


def keys_of(kind: int, root: Any, contents: list[int], block_size: int) -> list[Any]:
    keys = [root]
    for c in contents:
        keys.append(chain(kind, keys[-1], content_tokens(c, block_size).tobytes()))
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
    """Index and key_of with indexed and private entries, on keys of the given rows and junk keys.

    The keys `cached` are indexed first (unless the random entries drawn next disturb them). The prefix
    index keeps no stale entry and the backends rely on it: entries the random draws leave stale (their
    block holds another key, or none) are dropped at the end.
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
    entries = st.tuples(st.sampled_from(candidates), block, st.sampled_from(["indexed", "keyed"]))
    for key, b, mode in draw(st.lists(entries, max_size=12)):
        if mode == "indexed":  # indexed and held
            index[key], key_of[b] = b, key
        else:  # a private block holding the key, not indexed
            key_of[b] = key
    return {key: b for key, b in index.items() if key_of[b] == key}, key_of


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
    """A batch of rows over a block store of NUM_BLOCKS blocks (or a few fewer: a short store).

    The rows' block ids are distinct (mostly: one may repeat, or be out of range of key_of), and each
    published block's bytes in the store are its row's content, so that keys the rows share collide.
    """
    kind, root, block_size = draw(st.shared(kinds(), key="kind"))
    rows: list[tuple[list[int], int]] = []
    key_lists, starts, stops = [], [], []
    spans: list[list[int]] = []  # the contents of each row's blocks to publish
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
        spans.append(contents[start:stop])
    total = sum(len(span) for span in spans)
    ids: list[int] = list(draw(st.permutations(range(NUM_BLOCKS))))[:total]
    while len(ids) < total:  # more blocks than the store: ids repeat
        ids.append(draw(st.integers(0, NUM_BLOCKS - 1)))
    if ids and draw(st.integers(0, 9)) == 0:  # a repeated id
        ids[draw(st.integers(0, total - 1))] = draw(st.sampled_from(ids))
    store = np.stack([content_tokens(100 + b, block_size) for b in range(NUM_BLOCKS)])
    for b, content in zip(ids, [c for span in spans for c in span]):
        store[b] = content_tokens(content, block_size)
    store = store[: draw(st.just(NUM_BLOCKS) | st.integers(NUM_BLOCKS - 4, NUM_BLOCKS))]
    if ids and draw(st.integers(0, 9)) == 0:  # an id out of range of key_of
        ids[draw(st.integers(0, total - 1))] = draw(st.sampled_from([-1, -2, NUM_BLOCKS, 2**40]))
    index, key_of = draw(cache_states(rows))
    flags = np.array(draw(st.lists(st.booleans(), min_size=NUM_BLOCKS + 3, max_size=NUM_BLOCKS + 3)))
    keyed = draw(  # None, or flags already set on some blocks (as many as key_of or more; numpy or not)
        st.sampled_from([None, flags[:NUM_BLOCKS].copy(), flags, bytearray(flags.astype(np.uint8).tobytes())])
    )
    return {
        "kind": kind,
        "index": index,
        "key_of": key_of,
        "key_lists": key_lists,
        "starts": np.array(starts, dtype=np.int64),
        "stops": np.array(stops, dtype=np.int64),
        "blocks": as_data(draw, store),
        "width": 4 * block_size,
        "ids": np.array(ids, dtype=np.int64),
        "keyed": keyed,
    }


@st.composite
def match_cases(draw: st.DrawFn) -> dict[str, Any]:
    kind, root, block_size = draw(st.shared(kinds(), key="kind"))
    contents = draw(row_contents().filter(bool))
    others = draw(st.lists(row_contents(), max_size=2))
    cached = keys_of(kind, root, contents, block_size)[1 : draw(st.integers(0, len(contents))) + 1]
    index, key_of = draw(cache_states([(contents, 0)] + [(c, 0) for c in others], cached))
    tokens = np.array([content_tokens(c, block_size) for c in contents], dtype=np.int32).reshape(-1, block_size)
    return {
        "kind": kind,
        "index": index,
        "known": keys_of(kind, root, contents, block_size)[: draw(st.integers(1, len(contents) + 1))],
        "data": as_data(draw, tokens),
        "width": 4 * block_size,
        "max_blocks": draw(st.just(len(contents)) | st.integers(-1, len(contents))),
    }


def copy_case(case: dict[str, Any]) -> dict[str, Any]:
    """An independent copy of the mutable state (keys themselves are immutable)."""
    out = dict(case, index=dict(case["index"]))
    if "key_of" in case:
        out["key_of"] = list(case["key_of"])
    if "known" in case:
        out["known"] = list(case["known"])
    else:
        out["key_lists"] = [list(k) for k in case["key_lists"]]
    if case.get("keyed") is not None:
        out["keyed"] = case["keyed"].copy()
    return out


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert list(a["index"].items()) == list(b["index"].items())  # insertion order too
    assert a.get("key_of") == b.get("key_of")
    assert a.get("known") == b.get("known")
    assert a.get("key_lists") == b.get("key_lists")
    if a.get("keyed") is not None or b.get("keyed") is not None:
        assert bytes(a["keyed"]) == bytes(b["keyed"])


def outcome(call: Any, case: dict[str, Any]) -> Any:
    """What a call returns, or the type of the error it raises."""
    try:
        return call(**case)
    except (IndexError, ValueError) as exc:
        return type(exc)


# ---------------------------------------------------------------------------------------------- equivalence


@SETTINGS
@given(case=publish_cases())
def test_publish_rows_matches_reference(case: dict[str, Any]) -> None:
    ours = copy_case(case)
    before = copy_case(case)
    expected = outcome(REF.publish_rows, prefixed(case))
    assert outcome(native.publish_rows, prefixed(ours)) == expected
    assert_same_state(ours, case)
    if expected is IndexError:  # an id out of range of key_of: checked before anything changes
        assert_same_state(ours, before)
    if isinstance(expected, list):
        if case["keyed"] is not None:  # exactly the stored blocks were flagged (on top of the flags before)
            flagged = np.frombuffer(bytes(case["keyed"]), dtype=np.uint8).astype(bool)
            was = np.frombuffer(bytes(before["keyed"]), dtype=np.uint8).astype(bool)
            assert np.array_equal(flagged[: len(was)], was | np.isin(np.arange(len(was)), expected))
        again = copy_case(ours)  # publishing the same blocks again stores nothing new, in both
        assert native.publish_rows(**prefixed(again)) == REF.publish_rows(**prefixed(ours)) == []
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


def test_publish_then_match_a_prompt() -> None:
    """A prompt published by the extension is found by it (and by the reference)."""
    for kind, root in [(SHA256, hashlib.sha256(b"r").digest()), (FAST, 0)]:
        tokens = np.arange(37 * 16, dtype=np.int32).reshape(37, 16)
        store = np.zeros((64, 16), dtype=np.int32)  # the whole block store, the prompt's blocks scattered
        ids = np.random.default_rng(kind).permutation(64)[:37].astype(np.int64)
        store[ids] = tokens
        index: dict[Any, int] = {}
        key_of: list[Any] = [None] * 64
        keyed = np.zeros(64, dtype=bool)
        keys = [root]
        stored = native.publish_rows(kind, (index, key_of, keyed), [keys], [0], [37], store, 64, ids)
        assert stored == ids.tolist() and len(keys) == 38 and len(index) == 37
        assert np.flatnonzero(keyed).tolist() == sorted(stored)
        for backend in (native, REF):
            assert backend.match(kind, index, [root], tokens, 64, 37) == stored


def test_positional_lists_and_keywords() -> None:
    """Lists of ints stand for the int64 arrays; arguments may be passed by keyword."""
    root = hashlib.sha256(b"r").digest()
    store = np.arange(64, dtype=np.int32).reshape(4, 16)
    data = store[[3, 1]]
    key_of: list[Any] = [None] * 4
    index: dict[Any, int] = {}
    keyed = np.zeros(4, dtype=bool)
    stored = native.publish_rows(
        kind=SHA256, prefix=(index, key_of, keyed), key_lists=[[root]], starts=[0], stops=[2], blocks=store,
        width=64, ids=(3, 1),
    )  # fmt: skip
    assert stored == [3, 1] and keyed.tolist() == [False, True, False, True]
    assert native.match(SHA256, index, [root], data, width=64, max_blocks=2) == [3, 1]
    keyed[:] = False  # keyed by position too, and None means none
    for flags in (keyed, None):
        stored = native.publish_rows(SHA256, ({}, [None] * 4, flags), [[root]], [0], [2], store, 64, [3, 1])
        assert stored == [3, 1]
    assert keyed.tolist() == [False, True, False, True]
    args: tuple[Any, ...] = (SHA256, ({}, [None] * 4, None), [[root]], [0], [2])
    with pytest.raises(TypeError, match="unexpected keyword"):  # `data` is now `blocks`
        native.publish_rows(*args, width=64, ids=[3, 1], data=store)  # type: ignore[call-arg, misc]
    with pytest.raises(TypeError, match="takes 8 positional arguments"):
        native.publish_rows(*args, store, 64, [3, 1], None)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected keyword"):
        native.match(SHA256, index, [root], data, 64, max_block=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="missing required argument 'max_blocks'"):
        native.match(SHA256, index, [root], data, 64)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="multiple values"):
        native.match(SHA256, index, [root], data, 64, 2, width=64)  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------- errors


def small_publish(**changes: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "kind": SHA256,
        "index": {},
        "key_of": [None] * 4,
        "key_lists": [[hashlib.sha256(b"r").digest()]],
        "starts": np.array([0], dtype=np.int64),
        "stops": np.array([2], dtype=np.int64),
        "blocks": np.arange(16, dtype=np.int32),
        "width": 16,
        "ids": np.array([2, 1], dtype=np.int64),
        "keyed": np.zeros(4, dtype=bool),
    }
    args.update(changes)
    return args


def small_match(**changes: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "kind": FAST,
        "index": {},
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
        {"blocks": 12},
        {"blocks": np.arange(32, dtype=np.int32)[::2]},
        {"width": 16.0},
        {"key_lists": [[12]]},  # a SHA256 key must chain from bytes
    ],
)
def test_publish_rows_type_errors(changes: dict[str, Any]) -> None:
    with pytest.raises(TypeError):
        native.publish_rows(**prefixed(small_publish(**changes)))


@pytest.mark.parametrize("shape", ["list", "pair", "quad", "none"])
def test_publish_rows_prefix_must_be_a_triple(shape: str) -> None:
    """`prefix` is the owner's (index, key_of, keyed) as one tuple: anything else is a TypeError, before
    anything changes, in both backends."""
    for backend in (native, REF):
        args = prefixed(small_publish())
        index, key_of, keyed = args["prefix"]
        args["prefix"] = {
            "list": [index, key_of, keyed], "pair": (index, key_of), "quad": (index, key_of, keyed, None), "none": None
        }[shape]  # fmt: skip
        with pytest.raises(TypeError, match="prefix must be"):
            backend.publish_rows(**args)
        assert index == {} and key_of == [None] * 4 and not keyed.any() and len(args["key_lists"][0]) == 1


def read_only(flags: np.ndarray) -> np.ndarray:
    flags.setflags(write=False)
    return flags


@pytest.mark.parametrize(
    "keyed",
    [
        3,
        "keyed",
        bytes(4),  # read-only
        read_only(np.zeros(4, dtype=bool)),
        np.zeros(4, dtype=np.int32),  # 4-byte items
        np.zeros(8, dtype=bool)[::2],  # not contiguous
        np.zeros((2, 2), dtype=bool),  # 2-D
    ],
)
def test_publish_rows_keyed_type_errors(keyed: Any) -> None:
    for backend in (native, REF):
        args = small_publish(keyed=keyed)
        with pytest.raises(TypeError):
            backend.publish_rows(**prefixed(args))
        assert (
            args["index"] == {}
            and args["key_of"] == [None] * 4
            and args["key_lists"][0] == args["key_lists"][0][:1]
        )


def test_publish_rows_keyed_too_short() -> None:
    for backend in (native, REF):
        args = small_publish(keyed=np.zeros(3, dtype=bool))
        with pytest.raises(ValueError, match="keyed .*shorter than key_of"):
            backend.publish_rows(**prefixed(args))
        assert args["index"] == {} and args["key_of"] == [None] * 4 and len(args["key_lists"][0]) == 1


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"kind": 2}, "kind must be"),
        ({"width": -4}, "width must be"),
        ({"blocks": np.arange(11, dtype=np.int32)}, r"blocks \(44 bytes\) ends before block id 2"),
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
        native.publish_rows(**prefixed(args))
    assert args["index"] == {} and args["key_of"] == [None] * 4 and not args["keyed"].any()
    if changes.keys() != {"blocks"}:  # checked before anything changes
        assert all(len(k) == 1 for k in args["key_lists"])


def test_publish_rows_reference_value_errors_too() -> None:
    args = small_publish(starts=np.array([1], dtype=np.int64))
    with pytest.raises(ValueError, match="keys end before its first block"):
        REF.publish_rows(**prefixed(args))
    args = small_publish(blocks=np.arange(11, dtype=np.int32))
    with pytest.raises(ValueError, match=r"blocks \(44 bytes\) ends before block id 2"):
        REF.publish_rows(**prefixed(args))


def test_publish_rows_short_store_fails_only_for_blocks_to_hash() -> None:
    """Blocks whose keys the row already holds are not read: their ids may lie past the store's end."""
    root = hashlib.sha256(b"r").digest()
    store = np.arange(16, dtype=np.int32).reshape(4, 4)
    for backend in (native, REF):
        keys = keys_of(SHA256, root, [0], 4)  # block 0's key known: its id (5) is not read
        keyed = np.zeros(8, dtype=bool)
        stored = backend.publish_rows(SHA256, ({}, [None] * 8, keyed), [keys], [0], [2], store, 16, [5, 3])
        assert stored == [5, 3] and np.flatnonzero(keyed).tolist() == [3, 5]
        assert keys[2] == chain(SHA256, keys[1], store[3].tobytes())
        keys, index, key_of = [root], dict[Any, int](), [None] * 8
        with pytest.raises(ValueError, match=r"blocks \(64 bytes\) ends before block id 5"):
            backend.publish_rows(SHA256, (index, key_of, None), [[root], keys], [0, 0], [1, 2], store, 16, [2, 3, 5])
        assert list(index.values()) == [2] and len(keys) == 2  # the first row stays published


@pytest.mark.parametrize("bad", [4, -1, -5, 2**62])
def test_publish_rows_index_error(bad: int) -> None:
    """Ids to publish must lie in [0, len(key_of)): checked before anything changes, in both."""
    for backend in (native, REF):
        args = small_publish(ids=np.array([0, bad], dtype=np.int64))
        with pytest.raises(IndexError, match="out of range of key_of"):
            backend.publish_rows(**prefixed(args))
        assert args["index"] == {} and args["key_of"] == [None] * 4 and not args["keyed"].any()
        assert len(args["key_lists"][0]) == 1
        # ids past the rows' blocks are not used, so not checked
        args = small_publish(ids=np.array([0, 1, bad], dtype=np.int64))
        assert backend.publish_rows(**prefixed(args)) == [0, 1]


@pytest.mark.parametrize(
    "changes",
    [
        {"kind": None},
        {"index": DictSubclass()},
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


def test_an_index_entry_is_trusted_without_reading_key_of() -> None:
    """The prefix index keeps no stale entry, so neither backend checks one: match returns the entry's
    block as it is, and publishing a block whose key is indexed leaves it private, comparing nothing."""

    class Incomparable:
        def __eq__(self, other: object) -> bool:
            raise RuntimeError("compared")

        __ne__ = __eq__
        __hash__ = object.__hash__

    key = chain(FAST, 0, np.arange(4, dtype=np.int32).tobytes())
    for backend in (native, REF):
        args = small_match()
        args["index"][key] = 9  # a block id the backend does not look at
        assert backend.match(**args) == [9]
        publish = small_publish(kind=FAST, key_lists=[[0]], stops=np.array([1], dtype=np.int64), ids=[0])
        publish["index"][key] = 1
        publish["key_of"][1] = Incomparable()
        assert backend.publish_rows(**prefixed(publish)) == []
        assert publish["index"] == {key: 1} and publish["key_of"][0] is None and not publish["keyed"].any()


# ------------------------------------------------------------------------------------- reference counts


def test_reference_counts_are_exact() -> None:
    # block ids and the FAST root beyond the small-int cache, whose reference counts move all the time
    for kind, root in [(SHA256, hashlib.sha256(b"root").digest()), (FAST, 10**6 + 7)]:
        tokens = np.arange(5 * 4, dtype=np.int32).reshape(5, 4)
        store = np.zeros((1000, 4), dtype=np.int32)
        store[100:105] = store[500:505] = store[600:605] = tokens
        keys = keys_of(kind, root, [], 4)
        index: dict[Any, int] = {}
        key_of: list[Any] = [None] * 1000
        keyed = np.zeros(1000, dtype=bool)
        ids = np.arange(500, 505, dtype=np.int64)
        starts, stops = np.array([0], dtype=np.int64), np.array([5], dtype=np.int64)
        native.publish_rows(kind, (index, key_of, keyed), [keys], starts, stops, store, 16, ids)
        watched: list[Any] = [root, index, key_of, keys, store, keyed, ids, starts, stops]
        watched += [*keys, *index.values()]
        before = [sys.getrefcount(x) for x in watched]
        for _ in range(2000):
            native.publish_rows(kind, (index, key_of, keyed), [keys], starts, stops, store, 16, ids)
            # the keys are live: blocks 600.. stay private (one probe finds the entry, which stays)
            assert native.publish_rows(kind, (index, key_of, None), [keys], starts, stops, store, 16, ids + 100) == []
            assert native.match(kind, index, keys, tokens, 16, 5) == ids.tolist()
            known = [root]
            native.match(kind, index, known, tokens, 16, 5)
            # a fresh pool whose index holds block 1's key on another block (block 1 stays private), and
            # whose block 2 holds its key already, under the very (cached small) int object being published
            fresh: dict[Any, Any] = {keys[2]: 700, keys[3]: 102}
            fresh_key_of: list[Any] = [None] * 1000
            fresh_key_of[700], fresh_key_of[102] = keys[2], keys[3]
            small = ids - 400
            stored = native.publish_rows(kind, (fresh, fresh_key_of, None), [keys], starts, stops, store, 16, small)
            assert stored == [100, 103, 104] and list(fresh.values()) == [700, 102, *stored]
            with pytest.raises(IndexError):
                native.publish_rows(kind, (index, key_of, keyed), [[root]], starts, stops, store, 16, ids + 999)
            with pytest.raises(ValueError, match="blocks"):
                native.publish_rows(kind, ({}, [None] * 2000, None), [[root]], starts, stops, store, 16, ids + 1000)
        del known, fresh, fresh_key_of
        assert [sys.getrefcount(x) for x in watched] == before


def test_memory_stays_flat() -> None:
    """Fresh states published and matched over and over: no allocation outlives its call."""
    tokens = np.arange(8 * 16, dtype=np.int32).reshape(8, 16)
    store = np.ascontiguousarray(tokens[::-1])
    keyed = np.zeros(8, dtype=bool)
    ids = np.arange(8, dtype=np.int64)[::-1].copy()
    starts, stops = np.array([0, 0], dtype=np.int64), np.array([3, 5], dtype=np.int64)
    roots = {SHA256: hashlib.sha256(b"root").digest(), FAST: 7}

    def rounds(n: int) -> None:
        for i in range(n):
            kind = i & 1
            index: dict[Any, int] = {}
            key_of: list[Any] = [None] * 8
            native.publish_rows(kind, (index, key_of, keyed), [[roots[kind]], [roots[kind]]], starts, stops, store, 64, ids)
            native.match(kind, index, [roots[kind]], tokens, 64, 8)
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


def test_portable_sha_can_be_chosen_at_import() -> None:
    """PAGEDKV_SHA=portable: keys come from the portable code (what a CPU without SHA-NI runs), unchanged."""
    code = (
        "import hashlib; from pagedkv.core import _native as n; "
        "assert not n.has_sha_ni(); d = bytes(range(96)); assert n.sha256(d) == hashlib.sha256(d).digest()"
    )
    env = {**os.environ, "PAGEDKV_SHA": "portable"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
