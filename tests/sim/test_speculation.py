"""Speculation in the simulator: the same requests finish with the same tokens, no block leaks, the
acceptance drawn is the one asked for, and the figures move as the roofline says: at low load (memory-bound
steps) accepted drafts are nearly free tokens, so speculation cuts TPOT; with nothing accepted and a costly
draft it only slows down; the contiguous allocators do not speculate."""

from __future__ import annotations

import pytest

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.sim.catalog import BUILTIN_GPUS, BUILTIN_MODELS
from pagedkv.sim.commands_simulate import simulate_main
from pagedkv.sim.run_metrics import summarize
from pagedkv.sim.simulator import SimConfig, simulate
from pagedkv.sim.speculation import SpecSim
from pagedkv.sim.workload import WorkloadSpec, build_workload

MODEL, GPU = BUILTIN_MODELS["llama-2-7b"], BUILTIN_GPUS["a100-40gb"]


@pytest.fixture(scope="module")
def light():
    """A light load: few requests at a time, memory-bound decode steps."""
    return build_workload(WorkloadSpec(num_requests=40, time_scale=2.0), 2048)


def run(workload, spec: SpecSim | None, allocator: str = "paged-prefix") -> tuple[dict, object]:
    config = SimConfig(MODEL, GPU, allocator, max_model_len=2048, speculation=spec)
    trace = simulate(config, workload, check_every=5)
    assert trace.final_used_blocks == 0, "speculation leaked blocks"
    return summarize(trace), trace


def test_accepted_drafts_cut_tpot_at_low_load(light) -> None:
    plain, _ = run(light, None)
    spec, trace = run(light, SpecSim(k=4, acceptance_rate=0.8))
    assert spec["num_requests"] == plain["num_requests"] == len(light.requests)
    assert spec["spec_acceptance_rate"] == pytest.approx(0.8 * (1 - 0.8**4) / (1 - 0.8) / 4, abs=0.08)
    assert trace.spec_drafts > 0 and spec["num_steps"] < plain["num_steps"]
    assert spec["tpot_p50_s"] < 0.6 * plain["tpot_p50_s"], (spec["tpot_p50_s"], plain["tpot_p50_s"])
    assert "spec_acceptance_rate" not in plain


def test_nothing_accepted_with_a_costly_draft_only_slows_down(light) -> None:
    plain, _ = run(light, None)
    spec, trace = run(light, SpecSim(k=4, acceptance_rate=0.0, draft_cost=0.2))
    assert trace.spec_drafts > 0 and trace.spec_accepted_tokens == 0
    assert spec["tpot_p50_s"] > 1.5 * plain["tpot_p50_s"]
    assert spec["spec_draft_time_fraction"] > 0.3


def test_the_contiguous_baseline_does_not_speculate(light) -> None:
    plain, _ = run(light, None, "contiguous-oracle")
    spec, trace = run(light, SpecSim(k=4, acceptance_rate=0.9), "contiguous-oracle")
    assert trace.spec_drafts == 0 and spec == plain


def test_bad_parameters_are_refused() -> None:
    for kw in ({"k": 0}, {"acceptance_rate": 1.5}, {"draft_cost": -1.0}, {"acceptance_rate": float("nan")}):
        with pytest.raises(InvalidArgumentError):
            SpecSim(**kw)  # type: ignore[arg-type]
    assert SpecSim(k=3, acceptance_rate=1.0).expected_tokens_per_verification == 4.0
    assert SpecSim(k=2, acceptance_rate=0.5).expected_tokens_per_verification == pytest.approx(1.75)


def test_simulate_flags(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "llama-2-7b", "--gpu", "a100-40gb", "--allocators", "paged-prefix", "--num-requests", "30",
            "--max-model-len", "2048", "--no-progress", "--spec-k", "3", "--spec-acceptance", "0.6", "--json"]  # fmt: skip
    assert simulate_main(argv) == 0
    import json

    row = json.loads(capsys.readouterr().out)["allocators"]["paged-prefix"]
    assert 0.3 < row["spec_acceptance_rate"] < 0.7 and row["spec_mean_accepted_length"] > 1.5
    with pytest.raises(SystemExit) as bad:
        simulate_main([*argv[:-1], "--spec-acceptance", "2"])
    assert bad.value.code == 2
    assert "--spec-acceptance" in capsys.readouterr().err
