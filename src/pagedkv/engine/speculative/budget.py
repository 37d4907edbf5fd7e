"""`DraftBudget`: every speculating request's draft length in one step, chosen for the whole step's expected
tokens per second. Torch-free; the engine and the simulator hold one each and drive it the same way.

Per request it keeps the request's `AdaptiveK` (the cap: grow, shrink, misses and cool-downs) and its
acceptance per draft position, an EWMA of "accepted, given the drafts before it were" (`ALPHA`), which
starts at, and between verifications drifts back towards (`RELAX` a step), the EWMA of all requests at
that position (`GLOBAL_ALPHA`, starting at `PRIOR`): a request the budget stopped drafting for is tried
again once everyone's acceptance says it may pay. Over the step it keeps a cost model, fitted online to
the measured steps (`StepCostFit`):

```
step seconds  T = F + c x (scored tokens) + s x (requests verifying drafts)
                    + d x (draft tokens still to propose, by a draft model)
tokens out    G = one per decoding request + sum over its drafts j of P_j,   P_j = a_1 x ... x a_j
```

with a_j the request's acceptance at position j. s is what a verifying request costs beyond its tokens
(on the CPU engine its own attention call instead of a row of the batched decode kernel). `plan_drafts`
finds the lengths with the most G / T (Dinkelbach's iteration; exact). One more draft pays exactly when
its P_j exceeds its cost times G / T, so at batch 1, where F dwarfs c and s, a draft with any reasonable
acceptance pays and the request keeps its full cap; at saturation, where the step is compute-bound and
F is a small share of T, only drafts the target is nearly sure to accept pay, and a batch of
low-acceptance requests gets 0 drafts each. Until the fit has seen steps of different sizes it knows no
c, and `plan` hands the caps back unchanged (`AdaptiveK` alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.speculative.adaptive import AdaptiveK

ALPHA = 0.3  # weight of a request's latest verification in its acceptance per position
RELAX = 0.05  # per step, a request's acceptance moves this share of the way back to everyone's
GLOBAL_ALPHA = 0.05  # weight of one verification in the all-requests acceptance per position
PRIOR = 0.8  # the all-requests acceptance before any verification: optimistic, so speculation is tried
DECAY = 0.97  # weight of the step before in the cost fit (about the last 30 steps)
MIN_SPREAD = 2.0  # the fit knows c once its steps' sizes spread by this many tokens (weighted std)


@dataclass(slots=True)
class StepCostFit:
    """T = F + c x N + s x R (N scored tokens, R requests verifying drafts), least squares over the
    measured steps, each step before weighted `decay` times the one after it, c and s held >= 0. `known`
    is False until the steps' sizes spread enough to tell c from F."""

    decay: float = DECAY
    gram: np.ndarray = field(default_factory=lambda: np.zeros((3, 3)))  # sum of w x x^T, x = (1, N, R)
    moment: np.ndarray = field(default_factory=lambda: np.zeros(3))  # sum of w x T x
    fixed_s: float = 0.0  # F
    per_token_s: float = 0.0  # c
    per_request_s: float = (
        0.0  # s: a verifying request's own cost (its attention call, its rows' bookkeeping)
    )
    known: bool = False

    def observe(self, num_tokens: int, seconds: float, num_verifying: int = 0) -> None:
        if num_tokens <= 0 or not 0.0 < seconds < float("inf") or num_verifying < 0:
            return
        x = np.array([1.0, float(num_tokens), float(num_verifying)])
        self.gram = self.decay * self.gram + np.outer(x, x)
        self.moment = self.decay * self.moment + seconds * x
        w = self.gram[0, 0]
        if self.gram[1, 1] / w - (self.gram[0, 1] / w) ** 2 < MIN_SPREAD**2:
            return  # keep the last fit: steps of one size cannot tell F from c
        self.fixed_s, self.per_token_s, self.per_request_s = _nonnegative_fit(self.gram, self.moment)
        self.known = True


def _nonnegative_fit(gram: np.ndarray, moment: np.ndarray) -> tuple[float, float, float]:
    """(F, c, s) minimising the weighted squares with c, s >= 0: the full fit, else the best fit with the
    negative ones held at 0 (a feature that never varied, R before any drafts, is held at 0 too)."""
    ridge = np.diag([0.0, 1e-9, 1e-9]) * gram[0, 0]
    best: tuple[float, float, float] | None = None
    best_err = float("inf")
    for keep in ((0, 1, 2), (0, 1), (0, 2), (0,)):
        idx = list(keep)
        try:
            beta = np.linalg.solve(gram[np.ix_(idx, idx)] + ridge[np.ix_(idx, idx)], moment[idx])
        except np.linalg.LinAlgError:
            continue
        full = np.zeros(3)
        full[idx] = beta
        if full[1] < 0.0 or full[2] < 0.0:
            continue
        err = float(full @ gram @ full - 2.0 * full @ moment)  # the weighted squares, less a constant
        if err < best_err - 1e-15:
            best, best_err = (max(0.0, float(full[0])), float(full[1]), float(full[2])), err
    return best if best is not None else (float(moment[0] / gram[0, 0]), 0.0, 0.0)


def _ewma(old: float, new: float, alpha: float) -> float:
    return (1.0 - alpha) * old + alpha * new


@dataclass(slots=True)
class _RequestState:
    k: AdaptiveK
    acceptance: list[float | None]  # per draft position; None: everyone's (never verified there)


@dataclass
class DraftBudget:
    """The draft lengths of a batch (module docstring). `k` is the configured maximum per request."""

    k: int
    enabled: bool = True  # False: `plan` hands the caps back (AdaptiveK alone)
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
        state = self._state(request_id)
        own = state.acceptance
        for j, (o, g) in enumerate(zip(own, self.overall)):
            if o is not None:
                own[j] = _ewma(o, g, RELAX)
        return state.k.next_k()

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        """A verification of the request's `proposed` drafts accepted the first `accepted` of them."""
        if proposed <= 0:
            return
        state = self._state(request_id)
        state.k.record(proposed, accepted)
        for j in range(min(proposed, accepted + 1, self.k)):
            hit = 1.0 if j < accepted else 0.0
            old = state.acceptance[j]
            state.acceptance[j] = _ewma(self.overall[j] if old is None else old, hit, ALPHA)
            self.overall[j] = _ewma(self.overall[j], hit, GLOBAL_ALPHA)

    def forget(self, request_id: str) -> None:
        """The request ended or was preempted out of its drafts' KV: drop its state."""
        self._requests.pop(request_id, None)

    def observe_step(self, num_tokens: int, seconds: float, num_verifying: int = 0) -> None:
        """A step scored `num_tokens` tokens (drafts included), `num_verifying` requests' drafts among them,
        in `seconds`."""
        self.cost.observe(num_tokens, seconds, num_verifying)

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
        cost = self.cost
        if not self.enabled or not cost.known or cost.fixed_s + cost.per_token_s <= 0.0:
            return [max(0, min(int(c), self.k)) for c in caps]
        return plan_drafts(
            [self.acceptance(r) for r in request_ids],
            caps,
            fixed_s=cost.fixed_s,
            per_token_s=cost.per_token_s + (self.draft_token_s if to_propose else 0.0),
            base_tokens=max(int(base_tokens), len(request_ids)),
            per_request_s=cost.per_request_s,
        )


def plan_drafts(
    acceptance: Sequence[Sequence[float]],
    caps: Sequence[int],
    *,
    fixed_s: float,
    per_token_s: float,
    base_tokens: int,
    per_request_s: float = 0.0,
) -> list[int]:
    """The draft length per request that maximises expected tokens / step seconds (module docstring):
    request i's j-th draft adds P = acceptance[i][0] x ... x acceptance[i][j-1] tokens and `per_token_s`
    seconds, and a request verifying any drafts adds `per_request_s`, to a step of
    `fixed_s + per_token_s x base_tokens` seconds yielding one token a request.

    Dinkelbach's iteration: for the best rate r so far, each request alone takes the length that
    maximises its tokens - r x seconds (a prefix of its drafts, each worth P - r x per_token_s, then
    whether the prefix beats r x per_request_s); the rate of that choice is the next r, until it stops
    rising. The rate rises every round and there are finitely many choices, so it ends, at the best one."""
    costs = (fixed_s, per_token_s, per_request_s)
    if any(not 0.0 <= c < float("inf") for c in costs) or fixed_s + per_token_s <= 0.0:
        raise InvalidArgumentError(f"plan_drafts: need finite costs >= 0, F + c > 0; got {costs!r}")
    if len(acceptance) != len(caps):
        raise InvalidArgumentError(f"plan_drafts: {len(acceptance)} acceptance rows but {len(caps)} caps")
    reach = [_reach(a, cap) for a, cap in zip(acceptance, caps)]  # P_1, P_2, ... up to the cap
    ks = [0] * len(caps)
    base_s = fixed_s + per_token_s * base_tokens
    rate = len(caps) / base_s
    for _ in range(64):
        choice = [_best_length(p, rate, per_token_s, per_request_s) for p in reach]
        gain = len(caps) + sum(sum(p[:k]) for p, k in zip(reach, choice))
        seconds = base_s + sum(per_token_s * k + (per_request_s if k else 0.0) for k in choice)
        if gain / seconds <= rate * (1.0 + 1e-12):
            break
        ks, rate = choice, gain / seconds
    return ks


def _reach(acceptance: Sequence[float], cap: int) -> list[float]:
    """P_j, the chance that the first j drafts are all accepted, for j = 1 .. cap."""
    out, p = [], 1.0
    for a in list(acceptance)[: max(0, int(cap))]:
        p *= max(0.0, min(1.0, float(a)))
        out.append(p)
    return out


def _best_length(reach: list[float], rate: float, per_token_s: float, per_request_s: float) -> int:
    """The draft length maximising tokens - rate x seconds for one request (0 on ties)."""
    best_k, best, value = 0, 0.0, -rate * per_request_s
    for j, p in enumerate(reach, start=1):
        value += p - rate * per_token_s
        if value > best + 1e-15:
            best_k, best = j, value
    return best_k
