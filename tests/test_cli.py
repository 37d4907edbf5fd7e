"""The front door: errors are one clear line, the README's example runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pagedkv.cli", *args], capture_output=True, text=True)


def test_bad_input_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    out = run_cli("bench", "allocator", "--trace", str(tmp_path / "missing.csv"))
    assert out.returncode == 2
    assert "missing.csv: no such file" in out.stderr and "Traceback" not in out.stderr  # as in plan/simulate
    broken = tmp_path / "broken.csv"
    broken.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,-4,44\n")
    out = run_cli("bench", "allocator", "--trace", str(broken))
    assert out.returncode == 2 and "broken.csv:2" in out.stderr
    out = run_cli("bench", "allocator", "--num-blocks", "1")
    assert out.returncode == 2 and "--num-blocks" in out.stderr


def test_no_command_prints_help() -> None:
    out = run_cli()
    assert out.returncode == 2 and "simulate" in out.stdout and "bench" in out.stdout


def test_readme_example_runs() -> None:
    text = (ROOT / "README.md").read_text()
    start = text.index("```python") + len("```python")
    code = text[start : text.index("```", start)]
    exec(compile(code, "README.md", "exec"), {})
