"""`pagedkv simulate` with the hybrid allocator: the real scheduler over `HybridKVManager` for hybrid catalog
models, uniform (paged) and hybrid side by side in one run, the pool sized in hybrid pages, no leaks."""

from __future__ import annotations

import json

import pytest

from pagedkv.cli import main
from pagedkv.core.errors import CapacityError, InvalidArgumentError
from pagedkv.core.hybrid import HybridKVManager
from pagedkv.sim.allocators import check_allocator
from pagedkv.sim.catalog import BUILTIN_GPUS, BUILTIN_MODELS
from pagedkv.sim.hybrid_kv import GroupedKV
from pagedkv.sim.run import run_simulation
from pagedkv.sim.run_metrics import summarize
from pagedkv.sim.simulator import Replay, SimConfig, simulate
from pagedkv.sim.workload import WorkloadSpec, build_workload

H100 = BUILTIN_GPUS["h100-80gb"]
# long prompts (two Gemma 2 windows), short answers: what windows free
LONG = WorkloadSpec(source="fixed", num_requests=60, prompt_len=8000, output_len=32, seed=1)


def test_hybrid_pool_is_sized_in_hybrid_pages_with_the_models_groups() -> None:
    model = BUILTIN_MODELS["gemma-2-27b"]
    config = SimConfig(model, H100, "hybrid", max_model_len=8192)
    budget = config.budget()
    kv = GroupedKV(model, 16)
    assert budget.bytes_per_block == kv.bytes_per_block == 23 * 16 * model.kv_bytes_per_layer_token
    uniform = SimConfig(model, H100, "paged", max_model_len=8192).budget()
    assert budget.kv_budget_bytes == uniform.kv_budget_bytes, "same memory, other pages"
    assert budget.num_blocks == uniform.num_blocks * 2 or budget.num_blocks == uniform.num_blocks * 2 + 1
    replay = Replay(config, build_workload(LONG, 8192), budget)
    assert isinstance(replay.manager, HybridKVManager)
    assert [g.label() for g in replay.manager.groups] == ["sliding-4096", "full"]
    assert replay.manager.num_blocks == budget.num_usable_blocks


def test_hybrid_refused_for_contiguous_names_and_known_for_hybrid() -> None:
    assert check_allocator("hybrid") == "hybrid" and check_allocator("hybrid-prefix") == "hybrid-prefix"
    with pytest.raises(InvalidArgumentError, match="unknown allocator"):
        check_allocator("hybrid-max")


def test_gemma2_long_prompts_hybrid_holds_more_requests_and_less_dead_kv() -> None:
    report = run_simulation("gemma-2-27b", "h100-80gb", LONG, allocators=["paged"], max_model_len=8192, check_every=5)
    assert list(report.results) == ["paged", "hybrid"], "a hybrid model gets its hybrid row beside paged"
    paged, hybrid = report.results["paged"], report.results["hybrid"]
    assert paged["num_requests"] == hybrid["num_requests"] == 60
    assert hybrid["peak_concurrency"] > paged["peak_concurrency"]
    # uniform: the sliding half of the layers keeps ~3,900 of 8,000 prompt tokens no query reads
    assert 0.2 < paged["kv_unread"] < 0.3, paged["kv_unread"]
    assert hybrid["kv_unread"] < 0.05, hybrid["kv_unread"]
    assert hybrid["tokens_per_s"] > paged["tokens_per_s"]
    assert report.traces["hybrid"].final_used_blocks == 0


def test_mistral_every_layer_sliding_under_preemption() -> None:
    """Mistral 7B v0.1 (every layer windowed) on a pool that forces preemption: the hybrid row finishes every
    request, holds more of them at once, and leaks nothing."""
    spec = WorkloadSpec(source="fixed", num_requests=12, prompt_len=6000, output_len=1500, seed=2)
    kw = dict(allocators=["paged"], max_model_len=8192, activation_bytes=55 * 2**30, check_every=100)
    report = run_simulation("mistral-7b-v0.1", "h100-80gb", spec, **kw)  # type: ignore[arg-type]
    paged, hybrid = report.results["paged"], report.results["hybrid"]
    assert paged["preemptions"] > 0, "the uniform pool is under pressure"
    assert hybrid["num_requests"] == paged["num_requests"] == 12
    assert hybrid["preemptions"] < paged["preemptions"]
    assert hybrid["mean_concurrency"] > 1.4 * paged["mean_concurrency"]
    assert hybrid["peak_concurrency"] > paged["peak_concurrency"]


def test_non_hybrid_model_gets_no_hybrid_row() -> None:
    spec = WorkloadSpec(num_requests=30, time_scale=20.0)
    report = run_simulation("llama-2-7b", "a100-40gb", spec, allocators=["paged"], max_model_len=1024)
    assert list(report.results) == ["paged"]
    paged = report.results["paged"]  # full attention only: what no query reads is the empty slots
    assert paged["kv_unread"] == pytest.approx(paged["kv_waste"], abs=1e-9) and paged["kv_unread"] > 0


def test_hybrid_prefix_twin_of_paged_prefix() -> None:
    spec = WorkloadSpec(source="shared-prefix", num_requests=40, seed=3)
    report = run_simulation("gpt-oss-120b", "h100-80gb", spec, allocators=["paged-prefix"], max_model_len=4096)
    assert list(report.results) == ["paged-prefix", "hybrid-prefix"]
    assert report.results["hybrid-prefix"]["prefix_hit_rate"] > 0.3, "shared prefixes hit across groups"


def test_simulate_cli_prints_uniform_vs_hybrid(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--model", "gemma-3-27b", "--gpu", "h100-80gb", "--allocators", "paged",
            "--workload", "fixed", "--prompt-len", "4000", "--output-len", "16", "--num-requests", "30",
            "--max-model-len", "8192", "--no-progress"]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "uniform vs hybrid (KV cache groups: sliding-1024: 52 layers in 6 groups, full: 10 layers in 1 group;" in text
    assert "KV unread" in text and "\nhybrid " in text
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = data["allocators"]
    assert set(rows) == {"paged", "hybrid"} and rows["hybrid"]["num_blocks"] > rows["paged"]["num_blocks"]


def test_summaries_agree_with_the_trace() -> None:
    model = BUILTIN_MODELS["gpt-oss-120b"]
    spec = WorkloadSpec(source="fixed", num_requests=20, prompt_len=3000, output_len=8, seed=4)
    trace = simulate(SimConfig(model, H100, "hybrid", max_model_len=4096), build_workload(spec, 4096))
    s = summarize(trace)
    assert s["kv_held_gib"] > 0 and 0 <= s["kv_unread"] < 1
    assert s["num_blocks"] == trace.budget.num_blocks
    assert trace.budget.bytes_per_block == GroupedKV(model, 16).bytes_per_block


def test_step_model_reads_only_the_window_of_sliding_layers() -> None:
    from pagedkv.sim.step_time import StepTimeModel

    gemma2 = BUILTIN_MODELS["gemma-2-27b"]  # 23 sliding (4096) + 23 full layers
    m = StepTimeModel(gemma2, H100)
    per = gemma2.kv_bytes_per_layer_token
    start, new = [8000.0, 100.0], [1.0, 1.0]
    import numpy as np

    read = m.kv_read_bytes(np.array(start), np.array(new))
    assert read == 23 * per * (8001 + 101) + 23 * per * (4096 + 101)
    llama = StepTimeModel(BUILTIN_MODELS["llama-2-7b"], H100)
    assert llama.kv_read_bytes(np.array(start), np.array(new)) == 8102 * BUILTIN_MODELS["llama-2-7b"].kv_bytes_per_token


def test_uniform_run_that_cannot_hold_one_request_is_skipped_beside_hybrid(capsys: pytest.CaptureFixture[str]) -> None:
    """Gemma 3 at 128k: the uniform pool (about 41k tokens) cannot hold one request of max_model_len, the
    hybrid one can; the comparison runs the hybrid row and says why the uniform one did not run."""
    spec = WorkloadSpec(source="fixed", num_requests=3, prompt_len=100_000, output_len=4, seed=5)
    report = run_simulation("gemma-3-27b", "h100-80gb", spec, allocators=["paged"], max_model_len=131072)
    assert list(report.results) == ["hybrid"] and report.results["hybrid"]["num_requests"] == 3
    assert "less than one request of max_model_len=131072" in report.skipped["paged"]
    assert report.to_json()["skipped"] == report.skipped
    from pagedkv.sim.report import simulate_text

    assert "paged: not run: the KV budget" in simulate_text(report)
    with pytest.raises(CapacityError, match="less than one request"):  # nothing to compare with: the error
        run_simulation("gemma-3-27b", "h100-80gb", spec, allocators=["contiguous-max"], max_model_len=131072)
