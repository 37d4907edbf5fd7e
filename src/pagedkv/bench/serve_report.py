"""The report of `pagedkv bench serve`: the JSON object, the goals of issue 22, the table and the plot.

Per system and load: the median run's figures (by output tokens/s; the lower middle for an even count),
`runs_tokens_per_s` and `ranges` (min, max over runs of tokens/s, TTFT p99 and TPOT p50). Paired ratios
(round i against round i: the rounds were interleaved) of `pagedkv-serve` over every other system at each
load (over `pagedkv-offline` at the burst: the server's cost); `ratios_cpu` pairs the output tokens per CPU
second of the serving process tree (the server's with its workers, or this process's for the offline
engine), which a shared machine moves much less than wall time. The goals are judged on `ratios`. Texts are
compared only among systems that serve the same weights (`texts_not_compared` says who does not); a peer
that is not installed (`skipped`) or did not start (`failed`) is named with the reason.

Goals, each `met` True/False (None where a system needed was not run):
- `saturation`: at the burst, the median paired tokens/s ratio pagedkv-serve / transformers-serve >= 1.25;
- `ttft_below_saturation`: at every Poisson rate, pagedkv-serve's p99 TTFT (median run) is lower;
- `server_cost`: at the burst, the median paired ratio pagedkv-serve / pagedkv-offline >= 0.95.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

RANGE_KEYS = ("tokens_per_s", "ttft_p99_s", "tpot_p50_s", "tokens_per_cpu_s")
TABLE_COLUMNS = ("tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
                 "itl_p50_s", "itl_p99_s", "errors", "tokens_per_cpu_s")  # fmt: skip
# What the table says of a system wherever it appears, so that no figure is read as something it is not.
NOTES = {
    "openvino": "served through pagedkv's thin OpenAI shim over OpenVINO GenAI's ContinuousBatchingPipeline "
    "(OpenVINO GenAI has no HTTP server)",
    "llama-cpp": "llama-cpp-python's server answers one request at a time (a serial server, not a batching "
    "peer) and serves the GGUF's quantised weights: its text is not compared",
}


def cpu_model() -> str:
    """`lscpu`'s model name (or the platform's processor string)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ordered = sorted(runs, key=lambda f: f["tokens_per_s"])
    figure = dict(ordered[(len(ordered) - 1) // 2])
    figure["runs_tokens_per_s"] = [f["tokens_per_s"] for f in runs]
    figure["runs_tokens_per_cpu_s"] = [f.get("tokens_per_cpu_s") for f in runs]
    figure["runs_ttft_p99_s"] = [f.get("ttft_p99_s") for f in runs]
    figure["ranges"] = {
        k: [min(vals), max(vals)] if vals else None
        for k in RANGE_KEYS
        for vals in [[f[k] for f in runs if f.get(k) is not None]]
    }
    return figure


def paired(
    a: list[dict[str, Any]], b: list[dict[str, Any]], key: str = "tokens_per_s"
) -> dict[str, Any] | None:
    ratios = [x[key] / y[key] for x, y in zip(a, b) if x.get(key) and y.get(key)]
    if not ratios:
        return None
    return {"median": float(np.median(ratios)), "min": min(ratios), "max": max(ratios), "runs": ratios}


def text_agreement(
    texts: dict[str, dict[str, list[dict[str, str]]]], comparable: set[str] | None = None
) -> dict[str, Any]:
    """Per load: how many requests' texts differ from pagedkv-serve's (or the first system's), per system,
    among the `comparable` systems (same weights, same dtype; None: all)."""
    out: dict[str, Any] = {}
    systems = [s for s in texts if comparable is None or s in comparable]
    if not systems:
        return out
    base = "pagedkv-serve" if "pagedkv-serve" in texts else systems[0]
    for name, base_runs in texts[base].items():
        mismatched: dict[str, int] = {}
        compared = 0
        for other in systems:
            if other == base:
                continue
            for run_a, run_b in zip(base_runs, texts[other].get(name, [])):
                compared += len(run_a)
                mismatched[other] = mismatched.get(other, 0) + sum(run_a[k] != run_b.get(k) for k in run_a)
        out[name] = {"against": base, "requests_compared": compared, "mismatched": mismatched}
    return out


def goals(figures: dict[str, dict[str, Any]], ratios: dict[str, Any], loads: list[str]) -> dict[str, Any]:
    sat = ratios.get("pagedkv-serve/transformers-serve", {}).get("burst")
    cost = ratios.get("pagedkv-serve/pagedkv-offline", {}).get("burst")
    ttft: dict[str, Any] = {}
    for name in loads:
        if name in ("burst", "shared-prefix") or "pagedkv-serve" not in figures or "transformers-serve" not in figures:
            continue
        a, b = figures["pagedkv-serve"][name]["ttft_p99_s"], figures["transformers-serve"][name]["ttft_p99_s"]
        ttft[name] = {"pagedkv_p99_s": a, "transformers_p99_s": b,
                      "lower": None if a is None or b is None else a < b}  # fmt: skip
    lowers = [v["lower"] for v in ttft.values()]
    return {
        "saturation": {"goal": ">= 1.25x transformers serve's output tok/s at the burst", "ratio": sat,
                       "met": None if sat is None else sat["median"] >= 1.25},
        "ttft_below_saturation": {"goal": "lower p99 TTFT at every Poisson rate", "rates": ttft,
                                  "met": None if not lowers or None in lowers else all(lowers)},
        "server_cost": {"goal": "pagedkv serve >= 0.95x the offline engine's tok/s at the burst", "ratio": cost,
                        "met": None if cost is None else cost["median"] >= 0.95},
    }  # fmt: skip


def result_object(
    args: argparse.Namespace,
    setup: Any,
    runs: dict[str, dict[str, list[dict[str, Any]]]],
    texts: dict[str, dict[str, list[dict[str, str]]]],
    memory: dict[str, list[tuple[float, int]]],
    peer_configs: dict[str, dict[str, Any]] | None = None,
    failed: dict[str, str] | None = None,
) -> dict[str, Any]:
    from pagedkv.bench.peers import registry
    from pagedkv.bench.serve_systems import base_configs

    figures = {s: {name: median_run(r) for name, r in by_load.items() if r} for s, by_load in runs.items()}
    ratios: dict[str, Any] = {}
    ratios_cpu: dict[str, Any] = {}  # output tokens per CPU second of the serving process tree: steadier
    for other in runs:
        if "pagedkv-serve" in runs and other != "pagedkv-serve":
            mine, theirs = runs["pagedkv-serve"], runs[other]
            names = [name for name in setup.loads if theirs[name]]
            ratios[f"pagedkv-serve/{other}"] = {name: paired(mine[name], theirs[name]) for name in names}
            ratios_cpu[f"pagedkv-serve/{other}"] = {
                name: paired(mine[name], theirs[name], "tokens_per_cpu_s") for name in names
            }
    configs = {**base_configs(args), **(peer_configs or {})}
    peers = registry()
    not_compared = {s: "serves other weights (the GGUF's quantised ones)" for s in runs
                    if s in peers and not peers[s].same_weights}  # fmt: skip
    agreement = text_agreement(texts, {s for s in runs if s not in not_compared})
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_model(),
        "model": args.model,
        "requests_per_run": len(setup.shapes),
        "trace_offset": args.trace_offset,
        "prompt_tokens_mean": float(np.mean([s.prompt_tokens for s in setup.shapes])),
        "output_tokens_mean": float(np.mean([s.output_len for s in setup.shapes])),
        "kv_budget_blocks": args.num_blocks,
        "block_size": args.block_size,
        "loads": setup.loads,
        "repeat": args.repeat,
        "systems": {s: {"config": configs.get(s, {}), **({"note": NOTES[s]} if s in NOTES else {})} for s in runs},
        "skipped": dict(getattr(setup, "skipped", {}) or {}),
        "failed": dict(failed or {}),
        "threads": getattr(args, "threads", None),
        "dtype": getattr(args, "dtype", None),
        "differing_settings": differing(configs, [s for s in runs if s in configs]),
        "texts_not_compared": not_compared,
        "figures": figures,
        "ratios": ratios,
        "ratios_cpu": ratios_cpu,
        "texts": agreement,
        "texts_identical": all(not any(v["mismatched"].values()) for v in agreement.values()),
        "goals": goals(figures, ratios, setup.loads),
        "server_rss_samples": memory,
    }


def differing(configs: dict[str, dict[str, Any]], systems: list[str]) -> dict[str, dict[str, Any]]:
    keys = sorted({k for s in systems for k in configs[s]})
    return {
        k: {s: configs[s].get(k) for s in systems}
        for k in keys
        if len({str(configs[s].get(k)) for s in systems}) > 1
    }


def _loadavg_range(result: dict[str, Any]) -> str:
    values = [x for by_load in result["figures"].values() for f in by_load.values() for x in f.get("loadavg_1m") or []]
    return f"{min(values):.1f}-{max(values):.1f}" if values else "-"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if value < 100 else f"{value:.1f}"
    return "-" if value is None else str(value)


def print_table(result: dict[str, Any]) -> None:
    print(f"{result['model']} on {result['cpu']}, {result['date']}: {result['requests_per_run']} requests a run "
          f"(prompt mean {result['prompt_tokens_mean']:.0f}, output mean {result['output_tokens_mean']:.0f} tokens), "
          f"KV budget {result['kv_budget_blocks']} blocks x {result['block_size']} tokens, "
          f"{result['repeat']} interleaved repeat(s); texts identical: {result['texts_identical']}")  # fmt: skip
    print(f"threads {result['threads']}, dtype {result['dtype']}; loadavg 1m during the runs: "
          f"{_loadavg_range(result)}")  # fmt: skip
    for system, why in {**result["skipped"], **result["failed"]}.items():
        print(f"not run: {system}: {why}")
    for system, entry in result["systems"].items():
        if entry.get("note"):
            print(f"note: {system}: {entry['note']}")
    for system, why in result["texts_not_compared"].items():
        print(f"texts: {system} not compared: {why}")
    print("settings that differ:")
    for key, by_system in result["differing_settings"].items():
        print(f"  {key}: " + "; ".join(f"{s}: {v}" for s, v in by_system.items()))
    print("| system | load | " + " | ".join(TABLE_COLUMNS) + " | tok/s range |")
    print("|---" * (len(TABLE_COLUMNS) + 3) + "|")
    for system, by_load in result["figures"].items():
        for name, f in by_load.items():
            spread = f["ranges"]["tokens_per_s"]
            cells = [_cell(f.get(c)) for c in TABLE_COLUMNS]
            print(f"| {system} | {name} | " + " | ".join(cells) + f" | {spread[0]:.1f}-{spread[1]:.1f} |")
    for pair, by_load in result["ratios"].items():
        for name, r in by_load.items():
            cpu = result["ratios_cpu"][pair].get(name)
            if r and cpu:
                print(f"{pair} at {name}: tok/s median {r['median']:.2f}x, range {r['min']:.2f}-{r['max']:.2f}x "
                      f"over {len(r['runs'])} pair(s); tok per CPU s median {cpu['median']:.2f}x, "
                      f"range {cpu['min']:.2f}-{cpu['max']:.2f}x")  # fmt: skip
    for goal, g in result["goals"].items():
        state = {True: "met", False: "NOT met", None: "not measured"}[g["met"]]
        print(f"goal {goal} ({g['goal']}): {state}")


def plot(result: dict[str, Any], path: Path) -> None:
    """p99 TTFT and p50 TPOT against output tokens/s, one line per system through its loads (headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for system, by_load in result["figures"].items():
        names = [n for n in result["loads"] if n in by_load]
        x = [by_load[n]["tokens_per_s"] for n in names]
        for ax, key in zip(axes, ("ttft_p99_s", "tpot_p50_s")):
            y = [by_load[n][key] for n in names]
            ax.plot(x, y, marker="o", label=system)
            for xi, yi, n in zip(x, y, names):
                ax.annotate(n, (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
    for ax, title in zip(axes, ("p99 time to first token (s)", "p50 time per output token (s)")):
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"{result['model']}, {result['cpu']}, {result['date']} (labels: requests/s or burst)", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
