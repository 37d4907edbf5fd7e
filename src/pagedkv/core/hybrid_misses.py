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
first block under the other contexts and epochs). A windowed group that released block k and let it be
evicted therefore reports `evicted`, though a full group may still hold its own copy.

Each admission's miss record (reason, tokens, of which not moved yet) is kept on its sequence (`SeqState.miss`):
a tier loss moves tokens from that reason to `tier` by sequence (`count_tier_miss`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from pagedkv.core.group_keys import group_key
from pagedkv.core.misses import EPOCHS_BACK, MissCounter
from pagedkv.core.prefix import BlockKeys, Key, KeyFunction

if TYPE_CHECKING:
    from pagedkv.core.group import KVGroupSpec
    from pagedkv.core.hybrid_state import SeqState
    from pagedkv.core.prefix_index import PrefixIndex


class HybridMisses:
    """The miss-reason half of `HybridKVManager.admit` (see the module docstring)."""

    groups: tuple[KVGroupSpec, ...]
    index: PrefixIndex
    key_fn: KeyFunction
    misses: MissCounter
    seqs: dict[int, SeqState]
    _block_size: int
    _epoch: int

    def _count_miss(self, tokens: npt.NDArray[np.int32], keys: BlockKeys, k: int) -> tuple[str, int, int] | None:
        """Count an admission that hit `k` whole blocks (its keys computed up to its last full block before
        the last token): its miss record (reason, missed tokens, of which not moved to `tier` yet:
        `MissCounter.move_to_tier`), or None when nothing was missed."""
        misses = self.misses
        misses.seen(keys.salt, keys.extra)
        missed = len(tokens) - 1 - k * self._block_size
        if missed <= 0:
            return None
        reason = self.miss_reason(tokens, keys, k)
        misses.count(reason, missed)
        return reason, missed, missed

    def count_tier_miss(self, seq_id: int, num_tokens: int) -> None:
        """`num_tokens` that `seq_id`'s admission missed were lost by a tier below the device too (the
        engine's tiering says so): they move to the miss reason `tier` (`PagedKVManager.count_tier_miss`)."""
        seq = self.seqs[seq_id]
        if seq.miss is not None:
            seq.miss = self.misses.move_to_tier(seq.miss, num_tokens)

    def miss_reason(self, tokens: npt.NDArray[np.int32], keys: BlockKeys, k: int) -> str:
        """Why a hit of `tokens` stopped at `k` blocks (a query; see the module docstring)."""
        bs = self._block_size
        max_blocks = (len(tokens) - 1) // bs
        if max_blocks == 0:
            return "short_prompt"
        if k >= max_blocks:
            return "partial_block"
        if len(keys.keys) <= k + 1:  # defensive: the match keyed every block up to max_blocks
            return "no_key"
        g = self._limiting_group(keys.keys[k + 1], k)
        key = group_key(keys.keys[k + 1], g)
        if self.index.lookup(key) is not None:
            return "no_key"  # defensive: held now, though the match found a copy missing
        if self.index.was_evicted(key):
            return "evicted"
        contexts = self.misses.contexts
        if k == 0 and (self._epoch or len(contexts) > 1):  # else no other salt nor epoch to try
            first = tokens[:bs]
            for salt, extra in contexts:
                if (salt, extra) != (keys.salt, keys.extra) and self._known(first, keys, salt, extra, self._epoch, g):
                    return "salt"
            for epoch in range(self._epoch - 1, max(self._epoch - 1 - EPOCHS_BACK, -1), -1):
                if self._known(first, keys, keys.salt, keys.extra, epoch, g):
                    return "epoch"
        return "no_key"

    def _limiting_group(self, content: Key, k: int) -> int:
        """The first group that needs block k (content key `content`) for a hit at k + 1 blocks and does
        not hold it."""
        end, lookup = (k + 1) * self._block_size, self.index.lookup
        for g, spec in enumerate(self.groups):
            if spec.first_needed(end) < end and lookup(group_key(content, g)) is None:
                return g
        return 0  # defensive: every group could serve k + 1 blocks

    def _known(
        self, first: npt.NDArray[np.int32], keys: BlockKeys, salt: bytes, extra: bytes, epoch: int, g: int
    ) -> bool:
        """Whether group g's copy of the first block `first` is cached, or was evicted lately, under this
        salt, extra and epoch."""
        other = BlockKeys(salt, extra=extra, block_extra={0: keys.block_extra[0]} if 0 in keys.block_extra else None)
        other.bind(self.key_fn, epoch)
        key = group_key(other.key(0, first), g)
        return self.index.lookup(key) is not None or self.index.was_evicted(key)
