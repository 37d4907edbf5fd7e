"""Group-aware KV arithmetic: what a hybrid model's request holds with one table per KV cache group, next to
the uniform allocator that keeps every layer's KV for every token.

Layers are grouped as `pagedkv.core.group.group_layers` does (vLLM's layout): G = the fewest layers of any
attention type, each type cut into groups of G layers, one page (block) = G layers x block_size tokens:

    bytes_per_block (hybrid)  = G x block_size x kv_bytes_per_layer_token
    bytes_per_block (uniform) = L x block_size x kv_bytes_per_layer_token

A request of t tokens holds ceil(t / b) blocks in a full group and, in a sliding group of window W,
min(ceil(t / b), ceil((W - 1) / b) + 1) blocks while it decodes (the window's last W - 1 tokens plus the
block being written). Its uniform KV is L x ceil(t / b) x b token-layers.

Waste (vLLM's RFC #11382, first principles): the share of a uniform allocation that sliding layers hold
beyond their window,

    waste(t) = sum over sliding layers of (t - min(t, W)) / (L x t)

which at the model's longest context is 0.5 x (1 - 4096/8192) = 25% for Gemma 2 and
0.75 x (1 - 32768/131072) = 56.25% for Ministral, the RFC's figures. The planner rows use the same
Little's-law average as `planner.py`'s paged rows: bytes held at each decode step of each request,
weighted by its life.

The simulator (`pagedkv simulate`) runs the hybrid allocator for real: `HybridKVBudget` sizes its pool in
hybrid pages (the same KV bytes, `bytes_per_block` of G layers), `manager_groups` gives `HybridKVManager`
one group per `LayerGroup`, and every paged run of a hybrid model gets its hybrid twin (`hybrid` beside
`paged`, `hybrid-prefix` beside `paged-prefix`), printed side by side by `hybrid_sim_lines`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.core.group import KVGroupSpec, LayerGroup, group_layers, layers_per_block, padded_layers
from pagedkv.sim.catalog import ModelShape
from pagedkv.sim.kv_budget import KVBudget

IntArray = npt.NDArray[np.int64]
CONTEXTS = (8192, 32768, 65536, 131072)


def _ceil_sum(n: IntArray, b: int) -> IntArray:
    """sum_{t=1..n} ceil(t / b), element-wise."""
    q, r = np.divmod(n, b)
    out: IntArray = b * q * (q + 1) // 2 + r * (q + 1)
    return out


@dataclass(frozen=True)
class GroupedKV:
    """One model's KV cache groups at one block size (see the module docstring)."""

    model: ModelShape
    block_size: int

    @property
    def groups(self) -> tuple[LayerGroup, ...]:
        return group_layers(self.model.layer_windows)

    @property
    def layers_per_block(self) -> int:
        return layers_per_block(self.groups)

    @property
    def bytes_per_block(self) -> int:
        return self.model.kv_bytes_per_block(self.block_size, self.layers_per_block)

    def cap_blocks(self, group: LayerGroup) -> int | None:
        """The most blocks a decoding request holds in `group` (None: a full group, unbounded)."""
        w = group.spec.window
        return None if w is None else -(-(w - 1) // self.block_size) + 1

    def blocks(self, tokens: IntArray) -> IntArray:
        """Blocks a request of `tokens` tokens holds over all groups (element-wise)."""
        whole = -(-tokens // self.block_size)
        total = np.zeros_like(tokens)
        for g in self.groups:
            cap = self.cap_blocks(g)
            total += whole if cap is None else np.minimum(whole, cap)
        return total

    def blocks_over_life(self, start: IntArray, stop: IntArray) -> IntArray:
        """sum over t in (start, stop] of `blocks(t)`, element-wise: a request decoding from start to stop."""
        b = self.block_size
        total = np.zeros_like(start)
        for g in self.groups:
            cap = self.cap_blocks(g)
            if cap is None:
                total += _ceil_sum(stop, b) - _ceil_sum(start, b)
                continue
            tc = cap * b  # ceil(t / b) <= cap exactly when t <= tc
            lo, hi = np.minimum(start, tc), np.minimum(stop, tc)
            total += _ceil_sum(hi, b) - _ceil_sum(lo, b) + cap * (np.maximum(stop, tc) - np.maximum(start, tc))
        return total

    def waste(self, tokens: int) -> float:
        """The share of the uniform KV of a `tokens`-token request that sliding layers hold beyond their
        window (the RFC's figure; token granularity)."""
        windows = self.model.layer_windows
        beyond = sum(tokens - min(tokens, w) for w in windows if w is not None)
        return beyond / (len(windows) * tokens)


class HybridKVBudget(KVBudget):
    """`KVBudget` with hybrid pages: the same KV bytes cut into blocks of G layers (`GroupedKV`), so
    `num_blocks` and `num_tokens` count pages of one group's layers."""

    @property
    def bytes_per_block(self) -> int:
        return GroupedKV(self.model, self.block_size).bytes_per_block

    def fits(self, tokens: int) -> bool:
        """Whether one request of `tokens` tokens fits the pool, each group holding what it keeps."""
        need = GroupedKV(self.model, self.block_size).blocks(np.array([tokens], dtype=np.int64))
        return int(need[0]) <= self.num_usable_blocks


def manager_groups(model: ModelShape) -> tuple[KVGroupSpec, ...]:
    """`HybridKVManager`'s groups for `model`: one per `LayerGroup` (vLLM's layout, as the engine builds)."""
    return tuple(g.spec for g in group_layers(model.layer_windows))


def context_rows(budget: KVBudget, contexts: tuple[int, ...] = CONTEXTS) -> list[dict[str, Any]]:
    """Per context length (capped at the model's): concurrent requests of that many tokens, uniform vs
    hybrid, in the same KV budget, and the waste a uniform allocation carries."""
    kv = GroupedKV(budget.model, budget.block_size)
    b = budget.block_size
    rows = []
    for t in sorted({min(c, budget.model.max_model_len) for c in contexts}):
        uniform = -(-t // b) * budget.model.kv_bytes_per_block(b)
        hybrid = int(kv.blocks(np.array([t], dtype=np.int64))[0]) * kv.bytes_per_block
        rows.append({
            "context": t, "uniform_bytes": uniform, "hybrid_bytes": hybrid,
            "uniform_concurrent": int(budget.kv_budget_bytes // uniform),
            "hybrid_concurrent": int(budget.kv_budget_bytes // hybrid),
            "waste": kv.waste(t),
        })  # fmt: skip
    return rows


def workload_row(budget: KVBudget, prompt: IntArray, output: IntArray, max_num_seqs: int) -> dict[str, Any]:
    """The planner's paged row for a hybrid layout: bytes a live request holds on average (life-weighted,
    `planner.py`), and the concurrency the budget gives."""
    kv = GroupedKV(budget.model, budget.block_size)
    life = np.maximum(output - 1, 1)
    held = np.where(output > 1, kv.blocks_over_life(prompt, prompt + output - 1), kv.blocks(prompt))
    avg_bytes = float((held * kv.bytes_per_block).sum() / life.sum())
    full_bytes = float((kv.blocks(prompt + output) * kv.bytes_per_block * life).sum() / life.sum())
    memory = int(budget.kv_budget_bytes // avg_bytes)
    return {
        "max_concurrent": min(max_num_seqs, memory),
        "max_concurrent_memory": memory,
        "max_concurrent_no_preemption": min(max_num_seqs, int(budget.kv_budget_bytes // full_bytes)),
        "bytes_per_request": avg_bytes,
        "bytes_per_block": kv.bytes_per_block,
    }


def hybrid_plan(budget: KVBudget, prompt: IntArray, output: IntArray, max_num_seqs: int) -> dict[str, Any]:
    """Everything `pagedkv plan` shows for a hybrid model, JSON-ready."""
    kv = GroupedKV(budget.model, budget.block_size)
    return {
        "groups": _group_labels(kv.groups),
        "layers_per_block": kv.layers_per_block,
        "padded_layers": padded_layers(kv.groups),
        "hybrid": workload_row(budget, prompt, output, max_num_seqs),
        "contexts": context_rows(budget),
        "waste_at_max_context": kv.waste(budget.model.max_model_len),
    }


def _group_labels(groups: tuple[LayerGroup, ...]) -> list[str]:
    """'sliding-1024: 52 layers in 6 groups' per attention type, in order of appearance."""
    by: dict[str, list[int]] = {}
    for g in groups:
        by.setdefault(g.spec.label(), []).append(len(g.layers))
    return [f"{label}: {sum(n)} layers in {len(n)} group{'s' if len(n) > 1 else ''}" for label, n in by.items()]


def hybrid_text(plan: dict[str, Any], uniform: dict[str, Any]) -> str:
    """The hybrid section of `pagedkv plan`'s text."""
    gib = 2**30
    h = plan["hybrid"]
    lines = [
        f"KV cache groups: {', '.join(plan['groups'])} ({plan['layers_per_block']} layer slots per block, "
        f"{plan['padded_layers']} padding)",
        f"{'workload':<22}{'uniform (paged)':>18}{'hybrid':>12}",
        f"{'  max concurrent':<22}{uniform['max_concurrent']:>18,}{h['max_concurrent']:>12,}",
        f"{'  by memory':<22}{uniform['max_concurrent_memory']:>18,}{h['max_concurrent_memory']:>12,}",
        f"{'  GiB per request':<22}{uniform['bytes_per_request'] / gib:>18.3f}{h['bytes_per_request'] / gib:>12.3f}",
        f"{'context':>9}{'uniform GiB':>13}{'hybrid GiB':>12}{'uniform reqs':>14}{'hybrid reqs':>13}{'waste':>8}",
    ]
    for r in plan["contexts"]:
        lines.append(
            f"{r['context']:>9,}{r['uniform_bytes'] / gib:>13.3f}{r['hybrid_bytes'] / gib:>12.3f}"
            f"{r['uniform_concurrent']:>14,}{r['hybrid_concurrent']:>13,}{r['waste']:>8.1%}"
        )
    lines.append(f"uniform KV wasted on sliding layers at the model's {plan['contexts'][-1]['context']:,}-token "
                 f"context: {plan['waste_at_max_context']:.2%} (vLLM RFC #11382's measure)")  # fmt: skip
    return "\n".join(lines)


_SIM_COLUMNS = (("num blocks", "num_blocks", ","), ("KV held GiB", "kv_held_gib", ".2f"),
                ("KV unread", "kv_unread", "%"), ("mean conc", "mean_concurrency", ".1f"),
                ("peak conc", "peak_concurrency", ","), ("tok/s", "tokens_per_s", ".0f"),
                ("preempt", "preemptions", ","), ("TTFT p99", "ttft_p99_s", ".2f"))  # fmt: skip


def hybrid_sim_lines(
    model: ModelShape, results: dict[str, dict[str, Any]], skipped: dict[str, str] | None = None
) -> list[str]:
    """`pagedkv simulate`'s uniform vs hybrid table (rows of paged and hybrid runs); [] without hybrid rows.
    KV unread: the time-weighted share of the KV held that no query will read (empty slots, tokens out of
    every window, padding layer slots). `skipped`: runs whose pool could not hold one request, and why."""
    rows = {n: r for n, r in results.items() if n.split(":")[0] in ("paged", "paged-prefix", "hybrid", "hybrid-prefix")}
    if not any(n.startswith("hybrid") for n in rows):
        return []
    header = ["run", *(h for h, _, _ in _SIM_COLUMNS)]
    body = [[n, *(f"{100 * r[k]:.1f}%" if f == "%" else format(r[k], f) for _, k, f in _SIM_COLUMNS)]
            for n, r in rows.items()]  # fmt: skip
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = ["  ".join([row[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(row[1:], widths[1:]))])
             for row in [header, *body]]  # fmt: skip
    groups = ", ".join(_group_labels(group_layers(model.layer_windows)))
    return [f"uniform vs hybrid (KV cache groups: {groups}; same KV bytes, hybrid pages hold one group's layers):",
            lines[0], "-" * len(lines[0]), *lines[1:],
            *(f"{n}: not run: {why}" for n, why in (skipped or {}).items())]  # fmt: skip
