"""One of each across the engine, the simulator and the benchmarks: the scheduler's settings, the manager
factory and the KV-size arithmetic each have one owner that the others use."""

from __future__ import annotations

from dataclasses import fields

import pytest

from pagedkv.core import ContiguousKVManager, PagedKVManager
from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.managers import MANAGER_KINDS, make_manager
from pagedkv.engine.scheduler import SchedulerConfig
from pagedkv.sim.allocators import ALLOCATORS, CONTIGUOUS, manager_for
from pagedkv.sim.catalog import Catalog
from pagedkv.sim.simulator import SIM_SCHEDULER, SimConfig
from pagedkv.storage.kv_spec import KVCacheSpec, blocks_in_budget, kv_bytes_per_token

SCHEDULER_FIELDS = {f.name for f in fields(SchedulerConfig)}


def _sim_config(**kw: object) -> SimConfig:
    catalog = Catalog.builtin()
    return SimConfig(catalog.model("llama-2-7b"), catalog.gpu("a100-40gb"), **kw)  # type: ignore[arg-type]


def test_the_scheduler_settings_are_declared_once() -> None:
    for config in (EngineConfig, SimConfig):
        own = {f.name for f in fields(config)}
        assert not own & SCHEDULER_FIELDS, f"{config.__name__} re-declares {sorted(own & SCHEDULER_FIELDS)}"
    assert EngineConfig(num_blocks=8).scheduler == SchedulerConfig(), "the engine uses the one default"
    assert SchedulerConfig().max_num_batched_tokens == 512 and SchedulerConfig().max_num_seqs == 256
    # the simulator's explicit budget and vLLM's greedy admission (no growth reserve, no shared-prefix hold),
    # everything else the shared defaults
    assert _sim_config().scheduler == SIM_SCHEDULER
    assert SIM_SCHEDULER.max_num_batched_tokens == 8192 and SIM_SCHEDULER.admission_lookahead == 0
    assert not SIM_SCHEDULER.hold_shared_prefix and SchedulerConfig().hold_shared_prefix
    own = {"max_num_batched_tokens", "admission_lookahead", "hold_shared_prefix"}
    assert {n: getattr(SIM_SCHEDULER, n) for n in SCHEDULER_FIELDS - own} == {
        n: getattr(SchedulerConfig(), n) for n in SCHEDULER_FIELDS - own
    }


@pytest.mark.parametrize(
    "kw",
    [
        {"max_num_seqs": 0},
        {"max_num_batched_tokens": 0},
        {"max_num_batched_tokens": True},
        {"max_num_seqs": 2.0},
        {"preemption_mode": "drop"},
    ],
)
def test_scheduler_config_validates_on_construction(kw: dict[str, object]) -> None:
    with pytest.raises(InvalidArgumentError):
        SchedulerConfig(**kw)  # type: ignore[arg-type]


def test_the_embedding_configs_check_what_spans_both() -> None:
    with pytest.raises(InvalidArgumentError, match="swap needs the paged or hybrid allocator"):
        EngineConfig(num_blocks=8, allocator="contiguous", scheduler=SchedulerConfig(preemption_mode="swap"))
    with pytest.raises(InvalidArgumentError, match="SchedulerConfig"):
        EngineConfig(num_blocks=8, scheduler={"max_num_seqs": 4})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="recompute"):
        _sim_config(scheduler=SchedulerConfig(preemption_mode="swap"))
    budget = _sim_config(scheduler=SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=8)).budget()
    assert budget.activation_bytes < _sim_config().budget().activation_bytes, "the sim reads its scheduler"


def test_one_manager_factory_for_every_entry_point() -> None:
    assert MANAGER_KINDS == ("paged", "contiguous", "hybrid")
    paged = make_manager("paged", 8, 4, num_host_blocks=3, record_events=True)
    assert isinstance(paged, PagedKVManager) and paged.enable_prefix_caching
    assert not make_manager("paged", 8, 4, enable_prefix_caching=False).enable_prefix_caching
    assert isinstance(make_manager("contiguous", 8, 4), ContiguousKVManager)
    with pytest.raises(InvalidArgumentError, match="unknown allocator 'paged-prefix'"):
        make_manager("paged-prefix", 8, 4)
    for name in ALLOCATORS:  # the simulator's four names are policies over the two kinds
        manager = manager_for(name, 8, 4)
        assert isinstance(manager, ContiguousKVManager) == (name in CONTIGUOUS)
        if isinstance(manager, PagedKVManager):
            assert manager.enable_prefix_caching == (name == "paged-prefix")
    with pytest.raises(InvalidArgumentError, match="unknown allocator"):
        manager_for("contiguous", 8, 4)


def test_one_kv_size_arithmetic() -> None:
    model = Catalog.builtin().model("llama-3-8b")
    spec = KVCacheSpec(model.num_layers, model.num_kv_heads, model.head_dim, "bfloat16")
    assert model.kv_bytes_per_token == spec.bytes_per_token == kv_bytes_per_token(32, 8, 128, 2) == 131072
    assert blocks_in_budget(10 * spec.bytes_per_block(16) - 1, spec.bytes_per_block(16)) == 9, "floor"
    assert spec.num_blocks_for_budget(10 * spec.bytes_per_block(16), 16) == 10
    budget = _sim_config().budget()
    assert budget.num_blocks == blocks_in_budget(budget.kv_budget_bytes, budget.bytes_per_block)
    with pytest.raises(InvalidArgumentError, match="bytes_per_block"):
        blocks_in_budget(100, 0)
