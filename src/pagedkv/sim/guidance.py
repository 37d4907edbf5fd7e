"""When does paging pay? A sweep of output-length spread x memory pressure, drawn as a decision chart.

`pagedkv simulate --sweep-guidance PATH` (or `guidance_sweep(...)` from code) replays one synthetic workload
per cell of a grid through the simulator (`pagedkv.sim.simulator`) with three allocators and reports the
gain of `paged` in requests/s over `contiguous-max` and over `contiguous-oracle`:

- rows, output-length spread: every request has a `prompt_len`-token prompt (`--prompt-len`, default 512)
  and an output of mean `output_len` tokens (`--output-len`, default 128) drawn log-normal with ln-space
  sigma 0 (fixed length), 0.25, 0.5, 1.0 and 1.5 (heavy-tailed); mu = ln(mean) - sigma^2 / 2 keeps the mean
  (coefficients of variation 0, 0.25, 0.53, 1.31 and 2.91).
- columns, memory pressure: the KV budget in requests' worth, `pressure x (prompt_len + output_len)`
  tokens (2, 4, 8, 16, 32, 64), set through the activation reserve so the model and GPU stay the user's.
  `max_model_len` is the model's context or the budget, whichever is smaller (a server cannot admit a
  request longer than its cache): at 2-4 requests' worth the limit, not the cache, is what shrinks.
- every request arrives at t=0 (burst), so requests/s is each allocator's ceiling; a cell replays
  `max(MIN_REQUESTS, REQUESTS_PER_SLOT x pressure)` requests so each run reaches steady state.

With paging, the batch a cell sustains is about its pressure (requests' worth of memory, all of it used;
somewhat more, since a request mid-way holds less than its full length); so the seed's "use paging for
batch sizes above ~8" falls near the column 8 of the chart. The chart prints paged's measured mean batch
in every cell and marks where it reaches 8 (`threshold_column`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.sim.run_metrics import summarize
from pagedkv.sim.simulator import SimConfig, simulate
from pagedkv.sim.workload import WorkloadSpec, build_workload

SIGMAS = (0.0, 0.25, 0.5, 1.0, 1.5)
PRESSURES = (2, 4, 8, 16, 32, 64)
GUIDANCE_ALLOCATORS = ("contiguous-max", "contiguous-oracle", "paged")
MIN_REQUESTS = 200
REQUESTS_PER_SLOT = 6


@dataclass(frozen=True)
class GuidanceCell:
    sigma: float
    pressure: int
    max_model_len: int
    num_requests: int
    results: dict[str, dict[str, Any]]

    @property
    def gain_vs_max(self) -> float:
        return float(
            self.results["paged"]["requests_per_s"] / self.results["contiguous-max"]["requests_per_s"]
        )

    @property
    def gain_vs_oracle(self) -> float:
        return float(
            self.results["paged"]["requests_per_s"] / self.results["contiguous-oracle"]["requests_per_s"]
        )

    @property
    def paged_batch(self) -> float:
        return float(self.results["paged"]["mean_concurrency"])


def coefficient_of_variation(sigma: float) -> float:
    return math.sqrt(math.expm1(sigma**2))


def _cell_config(base: SimConfig, pressure: int, request_len: int) -> SimConfig:
    """`base` with the activation reserve chosen so the cache holds `pressure x request_len` tokens
    (plus the null block), and max_model_len capped by it."""
    budget = base.budget()
    bs = base.block_size
    blocks = -(-pressure * request_len // bs) + 1
    activation = budget.usable_bytes - base.model.weight_bytes - blocks * budget.bytes_per_block
    if activation < 0:
        raise InvalidArgumentError(
            f"{base.model.name} on {base.gpu.name} cannot hold {pressure} requests of {request_len} tokens "
            f"({blocks * budget.bytes_per_block / 1e9:.1f} GB of KV); choose a larger GPU or fewer pressures"
        )
    max_len = min(base.model.max_model_len, (blocks - 1) * bs)
    return replace(base, activation_bytes=activation, max_model_len=max_len)


def guidance_sweep(
    base: SimConfig,
    *,
    prompt_len: int = 512,
    output_len: int = 128,
    sigmas: Sequence[float] = SIGMAS,
    pressures: Sequence[int] = PRESSURES,
    seed: int = 0,
    num_requests: int | None = None,
    progress: bool = False,
) -> list[GuidanceCell]:
    """Simulate every (sigma, pressure) cell with the three allocators (module docstring); `num_requests`
    overrides the per-cell request count (tests)."""
    if prompt_len < 1 or output_len < 1:
        raise InvalidArgumentError(f"prompt_len and output_len must be >= 1, got {prompt_len}, {output_len}")
    if not sigmas or not pressures or min(sigmas) < 0 or min(pressures) < 1:
        raise InvalidArgumentError(
            f"need sigmas >= 0 and pressures >= 1, got {list(sigmas)}, {list(pressures)}"
        )
    request_len = prompt_len + output_len
    configs = {p: _cell_config(base, p, request_len) for p in pressures}  # fail before any work
    cells: list[GuidanceCell] = []
    total = len(sigmas) * len(pressures)
    for sigma in sigmas:
        for pressure in pressures:
            config = configs[pressure]
            n = num_requests or max(MIN_REQUESTS, REQUESTS_PER_SLOT * pressure)
            if progress:
                sys.stderr.write(
                    f"\r[sweep-guidance] cell {len(cells) + 1}/{total}: sigma {sigma:g}, "
                    f"{pressure} requests' worth, {n} requests x {len(GUIDANCE_ALLOCATORS)} allocators   "
                )
                sys.stderr.flush()
            spec = WorkloadSpec(
                source="variable",
                num_requests=n,
                arrivals="burst",
                seed=seed,
                prompt_lognormal=(math.log(prompt_len), 0.0),
                output_lognormal=(math.log(output_len) - sigma**2 / 2, sigma),
            )
            wl = build_workload(spec, config.max_model_len)
            results = {
                name: summarize(simulate(replace(config, allocator=name), wl)) for name in GUIDANCE_ALLOCATORS
            }
            cells.append(GuidanceCell(sigma, pressure, config.max_model_len, n, results))
    if progress:
        sys.stderr.write("\n")
    return cells


def threshold_column(cells: Sequence[GuidanceCell], batch: float = 8.0) -> float:
    """The pressure at which paged's mean batch (averaged over the rows) reaches `batch`, interpolated in
    log2(pressure); the first or last pressure when every column is above or below it."""
    pressures = sorted({c.pressure for c in cells})
    mean_batch = [float(np.mean([c.paged_batch for c in cells if c.pressure == p])) for p in pressures]
    for (p0, b0), (p1, b1) in zip(zip(pressures, mean_batch), zip(pressures[1:], mean_batch[1:])):
        if b0 < batch <= b1:
            f = (batch - b0) / (b1 - b0)
            return float(2 ** (math.log2(p0) + f * (math.log2(p1) - math.log2(p0))))
    return float(pressures[0] if mean_batch[0] >= batch else pressures[-1])


def plot_guidance(cells: Sequence[GuidanceCell], path: str | Path, title: str) -> Path:
    """Two heat maps (gain over contiguous-max, over contiguous-oracle); each cell shows the gain and paged's
    mean batch; a dashed line marks where paged's mean batch reaches 8."""
    from pagedkv.sim.figures import pyplot, save_figure

    plt = pyplot()
    from matplotlib.colors import TwoSlopeNorm

    sigmas = sorted({c.sigma for c in cells})
    pressures = sorted({c.pressure for c in cells})
    by = {(c.sigma, c.pressure): c for c in cells}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    x8 = threshold_column(cells)
    x8_pos = float(np.interp(math.log2(x8), np.log2(pressures), np.arange(len(pressures))))
    for ax, (attr, name) in zip(
        axes, (("gain_vs_max", "contiguous-max"), ("gain_vs_oracle", "contiguous-oracle"))
    ):
        grid = np.array([[getattr(by[(s, p)], attr) for p in pressures] for s in sigmas])
        hi = max(float(grid.max()), 1.05)
        lo = min(float(grid.min()), 0.95)
        im = ax.imshow(grid, cmap="RdYlGn", norm=TwoSlopeNorm(1.0, lo, hi), aspect="auto", origin="lower")
        for i, s in enumerate(sigmas):
            for j, p in enumerate(pressures):
                c = by[(s, p)]
                ax.text(
                    j, i, f"{grid[i, j]:.2f}x\nb={c.paged_batch:.0f}", ha="center", va="center", fontsize=7
                )
        ax.axvline(x8_pos, color="black", ls="--", lw=1)
        ax.text(x8_pos + 0.05, -0.42, "paged batch 8", fontsize=7)
        ax.set_xticks(range(len(pressures)), [str(p) for p in pressures])
        ax.set_yticks(
            range(len(sigmas)),
            [("fixed" if s == 0 else f"sigma {s:g} (CV {coefficient_of_variation(s):.2f})") for s in sigmas],
        )
        ax.set_xlabel("KV budget (requests' worth of prompt + mean output)")
        ax.set_ylabel("output-length spread")
        ax.set_title(f"paged req/s / {name} req/s", fontsize=10)
        fig.colorbar(im, ax=ax, shrink=0.85)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def _guidance_json(
    cells: list[GuidanceCell], model: str, gpu: str, args: argparse.Namespace, x8: float, path: Path
) -> dict[str, Any]:
    return {
        "model": model,
        "gpu": gpu,
        "prompt_len": args.prompt_len,
        "output_mean": args.output_len,
        "batch_8_at_pressure": x8,
        "plot": str(path),
        "cells": [
            {
                "sigma": c.sigma,
                "output_cv": coefficient_of_variation(c.sigma),
                "pressure": c.pressure,
                "max_model_len": c.max_model_len,
                "num_requests": c.num_requests,
                "gain_vs_max": c.gain_vs_max,
                "gain_vs_oracle": c.gain_vs_oracle,
                "paged_mean_batch": c.paged_batch,
                "allocators": c.results,
            }
            for c in cells
        ],
    }


def _print_guidance_table(cells: list[GuidanceCell], title: str, x8: float) -> None:
    """Rows: output spread; columns: KV budget in requests' worth; cell: gain vs max / vs oracle."""
    print(title)
    print(
        "rows: output spread; columns: KV budget in requests' worth; cell: gain vs max / vs oracle (paged batch)"
    )
    pressures = sorted({c.pressure for c in cells})
    print(f"{'':>22}" + "".join(f"{p:>20}" for p in pressures))
    for sigma in sorted({c.sigma for c in cells}):
        row = [c for c in cells if c.sigma == sigma]
        label = "fixed" if sigma == 0 else f"sigma {sigma:g} (CV {coefficient_of_variation(sigma):.2f})"
        cellstr = [f"{c.gain_vs_max:.2f}/{c.gain_vs_oracle:.2f} ({c.paged_batch:.0f})" for c in row]
        print(f"{label:>22}" + "".join(f"{s:>20}" for s in cellstr))
    print(f"paged's mean batch reaches 8 at about {x8:.1f} requests' worth of KV")


def run_guidance(args: argparse.Namespace) -> int:
    """`pagedkv simulate --sweep-guidance PATH`: the sweep under the command's model/GPU/block size; table
    (or `--json`) on stdout, the chart at PATH."""
    from pagedkv.sim.cli_options import sim_config_from

    base = sim_config_from(args, activation_bytes=None)  # the flag is validated, then replaced per cell
    model = base.model
    cells = guidance_sweep(
        base,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        seed=args.seed,
        progress=not args.no_progress,
    )
    title = (
        f"{model.name} on {base.gpu.name}: gain of paging in requests/s (burst), prompt {args.prompt_len}, "
        f"output mean {args.output_len}, block size {base.block_size}"
    )
    path = plot_guidance(cells, args.sweep_guidance, title)
    x8 = threshold_column(cells)
    if args.json:
        print(json.dumps(_guidance_json(cells, model.name, base.gpu.name, args, x8, path), indent=2))
        return 0
    _print_guidance_table(cells, title, x8)
    print(f"figure written to {path}")
    return 0
