"""Why prompt tokens were not served from the cache: one reason per admission, counted in lookups and tokens.

Every admission's prompt splits into three parts (`PagedKVManager.admit` counts them after it commits):

    [ cached (hits, and a partial block's reused tokens) | missed: n - 1 - cached | the last token ]

The last token is always computed (its logits are sampled), so it is never a miss. The missed tokens are
counted under the reason of the first block that did not hit:

    short_prompt   the prompt has no full block before its last token (vLLM #54607: a shared prompt
                   shorter than one block never hits)
    partial_block  every full block hit; the rest lies inside a block (served only by partial reuse)
    no_key         the first missing block's key was never cached (or fell out of the memory below)
    evicted        its key was evicted earlier (the index remembers recently evicted keys, bounded)
    salt           the same first block is cached (or was recently) under another salt (tenant)
    epoch          the same first block was cached under an earlier epoch (bump_epoch, weights changed)
    verify         the key is cached but verify_hits found other content (a hash collision)
    tier           the device missed them and a tier below it held them and lost them (a failed load, a
                   block that fell off the last tier, a failed write): the engine's tiering moves those
                   tokens from the admission's own reason to `tier` (`move_to_tier`), so the reasons
                   still partition the misses

So `sum(miss_tokens) + cached_tokens + admissions == prompt_tokens` (admissions with prefix caching on), with
tiers too: a sum over the reasons (Prometheus' `reason` label) is the total.
Salt and epoch are checked only when the first block misses (blocks after a hit share its salt and
epoch), against the last `RECENT_CONTEXTS` salts seen and the two previous epochs: a few extra hashes on a
cold miss, none on a hit.

`MissCounter.count_admission` and `miss_reason` are the one implementation, for every manager: a uniform
one asks about its index's copy of the missing block; a hybrid one (`hybrid_misses.py`) about the copy of
the group that limited the hit (`group`: the content key of the missing block -> that group). The counter
also keeps each live sequence's miss record (`records`: written by `count_admission`, moved by
`count_tier_miss`, dropped by `forget`), so both managers' `count_tier_miss` is this one rule.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pagedkv.core.group_keys import group_key
from pagedkv.core.prefix import BlockKeys, Key, KeyFunction

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from pagedkv.core.prefix_index import PrefixIndex

MISS_REASONS = ("short_prompt", "partial_block", "no_key", "evicted", "salt", "epoch", "verify", "tier")
RECENT_CONTEXTS = 8  # distinct (salt, extra) pairs remembered for the salt check
EPOCHS_BACK = 2  # earlier epochs checked for the epoch reason


class KeyedCache(Protocol):
    """What the miss reasons read of a manager's prefix cache."""

    @property
    def index(self) -> PrefixIndex: ...

    @property
    def key_fn(self) -> KeyFunction: ...

    @property
    def block_size(self) -> int: ...

    @property
    def epoch(self) -> int: ...


@dataclass(slots=True)
class MissCounter:
    """The live counters (the manager's `misses`; `ManagerStats` carries a copy)."""

    lookups: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_REASONS, 0))
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_REASONS, 0))
    contexts: deque[tuple[bytes, bytes]] = field(default_factory=lambda: deque(maxlen=RECENT_CONTEXTS))
    # live sequence (row) -> its admission's miss record: (reason, missed tokens, of which not moved yet)
    records: dict[int, tuple[str, int, int]] = field(default_factory=dict)
    # `forget(row, None)`: sequence `row` is gone (freed, preempted), its record goes with it. The records'
    # own `pop`, bound once: it runs on every free, where a Python call costs more than the pop
    forget: Callable[[int, None], tuple[str, int, int] | None] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.forget = self.records.pop

    def count(self, reason: str, num_tokens: int) -> None:
        self.lookups[reason] += 1
        self.tokens[reason] += num_tokens

    def move_to_tier(self, admission: tuple[str, int, int], num_tokens: int) -> tuple[str, int, int]:
        """A caller below the manager (the engine's tiering) found `num_tokens` of an admission's missed
        tokens gone from its tiers too: they move from the admission's reason to `tier`. `admission` is the
        manager's record of it, (reason, missed tokens, of which not moved yet); at most those move, and the
        lookup moves with the first. Returns the record after the move."""
        reason, missed, left = admission
        n = min(num_tokens, left)
        if n <= 0:
            return admission
        self.tokens[reason] -= n
        self.tokens["tier"] += n
        if left == missed:
            self.lookups[reason] -= 1
            self.lookups["tier"] += 1
        return reason, missed, left - n

    def count_tier_miss(self, row: int, num_tokens: int) -> None:
        """`num_tokens` that the admission of the live sequence `row` missed were lost by a tier below the
        device too: `move_to_tier` on its record (nothing if it missed nothing)."""
        if (record := self.records.get(row)) is not None:
            self.records[row] = self.move_to_tier(record, num_tokens)

    def count_admission(
        self, cache: KeyedCache, tokens: npt.NDArray[np.int32], keys: BlockKeys, num_hits: int, num_cached: int,
        row: int, group: Callable[[Key], int] | None = None,
    ) -> None:  # fmt: skip
        """Count the admission of sequence `row`: its missed tokens (all but the last, less the `num_cached`
        served) under the reason of its first missing block (`miss_reason`; `num_hits` full blocks hit, and
        the match computed the next key), and keep its miss record (reason, missed, not moved yet:
        `count_tier_miss`) while the sequence lives."""
        self.seen(keys.salt, keys.extra)
        missed = len(tokens) - 1 - num_cached
        if missed <= 0:
            return
        reason = miss_reason(cache, self, tokens, keys, num_hits, group)
        self.lookups[reason] += 1  # `count`, inline: on every admission that misses
        self.tokens[reason] += missed
        self.records[row] = (reason, missed, missed)

    def seen(self, salt: bytes, extra: bytes) -> None:
        """Remember a request's context for the salt check."""
        ctx = (salt, extra)
        if not self.contexts or self.contexts[-1] != ctx:
            if ctx in self.contexts:
                self.contexts.remove(ctx)
            self.contexts.append(ctx)

    def as_dict(self) -> dict[str, int]:
        """Flat counters: `miss_lookups_<reason>` and `miss_tokens_<reason>` (metrics, JSON)."""
        out = {f"miss_lookups_{r}": n for r, n in self.lookups.items()}
        out.update({f"miss_tokens_{r}": n for r, n in self.tokens.items()})
        return out


def miss_reason(
    cache: KeyedCache, misses: MissCounter, tokens: npt.NDArray[np.int32], keys: BlockKeys, num_hits: int,
    group: Callable[[Key], int] | None = None,
) -> str:  # fmt: skip
    """Why block `num_hits` of `tokens` did not hit (a query; the reasons of the module docstring), asked of
    the index's copy of that block: the plain key, or with `group` the copy of group `group(content key)`."""
    bs = cache.block_size
    max_blocks = (len(tokens) - 1) // bs
    if max_blocks == 0:
        return "short_prompt"
    if num_hits >= max_blocks:
        return "partial_block"
    if len(keys.keys) <= num_hits + 1:  # defensive: the match computes the missing block's key
        return "no_key"
    content = keys.keys[num_hits + 1]
    g = group(content) if group is not None else None
    key = content if g is None else group_key(content, g)
    index = cache.index
    if index.lookup(key) is not None:
        return "verify"  # in the index, refused by verify_hits
    if index.was_evicted(key):
        return "evicted"
    epoch, contexts = cache.epoch, misses.contexts
    if num_hits == 0 and (epoch or len(contexts) > 1):  # else no other salt nor epoch to try
        first = tokens[:bs]
        for salt, extra in contexts:
            if (salt, extra) != (keys.salt, keys.extra) and _known(cache, first, keys, salt, extra, epoch, g):
                return "salt"
        for old in range(epoch - 1, max(epoch - 1 - EPOCHS_BACK, -1), -1):
            if _known(cache, first, keys, keys.salt, keys.extra, old, g):
                return "epoch"
    return "no_key"


def _known(
    cache: KeyedCache, first: npt.NDArray[np.int32], keys: BlockKeys, salt: bytes, extra: bytes, epoch: int,
    g: int | None,
) -> bool:  # fmt: skip
    """Whether the first block `first` (group g's copy) is cached, or was evicted lately, under this salt,
    extra and epoch."""
    other = BlockKeys(salt, extra=extra, block_extra={0: keys.block_extra[0]} if 0 in keys.block_extra else None)
    other.bind(cache.key_fn, epoch)
    key = other.key(0, first)
    if g is not None:
        key = group_key(key, g)
    return cache.index.lookup(key) is not None or cache.index.was_evicted(key)
