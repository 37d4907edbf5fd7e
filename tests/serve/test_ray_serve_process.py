"""`pagedkv serve --replicas 2` as a process (its own session, a free port, a local Ray cluster it starts):
start-up is a few lines and warns that the replicas share no KV; Ray's servers listen on the loopback host
the user gave; `/metrics` at the ingress sums the replicas' KV and queue gauges; a client that leaves
mid-stream leaves no traceback; SIGTERM lets the stream in flight finish with `[DONE]`, the process exits 0
and no process of its Ray cluster outlives it. A port in use is one line and a nonzero exit before Ray starts.

One Ray cluster for the whole module (the lifecycle test); the port test starts none."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from serve_support import MODEL_NAME

pytest.importorskip("ray", reason="ray[serve] is not installed (the `ray` extra)")

RAY_PROCESS = re.compile(r"^ray::|raylet|gcs_server|dashboard|runtime_env|log_monitor|monitor\.py")



def serve_command(model_folder: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "pagedkv.cli", "serve", "--model", str(model_folder), "--port", str(port),
            "--served-model-name", MODEL_NAME, "--num-blocks", "64", "--replicas", "2", "--replica-cpus", "0.5",
            "--drain-timeout", "60"]  # fmt: skip


class Stderr:
    """The server's stderr lines, read on a thread as they come."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None, "the server's stderr is piped"
        self.lines: list[str] = []
        self._stream = proc.stderr
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self._stream:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if match := re.search(pattern, line):
                    return match
            time.sleep(0.1)
        raise AssertionError(f"no {pattern!r} on stderr in {timeout_s} s:\n" + "\n".join(self.lines))

    def text(self) -> str:
        return "\n".join(self.lines)


def session_processes(sid: int) -> list[psutil.Process]:
    """The live processes of session `sid` (the server and every process its Ray cluster started)."""
    out = []
    for p in psutil.process_iter(["name", "status"]):
        try:
            if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def describe(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:100] or p.name()
    except psutil.Error:
        return "?"


@pytest.fixture
def server(model_folder: Path) -> Iterator[tuple[subprocess.Popen[str], Stderr]]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}
    proc = subprocess.Popen(serve_command(model_folder, 0), stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        yield proc, Stderr(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in session_processes(proc.pid):  # what a failed test left: the session is the server's own
            p.kill()


def metric(text: str, name: str) -> float:
    match = re.search(rf"^pagedkv:{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert match, f"no pagedkv:{name} in /metrics:\n{text}"
    return float(match.group(1))


def test_replicas_start_quietly_serve_metrics_and_drain_on_sigterm(
    server: tuple[subprocess.Popen[str], Stderr],
) -> None:
    proc, stderr = server
    url = stderr.wait_for(r"on (http://127\.0\.0\.1:\d+)", 240).group(1)
    start_up = stderr.lines[: next(i for i, line in enumerate(stderr.lines) if url in line) + 1]
    # pagedkv's lines and Ray's warnings (its token notice; replicas slow to start on a loaded machine)
    others = [line for line in start_up if not re.search(r"^pagedkv serve: |\bWARNING\b|slow __init__", line)]
    assert not others, "\n".join(start_up)
    assert any("will not share KV" in line for line in start_up), "\n".join(start_up)
    listening = {
        (describe(p), c.laddr.ip)
        for p in session_processes(proc.pid)
        for c in _connections(p)
        if c.status == psutil.CONN_LISTEN
    }
    # Ray 2.60's Serve replicas open their inter-deployment gRPC server on [::]:0 whatever the node's
    # address (ray/serve/_private/replica.py): the one exception Ray leaves no setting for
    wide = {
        (name, ip)
        for name, ip in listening
        if ip not in ("127.0.0.1", "::ffff:127.0.0.1") and not (name.startswith("ray::ServeReplica:") and ip == "::")
    }
    assert listening and not wide, wide

    deadline = time.monotonic() + 120
    while httpx.get(f"{url}/health").status_code != 200:
        assert time.monotonic() < deadline, "the ingress did not become healthy"
        time.sleep(0.2)

    # a client that leaves mid-stream: nothing but (at most) one line at the ingress
    body = {"model": MODEL_NAME, "prompt": "Once", "max_tokens": 300, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    time.sleep(3)  # the replicas' log lines reach the driver within a second or two

    long_body = {**body, "max_tokens": 480, "stream_options": {"include_usage": True}}
    got: dict[str, Any] = {}
    first = threading.Event()

    def stream() -> None:
        events = []
        with httpx.Client(timeout=120) as http, http.stream("POST", f"{url}/v1/completions", json=long_body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()
        got["events"] = events

    thread = threading.Thread(target=stream)
    thread.start()
    assert first.wait(60)
    deadline = time.monotonic() + 15  # the ingress sums the replicas' stats (refreshed every second)
    while True:
        text = httpx.get(f"{url}/metrics").text
        if metric(text, "num_requests_running") == 1 and metric(text, "kv_cache_usage_perc") > 0:
            break
        assert time.monotonic() < deadline, text
        time.sleep(0.2)
    assert metric(text, "num_requests_waiting") == 0

    proc.send_signal(signal.SIGTERM)  # mid-stream
    thread.join(120)
    assert proc.wait(120) == 0, stderr.text()
    events = got["events"]
    assert events[-1] == "[DONE]", events[-3:]
    assert '"completion_tokens": 480' in events[-2]  # the in-flight request ran to its end
    log = stderr.text()
    assert "Traceback" not in log and "TaskCancelledError" not in log, log
    assert "SIGTERM received" not in log, log

    deadline = time.monotonic() + 10
    while left := [describe(p) for p in session_processes(proc.pid) if RAY_PROCESS.search(describe(p))]:
        assert time.monotonic() < deadline, left
        time.sleep(0.5)


def _connections(p: psutil.Process) -> list[Any]:
    try:
        return list(p.net_connections(kind="inet"))
    except psutil.Error:
        return []


def test_a_port_in_use_is_one_line_and_a_nonzero_exit(model_folder: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        done = subprocess.run(serve_command(model_folder, port), capture_output=True, text=True, env=env, timeout=120,
                              start_new_session=True)  # fmt: skip
    err = done.stderr.strip()
    assert done.returncode != 0
    assert len(err.splitlines()) == 1, err
    assert err.startswith("pagedkv serve") and f"127.0.0.1:{port}" in err and "in use" in err, err
