"""Publishing event batches over ZeroMQ in vLLM's framing, and subscribing to them without ever lying.

Publisher: a PUB socket sends each batch as three frames `[topic, seq, payload]` (as vLLM's
`ZmqEventPublisher`): `seq` is an 8-byte big-endian sequence number, `payload` the msgpack `EventBatch`. The
last `buffer_steps` payloads are kept, and a ROUTER socket (served by a background thread) answers a replay
request `[b"", start_seq]` from a DEALER with

    [b"", topic, seq, payload]          for every kept batch with seq >= start_seq, then
    [b"", topic, -1, first_seq ++ next_seq]   the end marker: the publisher's first and next sequence numbers

Unlike vLLM (vllm-project/vllm#45174) the replay reply carries the topic, so one DEALER can serve a client
that follows several topics. Sequence numbers are contiguous within one publisher's life (an *incarnation*);
its first number is the microsecond clock at start, so a publisher that restarts on the same endpoint always
numbers above anything the previous one sent. With `announce=True` (the default) the first batch is
`[AllBlocksCleared]`: a consumer written for vLLM that sees the restart drops what it held for the replica.
Create the publisher before its engine stores anything, or that announcement would hide those blocks.

Subscriber (`EventSubscriber`): delivers batches in sequence order and never lets a consumer hold a block the
replica does not:

- a gap (a late join, a message the PUB socket dropped) is replayed from the ROUTER before the next batch;
- `sync()` asks the ROUTER for everything from `next_seq` on: it finds batches lost at the tail (no later
  message would reveal them), a restart while idle, and a publisher that stopped answering
  (`ReplicaUnresponsiveError`, after `replay_timeout_ms`);
- a new incarnation (the publisher restarted) is delivered as a synthetic `[AllBlocksCleared]` batch followed
  by the new incarnation's batches from its first one;
- a range the publisher no longer holds is delivered as a synthetic `[AllBlocksCleared]` followed by what it
  still holds: the consumer's view becomes a subset of the replica's (a missed hit, never a false one),
  `partial` is set until the replica's own next `AllBlocksCleared`, and `lost` counts the missing batches.

Endpoints are ZeroMQ addresses (`ipc:///tmp/x.sock`, `tcp://127.0.0.1:5557`, `tcp://HOST:*` for a free port:
`endpoint` and `replay_endpoint` then say which).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import NamedTuple

import zmq

from pagedkv.core.errors import InvalidArgumentError, PagedKVError
from pagedkv.events.wire import AllBlocksCleared, EventBatch, decode_batch, encode_batch

END_SEQ = -1
# How long a subscriber waits for a replica's replay socket before it calls the replica unresponsive: the
# default of every layer that takes `replay_timeout_ms` (this subscriber, the router's `EventStreams`,
# `LiveRouter`, the Ray request router). A router's check waits this long on a silent replica while its
# decisions wait, so it is short; a live replica on a loaded machine answers in tens of milliseconds
# (docs/scale-out.md).
REPLAY_TIMEOUT_MS = 500


class ReplayGapError(PagedKVError):
    """Batches were lost: the publisher's replay buffer no longer holds them."""


class ReplicaUnresponsiveError(PagedKVError):
    """The publisher's replay socket did not answer in time (the replica is gone or unreachable)."""


def _seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def _seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


class ZmqEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        first_seq: int | None = None,
        announce: bool = True,
        data_parallel_rank: int | None = 0,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        if buffer_steps < 1:
            raise InvalidArgumentError(f"buffer_steps must be >= 1, got {buffer_steps}")
        if first_seq is not None and first_seq < 0:
            raise InvalidArgumentError(f"first_seq must be >= 0, got {first_seq}")
        self._ctx = context or zmq.Context.instance()
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self.first_seq = time.time_ns() // 1000 if first_seq is None else first_seq
        self._next_seq = self.first_seq
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.bind(replay_endpoint)
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve, args=(router,), daemon=True, name="kv-replay")
            self._thread.start()
        if announce:
            self.publish(EventBatch(time.time(), [AllBlocksCleared()], data_parallel_rank))

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def publish(self, batch: EventBatch) -> int:
        """Send one batch; returns its sequence number."""
        payload = encode_batch(batch)
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            self._buffer.append((seq, payload))
        self._pub.send_multipart((self._topic, _seq_bytes(seq), payload))
        return seq

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._pub.close(linger=0)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self, router: zmq.Socket[bytes]) -> None:
        try:
            while not self._stop.is_set():
                if not router.poll(50):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    continue  # not a replay request: ignore it
                client, _, start = frames
                first = _seq(start)
                with self._lock:
                    kept = [(s, p) for s, p in self._buffer if s >= first]
                    end = _seq_bytes(self.first_seq) + _seq_bytes(self._next_seq)
                for seq, payload in kept:
                    router.send_multipart((client, b"", self._topic, _seq_bytes(seq), payload))
                router.send_multipart((client, b"", self._topic, _seq_bytes(END_SEQ), end))
        finally:
            router.close(linger=0)


class ReplayAnswer(NamedTuple):
    """A replay answer: the kept batches from the asked number on, and the publisher's first and next numbers."""

    batches: list[tuple[int, EventBatch]]
    first_seq: int
    next_seq: int


def _cleared() -> EventBatch:
    return EventBatch(time.time(), [AllBlocksCleared()], None)


class EventSubscriber:
    """Receives one publisher's batches in order (see the module docstring for what it guarantees).

    `next_seq` is the next number expected (None before the first delivery: the subscriber then starts from
    the publisher's first batch, or, if that is gone, from a synthetic clear); `first_seq` the publisher's
    incarnation as last seen."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        next_seq: int | None = None,
        replay_timeout_ms: int = REPLAY_TIMEOUT_MS,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self._ctx = context or zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._topic = topic.encode()
        self._replay_endpoint = replay_endpoint
        self._timeout = replay_timeout_ms
        self.next_seq = next_seq
        self.first_seq: int | None = None
        self.replayed = 0  # batches obtained through the replay socket
        self.restarts = 0  # new incarnations seen
        self.lost = 0  # batches missed for good
        self.partial = False  # the consumer's view is a subset until the replica's next AllBlocksCleared

    def poll(self, timeout_ms: int = 0) -> list[tuple[int, EventBatch]]:
        """Every batch available now (waiting up to `timeout_ms` for the first), in sequence order."""
        out: list[tuple[int, EventBatch]] = []
        wait = timeout_ms
        while self._sub.poll(wait):
            wait = 0
            _topic, seq_bytes, payload = self._sub.recv_multipart()
            seq = _seq(seq_bytes)
            if self.next_seq is not None and seq < self.next_seq:
                continue  # already delivered (through a replay)
            if self.next_seq is None or seq > self.next_seq:
                out.extend(self._catch_up())
                continue  # the replay held this one too (or it is older than what was lost)
            out.append(self._deliver(seq, decode_batch(payload)))
        return out

    def sync(self) -> list[tuple[int, EventBatch]]:
        """Ask the publisher for everything from `next_seq` on (tail losses, an idle restart), then anything
        already queued on the SUB socket. `ReplicaUnresponsiveError` if it does not answer in time."""
        return self._catch_up() + self.poll(0)

    def replay(self, first: int, stop: int) -> list[tuple[int, EventBatch]]:
        """Batches [first, stop) from the publisher's replay buffer; `ReplayGapError` if any is gone."""
        got = [(s, b) for s, b in self._ask(first).batches if s < stop]
        if [s for s, _ in got] != list(range(first, stop)):
            raise ReplayGapError(
                f"batches {first}..{stop - 1} were missed; the publisher kept {len(got)} of them"
            )
        self.replayed += len(got)
        return got

    def close(self) -> None:
        self._sub.close(linger=0)

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals -------------------------------------------------------------------------------

    def _deliver(self, seq: int, batch: EventBatch) -> tuple[int, EventBatch]:
        if self.partial and any(isinstance(e, AllBlocksCleared) for e in batch.events):
            self.partial = False  # the replica restated everything: the view is exact again
        self.next_seq = seq + 1
        return seq, batch

    def _catch_up(self) -> list[tuple[int, EventBatch]]:
        """Replay from `next_seq`; handle a new incarnation or a lost range with a synthetic clear."""
        ask = self.next_seq if self.next_seq is not None else 0
        answer = self._ask(ask)
        batches = [(s, b) for s, b in answer.batches if s >= answer.first_seq]
        restarted = self.next_seq is None or answer.first_seq > self.next_seq
        start = answer.first_seq if restarted else ask
        out: list[tuple[int, EventBatch]] = []
        if restarted or (batches and batches[0][0] != start) or (not batches and answer.next_seq > start):
            if self.next_seq is not None and restarted:
                self.restarts += 1
            have = batches[0][0] if batches else answer.next_seq
            if have != start:  # the range [start, have) is gone for good
                self.lost += have - start
                self.partial = True
            out.append((have - 1, _cleared()))
        self.first_seq = answer.first_seq
        self.replayed += len(batches)
        out.extend(self._deliver(s, b) for s, b in batches)
        if not batches:
            self.next_seq = max(answer.next_seq, self.next_seq or 0)
        return out

    def _ask(self, first: int) -> ReplayAnswer:
        if self._replay_endpoint is None:
            raise ReplayGapError(f"batches from {first} on were missed and no replay endpoint is known")
        dealer = self._ctx.socket(zmq.DEALER)
        got: list[tuple[int, EventBatch]] = []
        try:
            dealer.connect(self._replay_endpoint)
            dealer.send_multipart((b"", _seq_bytes(first)))
            while True:
                if not dealer.poll(self._timeout):
                    raise ReplicaUnresponsiveError(
                        f"the replay socket {self._replay_endpoint} did not answer within {self._timeout} ms"
                    )
                _, topic, seq_bytes, payload = dealer.recv_multipart()
                if topic != self._topic:
                    raise ReplayGapError(
                        f"the replay socket answered for topic {topic!r}, not {self._topic!r}"
                    )
                seq = _seq(seq_bytes)
                if seq == END_SEQ:
                    return ReplayAnswer(got, _seq(payload[:8]), _seq(payload[8:16]))
                if seq >= first:
                    got.append((seq, decode_batch(payload)))
        finally:
            dealer.close(linger=0)
