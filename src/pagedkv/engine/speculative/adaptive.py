"""`AdaptiveK`: one request's draft length, adapted to what its proposals earn.

Rules, after each verification of `proposed` draft tokens of which `accepted` were accepted:

- all accepted: k grows by one, up to the configured k;
- some rejected: k becomes `accepted + 1` (the next try asks for one more than the last one earned);
- none accepted: a miss. `MAX_MISSES` misses in a row switch speculation off for this request for a
  cool-down of steps that doubles with every switch-off (from `FIRST_COOLDOWN` to `MAX_COOLDOWN` steps);
  afterwards it proposes again with k = 1. An accepted token resets the misses and the cool-down.

A proposer that finds nothing (no n-gram match) costs nothing and is not a miss. So where nothing is
accepted a request verifies at most `MAX_MISSES` wasted drafts per cool-down, and where everything is
accepted it runs at the full k.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_MISSES = 2
FIRST_COOLDOWN = 4
MAX_COOLDOWN = 64


@dataclass(slots=True)
class AdaptiveK:
    """The draft length of one request (see the module docstring). `k` is the configured maximum."""

    k: int
    current: int = -1
    misses: int = 0
    cooldown: int = FIRST_COOLDOWN
    off_steps: int = 0  # steps left with speculation off

    def __post_init__(self) -> None:
        if self.current < 0:
            self.current = self.k

    def next_k(self) -> int:
        """How many draft tokens to ask for this step (0: off); counts down the cool-down."""
        if self.off_steps > 0:
            self.off_steps -= 1
            return 0
        return self.current

    def record(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        if accepted == proposed:
            self.current = min(self.k, self.current + 1)
        else:
            self.current = max(1, min(self.k, accepted + 1))
        if accepted > 0:
            self.misses, self.cooldown = 0, FIRST_COOLDOWN
            return
        self.misses += 1
        if self.misses >= MAX_MISSES:
            self.off_steps, self.misses, self.current = self.cooldown, 0, 1
            self.cooldown = min(MAX_COOLDOWN, self.cooldown * 2)
