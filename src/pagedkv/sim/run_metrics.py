"""What an operator asks of a run, computed from a `SimTrace`.

Definitions (all times simulated seconds; the span runs from the first arrival to the last finish):
- `kv_waste`: of the KV slots allocated to live requests, the fraction holding no token, time-weighted over
  steps. Contiguous allocators waste their unused reservation and block rounding; paged ones only the empty
  tail of each sequence's last block (shared blocks counted once).
- `kv_utilisation`: the fraction of the whole KV budget holding tokens, time-weighted over the span.
- `mean_concurrency`: requests holding KV, time-weighted over the span (idle gaps count as zero);
  `peak_concurrency` its maximum.
- `requests_per_s`, `tokens_per_s`: finished requests and the tokens they generated per second of span (a
  request the allocator refused generated none).
- `ttft`: first token time minus arrival; `tpot`: (finish - first token) / (output tokens - 1), for
  requests with at least two output tokens.
- `prefix_hit_rate`: prompt tokens served from the prefix cache at first admission / prompt tokens.
- `prefill_tokens_saved`: prompt tokens served from the prefix cache over every admission (re-admissions
  after preemption included); `prefill_tokens_computed`: admitted prompt tokens minus those (the prefill the
  model ran); `miss_tokens_<reason>`: the computed ones, but each admission's last token, by why they missed
  (`pagedkv.core.misses`); `evictions`, `partial_hits` and `block_copies` as the allocator counted them.
- `kv_traffic_fraction`: the share of the bytes the step model charged that is KV (read and written), the
  rest being weights: how much of a memory-bound step the attention kernels' memory traffic is.
- `kv_held_gib`: KV bytes the pool holds (blocks in use x bytes per block), time-weighted over steps, in GiB;
  `kv_unread`: the share of them no query will read, time-weighted: empty slots, tokens a sliding layer's
  window has passed, padding layer slots of hybrid pages (`SimTrace.live_bytes`). On a hybrid model this is
  the measure that tells a uniform allocation (it keeps sliding layers' passed tokens) from a hybrid one.
- `page_table_bytes_fraction`: block-table bytes the attention kernels read (one int32 per context block
  per layer) over all bytes the step model charged; 0 for contiguous allocators. Traffic only: the latency
  cost of indirection inside a kernel is not modelled.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedkv.percentiles import percentile
from pagedkv.sim.simulator import SimTrace


def _pct(values: np.ndarray, q: float) -> float:
    """The shared percentile (finite values only); NaN rather than None when there is none (the JSON keeps it)."""
    value = percentile(values, q)
    return float("nan") if value is None else value


_LATENCY_KEYS = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")


def request_metrics(
    arrival_s: np.ndarray, first_token_s: np.ndarray, finish_s: np.ndarray, output_len: np.ndarray
) -> dict[str, Any]:
    """The requests' side of a run (one GPU's or a fleet's): TTFT and TPOT percentiles, the span from the
    first arrival to the last finish, finished requests and their generated tokens per second of it."""
    done = np.isfinite(finish_s)
    start = float(np.nanmin(arrival_s)) if np.isfinite(arrival_s).any() else 0.0
    span = max(float(np.nanmax(finish_s)) - start, 1e-12) if done.any() else 1e-12
    ttft = first_token_s - arrival_s
    decode = output_len > 1
    tpot = (finish_s[decode] - first_token_s[decode]) / (output_len[decode] - 1)
    return {
        "requests_per_s": int(done.sum()) / span,
        "tokens_per_s": float(output_len[done].sum()) / span,
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_s": _pct(tpot, 50),
        "tpot_p99_s": _pct(tpot, 99),
        "num_requests": int(done.sum()),
        "span_s": span,
    }


def summarize(trace: SimTrace) -> dict[str, Any]:
    """The metrics of one run (see the module docstring), as a flat JSON-ready dict."""
    dt = np.asarray(trace.step_s)
    bs = trace.config.block_size
    reserved = np.asarray(trace.used_blocks, dtype=np.float64) * bs
    empty = np.asarray(trace.empty_slots, dtype=np.float64)
    stored = np.asarray(trace.stored_tokens, dtype=np.float64)
    running = np.asarray(trace.running, dtype=np.float64)
    req = request_metrics(trace.arrival_s, trace.first_token_s, trace.finish_s, trace.output_len)
    span = req["span_s"]
    reserved_time = float((reserved * dt).sum())
    prompt_tokens = int(trace.prompt_len.sum())
    return {
        "kv_waste": float((empty * dt).sum() / reserved_time) if reserved_time else 0.0,
        "kv_utilisation": float((stored * dt).sum() / (trace.budget.num_tokens * span)),
        "mean_concurrency": float((running * dt).sum() / span),
        "peak_concurrency": int(running.max()) if running.size else 0,
        **{k: req[k] for k in ("requests_per_s", "tokens_per_s", *_LATENCY_KEYS)},
        "preemptions": int(trace.preemptions),
        "rejected": int(trace.rejected),
        "prefix_hit_rate": float(trace.cached_tokens.sum() / prompt_tokens) if prompt_tokens else 0.0,
        "kv_traffic_fraction": 1.0 - len(dt) * trace.config.model.weight_bytes / trace.bytes_moved
        if trace.bytes_moved
        else 0.0,
        "page_table_bytes_fraction": trace.page_table_bytes / trace.bytes_moved if trace.bytes_moved else 0.0,
        "num_requests": req["num_requests"],
        "num_steps": len(dt),
        "span_s": span,
        "num_blocks": trace.budget.num_blocks,
        **_cache_metrics(trace),
        **_held_metrics(trace, dt),
        **_spec_metrics(trace),
    }


def _spec_metrics(trace: SimTrace) -> dict[str, Any]:
    """With speculation on a paged allocator: the draws' acceptance, tokens per verification and the share of
    the span the draft model took; nothing otherwise."""
    if trace.config.speculation is None or not trace.spec_drafts:
        return {}
    return {
        "spec_acceptance_rate": trace.spec_accepted_tokens / trace.spec_draft_tokens,
        "spec_mean_accepted_length": 1.0 + trace.spec_accepted_tokens / trace.spec_drafts,
        "spec_draft_time_fraction": trace.draft_s / sum(trace.step_s) if trace.step_s else 0.0,
    }


def _held_metrics(trace: SimTrace, dt: np.ndarray) -> dict[str, float]:
    """KV held and the share of it no query reads, time-weighted (see the module docstring)."""
    held = np.asarray(trace.held_bytes, dtype=np.float64)
    live = np.minimum(np.asarray(trace.live_bytes, dtype=np.float64), held)  # shared prefixes count once
    held_time = float((held * dt).sum())
    return {
        "kv_held_gib": held_time / max(float(dt.sum()), 1e-12) / 2**30,
        "kv_unread": 1.0 - float((live * dt).sum()) / held_time if held_time else 0.0,
    }


def _cache_metrics(trace: SimTrace) -> dict[str, Any]:
    """The prefix cache's side of a run: policy, prefill saved and computed, evictions, misses by reason."""
    stats = trace.manager_stats
    out: dict[str, Any] = {"eviction": trace.config.eviction, "partial_reuse": trace.config.partial_reuse}
    if stats is None:
        return out
    out |= {
        "prefill_tokens_saved": stats.cached_tokens,
        "prefill_tokens_computed": stats.prompt_tokens - stats.cached_tokens,
        "evictions": stats.evictions,
        "partial_hits": stats.partial_hits,
        "block_copies": trace.block_copies,
    }
    out |= {f"miss_tokens_{reason}": n for reason, n in stats.miss_tokens.items()}
    return out
