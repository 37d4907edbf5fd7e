"""pagedkv's allocator against the peers' real KV-cache code, side by side: one invocation, one machine, interleaved.

    python benchmarks/allocator_vs_peers.py [--repeats 3] [--traces azure,mooncake] [--json OUT.json]
                                            [--data DIR] [--peers-dir DIR] [--plot OUT.png]

For every trace and every repeat it runs pagedkv (`pagedkv bench allocator --json --clock wall`) and then
each available peer harness (nano-vllm's BlockManager, SGLang's RadixCache, vLLM v1's KVCacheManager), one
after the other (A B C A B C ...), each in its own process, on the same loop: trace order, block size 16,
16,384 blocks, at most 256 running, FCFS admission, preempt the newest until one token for everyone fits,
grow by one token, free the finished. Every side is timed with the wall clock over the same four phases
(the peer harnesses time wall clock, so pagedkv does too here).

Per trace it prints (and with `--json OUT` writes) each system's us/token (median and range over the
repeats), steps, preemptions and prefix hit rate, and per peer the ratio peer us/token / pagedkv us/token
taken within each repeat (median and range). A ratio is refused, with one line saying why, when the two
schedules differ by more than 2% in steps or preemptions: then the loops differ and the ratio compares
different work. No figure is ever read from a document: a peer that cannot run is reported as unavailable,
with how to set it up.

Where things are (options win over environment variables):
- traces: `--data DIR` or `$PAGEDKV_DATA` (default `../data` beside the peers folder, i.e. `../shared/data`
  from the repository root): `azure-llm-2023/conv.csv` (Azure LLM inference trace 2023, conversation, first
  3000 rows) and `mooncake-fast25/synthetic_trace.jsonl` (Mooncake FAST'25 synthetic trace, first 1000).
- peer harnesses: `--peers-dir DIR` or `$PAGEDKV_PEERS_DIR` (default `../shared/peers`); they import each
  peer's own code from `$NANOVLLM_SRC`, `$SGLANG_SRC`, `$VLLM_SRC`, run by the interpreter `$PEER_PY` (a
  venv holding the peers' dependencies; the harness folder's `setup.sh DIR` builds one and prints the
  exports).

The machines these figures come from are shared, 2-core, and differ by about 2x from one another in absolute
us/token: quote only ratios taken in one run, with the date and the CPU model (both are in the output).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACES = {  # name -> (file under the data folder, first N requests, label)
    "azure": ("azure-llm-2023/conv.csv", 3000, "Azure conv, first 3000"),
    "mooncake": ("mooncake-fast25/synthetic_trace.jsonl", 1000, "Mooncake synthetic, first 1000"),
}
LOOP = {"num_blocks": 16384, "block_size": 16, "max_running": 256}
SCHEDULE_TOLERANCE = 0.02


@dataclass(frozen=True)
class Peer:
    name: str  # as printed
    script: str  # harness file in the peers folder
    src_env: str  # environment variable naming the peer's source tree


PEERS = (
    Peer("nano-vllm", "nanovllm_bench.py", "NANOVLLM_SRC"),
    Peer("sglang", "sglang_bench.py", "SGLANG_SRC"),
    Peer("vllm", "vllm_bench.py", "VLLM_SRC"),
)
SETUP_HINT = (
    "set up the peers with: W=$(mktemp -d); {peers}/setup.sh $W; put a nano-vllm source tree "
    "(github.com/GeeeekExplorer/nano-vllm) at $W/nanovllm_src; then export the PEER_PY, NANOVLLM_SRC, "
    "SGLANG_SRC and VLLM_SRC lines setup.sh prints"
)


def peer_unavailable(peer: Peer, peers_dir: Path, peer_py: str | None) -> str | None:
    """Why `peer` cannot run here, or None when it can."""
    if not (peers_dir / peer.script).is_file():
        return f"no harness {peers_dir / peer.script} (--peers-dir / $PAGEDKV_PEERS_DIR)"
    if not peer_py or not Path(peer_py).is_file():
        return "$PEER_PY is not set to a python" if not peer_py else f"$PEER_PY={peer_py} does not exist"
    src = os.environ.get(peer.src_env)
    if not src or not Path(src).is_dir():
        return (
            f"${peer.src_env} is not set to the peer's source tree"
            if not src
            else f"${peer.src_env}={src} is not a folder"
        )
    return None


def run_json(cmd: list[str], env: dict[str, str], out: Path) -> dict:
    """Run one benchmark process that writes its JSON report to `out`; raise with its stderr tail if it fails."""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed (rc {proc.returncode}):\n{tail}")
    if out.exists():
        return json.loads(out.read_text())
    return json.loads(proc.stdout)


def run_pagedkv(trace: Path, limit: int, hash_fn: str, tmp: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [
        sys.executable, "-m", "pagedkv.cli", "bench", "allocator", "--trace", str(trace), "--limit", str(limit),
        "--num-blocks", str(LOOP["num_blocks"]), "--block-size", str(LOOP["block_size"]),
        "--max-running", str(LOOP["max_running"]), "--hash", hash_fn, "--clock", "wall", "--json",
    ]  # fmt: skip
    return run_json(cmd, env, tmp / "__none__")


def run_peer(peer: Peer, peers_dir: Path, peer_py: str, trace: Path, limit: int, tmp: Path) -> dict:
    out = tmp / f"{peer.script}.json"
    out.unlink(missing_ok=True)
    cmd = [
        peer_py, str(peers_dir / peer.script), "--trace", str(trace), "--limit", str(limit),
        "--num-blocks", str(LOOP["num_blocks"]), "--block-size", str(LOOP["block_size"]),
        "--max-running", str(LOOP["max_running"]), "--json", str(out),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PEER_BENCH_CHECK"] = "0"
    return run_json(cmd, env, out)


def schedule_mismatch(ours: dict, theirs: dict) -> str | None:
    """Why the two runs did not follow the same schedule (steps or preemptions more than 2% apart), or None."""
    for key in ("steps", "preemptions"):
        a, b = int(ours[key]), int(theirs[key])
        if abs(a - b) > SCHEDULE_TOLERANCE * max(a, b, 1):
            return f"{key} differ: pagedkv {a}, peer {b} (more than {SCHEDULE_TOLERANCE:.0%})"
    return None


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def summarize(label: str, runs: dict[str, list[dict]]) -> dict:
    """Per system: medians and ranges; per peer: the per-repeat ratio, or the reason it is refused."""
    systems = {}
    for name, rows in runs.items():
        systems[name] = {
            "us_per_token": spread([float(r["us_per_token"]) for r in rows]),
            "steps": rows[0]["steps"],
            "preemptions": rows[0]["preemptions"],
            "prefix_hit_rate": rows[0]["prefix_hit_rate"],
            "scheduled_tokens": rows[0]["scheduled_tokens"],
        }
    ratios: dict[str, dict] = {}
    ours = runs["pagedkv"]
    for name, rows in runs.items():
        if name == "pagedkv":
            continue
        why = next((w for a, b in zip(ours, rows) if (w := schedule_mismatch(a, b))), None)
        if why is not None:
            ratios[name] = {"refused": why}
            continue
        per_run = [float(b["us_per_token"]) / float(a["us_per_token"]) for a, b in zip(ours, rows)]
        ratios[name] = spread(per_run)
    return {"trace": label, "systems": systems, "ratio_peer_over_pagedkv": ratios}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def print_trace(s: dict) -> None:
    print(f"\n{s['trace']}")
    print(f"{'system':<10} {'us/token median':>16} {'range':>17} {'steps':>6} {'preempt':>8} {'hit rate':>9}")
    for name, f in s["systems"].items():
        u = f["us_per_token"]
        print(f"{name:<10} {u['median']:>16.4f} {u['min']:>8.4f}-{u['max']:<8.4f} {f['steps']:>6} "
              f"{f['preemptions']:>8} {f['prefix_hit_rate']:>8.1%}")  # fmt: skip
    for name, r in s["ratio_peer_over_pagedkv"].items():
        if "refused" in r:
            print(f"ratio vs {name}: refused, the schedules differ ({r['refused']})")
        else:
            print(f"ratio vs {name}: {r['median']:.2f}x (range {r['min']:.2f}-{r['max']:.2f}x over "
                  f"{len(r['runs'])} runs) fewer us/token for pagedkv")  # fmt: skip


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    traces = list(result["traces"].values())
    fig, axes = plt.subplots(1, len(traces), figsize=(5.5 * len(traces), 3.6), squeeze=False)
    for ax, s in zip(axes[0], traces):
        names = list(s["systems"])
        med = [s["systems"][n]["us_per_token"]["median"] for n in names]
        lo = [m - s["systems"][n]["us_per_token"]["min"] for n, m in zip(names, med)]
        hi = [s["systems"][n]["us_per_token"]["max"] - m for n, m in zip(names, med)]
        ys = list(range(len(names)))[::-1]
        ax.barh(ys, med, xerr=[lo, hi], color=["tab:blue"] + ["tab:gray"] * (len(names) - 1))
        for y, v, top in zip(ys, med, hi):
            ax.text((v + top) * 1.08, y, f"{v:.3f}", va="center", fontsize=8)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlim(right=max(m + h for m, h in zip(med, hi)) * 2.5)
        ax.set_yticks(ys, names, fontsize=8)
        ax.set_xlabel("us per scheduled token (wall, median and range)")
        ax.set_title(s["trace"], fontsize=10)
    fig.suptitle(
        f"Allocator cost side by side, one run, interleaved ({result['date']}, {result['cpu']})", fontsize=9
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"figure written to {path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds per trace (default 3)")
    p.add_argument("--traces", default="azure,mooncake", help="comma-separated subset of azure, mooncake")
    p.add_argument(
        "--data", type=Path, default=None, help="trace folder (default $PAGEDKV_DATA or ../shared/data)"
    )
    p.add_argument("--peers-dir", type=Path, default=None,
                   help="peer harness folder (default $PAGEDKV_PEERS_DIR or ../shared/peers)")  # fmt: skip
    p.add_argument(
        "--hash", dest="hash_fn", choices=["sha256", "fast"], default="sha256", help="pagedkv's block keys"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the figures as one JSON object here")
    p.add_argument("--plot", type=Path, default=None, help="also draw the medians and ranges into this PNG")
    p.add_argument("--from-json", type=Path, default=None,
                   help="run nothing: print (and --plot) the figures of an earlier --json output")  # fmt: skip
    args = p.parse_args(argv)
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        print(
            f"{saved['date']}; CPU: {saved['cpu']}; {saved['repeats']} interleaved repeats (from {args.from_json})"
        )
        for s in saved["traces"].values():
            print_trace(s)
        if args.plot:
            plot(saved, args.plot)
        return 0

    # ../shared from the repository root, or from any folder above it (a worktree nested one level deeper)
    shared = next((d / "shared" for d in ROOT.parents if (d / "shared").is_dir()), ROOT.parent / "shared")
    data = args.data or Path(os.environ.get("PAGEDKV_DATA") or shared / "data")
    peers_dir = args.peers_dir or Path(os.environ.get("PAGEDKV_PEERS_DIR") or shared / "peers")
    traces = [t.strip() for t in args.traces.split(",") if t.strip()]
    bad = [t for t in traces if t not in TRACES]
    if bad or args.repeats < 1:
        print(f"error: unknown traces {bad} (choose azure, mooncake)" if bad else "error: --repeats must be >= 1",
              file=sys.stderr)  # fmt: skip
        return 2
    missing = [str(data / TRACES[t][0]) for t in traces if not (data / TRACES[t][0]).is_file()]
    if missing:
        print(
            f"error: trace file(s) not found: {', '.join(missing)} (set --data or $PAGEDKV_DATA)",
            file=sys.stderr,
        )
        return 2
    peer_py = os.environ.get("PEER_PY")
    available, unavailable = [], {}
    for peer in PEERS:
        why = peer_unavailable(peer, peers_dir, peer_py)
        if why is None:
            available.append(peer)
        else:
            unavailable[peer.name] = why
    for name, why in unavailable.items():
        print(f"peer {name} unavailable: {why}", file=sys.stderr)
    if unavailable:
        print(SETUP_HINT.format(peers=peers_dir), file=sys.stderr)

    result = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "clock": "wall (perf_counter) over the loop's four phases, every system",
        "loop": LOOP,
        "repeats": args.repeats,
        "hash_fn": args.hash_fn,
        "peers_unavailable": unavailable,
        "note": "absolute us/token varies about 2x between machines; compare ratios taken in one run",
        "traces": {},
    }
    print(f"{result['date']}, {result['cpu']} ({result['cpus']} CPUs); {args.repeats} interleaved repeats; "
          f"peers: {', '.join(p.name for p in available) or 'none'}", file=sys.stderr)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for t in traces:
            rel, limit, label = TRACES[t]
            path = data / rel
            runs: dict[str, list[dict]] = {"pagedkv": [], **{p.name: [] for p in available}}
            for i in range(args.repeats):
                for name in runs:
                    print(f"[{label}] repeat {i + 1}/{args.repeats}: {name} ...", file=sys.stderr, flush=True)
                    if name == "pagedkv":
                        row = run_pagedkv(path, limit, args.hash_fn, tmp)
                    else:
                        peer = next(p for p in available if p.name == name)
                        row = run_peer(peer, peers_dir, peer_py or "", path, limit, tmp)
                    runs[name].append(row)
            result["traces"][t] = summarize(label, runs)
    print(f"{result['date']}; CPU: {result['cpu']}; wall clock; {args.repeats} interleaved repeats. "
          "Absolute us/token varies about 2x between machines: only the ratios within one run compare.")  # fmt: skip
    for s in result["traces"].values():
        print_trace(s)
    for name, why in unavailable.items():
        print(f"peer {name}: unavailable ({why})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"JSON written to {args.json}", file=sys.stderr)
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
