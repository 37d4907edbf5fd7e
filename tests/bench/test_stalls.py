"""The stall benchmark's accounting: bytes copied by each growth policy, slow-step counting, GPU-scale model."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.bench import stalls
from pagedkv.core.errors import InvalidArgumentError


@pytest.fixture(scope="module")
def tiny_logs():
    from pagedkv.hf.tiny import tiny_model

    model = tiny_model("llama")
    requests = stalls.build_requests([12, 40], 60, 128, seed=0)
    return requests, stalls.run_stalls(model, requests)


def doubling_copies(prompt_len: int, final_len: int) -> list[int]:
    """Token counts the doubling buffer copies while a sequence grows from `prompt_len` to `final_len`
    tokens: the full buffer at each doubling (the accounting `DoublingLayer` must reproduce)."""
    cap, copies = stalls.next_capacity(prompt_len), []
    while cap < final_len:
        copies.append(cap)
        cap *= 2
    return copies


def _kv_bytes_per_token() -> int:
    return 2 * 2 * 2 * 16 * 4  # K and V x 2 layers x 2 KV heads x head_dim 16 x fp32


def test_doubling_copies_the_full_buffer_at_each_doubling(tiny_logs) -> None:
    requests, logs = tiny_logs
    assert doubling_copies(12, 71) == [16, 32, 64], "12 -> cap 16 -> 32 -> 64 -> 128"
    assert doubling_copies(40, 99) == [64], "40 -> cap 64 -> 128"
    expected = sum(sum(doubling_copies(len(r.prompt_token_ids), len(r.prompt_token_ids) + r.output_len - 1))
                   for r in requests)  # fmt: skip
    log = logs["doubling"]
    assert sum(log.copied_bytes) == expected * _kv_bytes_per_token(), "observed copies = the doublings"
    assert sum(1 for b in log.copied_bytes if b) == 4, "four reallocations, each one step"


def test_dynamic_cache_copies_the_whole_cache_every_decode_step(tiny_logs) -> None:
    requests, logs = tiny_logs
    # decode step k of a request holds prompt + k tokens before it appends the next one
    expected = sum(
        sum(range(len(r.prompt_token_ids), len(r.prompt_token_ids) + r.output_len - 1)) for r in requests
    )
    log = logs["hf-dynamic"]
    assert sum(log.copied_bytes) == expected * _kv_bytes_per_token(), "torch.cat copies everything held"
    assert not any(b for b, p in zip(log.copied_bytes, log.prefill) if p), "a prefill copies nothing"


def test_paged_never_copies_and_outputs_agree(tiny_logs) -> None:
    requests, logs = tiny_logs
    assert sum(logs["pagedkv-paged"].copied_bytes) == 0, "pages never move"
    for name, log in logs.items():
        assert [len(o) for o in log.outputs] == [60, 60], f"{name}: every token generated"
        assert sum(not p for p in log.prefill) == 2 * 59, f"{name}: one decode step per later token"
    assert logs["doubling"].outputs == logs["hf-dynamic"].outputs, "the doubling buffer changes no token"


def test_slow_step_counting() -> None:
    assert stalls.slow_steps([1.0, 1.0, 1.0, 1.0, 2.0, 2.01, 5.0]) == 2, "strictly above 2x the median (1.0)"
    assert stalls.slow_steps([]) == 0
    log = stalls.StepLog()
    for secs, prefill, copied in [(9.0, True, 0), (1.0, False, 0), (1.0, False, 8), (3.0, False, 0)]:
        log.add(secs, prefill, copied)
    s = stalls.summarize(log)
    assert (s["decode_steps"], s["prefill_steps"], s["slow_steps"]) == (3, 1, 1), "prefill kept out"
    assert (s["bytes_copied"], s["reallocating_steps"], s["step_max_ms"]) == (8, 1, 3000.0)


def test_bad_requests_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="output_len >= 2"):
        stalls.build_requests([4], 1, 128)


def test_simulator_reallocation_model() -> None:
    from pagedkv.sim.simulator import realloc_copy_tokens

    assert realloc_copy_tokens("none", 0, 100, 101) == (0, 0)
    assert realloc_copy_tokens("concat", 0, 100, 101) == (100, 101), "concat copies all it holds"
    assert realloc_copy_tokens("doubling", 0, 0, 100) == (0, 128), "first buffer: nothing to copy"
    assert realloc_copy_tokens("doubling", 128, 127, 128) == (0, 128), "fits"
    assert realloc_copy_tokens("doubling", 128, 128, 129) == (128, 256), "full: copy and double"


def test_simulated_copies_cost_bandwidth() -> None:
    from pagedkv.sim.catalog import Catalog
    from pagedkv.sim.simulator import SimConfig, simulate
    from pagedkv.sim.workload import WorkloadSpec, build_workload

    cat = Catalog.builtin()
    model, gpu = cat.model("llama-2-7b"), cat.gpu("a100-80gb")
    wl = build_workload(
        WorkloadSpec("fixed", num_requests=1, prompt_len=100, output_len=60, arrivals="burst"), 4096
    )
    base = simulate(SimConfig(model, gpu, "contiguous-oracle"), wl)
    doubled = simulate(SimConfig(model, gpu, "contiguous-oracle", realloc="doubling"), wl)
    # 100 -> 128 (prefill), full at 128: one copy of 128 tokens; 159 tokens never reach 256
    assert doubled.realloc_bytes == 128 * model.kv_bytes_per_token, "one doubling"
    extra = sum(doubled.step_s) - sum(base.step_s)
    assert extra == pytest.approx(2 * 128 * model.kv_bytes_per_token / gpu.hbm_bandwidth_bytes_per_s), (
        "read+write"
    )
    assert np.count_nonzero(doubled.realloc_s) == 1, "in one step"
    with pytest.raises(InvalidArgumentError, match="paged"):
        SimConfig(model, gpu, "paged", realloc="doubling")


def test_command_quick_json(capsys) -> None:
    import json

    from pagedkv.cli import main

    assert (
        main(["bench", "stalls", "--quick", "--model", "tiny:llama", "--json", "--systems", "doubling"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["systems"]["doubling"]["decode_steps"] == 2 * 39, "two quick requests of 40 tokens"
    assert out["systems"]["doubling"]["bytes_copied"] > 0, "quick lengths still cross a doubling"
    assert main(["bench", "stalls", "--quick", "--model", "tiny:llama", "--systems", "nope"]) == 2, (
        "one-line error"
    )


def test_allocator_choice_is_bit_identical_on_a_tiny_model() -> None:
    from pagedkv.bench.bitwise import check_allocators
    from pagedkv.hf.tiny import tiny_model

    r = check_allocators(tiny_model("llama"), [[5, 6, 7], [9] * 20], 4)
    assert r["same_schedule"] and r["bitwise_equal"] and r["max_abs_diff"] == 0.0, r
