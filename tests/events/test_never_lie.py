"""Events that never lie: a router following replicas over real ZMQ sockets keeps an index equal to what each
replica holds, through evictions, a subscriber that drops messages (in the middle and at the tail), a replica
that restarts on the same endpoints, a replica that dies, and a replay buffer too small to fill a gap."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq
from event_workload import gpu_hashes, make_replica, random_steps

from pagedkv.events import GPU, AllBlocksCleared, EventBatch, decode_batch
from pagedkv.events.publisher import EventSubscriber, ReplicaUnresponsiveError, ZmqEventPublisher
from pagedkv.router.event_streams import EventStreams


class Replica:
    """A manager, its event feed and its publisher: what one engine replica runs."""

    def __init__(self, folder, name: str, buffer_steps: int = 10_000) -> None:
        self.m, self.feed = make_replica(num_blocks=16)  # small: the workload evicts
        self.pub = ZmqEventPublisher(
            f"ipc://{folder}/{name}.pub", f"ipc://{folder}/{name}.replay", buffer_steps=buffer_steps
        )

    def publish(self) -> None:
        self.feed.poll()
        batch = self.feed.log.take_batch()
        if batch is not None:
            self.pub.publish(batch)

    def held(self) -> set[int]:
        return gpu_hashes(self.m, self.feed)

    def run(self, walk, steps: int) -> None:
        """`steps` steps of a `random_steps` workload, each one's events published."""
        for _ in range(steps):
            next(walk)
            self.publish()


def settle(streams: EventStreams, replicas: dict[str, Replica]) -> None:
    """Poll and sync until every live stream has applied everything its publisher sent."""
    deadline = time.monotonic() + 20
    while True:
        streams.poll()
        streams.check()
        if all(streams.subscriber(n).next_seq == r.pub.next_seq for n, r in replicas.items()):
            return
        assert time.monotonic() < deadline, "streams did not settle"
        time.sleep(0.01)


def test_router_view_equals_every_replica_after_drops_a_restart_and_a_death(tmp_path) -> None:
    rng = np.random.default_rng(11)
    replicas = {n: Replica(tmp_path, n) for n in ("a", "b", "c")}
    streams = EventStreams(replay_timeout_ms=300, sync_interval_s=3600)  # checks only when the test asks
    for n, r in replicas.items():
        streams.add(n, r.pub.endpoint, r.pub.replay_endpoint)
    walks = {n: random_steps(rng, r.m, r.feed, 240) for n, r in replicas.items()}
    b_sub = streams.subscriber("b")._sub
    evicted = 0
    marks: dict[int, int] = {}  # step -> b's next sequence number
    try:
        for step in range(240):
            if step == 120:  # c restarts: a fresh engine (empty cache) on the same endpoints
                replicas["c"].pub.close()
                replicas["c"] = Replica(tmp_path, "c")
                walks["c"] = random_steps(rng, replicas["c"].m, replicas["c"].feed, 120)
            for n, r in replicas.items():
                before = len(r.held())
                next(walks[n])
                evicted += max(0, before - len(r.held()))
                r.publish()
            marks[step] = replicas["b"].pub.next_seq
            if step == 40:  # b's subscriber stops receiving: the PUB socket drops b's batches for it
                b_sub.setsockopt(zmq.UNSUBSCRIBE, b"")
            if step == 90:
                b_sub.setsockopt(zmq.SUBSCRIBE, b"")
            if step == 230:  # and drops the tail: nothing after it reveals the gap but check()
                b_sub.setsockopt(zmq.UNSUBSCRIBE, b"")
            streams.poll()
        settle(streams, replicas)
        for n, r in replicas.items():
            assert streams.index.state(n).get(GPU, set()) == r.held(), n
        assert evicted > 0
        missed = (marks[90] - marks[40]) + (marks[239] - marks[230])  # both came through the replay socket
        assert missed > 10 and streams.subscriber("b").replayed >= missed
        assert streams.subscriber("c").restarts == 1
        assert not any(streams.subscriber(n).partial for n in replicas)

        replicas["a"].pub.close()  # a dies: its stream stops answering, the router forgets what it held
        assert streams.index.state("a")
        streams.check()
        assert streams.state["a"].down and streams.index.state("a") == {}
        assert streams.live() == ["b", "c"]
        for n in ("b", "c"):
            assert streams.index.state(n).get(GPU, set()) == replicas[n].held()
        streams.remove("a")
        assert "a" not in streams
    finally:
        streams.close()
        for r in replicas.values():
            r.pub.close()


def test_a_replica_that_answers_again_is_rebuilt_from_its_history(tmp_path) -> None:
    rng = np.random.default_rng(3)
    r = Replica(tmp_path, "r")
    streams = EventStreams(replay_timeout_ms=300, sync_interval_s=3600)
    streams.add("r", r.pub.endpoint, r.pub.replay_endpoint)
    walk = random_steps(rng, r.m, r.feed, 60, ops=False)
    try:
        r.run(walk, 30)
        settle(streams, {"r": r})
        streams._down("r")  # as if one check had timed out
        assert streams.index.state("r") == {}
        r.run(walk, 30)
        streams.check()
        assert not streams.state["r"].down
        settle(streams, {"r": r})
        assert streams.index.state("r").get(GPU, set()) == r.held()
    finally:
        streams.close()
        r.pub.close()


def test_a_range_gone_from_the_buffer_leaves_a_subset_until_the_replica_clears(tmp_path) -> None:
    rng = np.random.default_rng(5)
    r = Replica(tmp_path, "r", buffer_steps=4)
    streams = EventStreams(replay_timeout_ms=300, sync_interval_s=3600)
    streams.add("r", r.pub.endpoint, r.pub.replay_endpoint)
    sub = streams.subscriber("r")
    walk = random_steps(rng, r.m, r.feed, 100, ops=False)
    try:
        r.run(walk, 10)
        settle(streams, {"r": r})
        sub._sub.setsockopt(zmq.UNSUBSCRIBE, b"")
        r.run(walk, 40)  # far more batches than the publisher keeps
        sub._sub.setsockopt(zmq.SUBSCRIBE, b"")
        settle(streams, {"r": r})
        view = streams.index.state("r").get(GPU, set())
        assert sub.partial and sub.lost > 0
        assert view <= r.held()  # never a block the replica does not hold
        r.feed.reset()  # the replica's own AllBlocksCleared: exact again
        r.run(walk, 10)
        settle(streams, {"r": r})
        assert not sub.partial
        assert streams.index.state("r").get(GPU, set()) == r.held()
    finally:
        streams.close()
        r.pub.close()


def test_the_replay_reply_carries_the_topic_and_the_publishers_numbers(tmp_path) -> None:
    with ZmqEventPublisher(f"ipc://{tmp_path}/p", f"ipc://{tmp_path}/r", topic="kv@r1", first_seq=100) as pub:
        pub.publish(EventBatch(0.0, [], 0))
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        frames = []
        while True:
            assert dealer.poll(2000)
            frames.append(dealer.recv_multipart())
            if int.from_bytes(frames[-1][2], "big", signed=True) == -1:
                break
        dealer.close(linger=0)
        assert [f[1] for f in frames] == [b"kv@r1"] * 3  # the announce, the batch, the end marker
        assert [int.from_bytes(f[2], "big", signed=True) for f in frames] == [100, 101, -1]
        assert decode_batch(frames[0][3]).events == [AllBlocksCleared()]
        assert frames[2][3] == (100).to_bytes(8, "big") + (102).to_bytes(8, "big")
        with EventSubscriber(pub.endpoint, pub.replay_endpoint, topic="kv@r1") as sub:
            got = sub.sync()
            assert [s for s, _ in got][1:] == [100, 101] and sub.next_seq == 102


def test_a_publisher_that_never_answers_is_unresponsive(tmp_path) -> None:
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)  # bound, but nobody serves it
    silent.bind(f"ipc://{tmp_path}/silent")
    try:
        sub = EventSubscriber(f"ipc://{tmp_path}/nopub", f"ipc://{tmp_path}/silent", replay_timeout_ms=100)
        with sub, pytest.raises(ReplicaUnresponsiveError):
            sub.sync()
    finally:
        silent.close(linger=0)
