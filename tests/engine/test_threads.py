"""`--threads`: one flag on every command that runs a model, the cores by default, shared by replicas."""

from __future__ import annotations

import os

import pytest
import torch

from pagedkv.engine.cli_args import OneLineParser, add_threads, default_threads, use_threads


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_default_is_the_cores_this_process_may_use() -> None:
    assert default_threads() == len(os.sched_getaffinity(0))


def test_use_threads_sets_torch_and_shares_the_default_between_replicas() -> None:
    assert use_threads(2) == 2 and torch.get_num_threads() == 2
    assert use_threads(None) == default_threads() == torch.get_num_threads()
    assert use_threads(None, share=10_000) == 1  # never below one thread
    assert use_threads(None, share=2) == max(1, default_threads() // 2)


@pytest.mark.parametrize("bad", ["0", "-1", "two", "5000"])
def test_bad_thread_counts_are_one_line_errors(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = OneLineParser(prog="pagedkv generate")
    add_threads(parser)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--threads", bad])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--threads" in err


@pytest.mark.parametrize(
    "command", ["generate", "serve", "bench e2e", "bench stalls", "bench bitwise", "bench replicas"]
)
def test_every_model_command_takes_threads(command: str) -> None:
    import importlib

    from pagedkv.cli import COMMANDS

    parser = OneLineParser(prog=f"pagedkv {command}")
    importlib.import_module(COMMANDS[tuple(command.split())][0]).add_arguments(parser)
    assert parser.parse_args(["--threads", "3"]).threads == 3
    assert parser.parse_args([]).threads is None  # resolved by use_threads: the cores, shared by replicas
