"""Progress goes to a terminal only, past a second (issue 20 item 11): piped output gets no bar at all."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from pagedkv.progress import Progress, on_terminal


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_no_bar_when_piped() -> None:
    stream = io.StringIO()
    assert not on_terminal(stream)
    with Progress("work", total=10, stream=stream, delay_s=0.0, interval_s=0.0) as bar:
        for _ in range(10):
            bar.update()
    assert stream.getvalue() == ""


def test_bar_on_a_terminal_is_drawn_and_wiped() -> None:
    stream = _Tty()
    with Progress("work", total=4, unit="blocks", stream=stream, delay_s=0.0, interval_s=0.0) as bar:
        bar.update(2)
        assert "work [" in stream.getvalue() and "2/4 blocks" in stream.getvalue()
    assert stream.getvalue().endswith("\r") and "\n" not in stream.getvalue()


def test_short_work_draws_nothing_even_on_a_terminal() -> None:
    stream = _Tty()
    with Progress("work", total=4, stream=stream) as bar:  # default: only past one second
        bar.update(4)
    assert stream.getvalue() == ""


@pytest.mark.parametrize(
    "argv",
    [["simulate", "--num-requests", "500"], ["bench", "allocator", "--limit", "500"]],
    ids=["simulate", "bench-allocator"],
)
def test_piped_commands_write_no_carriage_returns(argv: list[str]) -> None:
    """`make demo | cat` used to get one 9-40 KB line of bar redraws from `simulate` and `bench allocator`."""
    # the timeout only catches a hang (the test is about the output, not the speed): a few seconds of work,
    # which parallel test workers and other load on a shared 2-core machine can stretch many times over
    out = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", *argv], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr
    assert "\r" not in out.stderr and "\r" not in out.stdout, out.stderr[:300]
