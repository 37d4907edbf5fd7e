"""`HybridKVManager`'s miss reasons: why an admission's prompt tokens were not served, over KV cache groups.

The same counter (`misses.MissCounter`) and the same reasons as `PagedKVManager.admit` (`misses.py`), with
the split of the prompt unchanged: `[ cached (k whole blocks) | missed: n - 1 - cached | the last token ]`,
so `sum(miss_tokens) + cached_tokens + admissions == prompt_tokens` (prefix caching on; there is no partial
reuse nor `verify_hits` here, so `verify` never counts).

Which block, in which group: the hit is the longest prefix of k blocks every group serves, so the prefix
of k + 1 blocks fails in some group. Every group that serves k blocks holds the blocks it needs for them,
and the blocks it needs for k + 1 are those plus block k at most (`first_needed` never decreases), so the
block that did not hit is always block k. The limiting group is the first group, in the manager's group
order, that needs block k for a hit at k + 1 and does not hold its copy: its group-qualified key gives the
reason (`no_key`, `evicted`, or, when nothing hit, `salt` / `epoch` by checking that group's copy of the
first block under the other contexts and epochs): `misses.miss_reason`, the paged manager's own, asked
about that group's copy. A windowed group that released block k and let it be
evicted therefore reports `evicted`, though a full group may still hold its own copy.

Each admission's miss record (reason, tokens, of which not moved yet) is kept by the counter while its
sequence lives (`MissCounter.records`): a tier loss moves tokens from that reason to `tier` by sequence
(`count_tier_miss`), as in the paged manager.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from pagedkv.core.group_keys import group_key
from pagedkv.core.misses import MissCounter, miss_reason
from pagedkv.core.prefix import BlockKeys, Key, KeyFunction

if TYPE_CHECKING:
    from pagedkv.core.group import KVGroupSpec
    from pagedkv.core.prefix_index import PrefixIndex
    from pagedkv.core.table import BlockTables


class HybridMisses:
    """The miss-reason half of `HybridKVManager.admit` (see the module docstring)."""

    groups: tuple[KVGroupSpec, ...]
    index: PrefixIndex
    key_fn: KeyFunction
    misses: MissCounter
    tables: list[BlockTables]

    @property
    def block_size(self) -> int:
        raise NotImplementedError

    @property
    def epoch(self) -> int:
        raise NotImplementedError

    def _count_miss(self, tokens: npt.NDArray[np.int32], keys: BlockKeys, k: int, row: int) -> None:
        """Count the admission of sequence `row`, which hit `k` whole blocks (its keys computed up to its last
        full block before the last token): `MissCounter.count_admission`, asked about the limiting group."""
        self.misses.count_admission(self, tokens, keys, k, k * self.block_size, row, self._group_of_miss(k))

    def count_tier_miss(self, seq_id: int, num_tokens: int) -> None:
        """`num_tokens` that `seq_id`'s admission missed were lost by a tier below the device too (the
        engine's tiering says so): they move to the miss reason `tier` (`MissCounter.count_tier_miss`)."""
        self.misses.count_tier_miss(self.tables[0].row(seq_id), num_tokens)

    def miss_reason(self, tokens: npt.NDArray[np.int32], keys: BlockKeys, k: int) -> str:
        """Why a hit of `tokens` stopped at `k` blocks (a query; see the module docstring)."""
        return miss_reason(self, self.misses, tokens, keys, k, self._group_of_miss(k))

    def _group_of_miss(self, k: int) -> Callable[[Key], int]:
        """The first group that needs block k (given its content key) for a hit at k + 1 blocks and does
        not hold it."""
        end, lookup = (k + 1) * self.block_size, self.index.lookup

        def limiting(content: Key) -> int:
            for g, spec in enumerate(self.groups):
                if spec.first_needed(end) < end and lookup(group_key(content, g)) is None:
                    return g
            return 0  # defensive: every group could serve k + 1 blocks

        return limiting
