"""The live router and the simulator's router make the same decisions from the same replica states: the same
events (the live router over ZMQ, the simulator's index in process), the same requests sent and completed."""

from __future__ import annotations

import time

import numpy as np

from pagedkv.core import PagedKVManager
from pagedkv.events import GPU, EventFeed, EventLog
from pagedkv.events.publisher import ZmqEventPublisher
from pagedkv.router import LIVE_IMBALANCE_THRESHOLD, CostWeights, request_hashes
from pagedkv.router.live import LiveRouter
from pagedkv.router.replica_stats import ReplicaStats
from pagedkv.sim.catalog import BUILTIN_GPUS, BUILTIN_MODELS
from pagedkv.sim.replicas import ReplicaSimulation
from pagedkv.sim.simulator import SimConfig
from pagedkv.sim.workload import WorkloadSpec, build_workload

BS = 4


class Replica:
    """A manager whose events go to the live router over ZMQ and to the simulator's index in process."""

    def __init__(self, folder, name: int, sim: ReplicaSimulation) -> None:
        self.name, self.sim = name, sim
        self.m = PagedKVManager(256, BS, record_events=True)
        self.feed = EventFeed(self.m, [EventLog(BS)])
        self.pub = ZmqEventPublisher(f"ipc://{folder}/{name}.pub", f"ipc://{folder}/{name}.replay")

    def stats(self) -> ReplicaStats:
        return ReplicaStats(kv_events=self.pub.endpoint, kv_replay=self.pub.replay_endpoint,
                            incarnation=self.pub.first_seq, block_size=BS, hash_fn="sha256", epoch=0,
                            num_blocks=self.m.num_blocks, free_blocks=self.m.num_blocks)  # fmt: skip

    def serve(self, prompt: list[int], router: LiveRouter) -> None:
        """Compute `prompt` (its blocks land in the prefix cache) and publish the events to both routers."""
        adm = self.m.admit(np.asarray(prompt, dtype=np.int32))
        self.m.mark_computed([adm.seq_id])
        self.m.free(adm.seq_id)
        self.feed.poll()
        batch = self.feed.log.take_batch()
        assert batch is not None
        self.pub.publish(batch)
        self.sim.router.index.apply(self.name, batch)
        want = self.sim.router.index.state(self.name).get(GPU, frozenset())
        deadline = time.monotonic() + 10
        while router.index.state(self.name).get(GPU, frozenset()) != want:
            assert time.monotonic() < deadline, "events did not arrive"
            router.streams.poll()
            router.streams.check()


def test_the_live_router_and_the_simulator_rank_the_same_states_alike(tmp_path) -> None:
    spec = WorkloadSpec(source="multi-turn", num_requests=4, turns=2, rate=1.0)
    config = SimConfig(BUILTIN_MODELS["llama-2-7b"], BUILTIN_GPUS["a100-40gb"], "paged-prefix", BS, max_model_len=2048)
    sim = ReplicaSimulation(config, build_workload(spec, 2048), num_replicas=2, router="cost")
    live = LiveRouter(sync_interval_s=3600)  # the live router with its defaults
    assert sim.router.policy.weights == live.policy.weights == CostWeights()
    assert sim.router.policy.imbalance_threshold == live.imbalance_threshold == LIVE_IMBALANCE_THRESHOLD
    reps = [Replica(tmp_path, i, sim) for i in range(2)]
    decisions: list[tuple[int, bool]] = []

    def send(rid: str, prompt: list[int]) -> int:
        ranking = live.rank([0, 1], prompt)
        live.predict(rid, ranking)
        live.routed(rid, ranking.order[0])
        simulated = sim.router.route(rid, request_hashes(prompt, BS))
        assert simulated.replica == ranking.order[0], f"{rid}: live {ranking.order}, simulator {simulated}"
        assert simulated.match == ranking.matches[ranking.order[0]]
        assert sim.router.load.load(0) == live.load.load(0) and sim.router.load.load(1) == live.load.load(1)
        live.load.check_invariants()
        sim.router.load.check_invariants()
        decisions.append((int(ranking.order[0]), ranking.fallback))
        return int(ranking.order[0])

    def complete(rid: str) -> None:
        live.completed(rid)
        sim.router.load.release(rid)
        live.load.check_invariants()
        sim.router.load.check_invariants()

    try:
        for r in reps:
            live.observe(r.name, r.stats())
        # a document on replica 1: the request extending it goes there
        doc = list(range(100, 124))
        reps[1].serve(doc + [1], live)
        assert send("d0", doc + [7, 8, 9]) == 1
        # a system prompt nobody holds, sent by many requests at once: the followers go where the first is
        # computing it (blocks on their way) until that replica is past the imbalance threshold
        system = list(range(2000, 2256))  # 64 blocks
        first = send("s0", system + [1, 2, 3, 4, 5])
        for i in range(1, 24):
            send(f"s{i}", system + [10 * i + k for k in range(5)])
        assert decisions[2:19] == [(first, False)] * 17 and decisions[19] == (1 - first, True)
        # the first prefill is done (its events), later ones complete, the loads follow in both
        reps[first].serve(system + [1, 2, 3, 4, 5], live)
        for i in range(0, 24, 2):
            complete(f"s{i}")
        # a conversation's history on the replica with more requests in flight: its next turn stays there
        # (sticky within the threshold, and the duplicate charge for anything else)
        history = list(range(300, 364))
        busy = max((0, 1), key=lambda r: live.load.requests(r))
        reps[busy].serve(history + [1], live)
        assert send("h1", history + [5, 6, 7, 8, 9]) == busy
        # fresh prompts go by the queues
        for i in range(8):
            send(f"f{i}", list(range(1000 + 40 * i, 1000 + 40 * i + 21)))
        # conversations whose histories replica 1 holds: their turns stay there and queue work on it
        for j in range(3):
            turn = list(range(5000 + 100 * j, 5000 + 100 * j + 40))
            reps[1].serve(turn + [1], live)
            assert send(f"c{j}", turn + list(range(7000, 7017))) == 1
        assert 6 < live.load.load(1) - live.load.load(0) < 24
        # the document again, while d0 shares it on replica 1 (no history of its own: the cost decides): the 6
        # blocks 0 would compute again cost it 3 more each, and it stays on 1 (without that charge it moved)
        assert send("d1", doc + [11, 12, 13, 14, 15]) == 1
        for rid in ["d0", "d1", "h1", "c0", "c1", "c2"] + [f"s{i}" for i in range(1, 24, 2)] + [f"f{i}" for i in range(8)]:
            complete(rid)
        assert sim.router.load.load(0) == live.load.load(0) == 0 and sim.router.load.load(1) == live.load.load(1) == 0
    finally:
        live.streams.close()
        for r in reps:
            r.pub.close()
