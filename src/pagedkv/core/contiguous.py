"""The contiguous baseline: what serving systems did before paging (FasterTransformer, Orca).

Each request reserves its maximum length (prompt + max_new_tokens) at admission as one contiguous run of
the KV arena, chosen first fit, and holds it until it finishes. Runs are whole blocks (so the same block
tables and attention kernels read it), which makes its block table `start, start+1, ...`. Nothing is shared.

Its waste is what paging removes: internal (reserved but never written: the unused tail of every
reservation) and external (free space split into holes too small for the next request: first fit makes
it real). It speaks the same protocol as `PagedKVManager`, so every comparison swaps only the allocator.
A sequence that outgrows its reservation cannot grow (`append` returns False): the scheduler preempts it.
"""

from __future__ import annotations

import bisect

import numpy as np
import numpy.typing as npt

from pagedkv.core.errors import CapacityError, InvariantError, NotSupportedError
from pagedkv.core.prefix import BlockKeys
from pagedkv.core.prefix_index import CacheEvent
from pagedkv.core.protocol import Admission, BlockFill, BlockMoves, BlockSource, ManagerStats
from pagedkv.core.table import BlockTables, TableViews
from pagedkv.core.validate import (
    as_admission,
    as_computed,
    as_count,
    as_flag,
    as_keys,
    as_pool_size,
    as_rollback,
    as_salt,
    as_token_matrix,
    as_tokens,
)

IntArray = npt.NDArray[np.int64]
_EMPTY = np.zeros(0, dtype=np.int64)


class RunAllocator:
    """First-fit allocation of contiguous runs of blocks; holes kept sorted and merged on free."""

    def __init__(self, first: int, end: int) -> None:
        self.first, self.end = first, end
        self._starts: list[int] = [first] if end > first else []
        self._lengths: list[int] = [end - first] if end > first else []
        self.num_free = end - first

    def find(self, n: int) -> int | None:
        for i, length in enumerate(self._lengths):
            if length >= n:
                return i
        return None

    def take(self, hole: int, n: int) -> int:
        start = self._starts[hole]
        if self._lengths[hole] == n:
            del self._starts[hole], self._lengths[hole]
        else:
            self._starts[hole] += n
            self._lengths[hole] -= n
        self.num_free -= n
        return start

    def give(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        merge_left = i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start
        merge_right = i < len(self._starts) and start + n == self._starts[i]
        if merge_left and merge_right:
            self._lengths[i - 1] += n + self._lengths[i]
            del self._starts[i], self._lengths[i]
        elif merge_left:
            self._lengths[i - 1] += n
        elif merge_right:
            self._starts[i] = start
            self._lengths[i] += n
        else:
            self._starts.insert(i, start)
            self._lengths.insert(i, n)
        self.num_free += n

    def holes(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._lengths))


class ContiguousKVManager(TableViews):
    def __init__(self, num_blocks: int, block_size: int = 16, *, null_block: bool = True) -> None:
        first = 1 if as_flag(null_block, "null_block") else 0
        num_blocks, block_size = as_pool_size(num_blocks, block_size, minimum=first + 1)
        self._block_size = block_size
        self._num_blocks = num_blocks - first
        self.runs = RunAllocator(first, num_blocks)
        self.tables = BlockTables(block_size, 0)
        self._admissions = self._preemptions = self._prompt_tokens = 0
        self._pending: dict[int, int] = {}  # destination block of a copy not handed out yet -> its source
        self._epoch = 0

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.runs.num_free

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - self.runs.num_free

    @property
    def stats(self) -> ManagerStats:
        """The paged manager's counters; nothing is cached, evicted or copied on write here."""
        return ManagerStats(
            self._admissions, self._preemptions, self._prompt_tokens, 0, 0, 0, 0, self.num_used_blocks,
            self._num_blocks,
        )  # fmt: skip

    @property
    def supports_swap(self) -> bool:
        return False

    @property
    def hot_path(self) -> str:
        """"-": no per-element loops (a run is reserved whole)."""
        return "-"

    # --- no prefix cache: nothing to report, forget or count -------------------------------------

    @property
    def records_events(self) -> bool:
        return False

    @property
    def grouped_events(self) -> bool:
        return False

    def take_events(self) -> list[CacheEvent]:
        return []

    @property
    def index(self) -> None:
        return None

    @property
    def misses(self) -> None:
        return None

    def count_tier_miss(self, seq_id: int, num_tokens: int) -> None:
        """Nothing to count: no admission here misses a cache."""
        self.tables.row(seq_id)
        as_count(num_tokens, "num_tokens")

    def reset_prefix_cache(self) -> int:
        return 0

    @property
    def epoch(self) -> int:
        return self._epoch

    def bump_epoch(self) -> int:
        """Nothing is cached to make unmatchable: only the epoch number moves, as the paged manager's does."""
        self._epoch += 1
        return self._epoch

    def swap_out(self, seq_id: int) -> BlockMoves | None:
        """Not supported: raises `NotSupportedError` (nothing changes); preempt by recompute instead."""
        raise NotSupportedError("the contiguous manager cannot swap; preempt by recompute (preemption_mode='recompute')")

    def swap_in(self, seq_id: int) -> BlockMoves | None:
        """Not supported: raises `NotSupportedError` (nothing changes)."""
        raise NotSupportedError("the contiguous manager cannot swap; preempt by recompute (preemption_mode='recompute')")

    def _reservation(self, n: int, max_new_tokens: int) -> int:
        return -(-(n + max_new_tokens) // self._block_size)

    def can_admit(self, token_ids: npt.ArrayLike, *, max_new_tokens: int = 0) -> bool:
        n = len(as_tokens(token_ids))
        return self.runs.find(self._reservation(n, as_count(max_new_tokens, "max_new_tokens"))) is not None

    def admit(
        self,
        token_ids: npt.ArrayLike,
        *,
        max_new_tokens: int = 0,
        priority: int = 0,
        salt: bytes = b"",
        num_lookahead: int = 0,
        keys: BlockKeys | None = None,
        keep_free: int = 0,
    ) -> Admission | None:
        """Reserve prompt + max_new_tokens (+ lookahead) contiguously, first fit. `None` if no hole fits or
        fewer than `keep_free` blocks would stay free."""
        tokens, max_new_tokens, num_lookahead, keep_free, priority = as_admission(
            token_ids, max_new_tokens, num_lookahead, keep_free, priority
        )
        n = len(tokens)
        need = self._reservation(n, max_new_tokens + num_lookahead)
        if need > self._num_blocks:
            raise CapacityError(f"a reservation of {need} blocks exceeds the {self._num_blocks} blocks of the arena")
        given = as_keys(keys, as_salt(salt), tokens)  # unused (nothing is shared) but checked alike
        if given is not None:
            given.remember(tokens)
        hole = self.runs.find(need) if self.runs.num_free - need >= keep_free else None
        if hole is None:
            return None
        start = self.runs.take(hole, need)
        row = self.tables.start_row(np.arange(start, start + need, dtype=np.int64), n, 0, 0, priority)
        self._admissions += 1
        self._prompt_tokens += n
        return Admission(row, 0)

    def num_blocks_to_append(self, seq_ids: npt.ArrayLike, num_tokens: int = 1) -> int:
        """0: growth stays inside the reservations and never takes a block from the pool (beyond a
        reservation `append` fails instead). The ids and count are checked as `append` checks them."""
        self.tables.rows(seq_ids)
        as_count(num_tokens, "num_tokens")
        return 0

    def append(self, seq_ids: npt.ArrayLike, token_ids: npt.ArrayLike | None = None, num_tokens: int = 1) -> bool:
        """Grow within the reservations. False (nothing changed) if any sequence would outgrow its run."""
        t = self.tables
        rows = t.rows(seq_ids)
        k = as_count(num_tokens, "num_tokens")
        if token_ids is not None:
            as_token_matrix(token_ids, len(rows), k)
        if k > self.capacity_tokens:
            return False
        new = t.num_tokens[rows] + k
        if (new > t.num_blocks[rows] * self._block_size).any():
            return False
        t.num_tokens[rows] = new
        return True

    def rollback(self, seq_id: int, num_tokens: int) -> None:
        """Drop the last `num_tokens` tokens (rejected speculative tokens); the reservation stays whole."""
        t = self.tables
        row = t.row(seq_id)
        t.truncate(row, as_rollback(num_tokens, int(t.num_tokens[row]), seq_id), t.blocks_of(row))

    def mark_computed(self, seq_ids: npt.ArrayLike, num_computed_tokens: npt.ArrayLike | None = None) -> None:
        t = self.tables
        rows = t.rows(seq_ids)
        given = None
        if num_computed_tokens is not None:
            given = as_computed(num_computed_tokens, t.num_computed[rows], t.num_tokens[rows])
        t.set_computed(rows, given)

    def free(self, seq_id: int) -> None:
        t = self.tables
        row = t.row(seq_id)
        start, n = int(t.table[row, 0]), int(t.num_blocks[row])
        for block_id in range(start, start + n):  # a copy into a freed run is moot (its blocks get reused)
            self._pending.pop(block_id, None)
        self.runs.give(start, n)
        t.drop_row(row)

    def preempt(self, seq_id: int) -> int:
        n = self.num_tokens(seq_id)
        self.free(seq_id)
        self._preemptions += 1
        return n

    def fork(self, seq_id: int) -> int | None:
        """No sharing in the baseline: a fork copies the whole reservation into a new run (None if none fits)."""
        t = self.tables
        row = t.row(seq_id)
        need = int(t.num_blocks[row])
        hole = self.runs.find(need)
        if hole is None:
            return None
        start = self.runs.take(hole, need)
        child = t.copy_row(row, np.arange(start, start + need, dtype=np.int64))
        pending = self._pending
        # a block still waiting for its own copy holds its source's KV: copy from that source. That source
        # may be a run freed since (fork, preempt the parent, fork again) and now the child's own block:
        # it already holds the KV, so no copy (never src == dst)
        src = [pending.get(b, b) for b in t.blocks_of(row).tolist()]
        pending.update((d, s) for d, s in zip(t.blocks_of(child).tolist(), src) if d != s)
        return child

    def fetch_blocks(
        self, seq_id: int, start: int, end: int, source: BlockSource, tag: object = None
    ) -> BlockFill | None:
        """The baseline keys no blocks (no prefix cache), so a tier never fills one: always None."""
        self.tables.row(seq_id)
        return None

    def take_copies(self) -> BlockMoves:
        """The fork copies since the last call, `src[i] -> dst[i]`, distinct destinations, never `src[i] ==
        dst[i]`, each live in the sequence it was copied for. Apply them as one batch (read every source, then write), after this
        step's other block moves (`protocol.py`)."""
        if not self._pending:
            return BlockMoves(_EMPTY, _EMPTY)
        dst = np.fromiter(self._pending.keys(), dtype=np.int64, count=len(self._pending))
        src = np.fromiter(self._pending.values(), dtype=np.int64, count=len(self._pending))
        self._pending = {}
        return BlockMoves(src, dst)

    def check_invariants(self) -> None:
        self.tables.check_invariants()
        if any(dst == src for dst, src in self._pending.items()):
            raise InvariantError("contiguous: a pending fork copy goes from a block onto itself")
        t = self.tables
        live = np.nonzero(t.alive)[0]
        runs = sorted((int(t.table[r, 0]), int(t.num_blocks[r])) for r in live)
        spans = sorted(runs + self.runs.holes())
        pos = self.runs.first
        for start, length in spans:
            if start != pos:
                raise InvariantError(f"contiguous: arena not tiled exactly at block {pos} (next span starts at {start})")
            pos += length
        if pos != self.runs.end:
            raise InvariantError("contiguous: runs and holes do not cover the arena")
        for r in live:
            blocks = t.blocks_of(int(r))
            if not np.array_equal(blocks, np.arange(blocks[0], blocks[0] + len(blocks))):
                raise InvariantError(f"contiguous: sequence {r} does not hold one contiguous run")
