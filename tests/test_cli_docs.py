"""docs/cli.md is the one place the command line is documented (issue 21): every flag of every command is
there (hidden aliases excepted), and every flag it names exists."""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest

from pagedkv.cli import COMMANDS
from pagedkv.engine.cli_args import OneLineParser

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
# documented elsewhere (docs/serving.md, docs/benchmarks.md)
ELSEWHERE = {("serve",), ("bench", "serve"), ("bench", "replicas")}
DOCUMENTED = [path for path in COMMANDS if path not in ELSEWHERE]


def _flags(path: tuple[str, ...]) -> set[str]:
    parser = OneLineParser(prog="pagedkv " + " ".join(path))
    importlib.import_module(COMMANDS[path][0]).add_arguments(parser)
    return {
        flag
        for action in parser._actions
        if action.help != argparse.SUPPRESS
        for flag in action.option_strings
        if flag not in ("-h", "--help")
    }


def _section(path: tuple[str, ...]) -> str:
    text = DOC.read_text()
    start = text.index(f"### `pagedkv {' '.join(path)}`")
    end = text.find("\n### ", start + 1)
    return text[start : end if end > 0 else len(text)]


@pytest.mark.parametrize("path", DOCUMENTED, ids=[" ".join(p) for p in DOCUMENTED])
def test_every_flag_is_documented_and_every_documented_flag_exists(path: tuple[str, ...]) -> None:
    section = _section(path)
    named = set(re.findall(r"`(--[a-z0-9-]+)`", section))
    flags = _flags(path)
    assert flags <= named, f"docs/cli.md lacks {sorted(flags - named)} of pagedkv {' '.join(path)}"
    assert named <= flags, (
        f"docs/cli.md names flags pagedkv {' '.join(path)} does not have: {sorted(named - flags)}"
    )


@pytest.mark.parametrize("path", DOCUMENTED, ids=[" ".join(p) for p in DOCUMENTED])
def test_each_flag_has_one_row(path: tuple[str, ...]) -> None:
    rows = re.findall(r"^\| `(--[a-z0-9-]+)`", _section(path), re.M)
    twice = sorted({flag for flag in rows if rows.count(flag) > 1})
    assert not twice, f"docs/cli.md lists {twice} more than once for pagedkv {' '.join(path)}"
