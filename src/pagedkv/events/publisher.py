"""Publishing event batches over ZeroMQ the way vLLM's `ZmqEventPublisher` does, and subscribing to them.

Publisher: a PUB socket sends each batch as three frames `[topic, seq, payload]`: `seq` is an 8-byte big-endian
sequence number (0, 1, 2, ...), `payload` the msgpack `EventBatch`. The last `buffer_steps` payloads are kept;
a ROUTER socket answers a replay request (frames `[b"", start_seq]` from a DEALER, 8 bytes big-endian) with
`[b"", seq, payload]` for every kept batch with `seq >= start_seq`, then `[b"", -1 (signed), b""]`. The ROUTER
is served by a background thread; `publish` runs in the caller's thread (ZeroMQ sockets are not shared).

Subscriber: a SUB socket (and a DEALER for replays). `poll()` returns the next batches in sequence order: when
a batch arrives after a gap (a late join, or messages the PUB socket dropped) it first asks the replay socket
for the missing range. If the publisher no longer holds it, `ReplayGapError` says which sequence numbers are
lost (the consumer should then drop that replica's state and wait for an `AllBlocksCleared`).

Endpoints are ZeroMQ addresses (`ipc:///tmp/x.sock`, `tcp://127.0.0.1:5557`); tests bind to loopback or ipc.
"""

from __future__ import annotations

import threading
from collections import deque

import zmq

from pagedkv.core.errors import InvalidArgumentError, PagedKVError
from pagedkv.events.wire import EventBatch, decode_batch, encode_batch

END_SEQ = -1


class ReplayGapError(PagedKVError):
    """Batches were lost: the publisher's replay buffer no longer holds them."""


def _seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


class ZmqEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        if buffer_steps < 1:
            raise InvalidArgumentError(f"buffer_steps must be >= 1, got {buffer_steps}")
        self._ctx = context or zmq.Context.instance()
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._next_seq = 0
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
                first = int.from_bytes(start, "big", signed=True)
                with self._lock:
                    kept = [(s, p) for s, p in self._buffer if s >= first]
                for seq, payload in kept:
                    router.send_multipart((client, b"", _seq_bytes(seq), payload))
                router.send_multipart((client, b"", _seq_bytes(END_SEQ), b""))
        finally:
            router.close(linger=0)


class EventSubscriber:
    """Receives one publisher's batches in order, replaying gaps; `next_seq` is the next expected number."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        next_seq: int = 0,
        replay_timeout_ms: int = 5000,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self._ctx = context or zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._timeout = replay_timeout_ms
        self.next_seq = next_seq
        self.replayed = 0  # batches obtained through the replay socket

    def poll(self, timeout_ms: int = 0) -> list[tuple[int, EventBatch]]:
        """Every batch available now (waiting up to `timeout_ms` for the first), in sequence order."""
        out: list[tuple[int, EventBatch]] = []
        wait = timeout_ms
        while self._sub.poll(wait):
            wait = 0
            _topic, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq < self.next_seq:
                continue  # already delivered (through a replay)
            if seq > self.next_seq:
                out.extend(self.replay(self.next_seq, seq))
            out.append((seq, decode_batch(payload)))
            self.next_seq = seq + 1
        return out

    def replay(self, first: int, stop: int) -> list[tuple[int, EventBatch]]:
        """Batches [first, stop) from the publisher's replay buffer; `ReplayGapError` if any is gone."""
        if self._replay_endpoint is None:
            raise ReplayGapError(f"batches {first}..{stop - 1} were missed and no replay endpoint is known")
        dealer = self._ctx.socket(zmq.DEALER)
        try:
            dealer.connect(self._replay_endpoint)
            dealer.send_multipart((b"", _seq_bytes(first)))
            got: list[tuple[int, EventBatch]] = []
            while True:
                if not dealer.poll(self._timeout):
                    raise ReplayGapError(f"the replay socket did not answer within {self._timeout} ms")
                _, seq_bytes, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    break
                if first <= seq < stop:
                    got.append((seq, decode_batch(payload)))
        finally:
            dealer.close(linger=0)
        if [s for s, _ in got] != list(range(first, stop)):
            raise ReplayGapError(f"batches {first}..{stop - 1} were missed; the publisher kept {len(got)} of them")
        self.replayed += len(got)
        return got

    def close(self) -> None:
        self._sub.close(linger=0)

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
