"""Managers' events, through the log and a real ZMQ PUB/SUB stream, rebuild an index equal to their state."""

from __future__ import annotations

import time

import numpy as np
import pytest
from event_workload import BS, gpu_hashes, make_replica, random_steps

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.prefix import root_key, sha256_key
from pagedkv.events import GPU, BlockStored, decode_batch, encode_batch
from pagedkv.events.publisher import EventSubscriber, ReplayGapError, ZmqEventPublisher
from pagedkv.router.index import ReplicaIndex


class Consumer:
    """A router-side index that also checks no event names a parent it does not hold."""

    def __init__(self) -> None:
        self.index = ReplicaIndex()

    def apply(self, replica: object, batch) -> None:
        for e in batch.events:
            if isinstance(e, BlockStored) and e.parent_block_hash is not None:
                assert self.index.holders(e.parent_block_hash).get(replica), "a parent never reported"
            if isinstance(e, BlockStored) and e.token_ids:
                assert len(e.token_ids) == BS * len(e.block_hashes)
            from pagedkv.events import EventBatch

            self.index.apply(replica, EventBatch(batch.ts, [e], batch.data_parallel_rank))


def check_parents(m, feed) -> None:
    """Every GPU key the log holds chains from its recorded parent through its recorded tokens."""
    log = feed.log
    root = root_key(sha256_key, m.epoch, b"", b"")
    for key in log.holds(GPU):
        parent, tokens = log._parent[key], log._tokens[key]
        data = np.asarray(tokens, dtype=np.int32).tobytes()
        assert sha256_key(root if parent is None else parent, data, b"") == key


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("native", [False, None])
def test_feed_keeps_an_index_equal_to_the_manager(seed: int, native: bool | None) -> None:
    rng = np.random.default_rng(seed)
    m, feed = make_replica(native=native)
    consumer = Consumer()
    for _ in random_steps(rng, m, feed, 400):
        if rng.random() < 0.7:  # sometimes several steps pile up between polls
            feed.poll()
            batch = feed.log.take_batch()
            if batch is not None:
                consumer.apply("r0", decode_batch(encode_batch(batch)))
            assert consumer.index.state("r0").get(GPU, set()) == gpu_hashes(m, feed)
            check_parents(m, feed)
            m.check_invariants()
    assert feed.orphans == 0


def test_epoch_bumped_behind_the_feed_is_refused() -> None:
    m, feed = make_replica()
    m.bump_epoch()
    with pytest.raises(InvalidArgumentError):
        feed.poll()


def drain(sub: EventSubscriber, pub: ZmqEventPublisher, consumer: Consumer, replica: object) -> None:
    deadline = time.monotonic() + 10
    for _, batch in sub.sync():
        consumer.apply(replica, batch)
    while sub.next_seq < pub.next_seq:
        assert time.monotonic() < deadline, f"stream stalled at {sub.next_seq} of {pub.next_seq}"
        for _, batch in sub.poll(50):
            consumer.apply(replica, batch)


def test_zmq_stream_rebuilds_every_replica_including_a_replay(tmp_path) -> None:
    rng = np.random.default_rng(7)
    n = 3
    replicas = [make_replica() for _ in range(n)]
    pubs = [
        ZmqEventPublisher(f"ipc://{tmp_path}/pub{i}", f"ipc://{tmp_path}/replay{i}", buffer_steps=1000)
        for i in range(n)
    ]
    subs = [EventSubscriber(p.endpoint, p.replay_endpoint) for p in pubs]
    consumer = Consumer()
    try:
        walks = [random_steps(rng, m, feed, 300) for m, feed in replicas]
        for step in range(301):
            for i, walk in enumerate(walks):
                next(walk)
                m, feed = replicas[i]
                feed.poll()
                batch = feed.log.take_batch()
                if batch is not None:
                    pubs[i].publish(batch)
            if step == 100:  # replica 1's subscriber goes away and misses a range
                drain(subs[1], pubs[1], consumer, 1)
                resume = subs[1].next_seq
                subs[1].close()
                subs[1] = None
            if step == 160:
                missed = pubs[1].next_seq - resume
                subs[1] = EventSubscriber(pubs[1].endpoint, pubs[1].replay_endpoint, next_seq=resume)
            for i, sub in enumerate(subs):
                if sub is not None:
                    for _, batch in sub.poll(0):
                        consumer.apply(i, batch)
        for i in range(n):
            drain(subs[i], pubs[i], consumer, i)
            m, feed = replicas[i]
            assert consumer.index.state(i).get(GPU, set()) == gpu_hashes(m, feed)
        assert missed > 5 and subs[1].replayed >= missed  # the missed range came back through the ROUTER
    finally:
        for s in subs:
            if s is not None:
                s.close()
        for p in pubs:
            p.close()


def test_a_range_the_publisher_no_longer_holds_is_a_gap_error(tmp_path) -> None:
    m, feed = make_replica()
    with ZmqEventPublisher(f"ipc://{tmp_path}/p", f"ipc://{tmp_path}/r", buffer_steps=2) as pub:
        f = pub.first_seq  # the announcement; then five batches
        for i in range(5):
            feed.log.stored(GPU, [bytes([i]) * 32])
            pub.publish(feed.log.take_batch())
        with EventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
            assert [s for s, _ in sub.replay(f + 4, f + 6)] == [f + 4, f + 5]
            with pytest.raises(ReplayGapError):
                sub.replay(f, f + 6)


def test_a_block_stored_and_reused_between_polls_is_never_reported() -> None:
    m, feed = make_replica(num_blocks=6)  # 5 usable blocks of 4 tokens
    first = m.admit(np.arange(9, dtype=np.int32))  # 2 full blocks published, 1 partial
    m.mark_computed([first.seq_id])
    m.free(first.seq_id)
    other = m.admit(np.arange(100, 117, dtype=np.int32))  # 5 blocks: evicts and reuses both
    m.mark_computed([other.seq_id])
    feed.poll()
    events = feed.log.take_batch().events
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    removed = [h for e in events if not isinstance(e, BlockStored) for h in e.block_hashes]
    assert removed == [] and set(stored) == gpu_hashes(m, feed) and len(stored) == 4
    check_parents(m, feed)
