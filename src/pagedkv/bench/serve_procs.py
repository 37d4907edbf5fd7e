"""The server processes of `pagedkv bench serve`: started on a free port, waited for, measured, stopped.

Each server is a subprocess of the bench, bound to 127.0.0.1 port 0 (the kernel picks a free port; the bench
reads it from the first "http://HOST:PORT" in the server's log: pagedkv serve's "on http://..." line,
uvicorn's "running on http://..."), with `HF_HUB_OFFLINE=1`
(nothing downloads) and `OMP_NUM_THREADS=1` unless the bench gives each its threads (`env`). It is ready when `GET /health` answers 200; the model id requests send is the first of `/v1/models`. It is stopped by
its pid: SIGTERM, then SIGKILL after `grace_s`. Its resident memory and CPU time are read from
`/proc/PID/status` and `/proc/PID/stat` (Linux).

`transformers serve` needs `config.json`'s `architectures` to pick the model class (pagedkv's GGUF
conversions name it; a folder from elsewhere may not), so `peer_folder` makes a folder of links to the
same files with that one key added where it is missing: every server then loads the same weights and the
same tokenizer. `transformers serve` itself is run through `PEER_LAUNCHER`, which sets torch's threads
(`OMP_NUM_THREADS`) before handing over to its command line, unchanged.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.core.errors import InvalidArgumentError

# the first URL with a port in the log: uvicorn's "running on http://HOST:PORT", pagedkv serve's "on http://..."
_LISTENING = re.compile(r"https?://[^\s/:]+:(\d+)")
# `python -c PEER_LAUNCHER MARGIN serve ...`: torch threads as OMP_NUM_THREADS (the bench's --threads),
# then transformers' own command line. MARGIN
# "default" leaves transformers' admission headroom alone (safety_margin None = 0.15 in its scheduler);
# a number sets it, as `ContinuousBatchingConfig(safety_margin=...)` would (its CLI has no flag for it).
PEER_LAUNCHER = """
import os, sys, torch
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
margin = sys.argv.pop(1)
if margin != "default":
    from transformers.generation.configuration_utils import ContinuousBatchingConfig as C
    post = C.__post_init__
    def _post(self, post=post, margin=float(margin)):
        if self.safety_margin is None:
            self.safety_margin = margin
        post(self)
    C.__post_init__ = _post
from transformers.cli.transformers import main
sys.argv = ["transformers"] + sys.argv[1:]
main()
"""


@dataclass(slots=True)
class ServerProcess:
    """A started server: its process, its log file and the URL it answers on."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    base_url: str = ""
    model_id: str = ""  # the `model` its /v1/models lists first: what requests name
    samples: list[tuple[float, int]] = field(default_factory=list)  # (time, RSS bytes)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")  # fmt: skip
    env.update(extra or {})
    return env


def free_port() -> int:
    """A port the kernel calls free now, for a server that cannot bind port 0 itself and say which it got
    (vLLM logs the port it was given); another process may take it before the server binds it (rare)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def exit_on_sigterm() -> None:
    """Make SIGTERM raise `SystemExit(143)` in this process (from the main thread), so the `finally` that stops
    each server runs: the servers run in sessions of their own, so a signal sent to the bench never reaches
    them, and without this they would outlive it."""

    def leave(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)


def start_server(
    name: str,
    argv: list[str],
    log_dir: Path,
    *,
    ready_timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> ServerProcess:
    """Start `argv` (a server that binds port 0 and logs uvicorn's "running on" line, or one told `port`),
    with `env` over `server_env()`, wait until its `/health` answers 200; on failure stop it and raise
    `RuntimeError` with its log's tail."""
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=server_env(env),
            start_new_session=True,
        )  # fmt: skip
    server = ServerProcess(name, proc, log_path)
    if port is not None:
        server.base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(server, ready_timeout_s)
    except BaseException:
        stop_server(server)
        raise
    return server


def _wait_ready(server: ServerProcess, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(
                f"{server.name} exited with code {server.proc.returncode} before it was ready:\n{server.log_tail()}"
            )
        if not server.base_url:
            match = _LISTENING.search(server.log_path.read_text(errors="replace"))
            if match:
                server.base_url = f"http://127.0.0.1:{match.group(1)}"
        if server.base_url:
            try:
                # llama-cpp-python's server has no /health: its /v1/models answering is its readiness
                health = httpx.get(f"{server.base_url}/health", timeout=5).status_code
                listed = httpx.get(f"{server.base_url}/v1/models", timeout=5)
                if health == 200 or (health == 404 and listed.status_code == 200):
                    models = listed.json()["data"]
                    server.model_id = str(models[0]["id"])
                    return
            except (httpx.HTTPError, KeyError, IndexError, ValueError):
                pass
        time.sleep(0.25)
    raise RuntimeError(f"{server.name} was not ready within {timeout_s:.0f} s:\n{server.log_tail()}")


def stop_server(server: ServerProcess, grace_s: float = 15.0) -> int | None:
    """SIGTERM, then SIGKILL after `grace_s`; the exit code. The server's own children (vLLM's engine
    process) that outlive it are ended too, by their pids, taken before the server stops."""
    children = descendants(server.pid) if server.proc.poll() is None else []
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(10)
    for pid in children:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return server.proc.returncode


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS line")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of `pid`, all threads."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """The pids of `pid`'s children, their children, and so on (Linux /proc), parents first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop(0)
        out.append(child)
        todo.extend(children.get(child, []))
    return out


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of `pid`'s process tree: its own and every live descendant's user + system time, plus what
    the children each has waited for used (so a worker that ended is counted by its parent)."""
    total = 0.0
    for p in (pid, *descendants(pid)):
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:  # ended between the listing and the read
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        total += sum(int(fields[i]) for i in (11, 12, 13, 14)) / os.sysconf("SC_CLK_TCK")
    return total


# --- the two servers ------------------------------------------------------------------------------------


def pagedkv_argv(model: str, options: list[str]) -> list[str]:
    """`pagedkv serve` on 127.0.0.1, a free port, with the bench's engine options."""
    return [sys.executable, "-m", "pagedkv.cli", "serve", "--model", model, "--host", "127.0.0.1", "--port", "0",
            *options]  # fmt: skip


def peer_argv(
    folder: Path, block_size: int, num_blocks: int, max_batch_tokens: int, safety_margin: float | None = None,
    *, dtype: str = "float32",
) -> list[str]:
    """`transformers serve --continuous-batching` on 127.0.0.1, a free port, the same KV budget and dtype,
    SDPA; `safety_margin` None keeps its own admission headroom (0.15)."""
    margin = "default" if safety_margin is None else str(safety_margin)
    return [sys.executable, "-c", PEER_LAUNCHER, margin, "serve", str(folder), "--continuous-batching",
            "--cb-block-size", str(block_size), "--cb-num-blocks", str(num_blocks),
            "--cb-max-batch-tokens", str(max_batch_tokens), "--attn-implementation", "sdpa",
            "--dtype", dtype, "--device", "cpu", "--host", "127.0.0.1", "--port", "0",
            "--log-level", "warning"]  # fmt: skip


def peer_extra_body() -> dict[str, Any]:
    """How `transformers serve` is told to ignore EOS: a `generation_config` JSON string in the body (its
    only way; every request sends the same one, because its continuous batching takes the sampling settings
    of the first request it sees for all)."""
    return {"generation_config": json.dumps({"do_sample": False, "eos_token_id": -1})}


def peer_folder(model_folder: Path, parent: Path | None = None) -> Path:
    """A folder of links to `model_folder`'s files whose `config.json` names the model class
    (`architectures`), which `transformers serve` needs (see the module docstring)."""
    config_path = model_folder / "config.json"
    if not config_path.is_file():
        raise InvalidArgumentError(f"{model_folder} has no config.json; pass a transformers model folder")
    config = json.loads(config_path.read_text())
    if not config.get("architectures"):
        config["architectures"] = [_architecture(config)]
    out = Path(tempfile.mkdtemp(prefix="pagedkv-peer-", dir=parent))
    for item in model_folder.iterdir():
        if item.name != "config.json":
            (out / item.name).symlink_to(item.resolve())
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def _architecture(config: dict[str, Any]) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = str(config.get("model_type", ""))
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if name is None:
        raise InvalidArgumentError(f"transformers has no causal LM class for model_type {model_type!r}")
    return str(name)
