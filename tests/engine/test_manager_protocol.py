"""The engine speaks to its KV manager through the protocol only (`pagedkv.core.protocol.KVManager`).

Only the factory (`engine/managers.py`) names a concrete manager class; everywhere else the engine asks the
protocol (`num_groups`, `reserves_chunks`, `records_events`, `grouped_events`, ...) instead of branching on
the class or probing attributes with `getattr(manager, name, default)`. And every manager the factory builds
answers every member of the protocol.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from pagedkv.core.group import KVGroupSpec
from pagedkv.core.protocol import KVManager
from pagedkv.engine.managers import MANAGER_KINDS, make_manager

ENGINE = Path(__file__).resolve().parents[2] / "src" / "pagedkv" / "engine"
CONCRETE = {"PagedKVManager", "HybridKVManager"}
# Modules allowed to name a concrete manager, each with the reason (keep this short).
EXEMPT: set[str] = set()


def _offences(source: str) -> list[str]:
    """Names of the concrete managers, and `getattr(<...manager...>, name, default)`, in one module."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id in CONCRETE:
            found.append(f"line {node.lineno}: names {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in CONCRETE:
            found.append(f"line {node.lineno}: names {node.attr}")
        elif isinstance(node, ast.alias) and node.name.split(".")[-1] in CONCRETE:
            found.append(f"line {getattr(node, 'lineno', '?')}: imports {node.name}")
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
            and len(node.args) == 3 and "manager" in ast.unparse(node.args[0]).lower()
        ):  # fmt: skip
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_factory_names_a_concrete_manager() -> None:
    bad = {
        str(path.relative_to(ENGINE)): offences
        for path in sorted(ENGINE.rglob("*.py"))
        if path.name != "managers.py" and str(path.relative_to(ENGINE)) not in EXEMPT and (offences := _offences(path.read_text()))
    }
    assert not bad, f"the engine branches on the manager's class or probes it with getattr: {bad}"


def test_the_check_finds_what_it_looks_for() -> None:
    src = (
        "from pagedkv.core.hybrid import HybridKVManager\n"
        "x = isinstance(m, core.PagedKVManager)\n"
        "y = getattr(self.manager, 'num_groups', 1)\n"
        "z = getattr(request, 'seq_id', None)\n"
    )
    assert len(_offences(src)) == 3


def _build(kind: str) -> KVManager:
    groups = (KVGroupSpec(), KVGroupSpec(kind="sliding", window=32)) if kind == "hybrid" else None
    return make_manager(kind, 64, 16, record_events=True, groups=groups)


@pytest.mark.parametrize("kind", MANAGER_KINDS)
def test_every_manager_answers_the_protocol(kind: str) -> None:
    m = _build(kind)
    assert isinstance(m, KVManager)
    caching = kind != "contiguous"
    assert m.num_groups == (2 if kind == "hybrid" else 1)
    assert m.reserves_chunks is (kind == "hybrid")
    assert m.records_events is caching
    assert m.grouped_events is (kind == "hybrid")
    assert (m.misses is not None) is caching
    a = m.admit(list(range(40)))
    assert a is not None
    seqs = np.array([a.seq_id], dtype=np.int64)
    assert m.reserve(seqs, np.array([40], dtype=np.int64)) is True
    m.mark_computed(seqs)
    m.count_tier_miss(a.seq_id, 0)
    events = m.take_events()
    assert bool(events) is caching
    assert (m.reset_prefix_cache() > 0) is caching
    epoch = m.epoch
    assert m.bump_epoch() == epoch + 1 == m.epoch
    m.check_invariants()

