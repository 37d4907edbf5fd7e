"""Sample groups sent as separate requests: one prompt's prefill computed once for the whole group.

RL trainers (verl) send n samples of a prompt as n requests of `n=1` sharing a group id. Requests that
arrive together would each compute the prompt: none finds it in the prefix cache before one has written
it. `PrefillGroups` holds back every request whose group already has a request with the same prompt (and
cache salt) still computing its prefill (the leader); once the leader's prompt KV is written, the held
requests are queued and find the prompt's full blocks in the prefix cache: only its last partial block is
computed again. `shared_tokens` counts the prompt tokens the held requests took from the cache (the
server's `pagedkv_group_prefill_shared_tokens_total`).

The engine asks `hold` at the door, `release` before each schedule, `take` when it ends a held request,
and counts held requests as unfinished. Invariants (`check_invariants`):

- a request is held by at most one group, and a held request is not queued: between `hold` and its
  `release` / `take` it is nowhere else, so a group never drops one (a request that comes while its group
  still holds others waits with them, even when the leader's prompt is written: the next `release` queues
  them all);
- a leader that ended before its prompt was written hands the lead to the group's first held request
  (queued at the next `release`); the others wait for its prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedkv.core.errors import InvalidArgumentError

GroupKey = tuple[str, tuple[int, ...], Any]


@dataclass
class _Group:
    leader: Any  # the leader's Request
    held: list[Any] = field(default_factory=list)  # the held requests' _Tracked, in arrival order


class PrefillGroups:
    """The engine's groups of requests waiting for a leader's prefill (see the module docstring)."""

    def __init__(self) -> None:
        self._groups: dict[GroupKey, _Group] = {}
        self._held: set[str] = set()  # the held requests' ids (the groups' lists, for O(1) lookups)
        self._counting: list[Any] = []  # released requests not yet scheduled: their cache hit is counted then
        self.shared_tokens = 0  # see count()

    @staticmethod
    def check(group_id: object) -> None:
        if group_id is not None and (not isinstance(group_id, str) or not group_id):
            raise InvalidArgumentError(f"group_id must be a non-empty string or None, got {group_id!r}")

    def hold(self, tracked: Any, group_id: str, is_live: Callable[[str], bool]) -> bool:
        """True if `tracked` waits (the engine then keeps it out of the scheduler): for its group's leader, or
        with the group's held requests until the next `release`; False if it leads (the engine queues it as
        usual)."""
        request = tracked.request
        key = (group_id, tuple(int(t) for t in request.prompt_token_ids), request.salt)
        group = self._groups.get(key)
        if group is not None and (group.held or self._computing(group.leader, is_live)):
            group.held.append(tracked)  # held ones not queued yet: replacing the group would drop them
            self._held.add(request.request_id)
            return True
        self._groups[key] = _Group(request)
        return False

    def count(self) -> int:
        """`shared_tokens`, after counting the cache hits of the released requests scheduled since."""
        for r in [r for r in self._counting if r.num_computed_tokens > 0]:
            self.shared_tokens += int(r.num_cached_tokens)
            self._counting.remove(r)
        return self.shared_tokens

    def release(self, accept: Callable[[Any], None], is_live: Callable[[str], bool]) -> None:
        """Queue the held requests of every group whose leader's prompt is written; where the leader ended
        before writing it, queue the first held request alone: it leads now."""
        self.count()
        self._counting = [r for r in self._counting if is_live(r.request_id)]
        for key, group in list(self._groups.items()):
            leader = group.leader
            if self._computing(leader, is_live):
                continue
            unwritten = leader.num_computed_tokens < leader.num_prompt_tokens  # it ended first
            promoted = group.held[:1] if unwritten else []
            for tracked in promoted or group.held:
                self._held.discard(tracked.request.request_id)
                accept(tracked)
                self._counting.append(tracked.request)  # what it takes of the old leader's prompt counts
            if promoted:
                self._groups[key] = _Group(promoted[0].request, group.held[1:])
            else:
                del self._groups[key]

    def take(self, request_id: str) -> Any:
        """The held request `request_id`'s _Tracked, no longer held (the engine queues it to end it), or None."""
        if request_id not in self._held:
            return None
        for group in self._groups.values():
            for tracked in group.held:
                if tracked.request.request_id == request_id:
                    group.held.remove(tracked)
                    self._held.discard(request_id)
                    return tracked
        raise AssertionError(f"PrefillGroups: {request_id!r} is counted as held but no group holds it")

    def is_held(self, request_id: str) -> bool:
        return request_id in self._held

    def has_held(self) -> bool:
        return bool(self._held)

    def held_ids(self) -> set[str]:
        return set(self._held)

    @staticmethod
    def _computing(leader: Any, is_live: Callable[[str], bool]) -> bool:
        return bool(is_live(leader.request_id)) and leader.num_computed_tokens < leader.num_prompt_tokens

    def check_invariants(self, is_live: Callable[[str], bool]) -> None:
        """A request is held once, and a held request is not queued (`is_live`: the engine's queued ids)."""
        ids = [t.request.request_id for g in self._groups.values() for t in g.held]
        assert len(ids) == len(set(ids)), f"PrefillGroups: a request held twice in {ids}"
        assert set(ids) == self._held, f"PrefillGroups: held ids {sorted(self._held)}, groups hold {sorted(ids)}"
        queued = [i for i in ids if is_live(i)]
        assert not queued, f"PrefillGroups: held requests {queued} are queued too"
