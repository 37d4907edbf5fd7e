"""Plot pagedkv's allocator cost per scheduled token against the peers' figures in PEERS.md.

    python benchmarks/allocator_vs_peers.py RESULTS_DIR [--out docs/figures/bench-allocator-peers.png]

RESULTS_DIR holds the `pagedkv bench allocator --json` outputs named az_sha.json, az_fast.json, az_py.json,
az_nopc.json and mc_*.json (Azure conv first 3000, Mooncake first 1000; the commands are in
docs/benchmarks.md). The peers' us/token are PEERS.md's (nano-vllm BlockManager, SGLang RadixCache Python
path, vLLM 0.33 KVCacheManager on the same loop, 2026-11-29); the dashed line is the 10x goal.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PEERS = {  # PEERS.md, prefix caching on
    "azure": {"nano-vllm": 0.687, "SGLang (Python)": 0.898, "vLLM 0.33": 2.465},
    "mooncake": {"nano-vllm": 0.439, "SGLang (Python)": 0.448, "vLLM 0.33": 0.767},
}
OURS = {  # file stem suffix -> label
    "sha": "pagedkv, sha256 keys",
    "fast": "pagedkv, fast keys",
    "py": "pagedkv, sha256, no C extension",
    "nopc": "pagedkv, no prefix caching",
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path)
    p.add_argument("--out", type=Path, default=Path("docs/figures/bench-allocator-peers.png"))
    args = p.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (trace, prefix, title) in zip(axes, [("azure", "az", "Azure conv, first 3000"),
                                                 ("mooncake", "mc", "Mooncake, first 1000")]):  # fmt: skip
        labels, values, colours = [], [], []
        for stem, label in OURS.items():
            path = args.results / f"{prefix}_{stem}.json"
            if path.exists():
                labels.append(label)
                values.append(json.loads(path.read_text())["us_per_token"])
                colours.append("tab:blue" if stem != "nopc" else "tab:cyan")
        for name, value in PEERS[trace].items():
            labels.append(f"{name} (PEERS.md)")
            values.append(value)
            colours.append("tab:gray")
        ys = range(len(labels))[::-1]
        ax.barh(list(ys), values, color=colours)
        for y, v in zip(ys, values):
            ax.text(v * 1.08, y, f"{v:.3f}", va="center", fontsize=8)
        goal = min(PEERS[trace].values()) / 10
        ax.axvline(goal, color="tab:red", ls="--", lw=1)
        ax.text(goal * 1.05, len(labels) - 0.45, "goal: 10x below the fastest peer", color="tab:red", fontsize=8,
                va="bottom")  # fmt: skip
        ax.set_ylim(-0.6, len(labels) + 0.1)
        ax.set_xscale("log")
        ax.set_yticks(list(ys), labels, fontsize=8)
        ax.set_xlabel("us per scheduled token (CPU time, log scale)")
        ax.set_title(title, fontsize=10)
        ax.set_xlim(0.005, 6)
    fig.suptitle("Allocator cost per scheduled token on the PEERS.md loop (lower is better)", fontsize=10)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"figure written to {args.out}")


if __name__ == "__main__":
    main()
