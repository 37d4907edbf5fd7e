"""`pagedkv bench attention` runs end to end at a tiny shape and reports what it measured."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedkv.bench import attention


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    attention.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_json_rows(capsys: pytest.CaptureFixture[str]) -> None:
    args = _args("--batch", "2", "--context", "40", "--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "8",
                 "--repeats", "1", "--json", "--block-size", "16", "--threads", "1")
    assert attention.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["results"]
    assert [(r["mode"], r["batch"], r["context"]) for r in rows] == [("decode", 2, 40), ("prefill", 2, 40)]
    for r in rows:
        assert r["paged_ms"] > 0 and r["contiguous_ms"] > 0
        assert r["ratio"] == pytest.approx(r["paged_ms"] / r["contiguous_ms"], rel=1e-2)
        assert r["max_abs_diff"] < 1e-5, "paged and contiguous outputs disagree"
    assert report["config"]["block_size"] == 16


def test_table_and_skips(capsys: pytest.CaptureFixture[str]) -> None:
    args = _args("--batch", "1", "--context", "32", "--num-heads", "2", "--num-kv-heads", "1", "--head-dim", "8",
                 "--repeats", "1", "--mode", "prefill", "--prefill-max-tokens", "16")
    assert attention.run(args) == 0
    out = capsys.readouterr().out
    assert "skipped: prefill batch=1 context=32" in out and "paged ms" in out


def test_the_cpu_decode_kernel_is_timed_against_contiguous_sdpa(capsys: pytest.CaptureFixture[str]) -> None:
    from native_policy import require_native

    from pagedkv.ops import cpu_decode

    require_native("pagedkv.ops._cpu_decode", cpu_decode.isa() is not None)
    args = _args("--batch", "3", "--context", "70", "--num-heads", "6", "--num-kv-heads", "2", "--head-dim", "16",
                 "--repeats", "1", "--json", "--backend", "cpu-decode")  # fmt: skip
    assert attention.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(r["mode"], r["batch"], r["context"]) for r in report["results"]] == [("decode", 3, 70)]
    assert report["results"][0]["max_abs_diff"] < 1e-5 and report["config"]["isa"] == cpu_decode.isa()
    bad = _args("--backend", "cpu-decode", "--mode", "prefill")
    assert attention.run(bad) == 2
    assert "decode on one CPU thread" in capsys.readouterr().err
