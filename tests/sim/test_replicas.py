"""`simulate --replicas`: one replica is the single-GPU simulator; routers, tiers and loads behave as stated."""

from __future__ import annotations

import json

import pytest

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.sim.catalog import BUILTIN_GPUS, BUILTIN_MODELS
from pagedkv.sim.commands_simulate import simulate_main
from pagedkv.sim.metrics import summarize
from pagedkv.sim.replicas import GIB, ReplicaSimulation, TierConfig, run_replicas
from pagedkv.sim.simulator import SimConfig, simulate
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


def test_one_replica_without_tiers_is_the_single_gpu_simulator(chats) -> None:
    cfg = config(1200)
    single = summarize(simulate(cfg, chats))
    one = ReplicaSimulation(cfg, chats, num_replicas=1, router="cost").run()
    for key in ("prefix_hit_rate", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tokens_per_s", "preemptions"):
        assert one[key] == pytest.approx(single[key], rel=1e-9), key
    assert one["gpu_hit_rate"] == one["prefix_hit_rate"] > 0.5


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
