"""The hybrid soak finds nothing on the real manager and catches injected bugs."""

from __future__ import annotations

import pytest

from pagedkv.bench.soak_hybrid import run_hybrid_soak
from pagedkv.core.group import KVGroupSpec
from pagedkv.core.hybrid import HybridKVManager


def test_clean_run() -> None:
    r = run_hybrid_soak(1200, seed=1)
    assert r.violations == 0, r.message
    assert r.episodes == 3


def test_catches_a_block_released_too_early(monkeypatch: pytest.MonkeyPatch) -> None:
    real = KVGroupSpec.releasable_blocks
    monkeypatch.setattr(KVGroupSpec, "releasable_blocks", lambda self, c, bs: real(self, c + bs, bs))
    assert run_hybrid_soak(1200, seed=1).violations == 1


def test_catches_a_lost_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    real = HybridKVManager.take_copies
    monkeypatch.setattr(HybridKVManager, "take_copies", lambda self: (real(self), real(self))[1])  # drops them
    assert run_hybrid_soak(1200, seed=1).violations == 1
