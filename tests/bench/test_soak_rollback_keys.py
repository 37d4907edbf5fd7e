"""The soak drives rollback then re-admission with the request's own keys, with prefix caching off too
(issue 20 item 6): a manager whose keys still remember rolled-back tokens is caught."""

from __future__ import annotations

from typing import Any

import pytest

from pagedkv.bench.soak import draw_config, run_soak
from pagedkv.core import hotpath

PAGED = ("paged", "paged-python") if hotpath.NATIVE is not None else ("paged-python",)


def rollback_keeps_remembered_tokens(m: Any) -> Any:
    """Today's bug with prefix caching off: rollback leaves the keys remembering the dropped tokens."""
    rollback = m.rollback

    def keeping(seq_id: int, n: int) -> None:
        keys = m.prefix.keys_of(m.tables.device_row(seq_id))
        remembered = None if keys is None else keys._tokens
        rollback(seq_id, n)
        if keys is not None:
            keys._tokens = remembered

    m.rollback = keeping
    return m


def keys_detached_with_caching_off(m: Any) -> Any:
    """The manager before the fix: with prefix caching off the keys were not attached to the row."""
    admit = m.admit

    def detaching(*args: Any, **kwargs: Any) -> Any:
        adm = admit(*args, **kwargs)
        if adm is not None and not m.enable_prefix_caching:
            m.prefix.detach(m.tables.row(adm.seq_id))
        return adm

    m.admit = detaching
    return m


@pytest.mark.parametrize("bug", [rollback_keeps_remembered_tokens, keys_detached_with_caching_off])
def test_soak_catches_keys_not_truncated_on_rollback(bug: Any) -> None:
    result = run_soak(100_000, seed=1, patch=bug, kinds=PAGED, shrink_s=2.0)
    assert result.violations == 1, "the soak missed rollback keeping the keys' tokens"
    assert result.reproduction and "BlockKeys was used with other token ids" in (result.message or "")
    # the reproduction is Python (keys named k<label>) and, on the real manager, runs clean
    exec("\n".join(result.reproduction), {})  # noqa: S102 - the soak's own reproduction


def test_soak_draws_managers_with_prefix_caching_off() -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    configs = [draw_config(rng, PAGED) for _ in range(200)]
    assert any(not c.prefix_caching for c in configs) and any(c.prefix_caching for c in configs)
    assert all("enable_prefix_caching=False" in c.source() for c in configs if not c.prefix_caching)
