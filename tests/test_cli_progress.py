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


def test_a_stage_line_ticks_through_a_long_silent_step_on_a_terminal() -> None:
    """A step that reports nothing for seconds (building a workload, one numpy pass) still shows what runs
    and for how long: `stage` names it and the line is redrawn on its own while it runs."""
    import time

    stream = _Tty()
    with Progress("pagedkv plan", stream=stream, delay_s=0.0, interval_s=0.02, tick=True) as bar:
        bar.stage("building the workload")
        time.sleep(0.15)  # no update() at all: the ticker draws
        assert "pagedkv plan: building the workload" in stream.getvalue()
        bar.stage("hashing shared prefixes", unit="blocks")
        bar.update(5)
        time.sleep(0.05)
        assert "hashing shared prefixes: 5 blocks" in stream.getvalue()
    assert stream.getvalue().endswith("\r")


def test_a_stage_line_is_silent_when_piped() -> None:
    import time

    stream = io.StringIO()
    with Progress("pagedkv plan", stream=stream, delay_s=0.0, interval_s=0.01, tick=True) as bar:
        bar.stage("building the workload")
        time.sleep(0.05)
    assert stream.getvalue() == ""


def _on_a_pty(argv: list[str]) -> str:
    """What `pagedkv ARGV` writes to a terminal (a pty of 120 columns; stdout and stderr together)."""
    import os
    import pty
    import select
    import struct

    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child
        os.execv(sys.executable, [sys.executable, "-m", "pagedkv.cli", *argv])
    import fcntl
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    chunks: list[bytes] = []
    while True:
        try:
            ready, _, _ = select.select([fd], [], [], 600)
            data = os.read(fd, 65536) if ready else b""
        except OSError:  # the child closed the pty
            break
        if not data:
            break
        chunks.append(data)
    os.waitpid(pid, 0)
    os.close(fd)
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.parametrize(
    "argv,stage",
    [(["plan", "--num-requests", "300"], "pagedkv plan: building the workload"),
     (["simulate", "--num-requests", "60", "--allocators", "paged"], "pagedkv simulate: building the workload")],
    ids=["plan", "simulate"],
)  # fmt: skip
def test_plan_and_simulate_say_what_they_do_on_a_terminal(argv: list[str], stage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal every phase is named as it starts (PAGEDKV_PROGRESS_DELAY_S=0 draws at once instead of
    past a second); piped, nothing (test_piped_commands_write_no_carriage_returns)."""
    monkeypatch.setenv("PAGEDKV_PROGRESS_DELAY_S", "0")
    out = _on_a_pty(argv)
    assert stage in out, out[-500:]
    assert "allocator" in out  # the table came out too
