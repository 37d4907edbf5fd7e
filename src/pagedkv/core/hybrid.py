"""`HybridKVManager`: KV cache groups (full, sliding window, chunked local) over ONE block pool.

Each group (`group.py`) has its own block table per sequence (`BlockTables`, rows in lockstep: a sequence
id is the same row in every group), over the one `BlockPool` of one block size, so a block id names a page
that holds one group's layers at a time. A model with one attention type is served by `PagedKVManager`,
untouched; this class is for models that mix them (or that want their windows to free memory).

Per group g and sequence, the table is a run of leading null entries, then real blocks:

    tokens      | 0 .. 15 | 16 .. 31 | 32 .. 47 | 48 .. 63 | 64 .. 70 |     computed = 66, window 24
    full        |   b3    |   b8     |   b1     |   b9     |   b4     |     every block held
    sliding-24  |  null   |  null    |   b2     |   b7     |   b5     |     released = 2 (first needed: 43)
                                     ^ held from `released` on; `held` tokens have slots (table num_tokens)

- Release as the window passes (`hybrid_publish.py`): `mark_computed` releases, in every sliding/chunked group, each block no
  query at or after `num_computed` reads (its entry becomes the null block). Published ones stay cached.
  A windowed hit is all or nothing: it needs every block of the window before the hit point, and the hit
  points that recur are the end of a prompt (re-sent with a new suffix) and the end of a sequence (the
  next turn). So released blocks within two windows before the prompt's end keep the sequence's
  priority, like the blocks `free` leaves (the full-group prefix and the sliding tail), and every other
  released block goes to the front of the eviction order (`OUT_OF_WINDOW_PRIORITY`). One LRU for all of
  them starved the prefix in vLLM (#48435): the out-of-window blocks each new request frees are more
  recent than older sessions' useful tails, so those went first and whole-prefix hits collapsed to 0.
  `evict_out_of_window_first=False` keeps that one LRU (for the test that reproduces it).
- Prefix hits across groups: content keys are qualified by group (`group_keys.py`); a hit at h tokens
  needs blocks [0, h) in a full group and the blocks covering [first_needed(h), h) in a windowed one
  (the last window - 1 tokens). The hit is the longest h every group can serve.
- Admission counts each group's need: a full group the whole prompt, a windowed group only from
  first_needed(h) to the end of the first chunk when the caller says how many tokens it computes per step
  (`chunk_tokens`), so a windowed group never needs more than its window plus one chunk (and one block)
  per sequence, and long prompts never deadlock. Later chunks take their slots with `reserve` (the
  scheduler calls it before scheduling a chunk, as vLLM allocates per step); `append` reserves too.
- Fork/copy-on-write, rollback, swap, pending copies and events work per group with the same rules as
  `PagedKVManager` (a block is written in place only when its writer is its sole holder and it has no
  key). A rollback may not go back past a block a group has already released (`InvalidArgumentError`).
- Tier hits per group (`fetch_blocks`, `hybrid_fetch.py`): a block is fetched when every group's copy is.
- Miss reasons (`misses`, `stats.miss_tokens`; `hybrid_misses.py`): `PagedKVManager`'s reasons, for the
  first block after the hit in the first group that limited it.
- Eviction: any policy of `eviction.py` (`eviction=`, LRU by default) orders the one pool's cached-free
  blocks, whatever group they came from; out-of-window releases reach it with `OUT_OF_WINDOW_PRIORITY`.
- Retention as `PagedKVManager`'s: `pin` holds the blocks a cached prefix's hit needs in every group until
  `unpin`; `bump_epoch` makes every published key unmatchable; salts and extra keys qualify every group.
- `check_invariants` checks the pool, every group's table, reference counts over all groups, null
  entries exactly before `released`, keys qualified by the group of the block holding them.

Where the state lives: each group's `BlockTables` holds its blocks, held tokens (`num_tokens`), computed
and published counts and the hashable tokens (the same in every group); `TokenRows` holds each sequence's
token ids and length; `SeqState` the rest (priority, keys, released per group, host blocks); the miss
counter (`misses`) each admission's miss record. A step's hot work runs in `hotpath`'s backend (the C
extension when built), the loops the uniform manager uses, each group under its own keys: `match` per full
group at admission, `growth`/`grow` per group for a decode step's append, and `publish_groups` for all of
`mark_computed`. Custom key functions and per-block extra keys take the Python path (`_publish_generic`),
with the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from pagedkv.core import hotpath
from pagedkv.core.copies import CopyLedger, PinHandle, PoolQueries
from pagedkv.core.errors import CapacityError, InvalidArgumentError, InvariantError, PinError
from pagedkv.core.eviction import EvictionPolicy
from pagedkv.core.group import KVGroupSpec
from pagedkv.core.group_keys import GroupCacheEvent, check_num_groups, group_events, group_key
from pagedkv.core.hybrid_check import check_hybrid
from pagedkv.core.hybrid_fetch import HybridFetch
from pagedkv.core.hybrid_growth import HybridGrowth
from pagedkv.core.hybrid_misses import HybridMisses
from pagedkv.core.hybrid_publish import HybridPublish
from pagedkv.core.hybrid_state import ALL_KNOWN, HybridLifecycle, SeqState, as_groups
from pagedkv.core.misses import MissCounter
from pagedkv.core.pool import NULL_BLOCK_ID, BlockPool
from pagedkv.core.prefix import BlockKeys, Key, fast_key, key_function, sha256_key
from pagedkv.core.protocol import Admission, CSRPages, ManagerStats
from pagedkv.core.table import BlockTables
from pagedkv.core.token_rows import TokenRows
from pagedkv.core.validate import (
    as_count,
    as_flag,
    as_index_array,
    as_native,
    as_pad_id,
    as_pool_size,
    as_priority,
    as_tokens,
    request_keys,
)  # fmt: skip

IntArray = npt.NDArray[np.int64]
_EMPTY = np.zeros(0, dtype=np.int64)


class HybridKVManager(PoolQueries, HybridGrowth, HybridPublish, HybridFetch, HybridMisses, HybridLifecycle):
    """Per-group block tables over one pool; see the module docstring for the contract."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        groups: Sequence[KVGroupSpec] = (KVGroupSpec(),),
        *,
        enable_prefix_caching: bool = True,
        hash_fn: str = "sha256",
        num_host_blocks: int = 0,
        record_events: bool = False,
        evict_out_of_window_first: bool = True,
        native: bool | None = None,
        eviction: str | EvictionPolicy = "lru",
    ) -> None:
        num_blocks, block_size = as_pool_size(num_blocks, block_size, minimum=2)
        num_host_blocks = as_count(num_host_blocks, "num_host_blocks")
        for flag, name in ((enable_prefix_caching, "enable_prefix_caching"), (record_events, "record_events"),
                           (evict_out_of_window_first, "evict_out_of_window_first")):  # fmt: skip
            as_flag(flag, name)
        native = as_native(native)
        self.groups = as_groups(groups)
        check_num_groups(len(self.groups))
        self._block_size = block_size
        self.pool = BlockPool(
            num_blocks, null_block=True, record_events=record_events, native=native, eviction=eviction,
            block_size=block_size,
        )  # fmt: skip
        self.index = self.pool.prefix_index
        self.host_pool = BlockPool(num_host_blocks, null_block=False) if num_host_blocks else None
        self.tables = [BlockTables(block_size, NULL_BLOCK_ID, native=native) for _ in self.groups]
        self.tokens = TokenRows()  # each sequence's token ids, by row
        self.enable_prefix_caching = enable_prefix_caching
        self.key_fn = key_function(hash_fn)
        self._hot = hotpath.backend(native)
        # the key function as a hot-path kind; None: a custom function (the Python path)
        self._kind = hotpath.SHA256 if self.key_fn is sha256_key else hotpath.FAST if self.key_fn is fast_key else None
        self._key_lists: list[list[Key] | None] = []  # each row's content keys (its BlockKeys' list), for the backend
        self._rows_with_extras = 0  # live sequences with per-block extra keys (they take the Python path)
        self._windowed = tuple((g, spec) for g, spec in enumerate(self.groups) if not spec.is_full)
        self._capacity_tokens = self._capacity()
        self.evict_out_of_window_first = evict_out_of_window_first
        self.seqs: dict[int, SeqState] = {}
        self.group_of = np.full(num_blocks, -1, dtype=np.int64)  # the group a block was last allocated to
        self.copies = CopyLedger(self.pool)  # copies not handed out yet, both ends held (copies.py)
        self._admissions = self._preemptions = self._prompt_tokens = self._cached_tokens = self._cow_copies = 0
        self._epoch = 0  # keys published under an earlier epoch match nothing (`bump_epoch`)
        self.misses = MissCounter()  # why admitted prompt tokens missed the cache, live (`hybrid_misses.py`)

    # --- queries --------------------------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_sequences(self) -> int:
        return len(self.seqs)

    @property
    def capacity_tokens(self) -> int:
        """The most tokens one sequence can hold: the pool less each windowed group's bounded share (one
        block per step's token), split between the full groups (unbounded with none)."""
        return self._capacity_tokens

    def _capacity(self) -> int:
        bounded = sum(g.max_blocks_per_sequence(1, self._block_size) or 0 for g in self.groups)
        full = sum(g.is_full for g in self.groups)
        if not full:
            return 2**62 - 1
        return max(self.num_blocks - bounded, 0) // full * self._block_size

    @property
    def hot_path(self) -> str:
        """The backend the step's loops run in: "native" (the C extension) or "python" (`hotpath.py`)."""
        return self._hot.NAME

    @property
    def supports_swap(self) -> bool:
        return True

    @property
    def reserves_chunks(self) -> bool:
        """True: admit takes `chunk_tokens` and later chunks take their slots with `reserve`."""
        return True

    @property
    def stats(self) -> ManagerStats:
        return ManagerStats(
            self._admissions, self._preemptions, self._prompt_tokens, self._cached_tokens,
            self.pool.stats.evictions, self._cow_copies, 0, self.pool.num_in_use, self.num_blocks,
            miss_lookups=dict(self.misses.lookups), miss_tokens=dict(self.misses.tokens),
        )  # fmt: skip

    def num_tokens(self, seq_id: int) -> int:
        return int(self.tokens.length[self.tables[0].row(seq_id)])

    def num_computed_tokens(self, seq_id: int) -> int:
        return int(self.tables[0].num_computed[self.tables[0].row(seq_id)])

    def is_swapped(self, seq_id: int) -> bool:
        return bool(self.tables[0].swapped[self.tables[0].row(seq_id)])

    def block_ids(self, seq_id: int, group: int | None = None) -> list[int]:
        """The sequence's table in one group (null entries included as the null block id)."""
        t = self.tables[self._group(group)]
        return t.blocks_of(t.row(seq_id)).tolist()  # type: ignore[no-any-return]

    def num_blocks_held(self, seq_id: int) -> list[int]:
        """Real (non-null) blocks the sequence holds in each group."""
        row = self.tables[0].row(seq_id)
        return [int(t.num_blocks[row]) - self.seqs[row].released[g] for g, t in enumerate(self.tables)]

    def _group(self, group: int | None) -> int:
        if group is None:
            if len(self.groups) != 1:
                raise InvalidArgumentError(f"this manager has {len(self.groups)} KV cache groups; pass group=0..{len(self.groups) - 1}")
            return 0
        if not isinstance(group, int | np.integer) or isinstance(group, bool) or not 0 <= group < len(self.groups):
            raise InvalidArgumentError(f"group must be an int in [0, {len(self.groups)}), got {group!r}")
        return int(group)

    # --- batch views (per group) ------------------------------------------------------------------

    def block_table(self, seq_ids: npt.ArrayLike, *, pad_id: int | None = None, group: int | None = None) -> npt.NDArray[np.int32]:
        """Padded `[B, max_blocks]` table of one group; released entries hold the null block."""
        g = self._group(group)
        return self.tables[g].block_table(self.tables[g].rows(seq_ids), as_pad_id(pad_id))

    def seq_lens(self, seq_ids: npt.ArrayLike) -> npt.NDArray[np.int32]:
        return self.tokens.length[self.tables[0].rows(seq_ids)].astype(np.int32)

    def slot_mapping(
        self, seq_ids: npt.ArrayLike, starts: npt.ArrayLike, ends: npt.ArrayLike, *, group: int | None = None
    ) -> npt.NDArray[np.int64]:
        """Slots of tokens [starts[i], ends[i]) in one group (every token must have a slot there)."""
        g = self._group(group)
        t = self.tables[g]
        rows = t.rows(seq_ids)
        starts_a = as_index_array(starts, "starts", rows.shape)
        if self.groups[g].window is not None and len(rows):
            # a start in a released block: released entries are exactly a row's leading null ones
            cols = starts_a // self._block_size
            held = cols < t.num_blocks[rows]
            if (held & (t.table[rows, np.minimum(cols, t.table.shape[1] - 1)] == NULL_BLOCK_ID)).any():
                raise InvalidArgumentError(f"slot_mapping: group {g} released the blocks of a range start (out of its window)")
        return t.slot_mapping(rows, starts_a, ends)

    def csr(self, seq_ids: npt.ArrayLike, *, group: int | None = None) -> CSRPages:
        g = self._group(group)
        return self.tables[g].csr(self.tables[g].rows(seq_ids))

    # --- prefix match -----------------------------------------------------------------------------


    def _native_keys(self, keys: BlockKeys) -> bool:
        """Whether `keys` are computed by the backend (a built-in key function, no per-block extras)."""
        return self._kind is not None and not keys.block_extra

    def _content_keys(self, tokens: npt.NDArray[np.int32], keys: BlockKeys, start: int, stop: int) -> list[Key]:
        """The content keys of blocks [start, stop): only blocks never keyed before are hashed (a decode
        step hashes one block, whatever the sequence's length)."""
        keys.bind(self.key_fn, self._epoch)
        bs, n = self._block_size, keys.num_keys()
        if stop > n:
            keys.extend(stop, np.asarray(tokens[n * bs : stop * bs], dtype=np.int32).tobytes(), bs)
        return keys.keys[start + 1 : stop + 1]

    def _match(self, tokens: npt.NDArray[np.int32], keys: BlockKeys, max_blocks: int) -> tuple[int, list[IntArray]]:
        """(k, hits): the longest prefix of k blocks every group serves, and each group's hit blocks (those
        covering [first_needed(k * bs), k * bs))."""
        if not self.enable_prefix_caching or max_blocks == 0:
            return 0, [_EMPTY for _ in self.groups]
        if self._native_keys(keys):
            return self._match_native(tokens, keys, max_blocks)
        content = self._content_keys(tokens, keys, 0, max_blocks)
        return self._match_keys(content, max_blocks, {})

    def _match_native(self, tokens: npt.NDArray[np.int32], keys: BlockKeys, max_blocks: int) -> tuple[int, list[IntArray]]:
        """`_match` in the backend: each full group walks the prompt until its first miss (computing the
        keys it reaches), then the windowed groups look up the keys up to the hit."""
        keys.bind(self.key_fn, self._epoch)
        assert self._kind is not None, "hybrid manager: a native match needs a built-in key function"
        k, width, known, full_hits = max_blocks, 4 * self._block_size, keys.keys, {}
        for g, spec in enumerate(self.groups):
            if spec.is_full:
                full_hits[g] = self._hot.match(self._kind, self.index.index, known, tokens, width, k, g)
                k = len(full_hits[g])
        if not self._windowed:
            return k, [np.array(full_hits[g][:k], dtype=np.int64) for g in range(len(self.groups))]
        self._hot.extend_keys(self._kind, known, tokens, width, k)
        return self._match_keys(known[1 : k + 1], k, full_hits)

    def _match_keys(self, content: list[Key], max_blocks: int, full_hits: dict[int, list[int]]) -> tuple[int, list[IntArray]]:
        """`_match` over the content keys of blocks [0, max_blocks); `full_hits`: the full groups' walks
        already made (their hits, up to their first miss)."""
        lookup, bs, k = self.index.lookup, self._block_size, max_blocks
        found: list[list[int | None]] = []
        for g, spec in enumerate(self.groups):
            ids: list[int | None] = []
            if g in full_hits:
                ids = list(full_hits[g][:k])
                k = len(ids)
            elif spec.is_full:  # needs every block up to the hit: stop at its first miss
                for c in content[:k]:
                    if (b := lookup(group_key(c, g))) is None:
                        break
                    ids.append(b)
                k = len(ids)
            else:
                ids = [lookup(group_key(c, g)) for c in content[:k]]
            found.append(ids)
        while k > 0 and not all(
            all(b is not None for b in found[g][spec.first_needed(k * bs) // bs : k])
            for g, spec in enumerate(self.groups) if not spec.is_full
        ):  # fmt: skip
            k -= 1
        hits = [
            np.array(found[g][spec.first_needed(k * bs) // bs : k], dtype=np.int64) for g, spec in enumerate(self.groups)
        ]
        return k, hits

    def match_prefix(self, token_ids: npt.ArrayLike, *, salt: bytes = b"", keys: BlockKeys | None = None) -> int:
        """How many leading tokens of `token_ids` an admission would take from the cache now."""
        tokens = as_tokens(token_ids)
        k, _ = self._match(tokens, request_keys(tokens, salt, keys), (len(tokens) - 1) // self._block_size)
        return k * self._block_size

    # --- admission --------------------------------------------------------------------------------

    def _held_end(self, g: int, n: int, lookahead: int, h: int, chunk: int | None) -> int:
        """Tokens group g gives slots at admission: all of them, or (windowed, with a chunk size) the first
        chunk's."""
        if self.groups[g].is_full or chunk is None or h + chunk >= n - 1:  # n - 1: see `reserve`
            return n + lookahead
        return h + chunk

    def _check_fits(self, n: int, chunk: int | None) -> None:
        bs = self._block_size
        need = 0
        for spec in self.groups:
            whole = -(-n // bs)
            bound = spec.max_blocks_per_sequence(chunk, bs) if chunk is not None else None
            need += whole if bound is None else min(whole, bound)
        if need > self.num_blocks:
            raise CapacityError(f"a sequence of {n} tokens needs {need} blocks over its groups; the pool has {self.num_blocks}")

    def can_admit(self, token_ids: npt.ArrayLike, *, max_new_tokens: int = 0, salt: bytes = b"") -> bool:
        tokens = as_tokens(token_ids)
        as_count(max_new_tokens, "max_new_tokens")
        k, hits = self._match(tokens, request_keys(tokens, salt, None), (len(tokens) - 1) // self._block_size)
        return self._admission_need(len(tokens), 0, k, hits, None)[0] <= self.pool.num_available

    def _admission_need(
        self, n: int, lookahead: int, k: int, hits: list[IntArray], chunk: int | None
    ) -> tuple[int, list[int]]:
        """(blocks taken from the pool counting cached hits that leave the eviction order, new blocks per
        group)."""
        bs, h = self._block_size, k * self._block_size
        new = [-(-self._held_end(g, n, lookahead, h, chunk) // bs) - k for g in range(len(self.groups))]
        cached = sum(int(np.count_nonzero(self.pool.ref[x] == 0)) for x in hits if len(x))
        return sum(new) + cached, new

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
        chunk_tokens: int | None = None,
    ) -> Admission | None:
        """Allocate each group's blocks for `token_ids` (see the module docstring); `None`: not enough free
        blocks now (counting `keep_free`). `chunk_tokens`: at most that many uncached tokens are computed
        in the first step (windowed groups then hold only those); later chunks call `reserve`.
        Raises `CapacityError` if the sequence could never fit."""
        tokens = as_tokens(token_ids)
        as_count(max_new_tokens, "max_new_tokens")
        lookahead = as_count(num_lookahead, "num_lookahead")
        keep_free = as_count(keep_free, "keep_free")
        priority = as_priority(priority)
        chunk = None if chunk_tokens is None else as_count(chunk_tokens, "chunk_tokens", minimum=1)
        n, bs = len(tokens), self._block_size
        self._check_fits(n + lookahead, chunk)
        keys = request_keys(tokens, salt, keys)
        if self.enable_prefix_caching:
            keys.bind(self.key_fn, self._epoch)
        k, hits = self._match(tokens, keys, (n - 1) // bs)
        total, new = self._admission_need(n, lookahead, k, hits, chunk)
        if total + keep_free > self.pool.num_available:
            return None
        # --- commit (nothing below can fail) ---
        row = self._new_row()
        if self.enable_prefix_caching:
            self._count_miss(tokens, keys, k, row)  # before evicting
        all_hits = np.concatenate(hits)
        if len(all_hits):
            self.pool.touch_hits(all_hits)
        ids = self.pool.allocate(sum(new)) if sum(new) else _EMPTY
        seq = self.seqs[row] = SeqState(priority, keys if self.enable_prefix_caching else None, len(self.groups), prompt_len=n)
        self.tokens.start(row, tokens)
        self._attach_keys(row, seq.keys)
        for g, t in enumerate(self.tables):
            lo = k - len(hits[g])
            mine, ids = ids[: new[g]], ids[new[g] :]
            self.group_of[mine] = g
            t.set_blocks(row, np.concatenate([np.full(lo, NULL_BLOCK_ID, np.int64), hits[g], mine]))
            t.num_tokens[row] = min(self._held_end(g, n, lookahead, k * bs, chunk), n)
            t.num_computed[row] = k * bs
            t.num_published[row] = k
            t.hashable_tokens[row] = ALL_KNOWN
            seq.released[g] = lo
        self._admissions += 1
        self._prompt_tokens += n
        self._cached_tokens += k * bs
        return Admission(row, k * bs)

    def _new_row(self) -> int:
        rows = {t.new_row() for t in self.tables}
        if len(rows) != 1:
            raise InvariantError("hybrid manager: the groups' tables handed out different rows")
        return rows.pop()

    def _attach_keys(self, row: int, keys: BlockKeys | None) -> None:
        """Row `row` publishes with `keys` (None: nothing) from now on."""
        if row >= len(self._key_lists):
            self._key_lists.extend([None] * (max(row + 1, len(self.tables[0].alive)) - len(self._key_lists)))
        self._key_lists[row] = None if keys is None else keys.keys
        self._rows_with_extras += keys is not None and bool(keys.block_extra)

    def _detach_keys(self, row: int, keys: BlockKeys | None) -> None:
        """Row `row`, which published with `keys`, is gone."""
        self._key_lists[row] = None
        self._rows_with_extras -= keys is not None and bool(keys.block_extra)

    # --- cache control, events, checks -------------------------------------------------------------

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix in every group; returns how many keys were dropped."""
        return self.pool.clear_keys()

    # --- retention (PagedKVManager's contract, over every group) -----------------------------------

    def pin(self, token_ids: npt.ArrayLike, *, salt: bytes = b"", keys: BlockKeys | None = None) -> PinHandle:
        """Keep the blocks the longest cached prefix of `token_ids` needs, in every group (the whole prefix
        in a full group, the window before the hit point in a windowed one), from eviction until `unpin`.
        Raises `PinError` if no full block of it is served (nothing would be pinned)."""
        tokens = as_tokens(token_ids)
        if not self.enable_prefix_caching:
            raise PinError("pinning needs prefix caching (enable_prefix_caching=True)")
        k, hits = self._match(tokens, request_keys(tokens, salt, keys), len(tokens) // self._block_size)
        if not k:
            raise PinError("pin: no full block of this prefix is cached; admit and compute it first")
        ids = tuple(int(b) for b in np.concatenate(hits))
        for block_id in ids:
            self.pool.pin(block_id)
        return PinHandle(ids)

    @property
    def epoch(self) -> int:
        return self._epoch

    def bump_epoch(self) -> int:
        """Make every key published so far, in every group, unmatchable (e.g. after a weight update). Live
        sequences' keys are computed again under the new epoch as they publish."""
        self._epoch += 1
        if self.enable_prefix_caching:
            for seq in self.seqs.values():
                if seq.keys is not None:
                    seq.keys.bind(self.key_fn, self._epoch)
        return self._epoch

    @property
    def records_events(self) -> bool:
        return self.index.record_events

    @property
    def grouped_events(self) -> bool:
        """True: `GroupCacheEvent`s, and group-qualified keys in the tiers (one group included)."""
        return True

    def take_events(self) -> list[GroupCacheEvent]:
        """Stored/removed/cleared events since the last call, each with its group (`group_keys.py`)."""
        return group_events(self.index.take_events())

    def snapshot(self) -> tuple[object, ...]:
        """Everything observable, for atomicity tests."""
        rows = tuple(
            tuple(getattr(t, name).tobytes() for name in ("table", "num_blocks", "num_tokens", "num_computed",
                                                          "num_published", "hashable_tokens", "cow_risk", "swapped"))
            for t in self.tables
        )  # fmt: skip
        seqs = tuple(sorted((r, repr(s), self.tokens.of(r).tobytes()) for r, s in self.seqs.items()))
        host = self.host_pool.snapshot() if self.host_pool else ()
        return (self.pool.snapshot(), host, rows, seqs, self.group_of.tobytes(), self.stats,
                self.copies.snapshot())  # fmt: skip

    def check_invariants(self) -> None:
        check_hybrid(self)
