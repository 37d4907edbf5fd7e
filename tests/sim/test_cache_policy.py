"""The simulator runs paged-prefix under each eviction policy side by side, with partial reuse, and reports
prefill saved, misses by reason, throughput and TTFT per policy; the multi-tenant workload is seeded."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagedkv.core import InvalidArgumentError
from pagedkv.sim.commands_simulate import simulate_main
from pagedkv.sim.run import run_simulation
from pagedkv.sim.workload import WorkloadSpec
from pagedkv.workloads.generators import multi_tenant


def test_the_multi_tenant_generator_shares_system_prompts_and_is_seeded() -> None:
    a = multi_tenant(300, system_prompt_len=64, seed=1, max_prompt_len=1000)
    b = multi_tenant(300, system_prompt_len=64, seed=1, max_prompt_len=1000)
    assert all(np.array_equal(x.prompt_token_ids, y.prompt_token_ids) for x, y in zip(a, b))
    heads: dict[bytes, int] = {}
    for x in a:
        heads[x.prompt_token_ids[:64].tobytes()] = heads.get(x.prompt_token_ids[:64].tobytes(), 0) + 1
    shared = sorted((n for n in heads.values() if n > 1), reverse=True)
    assert len(shared) <= 16 and shared[0] > shared[-1] and sum(shared) > 150  # Zipf-popular tenants
    assert 80 < sum(1 for n in heads.values() if n == 1) < 170  # about 40% one-off documents
    assert max(x.prompt_len for x in a) <= 1000
    with pytest.raises(InvalidArgumentError):
        multi_tenant(10, doc_fraction=2.0)


def _report(system_prompt_len: int = 2048, **kw: object):  # type: ignore[no-untyped-def]
    spec = WorkloadSpec(
        source="multi-tenant", num_requests=150, arrivals="poisson", rate=1.0, system_prompt_len=system_prompt_len
    )
    return run_simulation(
        "llama-2-7b", "a100-40gb", spec, allocators=["paged-prefix"], max_model_len=4096,
        gpu_memory_utilization=0.6, check_every=50, **kw,
    )  # fmt: skip


def test_every_policy_runs_side_by_side_and_slru_keeps_the_tenants() -> None:
    report = _report(evictions=["lru", "slru", "lfu", "priority", "cost"])
    rows = report.results
    assert list(rows) == [f"paged-prefix:{p}" for p in ("lru", "slru", "lfu", "priority", "cost")]
    lru, slru = rows["paged-prefix:lru"], rows["paged-prefix:slru"]
    assert slru["prefill_tokens_saved"] > lru["prefill_tokens_saved"]
    assert rows["paged-prefix:priority"]["prefill_tokens_saved"] == lru["prefill_tokens_saved"]  # no priorities
    for r in rows.values():
        assert r["prefill_tokens_saved"] + r["prefill_tokens_computed"] > 0 and r["evictions"] > 0
        assert r["miss_tokens_no_key"] > 0 and "ttft_p99_s" in r and "tokens_per_s" in r


def test_partial_reuse_copies_blocks_and_charges_them() -> None:
    on = _report(2040, partial_reuse=True).results["paged-prefix"]  # 2040 % 16 = 8: prompts share half a block
    off = _report(2040).results["paged-prefix"]
    assert on["partial_hits"] > 0 and on["block_copies"] >= on["partial_hits"] and off["block_copies"] == 0
    assert on["prefill_tokens_saved"] > off["prefill_tokens_saved"]


def test_the_cli_takes_policies_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--allocators", "paged-prefix", "--workload", "multi-tenant", "--num-requests", "40", "--rate", "1",
            "--max-model-len", "4096", "--no-progress"]  # fmt: skip
    assert simulate_main([*args, "--eviction", "lru,lfu"]) == 0
    out = capsys.readouterr().out
    assert "paged-prefix:lfu" in out and "prefill saved" in out and "vs lru" in out
    assert simulate_main([*args, "--eviction", "lru,cost", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["allocators"]["paged-prefix:cost"]["eviction"] == "cost"
    with pytest.raises(SystemExit):
        simulate_main([*args, "--eviction", "lru,mru"])
    assert "unknown or repeated eviction policy" in capsys.readouterr().err
