"""The bench's server processes never outlive it: a SIGTERM to a bench that has started a server (in a session
of its own, which the signal does not reach) stops that server before the bench exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from pagedkv.bench.serve_procs import free_port

# A stand-in server on the port it is given: /health and /v1/models (one model) answer 200.
SERVER = textwrap.dedent(
    """
    import http.server, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b'{"data": [{"id": "m"}]}')
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """
)

BENCH = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from pagedkv.bench import serve_procs as procs
    procs.exit_on_sigterm()
    port = int(sys.argv[1])
    server = procs.start_server("stand-in", [sys.executable, "-c", sys.argv[2], str(port)], Path(sys.argv[3]),
                                port=port, ready_timeout_s=30)
    try:
        print(server.pid, flush=True)
        time.sleep(120)
    finally:
        procs.stop_server(server, grace_s=5)
    """
)


def test_a_sigterm_to_the_bench_stops_the_server_it_started(tmp_path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    bench = subprocess.Popen(
        [sys.executable, "-c", BENCH, str(port), SERVER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert bench.stdout is not None
        server_pid = int(bench.stdout.readline())
        os.kill(server_pid, 0)  # running
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(30) == 143
        deadline = time.monotonic() + 10
        while True:
            try:
                os.kill(server_pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, "the server outlived the bench"
            time.sleep(0.05)
    finally:
        if bench.poll() is None:
            bench.kill()
