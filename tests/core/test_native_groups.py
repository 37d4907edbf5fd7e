"""The KV-cache-group loops of `pagedkv.core._native` against `hotpath.PythonBackend`: `match` with a group,
`extend_keys` and `publish_groups`, on random states (several groups, rows that already published some
blocks or none, keys that reach past the blocks to publish or stop short of them, blocks keyed already,
keys another block holds, both key kinds). Results or errors and every structure they mutate must agree,
and the group-qualified keys must be `group_key`'s. Then the hybrid manager itself: the same random
operations through the C backend and through the Python one leave the same observable state.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from native_support import REF, SETTINGS, chain, native

from pagedkv.core import hotpath
from pagedkv.core.group import KVGroupSpec
from pagedkv.core.group_keys import group_key
from pagedkv.core.hotpath import FAST, SHA256, TableArrays
from pagedkv.core.hybrid import HybridKVManager
from pagedkv.core.prefix import BlockKeys

NUM_BLOCKS = 40


def _root(kind: int) -> Any:
    return b"r" * 32 if kind == SHA256 else 12345


@st.composite
def group_cases(draw: st.DrawFn) -> dict[str, Any]:
    """A random `publish_groups` call: its arguments, with the index's structures as separate entries."""
    kind = draw(st.sampled_from([SHA256, FAST]))
    bs = draw(st.integers(1, 4))
    num_groups = draw(st.integers(1, 3))
    num_rows = draw(st.integers(1, 4))
    cols = 6
    tokens = np.array(draw(st.lists(st.integers(0, 3), min_size=num_rows * cols * bs, max_size=num_rows * cols * bs)),
                      dtype=np.int32).reshape(num_rows, cols * bs)  # fmt: skip
    seq_keys: list[list[Any] | None] = []
    for r in range(num_rows):
        if draw(st.booleans()) and r:
            seq_keys.append(None)
            continue
        known = [_root(kind)]
        for j in range(draw(st.integers(0, cols))):
            known.append(chain(kind, known[-1], tokens[r, j * bs : (j + 1) * bs].tobytes()))
        seq_keys.append(known)
    groups = []
    for _ in range(num_groups):
        table = np.array(draw(st.lists(st.integers(1, NUM_BLOCKS - 1), min_size=num_rows * cols, max_size=num_rows * cols)),
                         dtype=np.int32).reshape(num_rows, cols)  # fmt: skip
        published = np.array([draw(st.integers(0, cols)) for _ in range(num_rows)], dtype=np.int64)
        hashable = np.array(
            [draw(st.sampled_from([2**62, 0, bs, 3 * bs + 1])) for _ in range(num_rows)], dtype=np.int64
        )
        groups.append(
            TableArrays(
                np.full(num_rows, cols * bs, np.int64),
                np.zeros(num_rows, np.int64),
                hashable,
                published,
                table,
            )
        )
    rows = draw(st.lists(st.integers(0, num_rows - 1), unique=True, max_size=num_rows))
    computed = None if draw(st.booleans()) else [draw(st.integers(0, cols * bs)) for _ in rows]
    num_tokens = [draw(st.integers(0, cols * bs)) for _ in range(num_rows)]
    groups = [t._replace(num_tokens=np.array(num_tokens, np.int64) + g) for g, t in enumerate(groups)]
    index: dict[Any, int] = {}
    key_of: list[Any] = [None] * NUM_BLOCKS
    keyed = np.zeros(NUM_BLOCKS, dtype=bool)
    for b in draw(st.lists(st.integers(1, NUM_BLOCKS - 1), unique=True, max_size=8)):  # blocks keyed already
        r, j, g = (
            draw(st.integers(0, num_rows - 1)),
            draw(st.integers(0, cols - 1)),
            draw(st.integers(0, num_groups - 1)),
        )
        known = seq_keys[r]
        key = group_key(known[j + 1], g) if known is not None and j + 1 < len(known) else f"other-{b}"
        if key not in index:
            index[key], key_of[b], keyed[b] = b, key, True
    return {
        "kind": kind, "index": index, "key_of": key_of, "keyed": keyed, "seq_keys": seq_keys,
        "rows": np.array(rows, dtype=np.int64), "computed": None if computed is None else np.array(computed, dtype=np.int64),
        "groups": tuple(groups), "tokens": tokens, "block_size": bs,
    }  # fmt: skip


def _call(backend: Any, case: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    case = copy.deepcopy(case)
    args = {k: v for k, v in case.items() if k not in ("index", "key_of", "keyed")}
    try:
        out: Any = backend.publish_groups(prefix=(case["index"], case["key_of"], case["keyed"]), **args)
    except Exception as exc:  # noqa: BLE001 - the error is what is compared
        out = (type(exc), str(exc).split(":")[0])
    return out, case


def _state(case: dict[str, Any]) -> tuple[Any, ...]:
    return (
        case["index"], case["key_of"], case["keyed"].tolist(), case["seq_keys"],
        [[a.tolist() for a in t] for t in case["groups"]],
    )  # fmt: skip


@SETTINGS
@given(group_cases())
def test_publish_groups_matches_reference(case: dict[str, Any]) -> None:
    got, after_c = _call(native, case)
    want, after_py = _call(REF, case)
    assert got == want
    assert _state(after_c) == _state(after_py)


@SETTINGS
@given(group_cases())
def test_publish_groups_keys_are_the_groups_own(case: dict[str, Any]) -> None:
    stored, after = _call(native, case)
    if isinstance(stored, tuple):
        return
    num_groups = len(after["groups"])
    for b in stored:
        key = after["key_of"][b]
        owners = [g for g, t in enumerate(after["groups"]) if b in t.table]
        assert after["index"][key] == b and after["keyed"][b]
        content = key[:-1] if isinstance(key, bytes) else key // 256
        assert any(group_key(content, g) == key for g in owners) and 0 <= owners[0] < num_groups


def _simple_case(**changes: Any) -> dict[str, Any]:
    bs, tokens = 2, np.arange(24, dtype=np.int32).reshape(2, 12)
    table = np.arange(1, 13, dtype=np.int32).reshape(2, 6)
    t = TableArrays(
        np.full(2, 12, np.int64),
        np.zeros(2, np.int64),
        np.full(2, 2**62, np.int64),
        np.zeros(2, np.int64),
        table,
    )
    case = {
        "kind": SHA256, "index": {}, "key_of": [None] * NUM_BLOCKS, "keyed": np.zeros(NUM_BLOCKS, bool),
        "seq_keys": [[b"r" * 32], [b"s" * 32]], "rows": np.array([0, 1], np.int64),
        "computed": np.array([5, 12], np.int64), "groups": (t, t._replace(num_computed=np.zeros(2, np.int64),
        num_published=np.zeros(2, np.int64), table=table + 12)), "tokens": tokens, "block_size": bs,
    }  # fmt: skip
    case.update(changes)
    return case


def test_publish_groups_by_hand() -> None:
    """Two groups: every full computed block is indexed under its own group's key, and the keys are the
    chain over the row's tokens; a third call with a block keyed already leaves that block private."""
    case = _simple_case()
    stored, after = _call(native, case)
    assert sorted(stored) == [1, 2, 7, 8, 9, 10, 11, 12, 13, 14, 19, 20, 21, 22, 23, 24]
    row0 = after["seq_keys"][0]
    assert row0[1] == chain(SHA256, b"r" * 32, np.array([0, 1], np.int32).tobytes())
    assert after["index"][group_key(row0[1], 0)] == 1 and after["index"][group_key(row0[1], 1)] == 13
    assert len(row0) == 3 and len(after["seq_keys"][1]) == 7
    assert [t.num_published.tolist() for t in after["groups"]] == [[2, 6], [2, 6]]
    assert [t.num_computed.tolist() for t in after["groups"]] == [[5, 12], [5, 12]]


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"rows": np.array([0, 2], np.int64)}, IndexError),
        ({"computed": np.array([5], np.int64)}, ValueError),
        ({"computed": np.array([-1, 4], np.int64)}, ValueError),
        ({"groups": ()}, TypeError),
        ({"groups": ((1, 2, 3),)}, TypeError),
        ({"keyed": np.zeros(3, bool)}, TypeError),
        ({"tokens": np.zeros((2, 4), np.int32)}, ValueError),
    ],
)
def test_publish_groups_rejects_bad_arguments_before_any_change(
    changes: dict[str, Any], error: type[Exception]
) -> None:
    for backend in (native, REF):
        case = _simple_case(**changes)
        before = _state(copy.deepcopy(case)) if changes.get("groups") not in ((), ((1, 2, 3),)) else None
        with pytest.raises(error):
            backend.publish_groups(prefix=(case["index"], case["key_of"], case["keyed"]),
                                   **{k: v for k, v in case.items() if k not in ("index", "key_of", "keyed")})  # fmt: skip
        if before is not None:
            assert _state(case) == before


def test_publish_groups_block_id_out_of_range() -> None:
    case = _simple_case()
    case["groups"][1].table[1, 3] = NUM_BLOCKS
    for backend in (native, REF):
        with pytest.raises(IndexError):
            _raise(backend, copy.deepcopy(case))


def _raise(backend: Any, case: dict[str, Any]) -> None:
    backend.publish_groups(prefix=(case["index"], case["key_of"], case["keyed"]),
                           **{k: v for k, v in case.items() if k not in ("index", "key_of", "keyed")})  # fmt: skip


@SETTINGS
@given(
    st.sampled_from([SHA256, FAST]),
    st.lists(st.integers(0, 3), min_size=0, max_size=24),
    st.integers(0, 3),
    st.integers(0, 8),
    st.integers(0, 255),
    st.lists(st.integers(0, 6), max_size=4),
)
def test_match_with_a_group_matches_reference(
    kind: int, toks: list[int], have: int, max_blocks: int, group: int, cached: list[int]
) -> None:
    bs, width = 2, 8
    data = np.array(toks, dtype=np.int32)
    known = [_root(kind)]
    for j in range(min(have, len(toks) // bs)):
        known.append(chain(kind, known[-1], data[j * bs : (j + 1) * bs].tobytes()))
    full = [_root(kind)]
    for j in range(len(toks) // bs):
        full.append(chain(kind, full[-1], data[j * bs : (j + 1) * bs].tobytes()))
    index = {group_key(full[j + 1], group): 100 + j for j in cached if j + 1 < len(full)}
    index.update(
        {full[j + 1]: 200 + j for j in cached if j + 1 < len(full)}
    )  # plain keys: other groups' business
    limit = min(max_blocks, len(toks) // bs)
    a, b = list(known), list(known)
    assert native.match(kind, index, a, data, width, limit, group) == REF.match(
        kind, index, b, data, width, limit, group
    )
    assert a == b


def test_match_group_must_be_a_byte() -> None:
    for bad in (-1, 256):
        with pytest.raises(ValueError):
            native.match(SHA256, {}, [b"r" * 32], b"", 8, 0, bad)
        with pytest.raises(ValueError):
            REF.match(SHA256, {}, [b"r" * 32], b"", 8, 0, bad)


@pytest.mark.parametrize("kind", [SHA256, FAST])
def test_extend_keys_matches_reference_and_stops_at_short_data(kind: int) -> None:
    data = np.arange(10, dtype=np.int32)
    for stop in range(0, 7):
        a, b = [_root(kind)], [_root(kind)]
        errors = []
        for backend, known in ((native, a), (REF, b)):
            try:
                backend.extend_keys(kind, known, data, 8, stop)
                errors.append(None)
            except ValueError:
                errors.append(ValueError)
        assert a == b and errors[0] == errors[1]
        assert (errors[0] is ValueError) == (stop > 5) and len(a) == min(stop, 5) + 1
    with pytest.raises(ValueError):
        native.extend_keys(kind, [], data, 8, 1)


# --------------------------------------------------------------------------- the manager on both backends

GROUP_SETS = [
    (KVGroupSpec(),),
    (KVGroupSpec("sliding", 5), KVGroupSpec()),
    (KVGroupSpec("chunked", 6), KVGroupSpec("sliding", 3)),
]


def _run(
    native_flag: bool, groups: tuple[KVGroupSpec, ...], hash_fn: str, ops: list[tuple[int, ...]], events: bool
) -> list[Any]:
    """Apply `ops` to a fresh manager; the observable state (and each call's result) after every op."""
    m = HybridKVManager(
        48, 2, groups, hash_fn=hash_fn, native=native_flag, record_events=events, num_host_blocks=16
    )
    rng = np.random.default_rng(0)
    live: list[int] = []
    seen: list[Any] = []
    for op in ops:
        kind, a, b = op
        result: Any = None
        if kind == 0:  # admit one of a few prompts (shared prefixes)
            prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10][: 3 + a] + [a] * b
            adm = m.admit(prompt, keys=BlockKeys(), chunk_tokens=None if b % 2 else 3)
            result = adm
            if adm is not None:
                live.append(adm.seq_id)
        elif kind == 1 and live:  # append a decode step to some
            batch = live[: 1 + a % len(live)]
            tokens = rng.integers(0, 4, size=len(batch)).tolist() if b % 3 else None
            result = m.append(batch, tokens)
        elif kind == 2 and live:  # reserve what the chunk needs, then mark it computed
            s = live[a % len(live)]
            n = m.num_tokens(s)
            result = m.reserve([s], [n]) and m.mark_computed([s], [n])
        elif kind == 3 and live:  # mark everyone computed
            result = m.mark_computed(live)
        elif kind == 4 and live:
            m.free(live.pop(a % len(live)))
        elif kind == 5 and live:
            live.append(m.fork(live[a % len(live)]))
        elif kind == 6 and live:
            s = live[a % len(live)]
            try:
                m.rollback(s, b % 3)
            except Exception as exc:  # noqa: BLE001 - refused on both or neither
                result = type(exc)
        elif kind == 7:
            result = m.bump_epoch()
        m.check_invariants()
        keys = [(r, tuple(s.keys.keys)) for r, s in sorted(m.seqs.items()) if s.keys is not None]
        seen.append(
            (
                op,
                result,
                re.sub(r" at 0x[0-9a-f]+", "", repr(m.snapshot())),
                keys,
                m.take_events() if events else None,
            )
        )
    return seen


@SETTINGS
@given(
    st.sampled_from(GROUP_SETS),
    st.sampled_from(["sha256", "fast"]),
    st.booleans(),
    st.lists(st.tuples(st.integers(0, 7), st.integers(0, 5), st.integers(0, 5)), max_size=40),
)
def test_the_manager_is_the_same_on_both_backends(
    groups: tuple[KVGroupSpec, ...], hash_fn: str, events: bool, ops: list[tuple[int, int, int]]
) -> None:
    assert _run(True, groups, hash_fn, ops, events) == _run(False, groups, hash_fn, ops, events)


def test_the_step_runs_in_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Admission, a decode step and mark_computed each take one backend path per group (no per-row
    Python publishing): the calls are counted."""
    calls: dict[str, int] = {}
    for name in ("match", "growth", "grow", "publish_groups"):
        real = getattr(hotpath.PythonBackend, name)

        def counted(*args: Any, _name: str = name, _real: Any = real, **kwargs: Any) -> Any:
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(hotpath.PythonBackend, name, staticmethod(counted))
    m = HybridKVManager(64, 4, (KVGroupSpec("sliding", 6), KVGroupSpec()), native=False)
    monkeypatch.setattr(m, "_publish_generic", lambda *a: pytest.fail("the generic path ran"))
    a = m.admit(list(range(10)), keys=BlockKeys())
    assert a is not None
    m.mark_computed([a.seq_id])
    assert m.append([a.seq_id], [7])
    m.mark_computed([a.seq_id])
    assert calls == {"match": 1, "growth": 2, "grow": 2, "publish_groups": 2}
    m.check_invariants()
