"""`BlockKeys.extend` (a run of blocks keyed in one loop) gives the keys `BlockKeys.key` gives block by block."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.core.prefix import BlockKeys, fast_key, sha256_key

BS = 4


@pytest.mark.parametrize("fn", [sha256_key, fast_key])
@pytest.mark.parametrize("block_extra", [None, {1: b"img", 4: b"x"}])
def test_extend_equals_key_by_key(fn, block_extra) -> None:  # type: ignore[no-untyped-def]
    tokens = np.random.default_rng(0).integers(0, 1000, size=7 * BS + 2).astype(np.int32)
    one, run = BlockKeys(b"s", block_extra=block_extra), BlockKeys(b"s", block_extra=block_extra)
    for k in (one, run):
        k.bind(fn, 3)
    for i in range(7):
        one.key(i, tokens[i * BS : (i + 1) * BS])
    run.key(0, tokens[:BS])  # extend continues from the keys already there
    run.extend(5, tokens[BS : 5 * BS].tobytes(), BS)
    run.extend(5, b"", BS)  # nothing to add
    run.extend(7, tokens[5 * BS : 7 * BS].tobytes(), BS)
    assert run.keys == one.keys and len(run.keys) == 8
