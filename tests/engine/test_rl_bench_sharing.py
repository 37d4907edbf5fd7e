"""`pagedkv bench rl --sharing`: each rollout run as one request of n samples, as n requests with one group_id,
and as n unshared requests; the prompt tokens the model computed are exact for each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.cli import main


def test_each_sharing_mode_computes_the_prompt_tokens_it_should(tmp_path: Path) -> None:
    out = tmp_path / "rl.json"
    prompts, samples, prompt_len = 3, 4, 40  # 20 tokens of system prefix shared by every prompt
    argv = ["bench", "rl", "--prompts", str(prompts), "--samples", str(samples), "--iterations", "1",
            "--max-tokens", "4", "--prompt-len", str(prompt_len), "--num-blocks", "128", "--host-blocks", "0",
            "--threads", "1", "--sharing", "group,n,none", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    computed = {mode: row["sharing"][mode]["prompt_tokens_computed"] for mode in ("n", "group", "none")}
    # n: the first prompt whole, the others their own tails (the system prefix comes from the cache)
    assert computed["n"] == prompt_len + (prompts - 1) * (prompt_len - prompt_len // 2)
    # group: as n, plus what each follower computes again at the end of its cached prompt (under one block)
    followers = prompts * (samples - 1)
    extra = computed["group"] - computed["n"]
    assert extra % followers == 0 and 1 <= extra // followers <= 16, computed
    assert computed["none"] == prompts * samples * prompt_len  # every sample its whole prompt
    shared = {mode: row["sharing"][mode]["group_shared_tokens"] for mode in ("n", "group", "none")}
    assert shared["n"] == shared["none"] == 0 and shared["group"] == followers * prompt_len - extra
    assert row["rollout_tokens"] == row["sharing"]["group"]["rollout_tokens"] == prompts * samples * 4


@pytest.mark.parametrize("bad", ["n,n", "fork", ""])
def test_a_bad_sharing_list_is_refused(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "rl", "--sharing", bad]) == 2
    assert "argument --sharing: give distinct modes" in capsys.readouterr().err
