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
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MISS_REASONS = ("short_prompt", "partial_block", "no_key", "evicted", "salt", "epoch", "verify", "tier")
RECENT_CONTEXTS = 8  # distinct (salt, extra) pairs remembered for the salt check
EPOCHS_BACK = 2  # earlier epochs checked for the epoch reason


@dataclass(slots=True)
class MissCounter:
    """The live counters (the manager's `misses`; `ManagerStats` carries a copy)."""

    lookups: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_REASONS, 0))
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_REASONS, 0))
    contexts: deque[tuple[bytes, bytes]] = field(default_factory=lambda: deque(maxlen=RECENT_CONTEXTS))

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
