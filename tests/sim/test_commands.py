"""`pagedkv simulate` and `pagedkv plan` through the CLI front door: JSON shape, figure, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedkv.cli import main

ALLOCATOR_KEYS = {
    "kv_waste",
    "mean_concurrency",
    "peak_concurrency",
    "requests_per_s",
    "tokens_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "preemptions",
    "prefix_hit_rate",
}
SMALL = ["--num-requests", "40", "--max-model-len", "1024", "--time-scale", "20", "--no-progress"]


def test_simulate_json_and_plot(tmp_path, capsys) -> None:
    png = tmp_path / "fig.png"
    assert main(["simulate", *SMALL, "--json", "--plot", str(png)]) == 0, "exit status"
    data = json.loads(capsys.readouterr().out)
    assert {"model", "gpu", "workload", "kv_budget_bytes", "block_size", "allocators"} <= set(data), (
        "top keys"
    )
    assert (data["model"], data["gpu"], data["block_size"]) == ("llama-2-7b", "a100-40gb", 16), "defaults"
    assert list(data["allocators"]) == ["contiguous-max", "contiguous-oracle", "paged", "paged-prefix"], (
        "names"
    )
    for name, metrics in data["allocators"].items():
        assert set(metrics) >= ALLOCATOR_KEYS, f"{name} lacks {ALLOCATOR_KEYS - set(metrics)}"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG", "a PNG figure"


def test_simulate_table_names_everything(capsys) -> None:
    assert main(["simulate", *SMALL, "--allocators", "paged", "--sweep-block-sizes", "16,32"]) == 0, "exit"
    out = capsys.readouterr().out
    for part in (
        "llama-2-7b",
        "a100-40gb",
        "azure-conv",
        "block size 16",
        "paged",
        "KV budget",
        "paged bs=32",
    ):
        assert part in out, f"table lacks {part!r}"


def test_plan_json(capsys) -> None:
    assert main(["plan", "--json", "--workload", "fixed", "--prompt-len", "100", "--output-len", "28"]) == 0
    data = json.loads(capsys.readouterr().out)
    keys = {"model", "gpu", "kv_budget_bytes", "bytes_per_token", "block_size", "max_model_len", "allocators"}
    assert keys <= set(data), "plan top keys"
    assert data["bytes_per_token"] == 524_288, "Llama-2-7B KV bytes per token"
    assert all("max_concurrent" in a for a in data["allocators"].values()), "max_concurrent per allocator"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "gpt-9"], "unknown model 'gpt-9'"),
        (["--gpu", "v100"], "unknown GPU 'v100'"),
        (["--model", "llama-2-70b"], "no room for the KV cache"),
        (["--gpu-memory-utilization", "0.37"], "less than one request of max_model_len=4096"),
        (["--trace", "/nonexistent.csv"], "unknown workload '/nonexistent.csv'"),
        (["--max-model-len", "99999"], "max_model_len=99999 exceeds llama-2-7b's context length 4096"),
    ],
)
def test_bad_input_is_one_clear_line(argv: list[str], message: str, capsys) -> None:
    assert main(["simulate", "--num-requests", "5", "--no-progress", *argv]) == 2, "exit status 2"
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, f"expected one line with {message!r}, got {err!r}"


def test_broken_trace_row_names_the_line(tmp_path, capsys) -> None:
    bad = tmp_path / "t.jsonl"
    bad.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'
        '{"timestamp": 5, "input_length": 10, "hash_ids": [2]}\n'
    )
    assert main(["plan", "--trace", str(bad)]) == 2, "exit status"
    assert "t.jsonl:2" in capsys.readouterr().err, "names file and line"


def test_sim_imports_neither_torch_nor_matplotlib() -> None:
    code = (
        "import sys, io, contextlib; from pagedkv.sim import simulate_main, plan_main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    simulate_main(['--num-requests', '10', '--no-progress']); plan_main([])\n"
        "print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"pagedkv.sim pulled in {out.strip()}"
