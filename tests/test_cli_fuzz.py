"""Every command survives what a newcomer types (issue 20): a seeded sample of fuzzed command lines, each run
in a subprocess under a memory limit (RLIMIT_AS) and a timeout, fails on a traceback, a hang, an exit status
0 that printed an error, an error that is not one line, or memory beyond a bound.

Two kinds of case. The table below holds values that are invalid for their flag (zero,
negative, huge, wrong type, a missing or unwritable file) for every command, the model-loading ones
included: each must be refused in one line with status 2, before a model loads. On the torch-free commands
(`plan`, `simulate`, `bench allocator`, `bench soak`) random flags also get random values, valid or not: those
must end quickly either way. `pagedkv serve` is not fuzzed here (its own tests cover it).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

# --- the table: per command, base arguments that make a valid run short, and per flag values that are
# invalid for it (zero, negative, huge, wrong type, a missing or unwritable file) ---------------------------

ZERO, NEG, HUGE, WORD, NAN = "0", "-1", "99999999999999", "abc", "nan"
MISSING = "/nonexistent/pagedkv-fuzz.csv"
PROC = "/proc/nope/out.png"

SIM_FLAGS: dict[str, list[str]] = {
    "--tensor-parallel": [ZERO, NEG, WORD, HUGE],
    "--catalog": [MISSING, "{bad_json}"],
    "--max-model-len": [ZERO, NEG, WORD, HUGE],
    "--block-size": [ZERO, NEG, WORD, HUGE],
    "--gpu-memory-utilization": [ZERO, NEG, "2", NAN, WORD],
    "--max-num-seqs": [ZERO, NEG, WORD],
    "--max-num-batched-tokens": [ZERO, NEG, WORD],
    "--admission-lookahead": [NEG, WORD],
    "--activation-reserve-gib": [NEG, NAN, WORD, HUGE],
    "--trace": [MISSING, "{empty}", "{bad_json}", "{huge_row}"],
    "--num-requests": [ZERO, NEG, WORD],
    "--time-scale": [ZERO, NEG, NAN],
    "--seed": [WORD, NEG],
    "--model": ["no-such-model"],
    "--gpu": ["no-such-gpu"],
    "--allocators": ["", "foo"],
    "--workload fixed --prompt-len": [ZERO, NEG, "100000000"],
    "--workload fixed --output-len": [ZERO, NEG, "100000000"],
    "--workload fixed --num-requests": ["10000000000"],
    "--workload shared-prefix --system-prompt-len": [NEG, "100000000"],
    "--workload multi-turn --turns": [ZERO, NEG],
    "--workload variable --prompt-lognormal": [WORD, "1", "1,-1", "nan,1", "1000,1"],
    "--arrivals poisson --rate": [ZERO, NEG, NAN],
}
SIMULATE_FLAGS = {
    **SIM_FLAGS,
    "--plot": ["out.txt", PROC],
    "--step-overhead-ms": [NEG, NAN],
    "--sweep-block-sizes": [ZERO, WORD],
    "--replicas": [ZERO, "-2"],
    "--host-tier-gib": ["1"],
}
GENERATE_FLAGS = {
    "--max-new-tokens": [ZERO, NEG, WORD, HUGE],
    "--temperature": [NEG, NAN, WORD],
    "--top-p": [ZERO, NEG, "2", NAN],
    "--top-k": [NEG],
    "--n": [ZERO, NEG],
    "--kv-budget": [WORD, NEG, "0", "100TiB", "9999TB"],
    "--num-blocks": [ZERO, NEG, HUGE],
    "--block-size": [ZERO, NEG, HUGE],
    "--max-num-batched-tokens": [ZERO, NEG],
    "--max-batched-tokens": [ZERO],
    "--max-num-seqs": [ZERO, NEG],
    "--admission-lookahead": [NEG],
    "--host-blocks": [NEG, HUGE],
    "--disk-path": ["/proc/nope"],
    "--disk-bytes": [WORD, NEG],
    "--dtype": ["foo"],
    "--prompts-file": [MISSING, "{bad_json}"],
    "--model": [MISSING],
}
ALLOCATOR_FLAGS = {
    "--trace": [MISSING, "{empty}", "{huge_row}"],
    "--limit": [ZERO, NEG, WORD],
    "--num-blocks": [ZERO, NEG, HUGE],
    "--block-size": [ZERO, NEG, HUGE],
    "--max-running": [ZERO, NEG],
    "--repeat": [ZERO, NEG],
    "--plot": ["out.txt", PROC],
}
ATTENTION_FLAGS = {
    "--batch": [ZERO, NEG, HUGE],
    "--context": [ZERO, NEG, HUGE],
    "--block-size": [ZERO, NEG],
    "--num-heads": [ZERO],
    "--num-kv-heads": [ZERO, "3"],
    "--head-dim": [ZERO, NEG],
    "--prefill-max-tokens": [ZERO],
    "--max-gb": [NEG, NAN],
    "--repeats": [ZERO],
    "--threads": [ZERO, NEG],
    "--dtype": ["foo"],
    "--device": ["foo"],
}
E2E_FLAGS = {
    "--num-requests": [ZERO, NEG, HUGE],
    "--trace-offset": [NEG],
    "--prompt-scale": [ZERO, NEG, NAN],
    "--output-scale": [ZERO, NEG],
    "--max-new-tokens": [ZERO, NEG],
    "--num-blocks": [ZERO, NEG],
    "--block-size": [ZERO, NEG],
    "--max-num-batched-tokens": [ZERO, NEG],
    "--max-batched-tokens": [ZERO],
    "--host-blocks": [NEG],
    "--admission-lookahead": [NEG],
    "--repeat": [ZERO, NEG],
    "--static-batch": [ZERO, NEG],
    "--systems": ["foo"],
    "--model": [MISSING],
    "--outputs-file": [PROC],
}
TIERS_FLAGS = {
    "--blocks": [ZERO, NEG],
    "--batch": [ZERO, NEG],
    "--chain": [ZERO, NEG],
    "--lookups": [ZERO, NEG],
    "--repeats": [ZERO],
    "--layers": [ZERO],
    "--kv-heads": [ZERO],
    "--head-dim": [ZERO],
    "--block-size": [ZERO, NEG],
    "--dtype": ["foo"],
    "--tiers disk --disk-path": ["/proc/nope"],
    "--tiers redis --redis-url": ["redis://127.0.0.1:1/0", "foo://x"],
    "--tiers": ["foo"],
}
STALLS_FLAGS = {
    "--prompt-lens": [ZERO, WORD, NEG],
    "--output-len": [ZERO, NEG],
    "--systems": ["foo"],
    "--plot": ["out.txt", PROC],
    "--model": [MISSING],
}
BITWISE_FLAGS = {"--families": ["foo"], "--new-tokens": [ZERO, NEG]}
SOAK_FLAGS = {"--ops": [ZERO, NEG, WORD]}

# command -> (base arguments, flag table)
COMMANDS: dict[str, tuple[list[str], dict[str, list[str]]]] = {
    "plan": (["--num-requests", "50"], SIM_FLAGS),
    "simulate": (["--num-requests", "30"], SIMULATE_FLAGS),
    "generate": (["hello"], GENERATE_FLAGS),
    "bench allocator": (["--limit", "50"], ALLOCATOR_FLAGS),
    "bench attention": (["--quick"], ATTENTION_FLAGS),
    "bench e2e": (["--num-requests", "2"], E2E_FLAGS),
    "bench tiers": (["--quick"], TIERS_FLAGS),
    "bench stalls": (["--quick"], STALLS_FLAGS),
    "bench bitwise": (["--quick"], BITWISE_FLAGS),
    "bench soak": (["--ops", "200"], SOAK_FLAGS),
}


def all_cases() -> list[tuple[str, ...]]:
    """Every (command words..., flag words..., value) case of the table, in a fixed order."""
    out: list[tuple[str, ...]] = []
    for command, (base, flags) in COMMANDS.items():
        for flag, values in flags.items():
            for value in values:
                out.append((*command.split(), *base, *flag.split(), value))
    return out


# --- the harness ---------------------------------------------------------------------------------------

SEED = int(os.environ.get("PAGEDKV_FUZZ_SEED", "0"))
NUM_TABLE_CASES = 16  # from the table of invalid values (all commands)
NUM_RANDOM_CASES = 10  # random flags and values on the torch-free commands
# "Ends quickly" is judged on the command's own CPU time (measured in the child), so parallel test workers and
# other load cannot turn a short command into a failure; the wall-clock timeout only catches a true hang.
CPU_BOUND_S = 45
TIMEOUT_S = 240
ADDRESS_LIMIT = 8 << 30  # RLIMIT_AS: torch reserves address space it never touches
RSS_BOUND_KB = 2_500_000  # resident memory a refused or short command may reach (torch imported: ~0.5 GB)
TORCH_FREE = ("plan", "simulate", "bench allocator", "bench soak")
RANDOM_VALUES = [ZERO, NEG, HUGE, WORD, NAN, "", "1e400", "0.5", "3", MISSING, "-99999999999999999999"]

# Runs `pagedkv.cli.main(argv)` under the address-space limit and reports its peak resident memory.
LAUNCH = (
    "import resource, sys\n"
    f"resource.setrlimit(resource.RLIMIT_AS, ({ADDRESS_LIMIT}, {ADDRESS_LIMIT}))\n"
    "from pagedkv.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "usage = resource.getrusage(resource.RUSAGE_SELF)\n"
    "sys.stderr.write('\\nMAXRSS_KB=%d\\nCPU_S=%.1f\\n' % (usage.ru_maxrss, usage.ru_utime + usage.ru_stime))\n"
    "sys.exit(rc)\n"
)


def _files(tmp: Path) -> dict[str, str]:
    (tmp / "empty.csv").write_text("")
    (tmp / "bad.json").write_text("{not json")
    (tmp / "huge.jsonl").write_text(
        '{"timestamp": 0, "input_length": 99999999999, "output_length": 10, "hash_ids": [1]}\n'
    )
    return {
        "{empty}": str(tmp / "empty.csv"),
        "{bad_json}": str(tmp / "bad.json"),
        "{huge_row}": str(tmp / "huge.jsonl"),
    }


def _random_case(rng: random.Random) -> tuple[tuple[str, ...], bool]:
    command = rng.choice(TORCH_FREE)
    base, flags = COMMANDS[command]
    words = [*command.split(), *base]
    for flag in rng.sample(sorted(flags), k=min(rng.choice((1, 2)), len(flags))):
        words += [*flag.split(), rng.choice(RANDOM_VALUES)]
    return tuple(words), False


def _cases() -> list[tuple[tuple[str, ...], bool]]:
    """(argv, must_fail): a seeded sample of the table (every value invalid) and of random command lines."""
    rng = random.Random(SEED)
    table = [(case, True) for case in rng.sample(all_cases(), NUM_TABLE_CASES)]
    return table + [_random_case(rng) for _ in range(NUM_RANDOM_CASES)]


def _run(argv: tuple[str, ...], cwd: Path) -> tuple[int | None, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PAGEDKV_NATIVE": os.environ.get("PAGEDKV_NATIVE", "")}
    try:
        out = subprocess.run(
            [sys.executable, "-c", LAUNCH, *argv],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            cwd=cwd,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return None, ""
    return out.returncode, out.stderr


def _verdict(argv: tuple[str, ...], must_fail: bool, rc: int | None, err: str) -> str | None:
    """Why this run is a failure of the command line, or None."""
    shown = " ".join(argv)
    if rc is None:
        return f"hang (> {TIMEOUT_S} s): pagedkv {shown}"
    if "Traceback" in err:
        return f"traceback: pagedkv {shown}\n{err[-800:]}"
    rss = [int(line.split("=")[1]) for line in err.splitlines() if line.startswith("MAXRSS_KB=")]
    if rss and rss[0] > RSS_BOUND_KB:
        return f"{rss[0] / 1e6:.1f} GB resident: pagedkv {shown}"
    cpu = [float(line.split("=")[1]) for line in err.splitlines() if line.startswith("CPU_S=")]
    if cpu and cpu[0] > CPU_BOUND_S:
        return f"{cpu[0]:.0f} s of CPU (> {CPU_BOUND_S} s): pagedkv {shown}"
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("MAXRSS_KB=", "CPU_S="))]
    errors = [line for line in lines if "error" in line.lower()]
    if rc == 0 and errors:
        return f"exit status 0 after an error: pagedkv {shown}: {errors[0]}"
    if must_fail and rc != 2:
        return f"accepted an invalid value (status {rc}): pagedkv {shown}"
    if rc not in (0, None) and (len(lines) != 1 or not lines[0].startswith("pagedkv")):
        return f"status {rc} without one 'pagedkv ...' line on stderr: pagedkv {shown}: {lines[:3]}"
    return None


def test_fuzzed_command_lines_fail_cleanly(tmp_path: Path) -> None:
    files = _files(tmp_path)
    cases = [(tuple(files.get(word, word) for word in argv), must_fail) for argv, must_fail in _cases()]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda case: _run(case[0], tmp_path), cases))
    problems = [v for (argv, must), (rc, err) in zip(cases, results) if (v := _verdict(argv, must, rc, err))]
    assert not problems, f"{len(problems)} of {len(cases)} command lines (seed {SEED}):\n" + "\n".join(
        problems
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--workload", "multi-turn", "--turns", "0"],
        ["simulate", "--workload", "multi-turn", "--turns", "0"],
        ["plan", "--workload", "fixed", "--prompt-len", "100000000"],
        ["bench", "allocator", "--max-running", "0"],
        ["bench", "allocator", "--max-running", "-1"],
        ["bench", "allocator", "--limit", "0"],
        ["bench", "allocator", "--repeat", "0"],
        ["bench", "allocator", "--trace", "{empty}"],
        ["bench", "allocator", "--trace", "{huge_row}"],
        ["simulate", "--replicas", "0"],
        ["simulate", "--host-tier-gib", "1"],
        ["simulate", "--plot", "x.txt"],
        ["generate", "hi", "--dtype", "foo"],
        ["generate", "hi", "--kv-budget", "1TiB"],
        ["generate", "hi", "--kv-budget", "2TB"],
        ["generate", "hi", "--disk-path", "/proc/nope", "--disk-bytes", "1MiB"],
        ["bench", "tiers", "--batch", "0"],
        ["bench", "tiers", "--tiers", "redis", "--redis-url", "redis://127.0.0.1:1/0"],
        ["bench", "tiers", "--tiers", "disk", "--disk-path", "/proc/nope"],
        ["bench", "stalls", "--prompt-lens", "0"],
        ["bench", "bitwise", "--new-tokens", "0"],
    ],
    ids=lambda argv: " ".join(argv),
)
def test_the_issue_s_command_lines_are_one_line_errors(argv: list[str], tmp_path: Path) -> None:
    files = _files(tmp_path)
    argv = [files.get(word, word) for word in argv]
    rc, err = _run(tuple(argv), tmp_path)
    assert _verdict(tuple(argv), True, rc, err) is None, err
