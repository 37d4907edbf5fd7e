"""The growth verbs of `HybridKVManager`: slots for tokens before they are computed, in every group.

`reserve` gives slots to tokens a sequence already has (the next prefill chunk: windowed groups hold only
what the window and the chunk need); `append` adds tokens and their slots (decode). Both are all or
nothing, and both keep the rule of `manager.py`: a writer that shares its partial last block moves to a
copy first (copies are handed out by `take_copies`, both ends held until then), and a block written in
place loses its key.

A decode step's `append`, when no row may write into a shared block and every group holds every token
(the common case), runs the uniform manager's two backend loops per group (`hotpath.Backend.growth` to
count, `grow` to write the new blocks), and writes the tokens into `TokenRows` in one numpy call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from pagedkv.core import hotpath
from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.manager import _writers_to_move
from pagedkv.core.pool import BlockPool
from pagedkv.core.validate import as_count, as_index_array, as_token_matrix

if TYPE_CHECKING:
    from pagedkv.core.copies import CopyLedger
    from pagedkv.core.group import KVGroupSpec
    from pagedkv.core.hybrid_state import SeqState
    from pagedkv.core.table import BlockTables
    from pagedkv.core.token_rows import TokenRows

IntArray = npt.NDArray[np.int64]
_EMPTY = np.zeros(0, dtype=np.int64)


class HybridGrowth:
    """`reserve`, `append`, copy-on-write and `take_copies` of `HybridKVManager`."""

    pool: BlockPool
    tables: list[BlockTables]
    tokens: TokenRows
    seqs: dict[int, SeqState]
    group_of: IntArray
    _block_size: int
    _hot: hotpath.Backend
    _windowed: tuple[tuple[int, KVGroupSpec], ...]
    copies: CopyLedger
    _cow_copies: int

    @property
    def capacity_tokens(self) -> int:
        raise NotImplementedError

    def _growth(self, rows: IntArray, ends: IntArray) -> tuple[list[IntArray], list[tuple[IntArray, IntArray, IntArray]]]:
        """Per group: new blocks per row to give tokens [held, ends) slots, and (rows that must copy their
        shared partial last block first, those blocks, blocks written in place that lose their key)."""
        bs = self._block_size
        needs, cows = [], []
        for t in self.tables:
            held = t.num_tokens[rows]
            needs.append(np.maximum(-(-ends // bs) - t.num_blocks[rows], 0))
            cow: tuple[IntArray, IntArray, IntArray] = (_EMPTY, _EMPTY, _EMPTY)
            if t.any_cow_risk and t.cow_risk.any():
                risky = t.cow_risk[rows] & (held % bs != 0) & (ends > held)
                if risky.any():
                    cand = rows[risky]
                    src = t.table[cand, (t.num_tokens[cand] - 1) // bs].astype(np.int64)
                    move = self.pool.ref[src] > 1
                    move[move] = _writers_to_move(cand[move], src[move], self.pool.ref)
                    cow = (cand[move], src[move], src[~move])
            cows.append(cow)
        return needs, cows

    def _blocks_for(self, rows: IntArray, ends: IntArray) -> int:
        needs, cows = self._growth(rows, ends)
        return sum(int(x.sum()) for x in needs) + sum(len(c[0]) for c in cows)

    def num_blocks_to_append(self, seq_ids: npt.ArrayLike, num_tokens: int = 1) -> int:
        rows = self.tables[0].rows(seq_ids)
        k = as_count(num_tokens, "num_tokens")
        return self._blocks_for(rows, self._lengths(rows) + k)

    def num_blocks_to_reserve(self, seq_ids: npt.ArrayLike, ends: npt.ArrayLike) -> int:
        rows = self.tables[0].rows(seq_ids)
        return self._blocks_for(rows, self._checked_ends(rows, ends))

    def _lengths(self, rows: IntArray) -> IntArray:
        return self.tokens.length[rows]

    def _checked_ends(self, rows: IntArray, ends: npt.ArrayLike) -> IntArray:
        ends_a = as_index_array(ends, "ends", rows.shape)
        lengths = self._lengths(rows)
        if (ends_a > lengths).any():
            raise InvalidArgumentError("reserve: an end lies past the sequence's tokens; append tokens first")
        # a chunk ending one short of the tokens leaves the last one to a decode step, which takes no
        # reservation: give it its slot now
        out: IntArray = np.where(ends_a == lengths - 1, lengths, ends_a)
        return out

    def reserve(self, seq_ids: npt.ArrayLike, ends: npt.ArrayLike) -> bool:
        """Give tokens up to `ends[i]` (at most the sequence's tokens) slots in every group before they are
        computed. False (nothing changed) if the pool is short."""
        rows = self.tables[0].rows(seq_ids)
        return self._grow(rows, self._checked_ends(rows, ends))

    def append(self, seq_ids: npt.ArrayLike, token_ids: npt.ArrayLike | None = None, num_tokens: int = 1) -> bool:
        """Grow each sequence by `num_tokens` tokens with slots in every group. False (nothing changed) if
        the pool is short. Without token ids the blocks they fill are never published."""
        rows = self.tables[0].rows(seq_ids)
        k = as_count(num_tokens, "num_tokens")
        tok = as_token_matrix(token_ids, len(rows), k) if token_ids is not None else None
        if k > self.capacity_tokens:
            return False
        if len(rows) == 0 or k == 0:
            return True
        lengths = self._lengths(rows)
        if self._in_step(rows, lengths):
            if not self._grow_in_step(rows, k):
                return False
        elif not self._grow(rows, lengths + k):
            return False
        if tok is None:
            for t in self.tables:
                t.hashable_tokens[rows] = np.minimum(t.hashable_tokens[rows], lengths)
        self.tokens.append(rows, lengths, tok, k)
        return True

    def _in_step(self, rows: IntArray, lengths: IntArray) -> bool:
        """Whether every group holds every token of `rows` (a full group always does) and none may write
        into a shared block."""
        return not any(t.any_cow_risk and t.cow_risk.any() for t in self.tables) and all(
            bool((self.tables[g].num_tokens[rows] == lengths).all()) for g, _ in self._windowed
        )

    def _grow_in_step(self, rows: IntArray, k: int) -> bool:
        """`_grow` when `_in_step`: the backend's `growth` and `grow` per group (no copy-on-write)."""
        bs, hot, tables = self._block_size, self._hot, self.tables
        counts = [hot.growth(rows, t.num_tokens, t.num_blocks, k, bs) for t in tables]
        total = sum(n for n, _ in counts)
        if total > self.pool.num_available:
            return False
        # --- commit ---
        ids = self.pool.allocate(total) if total else _EMPTY
        at = 0
        for g, (t, (n, width)) in enumerate(zip(tables, counts)):
            mine = ids[at : at + n]
            at += n
            if n:
                self.group_of[mine] = g
            t.ensure_cols(width)
            hot.grow(rows, t.num_tokens, t.num_blocks, t.table, k, bs, mine, None, None)
        return True

    def _grow(self, rows: IntArray, ends: IntArray) -> bool:
        needs, cows = self._growth(rows, ends)
        total = sum(int(x.sum()) for x in needs) + sum(len(c[0]) for c in cows)
        if total > self.pool.num_available:
            return False
        # --- commit ---
        ids = self.pool.allocate(total) if total else _EMPTY
        bs = self._block_size
        for g, t in enumerate(self.tables):
            cow_rows, cow_src, in_place = cows[g]
            if len(cow_rows):
                dst, ids = ids[: len(cow_rows)], ids[len(cow_rows) :]
                self.group_of[dst] = g
                t.table[cow_rows, (t.num_tokens[cow_rows] - 1) // bs] = dst
                self._copy_on_write(cow_src, dst)
            for block_id in in_place.tolist():  # written in place: it loses its key
                self.pool.prefix_index.remove(block_id)
            grow = ends > t.num_tokens[rows]
            t.cow_risk[rows[grow]] = False
            t.any_cow_risk = bool(t.cow_risk.any())
            some = needs[g] > 0
            for r, need in zip(rows[some].tolist(), needs[g][some].tolist()):
                mine, ids = ids[:need], ids[need:]
                self.group_of[mine] = g
                t.set_blocks(r, np.concatenate([t.blocks_of(r), mine]))
            t.num_tokens[rows] = np.maximum(t.num_tokens[rows], ends)  # rows are distinct sequences
        return True

    def _copy_on_write(self, src: IntArray, dst: IntArray) -> None:
        """Record copies src -> dst (a writer moved off shared blocks); both ends held until `take_copies`."""
        self.pool.unshare(src)
        self.copies.record(src, dst)
        self._cow_copies += len(dst)
