"""`simulate --replicas`: one replica is the single-GPU simulator; routers, tiers and loads behave as stated."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagedkv.core.errors import CapacityError, InvalidArgumentError, InvariantError
from pagedkv.router import request_hashes
from pagedkv.sim.catalog import BUILTIN_GPUS, BUILTIN_MODELS
from pagedkv.sim.commands_simulate import simulate_main
from pagedkv.sim.replicas import GIB, ReplicaSimulation, TierConfig, run_replicas
from pagedkv.sim.run_metrics import request_metrics, summarize
from pagedkv.sim.simulator import Arrivals, Replay, SimConfig, simulate
from pagedkv.sim.workload import WorkloadSpec, build_workload

MODEL, GPU = BUILTIN_MODELS["llama-2-7b"], BUILTIN_GPUS["a100-40gb"]


def config(num_blocks: int, max_model_len: int = 2048) -> SimConfig:
    """Llama-2-7B on an A100-40GB with exactly `num_blocks` KV blocks of 16 tokens."""
    probe = SimConfig(MODEL, GPU, "paged-prefix", 16, max_model_len=max_model_len, activation_bytes=0)
    spare = probe.budget().kv_budget_bytes - num_blocks * probe.budget().bytes_per_block
    cfg = SimConfig(MODEL, GPU, "paged-prefix", 16, max_model_len=max_model_len, activation_bytes=spare)
    assert cfg.budget().num_blocks == num_blocks
    return cfg


@pytest.fixture(scope="module")
def chats():
    """Multi-turn chats: each turn's prompt extends the previous turn's, behind a shared system prompt."""
    spec = WorkloadSpec(source="multi-turn", num_requests=96, turns=4, rate=1.0, arrivals="poisson",
                        system_prompt_len=256)  # fmt: skip
    return build_workload(spec, 2048)


SHARED_KEYS = ("num_requests", "rejected", "prefix_hit_rate", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
               "tokens_per_s", "requests_per_s", "span_s", "preemptions")  # fmt: skip


def test_one_replica_without_tiers_is_the_single_gpu_simulator(chats) -> None:
    cfg = config(300)  # small: preemptions and evictions happen, and must happen identically
    single = summarize(simulate(cfg, chats))
    one = ReplicaSimulation(cfg, chats, num_replicas=1, router="cost").run()
    assert {k: one[k] for k in SHARED_KEYS} == {k: single[k] for k in SHARED_KEYS}, "exactly, not approximately"
    assert one["gpu_hit_rate"] == one["prefix_hit_rate"] > 0 and single["preemptions"] > 0, single["preemptions"]


def test_a_replica_is_the_simulators_replay(chats) -> None:
    """The seam: each replica is a `Replay` (the simulator's own phases) over the paged-prefix allocator with
    events on, all of them sharing one `Arrivals`."""
    sim = ReplicaSimulation(config(1200), chats, num_replicas=3, router="round-robin")
    assert all(isinstance(r, Replay) for r in sim.replicas)
    assert {r.arrivals for r in sim.replicas} == {sim.arrivals}
    assert all(r.config.allocator == "paged-prefix" for r in sim.replicas)
    result = sim.run()
    assert sum(result["requests_per_replica"]) == len(chats.requests) == result["num_requests"]
    assert not sim.arrivals.pending, "every turn of every chat arrived"
    firsts = {request_hashes(g.prompt_token_ids, 16)[0] for g in chats.requests}
    holders = {r for h in firsts for r, media in sim.router.index.holders(h).items() if "GPU" in media}
    assert holders == {0, 1, 2}, "each replica's events reached the router"


def test_a_replay_driven_through_add_and_step_is_simulate(chats) -> None:
    """What a replica does (requests handed in with `add`, advanced by `step`) replays exactly as `simulate`."""
    cfg = config(300)
    expected = summarize(simulate(cfg, chats))
    arrivals = Arrivals(chats)
    replay = Replay(cfg, chats, cfg.budget(), arrivals=arrivals)
    while arrivals.pending or replay.scheduler.has_unfinished():
        if not replay.scheduler.has_unfinished():
            replay.now = max(replay.now, arrivals.next_s())
        while arrivals.next_s() <= replay.now:
            t, g = arrivals.pop()
            replay.add(g, t)
        if not replay.step(None):
            replay.wait_or_fail()
    assert json.dumps(summarize(replay.finish())) == json.dumps(expected)


def test_a_leak_is_the_same_invariant_error_on_a_replica(chats) -> None:
    sim = ReplicaSimulation(config(1200), chats, num_replicas=2, router="round-robin")
    manager, leaked = sim.replicas[1].manager, []
    real_free = manager.free

    def free_but_the_first(seq_id: int) -> None:  # the first request to finish there keeps its blocks
        if leaked:
            real_free(seq_id)
        leaked.append(seq_id)

    manager.free = free_but_the_first  # type: ignore[method-assign]
    with pytest.raises(InvariantError, match="still in use after every request finished"):
        sim.run()


def test_a_budget_too_small_is_the_simulators_capacity_error(chats) -> None:
    cfg = config(100)  # 1,600 tokens < max_model_len 2048
    with pytest.raises(CapacityError, match="less than one request") as single:
        simulate(cfg, chats)
    with pytest.raises(CapacityError, match="less than one request") as fleet:
        ReplicaSimulation(cfg, chats, num_replicas=2, router="cost")
    assert str(single.value) == str(fleet.value)


def test_request_metrics_count_tokens_of_finished_requests_only() -> None:
    nan = float("nan")
    arrival, first = np.array([0.0, 1.0, 2.0]), np.array([0.5, 1.5, nan])  # the third was refused
    finish, output = np.array([2.5, 3.5, nan]), np.array([5, 3, 7])
    m = request_metrics(arrival, first, finish, output)
    assert (m["num_requests"], m["span_s"], m["tokens_per_s"], m["requests_per_s"]) == (2, 3.5, 8 / 3.5, 2 / 3.5)
    assert (m["ttft_p50_s"], m["tpot_p50_s"]) == (0.5, (0.5 + 1.0) / 2)


def test_cost_routing_keeps_conversations_where_their_prefix_is(chats) -> None:
    report = run_replicas(config(1200), chats, num_replicas=4, routers=["round-robin", "prefix", "cost"])
    rr, prefix, cost = (report.results[r] for r in ("round-robin", "prefix", "cost"))
    assert cost["prefix_hit_rate"] > rr["prefix_hit_rate"] + 0.1
    assert prefix["prefix_hit_rate"] >= cost["prefix_hit_rate"] - 0.05
    assert min(cost["requests_per_replica"]) > 0.5 * max(cost["requests_per_replica"])  # still balanced
    assert sum(rr["requests_per_replica"]) == sum(cost["requests_per_replica"]) == len(chats.requests)


def test_the_remote_store_serves_what_other_replicas_computed(chats) -> None:
    tiers = TierConfig(remote_tier=True)
    with_store = ReplicaSimulation(config(1200), chats, num_replicas=4, router="round-robin", tiers=tiers).run()
    without = ReplicaSimulation(config(1200), chats, num_replicas=4, router="round-robin").run()
    assert without["remote_hit_rate"] == 0 and with_store["remote_hit_rate"] > 0.3
    assert with_store["prefix_hit_rate"] > without["prefix_hit_rate"] + 0.2
    assert with_store["gpu_hit_rate"] + with_store["host_hit_rate"] + with_store["remote_hit_rate"] == pytest.approx(
        with_store["prefix_hit_rate"]
    )


def test_the_host_tier_catches_what_a_small_gpu_evicts(chats) -> None:
    cfg = config(300)  # 4.8k tokens: turns evict each other's prefixes
    off = ReplicaSimulation(cfg, chats, num_replicas=1, router="cost").run()
    on = ReplicaSimulation(cfg, chats, num_replicas=1, router="cost", tiers=TierConfig(host_tier_bytes=16 * GIB)).run()
    assert off["host_hit_rate"] == 0 and on["host_hit_rate"] > 0.1
    assert on["prefix_hit_rate"] > off["prefix_hit_rate"]
    tiny = TierConfig(host_tier_bytes=cfg.budget().bytes_per_block * 4)
    capped = ReplicaSimulation(cfg, chats, num_replicas=1, router="cost", tiers=tiny).run()
    assert capped["host_evictions"] > 0 and capped["host_hit_rate"] < on["host_hit_rate"]


def test_loads_delay_the_first_token_by_the_link_time(chats) -> None:
    slow = TierConfig(remote_tier=True, remote_bandwidth=1e6)  # 1 MB/s: a 16-token block takes 0.5 s
    fast = TierConfig(remote_tier=True)
    a = ReplicaSimulation(config(1200), chats, num_replicas=4, router="round-robin", tiers=slow).run()
    b = ReplicaSimulation(config(1200), chats, num_replicas=4, router="round-robin", tiers=fast).run()
    assert a["ttft_p50_s"] > b["ttft_p50_s"] + 1.0


def test_bad_input_is_a_typed_error(chats) -> None:
    with pytest.raises(InvalidArgumentError):
        ReplicaSimulation(config(1200), chats, num_replicas=0, router="cost")
    with pytest.raises(InvalidArgumentError):
        run_replicas(config(1200), chats, num_replicas=2, routers=["fastest"])
    with pytest.raises(InvalidArgumentError):
        TierConfig(host_tier_bytes=-1)


def test_command_line_reports_every_router(capsys) -> None:
    code = simulate_main(["--replicas", "2", "--router", "round-robin,cost", "--num-requests", "30",
                          "--remote-tier", "--host-tier-gib", "1", "--json", "--no-progress"])  # fmt: skip
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["routers"]) == {"round-robin", "cost"} and data["replicas"] == 2
    for r in data["routers"].values():
        assert {"gpu_hit_rate", "host_hit_rate", "remote_hit_rate", "ttft_p99_s", "tpot_p99_s"} <= set(r)
    with pytest.raises(SystemExit):
        simulate_main(["--replicas", "2", "--router", "nope"])


def test_command_line_replicas_honour_one_eviction_policy(capsys) -> None:
    """`--replicas 1 --eviction slru --partial-reuse` is `--allocators paged-prefix --eviction slru
    --partial-reuse` (it used to ignore both flags); several policies at once are refused in one line."""
    small = ["--num-requests", "30", "--workload", "multi-turn", "--rate", "4", "--json", "--no-progress"]
    policy = ["--eviction", "slru", "--partial-reuse"]
    assert simulate_main([*small, *policy, "--allocators", "paged-prefix"]) == 0
    single = json.loads(capsys.readouterr().out)["allocators"]["paged-prefix:slru"]
    assert simulate_main([*small, *policy, "--replicas", "1", "--router", "cost"]) == 0
    one = json.loads(capsys.readouterr().out)["routers"]["cost"]
    assert {k: one[k] for k in SHARED_KEYS} == {k: single[k] for k in SHARED_KEYS}
    assert simulate_main([*small, "--eviction", "lru,slru", "--replicas", "2"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
