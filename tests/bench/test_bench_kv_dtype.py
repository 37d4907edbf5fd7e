"""`pagedkv bench kv-dtype` on the tiny model: every part runs, the baseline row carries no differences, the
capacity follows the bytes per token, and the table prints every dtype side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pagedkv.bench import kv_dtype
from pagedkv.engine.cli_args import OneLineParser
from pagedkv.hf.tiny import tiny_model
from pagedkv.ops import cpu_decode


class _Tokenizer:
    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [3 + ord(c) % 120 for c in text]}


def _args(tmp_path: Path, *extra: str) -> Any:
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog; " * 20)
    parser = OneLineParser(prog="pagedkv bench kv-dtype")
    kv_dtype.add_arguments(parser)
    return parser.parse_args(["--text-file", str(text), "--max-tokens", "200", "--chunk", "64", "--prompts", "3",
                              "--prompt-tokens", "16", "--max-new-tokens", "6", "--contexts", "64,100",
                              "--repeat", "1", "--budget", "1MiB", "--request-tokens", "64", "--plan-requests", "20",
                              *extra])  # fmt: skip


def test_every_part_side_by_side(tmp_path: Path) -> None:
    args = _args(tmp_path)
    model = tiny_model("llama")
    result = {"model": "tiny", "torch_threads": 1, "dtypes": args.kv_cache_dtypes,
              "accuracy": kv_dtype.accuracy(model, _Tokenizer(), args), "capacity": kv_dtype.capacity(model, args),
              "speed": kv_dtype.speed(model, args)}  # fmt: skip
    acc = result["accuracy"]["rows"]
    assert "perplexity_change" not in acc["auto"] and acc["auto"]["tokens_scored"] == 199
    for d in ("bf16", "int8", "fp8_e4m3", "fp8_e5m2"):
        assert 0 <= acc[d]["logprob_abs_diff_mean"] <= acc[d]["logprob_abs_diff_max"]
        assert 0 <= acc[d]["greedy_token_agreement"] <= 1 and acc[d]["greedy_prompts"] == 3
    cap = result["capacity"]["rows"]
    reqs = [cap[d]["engine_requests_admitted"] for d in ("auto", "bf16", "int8")]
    assert reqs[0] < reqs[1] < reqs[2], reqs  # float32, bf16, one byte + scales
    assert cap["int8"]["plan_bytes_per_token"] < cap["bf16"]["plan_bytes_per_token"]
    assert cap["int8"]["plan_max_concurrent"] > cap["bf16"]["plan_max_concurrent"]
    speed = result["speed"]
    assert speed["paths"]["int8"] == "C kernel (codes)"
    assert speed["paths"]["bf16"] == ("C kernel (bf16)" if cpu_decode.isa() is not None else "SDPA gather")
    assert all(speed["seconds"][d]["100"] > 0 for d in args.kv_cache_dtypes)
    table = kv_dtype.text(result)
    for d in args.kv_cache_dtypes:
        assert table.count(f"\n{d} ") == 3, d


def test_block_scale_rows(tmp_path: Path) -> None:
    args = _args(tmp_path, "--kv-cache-dtypes", "auto,bf16,int8,int8/block", "--parts", "capacity")
    assert kv_dtype.kv_choice("int8/block") == ("int8", "block") and kv_dtype.kv_choice("int8") == ("int8", "token")
    cap = kv_dtype.capacity(tiny_model("llama"), args)["rows"]
    assert cap["int8/block"]["engine_bytes_per_block"] < cap["int8"]["engine_bytes_per_block"]
    assert cap["int8/block"]["engine_requests_admitted"] >= cap["int8"]["engine_requests_admitted"]
    assert cap["int8/block"]["plan_bytes_per_token"] < cap["int8"]["plan_bytes_per_token"]


@pytest.mark.parametrize("bad", ["int8,auto", "auto,int4", "auto,auto", "auto,bf16/block", "auto,int8/tensor"])
def test_dtype_lists_start_with_the_baseline(bad: str, tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        _args(tmp_path, "--kv-cache-dtypes", bad)
