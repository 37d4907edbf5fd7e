"""`pagedkv serve` as a process: bad arguments are one line and exit 2 before any weights load; a served
folder answers the openai client; SIGTERM or SIGINT lets the stream in flight finish, then the process exits 0
with one line when draining starts and one when it is done, and no traceback."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_support import MODEL_NAME

from pagedkv.bench.serve_procs import descendants
from pagedkv.cli import main


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--model", "/no/such/folder"], "neither"),
        (["--max-waiting", "0"], "--max-waiting"),
        (["--port", "70000"], "--port"),
        (["--drain-timeout", "-1"], "--drain-timeout"),
    ],
)
def test_bad_arguments_are_one_line_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and err.startswith("pagedkv serve")


@pytest.mark.parametrize(
    ("sig", "where"),
    [(signal.SIGTERM, []), (signal.SIGINT, []), (signal.SIGTERM, ["--engine-process"])],
    ids=["SIGTERM", "SIGINT", "SIGTERM-engine-process"],
)
def test_serve_answers_then_drains_on_sigterm_or_sigint_and_exits_0(model_folder: Path, sig: int, where: list[str]) -> None:
    """SIGINT is Ctrl-C on a terminal: it drains as SIGTERM does (before: a KeyboardInterrupt traceback and
    exit 130). Draining prints one line when it starts (with the requests in flight) and one when done."""
    cmd = [sys.executable, "-m", "pagedkv.cli", "serve", "--model", str(model_folder), "--port", "0",
           "--served-model-name", MODEL_NAME, "--num-blocks", "64", "--drain-timeout", "30", *where]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = _wait_until_healthy(proc)
        body = {"model": MODEL_NAME, "prompt": "Once", "max_tokens": 200, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
        got: dict[str, Any] = {}
        first = threading.Event()

        def stream() -> None:
            events = []
            with (
                httpx.Client(timeout=60) as http,
                http.stream("POST", f"{url}/v1/completions", json=body) as r,
            ):
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()
            got["events"] = events

        thread = threading.Thread(target=stream)
        thread.start()
        assert first.wait(30)
        children = descendants(proc.pid)  # the engine process, with --engine-process
        assert bool(children) == bool(where)
        proc.send_signal(sig)  # mid-stream
        thread.join(60)
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 15
        while [pid for pid in children if _running(pid)]:  # stopped with the server, not left behind
            assert time.monotonic() < deadline, f"left behind: {[p for p in children if _running(p)]}"
            time.sleep(0.05)
        assert proc.stderr is not None
        err = proc.stderr.read()
        assert "Traceback" not in err and "Error" not in err, err
        lines = err.strip().splitlines()
        assert len(lines) == 2, err
        assert lines[0].startswith("pagedkv serve: draining 1 request in flight"), err
        assert lines[1].startswith("pagedkv serve: stopped"), err
        events = got["events"]
        assert events[-1] == "[DONE]"
        assert '"completion_tokens": 200' in events[-2]  # the in-flight request ran to its end
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _running(pid: int) -> bool:
    """True while `pid` runs (a zombie, exited but not reaped by its parent, has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_until_healthy(proc: subprocess.Popen[str]) -> str:
    """The server's URL from its first stderr line, once /health answers 200."""
    assert proc.stderr is not None
    line = proc.stderr.readline()
    match = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
    assert match, line
    url = match.group(1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return url
        except httpx.ConnectError:
            pass
        time.sleep(0.05)
    raise AssertionError("pagedkv serve did not become healthy")


def test_the_start_up_line_says_the_kv_budget_back(model_folder: Path) -> None:
    """`--kv-budget 1mib` is said back in bytes and MiB with what the whole blocks under it take."""
    cmd = [sys.executable, "-m", "pagedkv.cli", "serve", "--model", str(model_folder), "--port", "0",
           "--served-model-name", MODEL_NAME, "--kv-budget", "1mib"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "(--kv-budget 1,048,576 bytes = 1.0 MiB, " in line, line
        used, blocks = re.search(r"MiB, ([\d.]+) MiB in (\d+) KV blocks", line).groups()  # type: ignore[union-attr]
        assert 0 < float(used) <= 1.0 and int(blocks) > 0, line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
