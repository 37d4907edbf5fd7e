"""Routing policies: which replica should serve a request, given the fleet's prefix index and its load.

A request is its chain of block hashes (`request_hashes`: one per full block of the prompt, as the engine keys
them, without the block holding the last prompt token, which is always computed). For each replica the index
says how many leading blocks it holds on its GPU, how many more it can load from its own CPU/DISK tier, and how
many more the shared REMOTE store holds (`PrefixMatch`). Policies:

- `round-robin`: replicas in turn; ignores the cache (the baseline every fleet starts with).
- `prefix`: pure longest prefix: the replica holding the most leading blocks (any local medium); ties go
  round-robin. Load is ignored, so when many requests share a first block (a system prompt) the first replica
  to compute it wins every later request: it concentrates load, which is why load must count.
- `cost`: the replica minimising

      cost = compute_weight * blocks to compute
           + local_discount * blocks to load from its CPU/DISK + remote_discount * blocks to load from REMOTE
           + queue_weight * queued work

  with queued work in blocks (the caller's measure, e.g. prompt blocks not yet computed plus running
  sequences). Ties go to the least loaded, then round-robin. With `duplicate_weight` (3 by default) each
  block to compute that another candidate already holds costs that much more: the fleet would compute it
  twice, and a conversation's history left on the replica that holds it keeps drawing its later turns there
  (a turn moved for a moment's queue recomputes the whole history).

  Blocks on their way (`PrefixMatch.pending`: a request already sent there is computing them now) are not
  computed again, and the queued work that computes them is not charged again either: the request waits
  for those blocks there, but they are work the replica does once, which another replica would repeat. So

      queued work charged = max(queued work - pending blocks, 0)

  (charged in full, that work would cancel the blocks saved, and a request sharing a system prompt with
  one still prefilling would go to an idle replica and compute the prompt again). Where nothing is on its
  way (an idle fleet) the cost is the formula above unchanged.
- `CostRouting.rank` adds two rules over requests in flight. A request whose own history one replica holds
  (`sticky`: `FleetLoad.private`) stays there unless that replica's requests exceed the least loaded's by
  more than the imbalance threshold (16 by default). Any other request: when the replicas' requests differ
  by more than the threshold, those within it of the least loaded lead, by cost among them, whatever the
  others hold (a hot prefix, or one on its way, must not pile everything onto one replica).

Every policy's `choose(num_blocks, matches, loads)` takes one `PrefixMatch` and one load per replica, in
replica order, and returns the chosen position; its `rank` orders them all. `rank` (the function) is the one
decision the live router (`pagedkv.router.live`) and the simulator (`pagedkv.sim.replicas`, through `Router`)
make: the index's matches, the load model's queued work, requests in flight, blocks on their way and a
request's own history (`pagedkv.router.load.FleetLoad`), ranked by the policy.
"""

from __future__ import annotations

from collections.abc import Container, Hashable, Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.prefix import BlockKeys, KeyFunction, key_function
from pagedkv.events.wire import GPU, external_hash
from pagedkv.router.index import PrefixMatch, ReplicaIndex
from pagedkv.router.load import FleetLoad, placement

POLICIES = ("round-robin", "prefix", "cost")


def request_hashes(
    token_ids: npt.ArrayLike,
    block_size: int,
    *,
    salt: bytes = b"",
    hash_fn: str | KeyFunction = "sha256",
    epoch: int = 0,
) -> list[int]:
    """The published hashes of a prompt's cacheable blocks (what a replica's events would call them)."""
    tokens = np.ascontiguousarray(np.asarray(token_ids, dtype=np.int32))
    keys = BlockKeys(salt)
    keys.bind(key_function(hash_fn), epoch)
    n = (len(tokens) - 1) // block_size if len(tokens) else 0
    return [external_hash(keys.key(i, tokens[i * block_size : (i + 1) * block_size])) for i in range(n)]


class Policy(Protocol):
    name: str

    def choose(self, num_blocks: int, matches: Sequence[PrefixMatch], loads: Sequence[float]) -> int: ...

    def rank(
        self,
        num_blocks: int,
        matches: Sequence[PrefixMatch],
        loads: Sequence[float],
        requests: Sequence[int] | None = None,
        sticky: int | None = None,
    ) -> tuple[list[int], bool]: ...


def _choice_first(first: int, n: int) -> tuple[list[int], bool]:
    return [first] + [i for i in range(n) if i != first], False


class _Turns:
    """Round-robin among a set of candidates, remembering where the last pick was."""

    def __init__(self) -> None:
        self.next = 0

    def pick(self, candidates: Sequence[int], n: int) -> int:
        best = min(candidates, key=lambda i: (i - self.next) % n)
        self.next = (best + 1) % n
        return best


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._turns = _Turns()

    def choose(self, num_blocks: int, matches: Sequence[PrefixMatch], loads: Sequence[float]) -> int:
        return self._turns.pick(range(len(matches)), len(matches))

    def rank(
        self,
        num_blocks: int,
        matches: Sequence[PrefixMatch],
        loads: Sequence[float],
        requests: Sequence[int] | None = None,
        sticky: int | None = None,
    ) -> tuple[list[int], bool]:
        """`choose` first, the rest in replica order."""
        return _choice_first(self.choose(num_blocks, matches, loads), len(matches))


class LongestPrefix:
    name = "prefix"

    def __init__(self) -> None:
        self._turns = _Turns()

    def choose(self, num_blocks: int, matches: Sequence[PrefixMatch], loads: Sequence[float]) -> int:
        held = [m.gpu + m.local for m in matches]
        top = max(held)
        return self._turns.pick([i for i, h in enumerate(held) if h == top], len(matches))

    def rank(
        self,
        num_blocks: int,
        matches: Sequence[PrefixMatch],
        loads: Sequence[float],
        requests: Sequence[int] | None = None,
        sticky: int | None = None,
    ) -> tuple[list[int], bool]:
        """`choose` first, the rest in replica order."""
        return _choice_first(self.choose(num_blocks, matches, loads), len(matches))


@dataclass(frozen=True)
class CostWeights:
    """The cost's weights. The defaults are the ones the live router (`pagedkv.router.live`, Ray Serve's
    PagedKVRequestRouter, `pagedkv bench replicas`) and the simulator (`pagedkv simulate --replicas`) run: a
    block another replica already holds costs four times to compute again (`duplicate_weight` 3). At 1 a
    replica a few prefills behind took new conversations whose system prompt only the busier one held and
    computed the prompt again (3 of 160 first turns a run at 2 replicas in `pagedkv bench replicas`,
    docs/scale-out.md)."""

    compute_weight: float = 1.0
    local_discount: float = 0.1
    remote_discount: float = 0.3
    queue_weight: float = 1.0
    duplicate_weight: float = 3.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not value >= 0:
                raise InvalidArgumentError(f"{f.name} must be >= 0, got {value!r}")


LIVE_WEIGHTS = CostWeights()  # the live router's weights: the defaults

# The load-imbalance threshold (requests in flight beyond the least loaded replica's), for a conversation's
# turn to leave its history and for any other request to be sent by load alone. At 8 the lockstep waves of
# `pagedkv bench replicas`'s closed-loop conversations crossed it every few seconds: up to 2 later turns a run
# moved and recomputed their history, and new conversations computed a system prompt again on the lighter
# replica.
LIVE_IMBALANCE_THRESHOLD = 16


class CostRouting:
    """The `cost` routing policy (see the module docstring): the weights and the imbalance threshold, whose
    defaults the live router and the simulator share."""

    name = "cost"

    def __init__(self, weights: CostWeights | None = None, imbalance_threshold: int = LIVE_IMBALANCE_THRESHOLD) -> None:
        if isinstance(imbalance_threshold, bool) or not isinstance(imbalance_threshold, int) or imbalance_threshold < 0:
            raise InvalidArgumentError(f"imbalance_threshold must be an int >= 0, got {imbalance_threshold!r}")
        self.weights = weights or CostWeights()
        self.imbalance_threshold = imbalance_threshold
        self._turns = _Turns()

    def cost(self, num_blocks: int, match: PrefixMatch, load: float, held_elsewhere: int = 0) -> float:
        """The replica's cost for a request of `num_blocks` cacheable blocks; `held_elsewhere`: the longest
        prefix of them another candidate holds (the blocks here beyond `match` up to it would be computed
        twice in the fleet, charged `duplicate_weight` more each)."""
        w = self.weights
        compute = max(num_blocks - match.total, 0)
        duplicate = max(min(held_elsewhere, num_blocks) - match.total, 0)
        queued = max(load - match.pending, 0.0)  # the work computing its blocks on their way is shared
        return (
            w.compute_weight * compute
            + w.duplicate_weight * duplicate
            + w.local_discount * match.local
            + w.remote_discount * match.remote
            + w.queue_weight * queued
        )

    def costs(self, num_blocks: int, matches: Sequence[PrefixMatch], loads: Sequence[float]) -> list[float]:
        """Every candidate's `cost`, each with the longest prefix the others hold."""
        held = [m.total for m in matches]
        others = [max(held[:i] + held[i + 1 :], default=0) for i in range(len(held))]
        return [self.cost(num_blocks, m, load, o) for m, load, o in zip(matches, loads, others)]

    def choose(self, num_blocks: int, matches: Sequence[PrefixMatch], loads: Sequence[float]) -> int:
        costs = self.costs(num_blocks, matches, loads)
        low = min(costs)
        tied = [i for i, c in enumerate(costs) if c <= low + 1e-9]
        least = min(loads[i] for i in tied)
        return self._turns.pick([i for i in tied if loads[i] == least], len(matches))

    def rank(
        self,
        num_blocks: int,
        matches: Sequence[PrefixMatch],
        loads: Sequence[float],
        requests: Sequence[int] | None = None,
        sticky: int | None = None,
    ) -> tuple[list[int], bool]:
        """Every position, best first, and whether the load-imbalance fallback decided.

        - `sticky` (the position holding the request's own history, e.g. a conversation's earlier turns):
          it comes first unless its requests in flight exceed the least loaded's by more than the
          imbalance threshold; then `choose` decides (the history is recomputed elsewhere only if that
          costs less). Moving a turn for a smaller gap trades a history's recomputation, and the cache hit
          that is sure, for a queue difference the router only estimates.
        - otherwise, when the replicas' requests in flight differ by more than `imbalance_threshold`, those
          within the threshold of the least loaded come first, by cost, whatever the others hold (a hot
          prefix must not pile everything onto one replica);
        - otherwise `choose`.

        The rest follow by cost. Without `requests`: `sticky` if given, else `choose`, then the rest."""
        n = len(matches)
        costs = self.costs(num_blocks, matches, loads)
        heavy = [False] * n  # past the threshold: more requests in flight than the least loaded's + threshold
        if requests is not None:
            least = min(requests)
            heavy = [r - least > self.imbalance_threshold for r in requests]
        if sticky is not None and not heavy[sticky]:
            first = sticky
        elif sticky is None and any(heavy):
            # the fallback: the replicas within the threshold lead, by cost among them (one may hold the
            # prefix too); the heavy ones follow, least loaded first
            light = sorted((i for i in range(n) if not heavy[i]), key=lambda i: (costs[i], loads[i]))
            assert requests is not None, "policy: the imbalance fallback without requests"
            return light + sorted((i for i in range(n) if heavy[i]), key=lambda i: (requests[i], loads[i])), True
        else:
            first = self.choose(num_blocks, matches, loads)
        return [first] + sorted(
            (i for i in range(n) if i != first), key=lambda i: (costs[i], loads[i])
        ), False


def make_policy(name: str) -> Policy:
    """A policy by name, with the default weights and threshold."""
    if name == "round-robin":
        return RoundRobin()
    if name == "prefix":
        return LongestPrefix()
    if name == "cost":
        return CostRouting()
    raise InvalidArgumentError(f"unknown router {name!r}; choose one of {', '.join(POLICIES)}")


@dataclass(frozen=True)
class Ranking:
    """A decision: candidates best first, with what the index and the load model predicted for each."""

    order: list[Hashable]
    matches: dict[Hashable, PrefixMatch]
    loads: dict[Hashable, float]
    fallback: bool  # the load-imbalance fallback decided
    num_blocks: int  # the request's cacheable blocks
    hashes: dict[Hashable, list[int]]  # per candidate, the request's cacheable blocks as it names them


def rank(
    policy: Policy,
    index: ReplicaIndex,
    load: FleetLoad,
    candidates: Sequence[Hashable],
    hashes: dict[Hashable, list[int]],
    followed: Container[Hashable] | None = None,
) -> Ranking:
    """The one routing decision, the live router's and the simulator's: each candidate's match in the index
    (none where its events are not `followed`) extended by the blocks on their way there, its queued work and
    requests in flight from `load`, the request's own history (`FleetLoad.private`) as `sticky`, ranked by
    `policy.rank`."""
    load.prefills_done(lambda h, r: GPU in index.media(h, r))
    matches: dict[Hashable, PrefixMatch] = {}
    for r in candidates:
        found = index.match(hashes[r], [r])[r] if followed is None or r in followed else PrefixMatch()
        matches[r] = load.match(r, found, hashes[r])
    loads = {r: load.load(r) for r in candidates}
    holder = load.private(candidates, matches, hashes)
    positions, fallback = policy.rank(
        max(len(hashes[r]) for r in candidates), [matches[r] for r in candidates], [loads[r] for r in candidates],
        [load.requests(r) for r in candidates], None if holder is None else candidates.index(holder),
    )  # fmt: skip
    order = [candidates[i] for i in positions]
    return Ranking(order, matches, loads, fallback, max(len(hashes[r]) for r in candidates), hashes)


class Decision(NamedTuple):
    replica: Hashable
    match: PrefixMatch


class Router:
    """A policy over a fixed list of replicas, reading a `ReplicaIndex` the caller keeps fed with events and
    keeping the requests it routed in a `FleetLoad` (the caller says when each completes: `load.release`)."""

    def __init__(
        self, replicas: Sequence[Hashable], policy: str | Policy = "cost", index: ReplicaIndex | None = None
    ):
        if not replicas:
            raise InvalidArgumentError("a router needs at least one replica")
        if len(set(replicas)) != len(replicas):
            raise InvalidArgumentError("replica names must be distinct")
        self.replicas = list(replicas)
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.index = index if index is not None else ReplicaIndex()
        self.load = FleetLoad()

    def route(self, request_id: Hashable, hashes: Sequence[int]) -> Decision:
        """Rank the replicas for a request of cacheable blocks `hashes` and place it on the first."""
        if request_id in self.load:
            raise InvalidArgumentError(f"request {request_id!r} is routed already; release it first")
        ranking = rank(self.policy, self.index, self.load, self.replicas, dict.fromkeys(self.replicas, list(hashes)))
        best = ranking.order[0]
        match = ranking.matches[best]
        self.load.place(request_id, placement(best, hashes, match))
        return Decision(best, match)
