"""Block tables: per-sequence page tables kept as rows of one numpy matrix, and the batch views.

Sequence ids are row indices (handed out and reused like file descriptors), so a batch of sequences is an
int array that indexes every per-sequence array directly: growing 256 sequences or building their padded
block table is a handful of numpy calls, with no Python loop over sequences or tokens.

Logical block j of a sequence holds tokens [j*block_size, (j+1)*block_size):

    tokens    | 0 ........ 15 | 16 ....... 31 | 32 .. 40 |         num_tokens = 41
    table[r]  |     b7        |     b2        |   b9     | pad pad  num_blocks[r] = 3 (+ lookahead)
    slot(t) = table[r, t // block_size] * block_size + t % block_size

Invariants: entries at column >= num_blocks[r] hold `pad_id`; num_blocks[r] >= ceil(num_tokens[r] / bs);
num_computed[r] <= num_tokens[r].

This module is the one writer of the per-row counts (`num_tokens`, `num_computed`, `num_published`,
`hashable_tokens`) over a row's life: `start_row` (admission), `copy_row` (fork), `truncate` (rollback),
`move_row` (swap), `forget_token_ids`, `set_computed` (a manager that publishes nothing) and `drop_row`.
The one rule that advances `num_computed` and `num_published` as KV is written and blocks are published
is `hotpath.Backend.publish_computed` (its Python specification, mirrored once in C), which takes these
arrays as one value, `counts()`; growth's `hotpath.Backend.grow` advances `num_tokens` and `num_blocks`.
tests/core/test_prefix_index.py records every write to them at run time, through any alias.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from pagedkv.core import hotpath
from pagedkv.core.errors import InvalidArgumentError, InvariantError, UnknownSequenceError
from pagedkv.core.protocol import CSRPages
from pagedkv.core.validate import as_index_array, as_pad_id

IntArray = npt.NDArray[np.int64]
ALL_TOKENS_KNOWN = 2**62  # `hashable_tokens` while every appended token came with its id (prefix caching on)


class BlockTables:
    _ROW_ARRAYS = (
        "num_blocks", "num_tokens", "num_computed", "alive",
        "num_published", "hashable_tokens", "priority", "cow_risk", "swapped", "on_device",
    )

    def __init__(
        self, block_size: int, pad_id: int, *, rows: int = 64, cols: int = 16, native: bool | None = None,
        hashing: bool = False,
    ) -> None:  # fmt: skip
        self.block_size = block_size
        self.pad_id = pad_id
        # `hashable_tokens` of a row whose token ids are all known: 0 when nothing is ever hashed, so the
        # publishing rule finds no full block to publish (a manager without prefix caching)
        self.all_known = ALL_TOKENS_KNOWN if hashing else 0
        self.table = np.full((rows, cols), pad_id, dtype=np.int32)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self.num_tokens = np.zeros(rows, dtype=np.int64)
        self.num_computed = np.zeros(rows, dtype=np.int64)
        self.alive = np.zeros(rows, dtype=bool)
        # Prefix-cache and scheduling state per sequence (used by the paged manager).
        self.num_published = np.zeros(rows, dtype=np.int64)  # leading blocks whose key is settled
        self.hashable_tokens = np.zeros(rows, dtype=np.int64)  # ids of tokens [0, n) are known
        self.priority = np.zeros(rows, dtype=np.int64)
        self.cow_risk = np.zeros(rows, dtype=bool)  # the last partial block may be shared
        self.any_cow_risk = False  # False: no row has cow_risk (True may be stale: then check the array)
        self.swapped = np.zeros(rows, dtype=bool)  # the table holds host block ids
        self.on_device = np.zeros(rows, dtype=bool)  # alive and not swapped: batch views allowed
        self._free_rows = list(range(rows - 1, -1, -1))
        self._mark = np.zeros(rows, dtype=np.int64)  # scratch of `check_rows`
        self._check_rows = hotpath.backend(native).check_rows
        self.num_alive = 0

    # --- rows -----------------------------------------------------------------------------------

    def new_row(self) -> int:
        if not self._free_rows:
            old = len(self.alive)
            self._resize_rows(2 * old)
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        row = self._free_rows.pop()
        self.alive[row] = self.on_device[row] = True
        self.num_alive += 1
        return row

    def start_row(self, block_ids: IntArray, num_tokens: int, num_computed: int, num_published: int, priority: int) -> int:
        """A new row holding `block_ids` for `num_tokens` tokens, the first `num_computed` computed and the
        first `num_published` blocks published (admission: its prefix hits)."""
        row = self.new_row()
        self.set_blocks(row, block_ids)
        self.num_tokens[row] = num_tokens
        self.num_computed[row] = num_computed
        self.num_published[row] = num_published
        self.priority[row] = priority
        self.hashable_tokens[row] = self.all_known
        return row

    def copy_row(self, row: int, block_ids: IntArray) -> int:
        """A new row with `row`'s counts and priority, holding `block_ids` (a fork)."""
        child = self.new_row()
        self.set_blocks(child, block_ids)
        for name in ("num_tokens", "num_computed", "num_published", "hashable_tokens", "priority"):
            arr = getattr(self, name)
            arr[child] = arr[row]
        return child

    def truncate(self, row: int, num_tokens: int, block_ids: IntArray) -> None:
        """Keep the first `num_tokens` tokens of `row` in `block_ids` (rollback): nothing past them stays
        computed or published, and the token ids left are all known again if the unknown ones were dropped."""
        self.set_blocks(row, block_ids)
        self.num_tokens[row] = num_tokens
        self.num_computed[row] = min(int(self.num_computed[row]), num_tokens)
        self.num_published[row] = min(int(self.num_published[row]), num_tokens // self.block_size)
        if self.hashable_tokens[row] >= num_tokens:
            self.hashable_tokens[row] = self.all_known

    def move_row(self, row: int, block_ids: IntArray, *, to_host: bool) -> None:
        """`row` now holds `block_ids` in host memory (`to_host`) or on the device (swap). Swapped out, it
        shares nothing and has published nothing: swapped back in, its fresh blocks are published again."""
        self.set_blocks(row, block_ids)
        self.swapped[row] = to_host
        self.on_device[row] = not to_host
        if to_host:
            self.cow_risk[row] = False
            self.num_published[row] = 0

    def forget_token_ids(self, rows: IntArray) -> None:
        """The rows' next tokens come without ids: only their tokens so far can be hashed."""
        self.hashable_tokens[rows] = np.minimum(self.hashable_tokens[rows], self.num_tokens[rows])

    def set_computed(self, rows: IntArray, computed: IntArray | None) -> None:
        """KV is written for tokens [0, computed) (all tokens when None), for a manager that publishes
        nothing (one with publishing goes through `hotpath.Backend.publish_computed`)."""
        self.num_computed[rows] = self.num_tokens[rows] if computed is None else computed

    def counts(self) -> hotpath.TableArrays:
        """The arrays `hotpath.Backend.publish_computed` reads and advances, as one value (rebuilt per call:
        a resize replaces the arrays)."""
        return hotpath.TableArrays(self.num_tokens, self.num_computed, self.hashable_tokens, self.num_published, self.table)

    def drop_row(self, row: int) -> None:
        n = int(self.num_blocks[row])
        self.table[row, :n] = self.pad_id
        self.num_blocks[row] = self.num_tokens[row] = self.num_computed[row] = 0
        self.num_published[row] = self.hashable_tokens[row] = self.priority[row] = 0
        self.cow_risk[row] = self.swapped[row] = self.on_device[row] = False
        self.alive[row] = False
        self.num_alive -= 1
        self._free_rows.append(row)

    def _resize_rows(self, rows: int) -> None:
        old = len(self.alive)
        table = np.full((rows, self.table.shape[1]), self.pad_id, dtype=np.int32)
        table[:old] = self.table
        self.table = table
        for name in self._ROW_ARRAYS:
            arr = getattr(self, name)
            grown = np.zeros(rows, dtype=arr.dtype)
            grown[:old] = arr
            setattr(self, name, grown)
        self._mark = np.zeros(rows, dtype=np.int64)

    def ensure_cols(self, cols: int) -> None:
        if cols > self.table.shape[1]:
            new_cols = max(cols, 2 * self.table.shape[1])
            table = np.full((len(self.alive), new_cols), self.pad_id, dtype=np.int32)
            table[:, : self.table.shape[1]] = self.table
            self.table = table

    def row(self, seq_id: int) -> int:
        """Validate a single sequence handle."""
        if not isinstance(seq_id, int | np.integer) or isinstance(seq_id, bool):
            raise InvalidArgumentError(f"sequence id must be an int, got {type(seq_id).__name__}")
        if not (0 <= seq_id < len(self.alive)) or not self.alive[seq_id]:
            raise UnknownSequenceError(f"sequence {seq_id} is not live (never admitted, or already freed)")
        return int(seq_id)

    def device_row(self, seq_id: int) -> int:
        """Validate a single sequence handle that must be on the device (not swapped out)."""
        row = self.row(seq_id)
        if self.swapped[row]:
            raise InvalidArgumentError(f"sequence {seq_id} is swapped out; swap_in first")
        return row

    def rows(self, seq_ids: npt.ArrayLike) -> IntArray:
        """Validate a batch of sequence handles: live, on the device (not swapped out), distinct, ints."""
        rows = np.asarray(seq_ids)
        if rows.ndim != 1 or (rows.size and rows.dtype.kind not in "iu"):
            raise InvalidArgumentError(f"seq_ids must be a 1-D array of ints, got shape {rows.shape}, {rows.dtype}")
        given = rows
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        status = self._check_rows(self.on_device, self._mark, rows)  # one pass: range, device, duplicates
        if status == 1:
            if given.dtype == np.uint64 and int(given.max()) >= 2**63:  # wrapped negative above
                raise InvalidArgumentError(f"seq_ids must be sequence handles (small ints), got {int(given.max())}")
            bad = [int(r) for r in rows if not (0 <= r < len(self.alive)) or not self.alive[r]]
            if bad:
                raise UnknownSequenceError(f"sequences {bad[:8]} are not live (never admitted, or already freed)")
            raise InvalidArgumentError(f"sequences {rows[self.swapped[rows]][:8].tolist()} are swapped out; swap_in first")
        if status == 2:
            raise InvalidArgumentError("seq_ids has duplicates; each sequence may appear once per call")
        return rows

    def blocks_of(self, row: int, *, tail_first: bool = False) -> IntArray:
        """The row's block ids as a new int64 array, in order or (`tail_first`) reversed, as `release` takes them."""
        blocks = self.table[row, : self.num_blocks[row]]
        return (blocks[::-1] if tail_first else blocks).astype(np.int64)

    def set_blocks(self, row: int, block_ids: IntArray) -> None:
        n = len(block_ids)
        self.ensure_cols(n)
        old = int(self.num_blocks[row])
        self.table[row, :n] = block_ids
        if old > n:
            self.table[row, n:old] = self.pad_id
        self.num_blocks[row] = n

    # --- batch views ----------------------------------------------------------------------------

    def block_table(self, rows: IntArray, pad_id: int | None = None) -> npt.NDArray[np.int32]:
        """Padded `[B, max_blocks]` int32 matrix (FlashAttention `block_table` style)."""
        width = int(self.num_blocks[rows].max()) if len(rows) else 0
        out = self.table[rows, :width]
        if pad_id is not None and pad_id != self.pad_id:
            out = np.where(np.arange(width) < self.num_blocks[rows, None], out, np.int32(pad_id))
        return np.ascontiguousarray(out, dtype=np.int32)

    def slot_mapping(self, rows: IntArray, starts: npt.ArrayLike, ends: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Slots of tokens [starts[i], ends[i]) of each sequence, concatenated in batch order."""
        starts_a = as_index_array(starts, "starts", rows.shape)
        ends_a = as_index_array(ends, "ends", rows.shape)
        lengths = ends_a - starts_a
        if (lengths < 0).any():
            raise InvalidArgumentError("slot_mapping needs 0 <= start <= end for every sequence")
        if (ends_a > self.num_blocks[rows] * self.block_size).any():
            raise InvalidArgumentError("slot_mapping: a range ends past the blocks the sequence holds; append first")
        total = int(lengths.sum())
        owner = np.repeat(rows, lengths)
        first = np.cumsum(lengths) - lengths
        pos = np.arange(total, dtype=np.int64) + np.repeat(starts_a - first, lengths)
        bs = self.block_size
        slots: npt.NDArray[np.int64] = self.table[owner, pos // bs].astype(np.int64) * bs + pos % bs
        return slots

    def csr(self, rows: IntArray) -> CSRPages:
        """FlashInfer-style pages covering each sequence's tokens."""
        bs = self.block_size
        tokens = self.num_tokens[rows]
        pages = -(-tokens // bs)
        indptr = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(pages, out=indptr[1:])
        width = int(pages.max()) if len(rows) else 0
        mask = np.arange(width) < pages[:, None]
        indices = self.table[rows, :width][mask].astype(np.int32)
        last = np.where(pages > 0, tokens - (pages - 1) * bs, 0).astype(np.int32)
        return CSRPages(indptr, indices, last)

    # --- checks ---------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        def fail(msg: str) -> None:
            raise InvariantError(f"block tables: {msg}")

        cols = np.arange(self.table.shape[1])
        live = self.alive
        if int(live.sum()) != self.num_alive:
            fail("live-row count disagrees with the live mask")
        need = -(-self.num_tokens // self.block_size)
        if (self.num_blocks[live] < need[live]).any():
            fail("a sequence holds fewer blocks than its tokens need")
        if (self.num_computed > self.num_tokens).any():
            fail("computed tokens exceed tokens")
        padding = cols >= self.num_blocks[:, None]
        if (self.table[padding] != self.pad_id).any():
            fail("a table entry past a sequence's blocks is not the pad id")
        if self.cow_risk.any() and not self.any_cow_risk:
            fail("a row may share its last block but the any-row flag is off")
        if not np.array_equal(self.on_device, live & ~self.swapped):
            fail("the on-device mask disagrees with alive and swapped")
        if (~live & ((self.num_blocks != 0) | (self.num_tokens != 0))).any():
            fail("a dead row holds blocks or tokens")


class TableViews:
    """The batch views both managers expose, read from their `BlockTables` (validated, no Python loops)."""

    tables: BlockTables

    @property
    def num_blocks(self) -> int:
        """Usable blocks (a null block excluded)."""
        raise NotImplementedError

    @property
    def block_size(self) -> int:
        return self.tables.block_size

    @property
    def capacity_tokens(self) -> int:
        """The most tokens one sequence can ever hold."""
        return self.num_blocks * self.tables.block_size

    @property
    def num_sequences(self) -> int:
        return self.tables.num_alive

    def num_tokens(self, seq_id: int) -> int:
        return int(self.tables.num_tokens[self.tables.row(seq_id)])

    @property
    def num_groups(self) -> int:
        """One table per sequence: one group."""
        return 1

    @property
    def reserves_chunks(self) -> bool:
        """False: admission and `append` give every token its slot, so `reserve` has nothing to do."""
        return False

    def reserve(self, seq_ids: npt.ArrayLike, ends: npt.ArrayLike) -> bool:
        """Every token up to `ends[i]` already has its slot: checks the arguments and returns True."""
        rows = self.tables.rows(seq_ids)
        if (as_index_array(ends, "ends", rows.shape) > self.tables.num_tokens[rows]).any():
            raise InvalidArgumentError("reserve: an end lies past the sequence's tokens; append tokens first")
        return True

    def block_ids(self, seq_id: int) -> list[int]:
        return self.tables.blocks_of(self.tables.row(seq_id)).tolist()  # type: ignore[no-any-return]

    def block_table(self, seq_ids: npt.ArrayLike, *, pad_id: int | None = None) -> npt.NDArray[np.int32]:
        return self.tables.block_table(self.tables.rows(seq_ids), as_pad_id(pad_id))

    def seq_lens(self, seq_ids: npt.ArrayLike) -> npt.NDArray[np.int32]:
        return self.tables.num_tokens[self.tables.rows(seq_ids)].astype(np.int32)

    def slot_mapping(self, seq_ids: npt.ArrayLike, starts: npt.ArrayLike, ends: npt.ArrayLike) -> npt.NDArray[np.int64]:
        return self.tables.slot_mapping(self.tables.rows(seq_ids), starts, ends)

    def csr(self, seq_ids: npt.ArrayLike) -> CSRPages:
        return self.tables.csr(self.tables.rows(seq_ids))
