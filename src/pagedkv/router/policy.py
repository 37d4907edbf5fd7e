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
  sequences). Ties go to the least loaded, then round-robin. With `duplicate_weight` (0 by default, 1 for the
  live router: `LIVE_WEIGHTS`) each block to compute that another candidate already holds costs that much
  more: the fleet would compute it twice, and a conversation's history left on the replica that holds it
  keeps drawing its later turns there (a turn moved for a moment's queue recomputes the whole history).

  Blocks on their way (`PrefixMatch.pending`: a request already sent there is computing them now) are not
  computed again, and the queued work that computes them is not charged again either: the request waits
  for those blocks there, but they are work the replica does once, which another replica would repeat. So

      queued work charged = max(queued work - pending blocks, 0)

  Charged in full, that work cancelled the blocks saved: a second request sharing only a system prompt
  with one still prefilling went to the idle replica and computed the prompt again. Where nothing is on its
  way (the simulator's index, an idle fleet) the cost is the formula above unchanged.
- `rank` adds two rules over requests in flight. A request whose own history one replica holds (`sticky`,
  the caller's judgement: `pagedkv.router.live` knows which prefixes requests in flight share) stays there
  unless that replica's requests exceed the least loaded's by more than a threshold. Any other request: when
  the replicas' requests differ by more than the threshold, those within it of the least loaded lead, by
  cost among them, whatever the others hold (a hot prefix, or one on its way, must not pile everything onto
  one replica).

Every policy's `choose(matches, loads)` takes one `PrefixMatch` and one load per replica, in replica order, and
returns the chosen position; `Router` glues a policy to a `ReplicaIndex`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.prefix import BlockKeys, KeyFunction, key_function
from pagedkv.events.wire import external_hash
from pagedkv.router.index import PrefixMatch, ReplicaIndex

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


class LongestPrefix:
    name = "prefix"

    def __init__(self) -> None:
        self._turns = _Turns()

    def choose(self, num_blocks: int, matches: Sequence[PrefixMatch], loads: Sequence[float]) -> int:
        held = [m.gpu + m.local for m in matches]
        top = max(held)
        return self._turns.pick([i for i, h in enumerate(held) if h == top], len(matches))


@dataclass(frozen=True)
class CostWeights:
    compute_weight: float = 1.0
    local_discount: float = 0.1
    remote_discount: float = 0.3
    queue_weight: float = 1.0
    duplicate_weight: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not value >= 0:
                raise InvalidArgumentError(f"{f.name} must be >= 0, got {value!r}")


# The live router's weights (`pagedkv.router.live`, Ray Serve's PagedKVRequestRouter, `pagedkv bench
# replicas`): a block another replica already holds costs four times to compute again (duplicate_weight 3). At
# 1 (until 2026-12-01) a replica a few prefills behind took new conversations whose system prompt only the
# busier one held and computed the prompt again: 3 of 160 first turns a run at 2 replicas in `pagedkv bench
# replicas`, the hit rate 0.1-0.2 points under the fleet's ceiling, for a queue difference of milliseconds
# (docs/scale-out.md). The simulator's tables were measured with `CostWeights()` (no duplicate charge) and keep
# them until they are measured again.
LIVE_WEIGHTS = CostWeights(duplicate_weight=3.0)

# The live router's load-imbalance threshold (requests in flight beyond the least loaded replica's), for a
# conversation's turn to leave its history and for any other request to be sent by load alone. At 8 (until
# 2026-12-01) the lockstep waves of `pagedkv bench replicas`'s closed-loop conversations crossed it every few
# seconds: up to 2 later turns a run moved and recomputed their history, and new conversations computed a system
# prompt again on the lighter replica.
LIVE_IMBALANCE_THRESHOLD = 16


class CostPolicy:
    name = "cost"

    def __init__(self, weights: CostWeights | None = None) -> None:
        self.weights = weights or CostWeights()
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
        imbalance_threshold: int | None = None,
        sticky: int | None = None,
    ) -> tuple[list[int], bool]:
        """Every position, best first, and whether the load-imbalance fallback decided.

        - `sticky` (the position holding the request's own history, e.g. a conversation's earlier turns):
          it comes first unless its requests in flight exceed the least loaded's by more than
          `imbalance_threshold`; then `choose` decides (the history is recomputed elsewhere only if that
          costs less). Moving a turn for a smaller gap trades a history's recomputation, and the cache hit
          that is sure, for a queue difference the router only estimates.
        - otherwise, when the replicas' requests in flight differ by more than `imbalance_threshold`, those
          within the threshold of the least loaded come first, by cost, whatever the others hold (a hot
          prefix must not pile everything onto one replica);
        - otherwise `choose`.

        The rest follow by cost. Without `requests` or a threshold: `sticky` if given, else `choose`, then the
        rest."""
        n = len(matches)
        costs = self.costs(num_blocks, matches, loads)
        heavy = [False] * n  # past the threshold: more requests in flight than the least loaded's + threshold
        if requests is not None and imbalance_threshold is not None:
            least = min(requests)
            heavy = [r - least > imbalance_threshold for r in requests]
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


def make_policy(name: str, weights: CostWeights | None = None) -> Policy:
    if name == "round-robin":
        return RoundRobin()
    if name == "prefix":
        return LongestPrefix()
    if name == "cost":
        return CostPolicy(weights)
    raise InvalidArgumentError(f"unknown router {name!r}; choose one of {', '.join(POLICIES)}")


class Decision(NamedTuple):
    replica: Hashable
    match: PrefixMatch


class Router:
    """A policy over a fixed list of replicas, reading a `ReplicaIndex` the caller keeps fed with events."""

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

    def route(self, hashes: Sequence[int], loads: Sequence[float]) -> Decision:
        if len(loads) != len(self.replicas):
            raise InvalidArgumentError(f"{len(loads)} loads for {len(self.replicas)} replicas")
        found = self.index.match(hashes, self.replicas)
        matches = [found[r] for r in self.replicas]
        i = self.policy.choose(len(hashes), matches, loads)
        return Decision(self.replicas[i], matches[i])
