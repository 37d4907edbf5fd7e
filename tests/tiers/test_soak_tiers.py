"""`pagedkv bench soak --tiers`: a host tier below the device in half the paged episodes; blocks the device
evicts or publishes are copied into it before anything writes the device, and every admission (and random
steps) asks the manager to `fetch_blocks` from it between swaps, copies and steps. What a fetch brings must
read back as the sequence's own KV, and the soak catches a fill that lands in the wrong blocks or brings
another block's bytes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pagedkv.bench.soak import run_soak
from pagedkv.core.protocol import BlockFill


def test_the_soak_fetches_from_a_tier_and_finds_nothing_wrong() -> None:
    result = run_soak(15_000, 0, kinds=("paged-python",), tiers=True)
    assert result.violations == 0, "\n".join(result.reproduction or [])
    assert result.tier_blocks_loaded > 100


def _late(m: Any) -> Any:
    """A fill one block late: the tier's bytes land in the block after the one they belong to."""
    fetch = m.fetch_blocks

    def late(seq_id: int, start: int, end: int, source: Any, tag: object = None) -> BlockFill | None:
        fill = fetch(seq_id, start, end, source, tag)
        blocks = m.block_ids(seq_id)
        first = start // m.block_size + 1
        if fill is None or first + len(fill.dst) > len(blocks):
            return fill
        return BlockFill(np.asarray(blocks[first : first + len(fill.dst)], dtype=np.int64), fill.rows)

    m.fetch_blocks = late
    return m


def _rolled(m: Any) -> Any:
    """Another block's bytes: the rows come back in the wrong order."""
    fetch = m.fetch_blocks

    def rolled(seq_id: int, start: int, end: int, source: Any, tag: object = None) -> BlockFill | None:
        fill = fetch(seq_id, start, end, source, tag)
        return fill if fill is None else BlockFill(fill.dst, np.roll(fill.rows, 1, axis=0))

    m.fetch_blocks = rolled
    return m


@pytest.mark.parametrize(("bug", "found"), [(_late, "not s"), (_rolled, "reads back wrong KV")])
def test_the_soak_catches_a_wrong_fill(bug: Any, found: str) -> None:
    result = run_soak(15_000, 0, kinds=("paged-python",), tiers=True, patch=bug, shrink_s=2.0)
    assert result.violations == 1 and found in str(result.message), result.message
