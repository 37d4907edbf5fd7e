"""Routing policies on a hand-fed index, and the index against a real manager's events."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from pagedkv import events as ev
from pagedkv.core import PagedKVManager
from pagedkv.core.errors import InvalidArgumentError
from pagedkv.router import (
    LIVE_WEIGHTS,
    CostRouting,
    CostWeights,
    Decision,
    PrefixMatch,
    ReplicaIndex,
    Router,
    request_hashes,
)

BS = 4


def stored(hashes: list[int], medium: str = ev.GPU) -> ev.EventBatch:
    return ev.EventBatch(0.0, [ev.BlockStored(hashes, None, [], BS, None, medium)], 0)


def test_request_hashes_name_the_blocks_a_manager_publishes() -> None:
    m = PagedKVManager(16, BS, record_events=True)
    feed = ev.EventFeed(m, [ev.EventLog(BS)])
    prompt = np.arange(3 * BS + 2, dtype=np.int32)
    adm = m.admit(prompt)
    m.mark_computed([adm.seq_id])
    feed.poll()
    index = ReplicaIndex()
    index.apply("a", feed.log.take_batch())
    hashes = request_hashes(prompt, BS)
    assert len(hashes) == 3 and index.match(hashes, ["a"])["a"] == PrefixMatch(3, 0, 0)
    assert request_hashes(prompt[: 2 * BS + 1], BS) == hashes[:2]  # the last token's block is never a hit


def test_index_walks_gpu_then_local_then_remote_and_stops_at_a_hole() -> None:
    idx = ReplicaIndex()
    idx.apply("a", stored([1, 2]))
    idx.apply("a", stored([3], ev.CPU))
    idx.apply("b", stored([4, 5], ev.REMOTE))  # the shared store: anyone may load it
    idx.apply("b", stored([7], ev.REMOTE))
    m = idx.match([1, 2, 3, 4, 5, 6, 7], ["a", "b", "c"])
    assert m["a"] == PrefixMatch(2, 1, 2)
    assert m["b"] == PrefixMatch(0, 0, 0)  # block 1 is nowhere b can get it
    idx.apply("a", ev.EventBatch(0.0, [ev.BlockRemoved([2], ev.GPU)], 0))
    assert idx.match([1, 2, 3], ["a"])["a"] == PrefixMatch(1, 0, 0)
    idx.apply("b", ev.EventBatch(0.0, [ev.AllBlocksCleared()], 0))
    assert idx.match([4], ["a"])["a"] == PrefixMatch(0, 0, 0) and idx.state("b") == {}
    assert idx.holders(1) == {"a": frozenset({ev.GPU})}


def route(r: Router, hashes: list[int], loads: list[float]) -> Decision:
    """The router's policy on its index with the loads given (the policy's arithmetic, without a load model)."""
    found = r.index.match(hashes, r.replicas)
    matches = [found[x] for x in r.replicas]
    i = r.policy.choose(len(hashes), matches, loads)
    return Decision(r.replicas[i], matches[i])


def test_round_robin_ignores_the_cache() -> None:
    r = Router(["a", "b", "c"], "round-robin")
    r.index.apply("b", stored([1, 2]))
    assert [r.route(i, [1, 2]).replica for i in range(4)] == ["a", "b", "c", "a"]


def test_cost_prefers_the_holder_until_its_queue_outweighs_the_prefix() -> None:
    r = Router(["a", "b"], CostRouting(CostWeights(compute_weight=1.0, queue_weight=1.0, duplicate_weight=0.0)))
    r.index.apply("b", stored([1, 2, 3]))
    assert route(r, [1, 2, 3, 4], [0, 0]).replica == "b"  # 1 block to compute vs 4
    assert route(r, [1, 2, 3, 4], [0, 2.5]).replica == "b"  # 1 + 2.5 < 4
    assert route(r, [1, 2, 3, 4], [0, 3.5]).replica == "a"  # 1 + 3.5 > 4


def test_cost_discounts_loads_from_lower_tiers() -> None:
    r = Router(["a", "b"], CostRouting(CostWeights(local_discount=0.1, remote_discount=0.5)))
    r.index.apply("a", stored([1, 2, 3, 4], ev.CPU))
    r.index.apply("b", stored([1, 2], ev.GPU))
    r.index.apply("b", stored([1, 2, 3, 4], ev.REMOTE))
    # a: load 4 from ev.CPU = 0.4; b: 2 on ev.GPU, 2 from ev.REMOTE = 1.0
    d = route(r, [1, 2, 3, 4], [0, 0])
    assert d.replica == "a" and d.match == PrefixMatch(0, 4, 0)


def test_pure_prefix_piles_shared_first_blocks_on_one_replica_and_cost_balances() -> None:
    """Many requests share a first block: pure longest-prefix sends every one to whoever computed it first;
    the cost policy, charging queued work, spreads them."""

    def run(policy: str) -> Counter[str]:
        rng = np.random.default_rng(0)
        r = Router(["a", "b", "c", "d"], policy)
        loads = dict.fromkeys(r.replicas, 0.0)
        for i in range(200):
            hashes = [1, *(int(x) for x in rng.integers(1 << 40, size=6))]  # shared block, private rest
            d = route(r, hashes, [loads[x] for x in r.replicas])
            loads[d.replica] += len(hashes) - d.match.total  # its new work
            r.index.apply(d.replica, stored(hashes))
            if i % 4 == 3:  # work drains as the replicas compute
                for x in loads:
                    loads[x] = max(0.0, loads[x] - 7)
        return Counter({x: len(r.index.state(x).get(ev.GPU, ())) for x in r.replicas})

    prefix = run("prefix")
    cost = run("cost")
    assert prefix["a"] == 1 + 200 * 6 and all(prefix[x] == 0 for x in "bcd")  # everything on one replica
    assert min(cost[x] for x in "abcd") > 150  # every replica took a fair share of the work


def test_bad_input_is_a_typed_error() -> None:
    with pytest.raises(InvalidArgumentError):
        Router([], "cost")
    with pytest.raises(InvalidArgumentError):
        Router(["a"], "fastest")
    with pytest.raises(InvalidArgumentError):
        CostRouting(imbalance_threshold=-1)
    r = Router(["a", "b"])
    r.route("q", [1])
    with pytest.raises(InvalidArgumentError):
        r.route("q", [1])  # routed twice without a release: nothing changes
    assert r.load.requests("a") + r.load.requests("b") == 1
    with pytest.raises(InvalidArgumentError):
        CostWeights(remote_discount=-1)


def test_cost_rank_is_choose_then_cost_order_and_the_imbalance_fallback_overrides_it() -> None:
    policy = CostRouting(imbalance_threshold=8)
    matches = [PrefixMatch(gpu=6), PrefixMatch(), PrefixMatch(gpu=2)]
    order, fallback = policy.rank(8, matches, [0.0, 0.0, 0.0])
    assert order == [0, 2, 1] and not fallback
    # replica 0 holds the prefix but has 10 requests in flight against 0 and 1: past a threshold of 8, the
    # replicas within it lead whatever 0 holds, by cost among them (2 holds 2 blocks: 6 + 1 against 8 + 0)
    order, fallback = policy.rank(8, matches, [3.0, 0.0, 1.0], requests=[10, 0, 1])
    assert order == [2, 1, 0] and fallback
    order, fallback = policy.rank(8, matches, [3.0, 0.0, 1.0], requests=[10, 0, 9])
    assert order == [1, 2, 0] and fallback  # 2 is past the threshold too: the heavy follow, least loaded first
    order, fallback = policy.rank(8, matches, [3.0, 0.0, 1.0], requests=[8, 0, 1])
    assert order[0] == 0 and not fallback


def test_blocks_on_their_way_are_neither_computed_nor_charged_again() -> None:
    """b is prefilling a request: 16 system-prompt blocks and 2 of its own (18 + 1 of queued work). The next
    request shares the 16 and has 2 of its own: on b it computes 2 and waits for work b does anyway."""
    policy = CostRouting(CostWeights(duplicate_weight=0.0), imbalance_threshold=8)
    on_way = [PrefixMatch(), PrefixMatch(pending=16)]
    assert on_way[1].total == 16 and policy.cost(18, on_way[1], 19.0) == 2 + 3
    order, fallback = policy.rank(18, on_way, [0.0, 19.0], requests=[0, 1])
    assert order == [1, 0] and not fallback
    # the same blocks already on b's ev.GPU: its 19 queued are other requests' work, charged in full
    assert policy.rank(18, [PrefixMatch(), PrefixMatch(gpu=16)], [0.0, 19.0])[0] == [0, 1]
    # never a negative queue: a replica whose queue is all the shared prefill costs its compute only
    assert policy.cost(18, PrefixMatch(pending=16), 10.0) == 2
    # followers piled past the imbalance threshold: the least loaded leads whatever is on its way
    order, fallback = policy.rank(18, on_way, [0.0, 43.0], requests=[0, 9])
    assert order == [0, 1] and fallback


def test_the_duplicate_charge_keeps_a_history_where_it_is_and_leaves_fresh_prompts_to_the_queues() -> None:
    """A conversation's next turn: 22 of its 23 blocks on a, whose queue is 40 against b's 16 (a moment's
    burst). Without the duplicate charge it moves (1 + 40 > 23 + 16) and b recomputes the whole history; with
    it (`LIVE_WEIGHTS`: duplicate_weight 3) the 22 blocks a holds cost b four times. A prompt nobody holds goes
    by the queues alone."""
    history = [PrefixMatch(gpu=22), PrefixMatch()]
    assert CostRouting(CostWeights(duplicate_weight=0.0)).rank(23, history, [40.0, 16.0])[0] == [1, 0]
    live = CostRouting()
    assert LIVE_WEIGHTS.duplicate_weight == 3.0
    assert live.costs(23, history, [40.0, 16.0]) == [1 + 40.0, 23 + 3 * 22 + 16.0]
    assert live.rank(23, history, [40.0, 16.0])[0] == [0, 1]
    assert live.rank(23, [PrefixMatch(), PrefixMatch()], [40.0, 16.0])[0] == [1, 0]
    # held elsewhere only in part: only that part is charged twice
    assert live.costs(23, [PrefixMatch(gpu=16), PrefixMatch(gpu=22)], [0.0, 0.0]) == [7 + 3 * 6, 1]
    assert CostWeights() == LIVE_WEIGHTS  # one set of defaults: the live router's are the simulator's


def test_a_turn_stays_with_its_history_until_its_replica_is_past_the_threshold() -> None:
    """A conversation's turn whose history only replica 0 holds (`sticky`): it stays there whatever the
    queued blocks say while replica 0's requests in flight exceed the least loaded's by no more than the
    threshold; past it the cost decides (here: the queue outweighs the history, and it moves). Without
    `sticky` the same figures go by cost, and a prefix many requests share goes by the fallback."""
    live = CostRouting(imbalance_threshold=8)
    turn = [PrefixMatch(gpu=7), PrefixMatch(gpu=4)]
    assert live.rank(8, turn, [30.0, 0.0])[0] == [1, 0]  # cost: 1 + 30 against 4 + 3 + 0
    assert live.rank(8, turn, [30.0, 0.0], requests=[6, 0], sticky=0) == ([0, 1], False)
    assert live.rank(8, turn, [30.0, 0.0], requests=[8, 0], sticky=0) == ([0, 1], False)
    assert live.rank(8, turn, [30.0, 0.0], requests=[9, 0], sticky=0) == ([1, 0], False)
    assert live.rank(8, turn, [30.0, 0.0], sticky=0) == ([0, 1], False)  # no requests: the history decides
    # the other replica's load does not make the holder heavy: only the holder's own lead counts
    assert live.rank(8, turn + [PrefixMatch()], [3.0, 0.0, 90.0], requests=[2, 0, 20],
                     sticky=0) == ([0, 1, 2], False)  # fmt: skip
    assert live.rank(8, turn, [30.0, 0.0], requests=[9, 0]) == ([1, 0], True)
