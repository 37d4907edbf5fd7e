"""Plain-text tables for `pagedkv simulate` and `pagedkv plan`. Every table names what produced it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedkv.sim.run import SimulationReport

_COLUMNS: tuple[tuple[str, str, str], ...] = (
    # (header, key, format)
    ("KV waste", "kv_waste", "pct"),
    ("mean conc", "mean_concurrency", ".1f"),
    ("peak conc", "peak_concurrency", "d"),
    ("req/s", "requests_per_s", ".2f"),
    ("tok/s", "tokens_per_s", ".0f"),
    ("TTFT p50", "ttft_p50_s", "s"),
    ("TTFT p99", "ttft_p99_s", "s"),
    ("TPOT p50", "tpot_p50_s", "ms"),
    ("TPOT p99", "tpot_p99_s", "ms"),
    ("preempt", "preemptions", "d"),
    ("prefix hit", "prefix_hit_rate", "pct"),
)


def _cell(value: Any, fmt: str) -> str:
    if fmt == "pct":
        return f"{100 * value:.1f}%"
    if fmt == "s":
        return f"{value:.2f}s"
    if fmt == "ms":
        return f"{1000 * value:.1f}ms"
    return format(value, fmt)


def table(
    rows: dict[str, dict[str, Any]], first: str = "allocator", columns: tuple[tuple[str, str, str], ...] = _COLUMNS
) -> list[str]:
    """Aligned rows of the metrics in `rows` (name -> summary): `columns` are (header, key, format)."""
    header = [first] + [h for h, _, _ in columns]
    body = [[name] + [_cell(r[k], f) for _, k, f in columns] for name, r in rows.items()]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = []
    for row in [header, *body]:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells))
    lines.insert(1, "-" * len(lines[0]))
    return lines


# the prefix cache's table: (header, key, format); miss reasons follow as the largest two
_CACHE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("prefix hit", "prefix_hit_rate", "pct"),
    ("prefill saved", "prefill_tokens_saved", "d"),
    ("prefill run", "prefill_tokens_computed", "d"),
    ("evictions", "evictions", "d"),
    ("partial", "partial_hits", "d"),
    ("tok/s", "tokens_per_s", ".0f"),
    ("TTFT p99", "ttft_p99_s", "s"),
)


def cache_table(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The prefix-cache rows (runs that cache prefixes): hits, prefill saved and run, evictions, the two
    largest miss reasons, throughput, TTFT p99; `vs lru` is prefill saved against the `lru` row."""
    rows = {n: r for n, r in rows.items() if "prefill_tokens_saved" in r and n.startswith("paged-prefix")}
    if not rows:
        return []
    base = next((r["prefill_tokens_saved"] for r in rows.values() if r.get("eviction") == "lru"), None)
    header = ["run", *(h for h, _, _ in _CACHE_COLUMNS), "vs lru", "misses (tokens)"]
    body = []
    for name, r in rows.items():
        misses = sorted(((v, k[len("miss_tokens_") :]) for k, v in r.items() if k.startswith("miss_tokens_") and v), reverse=True)
        gain = f"{100 * (r['prefill_tokens_saved'] / base - 1):+.1f}%" if base else "-"
        body.append([name, *(_cell(r[k], f) for _, k, f in _CACHE_COLUMNS), gain,
                     ", ".join(f"{k} {v}" for v, k in misses[:2]) or "-"])  # fmt: skip
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = ["  ".join([row[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(row[1:-1], widths[1:-1])), row[-1]])
             for row in [header, *body]]  # fmt: skip
    lines.insert(1, "-" * len(lines[0]))
    return lines


def simulate_text(report: SimulationReport) -> str:
    c = report.config
    tp = f"{c.tensor_parallel} x " if c.tensor_parallel > 1 else ""
    out = [
        f"pagedkv simulate: model {c.model.name} on {tp}{c.gpu.name}, block size {c.block_size}, "
        f"max_model_len {c.max_model_len}",
        f"workload: {report.workload.name}",
        f"          {report.workload.notes()}",
        f"step time: roofline of bf16 weights + KV traffic vs FLOPs, + {1000 * c.step_overhead_s:g} ms/step; "
        f"max_num_seqs {c.scheduler.max_num_seqs}, max_num_batched_tokens {c.scheduler.max_num_batched_tokens}",
        "",
        *report.budget.lines(),
        "",
        *table(report.results),
    ]
    from pagedkv.sim.hybrid_kv import hybrid_sim_lines  # a hybrid model: uniform vs hybrid, in bytes

    hybrid = hybrid_sim_lines(c.model, report.results, report.skipped)
    out += ["", *hybrid] if hybrid else []
    cache = cache_table(report.results)
    if cache:
        out += ["", "prefix cache (prefill tokens over every admission; misses by reason, pagedkv.core.misses):", *cache]
    if report.sweep:
        for name in report.results:
            rows = {
                f"{name} bs={bs}": runs[name] for bs, runs in sorted(report.sweep.items()) if name in runs
            }
            out += ["", f"block-size sweep, {name}:", *table(rows, "run")]
            cache = cache_table(rows)
            out += ["", *cache] if cache else []
    return "\n".join(out)


def plan_text(plan: dict[str, Any], budget_lines: Sequence[str]) -> str:
    out = [
        f"pagedkv plan: model {plan['model']} on {plan['gpu']}, block size {plan['block_size']}, "
        f"max_model_len {plan['max_model_len']}",
        f"workload: {plan['workload']}",
        "",
        *budget_lines,
        "",
    ]
    header = ["allocator", "tokens/request", "blocks/request", "max concurrent", "no-preempt", "by memory"]
    body = [
        [
            name,
            f"{a['tokens_per_request']:.0f}",
            f"{a['blocks_per_request']:.1f}",
            str(a["max_concurrent"]),
            str(a["max_concurrent_no_preemption"]),
            str(a["max_concurrent_memory"]),
        ]
        for name, a in plan["allocators"].items()
    ]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    rows = [
        "  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])])
        for r in [header, *body]
    ]
    rows.insert(1, "-" * len(rows[0]))
    out += rows
    out += ["", *plan["notes"]]
    return "\n".join(out)
