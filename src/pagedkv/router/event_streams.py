"""The router's subscriptions: one `EventSubscriber` per replica, folded into one `ReplicaIndex`.

    streams = EventStreams(index)
    streams.add("r0", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558")   # a replica's PUB and replay endpoints
    streams.poll()                      # apply every batch that arrived (cheap: call before each decision)
    streams.check()                     # every `sync_interval_s`: replay tails, find restarts, find the dead
    streams.remove("r0")                # the replica is gone: forget what it held

Contract: the index holds a block for a replica only if the replica holds it, up to the batches still in
flight. The subscriber replays gaps and turns restarts and lost ranges into an `AllBlocksCleared` for that
replica (see `pagedkv.events.publisher`); a replica whose replay socket does not answer within
`replay_timeout_ms` (default `REPLAY_TIMEOUT_MS`, 500 ms) is dropped from the index and marked `down` (it
takes no prefix credit) until it answers again, when its whole history is replayed from its publisher (or,
if that is gone, what follows a synthetic clear). `remove` forgets a replica for good (Ray replaced it).

The periodic check that `poll` runs every `sync_interval_s` syncs only the streams that delivered nothing
since the previous one: a stream that delivered is alive, and a batch it lost shows as a gap in its next
one, which `poll` replays at once. A sync is a round trip to the replica, made while the caller waits
(measured in docs/scale-out.md, "Events that never lie"). `check()` called directly syncs every stream.

Not thread-safe: one owner calls every method (the router's event loop).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import zmq

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.events.publisher import REPLAY_TIMEOUT_MS, EventSubscriber, ReplicaUnresponsiveError
from pagedkv.events.wire import EventBatch
from pagedkv.router.index import ReplicaIndex


@dataclass
class StreamState:
    """What the router knows of one replica's stream (for status pages and tests)."""

    endpoint: str
    replay_endpoint: str | None
    down: bool = False
    batches: int = 0
    heard: bool = False  # delivered a batch since the last periodic check


class EventStreams:
    def __init__(
        self,
        index: ReplicaIndex | None = None,
        *,
        replay_timeout_ms: int = REPLAY_TIMEOUT_MS,
        sync_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        if replay_timeout_ms < 1 or sync_interval_s < 0:
            raise InvalidArgumentError("replay_timeout_ms must be >= 1 and sync_interval_s >= 0")
        self.index = index if index is not None else ReplicaIndex()
        self._timeout = replay_timeout_ms
        self._interval = sync_interval_s
        self._clock = clock
        self._ctx = context or zmq.Context.instance()
        self._subs: dict[Hashable, EventSubscriber] = {}
        self.state: dict[Hashable, StreamState] = {}
        self._last_check = clock()

    def __contains__(self, replica: Hashable) -> bool:
        return replica in self._subs

    def replicas(self) -> list[Hashable]:
        return list(self._subs)

    def live(self) -> list[Hashable]:
        """Replicas whose stream answers."""
        return [r for r, s in self.state.items() if not s.down]

    def add(self, replica: Hashable, endpoint: str, replay_endpoint: str | None) -> None:
        """Follow a replica's events (its index entry starts empty and fills from its publisher's history)."""
        if replica in self._subs:
            raise InvalidArgumentError(f"replica {replica!r} is already followed; remove it first")
        self._subs[replica] = EventSubscriber(
            endpoint, replay_endpoint, replay_timeout_ms=self._timeout, context=self._ctx
        )
        self.state[replica] = StreamState(endpoint, replay_endpoint)

    def remove(self, replica: Hashable) -> None:
        """Stop following a replica and drop everything the index holds for it (unknown replicas: no-op)."""
        sub = self._subs.pop(replica, None)
        if sub is not None:
            sub.close()
        self.state.pop(replica, None)
        self.index.clear(replica)

    def poll(self, *, sync: bool = True) -> int:
        """Apply every batch that has arrived; returns how many. With `sync`, runs the periodic check when it
        is due (a caller about to decide passes False: a decision does not wait for a round trip)."""
        n = 0
        for replica, sub in self._subs.items():
            if self.state[replica].down:
                continue
            try:
                n += self._apply(replica, sub.poll(0))
            except ReplicaUnresponsiveError:  # a gap whose replay did not answer
                self._down(replica)
        if sync and self._clock() - self._last_check >= self._interval:
            n += self.check(silent_only=True)
        return n

    def check(self, *, silent_only: bool = False) -> int:
        """Sync every stream through its replay socket: tail losses and idle restarts are applied, a replica
        that does not answer is dropped from the index and marked down, one that answers again is rebuilt.
        `silent_only` (the periodic check): only the streams that delivered nothing since the last check."""
        self._last_check = self._clock()
        n = 0
        for replica, sub in self._subs.items():
            state = self.state[replica]
            heard, state.heard = state.heard, False
            if silent_only and heard and not state.down:
                continue
            try:
                if state.down:
                    sub.next_seq = None  # rebuild from the publisher's history (or a synthetic clear)
                batches = sub.sync()
            except ReplicaUnresponsiveError:
                self._down(replica)
                continue
            state.down = False
            n += self._apply(replica, batches)
            state.heard = False  # what the sync brought does not prove the stream alive until the next check
        return n

    def subscriber(self, replica: Hashable) -> EventSubscriber:
        return self._subs[replica]

    def close(self) -> None:
        for replica in list(self._subs):
            self.remove(replica)

    def _apply(self, replica: Hashable, batches: list[tuple[int, EventBatch]]) -> int:
        for _, batch in batches:
            self.index.apply(replica, batch)
        state = self.state[replica]
        state.batches += len(batches)
        state.heard = state.heard or bool(batches)
        return len(batches)

    def _down(self, replica: Hashable) -> None:
        self.state[replica].down = True
        self.index.clear(replica)
