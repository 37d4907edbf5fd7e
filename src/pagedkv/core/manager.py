"""The paged KV manager: the facade schedulers use (see `protocol.py` for the contract).

It composes the block pool (ownership, eviction, keys) with the block tables (per-sequence pages) and the
prefix keys. The semantics it keeps:

- On demand: `admit` allocates for the prompt only; `append` takes a block when a sequence crosses a block
  boundary. Nothing reserves for a maximum length.
- Prefix cache: at admission the prompt's full blocks are looked up in order until the first miss; the
  block holding the last prompt token is never served from cache (its logits must be computed). Full blocks
  are published when `mark_computed` says their KV is written, so a request admitted in the same step
  cannot hit them. A block computed twice concurrently stays private in its second copy (see `prefix_index.py`).
- Partial reuse (`partial_reuse=True`): a prompt whose first missing block shares leading tokens with a
  cached block after the same parent gets a fresh block recorded as a copy of it (a pending copy, handed out
  by `take_copies`) and those tokens count as cached and computed; eviction order is the pool's policy.
- Free and preempt release blocks tail first: the shared head of a prompt outlives its private tail.
- Fork shares every block that holds tokens; the first write into a shared partial block moves the writer
  to a fresh block and records a copy, handed out by `take_copies`.
- Rollback releases blocks no longer needed and unpublishes a keyed block whose content will change.
- Atomic: every method validates (`validate.py`, shared with the contiguous manager) and checks capacity
  before it changes anything.

The one rule that keeps the prefix cache honest: **a block is written in place only when its writer is its
sole holder and it has no key.** `append` enforces it at the only place KV is written into an existing
block (the partial last block of a sequence): a writer that shares the block moves to a copy, and the block
a writer keeps loses its key first. Whatever the order of fork, rollback, append, preempt, swap and free,
a block someone may write into is therefore never reachable through the prefix index, and
`check_invariants` checks it (a keyed block partial in a sequence must be marked copy-before-write, and an
unmarked sequence's partial last block is private).

Pending copies (see `protocol.py` for the order of block moves): the source and destination of a copy not
yet handed out by `take_copies` are held (one reference each) until it is, so no swap-in or later copy can
reuse them; a copy whose source is itself a pending destination copies from that one's source instead; a
swap-out of a sequence whose block is a pending destination reads the copy's source, which holds the same
KV until the next forward pass.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from pagedkv.core.copies import CopyLedger, PinHandle, PoolQueries, check_references
from pagedkv.core.errors import CapacityError, InvalidArgumentError, InvariantError, PinError
from pagedkv.core.eviction import EvictionPolicy
from pagedkv.core.misses import MissCounter
from pagedkv.core.pool import NULL_BLOCK_ID, BlockPool
from pagedkv.core.prefix import BlockKeys, KeyFunction, key_function
from pagedkv.core.prefix_cache import PrefixCache
from pagedkv.core.prefix_index import CacheEvent, PrefixIndex
from pagedkv.core.protocol import Admission, BlockFill, BlockSource, ManagerStats
from pagedkv.core.swap import SwapMixin
from pagedkv.core.table import BlockTables, TableViews
from pagedkv.core.validate import (
    as_admission,
    as_computed,
    as_count,
    as_flag,
    as_native,
    as_pool_size,
    as_rollback,
    as_token_matrix,
    as_tokens,
    request_keys,
)

IntArray = npt.NDArray[np.int64]
_EMPTY = np.zeros(0, dtype=np.int64)
PARTIAL_REUSE_MIN_TOKENS = 1  # a block copy costs less than recomputing one token (docs/cache-policy.md)


# What the cache holds of a prompt: (hits, src, reuse): its full-block hits, and a block to copy `reuse`
# tokens from (partial reuse; src -1 and reuse 0 when none). A plain tuple: built on every admission, where
# a NamedTuple's constructor is one more Python call.
_Lookup = tuple[IntArray, int, int]
_NO_LOOKUP: _Lookup = (_EMPTY, -1, 0)


def _writers_to_move(rows: IntArray, src: IntArray, ref: npt.NDArray[np.int32]) -> npt.NDArray[np.bool_]:
    """Of the rows about to write into shared blocks, those that must move to a copy (a mask).

    Every writer copies, except when all holders of a block write in the same batch: then the last of
    them (in batch order) keeps the original, since nobody else would ever read it (the caller then
    unpublishes it: it is written in place).
    """
    if len(src) == 0:
        return np.zeros(0, dtype=bool)
    order = np.argsort(src, kind="stable")
    sorted_src = src[order]
    rank = np.empty(len(src), dtype=np.int64)
    rank[order] = np.arange(len(src)) - np.searchsorted(sorted_src, sorted_src, side="left")
    counts = np.bincount(np.searchsorted(sorted_src, src, side="left"), minlength=len(src))
    writers = counts[np.searchsorted(sorted_src, src, side="left")]
    move: npt.NDArray[np.bool_] = ~((writers == ref[src]) & (rank == writers - 1))
    return move


class PagedKVManager(PoolQueries, SwapMixin, TableViews):
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        enable_prefix_caching: bool = True,
        hash_fn: str | KeyFunction = "sha256",
        verify_hits: bool = False,
        null_block: bool = True,
        num_host_blocks: int = 0,
        record_events: bool = False,
        native: bool | None = None,
        eviction: str | EvictionPolicy = "lru",
        partial_reuse: bool = False,
    ) -> None:
        num_blocks, block_size = as_pool_size(num_blocks, block_size, minimum=2 if null_block is True else 1)
        num_host_blocks = as_count(num_host_blocks, "num_host_blocks")
        for flag, name in ((enable_prefix_caching, "enable_prefix_caching"), (verify_hits, "verify_hits"),
                           (null_block, "null_block"), (record_events, "record_events")):  # fmt: skip
            as_flag(flag, name)
        native = as_native(native)
        self._block_size = block_size
        self._capacity_tokens = (num_blocks - (1 if null_block else 0)) * block_size
        self.pool = BlockPool(
            num_blocks, null_block=null_block, record_events=record_events, native=native, eviction=eviction,
            block_size=block_size,
        )  # fmt: skip
        self.host_pool = BlockPool(num_host_blocks, null_block=False) if num_host_blocks else None
        self.host_block_tokens = np.zeros((num_host_blocks if enable_prefix_caching else 0, block_size), np.int32)
        self.tables = BlockTables(block_size, NULL_BLOCK_ID, native=native, hashing=enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.verify_hits = verify_hits
        self.prefix = PrefixCache(
            self.pool, self.tables, block_size, key_function(hash_fn), enabled=enable_prefix_caching,
            verify_hits=verify_hits, native=native, partial_reuse=as_flag(partial_reuse, "partial_reuse"),
        )  # fmt: skip
        self._hot = self.prefix.hot  # the stateless backend of the growth loops (`hotpath.py`)
        self.copies = CopyLedger(self.pool)  # copies not handed out yet, both ends held (copies.py)
        self._admissions = self._preemptions = self._prompt_tokens = self._cached_tokens = 0
        self._cow_copies = self._partial_hits = 0

    # --- queries --------------------------------------------------------------------------------

    @property
    def index(self) -> PrefixIndex:
        """The prefix index (key <-> block, events), the pool's: read it; it is written only by its methods."""
        return self.pool.prefix_index

    @property
    def block_tokens(self) -> npt.NDArray[np.int32]:
        """Token ids of every block's slots, mirroring the KV content (the prefix cache's; read it)."""
        return self.prefix.block_tokens

    @property
    def misses(self) -> MissCounter:
        """Why admitted prompt tokens missed the cache, live (`misses.py`; the prefix cache's)."""
        return self.prefix.misses

    @property
    def stats(self) -> ManagerStats:
        return ManagerStats(
            self._admissions, self._preemptions, self._prompt_tokens, self._cached_tokens,
            self.pool.stats.evictions, self._cow_copies, self.prefix.verify_failures,
            self.pool.num_in_use, self.num_blocks,
            miss_lookups=dict(self.prefix.misses.lookups), miss_tokens=dict(self.prefix.misses.tokens),
            partial_hits=self._partial_hits,
        )  # fmt: skip

    @property
    def hot_path(self) -> str:
        """The backend the step's loops run in: "native" (the C extension) or "python" (`hotpath.py`)."""
        return self._hot.NAME

    @property
    def num_extra_references(self) -> int:
        """References beyond the first on each block (a block shared by k holders counts k - 1): the
        blocks the tables name more than once."""
        pool = self.pool
        return int(np.maximum(pool.ref[pool.first_id :] - 1, 0).sum())

    def num_computed_tokens(self, seq_id: int) -> int:
        return int(self.tables.num_computed[self.tables.row(seq_id)])

    def is_swapped(self, seq_id: int) -> bool:
        return bool(self.tables.swapped[self.tables.row(seq_id)])

    def match_prefix(self, token_ids: npt.ArrayLike, *, salt: bytes = b"", keys: BlockKeys | None = None) -> int:
        """How many leading tokens of `token_ids` an admission would take from the cache now."""
        tokens = as_tokens(token_ids)
        keys = request_keys(tokens, salt, keys)
        hits, _, reuse = self._lookup(tokens, keys)
        return len(hits) * self._block_size + reuse

    def _lookup(self, tokens: npt.NDArray[np.int32], keys: BlockKeys) -> _Lookup:
        """The prompt's cached full blocks, then (with partial reuse) a block sharing the next tokens."""
        if not self.enable_prefix_caching:
            return _NO_LOOKUP
        hits = np.array(self.prefix.match(tokens, keys, (len(tokens) - 1) // self._block_size), dtype=np.int64)
        if not self.prefix.partial_reuse:
            return hits, -1, 0
        src, reuse = self.prefix.partial_match(tokens, keys, len(hits), PARTIAL_REUSE_MIN_TOKENS)
        if src in self.copies.pending:  # its KV is not all there before the copies run (a caller publishing early)
            return hits, -1, 0
        return hits, src, reuse


    def can_admit(self, token_ids: npt.ArrayLike, *, max_new_tokens: int = 0, salt: bytes = b"") -> bool:
        tokens = as_tokens(token_ids)
        as_count(max_new_tokens, "max_new_tokens")
        keys = request_keys(tokens, salt, None)
        return self._blocks_short(len(tokens), 0, self._lookup(tokens, keys)) <= 0

    def _blocks_short(self, n: int, lookahead: int, found: _Lookup) -> int:
        hits, src, reuse = found
        need = -(-(n + lookahead) // self._block_size) - len(hits)
        cached_hits = int(np.count_nonzero(self.pool.ref[hits] == 0)) if len(hits) else 0
        if reuse and self.pool.ref[src] == 0:
            cached_hits += 1  # holding the copy's source takes it out of the eviction order
        return need - (self.pool.num_available - cached_hits)

    # --- admission ------------------------------------------------------------------------------

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
        """Allocate blocks for `token_ids` (sharing cached leading blocks). `None`: not enough free blocks now,
        counting `keep_free` blocks that must stay free after the admission (cached hits cost nothing).

        `max_new_tokens` is ignored (paging reserves nothing ahead); `keys` lets a request keep its block
        keys across admissions, so re-admitting a waiting or preempted request hashes nothing twice.
        Raises `CapacityError` if the sequence could never fit, however empty the pool.
        """
        tokens, _, num_lookahead, keep_free, priority = as_admission(
            token_ids, max_new_tokens, num_lookahead, keep_free, priority
        )
        n, bs = len(tokens), self._block_size
        if -(-(n + num_lookahead) // bs) > self.num_blocks:
            raise CapacityError(f"a sequence of {n + num_lookahead} tokens needs more than the {self.num_blocks} blocks of the pool")
        keys = request_keys(tokens, salt, keys)  # validated last: it remembers the tokens
        found = self._lookup(tokens, keys)
        if self._blocks_short(n, num_lookahead, found) + keep_free > 0:
            return None
        # --- commit (nothing below can fail) ---
        row = self._commit_admission(tokens, keys, found, n + num_lookahead, priority)
        num_hits = len(found[0])
        cached = num_hits * bs + found[2]
        self._admissions += 1
        self._prompt_tokens += n
        self._cached_tokens += cached
        # why the rest was not cached (misses.py)
        prefix = self.prefix
        if self.enable_prefix_caching:
            prefix.misses.count_admission(prefix, tokens, keys, num_hits, cached, row)
        return Admission(row, cached)

    def _commit_admission(
        self, tokens: npt.NDArray[np.int32], keys: BlockKeys, found: _Lookup, num_slots: int, priority: int
    ) -> int:
        """`admit` once it fits: take the hits, hold a partial copy's source, allocate the rest; the new row."""
        pool, t, bs = self.pool, self.tables, self._block_size
        hits, src, reuse = found
        n, h = len(tokens), len(hits)
        if h:
            pool.touch_hits(hits)
        if reuse:  # held before allocating: it must not be evicted
            self.copies.hold_source(src)
        new = pool.allocate(-(-num_slots // bs) - h)
        row = t.start_row(np.concatenate([hits, new]) if h else new, n, h * bs + reuse, h, priority)
        # the keys follow the row in both settings, so rollback truncates the tokens they remember
        self.prefix.attach(row, keys)
        if self.enable_prefix_caching:
            self.prefix.write_tokens(new, tokens[h * bs :])
        if reuse:
            self._partial_copy(src, int(new[0]))
        return row

    def _partial_copy(self, src: int, dst: int) -> None:
        """Partial reuse: the sequence's fresh block `dst` starts as a copy of cached block `src` (held since
        `_commit_admission`); both stay held until `take_copies` hands the copy out."""
        self.copies.record(np.array([src], dtype=np.int64), np.array([dst], dtype=np.int64))
        self._partial_hits += 1

    # --- growth ---------------------------------------------------------------------------------

    def _growth(self, rows: IntArray, k: int) -> tuple[IntArray, IntArray, IntArray, IntArray]:
        """Blocks each row needs for k more tokens; the rows/blocks needing copy-on-write first; and the
        blocks that rows marked copy-before-write will write in place (they lose their key first)."""
        t = self.tables
        old = t.num_tokens[rows]
        need = (old + (k + self._block_size - 1)) // self._block_size - t.num_blocks[rows]
        np.maximum(need, 0, out=need)
        cow_rows, cow_src, in_place = _EMPTY, _EMPTY, _EMPTY
        if t.any_cow_risk and t.cow_risk.any():
            risky = t.cow_risk[rows] & (old % self._block_size != 0)
            if risky.any():
                cand = rows[risky]
                src = t.table[cand, (t.num_tokens[cand] - 1) // self._block_size].astype(np.int64)
                move = self.pool.ref[src] > 1
                move[move] = _writers_to_move(cand[move], src[move], self.pool.ref)
                cow_rows, cow_src, in_place = cand[move], src[move], src[~move]
        return need, cow_rows, cow_src, in_place

    def num_blocks_to_append(self, seq_ids: npt.ArrayLike, num_tokens: int = 1) -> int:
        rows = self.tables.rows(seq_ids)
        need, cow_rows, _, _ = self._growth(rows, as_count(num_tokens, "num_tokens"))
        return int(need.sum()) + len(cow_rows)

    def append(self, seq_ids: npt.ArrayLike, token_ids: npt.ArrayLike | None = None, num_tokens: int = 1) -> bool:
        """Grow each sequence by `num_tokens` slots. False (nothing changed) if the pool is short.

        With prefix caching on, pass the token ids (`[B]` or `[B, num_tokens]`) so the blocks they fill
        can be published; without them those blocks stay private.
        """
        t = self.tables
        rows = t.rows(seq_ids)
        k = as_count(num_tokens, "num_tokens")
        tok = as_token_matrix(token_ids, len(rows), k) if token_ids is not None else None
        if k > self._capacity_tokens:
            return False  # no sequence can hold that many more (nor int64 wrap below)
        if len(rows) == 0 or k == 0:
            return True
        if t.any_cow_risk and t.cow_risk.any():
            return self._append_shared(rows, k, tok)
        # no row writes into a shared block: count the new blocks, then write blocks and tokens
        t.any_cow_risk = False
        total_new, width = self._hot.growth(rows, t.num_tokens, t.num_blocks, k, self._block_size)
        if total_new > self.pool.num_available:
            return False
        # --- commit ---
        self._write_growth(rows, k, tok, self.pool.allocate(total_new) if total_new else _EMPTY, width)
        return True

    def _append_shared(self, rows: IntArray, k: int, tok: npt.NDArray[np.int32] | None) -> bool:
        """`append` when some rows may write into a block they share (after fork or rollback): those move
        to a copy first."""
        t = self.tables
        need, cow_rows, cow_src, in_place = self._growth(rows, k)
        total_new = int(need.sum())
        if total_new + len(cow_rows) > self.pool.num_available:
            return False
        # --- commit ---
        ids = self.pool.allocate(total_new + len(cow_rows)) if total_new + len(cow_rows) else _EMPTY
        if len(cow_rows):
            self._copy_on_write(cow_rows, cow_src, ids[: len(cow_rows)])
            ids = ids[len(cow_rows) :]
        for block_id in in_place.tolist():  # the rule: a block written in place has no key
            self.index.remove(block_id)
        t.cow_risk[rows] = False  # every appended row now writes into a private last block
        t.any_cow_risk = bool(t.cow_risk.any())
        self._write_growth(rows, k, tok, ids, int((t.num_blocks[rows] + need).max()))
        return True

    def _write_growth(
        self, rows: IntArray, k: int, tok: npt.NDArray[np.int32] | None, ids: IntArray, width: int
    ) -> None:
        """Append the new blocks `ids` to the rows (in batch order), write the token ids into the mirror
        (or mark them unknown), and count the k tokens: one backend call."""
        t = self.tables
        t.ensure_cols(width)
        mirror = self.enable_prefix_caching and tok is not None
        if self.enable_prefix_caching and tok is None:
            t.forget_token_ids(rows)
        self._hot.grow(
            rows, t.num_tokens, t.num_blocks, t.table, k, self._block_size, ids,
            np.ascontiguousarray(tok) if mirror else None, self.block_tokens if mirror else None,
        )  # fmt: skip

    def _copy_on_write(self, rows: IntArray, src: IntArray, dst: IntArray) -> None:
        t, pool = self.tables, self.pool
        t.table[rows, (t.num_tokens[rows] - 1) // self._block_size] = dst
        pool.unshare(src)  # someone else still holds each src: no state change
        if self.enable_prefix_caching:
            self.prefix.copy_tokens(dst, src)
        self.copies.record(src, dst)  # neither end is reused before `take_copies` hands the copy out
        self._cow_copies += len(rows)

    def fetch_blocks(
        self, seq_id: int, start: int, end: int, source: BlockSource, tag: object = None
    ) -> BlockFill | None:
        """A tier hit (`protocol.py`): the sequence's `BlockKeys` key its full blocks inside `[start, end)`
        but the block of token `end - 1`; `source` fills the longest leading run it holds. Only blocks this
        sequence alone holds and nobody published are asked for (past the computed tokens they are unwritten),
        so the fill is their one writer this step; they are published by the `mark_computed` that follows
        the forward, like computed blocks."""
        t, bs = self.tables, self._block_size
        row = t.device_row(seq_id)
        start, end = as_count(start, "start"), as_count(end, "end")
        if start % bs or start < t.num_computed[row] or end > t.num_tokens[row]:
            raise InvalidArgumentError(
                f"fetch_blocks: start {start} must be a block boundary at or past the {t.num_computed[row]} "
                f"computed tokens and end {end} at most the {t.num_tokens[row]} tokens of sequence {seq_id}"
            )
        first, last = start // bs, (end - 1) // bs
        keys = self.prefix.keys_of(row)
        if not self.enable_prefix_caching or keys is None or keys.epoch != self.prefix.epoch:
            return None  # keys of an earlier epoch name KV of other weights
        last = min(last, int(min(t.num_tokens[row], t.hashable_tokens[row])) // bs)
        blocks = t.blocks_of(row)
        if last > first:  # only the leading run of private, unpublished blocks (a fork shares its tail)
            own = (self.pool.ref[blocks[first:last]] == 1) & ~self.pool.keyed[blocks[first:last]]
            last = last if own.all() else first + int(np.argmin(own))
        if last <= first:
            return None
        for j in range(keys.num_keys(), last):
            keys.key(j, self.block_tokens[blocks[j]])
        n, rows = source.fetch(keys.keys[first + 1 : last + 1], first, tag)
        return BlockFill(blocks[first : first + n].astype(np.int64), rows[:n]) if n else None

    def mark_computed(self, seq_ids: npt.ArrayLike, num_computed_tokens: npt.ArrayLike | None = None) -> None:
        """KV is written for tokens [0, num_computed) of each sequence; publish the full blocks among them."""
        t = self.tables
        rows = t.rows(seq_ids)
        given: IntArray | None = None
        if num_computed_tokens is not None:
            given = as_computed(num_computed_tokens, t.num_computed[rows], t.num_tokens[rows])
        self.prefix.publish(rows, given)  # without prefix caching nothing is hashable: counts only

    # --- release ---------------------------------------------------------------------------------

    def free(self, seq_id: int) -> None:
        """Release a finished sequence's blocks (tail first); cached blocks stay hittable until evicted."""
        t = self.tables
        row = t.row(seq_id)
        blocks = t.blocks_of(row, tail_first=True)
        if t.swapped[row]:
            assert self.host_pool is not None, "manager: a swapped sequence without a host pool"
            self.host_pool.release(blocks)
        else:
            self.pool.release(blocks, int(t.priority[row]))
        self.prefix.detach(row)
        self.prefix.misses.forget(row, None)
        t.drop_row(row)

    def count_tier_miss(self, seq_id: int, num_tokens: int) -> None:
        """`num_tokens` that `seq_id`'s admission missed were lost by a tier below the device too (the
        engine's tiering says so): they move to the miss reason `tier` (`MissCounter.count_tier_miss`)."""
        self.prefix.misses.count_tier_miss(self.tables.row(seq_id), num_tokens)

    def preempt(self, seq_id: int) -> int:
        """Free a running sequence to make room (recompute later); returns how many tokens it held."""
        n = self.num_tokens(seq_id)
        self.free(seq_id)
        self._preemptions += 1
        return n

    def fork(self, seq_id: int) -> int:
        """A new sequence sharing every block that holds `seq_id`'s tokens (copy-on-write on first write)."""
        t = self.tables
        row = t.device_row(seq_id)
        n_tok = int(t.num_tokens[row])
        blocks = t.blocks_of(row)[: -(-n_tok // self._block_size)]
        child = t.copy_row(row, blocks)
        self.pool.share(blocks)
        if n_tok % self._block_size:
            t.cow_risk[row] = t.cow_risk[child] = t.any_cow_risk = True
        if (keys := self.prefix.keys_of(row)) is not None:
            self.prefix.attach(child, keys.copy())
        return child

    def rollback(self, seq_id: int, num_tokens: int) -> None:
        """Drop the last `num_tokens` tokens (rejected speculative tokens)."""
        t = self.tables
        row = t.device_row(seq_id)
        old = int(t.num_tokens[row])
        new, bs = as_rollback(num_tokens, old, seq_id), self._block_size
        if new == old:
            return
        keep = -(-new // bs)
        blocks = t.blocks_of(row)
        self.pool.release(blocks[keep:][::-1], int(t.priority[row]))
        t.truncate(row, new, blocks[:keep])
        if (keys := self.prefix.keys_of(row)) is not None:
            keys.truncate(new // bs, new)
        if new % bs:
            last = int(blocks[keep - 1])
            if self.pool.ref[last] > 1:
                t.cow_risk[row] = t.any_cow_risk = True  # shared: the next write copies it
            else:
                self.index.remove(last)  # private: its content past `new` will change

    # --- retention ------------------------------------------------------------------------------

    def pin(self, token_ids: npt.ArrayLike, *, salt: bytes = b"", keys: BlockKeys | None = None) -> PinHandle:
        """Keep the cached full blocks leading this prefix from eviction until `unpin`.

        Raises `PinError` if not even its first full block is cached (nothing would be pinned).
        """
        tokens = as_tokens(token_ids)
        keys = request_keys(tokens, salt, keys)
        if not self.enable_prefix_caching:
            raise PinError("pinning needs prefix caching (enable_prefix_caching=True)")
        hits = self.prefix.match(tokens, keys, len(tokens) // self._block_size)
        if not hits:
            raise PinError("pin: no full block of this prefix is cached; admit and compute it first")
        for block_id in hits:
            self.pool.pin(block_id)
        return PinHandle(tuple(hits))

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns how many keys were dropped. Running sequences are unaffected."""
        return self.pool.clear_keys()

    @property
    def epoch(self) -> int:
        return self.prefix.epoch

    def bump_epoch(self) -> int:
        """Make every key published so far unmatchable (e.g. after a weight update), in O(1)."""
        self.prefix.epoch += 1
        return self.prefix.epoch

    @property
    def records_events(self) -> bool:
        return self.index.record_events

    @property
    def grouped_events(self) -> bool:
        """False: `CacheEvent`s of plain content keys."""
        return False

    def take_events(self) -> list[CacheEvent]:
        return self.index.take_events()

    # --- checks ---------------------------------------------------------------------------------

    def snapshot(self) -> tuple[object, ...]:
        """Everything observable, for atomicity tests."""
        t = self.tables
        rows = tuple(getattr(t, name).tobytes() for name in t._ROW_ARRAYS)
        keys = tuple((r, tuple(k.keys)) for r, k in enumerate(self.prefix.by_row) if k is not None)
        host = self.host_pool.snapshot() if self.host_pool else ()
        return (self.pool.snapshot(), host, t.table.tobytes(), rows, keys, self.block_tokens.tobytes(),
                self.epoch, self.stats, self.copies.snapshot())  # fmt: skip

    def check_invariants(self) -> None:
        check_references(self.pool, self.host_pool, (self.tables,), self.copies, "manager")
        t, bs = self.tables, self._block_size
        if (t.num_published > t.num_computed // bs).any():
            raise InvariantError("manager: more blocks published than computed")
        if any(k is not None and not t.alive[r] for r, k in enumerate(self.prefix.by_row)):
            raise InvariantError("manager: block keys kept for a dead sequence")
        p = self.prefix
        if any(
            (p.key_lists[r] is not (None if k is None else k.keys)) or (k is not None and p.key_epochs[r] != k.epoch)
            for r, k in enumerate(p.by_row)
        ):
            raise InvariantError("manager: the key lists or epochs the hot path reads disagree with the block keys")
