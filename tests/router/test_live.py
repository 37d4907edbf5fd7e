"""`LiveRouter` over two replicas publishing real ZMQ events: prefix first, load next, the imbalance
fallback, a restarted replica re-followed, a forgotten one gone from the index."""

from __future__ import annotations

import importlib.util
import time

import numpy as np
import pytest

from pagedkv.core import PagedKVManager
from pagedkv.core.errors import InvalidArgumentError
from pagedkv.events import GPU, EventFeed, EventLog
from pagedkv.events.publisher import ZmqEventPublisher
from pagedkv.router.live import LiveRouter
from pagedkv.router.policy import CostWeights
from pagedkv.router.replica_stats import EngineGauges, ReplicaStats

BS = 4


class Replica:
    def __init__(self, folder, name: str) -> None:
        self.m = PagedKVManager(64, BS, record_events=True)
        self.feed = EventFeed(self.m, [EventLog(BS)])
        self.pub = ZmqEventPublisher(f"ipc://{folder}/{name}.pub", f"ipc://{folder}/{name}.replay")

    def stats(self, **load: int) -> ReplicaStats:
        return ReplicaStats(kv_events=self.pub.endpoint, kv_replay=self.pub.replay_endpoint,
                            incarnation=self.pub.first_seq, block_size=BS, hash_fn="sha256", epoch=0,
                            num_blocks=self.m.num_blocks, free_blocks=self.m.num_blocks - self.m.num_used_blocks,
                            num_running=load.get("running", 0), num_waiting=load.get("waiting", 0))  # fmt: skip

    def serve(self, prompt: list[int]) -> None:
        adm = self.m.admit(np.asarray(prompt, dtype=np.int32))
        self.m.mark_computed([adm.seq_id])
        self.m.free(adm.seq_id)
        self.feed.poll()
        batch = self.feed.log.take_batch()
        if batch is not None:
            self.pub.publish(batch)


def wait_for(router: LiveRouter, replica: str, blocks: int) -> None:
    deadline = time.monotonic() + 10
    while len(router.index.state(replica).get(GPU, ())) < blocks:
        assert time.monotonic() < deadline, "events did not arrive"
        router.streams.poll()
        router.streams.check()


def test_prefix_then_load_then_the_imbalance_fallback(tmp_path) -> None:
    a, b = Replica(tmp_path, "a"), Replica(tmp_path, "b")
    # a duplicate charge of 1 (the arithmetic below; the live default's is in test_policy)
    router = LiveRouter(imbalance_threshold=3, sync_interval_s=3600, weights=CostWeights(duplicate_weight=1.0))
    try:
        for name, r in (("a", a), ("b", b)):
            router.observe(name, r.stats())
        doc = list(range(100, 124))  # 6 blocks
        b.serve(doc + [1])
        wait_for(router, "b", 6)
        prompt = doc + [7, 8, 9]
        ranking = router.rank(["a", "b"], prompt)
        assert ranking.order == ["b", "a"] and ranking.matches["b"].gpu == 6 and not ranking.fallback
        # b gets busy with what this router sent it. The prompt's prefix on b is its own (in no request in flight
        # there, as a conversation's history): it stays while b's requests in flight exceed a's by no more than
        # the threshold, whatever the queued blocks say (15 here, against 6 to compute on a and 6 more for
        # computing blocks b already holds: the live router's duplicate charge)
        for i in range(3):
            router.predict(f"q{i}", router.rank(["a", "b"], list(range(500 + 10 * i, 517 + 10 * i))))
            router.routed(f"q{i}", "b")
        busy = router.rank(["a", "b"], prompt)
        assert busy.loads["b"] == 15.0 and busy.order[0] == "b" and not busy.fallback
        # one more: 4 requests against 0 is past the threshold, and the cost decides: 20 blocks of queued work
        # outweigh the 12
        router.predict("q3", router.rank(["a", "b"], list(range(540, 557))))
        router.routed("q3", "b")
        busy = router.rank(["a", "b"], prompt)
        assert busy.loads["b"] == 20.0 and busy.order[0] == "a" and not busy.fallback
        b.serve(list(range(500, 517)))  # q0's prefill is done: its events show its last block on b's GPU
        wait_for(router, "b", 10)
        assert router.rank(["a", "b"], prompt).loads["b"] == 1.0 + 3 * 5.0  # q0 running, q1 to q3 to prefill
        for i in range(4):
            router.completed(f"q{i}")
        assert router.rank(["a", "b"], prompt).order[0] == "b"
        # other routers' requests, seen through b's stats: 5 in flight against a's 0 > threshold 3, so the cost
        # decides; b holds the whole prefix (cost 5, its queue) against 12 on a: it stays
        router.observe("b", b.stats(running=4, waiting=1))
        private = router.rank(["a", "b"], prompt)
        assert not private.fallback and private.order == ["b", "a"]
        # a request in flight on b shares the document: it is a shared prefix now, and the fallback moves the next
        router.predict("s", router.rank(["a", "b"], doc + [4, 4, 4, 4, 4]))
        router.routed("s", "b")
        fallback = router.rank(["a", "b"], prompt)
        assert fallback.fallback and fallback.order == ["a", "b"]
        router.completed("s")
        assert not router.rank(["a", "b"], prompt).fallback  # private again: nothing left of "s" on b
    finally:
        router.streams.close()
        a.pub.close()
        b.pub.close()


def test_a_replica_restarted_elsewhere_is_refollowed_and_a_gone_one_forgotten(tmp_path) -> None:
    a = Replica(tmp_path, "a")
    router = LiveRouter(sync_interval_s=3600)
    try:
        router.observe("a", a.stats())
        a.serve(list(range(40)))
        wait_for(router, "a", 9)
        a.pub.close()
        a2 = Replica(tmp_path, "a2")  # Ray restarted it: a new process, new endpoints, an empty cache
        router.observe("a", a2.stats())
        router.streams.check()
        assert router.index.state("a") == {}
        a2.serve(list(range(8)) + [1])
        wait_for(router, "a", 2)
        assert len(router.index.state("a")[GPU]) == 2 and len(router.index) == 2  # the old 9 blocks are gone
        router.forget("a")
        assert len(router.index) == 0 and "a" not in router.streams
        with pytest.raises(InvalidArgumentError):
            router.rank([], [1, 2, 3])
        a2.pub.close()
    finally:
        router.streams.close()


def test_blocks_on_their_way_draw_the_next_request_sharing_them(tmp_path) -> None:
    a, b = Replica(tmp_path, "a"), Replica(tmp_path, "b")
    router = LiveRouter(sync_interval_s=3600)
    try:
        for name, r in (("a", a), ("b", b)):
            router.observe(name, r.stats())
        system = list(range(60, 92))  # 8 blocks nobody holds yet
        first = router.rank(["a", "b"], system + [1, 2, 3])
        router.predict("r1", first)
        router.routed("r1", "b")  # sent to b, still prefilling: no event yet
        second = router.rank(["a", "b"], system + [4, 5, 6])
        assert second.matches["b"].pending == 8 and second.matches["b"].gpu == second.matches["a"].total == 0
        # r1's prefill (8 blocks + 1) is b's queued work, but the 8 blocks it computes are the ones the second
        # request shares: not charged again, so b (1 block + 1 queued) beats an idle a (9 blocks to compute)
        assert second.loads["b"] == 9.0 and second.order == ["b", "a"] and not second.fallback
        assert len(router.index) == 0  # the index itself holds only what events said
        b.serve(system + [1, 2, 3])  # r1's prefill done: the events take over from the credit
        wait_for(router, "b", 8)
        router.completed("r1")
        assert router.rank(["a", "b"], system + [4, 5, 6]).matches["b"].gpu == 8  # from the index now
        router.predict("r3", router.rank(["a", "b"], list(range(300, 332)) + [1]))
        router.routed("r3", "a")  # the router's pick, counted at once
        router.routed("r3", "b")  # Ray placed it on b: it moves, work and blocks on their way
        moved = router.rank(["a", "b"], list(range(300, 332)) + [2])
        assert (moved.matches["a"].pending, moved.matches["b"].pending) == (0, 8) and moved.loads["a"] == 0.0
        router.withdraw("r3")  # ranked again: its own placement no longer counts
        again = router.rank(["a", "b"], list(range(300, 332)) + [2])
        assert again.matches["b"].total == 0 and again.loads["b"] == 0.0
        router.routed("r3", "b")
        router.completed("r3")
        router.predict("r2", router.rank(["a", "b"], list(range(200, 232)) + [1]))
        router.routed("r2", "a")
        router.completed("r2")  # ended (an abort) without ever computing: no credit left behind
        assert router.rank(["a", "b"], list(range(200, 232)) + [9]).matches["a"].total == 0
    finally:
        router.streams.close()
        a.pub.close()
        b.pub.close()


@pytest.mark.parametrize("systems", [4, 1])
def test_a_burst_groups_conversations_by_system_prompt(tmp_path, systems) -> None:
    """32 conversations start at once, before any replica has computed a system prompt (nothing completes
    during the burst). Each of 4 system prompts is computed on one replica and its conversations follow it,
    2 prompts and 16 conversations a replica. One system prompt for all: its followers join the first
    replica (on the other they would compute 16 blocks the fleet holds, charged twice) until the imbalance
    fallback sends one to the other, which then takes its share."""
    a, b = Replica(tmp_path, "a"), Replica(tmp_path, "b")
    router = LiveRouter(imbalance_threshold=8, sync_interval_s=3600)
    try:
        for name, r in (("a", a), ("b", b)):
            router.observe(name, r.stats())
        prompts = {s: list(range(1000 * s + 100, 1000 * s + 164)) for s in range(systems)}  # 16 blocks each
        placed: dict[str, list[int]] = {"a": [], "b": []}
        order = []
        computed = 0  # system prompts computed: the first request with the prompt on each replica
        for c in range(32):
            ranking = router.rank(["a", "b"], prompts[c % systems] + [5000 + c] * 9)
            router.predict(c, ranking)
            router.routed(c, ranking.order[0])
            computed += ranking.matches[ranking.order[0]].pending == 0
            placed[ranking.order[0]].append(c % systems)
            order.append(ranking.order[0])
        assert abs(len(placed["a"]) - len(placed["b"])) <= 8 + 1
        if systems == 4:
            assert computed == 4 and len(placed["a"]) == len(placed["b"]) == 16
            assert not set(placed["a"]) & set(placed["b"])
        else:  # 9 requests on a against none on b pass the threshold of 8: the 10th computes the prompt on b
            assert computed == 2 and "".join(order[:10]) == "a" * 9 + "b", "".join(order)
    finally:
        router.streams.close()
        a.pub.close()
        b.pub.close()


def test_a_replicas_report_adds_only_other_routers_requests_and_a_stale_one_no_phantoms() -> None:
    router = LiveRouter(imbalance_threshold=3, sync_interval_s=3600)
    try:
        router.observe("a", ReplicaStats(num_running=0, num_waiting=0))
        for i in range(5):
            router.routed(f"q{i}", "b")  # five running on b (no prefill: nothing predicted)
        router.observe("b", ReplicaStats(num_running=5, num_waiting=0))  # its report counts the same five
        assert router.rank(["a", "b"], [1, 2, 3]).loads == {"a": 0.0, "b": 5.0}
        for i in range(3):
            router.completed(f"q{i}")
        router.observe("b", ReplicaStats(num_running=5, num_waiting=0))  # the same report again: two are left
        ranking = router.rank(["a", "b"], [1, 2, 3])
        assert ranking.loads["b"] == 2.0 and not ranking.fallback
        router.observe("b", ReplicaStats(num_running=4, num_waiting=2))  # a new one: 4 beyond this router's 2
        ranking = router.rank(["a", "b"], [1, 2, 3])
        assert ranking.loads["b"] == 6.0 and ranking.fallback and ranking.order == ["a", "b"]
    finally:
        router.streams.close()


def test_a_routing_message_goes_through_its_dict_form_and_refuses_what_it_does_not_know() -> None:
    sent = ReplicaStats(kv_events="tcp://h:1", kv_replay="tcp://h:2", incarnation=7, block_size=4, hash_fn="vllm",
                        epoch=2, num_blocks=96, free_blocks=90, num_running=3, num_waiting=1,
                        gauges=EngineGauges(3, 0, 0, 6, 96))  # fmt: skip
    assert ReplicaStats.from_dict(sent.as_dict()) == sent and sent.load == 4
    with pytest.raises(InvalidArgumentError, match="unknown fields"):
        ReplicaStats.from_dict({**sent.as_dict(), "free": 1})
    with pytest.raises(InvalidArgumentError, match="hash_fn"):
        ReplicaStats.from_dict({"hash_fn": "md5"})
    with pytest.raises(InvalidArgumentError, match="block_size"):
        ReplicaStats.from_dict({"block_size": "4"})


def test_the_router_reads_a_cache_salt_as_the_engine_does() -> None:
    """One salt-to-bytes (`pagedkv.engine.intake.salt_bytes`): text is its UTF-8, None and "" the shared cache,
    and another type is the engine's one-line refusal, not a hash of whatever it was."""
    from pagedkv.engine.intake import salt_bytes

    router = LiveRouter(sync_interval_s=3600)
    try:
        router.observe("a", ReplicaStats(kv_events="ipc:///nonexistent/a", kv_replay="", incarnation=0, block_size=BS,
                                         hash_fn="sha256", epoch=0, num_blocks=8, free_blocks=8, num_running=0,
                                         num_waiting=0))  # fmt: skip
        prompt = list(range(40, 52))
        for salt in (None, "", "tenant é", b"tenant \xc3\xa9"):
            assert router.rank(["a"], prompt, cache_salt=salt) == router.rank(["a"], prompt, cache_salt=salt_bytes(salt))
        with pytest.raises(InvalidArgumentError, match="cache_salt must be a str, bytes or None, got int"):
            router.rank(["a"], prompt, cache_salt=7)  # type: ignore[arg-type]
    finally:
        router.streams.close()


def test_one_replay_timeout_default_from_the_subscriber_to_the_ray_router() -> None:
    """`replay_timeout_ms` has one default, `pagedkv.events.publisher.REPLAY_TIMEOUT_MS`, at every layer that
    takes it (a router check waits that long on a silent replica, so every layer must agree)."""
    import inspect

    from pagedkv.events.publisher import REPLAY_TIMEOUT_MS, EventSubscriber
    from pagedkv.router.event_streams import EventStreams

    takers = [EventSubscriber.__init__, EventStreams.__init__, LiveRouter.__init__]
    if importlib.util.find_spec("ray") is not None:
        from pagedkv.serve.ray_router import PagedKVRequestRouter

        takers.append(PagedKVRequestRouter.initialize_state)
    defaults = {f.__qualname__: inspect.signature(f).parameters["replay_timeout_ms"].default for f in takers}
    assert set(defaults.values()) == {REPLAY_TIMEOUT_MS}, defaults
