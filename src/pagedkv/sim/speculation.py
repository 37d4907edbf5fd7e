"""Speculative decoding in the simulator: what it buys on a modelled GPU, given how often drafts are accepted.

The replay speculates through the engine's own scheduler path (`Scheduler(num_lookahead_tokens=k)`: draft
slots in the token budget and the growth reserve, rejected drafts rolled back through the allocator), so
KV use, preemption and the prefix cache behave as in the engine. What the simulator cannot know, it takes as
parameters (`SpecSim`):

- `k`: the most draft tokens per decoding request per step. Each request adapts its own k by the
  engine's rule (`pagedkv.engine.speculative.adaptive.AdaptiveK`, the same class and constants): k shrinks
  to one more than the last verification accepted and grows back by one when all are accepted, and two
  verifications in a row that accept nothing switch speculation off for that request for a cool-down of
  4 steps doubling to 64. On top of that, as in the engine, the step's draft budget
  (`pagedkv.engine.speculative.budget.DraftBudget`, the same object the engine holds) cuts the batch's
  drafts to those that raise the step's expected tokens per second, from each request's measured
  acceptance and a step cost fitted to the simulated steps (`budget=False`: AdaptiveK alone).
  `adaptive=False` models a fixed k instead (every step proposes k);
- `acceptance_rate` a: each draft token is accepted with probability a given that the ones before it were,
  so a verification accepts i or more drafts with probability a^i (vLLM's and the papers' i.i.d. model;
  the expected tokens per verification are (1 - a^(k+1)) / (1 - a));
- `draft_cost`: the time of one draft forward relative to the target's decode step over the same requests
  (0 for n-gram lookup; ~0.05-0.2 for a draft model 10-20x smaller). A proposal is k draft forwards.

```
step time = target step over its chunks (each speculating request: 1 + its k tokens, its context read once)
          + max k x draft_cost x target decode step over the speculating requests (1 token each)
```

On a memory-bound GPU step (weights read once per step whatever the batch) the verification's extra k
tokens per request cost little, so every accepted draft is close to a free token; near saturation the step
becomes compute-bound and rejected drafts cost their FLOPs; the adaptive rule bounds what a proposer that
keeps missing costs. Draws come from a generator seeded per replay: the same workload and configuration give
the same numbers. `Drafter.accepted` is the one draw (a subclass may script it: tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.speculative.budget import DraftBudget

REJECTED_TOKEN_ID = 50_001  # outside the synthetic vocabulary and not EOS: a draft the target never picks


@dataclass(frozen=True)
class SpecSim:
    """Speculative decoding's parameters in the simulator (module docstring)."""

    k: int = 4
    acceptance_rate: float = 0.7
    draft_cost: float = 0.0
    seed: int = 0
    adaptive: bool = True  # each request's k follows the engine's AdaptiveK; False: always k
    budget: bool = True  # with adaptive: the engine's whole-step DraftBudget too

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise InvalidArgumentError(f"speculation k must be an int >= 1, got {self.k!r}")
        a = self.acceptance_rate
        if isinstance(a, bool) or not isinstance(a, int | float) or not 0.0 <= a <= 1.0:
            raise InvalidArgumentError(f"speculation acceptance_rate must be in [0, 1], got {a!r}")
        c = self.draft_cost
        if isinstance(c, bool) or not isinstance(c, int | float) or not 0.0 <= c < float("inf"):
            raise InvalidArgumentError(f"speculation draft_cost must be a finite number >= 0, got {c!r}")
        if not isinstance(self.adaptive, bool):
            raise InvalidArgumentError(f"speculation adaptive must be a bool, got {self.adaptive!r}")
        if not isinstance(self.budget, bool):
            raise InvalidArgumentError(f"speculation budget must be a bool, got {self.budget!r}")

    @property
    def expected_tokens_per_verification(self) -> float:
        """Accepted drafts plus the target's own token, on average, at the full k."""
        a, k = float(self.acceptance_rate), self.k
        return float(k + 1) if a == 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


class Drafter:
    """Draws each decoding request's drafts: the true continuation for the accepted ones, then a token the
    target rejects; and keeps each request's draft length (the engine's `DraftBudget`, or the fixed k)."""

    def __init__(self, spec: SpecSim) -> None:
        self.spec = spec
        self.rng = np.random.default_rng(spec.seed)
        self.budget = DraftBudget(spec.k, spec.budget)

    def next_k(self, request_id: str) -> int:
        """How many drafts the request asks for this step (0: its speculation is off for now), as the
        engine asks each decoding request once per step."""
        return self.budget.next_k(request_id) if self.spec.adaptive else self.spec.k

    def plan(self, request_ids: list[str], caps: list[int], base_tokens: int) -> list[int]:
        """The step's draft lengths (`DraftBudget.plan`, drafts still to propose), or the caps without it."""
        if not self.spec.adaptive:
            return caps
        return self.budget.plan(request_ids, caps, base_tokens, to_propose=True)

    def observe(
        self, num_tokens: int, num_verifying: int, step_s: float, num_drafts: int, draft_s: float
    ) -> None:
        """A simulated step scored `num_tokens` tokens, `num_verifying` requests' drafts among them, in
        `step_s`; proposing its `num_drafts` drafts took `draft_s`."""
        self.budget.observe_step(num_tokens, step_s, num_verifying)
        self.budget.observe_drafting(num_drafts, draft_s)

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        """A verification of the request's `proposed` drafts accepted `accepted` of them."""
        if self.spec.adaptive:
            self.budget.record(request_id, proposed, accepted)

    def forget(self, request_id: str) -> None:
        """The request ended: drop its draft length."""
        self.budget.forget(request_id)

    def accepted(self, limit: int) -> int:
        """How many of the next `limit` drafts the target accepts: each with probability `acceptance_rate`
        given the ones before it were."""
        a = 0
        while a < limit and self.rng.random() < self.spec.acceptance_rate:
            a += 1
        return a

    def drafts(self, truth: Sequence[int], num_tokens: int) -> list[int]:
        """`num_tokens` drafts after a request whose true next tokens are `truth`."""
        a = self.accepted(min(num_tokens, len(truth)))
        return [int(t) for t in truth[:a]] + [REJECTED_TOKEN_ID] * (num_tokens - a)


def verified(drafts: Sequence[int], truth: Sequence[int]) -> list[int]:
    """What the target keeps of `drafts` when its own choices are `truth`: the matching drafts, then its
    own next token."""
    a = 0
    while a < len(drafts) and a < len(truth) - 1 and drafts[a] == truth[a]:
        a += 1
    return [int(t) for t in truth[: a + 1]]
