"""`DraftBudget`: every speculating request's draft length in one step, chosen for the whole step's expected
tokens per second. Torch-free; the engine and the simulator hold one each and drive it the same way.

Per request it keeps the request's `AdaptiveK` (the cap: grow, shrink, misses and cool-downs) and its
acceptance per draft position, an EWMA of "accepted, given the drafts before it were" (`ALPHA`). A position
a request has not been verified at yet takes the EWMA of all requests at it (`GLOBAL_ALPHA`, starting at
`PRIOR`). Over the step it keeps a cost model, fitted online from the measured steps (`StepCostFit`):

```
step seconds  T = F + c x (scored tokens) + d x (draft tokens proposed by a draft model)
tokens out    G = one per decoding request + sum over its drafts j of P_j,   P_j = a_1 x ... x a_j
```

with a_j the request's acceptance at position j. One more draft costs w = c (+ d where it is still to be
proposed) and adds P_j: it raises G / T exactly when P_j > w x G / T. Every draft costs the same w, and
a request's P_j shrink with j, so the best set of drafts for the step is the P_j largest ones: `plan`
adds them from the largest down while each still raises G / T. At batch 1, where F dwarfs c, a draft
with any reasonable acceptance pays and the request keeps its full cap; at saturation, where the step
is compute-bound and F is a small share of T, only drafts the target is nearly sure to accept pay, and a
batch of low-acceptance requests gets 0 drafts each. Until the fit has seen steps of different sizes it
knows no c, and `plan` hands the caps back unchanged (`AdaptiveK` alone).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.speculative.adaptive import AdaptiveK

ALPHA = 0.3  # weight of a request's latest verification in its acceptance per position
GLOBAL_ALPHA = 0.05  # weight of one verification in the all-requests acceptance per position
PRIOR = 0.8  # the all-requests acceptance before any verification: optimistic, so speculation is tried
DECAY = 0.97  # weight of the step before in the cost fit (about the last 30 steps)
MIN_SPREAD = 2.0  # the fit knows c once its steps' sizes spread by this many tokens (weighted std)


@dataclass(slots=True)
class StepCostFit:
    """T = F + c x N, least squares over the measured steps, each step before weighted `decay` times the
    one after it. `known` is False until the steps' sizes spread enough to tell c from noise."""

    decay: float = DECAY
    s0: float = 0.0
    sn: float = 0.0
    st: float = 0.0
    snn: float = 0.0
    snt: float = 0.0
    fixed_s: float = 0.0  # F
    per_token_s: float = 0.0  # c
    known: bool = False

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or not seconds > 0.0 or seconds == float("inf"):
            return
        n, t, g = float(num_tokens), float(seconds), self.decay
        self.s0, self.sn, self.st = g * self.s0 + 1.0, g * self.sn + n, g * self.st + t
        self.snn, self.snt = g * self.snn + n * n, g * self.snt + n * t
        var = self.snn / self.s0 - (self.sn / self.s0) ** 2
        if var < MIN_SPREAD**2:
            return  # keep the last fit: steps of one size cannot tell F from c
        c = (self.snt / self.s0 - self.sn * self.st / self.s0**2) / var
        c = max(0.0, c)
        self.per_token_s = c
        self.fixed_s = max(0.0, (self.st - c * self.sn) / self.s0)
        self.known = True


def _ewma(old: float, new: float, alpha: float) -> float:
    return (1.0 - alpha) * old + alpha * new


@dataclass(slots=True)
class _RequestState:
    k: AdaptiveK
    acceptance: list[float | None]  # per draft position; None: never verified there


@dataclass
class DraftBudget:
    """The draft lengths of a batch (module docstring). `k` is the configured maximum per request."""

    k: int
    cost: StepCostFit = field(default_factory=StepCostFit)
    draft_token_s: float = 0.0  # d: seconds of proposing one draft token (a draft model's forwards)
    overall: list[float] = field(default_factory=list)  # acceptance per position over all requests
    _requests: dict[str, _RequestState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise InvalidArgumentError(f"DraftBudget k must be an int >= 1, got {self.k!r}")
        if not self.overall:
            self.overall = [PRIOR] * self.k

    def _state(self, request_id: str) -> _RequestState:
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _RequestState(AdaptiveK(self.k), [None] * self.k)
        return state

    def next_k(self, request_id: str) -> int:
        """The request's cap for this step (`AdaptiveK.next_k`: 0 during a cool-down); once a step."""
        return self._state(request_id).k.next_k()

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        """A verification of the request's `proposed` drafts accepted the first `accepted` of them."""
        if proposed <= 0:
            return
        state = self._state(request_id)
        state.k.record(proposed, accepted)
        for j in range(min(proposed, accepted + 1, self.k)):
            hit = 1.0 if j < accepted else 0.0
            old = state.acceptance[j]
            state.acceptance[j] = hit if old is None else _ewma(old, hit, ALPHA)
            self.overall[j] = _ewma(self.overall[j], hit, GLOBAL_ALPHA)

    def forget(self, request_id: str) -> None:
        """The request ended or was preempted out of its drafts' KV: drop its state."""
        self._requests.pop(request_id, None)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step scored `num_tokens` tokens (drafts included) in `seconds`."""
        self.cost.observe(num_tokens, seconds)

    def observe_drafting(self, num_tokens: int, seconds: float) -> None:
        """Proposing `num_tokens` draft tokens took `seconds` (n-gram lookup: about nothing)."""
        if num_tokens > 0 and seconds >= 0.0:
            self.draft_token_s = _ewma(self.draft_token_s, seconds / num_tokens, 0.2)

    def acceptance(self, request_id: str) -> list[float]:
        """The request's acceptance per draft position (its own where verified there, else everyone's)."""
        state = self._requests.get(request_id)
        own = state.acceptance if state is not None else [None] * self.k
        return [o if o is not None else g for o, g in zip(own, self.overall)]

    def plan(
        self, request_ids: Sequence[str], caps: Sequence[int], base_tokens: int, *, to_propose: bool = False
    ) -> list[int]:
        """How many drafts each request verifies this step, at most its cap, for the most expected tokens
        per second of a step that scores `base_tokens` tokens besides the drafts (at least one a request).
        `to_propose`: the drafts are still to be proposed, so each also costs `draft_token_s`."""
        if len(request_ids) != len(caps):
            raise InvalidArgumentError(f"plan: {len(request_ids)} requests but {len(caps)} caps")
        if not self.cost.known or self.cost.fixed_s + self.cost.per_token_s <= 0.0:
            return [max(0, min(int(c), self.k)) for c in caps]
        return plan_drafts(
            [self.acceptance(r) for r in request_ids],
            caps,
            fixed_s=self.cost.fixed_s,
            per_token_s=self.cost.per_token_s + (self.draft_token_s if to_propose else 0.0),
            base_tokens=max(int(base_tokens), len(request_ids)),
        )


def plan_drafts(
    acceptance: Sequence[Sequence[float]],
    caps: Sequence[int],
    *,
    fixed_s: float,
    per_token_s: float,
    base_tokens: int,
) -> list[int]:
    """The draft length per request that maximises expected tokens / step seconds (module docstring):
    request i's j-th draft adds P = acceptance[i][0] x ... x acceptance[i][j-1] tokens and `per_token_s`
    seconds to a step of `fixed_s + per_token_s x base_tokens` seconds yielding one token a request."""
    if fixed_s < 0.0 or per_token_s < 0.0 or (fixed_s == 0.0 and per_token_s == 0.0):
        raise InvalidArgumentError(
            f"plan_drafts: need costs >= 0, not both 0; got {fixed_s!r}, {per_token_s!r}"
        )
    ks = [0] * len(caps)
    gain, seconds = float(len(caps)), fixed_s + per_token_s * base_tokens
    heap: list[tuple[float, int, float]] = []  # (-P of the next draft, request, P)
    for i, (a, cap) in enumerate(zip(acceptance, caps)):
        if cap > 0 and len(a) > 0:
            p = max(0.0, min(1.0, float(a[0])))
            heapq.heappush(heap, (-p, i, p))
    while heap:
        _, i, p = heapq.heappop(heap)
        if p * seconds <= per_token_s * gain:  # the best draft left lowers tokens per second: so do the rest
            break
        ks[i] += 1
        gain, seconds = gain + p, seconds + per_token_s
        j = ks[i]
        if j < min(caps[i], len(acceptance[i])):
            q = p * max(0.0, min(1.0, float(acceptance[i][j])))
            heapq.heappush(heap, (-q, i, q))
    return ks
