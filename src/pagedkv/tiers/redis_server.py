"""A private `redis-server` on a unix socket in a temporary folder, for tests and benchmarks.

It never touches a Redis already running on the machine (no TCP port: `--port 0`), keeps nothing on disk
(`--save "" --appendonly no`), and evicts like a cache (`--maxmemory-policy allkeys-lru`). Use it as a
context manager; `url` is `unix://...`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from pagedkv.core.errors import PagedKVError


class RedisUnavailableError(PagedKVError):
    """`redis-server` is not installed or did not start."""


def redis_server_path() -> str | None:
    return shutil.which("redis-server")


class RedisServer:
    def __init__(self, *, maxmemory: str = "64mb", folder: str | os.PathLike[str] | None = None,
                 start_timeout_s: float = 10.0) -> None:  # fmt: skip
        self.maxmemory = maxmemory
        self._own_folder = folder is None
        self.folder = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="pagedkv-redis-"))
        self.socket = self.folder / "redis.sock"
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> RedisServer:
        exe = redis_server_path()
        if exe is None:
            raise RedisUnavailableError("redis-server is not installed (apt-get install redis-server)")
        args = [exe, "--port", "0", "--unixsocket", str(self.socket), "--unixsocketperm", "700",
                "--save", "", "--appendonly", "no", "--maxmemory", self.maxmemory,
                "--maxmemory-policy", "allkeys-lru", "--dir", str(self.folder), "--daemonize", "no"]  # fmt: skip
        log = open(self.folder / "redis.log", "wb")  # noqa: SIM115 - closed by the child's lifetime
        self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.folder)
        log.close()
        import redis

        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RedisUnavailableError(
                    f"redis-server exited with {self._proc.returncode}; see {self.folder}/redis.log"
                )
            if self.socket.exists():
                try:
                    client = redis.Redis(unix_socket_path=str(self.socket))
                    client.ping()
                    client.close()
                    return self
                except redis.exceptions.ConnectionError:
                    pass
            time.sleep(0.02)
        self.stop()
        raise RedisUnavailableError(f"redis-server did not answer within {self.start_timeout_s}s")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._own_folder:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        self.stop()
