"""The soak finds nothing in the real managers, and finds each of a dozen injected bugs.

Each bug is patched into the managers the soak builds (a patched instance, or a patched module function),
the soak runs at most 100,000 operations, and it must report a violation with a reproduction.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

import pagedkv.bench.soak as soak_module
import pagedkv.core.manager as manager_module
import pagedkv.core.prefix as prefix_module
from pagedkv.bench.soak import run_soak
from pagedkv.core import BlockMoves, hotpath

PAGED = ("paged", "paged-python") if hotpath.NATIVE is not None else ("paged-python",)


def test_short_soak_finds_no_violation() -> None:
    result = run_soak(20_000, seed=0)
    assert result.violations == 0, "\n".join(result.reproduction or [])
    assert result.ops == 20_000 and result.failed_calls > 0
    assert set(result.episodes_by_kind) >= {"paged-python", "contiguous"}


def test_cli_prints_json() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", "bench", "soak", "--ops", "2000", "--seed", "3", "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    doc = json.loads(out.stdout)
    assert doc["ops"] == 2000 and doc["violations"] == 0 and doc["ops_per_s"] > 0


# --- injected bugs ------------------------------------------------------------------------------


def skip_unpublish_on_write(m: Any) -> Any:
    """The original corruption: a block written in place keeps its key."""
    growth = m._growth
    m._growth = lambda rows, k: (*growth(rows, k)[:3], np.zeros(0, dtype=np.int64))
    return m


def skip_refcount_decrement(m: Any) -> Any:
    release = m.pool.release
    m.pool.release = lambda ids, priority=0: release(ids[1:] if len(ids) > 1 else ids, priority)
    return m


def rollback_off_by_one(m: Any) -> Any:
    rollback = m.rollback
    m.rollback = lambda seq_id, n: rollback(seq_id, n - 1 if n > 1 else n)
    return m


def epoch_not_bumped(m: Any) -> Any:
    m.bump_epoch = lambda: m.prefix.epoch + 1  # says it bumped, keeps serving the old keys
    m.__class__ = type("Stale", (type(m),), {"epoch": property(lambda self: self.prefix.epoch + 1)})
    return m


def copies_lost(m: Any) -> Any:
    take = m.take_copies
    m.take_copies = lambda: (take(), BlockMoves(np.zeros(0, np.int64), np.zeros(0, np.int64)))[1]
    return m


def copies_not_held(m: Any) -> Any:
    """The storage-order bug: a pending copy's blocks are reusable before the copy is handed out."""
    cow = m._copy_on_write

    def unheld(rows: Any, src: Any, dst: Any) -> None:
        cow(rows, src, dst)
        held = np.flatnonzero(m.copies.held)
        m.copies.held[held] = False
        m.pool.release(held)

    m._copy_on_write = unheld
    return m


def eviction_keeps_keys(m: Any) -> Any:
    class Forgetful:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def forget_keys(self, prefix: Any, ids: Any) -> None:
            pass

    real = m.pool.prefix_index._hot  # the backend the prefix index evicts keys with
    m.pool.prefix_index._hot = Forgetful()
    return m


def admission_counted_before_capacity_check(m: Any) -> Any:
    admit = m.admit

    def counting(*args: Any, **kwargs: Any) -> Any:
        m._admissions += 1
        adm = admit(*args, **kwargs)
        if adm is not None:
            m._admissions -= 1
        return adm

    m.admit = counting
    return m


def swap_in_plan_reversed(m: Any) -> Any:
    swap_in = m.swap_in

    def reversed_plan(seq_id: int) -> Any:
        plan = swap_in(seq_id)
        return None if plan is None else BlockMoves(plan.src, plan.dst[::-1].copy())

    m.swap_in = reversed_plan
    return m


def contiguous_marks_unchecked(m: Any) -> Any:
    """The contiguous manager as it was: mark_computed takes any counts."""

    def mark(seq_ids: Any, num_computed_tokens: Any = None) -> None:
        rows = m.tables.rows(seq_ids)
        t = m.tables
        t.num_computed[rows] = t.num_tokens[rows] if num_computed_tokens is None else num_computed_tokens

    m.mark_computed = mark
    return m


def no_copy_on_write(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manager_module, "_writers_to_move", lambda rows, src, ref: np.zeros(len(src), dtype=bool))


def salt_left_out_of_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    root = prefix_module.root_key
    monkeypatch.setattr(prefix_module, "root_key", lambda fn, epoch, salt, extra: root(fn, epoch, b"", extra))


def block_extra_left_out_of_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    key = prefix_module.BlockKeys.key

    def keyed_without_extras(self: Any, block_index: int, block_tokens: Any) -> Any:
        extra, self.block_extra = self.block_extra, {}
        try:
            return key(self, block_index, block_tokens)
        finally:
            self.block_extra = extra

    monkeypatch.setattr(prefix_module.BlockKeys, "key", keyed_without_extras)


def contiguous_copies_onto_themselves(m: Any) -> Any:
    """The contiguous fork before the fix: fork, preempt the parent, fork again, and the grandchild's run (the
    parent's, first fit) gets copies from its own blocks."""
    fork = m.fork

    def forked(seq_id: int) -> Any:
        t = m.tables
        src = [m._pending.get(b, b) for b in t.blocks_of(t.row(seq_id)).tolist()]
        child = fork(seq_id)
        if child is not None:
            m._pending.update(zip(t.blocks_of(t.row(child)).tolist(), src))
        return child

    m.fork = forked
    return m


INSTANCE_BUGS = [
    (skip_unpublish_on_write, PAGED),
    (skip_refcount_decrement, PAGED),
    (rollback_off_by_one, PAGED),
    (epoch_not_bumped, PAGED),
    (copies_lost, PAGED),
    (copies_not_held, PAGED),
    (eviction_keeps_keys, PAGED),
    (admission_counted_before_capacity_check, PAGED),
    (swap_in_plan_reversed, PAGED),
    (contiguous_marks_unchecked, ("contiguous",)),
    (contiguous_copies_onto_themselves, ("contiguous",)),
]
MODULE_BUGS = [no_copy_on_write, salt_left_out_of_the_key, block_extra_left_out_of_the_key]


def _caught(result: Any, name: str) -> None:
    assert result.violations == 1, f"the soak missed {name} in {result.ops} operations"
    assert result.ops <= 100_000 and result.reproduction and result.message
    assert result.reproduction[-1].startswith("# violation:")


@pytest.mark.parametrize("bug,kinds", INSTANCE_BUGS, ids=[b.__name__ for b, _ in INSTANCE_BUGS])
def test_soak_catches_injected_bug(bug: Any, kinds: tuple[str, ...]) -> None:
    _caught(run_soak(100_000, seed=1, patch=bug, kinds=kinds, shrink_s=2.0), bug.__name__)


@pytest.mark.parametrize("bug", MODULE_BUGS, ids=[b.__name__ for b in MODULE_BUGS])
def test_soak_catches_injected_module_bug(bug: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    bug(monkeypatch)
    _caught(run_soak(100_000, seed=1, kinds=PAGED, shrink_s=2.0), bug.__name__)


class _ReplayClock:
    """`time` for the shrinker, with a monotonic clock that moves 20 ms per reading instead of with the wall:
    the shrinker reads it once per trial replay, so its budget becomes a number of replays (120 for 2.4 s)
    and a loaded machine (parallel test workers) cannot cut the shrinking short."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 0.02
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def test_reproduction_is_python_that_fails_the_same_way(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(soak_module, "time", _ReplayClock())
    result = run_soak(100_000, seed=1, patch=skip_unpublish_on_write, kinds=PAGED, shrink_s=2.4)
    _caught(result, "skip_unpublish_on_write")
    assert result.message is not None and result.message.startswith("check_invariants")
    lines = result.reproduction or []
    assert len(lines) < 250, "the shrinker should cut the episode down"
    import pagedkv.core as core

    namespace = {name: getattr(core, name) for name in core.__all__}
    namespace["PagedKVManager"] = lambda *a, **k: skip_unpublish_on_write(core.PagedKVManager(*a, **k))
    code = "\n".join(line for line in lines if not line.startswith("from "))
    with pytest.raises(core.InvariantError):
        exec(code, namespace)  # noqa: S102 - the soak's own output
    namespace["PagedKVManager"] = core.PagedKVManager  # without the bug the same calls are fine
    exec(code.replace("m.check_invariants()  # raises", "m.check_invariants()"), namespace)
