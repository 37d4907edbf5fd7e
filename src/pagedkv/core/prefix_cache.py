"""The prefix cache's hot paths: matching a prompt's leading blocks, and publishing written blocks.

It owns what makes KV content addressable: the key function and the cache epoch, each live sequence's
`BlockKeys`, and a mirror of every block's token ids (the KV content in token form: hashing, verify-on-hit
and copy-on-write read it; it writes the mirror through `write_tokens` and `copy_tokens`, growth's
`hotpath.Backend.grow` writes appended tokens). It owns the two rules of content addressing: which blocks
a prompt hits (`match`) and when a written block is published (`publish`, all of `mark_computed`); the
prefix index (`prefix_index.py`, held by the pool) holds the key <-> block map and its events; the manager
decides when to call.

The per-block loops (hash, look up, index) run in `hotpath`'s backend, called from here on the index's
`arrays`: the C extension when it is built, else its Python reference. A whole `mark_computed` is one call
(`publish_computed`, reading the block table's counts and each row's keys through `key_lists` and
`key_epochs`), and that call is the one place the computed and published counts advance; custom key
functions and per-block extra keys compute their keys here and `insert` them, with the same semantics, and
keys of an earlier epoch are never published.

With `verify_hits`, a hit must match everything its key stands for, not only the key: the block's token ids
(the mirror) and its origin, (epoch, salt, request extra key, the block's extra key), recorded when it is
published. A hit that differs (a hash collision, across tenants or epochs too) ends the match there and
counts in `verify_failures`. Publishing then takes the per-row path, which records origins.

Partial reuse (`partial_reuse=True`): when a prompt's first missing block shares its first tokens with a
cached block that follows the same parent (`PrefixIndex.children`), `partial_match` names that block and
how many of its tokens match (never the prompt's last token, never a whole block: that would be a key
hit); the manager copies it into the prompt's fresh block and computes only the rest. The token mirror is
what makes the comparison exact. Rows with per-block extra keys never take part (equal tokens need not
mean equal KV there).

With `record_events`, every block `publish` indexes is reported to the index with its parent key and token
ids (`PrefixIndex.remember_origins`), what the event feeds send with it.

Every admission's uncached tokens are counted under a reason (`MissCounter.count_admission` over this cache,
the reasons in `misses.py`).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from pagedkv.core import hotpath
from pagedkv.core.misses import MissCounter, miss_reason
from pagedkv.core.pool import BlockPool
from pagedkv.core.prefix import BlockKeys, Key, KeyFunction, fast_key, sha256_key
from pagedkv.core.table import BlockTables

IntArray = npt.NDArray[np.int64]


class PrefixCache:
    def __init__(
        self, pool: BlockPool, tables: BlockTables, block_size: int, key_fn: KeyFunction, *, enabled: bool,
        verify_hits: bool, native: bool | None = None, partial_reuse: bool = False,
    ) -> None:  # fmt: skip
        self.pool = pool
        self.index = pool.prefix_index
        self.tables = tables
        self.block_size = block_size
        self.key_fn = key_fn
        self.verify_hits = verify_hits
        self.epoch = 0
        self.verify_failures = 0
        self.by_row: list[BlockKeys | None] = []  # each live sequence's block keys, by row
        # what the hot path reads of them, by row: by_row[r].keys (the same list) and by_row[r].epoch
        self.key_lists: list[list[Key] | None] = []
        self.key_epochs = np.zeros(0, dtype=np.int64)
        self._rows_with_extras = 0  # live sequences with per-block extra keys (they take the Python path)
        num_blocks = pool.num_blocks if enabled else 0
        self.block_tokens = np.zeros((num_blocks, block_size), np.int32)
        # with verify_hits: what each published block's key stands for besides its tokens
        self.origin: list[tuple[int, bytes, bytes, bytes] | None] = [None] * (num_blocks if verify_hits else 0)
        self.hot = hotpath.backend(native)
        # the key function as a hot-path kind; None: a custom function (plain Python path)
        self._kind = hotpath.SHA256 if key_fn is sha256_key else hotpath.FAST if key_fn is fast_key else None
        self._width = 4 * block_size  # bytes of one block's token ids
        self.misses = MissCounter()
        self.partial_reuse = partial_reuse and enabled
        # `publish` compares the published counts before and after: to link children, or to remember origins
        self._reads_published = self.partial_reuse or self.index.record_events
        if self.partial_reuse:
            self.index.track_children()

    def keys_of(self, row: int) -> BlockKeys | None:
        return self.by_row[row] if row < len(self.by_row) else None

    def attach(self, row: int, keys: BlockKeys) -> None:
        """Sequence `row` publishes with `keys` from now on."""
        self.detach(row)
        if row >= len(self.by_row):
            self.by_row.extend([None] * (row + 1 - len(self.by_row)))
            self.key_lists.extend([None] * (row + 1 - len(self.key_lists)))
            self.key_epochs = np.concatenate([self.key_epochs, np.zeros(len(self.by_row) - len(self.key_epochs), np.int64)])
        self.by_row[row] = keys
        self.key_lists[row] = keys.keys
        self.key_epochs[row] = keys.epoch
        self._rows_with_extras += bool(keys.block_extra)

    def detach(self, row: int) -> None:
        keys = self.keys_of(row)
        if keys is not None:
            self.by_row[row] = None
            self.key_lists[row] = None
            self._rows_with_extras -= bool(keys.block_extra)

    def write_tokens(self, block_ids: IntArray, tokens: npt.NDArray[np.int32]) -> None:
        """The mirror of `block_ids` holds `tokens` from their first slot: one row per block (a swap-in), or
        a flat run (an admission's uncached prompt tokens; the last block's tail reads 0)."""
        if tokens.ndim == 2:
            self.block_tokens[block_ids] = tokens
            return
        bs = self.block_size
        m = -(-len(tokens) // bs)
        padded = np.zeros(m * bs, dtype=np.int32)
        padded[: len(tokens)] = tokens
        self.block_tokens[block_ids[:m]] = padded.reshape(m, bs)

    def copy_tokens(self, dst: IntArray, src: IntArray) -> None:
        """Blocks `dst` hold copies of blocks `src` (copy-on-write)."""
        self.block_tokens[dst] = self.block_tokens[src]

    def publish(self, rows: IntArray, computed: IntArray | None) -> None:
        """`mark_computed`: KV is written for tokens [0, computed[i]) of each row (all when None); publish
        the full blocks among them.

        One rule advances the rows' computed and published counts: `hotpath.Backend.publish_computed`
        (its Python specification, mirrored in C), in one backend call for the whole batch. With the
        built-in key functions it also keys and indexes the newly full blocks; with a custom key function,
        per-block extras or `verify_hits` it keys nothing (no key lists) and `_publish_rows` publishes the
        blocks it advanced over, block range by block range.
        """
        t, index = self.tables, self.index
        generic = self._kind is None or self._rows_with_extras > 0 or self.verify_hits
        before = t.num_published[rows] if generic or self._reads_published else None  # a copy (fancy indexing)
        key_lists: list[list[Key] | None] = [None] * len(self.key_lists) if generic else self.key_lists
        kind = hotpath.SHA256 if self._kind is None else self._kind
        stored = self.hot.publish_computed(
            kind, index.arrays, key_lists, self.key_epochs, self.epoch, rows, computed, t.counts(), self.block_tokens
        )
        index.stored(stored)
        if before is None:
            return
        after = t.num_published[rows]
        todo = after > before
        if generic and todo.any():
            stored = self._publish_rows(rows[todo], before[todo], after[todo])
        elif self.partial_reuse:
            self._link(rows, before, after)
        if stored and index.record_events:
            self._report_parents(rows[todo], before[todo], after[todo], set(stored))

    def _report_parents(self, rows: IntArray, starts: IntArray, stops: IntArray, stored: set[int]) -> None:
        """The parent keys and tokens (the mirror) of the blocks just indexed, `stored`, among blocks
        [starts[i], stops[i]) of each row, for the event feeds (`PrefixIndex.remember_origins`)."""
        table, by_row, mirror = self.tables.table, self.by_row, self.block_tokens
        for row, start, stop in zip(rows.tolist(), starts.tolist(), stops.tolist()):
            keys = by_row[row]
            if keys is not None:
                ids = table[row, start:stop].tolist()
                self.index.remember_origins(keys.keys, start, ids, mirror[ids], stored)

    def match(self, tokens: npt.NDArray[np.int32], keys: BlockKeys, max_blocks: int) -> list[int]:
        """Leading cached blocks of `tokens` (at most `max_blocks`), stopping at the first miss."""
        was = keys.epoch
        keys.bind(self.key_fn, self.epoch)
        if keys.epoch != was and was >= 0:  # keys attached to a live row (epoch >= 0) rebound: follow them
            for row, held in enumerate(self.by_row):
                if held is keys:
                    self.key_epochs[row] = keys.epoch
        if self._kind is None or keys.block_extra:
            hits = self._match_generic(tokens, keys, max_blocks)
        else:
            hits = self.hot.match(self._kind, self.index.index, keys.keys, tokens, self._width, max_blocks)
        if self.verify_hits and hits:
            bs = self.block_size
            same = (self.block_tokens[hits] == tokens[: len(hits) * bs].reshape(-1, bs)).all(axis=1)
            origin, extra = self.origin, keys.block_extra
            same &= np.array(
                [origin[b] == (self.epoch, keys.salt, keys.extra, extra.get(i, b"")) for i, b in enumerate(hits)]
            )
            if not same.all():  # a key collision: stop before the first block whose tokens differ
                self.verify_failures += 1
                del hits[int(np.argmin(same)) :]
        return hits

    def miss_reason(self, tokens: npt.NDArray[np.int32], keys: BlockKeys, num_hits: int) -> str:
        """Why block `num_hits` of `tokens` did not hit (a query; `misses.miss_reason`)."""
        return miss_reason(self, self.misses, tokens, keys, num_hits)

    def _match_generic(self, tokens: npt.NDArray[np.int32], keys: BlockKeys, max_blocks: int) -> list[int]:
        bs, lookup = self.block_size, self.index.lookup
        hits: list[int] = []
        for i in range(max_blocks):
            block_id = lookup(keys.key(i, tokens[i * bs : (i + 1) * bs]))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _publish_rows(self, rows: IntArray, starts: IntArray, upto: IntArray) -> list[int]:
        """Key and index blocks [starts[i], upto[i]) of each row (`publish`'s path for custom key functions,
        per-block extras and `verify_hits`; the counts are advanced already); returns the blocks indexed.

        One gather of the blocks' ids for the whole batch, then one backend call where the key function is
        built in: keys not known yet are hashed (keys computed at admission are reused), and each block
        enters the index unless another block already holds its key.
        """
        t = self.tables
        counts = upto - starts
        if len(rows) == 1:  # one sequence (an admitted prompt): its blocks are one slice of its row
            block_ids = t.table[rows[0], starts[0] : upto[0]].astype(np.int64)
        elif counts.max() == 1:  # decode: each row filled exactly one block
            block_ids = t.table[rows, starts].astype(np.int64)
        else:
            owner = np.repeat(rows, counts)
            first = np.cumsum(counts) - counts
            block_ids = t.table[owner, np.arange(len(owner)) + np.repeat(starts - first, counts)].astype(np.int64)
        by_row = self.by_row
        seq_keys = [by_row[row] for row in rows.tolist()]
        epoch = self.epoch
        lists = [k.keys for k in seq_keys if k.epoch == epoch and not k.block_extra]
        if self._kind is not None and len(lists) == len(seq_keys):
            stored = self.hot.publish_rows(
                self._kind, self.index.arrays, lists, starts, upto, self.block_tokens, self._width, block_ids
            )
            self.index.stored(stored)
        else:
            stored = self._publish_generic(seq_keys, starts, upto, self.block_tokens[block_ids], block_ids)
        if stored and self.verify_hits:
            self._record_origins(seq_keys, starts, upto, block_ids, stored)
        if stored and self.partial_reuse:
            self._link(rows, starts, upto)
        return stored

    def _link(self, rows: IntArray, starts: IntArray, stops: IntArray) -> None:
        """Link blocks [starts[i], stops[i]) of each row under their parents' keys (partial reuse)."""
        table, epoch = self.tables.table, self.epoch
        for row, start, stop in zip(rows.tolist(), starts.tolist(), stops.tolist()):
            keys = self.by_row[row]
            if stop <= start or keys is None or keys.block_extra or keys.epoch != epoch or len(keys.keys) <= stop:
                continue
            self.index.link(keys.keys[start:stop], keys.keys[start + 1 : stop + 1], table[row, start:stop].tolist())

    def partial_match(self, tokens: npt.NDArray[np.int32], keys: BlockKeys, num_hits: int, min_tokens: int) -> tuple[int, int]:
        """(source block, tokens) for partial reuse of block `num_hits` of `tokens`: the cached block after the
        same parent sharing the most leading tokens with it (at least `min_tokens`, never the last token
        nor a whole block), or (-1, 0)."""
        children = self.index.children
        if children is None or keys.block_extra or len(keys.keys) <= num_hits:
            return -1, 0
        bs = self.block_size
        start = num_hits * bs
        limit = min(len(tokens) - 1 - start, bs - 1)
        candidates = children.get(keys.keys[num_hits]) if limit >= max(min_tokens, 1) else None
        if not candidates:
            return -1, 0
        same = self.block_tokens[candidates, :limit] == tokens[start : start + limit]
        run = np.cumprod(same, axis=1).sum(axis=1)
        best = int(np.argmax(run))
        return (candidates[best], int(run[best])) if run[best] >= max(min_tokens, 1) else (-1, 0)

    def _record_origins(
        self, seq_keys: list[BlockKeys], starts: IntArray, upto: IntArray, block_ids: IntArray, stored: list[int]
    ) -> None:
        new = set(stored)
        ids = block_ids.tolist()
        pos = 0
        for keys, start, stop in zip(seq_keys, starts.tolist(), upto.tolist()):
            for i in range(start, stop):
                if ids[pos] in new:
                    self.origin[ids[pos]] = (self.epoch, keys.salt, keys.extra, keys.block_extra.get(i, b""))
                pos += 1

    def _publish_generic(
        self, seq_keys: list[BlockKeys], starts: IntArray, upto: IntArray, data: npt.NDArray[np.int32],
        block_ids: IntArray,
    ) -> list[int]:  # fmt: skip
        """`publish` for custom key functions, per-block extra keys and rows keyed under an old epoch."""
        new_keys: list[Key] = []
        new_ids: list[int] = []
        ids = block_ids.tolist()
        pos = 0
        for keys, start, stop in zip(seq_keys, starts.tolist(), upto.tolist()):
            segment = range(pos, pos + stop - start)
            pos += stop - start
            if keys.epoch != self.epoch:  # computed under weights of an earlier epoch: never matchable
                continue
            new_keys += (keys.key(i, data[j]) for i, j in zip(range(start, stop), segment))
            new_ids += ids[segment.start : segment.stop]
        return self.index.insert(new_keys, new_ids)
