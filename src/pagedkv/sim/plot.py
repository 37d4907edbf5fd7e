"""The simulate figure: per allocator, KV in use vs reserved over time, and concurrency over time.

matplotlib is imported here only, with the Agg backend, so the CLI starts fast and runs headless.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pagedkv.sim.run import SimulationReport

GIB = 1024**3  # as the budget arithmetic prints


def plot_report(report: SimulationReport, path: str | Path) -> Path:
    """Write a PNG with one row per allocator; the title names model, GPU, workload and block size."""
    from pagedkv.sim.figures import label_panel, pyplot, save_figure

    plt = pyplot()

    names = list(report.traces)
    fig, axes = plt.subplots(len(names), 2, figsize=(13, 2.6 * len(names) + 0.9), squeeze=False, sharex=True)
    c = report.config
    budget_gb = report.budget.kv_budget_bytes / GIB
    bpt = report.budget.bytes_per_token
    for row, name in zip(axes, names):
        t = report.traces[name]
        x = np.asarray(t.step_end_s)
        reserved = np.asarray(t.used_blocks) * c.block_size * bpt / GIB
        in_use = np.asarray(t.stored_tokens) * bpt / GIB
        kv, conc = row
        kv.fill_between(x, 0, reserved, step="post", color="tab:orange", alpha=0.35, label="reserved")
        kv.plot(x, in_use, drawstyle="steps-post", color="tab:blue", lw=0.9, label="in use (tokens)")
        kv.axhline(budget_gb, color="grey", ls="--", lw=0.8, label="KV budget")
        s = report.results[name]
        label_panel(kv, f"{name}: KV waste {100 * s['kv_waste']:.1f}%", "KV (GiB)")
        conc.plot(x, t.running, drawstyle="steps-post", color="tab:green", lw=0.9, label="running")
        conc.plot(x, t.waiting, drawstyle="steps-post", color="tab:red", lw=0.7, alpha=0.7, label="waiting")
        label_panel(
            conc,
            f"{name}: mean {s['mean_concurrency']:.1f} / peak {s['peak_concurrency']} concurrent, "
            f"{s['requests_per_s']:.2f} req/s",
            "requests",
        )
    for ax in axes[-1]:
        ax.set_xlabel("simulated time (s)")
    tp = f"{c.tensor_parallel} x " if c.tensor_parallel > 1 else ""
    fig.suptitle(
        f"{c.model.name} on {tp}{c.gpu.name}, block size {c.block_size}, max_model_len {c.max_model_len}\n"
        f"{report.workload.name}",
        fontsize=10,
    )
    return save_figure(fig, path)


def sweep_path(path: str | Path) -> Path:
    """Where the block-size sweep figure goes, beside the main figure: `out.png` -> `out-sweep.png`."""
    path = Path(path)
    return path.with_name(f"{path.stem}-sweep{path.suffix or '.png'}")


def plot_sweep(report: SimulationReport, path: str | Path) -> Path:
    """The block-size sweep: per allocator, KV waste, mean concurrency and throughput against block size."""
    from pagedkv.sim.figures import pyplot, save_figure

    plt = pyplot()

    sizes = sorted(report.sweep)
    metrics = (("kv_waste", "KV waste (%)", 100.0), ("mean_concurrency", "mean concurrency", 1.0),
               ("tokens_per_s", "output tokens/s", 1.0))  # fmt: skip
    fig, axes = plt.subplots(1, len(metrics), figsize=(14, 3.8), squeeze=False)
    for ax, (key, label, scale) in zip(axes[0], metrics):
        for name in report.results:
            xs = [bs for bs in sizes if name in report.sweep[bs]]
            ax.plot(xs, [scale * report.sweep[bs][name][key] for bs in xs], marker="o", lw=1, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(bs) for bs in sizes])
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    c = report.config
    fig.suptitle(f"block-size sweep: {c.model.name} on {c.gpu.name}, {report.workload.name}", fontsize=10)
    return save_figure(fig, path)
