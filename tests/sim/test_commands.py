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


@pytest.mark.parametrize("flags", [["--eviction", "slru"], ["--eviction", "all"], ["--partial-reuse"]])
def test_plan_refuses_cache_policy_flags_it_cannot_honour(flags: list[str], capsys) -> None:
    """plan counts live requests at one moment: no block is evicted or copied there, so it refuses the
    cache-policy flags in one line (it used to accept and ignore --eviction), and still plans without them."""
    assert main(["plan", "--workload", "fixed", "--num-requests", "10", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith(f"pagedkv plan: error: {flags[0]}") and "pagedkv simulate" in captured.err
    assert main(["plan", "--workload", "fixed", "--num-requests", "10", "--json"]) == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "gpt-9"], "unknown model 'gpt-9'"),
        (["--gpu", "v100"], "unknown GPU 'v100'"),
        (["--model", "llama-2-70b"], "no room for the KV cache"),
        (["--gpu-memory-utilization", "0.37"], "less than one request of max_model_len=4096"),
        (["--trace", "/nonexistent.csv"], "argument --trace: /nonexistent.csv: no such file"),
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


def test_dropped_requests_warn_with_count_and_flag(capsys) -> None:
    # max_model_len 512 drops every request of the first 40 whose prompt is >= 512 tokens
    argv = ["--num-requests", "40", "--max-model-len", "512", "--time-scale", "20", "--no-progress", "--json"]
    assert main(["simulate", *argv]) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert data["dropped"] > 0
    assert f"{data['dropped']} of 40 requests dropped" in err and "--max-model-len" in err
    assert main(["plan", *argv[:4], "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["dropped"] == data["dropped"] and "--max-model-len" in err
    assert main(["plan", "--num-requests", "5", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["dropped"] == 0 and "warning" not in err


def test_block_size_sweep_draws_its_figure(tmp_path, capsys) -> None:
    png = tmp_path / "fig.png"
    argv = ["simulate", *SMALL, "--allocators", "paged", "--sweep-block-sizes", "16,32", "--plot", str(png)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    sweep = tmp_path / "fig-sweep.png"
    assert sweep.is_file() and sweep.read_bytes()[:4] == b"\x89PNG" and str(sweep) in out


def test_tensor_parallel_that_cannot_shard_the_heads_is_refused(capsys) -> None:
    assert main(["plan", "--tensor-parallel", "3", "--num-requests", "5"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "32 attention heads" in err and "1, 2, 4, 8" in err
    assert main(["plan", "--tensor-parallel", "2", "--num-requests", "5"]) == 0


def test_example_catalog_is_printed_in_help_and_loads(tmp_path, capsys) -> None:
    assert main(["plan", "--example-catalog"]) == 0  # main returns argparse's exits as a status
    example = tmp_path / "catalog.yaml"
    example.write_text(capsys.readouterr().out)
    assert (
        main(
            ["plan", "--catalog", str(example), "--model", "opt-13b", "--gpu", "l40s", "--num-requests", "5"]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["simulate", "--help"]) == 0
    assert "memory_gib" in capsys.readouterr().out, "--help shows the catalog format"


def test_incomplete_catalog_entry_names_the_users_keys(tmp_path, capsys) -> None:
    partial = tmp_path / "partial.yaml"
    partial.write_text("gpus:\n  my-gpu:\n    memory_gib: 48\n    hbm_bandwidth_gb_per_s: 864\n")
    assert main(["plan", "--catalog", str(partial), "--gpu", "my-gpu"]) == 2
    err = capsys.readouterr().err
    assert "missing bf16_tflops" in err and "hbm_bandwidth_gb_per_s, memory_gib" in err
    assert "bf16_flops_per_s" not in err.split("missing")[0], "names the user's keys first"


def test_planner_output_is_in_gib_only(capsys) -> None:
    assert main(["plan", "--num-requests", "5", "--activation-reserve-gib", "1"]) == 0
    out = capsys.readouterr().out
    assert "GiB" in out and " GB" not in out
    assert "activation reserve (profile estimate)         1.00 GiB" in out
    assert main(["plan", "--model", "llama-2-70b", "--num-requests", "5"]) == 2
    err = capsys.readouterr().err
    assert "GiB" in err and " GB" not in err


def test_plan_without_allocators_plans_those_that_fit_and_says_why_the_others_are_left_out(capsys) -> None:
    """gemma-3-27b's 131,072-token context in one contiguous run does not fit an H100's pool: `plan` used to
    exit 2; it plans the paged allocators and names each one left out, with the reason, in one line."""
    assert main(["plan", "--model", "gemma-3-27b", "--gpu", "h100-80gb", "--num-requests", "100"]) == 0
    captured = capsys.readouterr()
    assert "paged-prefix" in captured.out
    left_out = [line for line in captured.out.splitlines() if line.startswith("left out: ")]
    assert [line.split(":")[1].strip() for line in left_out] == ["contiguous-max"], captured.out
    assert "reserves 8,192 blocks" in left_out[0] and "--max-model-len" in left_out[0]
    assert main(["plan", "--model", "gemma-3-27b", "--gpu", "h100-80gb", "--num-requests", "100", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "contiguous-max" not in data["allocators"] and "contiguous-max" in data["left_out"]
    # asked for by name, it is still an error (one line)
    argv = ["plan", "--model", "gemma-3-27b", "--gpu", "h100-80gb", "--num-requests", "100", "--allocators", "contiguous-max"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "contiguous-max" in err


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_a_gpu_alias_is_said_back_resolved(command: str, capsys) -> None:
    assert main([command, "--gpu", "h100", "--num-requests", "20", "--allocators", "paged", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"pagedkv {command}: gpu: h100-80gb (--gpu h100)" in err, err
    assert main([command, "--gpu", "h100-80gb", "--num-requests", "20", "--allocators", "paged", "--no-progress"]) == 0
    assert "gpu:" not in capsys.readouterr().err  # the canonical name needs no echo
