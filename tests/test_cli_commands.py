"""The command line's front door (issue 20 item 11, issue 21): `--version`, `plan --list`, one spelling of the
token-budget flag with the old one hidden, one `--block-size` and one `SchedulerConfig` builder, and
`generate`'s summary helpers (cached tokens by tier, chat template by default for instruct models)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagedkv import __version__
from pagedkv.cli import main
from pagedkv.engine.cli_args import OneLineParser, add_scheduler_arguments, scheduler_from
from pagedkv.engine.generate_command import cached_summary, is_instruct
from pagedkv.engine.scheduler import SchedulerConfig

SRC = Path(__file__).resolve().parents[1] / "src" / "pagedkv"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"pagedkv {__version__}"


def test_plan_lists_models_and_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--list", "--json"]) == 0
    known = json.loads(capsys.readouterr().out)
    assert known["models"]["llama-2-7b"] == 4096 and known["gpus"]["a100-40gb"] == pytest.approx(40)
    assert main(["plan", "--list"]) == 0
    assert "qwen2.5-7b" in capsys.readouterr().out


def test_old_token_budget_spelling_is_a_hidden_alias(capsys: pytest.CaptureFixture[str]) -> None:
    parser = OneLineParser(prog="t")
    add_scheduler_arguments(parser, preemption=True)
    new = scheduler_from(parser.parse_args(["--max-num-batched-tokens", "77"]))
    old = scheduler_from(parser.parse_args(["--max-batched-tokens", "77"]))
    assert new == old and new.max_num_batched_tokens == 77
    assert scheduler_from(parser.parse_args([])) == SchedulerConfig()
    assert "--max-batched-tokens" not in parser.format_help()
    for command in (["generate"], ["bench", "e2e"], ["bench", "serve"], ["simulate"]):
        main([*command, "--help"])
        shown = capsys.readouterr().out
        assert "--max-num-batched-tokens" in shown and "--max-batched-tokens" not in shown, command


def test_block_size_and_scheduler_are_declared_once() -> None:
    """One declaration of `--block-size` and one `SchedulerConfig` builder for the commands this issue owns."""
    files = ["sim/cli_options.py", "engine/generate_command.py", "bench/allocator.py", "bench/attention.py", "bench/e2e.py",
             "bench/tiers.py", "bench/serve.py", "bench/serve_soak.py", "sim/commands_simulate.py",
             "sim/commands_plan.py"]  # fmt: skip
    for name in files:
        text = (SRC / name).read_text()  # bench serve passes "--block-size" on to `pagedkv serve`: not a declaration
        assert 'add_argument("--block-size"' not in text, f"{name} declares --block-size itself"
        assert "SchedulerConfig(\n" not in text and "scheduler=SchedulerConfig(" not in text, name


def test_cached_summary_counts_prompt_tokens_by_tier() -> None:
    done = [
        SimpleNamespace(
            parent_id=None, num_cached_tokens=48, num_cached_tokens_by_tier={"GPU": 32, "CPU": 16}
        ),
        SimpleNamespace(parent_id="req-0", num_cached_tokens=48, num_cached_tokens_by_tier={"GPU": 48}),
        SimpleNamespace(
            parent_id=None, num_cached_tokens=16, num_cached_tokens_by_tier={"GPU": 0, "CPU": 16}
        ),
    ]
    assert cached_summary(done) == "cached prompt tokens: 64 (GPU 32, CPU 32)"
    assert cached_summary(
        [SimpleNamespace(parent_id=None, num_cached_tokens=8, num_cached_tokens_by_tier={})]
    ) == ("cached prompt tokens: 8")


def test_chat_template_by_default_for_instruct_models() -> None:
    templated = SimpleNamespace(chat_template="{{ x }}", name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert is_instruct("smollm2", templated)
    assert is_instruct("/models/Qwen2-0.5B-Instruct", SimpleNamespace(chat_template="t", name_or_path=""))
    assert not is_instruct("/models/gpt2", SimpleNamespace(chat_template=None, name_or_path="gpt2"))
    assert not is_instruct("/models/base", SimpleNamespace(chat_template="t", name_or_path="base"))
