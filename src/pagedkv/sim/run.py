"""One call that runs a comparison: `run_simulation(...)` replays a workload under each allocator.

This is the entry point for code (the demo, notebooks, tests); `pagedkv simulate` is a thin CLI over it.
Each allocator gets a fresh scheduler and manager over the same KV budget and the same requests.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pagedkv.core.errors import CapacityError
from pagedkv.engine.scheduler import SchedulerConfig
from pagedkv.progress import Progress
from pagedkv.sim.allocators import ALLOCATORS, check_allocator, hybrid_twin, is_hybrid_allocator
from pagedkv.sim.catalog import Catalog
from pagedkv.sim.kv_budget import KVBudget
from pagedkv.sim.run_metrics import summarize
from pagedkv.sim.simulator import SIM_SCHEDULER, SimConfig, SimTrace, simulate
from pagedkv.sim.speculation import SpecSim
from pagedkv.sim.workload import Workload, WorkloadSpec, build_workload


@dataclass
class SimulationReport:
    """Results of one comparison, keyed by allocator (and by block size for a sweep)."""

    config: SimConfig  # the shared settings; `allocator` and `block_size` vary per run
    workload: Workload
    budget: KVBudget
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    traces: dict[str, SimTrace] = field(default_factory=dict)
    sweep: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)
    # runs of a hybrid model whose pool cannot hold one max_model_len request (the uniform one at long
    # context) while a hybrid run can: name -> why (`_replay`)
    skipped: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "model": self.config.model.name,
            "gpu": self.config.gpu.name,
            "tensor_parallel": self.config.tensor_parallel,
            "workload": self.workload.name,
            "workload_notes": self.workload.notes(),
            "kv_budget_bytes": self.budget.kv_budget_bytes,
            "bytes_per_token": self.budget.bytes_per_token,
            "block_size": self.config.block_size,
            "max_model_len": self.config.max_model_len,
            "gpu_memory_utilization": self.config.gpu_memory_utilization,
            "step_overhead_s": self.config.step_overhead_s,
            "allocators": self.results,
        }
        if self.skipped:
            data["skipped"] = dict(self.skipped)
        if self.sweep:
            data["block_size_sweep"] = {str(bs): r for bs, r in sorted(self.sweep.items())}
        return data


class _Progress:
    """A progress bar on stderr counting finished requests over every run: tqdm when installed, else a
    one-line counter of our own."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar: Any = None
        self._enabled, self._total, self._n, self._text = enabled, total, 0, ""
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:  # tqdm ships with the hf extra; the core install may lack it
            return
        self._bar = tqdm(total=total, unit="req", file=sys.stderr, leave=False, dynamic_ncols=True)

    def describe(self, text: str) -> None:
        self._text = text
        if self._bar is not None:
            self._bar.set_description(text)

    def __call__(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)
        elif self._enabled:
            self._n += n
            sys.stderr.write(f"\r{self._text}: {self._n}/{self._total} requests")
            sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._enabled and self._n:
            sys.stderr.write("\r" + " " * (len(self._text) + 40) + "\r")
            sys.stderr.flush()


def _variants(allocators: Sequence[str], evictions: Sequence[str], *, hybrid: bool = False) -> list[tuple[str, str, str]]:
    """(row name, allocator, eviction policy) of each run: `paged-prefix` once per policy when given; a
    hybrid model (`hybrid`) adds each paged allocator's hybrid twin (uniform vs hybrid, sim/hybrid_kv.py)."""
    out: list[tuple[str, str, str]] = []
    for a in allocators:
        if a == "paged-prefix" and evictions:
            out += [(f"paged-prefix:{e}", a, e) for e in evictions]
        else:
            out.append((a, a, "lru"))
    return _with_hybrid_twins(out) if hybrid else out


def _with_hybrid_twins(variants: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """A hybrid model's runs: each paged allocator followed by its hybrid twin (`hybrid` after `paged`,
    `hybrid-prefix` after the last `paged-prefix` row), unless already asked for."""
    out: list[tuple[str, str, str]] = []
    names = {name for name, _, _ in variants}
    for i, (name, allocator, eviction) in enumerate(variants):
        out.append((name, allocator, eviction))
        twin = hybrid_twin(allocator)
        last = i + 1 == len(variants) or variants[i + 1][1] != allocator
        if twin is not None and last and twin not in names:
            out.append((twin, twin, "lru"))
    return out


def _run_all(
    report: SimulationReport, runs: list[tuple[int, tuple[str, str, str]]], variants: list[tuple[str, str, str]],
    partial_reuse: bool, check_every: int, bar: Progress,
) -> None:  # fmt: skip
    """Each run of the comparison into `report` (the shared block size's rows, and every size's sweep)."""
    base, wl = report.config, report.workload
    for i, (bs, (name, allocator_name, eviction)) in enumerate(runs, 1):
        bar.stage(f"run {i}/{len(runs)}, {name} bs={bs}", total=len(wl.requests), unit="requests")
        config = replace(base, allocator=allocator_name, block_size=bs, eviction=eviction,
                         partial_reuse=partial_reuse)  # fmt: skip
        trace = _replay(config, wl, bar, check_every, report, name, variants)
        if trace is None:
            continue
        bar.stage(f"run {i}/{len(runs)}, {name} bs={bs}: summarising")
        summary = summarize(trace)
        if bs == base.block_size:
            report.results[name] = summary
            report.traces[name] = trace
        report.sweep.setdefault(bs, {})[name] = summary


def _replay(
    config: SimConfig, wl: Workload, bar: Progress, check_every: int, report: SimulationReport, name: str,
    variants: list[tuple[str, str, str]],
) -> SimTrace | None:
    """One run. A hybrid model's run whose pool cannot hold one `max_model_len` request is skipped (None,
    its reason in `report.skipped`) when the comparison has a hybrid run, which may hold it; else it raises."""
    try:
        return simulate(config, wl, progress=bar.update, check_every=check_every)
    except CapacityError as exc:
        others = [a for n, a, _ in variants if n != name]
        if is_hybrid_allocator(config.allocator) or not any(is_hybrid_allocator(a) for a in others):
            raise
        report.skipped[name] = str(exc)
        return None


def run_simulation(
    model: str = "llama-2-7b",
    gpu: str = "a100-40gb",
    workload: WorkloadSpec | None = None,
    *,
    allocators: Sequence[str] = ALLOCATORS,
    block_size: int = 16,
    max_model_len: int | None = None,
    gpu_memory_utilization: float = 0.9,
    scheduler: SchedulerConfig = SIM_SCHEDULER,
    step_overhead_s: float = 0.002,
    tensor_parallel: int = 1,
    activation_bytes: int | None = None,
    sweep_block_sizes: Sequence[int] = (),
    catalog: Catalog | None = None,
    progress: bool = False,
    check_every: int = 0,
    evictions: Sequence[str] = (),
    partial_reuse: bool = False,
    kv_cache_dtype: str = "auto",
    kv_scale_scheme: str = "token",
    speculation: SpecSim | None = None,
) -> SimulationReport:
    """Replay `workload` (default: the shipped Azure conv trace) under each allocator; see `SimConfig`.
    `evictions`: run `paged-prefix` once per eviction policy (rows `paged-prefix:<policy>`); `partial_reuse`
    turns partial-block reuse on for it. A hybrid model runs each paged allocator's hybrid twin beside it.
    `kv_cache_dtype` stores the model's KV in another dtype (`ModelShape.kv_cache_dtype`), with
    `kv_scale_scheme`'s scales when quantized.
    `speculation` speculates on the paged allocators (`pagedkv.sim.speculation`).
    `progress`: one line on stderr naming each phase (building the workload, then each run with its
    finished requests), redrawn while it runs (`pagedkv.progress`)."""
    catalog = catalog or Catalog.builtin()
    model_spec, gpu_spec = catalog.model(model), catalog.gpu(gpu)
    if kv_cache_dtype != "auto":
        model_spec = replace(model_spec, kv_cache_dtype=kv_cache_dtype)
    if kv_scale_scheme != "token":
        model_spec = replace(model_spec, kv_scale_scheme=kv_scale_scheme)
    for name in allocators:
        check_allocator(name)
    if not allocators:
        raise ValueError("run_simulation: give at least one allocator")
    base = SimConfig(
        model=model_spec, gpu=gpu_spec, allocator=allocators[0], block_size=block_size,
        max_model_len=max_model_len or model_spec.max_model_len, gpu_memory_utilization=gpu_memory_utilization,
        scheduler=scheduler, step_overhead_s=step_overhead_s, tensor_parallel=tensor_parallel,
        activation_bytes=activation_bytes, speculation=speculation,
    )  # fmt: skip
    bar = Progress("pagedkv simulate", enabled=progress, tick=True)
    try:
        bar.stage("building the workload")
        wl = build_workload(workload or WorkloadSpec(), base.max_model_len)
        variants = _variants(allocators, evictions, hybrid=model_spec.is_hybrid)
        runs = [(block_size, v) for v in variants]
        runs += [(bs, v) for bs in sweep_block_sizes if bs != block_size for v in variants]
        report = SimulationReport(base, wl, base.budget())
        _run_all(report, runs, variants, partial_reuse, check_every, bar)
    finally:
        bar.close()
    report.sweep = report.sweep if sweep_block_sizes else {}
    return report
