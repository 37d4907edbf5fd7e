"""The computed verb of `HybridKVManager`: `mark_computed` publishes every group's newly full blocks, then
releases the blocks each windowed group's window has passed (the contract is in `hybrid.py`'s docstring).

Publishing is one backend call for the batch (`hotpath.Backend.publish_groups`: every group's computed
count, each row's keys chained once from its token ids, each group's new full blocks indexed under its own
keys); custom key functions and per-block extra keys take `_publish_generic`, the same rule over
`BlockKeys` in Python. Releasing visits only rows whose last releasable block is still held; rows that
pass one block this step (most) are handled with array operations, and the released blocks go back to the
pool in one call per priority (row by row only when a forked block repeats across rows).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from pagedkv.core.group_keys import group_key
from pagedkv.core.pool import NULL_BLOCK_ID, BlockPool
from pagedkv.core.validate import as_computed

if TYPE_CHECKING:
    from pagedkv.core import hotpath
    from pagedkv.core.group import KVGroupSpec
    from pagedkv.core.hybrid_state import SeqState
    from pagedkv.core.prefix import BlockKeys, Key
    from pagedkv.core.prefix_index import PrefixIndex
    from pagedkv.core.table import BlockTables
    from pagedkv.core.token_rows import TokenRows

IntArray = npt.NDArray[np.int64]
OUT_OF_WINDOW_PRIORITY = -(2**62)  # released as the window passed: evicted before anything else cached


class HybridPublish:
    """`mark_computed`, its publishing and the windowed release of `HybridKVManager`."""

    pool: BlockPool
    index: PrefixIndex
    tables: list[BlockTables]
    tokens: TokenRows
    seqs: dict[int, SeqState]
    evict_out_of_window_first: bool
    _block_size: int
    _hot: hotpath.Backend
    _kind: int | None
    _key_lists: list[list[Key] | None]
    _rows_with_extras: int
    _windowed: tuple[tuple[int, KVGroupSpec], ...]

    def _content_keys(self, tokens: npt.NDArray[np.int32], keys: BlockKeys, start: int, stop: int) -> list[Key]:
        raise NotImplementedError

    def mark_computed(self, seq_ids: npt.ArrayLike, num_computed_tokens: npt.ArrayLike | None = None) -> None:
        """KV is written for tokens [0, num_computed) of each sequence: publish the full blocks among them
        in every group, then release the blocks each windowed group no longer reads."""
        tables = self.tables
        rows = tables[0].rows(seq_ids)
        given: IntArray | None = None  # None: every token every group holds (the backend reads them)
        if num_computed_tokens is not None or self._windowed or self._kind is None or self._rows_with_extras:
            held = tables[0].num_tokens[rows] if len(tables) == 1 else np.min([t.num_tokens[rows] for t in tables], axis=0)
            given = held if num_computed_tokens is None else as_computed(num_computed_tokens, tables[0].num_computed[rows], held)
        if self._kind is None or self._rows_with_extras:
            assert given is not None, "hybrid manager: the generic path needs the computed counts"
            self._publish_generic(rows, given)
        else:
            before = [t.num_published[rows] for t in tables] if self.index.record_events else None
            stored = self._hot.publish_groups(
                self._kind, self.index.arrays, self._key_lists, rows, given, tuple(t.counts() for t in tables),
                self.tokens.ids, self._block_size,
            )  # fmt: skip
            self.index.stored(stored)
            if before is not None and stored:
                self._remember_origins(rows, before, stored)
        for g, spec in self._windowed:
            assert given is not None, "hybrid manager: windowed groups need the computed counts"
            self._release_passed(g, spec, rows, given)

    def _publish_generic(self, rows: IntArray, given: IntArray) -> None:
        """`hotpath.Backend.publish_groups` in Python over `BlockKeys` (custom key functions, per-block
        extra keys): the same counts, the same blocks indexed."""
        bs, tables = self._block_size, self.tables
        for t in tables:
            t.num_computed[rows] = given
        for r, c in zip(rows.tolist(), given.tolist()):
            full = min(c, int(tables[0].hashable_tokens[r])) // bs
            first = min(int(t.num_published[r]) for t in tables)
            if full <= first:
                continue
            keys = self.seqs[r].keys
            content = [] if keys is None else self._content_keys(self.tokens.of(r), keys, first, full)
            for g, t in enumerate(tables):
                start = int(t.num_published[r])
                if full <= start:
                    continue
                t.num_published[r] = full
                if keys is None:
                    continue
                ids = t.table[r, start:full].tolist()
                stored = self.index.insert([group_key(c, g) for c in content[start - first :]], ids)
                if stored:
                    self._remember_row(r, start, ids, set(stored))

    def _remember_origins(self, rows: IntArray, before: list[IntArray], stored: list[int]) -> None:
        """The parent keys and tokens of the blocks the backend just published (for the event feeds)."""
        new = set(stored)
        for g, t in enumerate(self.tables):
            after = t.num_published[rows]
            for r, start, stop in zip(rows.tolist(), before[g].tolist(), after.tolist()):
                if stop > start:
                    self._remember_row(r, start, t.table[r, start:stop].tolist(), new)

    def _remember_row(self, row: int, start: int, ids: list[int], stored: set[int]) -> None:
        """Blocks `ids` of row `row` from column `start` were published, those in `stored` indexed: their
        origins go to the index (`PrefixIndex.remember_origins`)."""
        keys = self.seqs[row].keys
        if keys is not None:
            bs = self._block_size
            tokens = self.tokens.of(row)[start * bs : (start + len(ids)) * bs].reshape(len(ids), bs)
            self.index.remember_origins(keys.keys, start, ids, tokens, stored)

    def _release_passed(self, g: int, spec: KVGroupSpec, rows: IntArray, computed: IntArray) -> None:
        """Release windowed group g's blocks no query at or after each row's computed count reads. Those
        that can serve a hit near the prompt's end (`_keeps_for_hits`) keep the sequence's priority; the
        rest go to the front of the eviction order (`OUT_OF_WINDOW_PRIORITY`), oldest first. Only rows whose
        last releasable block is still held (released entries are the leading null ones) are visited."""
        bs, t = self._block_size, self.tables[g]
        upto = np.minimum(spec.releasable_blocks(computed, bs), t.num_blocks[rows])
        todo = (upto > 0) & (t.table[rows, np.maximum(upto - 1, 0)] != NULL_BLOCK_ID)
        if not todo.any():
            return
        rows, upto = rows[todo], upto[todo]
        # most rows pass one block a step: the one before it is released (null) or there is none
        one = (upto == 1) | (t.table[rows, np.maximum(upto - 2, 0)] == NULL_BLOCK_ID)
        pieces: list[tuple[IntArray, IntArray, int]] = []  # per row: (out of window, kept for hits, priority)
        if one.any():
            pieces += self._release_one_each(g, spec, rows[one], upto[one])
            rows, upto = rows[~one], upto[~one]
        for row, stop in zip(rows.tolist(), upto.tolist()):
            seq = self.seqs[row]
            lo = seq.released[g]
            blocks = t.table[row, lo:stop].astype(np.int64)
            t.table[row, lo:stop] = NULL_BLOCK_ID
            seq.released[g] = stop
            t.num_published[row] = max(int(t.num_published[row]), stop)
            # block j keeps the priority iff (j + 1) * bs > prompt_len - keeps, i.e. j >= that // bs
            split = 0
            if self.evict_out_of_window_first:
                split = min(max((seq.prompt_len - self._keeps_for_hits(spec)) // bs - lo, 0), stop - lo)
            pieces.append((blocks[:split], blocks[split:], seq.priority))
        if pieces:
            self._release_pieces(pieces)

    def _release_one_each(
        self, g: int, spec: KVGroupSpec, rows: IntArray, upto: IntArray
    ) -> list[tuple[IntArray, IntArray, int]]:
        """`_release_passed` for rows that each release exactly block `upto - 1`, batched: their pieces (out
        of window, kept, priority), one per priority present (one per row if a block repeats: a piece never
        holds a block twice)."""
        t, bs, seqs = self.tables[g], self._block_size, self.seqs
        cols = upto - 1
        blocks = t.table[rows, cols].astype(np.int64)
        t.table[rows, cols] = NULL_BLOCK_ID
        t.num_published[rows] = np.maximum(t.num_published[rows], upto)
        states = [seqs[r] for r in rows.tolist()]
        for seq, stop in zip(states, upto.tolist()):
            seq.released[g] = stop
        priority = np.array([seq.priority for seq in states], dtype=np.int64)
        if self.evict_out_of_window_first:  # the block keeps its priority iff cols >= (prompt_len - keeps) // bs
            first_kept = (np.array([seq.prompt_len for seq in states], dtype=np.int64) - self._keeps_for_hits(spec)) // bs
            kept = cols >= first_kept
        else:
            kept = np.ones(len(rows), dtype=bool)
        if len(np.unique(blocks)) < len(blocks):  # a forked block passed in two rows: a piece per row
            return [(blocks[i : i + 1][~kept[i : i + 1]], blocks[i : i + 1][kept[i : i + 1]], int(priority[i]))
                    for i in range(len(blocks))]  # fmt: skip
        pieces = []
        for p in np.unique(priority).tolist():
            mine = priority == p
            pieces.append((blocks[mine & ~kept], blocks[mine & kept], p))
        return pieces

    def _release_pieces(self, pieces: list[tuple[IntArray, IntArray, int]]) -> None:
        """Release each row's (out of window, kept) blocks: one pool call per priority when no block repeats
        across rows (a block forked into two rows may; then row by row). Each priority's blocks reach the
        eviction order in row order either way."""
        release = self.pool.release
        if len(pieces) > 1:
            everything = np.concatenate([b for drop, keep, _ in pieces for b in (drop, keep)])
            if len(np.unique(everything)) == len(everything):
                drops = [drop for drop, _, _ in pieces if len(drop)]
                if drops:
                    release(np.concatenate(drops), OUT_OF_WINDOW_PRIORITY)
                by_priority: dict[int, list[IntArray]] = {}
                for _, keep, priority in pieces:
                    if len(keep):
                        by_priority.setdefault(priority, []).append(keep)
                for priority, kept in by_priority.items():
                    release(np.concatenate(kept), priority)
                return
        for drop, keep, priority in pieces:
            if len(drop):
                release(drop, OUT_OF_WINDOW_PRIORITY)
            if len(keep):
                release(keep, priority)

    @staticmethod
    def _keeps_for_hits(spec: KVGroupSpec) -> int:
        """Tokens before the prompt's end whose windowed blocks keep their priority when released: two
        windows, so a prompt re-sent with a new suffix (diverging up to a window before the end) still
        finds the window before its hit point."""
        return 2 * (spec.window or 0)
