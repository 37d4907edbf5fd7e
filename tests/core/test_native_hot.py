"""The C extension's `publish_computed`, `take_live` and `release_refs` against their specification, `hotpath.PythonBackend`.

`publish_computed` (a whole `mark_computed`) is checked on random realistic batches -- rows sharing token
content (colliding keys, so blocks stay private), prefix blocks shared between rows, index entries that are
held or shadowed by other keyed blocks (none stale), keys computed at admission past what gets published, hashable
counts below the token counts, rows without keys or with keys of an old epoch, rows with nothing to publish
-- against both the Python reference (written for speed: numpy row selection, bulk inserts) and a naive
model that calls `PythonBackend.publish_rows` row by row. `take_live` (eviction's scan of a lazily deleted
FIFO queue) is checked on queues built by simulating pushes and hits, against the reference and a plain
loop; `release_refs` (the pool's release) against the reference and a one-block-at-a-time model. Invalid
inputs must raise before anything changes.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from native_support import REF, SETTINGS, chain, content_tokens, native

from pagedkv.core import hotpath
from pagedkv.core.hotpath import FAST, SHA256
from pagedkv.core.prefix import BlockKeys, key_function

RARELY = st.sampled_from([False, False, False, False, True])
EPOCH = 5


# ------------------------------------------------------------------------------------------ publish_computed

PC_ARRAYS = ("num_tokens", "num_computed", "hashable", "num_published", "table", "blocks", "keyed")


@st.composite
def computed_cases(draw: st.DrawFn) -> dict[str, Any]:
    """A prefix cache and a batch of distinct rows to mark computed (see the module docstring)."""
    kind = draw(st.sampled_from([SHA256, FAST]))
    fn = key_function("sha256" if kind == SHA256 else "fast")
    bs = draw(st.sampled_from([1, 2, 3, 4, 16]))
    num_rows = draw(st.integers(1, 6))
    cols = draw(st.integers(1, 6))
    num_others = draw(st.integers(0, 6))  # blocks outside every table (cached-free, holding other keys)
    num_blocks = num_rows * cols + num_others + 1  # + 1: block 0 pads the tables, like the pool's zeros
    fresh = iter(draw(st.permutations(range(1, num_blocks))))
    contents_of = st.lists(st.integers(0, 3), min_size=cols, max_size=cols)
    bases = [draw(contents_of) for _ in range(2)]  # two prompts the rows share prefixes of
    salts = [b"", b"tenant"]

    store = np.zeros((num_blocks, bs), dtype=np.int32)
    for b in range(num_blocks):  # junk content, overwritten for the blocks in a table
        store[b] = content_tokens(100 + draw(st.integers(0, 3)), bs)
    table = np.zeros((num_rows, cols), dtype=np.int32)
    num_tokens = np.zeros(num_rows, dtype=np.int64)
    num_computed = np.zeros(num_rows, dtype=np.int64)
    hashable = np.zeros(num_rows, dtype=np.int64)
    num_published = np.zeros(num_rows, dtype=np.int64)
    index: dict[Any, int] = {}
    key_of: list[Any] = [None] * num_blocks
    seq_keys: list[Any] = []
    rows_meta: list[tuple[bytes, list[int]]] = []  # (salt, contents) of each row
    # every key a row's blocks can have under the current epoch (candidates for pre-existing entries)
    candidates: list[Any] = [b"junk" * 8 if kind == SHA256 else 987654321]

    for r in range(num_rows):
        salt = draw(st.sampled_from(salts))
        split = draw(st.integers(0, cols))
        contents = bases[draw(st.integers(0, 1))][:split] + draw(contents_of)[split:]
        tokens = draw(st.integers(0, cols * bs) | st.integers(cols * bs // 2, cols * bs))
        held = draw(st.integers(-(-tokens // bs), cols))  # blocks in the table (lookahead ones too)
        hashable[r] = tokens if draw(st.booleans()) else draw(st.integers(0, tokens))
        num_tokens[r] = tokens
        num_computed[r] = draw(st.just(0) | st.integers(0, tokens))  # mostly a prompt not computed yet
        published = draw(st.integers(0, min(int(num_computed[r]), int(hashable[r])) // bs))
        num_published[r] = published
        root = BlockKeys(salt)
        root.bind(fn, EPOCH)
        keys = [root.keys[0]]
        for c in contents:
            keys.append(chain(kind, keys[-1], content_tokens(c, bs).tobytes()))
        candidates += keys[1:]
        for j in range(held):
            shared = None
            if j < published:  # a prefix hit on a published block of an earlier row with the same prefix
                owners = [
                    q for q, (s, seen) in enumerate(rows_meta)
                    if s == salt and seen[: j + 1] == contents[: j + 1] and j < num_published[q]
                ]  # fmt: skip
                if len(owners) > 0 and draw(st.booleans()):
                    shared = int(table[draw(st.sampled_from(owners)), j])
            b = next(fresh) if shared is None else shared
            table[r, j] = b
            store[b] = content_tokens(contents[j], bs)
            if j < published and shared is None and draw(st.booleans()):  # published and indexed
                holder = index.get(keys[j + 1])
                if holder is None or key_of[holder] != keys[j + 1]:
                    index[keys[j + 1]], key_of[b] = b, keys[j + 1]
        rows_meta.append((salt, contents))

        mode = draw(st.sampled_from(["keys", "keys", "keys", "none", "old"]))
        if mode == "none":
            seq_keys.append(None)
            continue
        bk = BlockKeys(salt)
        bk.bind(fn, EPOCH if mode == "keys" else EPOCH - 1)
        low = published if mode == "keys" else 0  # keys computed at admission may reach past what publishes
        have = draw(st.sampled_from([low, tokens // bs]) | st.integers(low, tokens // bs))
        for j in range(have):
            bk.keys.append(chain(kind, bk.keys[-1], store[table[r, j]].tobytes()))
        seq_keys.append(bk)
    seq_keys += [None] * draw(st.integers(0, 2))  # by_row may be longer than the tables

    # pre-existing entries on other blocks (rarely on the blocks to publish themselves)
    others = list(range(num_rows * cols + 1, num_blocks)) or [0]
    anywhere = st.integers(0, num_blocks - 1)
    entries = st.tuples(st.sampled_from(candidates), st.sampled_from(["indexed", "keyed"]), RARELY)
    for key, mode, wild in draw(st.just([]) | st.lists(entries, max_size=10)):
        b = draw(anywhere if wild else st.sampled_from(others))
        if mode == "indexed":  # indexed and held
            index[key], key_of[b] = b, key
        else:  # a keyed block, not indexed (or indexed to another block)
            key_of[b] = key
    index = {key: b for key, b in index.items() if key_of[b] == key}  # the prefix index keeps none stale
    keyed = np.array([k is not None for k in key_of], dtype=np.bool_)

    order = draw(st.permutations(range(num_rows)))
    rows = np.array(order[: draw(st.just(num_rows) | st.integers(0, num_rows))], dtype=np.int64)
    computed = None
    if draw(st.booleans()):
        computed = np.array(
            [draw(st.integers(int(num_computed[r]), int(num_tokens[r]))) for r in rows.tolist()],
            dtype=np.int64,
        )
    return {
        "kind": kind, "index": index, "key_of": key_of, "keyed": keyed, "seq_keys": seq_keys, "epoch": EPOCH,
        "rows": rows, "computed": computed, "num_tokens": num_tokens, "num_computed": num_computed,
        "hashable": hashable, "num_published": num_published, "table": table, "blocks": store,
    }  # fmt: skip


def key_lists(seq_keys: Any) -> tuple[Any, np.ndarray]:
    """The cases' `BlockKeys` by row as the backends take them: each row's key list (the same list object,
    or None) in a container of the same type, and the epochs they were computed under (int64, by row)."""
    lists = type(seq_keys)(None if k is None else k.keys for k in seq_keys)
    return lists, np.array([-1 if k is None else k.epoch for k in seq_keys], dtype=np.int64)


def call(fn: Any, case: dict[str, Any]) -> Any:
    """`fn(kind, (index, key_of, keyed), key lists, epochs, epoch, rows, computed, (num_tokens, ..., table),
    blocks)`, the key lists and epochs read from the case's `BlockKeys` (`key_lists`)."""
    c = case
    prefix = (c["index"], c["key_of"], c["keyed"])
    tables = (c["num_tokens"], c["num_computed"], c["hashable"], c["num_published"], c["table"])
    lists, epochs = key_lists(c["seq_keys"])
    return fn(c["kind"], prefix, lists, epochs, c["epoch"], c["rows"], c["computed"], tables, c["blocks"])


def naive_publish_computed(case: dict[str, Any]) -> list[int]:
    """The docstring's semantics, one row at a time, publishing with `PythonBackend.publish_rows`."""
    blocks, table, bs = case["blocks"], case["table"], case["blocks"].shape[1]
    stored: list[int] = []
    for i, r in enumerate(case["rows"].tolist()):
        c = int(case["num_tokens"][r] if case["computed"] is None else case["computed"][i])
        case["num_computed"][r] = c
        start, stop = int(case["num_published"][r]), min(c, int(case["hashable"][r])) // bs
        if stop <= start:
            continue
        case["num_published"][r] = stop
        keys = case["seq_keys"][r]
        if keys is None or keys.epoch != case["epoch"]:
            continue
        ids = table[r, start:stop].astype(np.int64)
        prefix = (case["index"], case["key_of"], case["keyed"])
        stored += REF.publish_rows(case["kind"], prefix, [keys.keys], [start], [stop], blocks, 4 * bs, ids)
    return stored


def snapshot(case: dict[str, Any]) -> dict[str, Any]:
    """Everything publish_computed may change or must leave alone, in comparable form."""
    return {
        "index": list(case["index"].items()),  # items in iteration order
        "key_of": list(case["key_of"]),
        "keys": [None if k is None else (k.epoch, list(k.keys)) for k in case["seq_keys"]],
        **{name: case[name].tolist() for name in PC_ARRAYS},
    }


@SETTINGS
@given(case=computed_cases())
def test_publish_computed_matches_reference_and_model(case: dict[str, Any]) -> None:
    before = snapshot(case)
    ours, ref, model = copy.deepcopy(case), copy.deepcopy(case), copy.deepcopy(case)
    expected = naive_publish_computed(model)
    assert call(REF.publish_computed, ref) == expected
    assert call(native.publish_computed, ours) == expected
    after = snapshot(model)
    assert snapshot(ref) == after
    assert snapshot(ours) == after
    for name in ("num_tokens", "hashable", "table", "blocks"):  # read only
        assert after[name] == before[name]
    # each block stored was not keyed before, and is now keyed and indexed under its key
    assert len(set(expected)) == len(expected)
    for b in expected:
        key = model["key_of"][b]
        assert key is not None and model["index"][key] == b and model["keyed"][b]
        assert before["key_of"][b] is None


def test_publish_computed_bulk_fresh_prompt_and_private_duplicates() -> None:
    """Two rows holding the same prompt: the first one's blocks are indexed, the second's stay private."""
    for kind, name in ((SHA256, "sha256"), (FAST, "fast")):
        bs = 4
        blocks = np.zeros((9, bs), dtype=np.int32)
        table = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=np.int32)
        for j in range(4):
            blocks[1 + j] = blocks[5 + j] = content_tokens(j, bs)
        seq_keys: list[Any] = []
        for _ in range(2):
            bk = BlockKeys()
            bk.bind(key_function(name), EPOCH)
            seq_keys.append(bk)
        case: dict[str, Any] = {
            "kind": kind, "index": {}, "key_of": [None] * 9, "keyed": np.zeros(9, dtype=np.bool_),
            "seq_keys": seq_keys, "epoch": EPOCH, "rows": np.array([0, 1], dtype=np.int64), "computed": None,
            "num_tokens": np.array([16, 14], dtype=np.int64), "num_computed": np.zeros(2, dtype=np.int64),
            "hashable": np.array([15, 14], dtype=np.int64), "num_published": np.zeros(2, dtype=np.int64),
            "table": table, "blocks": blocks,
        }  # fmt: skip
        ref = copy.deepcopy(case)
        assert call(native.publish_computed, case) == [1, 2, 3]
        assert call(REF.publish_computed, ref) == [1, 2, 3]
        assert snapshot(case) == snapshot(ref)
        assert case["num_published"].tolist() == [3, 3] and case["num_computed"].tolist() == [16, 14]
        assert seq_keys[0].keys == seq_keys[1].keys and len(seq_keys[0].keys) == 4
        assert case["keyed"].tolist() == [False, True, True, True] + [False] * 5


@pytest.mark.parametrize("kind", [SHA256, FAST])
def test_publish_computed_long_rows(kind: int) -> None:
    """Rows of more than 64 blocks to publish (the C side's scratch goes to the heap): a prompt, a second
    prompt sharing its first 70 blocks (private duplicates there), a row of an old epoch."""
    fn = key_function("sha256" if kind == SHA256 else "fast")
    num_rows, cols, bs = 3, 100, 2
    num_blocks = num_rows * cols
    table = np.arange(num_blocks, dtype=np.int32).reshape(num_rows, cols)[:, ::-1].copy()
    contents = [list(range(cols)), list(range(70)) + list(range(500, 530)), list(range(cols))]
    blocks = np.zeros((num_blocks, bs), dtype=np.int32)
    for r in range(num_rows):
        for j in range(cols):
            blocks[table[r, j]] = content_tokens(contents[r][j], bs)
    seq_keys: list[Any] = []
    for r, (epoch, have) in enumerate([(EPOCH, 10), (EPOCH, 90), (EPOCH - 1, 0)]):
        bk = BlockKeys()
        bk.bind(fn, epoch)
        for j in range(have):
            bk.keys.append(chain(kind, bk.keys[-1], blocks[table[r, j]].tobytes()))
        seq_keys.append(bk)
    case: dict[str, Any] = {
        "kind": kind, "index": {}, "key_of": [None] * num_blocks, "keyed": np.zeros(num_blocks, dtype=np.bool_),
        "seq_keys": seq_keys, "epoch": EPOCH, "rows": np.array([1, 0, 2], dtype=np.int64),
        "computed": np.array([2 * cols - 1, 2 * cols, 2 * cols], dtype=np.int64),
        "num_tokens": np.full(num_rows, 2 * cols, dtype=np.int64), "num_computed": np.zeros(num_rows, np.int64),
        "hashable": np.full(num_rows, 2 * cols, dtype=np.int64), "num_published": np.array([0, 2, 0]),
        "table": table, "blocks": blocks,
    }  # fmt: skip
    # row 1 published its first two blocks earlier (indexed)
    for j in range(2):
        key, b = seq_keys[1].keys[j + 1], int(table[1, j])
        case["index"][key], case["key_of"][b], case["keyed"][b] = b, key, True
    ours, ref = copy.deepcopy(case), copy.deepcopy(case)
    expected = naive_publish_computed(case)
    # row 1's blocks 2..98, then row 0's last 30 (its first 70 are duplicates of row 1's)
    assert len(expected) == 97 + 30
    assert call(native.publish_computed, ours) == expected == call(REF.publish_computed, ref)
    assert snapshot(ours) == snapshot(case) == snapshot(ref)


# ------------------------------------------------------------------------------------- publish_computed errors


def small_case() -> dict[str, Any]:
    """Three rows, all with blocks to publish; row 2 has no keys."""
    bs, num_blocks = 2, 10
    blocks = np.arange(num_blocks * bs, dtype=np.int32).reshape(num_blocks, bs)
    seq_keys: list[Any] = []
    for salt in (b"", b"x"):
        bk = BlockKeys(salt)
        bk.bind(key_function("sha256"), EPOCH)
        seq_keys.append(bk)
    seq_keys.append(None)
    index = {b"live": 8}
    key_of: list[Any] = [None] * num_blocks
    key_of[8] = b"live"
    return {
        "kind": SHA256, "index": index, "key_of": key_of, "keyed": np.array([k is not None for k in key_of]),
        "seq_keys": seq_keys, "epoch": EPOCH, "rows": np.array([0, 1, 2], dtype=np.int64), "computed": None,
        "num_tokens": np.array([6, 4, 4], dtype=np.int64), "num_computed": np.zeros(3, dtype=np.int64),
        "hashable": np.array([6, 4, 4], dtype=np.int64), "num_published": np.zeros(3, dtype=np.int64),
        "table": np.array([[1, 2, 3], [4, 5, 0], [6, 7, 0]], dtype=np.int32), "blocks": blocks,
    }  # fmt: skip


def test_small_case_publishes() -> None:
    case, ref = small_case(), small_case()
    assert call(native.publish_computed, case) == [1, 2, 3, 4, 5] == call(REF.publish_computed, ref)
    assert snapshot(case) == snapshot(ref)


def with_table(row: int, col: int, value: int) -> Any:
    def change(case: dict[str, Any]) -> None:
        case["table"][row, col] = value

    return change


def setter(name: str, value: Any) -> Any:
    def change(case: dict[str, Any]) -> None:
        case[name] = value(case[name]) if callable(value) else value

    return change


def both(*changes: Any) -> Any:
    def change(case: dict[str, Any]) -> None:
        for one in changes:
            one(case)

    return change


def keyed_mismatch(label: str, make: Any, what: str) -> Any:
    """A `keyed` that is not a writable C-contiguous 1-D array of 1-byte items: TypeError, as from
    publish_rows (`what` says how the C code once got it wrong)."""
    return pytest.param(label, setter("keyed", make), TypeError)


def readonly(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.flags.writeable = False
    return a


INVALID: list[Any] = [
    # rows out of range of the tables, the counts or seq_keys
    ("row past the tables", setter("rows", np.array([0, 3], dtype=np.int64)), IndexError),
    ("negative row", setter("rows", np.array([0, -1], dtype=np.int64)), IndexError),
    ("row past seq_keys", setter("seq_keys", lambda s: s[:2]), IndexError),
    ("row past hashable", setter("hashable", lambda a: a[:2].copy()), IndexError),
    ("huge row", setter("rows", [0, 2**62]), IndexError),
    # a block id to publish outside key_of or the block store (the last row's, after the others)
    ("id past key_of", with_table(2, 1, 10), IndexError),
    ("negative id", with_table(2, 0, -1), IndexError),
    (
        "id past blocks",
        both(
            setter("key_of", lambda k: k + [None] * 4),
            setter("keyed", lambda a: np.zeros(14, dtype=np.bool_)),
            with_table(2, 1, 11),
        ),
        IndexError,
    ),
    ("id past blocks and key_of", with_table(1, 1, 12), IndexError),
    # counts
    ("computed too short", setter("computed", np.array([6, 4], dtype=np.int64)), ValueError),
    ("computed too long", setter("computed", np.array([6, 4, 4, 4], dtype=np.int64)), ValueError),
    (
        "computed past the table",
        both(setter("computed", np.array([6, 4, 8], dtype=np.int64)), setter("hashable", lambda a: a * 2)),
        ValueError,
    ),
    ("negative computed", setter("computed", np.array([6, 4, -2], dtype=np.int64)), ValueError),
    ("keyed too short", setter("keyed", lambda a: a[:9].copy()), ValueError),
    ("bad kind", setter("kind", 2), ValueError),
    # types
    ("index not a dict", setter("index", lambda d: list(d.items())), TypeError),
    ("key_of not a list", setter("key_of", tuple), TypeError),
    ("seq_keys not a list", setter("seq_keys", tuple), TypeError),
    ("rows int32", setter("rows", lambda a: a.astype(np.int32)), TypeError),
    ("rows float", setter("rows", lambda a: a.astype(np.float64)), TypeError),
    ("computed int32", setter("computed", np.array([6, 4, 4], dtype=np.int32)), TypeError),
    ("computed float", setter("computed", np.array([6.0, 4.0, 4.0])), TypeError),
    ("num_tokens int32", setter("num_tokens", lambda a: a.astype(np.int32)), TypeError),
    ("num_computed float", setter("num_computed", lambda a: a.astype(np.float64)), TypeError),
    ("num_computed read-only", setter("num_computed", readonly), TypeError),
    ("hashable uint64", setter("hashable", lambda a: a.astype(np.uint64)), TypeError),
    ("num_published int32", setter("num_published", lambda a: a.astype(np.int32)), TypeError),
    ("num_published read-only", setter("num_published", readonly), TypeError),
    ("num_published 2-D", setter("num_published", lambda a: a.reshape(3, 1).copy()), TypeError),
    ("table int64", setter("table", lambda a: a.astype(np.int64)), TypeError),
    ("table 1-D", setter("table", lambda a: a.ravel().copy()), TypeError),
    ("table not contiguous", setter("table", lambda a: np.asfortranarray(a)), TypeError),
    ("blocks int64", setter("blocks", lambda a: a.astype(np.int64)), TypeError),
    ("blocks bytes", setter("blocks", lambda a: a.tobytes()), TypeError),
    ("keyed a list", setter("keyed", lambda a: a.tolist()), TypeError),
    # `keyed` of the wrong kind: TypeError from publish_rows (both backends), not so from publish_computed
    keyed_mismatch(
        "keyed read-only", readonly, "raises ValueError (numpy's 'buffer source array is read-only')"
    ),
    keyed_mismatch("keyed bytes", lambda a: bytes(len(a)), "raises BufferError ('Object is not writable.')"),
    keyed_mismatch(
        "keyed not contiguous",
        lambda a: np.repeat(a, 2)[::2],
        "raises ValueError (numpy's 'not C-contiguous')",
    ),
    keyed_mismatch(
        "keyed int64", lambda a: a.astype(np.int64), "raises ValueError ('keyed not 1-byte items ...')"
    ),
    keyed_mismatch(
        "keyed 2-D", lambda a: a.reshape(5, 2).copy(), "accepts it (and writes it as a flat array)"
    ),
]


@pytest.mark.parametrize(("label", "change", "error"), INVALID, ids=[
    p.values[0] if hasattr(p, "values") else p[0] for p in INVALID
])  # fmt: skip
def test_publish_computed_invalid_inputs_change_nothing(
    label: str, change: Any, error: type[Exception]
) -> None:
    case = small_case()
    change(case)
    before = copy.deepcopy(case)
    with pytest.raises(error):
        call(native.publish_computed, case)
    # nothing changed: the index, key_of, every keys list, every array
    index, old = case["index"], before["index"]
    assert (list(index.items()) == list(old.items())) if isinstance(index, dict) else index == old
    assert list(case["key_of"]) == list(before["key_of"])
    for k, b in zip(case["seq_keys"], before["seq_keys"]):
        assert (k is None and b is None) or (k.keys == b.keys and k.epoch == b.epoch)
    for name in PC_ARRAYS:
        a, b = case[name], before[name]
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b)
        else:
            assert a == b


def test_publish_computed_takes_the_owners_structs_as_tuples() -> None:
    """`prefix` and `tables` are one value each; a malformed one is a TypeError before anything changes."""
    for backend in (native, REF):
        case = small_case()
        before = copy.deepcopy(case)
        prefix = (case["index"], case["key_of"], case["keyed"])
        tables = (case["num_tokens"], case["num_computed"], case["hashable"], case["num_published"], case["table"])
        rest = (*key_lists(case["seq_keys"]), case["epoch"], case["rows"], case["computed"])
        for bad_prefix, bad_tables in ((prefix[:2], tables), (prefix, tables[:4]), (list(prefix), tables)):
            with pytest.raises(TypeError, match="tuple|prefix must be"):
                backend.publish_computed(case["kind"], bad_prefix, *rest, bad_tables, case["blocks"])
            assert case["index"] == before["index"] and np.array_equal(case["num_computed"], before["num_computed"])
        arrays = hotpath.TableArrays(*tables)
        assert backend.publish_computed(case["kind"], prefix, *rest, arrays, case["blocks"]) == [1, 2, 3, 4, 5]


def test_publish_computed_reads_keys_and_epochs_as_passed() -> None:
    """The key lists and their epochs are arguments: a row publishes only when epochs[r] == epoch (the C code
    reads no attribute of a keys object); malformed ones are errors before anything changes."""
    for backend in (native, REF):
        case = small_case()
        lists, epochs = key_lists(case["seq_keys"])
        prefix = (case["index"], case["key_of"], case["keyed"])
        tables = (case["num_tokens"], case["num_computed"], case["hashable"], case["num_published"], case["table"])
        rest = (case["rows"], case["computed"], tables, case["blocks"])
        epochs[0] = EPOCH - 1  # row 0's keys of an earlier epoch: its blocks 1-3 stay private
        assert backend.publish_computed(case["kind"], prefix, lists, epochs, EPOCH, *rest) == [4, 5]
        assert case["key_of"][1] is None and len(lists[0]) == 1
    case = small_case()
    lists, epochs = key_lists(case["seq_keys"])
    prefix = (case["index"], case["key_of"], case["keyed"])
    tables = (case["num_tokens"], case["num_computed"], case["hashable"], case["num_published"], case["table"])
    rest = (case["rows"], case["computed"], tables, case["blocks"])
    bad: list[tuple[Any, Any, Any, type[Exception]]] = [
        (lists, epochs[:2].copy(), EPOCH, IndexError),  # row 2 past epochs
        (lists, epochs.astype(np.int32), EPOCH, TypeError),
        (lists, epochs.tolist(), EPOCH, TypeError),
        (lists, epochs, "0", TypeError),
    ]
    for args in bad:
        with pytest.raises(args[3]):
            native.publish_computed(case["kind"], prefix, args[0], args[1], args[2], *rest)
        assert case["index"] == {b"live": 8} and not case["num_computed"].any() and len(lists[1]) == 1
    # a row's keys not a list: found in the loop (the C code is stricter than the reference here)
    with pytest.raises(TypeError, match="must be a list or None"):
        native.publish_computed(case["kind"], prefix, [tuple(lists[0]), *lists[1:]], epochs, EPOCH, *rest)
    assert case["index"] == {b"live": 8} and case["key_of"][1] is None


def test_publish_computed_keys_ending_early() -> None:
    """A row's keys ending before its first block to publish: ValueError from both backends."""
    for backend in (native, REF):
        case = small_case()
        case["num_published"][1] = 1  # row 1 published block 0 already, but its keys hold the root only
        with pytest.raises(ValueError, match="keys end before"):
            call(backend.publish_computed, case)


# ------------------------------------------------------------------------------------------------ take_live


@st.composite
def queue_cases(draw: st.DrawFn) -> dict[str, Any]:
    """A lazily deleted FIFO queue built by pushes (entry = the block's stamp now) and hits (stamp + 1)."""
    num_blocks = draw(st.integers(1, 12))
    stamp = np.array(draw(st.lists(st.integers(0, 3), min_size=num_blocks, max_size=num_blocks)), np.int64)
    live: set[int] = set()
    ids: list[int] = []
    stamps: list[int] = []
    ops = st.tuples(st.sampled_from(["push", "push", "hit"]), st.integers(0, num_blocks - 1))
    for op, b in draw(st.lists(ops, max_size=60)):
        if op == "hit" or b in live:  # a hit (or a block freed again) stales its entry
            stamp[b] += 1
            live.discard(b)
        if op == "push":
            ids.append(b)
            stamps.append(int(stamp[b]))
            live.add(b)
    tail = len(ids)
    head = draw(st.integers(0, tail))
    # entries before head were consumed already; capacity past tail holds junk (never read)
    spare = draw(st.integers(0, 5))
    queue_ids = np.array(ids + draw(st.lists(st.integers(-5, 50), min_size=spare, max_size=spare)), np.int64)
    queue_stamps = np.array(
        stamps + draw(st.lists(st.integers(-1, 9), min_size=spare, max_size=spare)), np.int64
    )
    size = draw(st.integers(0, 16))
    filled = draw(st.integers(0, size))
    out = np.array(draw(st.lists(st.integers(-1, 99), min_size=size, max_size=size)), dtype=np.int64)
    return {
        "queue_ids": queue_ids, "queue_stamps": queue_stamps, "head": head, "tail": tail, "stamp": stamp,
        "out": out, "filled": filled,
    }  # fmt: skip


TL_ORDER = ("queue_ids", "queue_stamps", "head", "tail", "stamp", "out", "filled")


def take(fn: Any, case: dict[str, Any]) -> Any:
    return fn(*(case[name] for name in TL_ORDER))


def naive_take_live(case: dict[str, Any]) -> tuple[int, int]:
    head, tail, filled = case["head"], case["tail"], case["filled"]
    ids, stamps, stamp, out = case["queue_ids"], case["queue_stamps"], case["stamp"], case["out"]
    while head < tail and filled < len(out):
        b = int(ids[head])
        if stamp[b] == stamps[head]:
            out[filled] = b
            stamp[b] += 1
            filled += 1
        head += 1
    return head, filled


def tl_state(case: dict[str, Any]) -> list[list[int]]:
    return [case[name].tolist() for name in ("queue_ids", "queue_stamps", "stamp", "out")]


@SETTINGS
@given(case=queue_cases())
def test_take_live_matches_reference_and_model(case: dict[str, Any]) -> None:
    ours, ref, model = copy.deepcopy(case), copy.deepcopy(case), copy.deepcopy(case)
    expected = naive_take_live(model)
    assert take(REF.take_live, ref) == expected
    got = take(native.take_live, ours)
    assert got == expected and all(type(x) is int for x in got)
    assert tl_state(ours) == tl_state(model) == tl_state(ref)
    # the blocks taken are distinct, the queue itself is untouched, the scan stops full or at tail
    head, filled = expected
    taken = model["out"][case["filled"] : filled].tolist()
    assert len(set(taken)) == len(taken)
    assert tl_state(model)[:2] == tl_state(case)[:2]
    assert filled == len(case["out"]) or head == case["tail"]


def queue() -> dict[str, Any]:
    return {
        "queue_ids": np.array([0, 1, 2, 1, 3], dtype=np.int64),
        "queue_stamps": np.array([0, 0, 0, 1, 0], dtype=np.int64),
        "head": 0, "tail": 5, "stamp": np.array([0, 1, 0, 0], dtype=np.int64),
        "out": np.full(3, -1, dtype=np.int64), "filled": 0,
    }  # fmt: skip


def test_take_live_small_queue() -> None:
    for backend in (native, REF):
        case = queue()
        assert take(backend.take_live, case) == (4, 3)  # entry 1 is stale; 3 stays for next time
        assert case["out"].tolist() == [0, 2, 1] and case["stamp"].tolist() == [1, 2, 1, 0]
        assert take(backend.take_live, {**case, "head": 4, "filled": 2}) == (5, 3)
        assert case["out"].tolist() == [0, 2, 3]


TL_INVALID: list[Any] = [
    ("head past tail", {"head": 4, "tail": 3}, ValueError, True),
    ("negative head", {"head": -1}, ValueError, True),
    ("tail past the queue", {"tail": 6}, ValueError, True),
    ("tail past the stamps", {"queue_stamps": np.zeros(4, dtype=np.int64)}, ValueError, False),
    ("filled past out", {"filled": 4}, ValueError, True),
    ("negative filled", {"filled": -1}, ValueError, True),
    ("id past stamp", {"queue_ids": np.array([0, 1, 2, 1, 4], dtype=np.int64)}, IndexError, True),
    ("negative id", {"queue_ids": np.array([0, 1, -1, 1, 3], dtype=np.int64)}, IndexError, True),
    ("queue_ids int32", {"queue_ids": np.array([0, 1, 2, 1, 3], dtype=np.int32)}, TypeError, False),
    ("queue_stamps float", {"queue_stamps": np.zeros(5)}, TypeError, False),
    ("stamp int32", {"stamp": np.array([0, 1, 0, 0], dtype=np.int32)}, TypeError, False),
    ("stamp read-only", {"stamp": readonly(np.array([0, 1, 0, 0], dtype=np.int64))}, TypeError, False),
    ("out int32", {"out": np.full(3, -1, dtype=np.int32)}, TypeError, False),
    ("out read-only", {"out": readonly(np.full(3, -1, dtype=np.int64))}, TypeError, False),
    ("out not contiguous", {"out": np.full(6, -1, dtype=np.int64)[::2]}, TypeError, False),
    ("queue_ids a list", {"queue_ids": [0, 1, 2, 1, 3]}, TypeError, False),
    ("head not an int", {"head": 0.0}, TypeError, False),
]


@pytest.mark.parametrize(
    ("label", "changes", "error", "also_reference"), TL_INVALID, ids=[t[0] for t in TL_INVALID]
)
def test_take_live_invalid_inputs_change_nothing(
    label: str, changes: dict[str, Any], error: type[Exception], also_reference: bool
) -> None:
    for backend in (native, REF) if also_reference else (native,):
        case = {**queue(), **changes}  # the arrays as they are (copies would be writable and contiguous)
        before = copy.deepcopy(case)
        with pytest.raises(error):
            take(backend.take_live, case)
        for name in ("queue_ids", "queue_stamps", "stamp", "out"):
            assert np.array_equal(np.asarray(case[name]), np.asarray(before[name])), (backend, name)


def test_take_live_ignores_ids_outside_head_and_tail() -> None:
    """Junk before head or past tail is never read (not even checked)."""
    for backend in (native, REF):
        case = queue()
        case["queue_ids"] = np.array([99, 1, 2, 1, -7], dtype=np.int64)
        assert take(backend.take_live, {**case, "head": 1, "tail": 4}) == (4, 2)
        assert case["out"].tolist() == [2, 1, -1]


# --------------------------------------------------------------------------------------------- release_refs


@st.composite
def release_cases(draw: st.DrawFn) -> dict[str, Any]:
    """A pool's reference counts and key flags, a free stack with `top` entries, and distinct held ids."""
    num_blocks = draw(st.integers(1, 24))
    ref = np.array(draw(st.lists(st.integers(0, 3), min_size=num_blocks, max_size=num_blocks)), np.int32)
    keyed = np.array(draw(st.lists(st.booleans(), min_size=num_blocks, max_size=num_blocks)), bool)
    held = [b for b in range(num_blocks) if ref[b] > 0]
    ids = draw(st.permutations(held)) if held else []
    ids = np.array(ids[: draw(st.integers(0, len(ids)))], np.int64)
    size = draw(st.integers(0, num_blocks + 4))
    stack = np.array(draw(st.lists(st.integers(-1, 99), min_size=size, max_size=size)), np.int64)
    top = draw(st.integers(0, size))
    out = np.full(len(ids) + draw(st.integers(0, 3)), -7, np.int64)
    return {"ref": ref, "keyed": keyed, "ids": ids, "stack": stack, "top": top, "out": out}


RR_ORDER = ("ref", "keyed", "ids", "stack", "top", "out")


def release(fn: Any, case: dict[str, Any]) -> Any:
    return fn(*(case[name] for name in RR_ORDER))


def naive_release(case: dict[str, Any]) -> tuple[int, int]:
    """One block at a time: the unkeyed ones that reach zero are pushed so the first released ends on top."""
    ref, keyed, stack, out = case["ref"], case["keyed"], case["stack"], case["out"]
    plain, kept = [], 0
    for b in case["ids"].tolist():
        ref[b] -= 1
        if ref[b] == 0 and keyed[b]:
            out[kept] = b
            kept += 1
        elif ref[b] == 0:
            plain.append(b)
    top = case["top"]
    if top + len(plain) > len(stack):
        raise ValueError("no room")
    stack[top : top + len(plain)] = plain[::-1]
    return top + len(plain), kept


def rr_state(case: dict[str, Any]) -> list[list[Any]]:
    return [case[name].tolist() for name in ("ref", "keyed", "stack", "out")]


@SETTINGS
@given(case=release_cases())
def test_release_refs_matches_reference_and_model(case: dict[str, Any]) -> None:
    ours, ref, model = copy.deepcopy(case), copy.deepcopy(case), copy.deepcopy(case)
    try:
        expected: Any = naive_release(model)
    except ValueError:  # no room: both refuse, changing nothing
        for backend, state in ((REF, ref), (native, ours)):
            with pytest.raises(ValueError, match="no room on the free stack"):
                release(backend.release_refs, state)
            assert rr_state(state) == rr_state(case)
        return
    assert release(REF.release_refs, ref) == expected
    got = release(native.release_refs, ours)
    assert got == expected and all(type(x) is int for x in got)
    assert rr_state(ours) == rr_state(model) == rr_state(ref)


RR_INVALID: list[Any] = [
    ("id out of range", {"ids": np.array([0, 3], np.int64)}, IndexError, "out of range"),
    ("negative id", {"ids": np.array([-1], np.int64)}, IndexError, "out of range"),
    ("a block not held", {"ids": np.array([1, 2], np.int64)}, ValueError, "holds no reference"),
    ("out too short", {"out": np.zeros(0, np.int64)}, ValueError, "len\\(out\\)"),
    ("top past the stack", {"top": 5}, ValueError, "0 <= top"),
    ("negative top", {"top": -1}, ValueError, "0 <= top"),
    ("a full stack", {"top": 4}, ValueError, "no room"),
]


@pytest.mark.parametrize(("what", "change", "error", "words"), RR_INVALID, ids=[c[0] for c in RR_INVALID])
def test_release_refs_refuses_before_changing_anything(what: str, change: dict[str, Any], error: type, words: str) -> None:
    for backend in (native, REF):
        case = {
            "ref": np.array([1, 1, 0], np.int32), "keyed": np.array([False, True, False]),
            "ids": np.array([0], np.int64), "stack": np.zeros(4, np.int64), "top": 0, "out": np.zeros(2, np.int64),
            **change,
        }  # fmt: skip
        before = rr_state(case)
        with pytest.raises(error, match=words):
            release(backend.release_refs, case)
        assert rr_state(case) == before, what
