"""`pagedkv bench soak --hybrid N`: a black-box soak of `HybridKVManager`, checked against a shadow KV store.

Episodes on fresh managers with random KV cache groups (a full group and one to three windowed ones,
sliding or chunked, windows of 2-40 tokens), block sizes 1-16 and pools of 24-256 blocks. Random
operations: admit (prompts sharing a few prefixes, with and without a chunk budget), compute a chunk
(`reserve`, then the caller's forward writes (position, token) at each group's slots, then
`mark_computed`), batched append, fork, rollback, free, preempt, swap out and in, reset. Block copies and
swap plans are applied to the shadow as the protocol orders them. After every operation each live
sequence must read back, in every group, its own tokens at every position a query at its computed count
still attends to; every refused call must leave `snapshot()` unchanged; `check_invariants()` runs every
16 operations and at the end of each episode, where every block must be free again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from pagedkv.core.errors import CapacityError, InvalidArgumentError
from pagedkv.core.group import KVGroupSpec
from pagedkv.core.hybrid import HybridKVManager

EPISODE_OPS = 400
CHECK_EVERY = 16


@dataclass
class HybridSoakResult:
    ops: int
    seed: int
    episodes: int
    seconds: float
    violations: int = 0
    message: str = ""


class _Violation(Exception):
    pass


class _Episode:
    """One manager, its shadow KV and its live sequences."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.bs = int(rng.choice([1, 2, 4, 16]))
        groups = [KVGroupSpec()] + [
            KVGroupSpec(str(rng.choice(["sliding", "chunked"])), int(rng.integers(2, 41)))  # type: ignore[arg-type]
            for _ in range(int(rng.integers(1, 4)))
        ]
        self.m = HybridKVManager(int(rng.integers(24, 257)), self.bs, groups, num_host_blocks=64, record_events=True)
        self.prefixes = [rng.integers(1, 4, int(rng.integers(4, 60))).tolist() for _ in range(3)]
        self.kv: dict[int, tuple[int, int]] = {}
        self.host: dict[int, tuple[int, int]] = {}
        self.tokens: dict[int, list[int]] = {}

    def live(self) -> list[int]:
        return [s for s in self.tokens if not self.m.is_swapped(s)]

    def copies(self) -> None:
        src, dst = self.m.take_copies()
        moved = {d * self.bs + o: self.kv[s * self.bs + o] for s, d in zip(src.tolist(), dst.tolist())
                 for o in range(self.bs) if s * self.bs + o in self.kv}  # fmt: skip
        self.kv.update(moved)

    def read_back(self, s: int) -> None:
        c = self.m.num_computed_tokens(s)
        for g, spec in enumerate(self.m.groups):
            lo = spec.first_needed(c)
            if lo < c:
                got = [self.kv.get(x) for x in self.m.slot_mapping([s], [lo], [c], group=g).tolist()]
                want = [(p, self.tokens[s][p]) for p in range(lo, c)]
                if got != want:
                    raise _Violation(f"sequence {s} reads other KV in group {g} ({spec.label()})")

    def refused(self, before: tuple[object, ...], what: str) -> None:
        if self.m.snapshot() != before:
            raise _Violation(f"a refused {what} changed state")

    def step(self) -> None:
        op = self.rng.choice(["admit", "compute", "compute", "append", "fork", "rollback", "free", "swap", "reset"],
                             p=[0.2, 0.2, 0.2, 0.14, 0.06, 0.06, 0.08, 0.05, 0.01])  # fmt: skip
        getattr(self, f"op_{op}")()
        self.copies()
        for s in self.live():
            self.read_back(s)

    def op_admit(self) -> None:
        rng = self.rng
        prompt = self.prefixes[int(rng.integers(3))] + rng.integers(1, 4, int(rng.integers(0, 30))).tolist()
        before = self.m.snapshot()
        try:
            adm = self.m.admit(prompt, chunk_tokens=None if rng.random() < 0.3 else int(rng.integers(1, 24)))
        except CapacityError:
            return self.refused(before, "admission")
        if adm is None:
            return self.refused(before, "admission")
        self.tokens[adm.seq_id] = prompt
        return None

    def op_compute(self) -> None:
        live = self.live()
        if not live:
            return
        s = live[int(self.rng.integers(len(live)))]
        c = self.m.num_computed_tokens(s)
        end = min(c + int(self.rng.integers(1, 24)), len(self.tokens[s]))
        before = self.m.snapshot()
        if end == c or not self.m.reserve([s], [end]):
            return self.refused(before, "reserve") if end > c else None
        self.copies()
        for g in range(self.m.num_groups):
            for p, slot in zip(range(c, end), self.m.slot_mapping([s], [c], [end], group=g).tolist()):
                self.kv[slot] = (p, self.tokens[s][p])
        self.m.mark_computed([s], [end])
        return None

    def op_append(self) -> None:
        live = self.live()
        if not live:
            return
        batch = [s for s in live if self.rng.random() < 0.5] or live[:1]
        k, before = int(self.rng.integers(1, 4)), self.m.snapshot()
        new = self.rng.integers(1, 4, (len(batch), k))
        if self.m.append(batch, new, num_tokens=k):
            for s, row in zip(batch, new.tolist()):
                self.tokens[s] += row
        else:
            self.refused(before, "append")

    def op_fork(self) -> None:
        if live := self.live():
            s = live[int(self.rng.integers(len(live)))]
            self.tokens[self.m.fork(s)] = list(self.tokens[s])

    def op_rollback(self) -> None:
        if live := self.live():
            s = live[int(self.rng.integers(len(live)))]
            n, before = min(int(self.rng.integers(0, 8)), len(self.tokens[s])), self.m.snapshot()
            try:
                self.m.rollback(s, n)
            except InvalidArgumentError:
                return self.refused(before, "rollback")
            del self.tokens[s][len(self.tokens[s]) - n :]
        return None

    def op_free(self) -> None:
        if self.tokens:
            s = sorted(self.tokens)[int(self.rng.integers(len(self.tokens)))]
            self.m.free(s) if self.m.is_swapped(s) or self.rng.random() < 0.5 else self.m.preempt(s)
            del self.tokens[s]

    def op_swap(self) -> None:
        swapped = [s for s in self.tokens if self.m.is_swapped(s)]
        bs = self.bs
        if swapped and self.rng.random() < 0.5:
            if (plan := self.m.swap_in(swapped[0])) is not None:
                for h, d in zip(plan.src.tolist(), plan.dst.tolist()):
                    self.kv.update({d * bs + o: self.host[h * bs + o] for o in range(bs) if h * bs + o in self.host})
            return
        live = self.live()
        if live and (plan := self.m.swap_out(live[int(self.rng.integers(len(live)))])) is not None:
            for d, h in zip(plan.src.tolist(), plan.dst.tolist()):
                self.host.update({h * bs + o: self.kv.get(d * bs + o, (-1, -1)) for o in range(bs)})

    def op_reset(self) -> None:
        self.m.reset_prefix_cache()

    def finish(self) -> None:
        for s in list(self.tokens):
            self.m.free(s)
        self.m.take_copies()
        self.m.check_invariants()
        if self.m.num_used_blocks:
            raise _Violation(f"{self.m.num_used_blocks} blocks in use after every sequence was freed")


def run_hybrid_soak(ops: int, seed: int = 0) -> HybridSoakResult:
    """Run `ops` operations in episodes of `EPISODE_OPS`; stop at the first violation."""
    rng = np.random.default_rng(seed)
    start, done, episodes = time.perf_counter(), 0, 0
    result = HybridSoakResult(ops, seed, 0, 0.0)
    while done < ops:
        ep, episodes = _Episode(rng), episodes + 1
        try:
            for i in range(min(EPISODE_OPS, ops - done)):
                ep.step()
                if i % CHECK_EVERY == 0:
                    ep.m.check_invariants()
                done += 1
            ep.finish()
        except Exception as exc:  # a violation, a broken invariant, or an error a valid call must not raise
            result.violations, result.message = 1, f"episode {episodes}, op {done}: {type(exc).__name__}: {exc}"
            break
    result.episodes, result.seconds = episodes, time.perf_counter() - start
    return result
