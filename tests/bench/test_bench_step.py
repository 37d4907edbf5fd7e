"""`pagedkv bench step`: the phase split adds up, the fit is a line, the instrumentation leaves nothing behind."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AttentionInterface

from pagedkv.bench import step as bench_step
from pagedkv.cli import main
from pagedkv.hf.attention import ATTENTION_NAME, paged_attention_forward
from pagedkv.hf.cpu_linear import choose_linear_backend
from pagedkv.hf.tiny import tiny_model


@pytest.mark.parametrize("forward", ["fused", "transformers"])
def test_measure_splits_a_step_into_phases_and_undoes_its_timers(forward: str) -> None:
    model = tiny_model("llama", 0)
    row = bench_step.measure(model, 3, 10, 4, model_forward=forward)
    assert row["model_forward"] == forward
    phases = row["phases_ms"]
    assert list(phases) == list(bench_step.PHASES)
    auto = choose_linear_backend("auto", torch.float32, torch.device("cpu"))  # oneDNN-packed where torch has oneDNN
    assert row["batch"] == 3 and row["step_ms"] > 0 and row["linear_backend"] == auto
    for name in ("schedule", "metadata", "linear", "attention", "sampling", "update"):
        assert phases[name] > 0, name
    assert sum(phases.values()) == pytest.approx(row["instrumented_step_ms"])
    # nothing stays wrapped: the model's modules and the registered attention are the originals again
    assert all("forward" not in vars(m) for m in model.modules())
    assert AttentionInterface._global_mapping[ATTENTION_NAME] is paged_attention_forward


def test_fit_is_least_squares_over_batch_sizes() -> None:
    rows = [{"batch": b, "step_ms": 5.0 + 0.5 * b} for b in (1, 4, 16)]
    fixed, per_token = bench_step.fit(rows)
    assert fixed == pytest.approx(5.0) and per_token == pytest.approx(0.5)
    assert bench_step.fit(rows[:1]) == (None, None)


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    before = torch.get_num_threads()
    try:
        code = main(["bench", "step", "--model", "tiny:llama", "--batch-sizes", "1,2", "--steps", "3", "--json",
                     "--threads", "1"])  # fmt: skip
    finally:
        torch.set_num_threads(before)
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["batch"] for r in result["batches"]] == [1, 2]
    assert result["torch_threads"] == 1 and result["fixed_ms"] is not None and result["overhead_ms"] is not None


@pytest.mark.parametrize("bad", ["0", "1,x", "", "2000"])
def test_bad_batch_sizes_are_one_line_errors(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "step", "--batch-sizes", bad]) == 2
    assert capsys.readouterr().err.count("\n") == 1
