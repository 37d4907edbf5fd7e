"""`pip install pagedkv` with no extras (numpy and msgspec, pyproject's `dependencies`) runs the torch-free
commands: `pagedkv plan` and `pagedkv simulate` (with and without replicas), in a fresh interpreter where
every package of an extra is made unimportable."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the import names of the extras' packages (pyproject's optional-dependencies)
OPTIONAL = [
    "torch", "triton", "transformers", "gguf", "accelerate", "tqdm", "matplotlib", "redis", "hiredis", "zmq",
    "fastapi", "uvicorn", "prometheus_client", "httpx", "openai", "rich", "ray",
]  # fmt: skip
COMMANDS = [
    ["plan", "--model", "llama-2-7b", "--gpu", "a100-40gb", "--num-requests", "5", "--json"],
    ["simulate", "--num-requests", "5", "--arrivals", "burst", "--no-progress", "--json"],
    ["simulate", "--num-requests", "5", "--arrivals", "burst", "--replicas", "2", "--no-progress", "--json"],
]


def test_the_core_dependencies_are_what_pyproject_says() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {d.split(">")[0].split("=")[0].strip() for d in project["dependencies"]}
    assert core == {"numpy", "msgspec"}
    extras = {d.split(">")[0].split("=")[0].split("[")[0].strip() for ds in project["optional-dependencies"].values() for d in ds}
    assert not core & extras


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a[:3]))
def test_a_torch_free_command_runs_without_the_extras(argv: list[str]) -> None:
    code = (
        "import sys\n"
        f"for name in {OPTIONAL!r}: sys.modules[name] = None  # import raises ModuleNotFoundError\n"
        "from pagedkv.cli import main\n"
        f"sys.exit(main({argv!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
