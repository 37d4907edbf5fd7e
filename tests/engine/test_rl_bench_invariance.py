"""`pagedkv bench rl`'s batch-invariant figures: the mode's cost (rollout tokens/s against the default, over
interleaved rounds) and each mode's greedy logprob drift between a prompt alone and in the batch; the
invariant mode's drift is 0 by contract. `--batch-invariant` runs the whole loop in the mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.cli import main

SMALL = ["bench", "rl", "--prompts", "3", "--samples", "2", "--iterations", "1", "--max-tokens", "5",
         "--prompt-len", "20", "--num-blocks", "64", "--host-blocks", "0", "--threads", "1", "--sharing", "n"]  # fmt: skip


@pytest.mark.parametrize("loop", ["default", "batch-invariant"])
def test_bench_rl_reports_the_cost_and_the_drift_of_batch_invariant_mode(
    loop: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rl.json"
    extra = ["--batch-invariant"] if loop == "batch-invariant" else []
    assert main([*SMALL, "--invariance-rounds", "2", *extra, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "batch-invariant mode (n rollout, 2 interleaved rounds)" in printed and "logprob drift" in printed
    result = json.loads(out.read_text())
    assert result["stale_kv_check"] == "pass"
    inv = result["batch_invariance"]
    assert all(len(inv["rollout_tok_s"][m]) == 2 and min(inv["rollout_tok_s"][m]) > 0 for m in ("default", "invariant"))
    assert inv["cost"] > 0 and inv["cpu_cost"] > 0
    assert inv["logprob_drift"]["invariant"] == 0.0
    assert inv["logprob_drift"]["default"] >= 0.0


def test_zero_rounds_skip_the_measurement(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rl.json"
    assert main([*SMALL, "--invariance-rounds", "0", "--json", str(out)]) == 0
    assert "batch-invariant mode" not in capsys.readouterr().out
    assert json.loads(out.read_text())["batch_invariance"] is None


def test_a_tied_weight_is_perturbed_once_so_the_stale_kv_check_compares_equal_weights(tmp_path: Path) -> None:
    """gpt2's lm_head is its input embedding: perturbed under both names, the engine (the folder's order)
    and the fresh engine (load_state_dict's) would end on different weights and the check fail."""
    argv = ["bench", "rl", "--model", "tiny:gpt2", "--iterations", "2", "--prompts", "3", "--samples", "2",
            "--max-tokens", "8", "--sharing", "n", "--invariance-rounds", "0", "--threads", "1", "--perturb", "0.5",
            "--json", str(tmp_path / "rl.json")]  # fmt: skip
    assert main(argv) == 0
    assert json.loads((tmp_path / "rl.json").read_text())["stale_kv_check"] == "pass"
