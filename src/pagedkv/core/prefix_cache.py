"""The prefix cache's hot paths: matching a prompt's leading blocks, and publishing written blocks.

It owns what makes KV content addressable: the key function and the cache epoch, each live sequence's
`BlockKeys`, and a mirror of every block's token ids (the KV content in token form: hashing, verify-on-hit
and copy-on-write read it). The block pool owns the key <-> block index; the manager decides when to call.

Publishing is the per-block loop of prefix caching, so it is written for speed: one gather and one
`tobytes` for a whole batch of rows, one hashlib call per block whose key is not known yet, a bulk index
insert for a fresh prompt, and a one-block fast path for decode.
"""

from __future__ import annotations

import hashlib

import numpy as np
import numpy.typing as npt

from pagedkv.core.pool import BlockPool, CacheEvent
from pagedkv.core.prefix import BlockKeys, Key, KeyFunction, fast_key, sha256_key
from pagedkv.core.table import BlockTables

IntArray = npt.NDArray[np.int64]


class PrefixCache:
    def __init__(
        self, pool: BlockPool, tables: BlockTables, block_size: int, key_fn: KeyFunction, *, enabled: bool,
        verify_hits: bool,
    ) -> None:  # fmt: skip
        self.pool = pool
        self.tables = tables
        self.block_size = block_size
        self.key_fn = key_fn
        self.verify_hits = verify_hits
        self.epoch = 0
        self.verify_failures = 0
        self.keys: dict[int, BlockKeys] = {}  # live sequence -> its block keys
        num_blocks = pool.num_blocks if enabled else 0
        self.block_tokens = np.zeros((num_blocks, block_size), np.int32)

    def match(self, tokens: npt.NDArray[np.int32], keys: BlockKeys, max_blocks: int) -> list[int]:
        """Leading cached blocks of `tokens` (at most `max_blocks`), stopping at the first miss."""
        keys.bind(self.key_fn, self.epoch)
        bs, index, known, key_of = self.block_size, self.pool.index, keys.keys, self.pool.key_of
        hits: list[int] = []
        for i in range(max_blocks):
            block_tokens = tokens[i * bs : (i + 1) * bs]
            key = known[i + 1] if i + 1 < len(known) else keys.key(i, block_tokens)
            block_id = index.get(key)
            if block_id is None or key_of[block_id] != key:  # a miss, or a stale entry of an evicted block
                break
            if self.verify_hits and not np.array_equal(self.block_tokens[block_id], block_tokens):
                self.verify_failures += 1
                break
            hits.append(block_id)
        return hits

    def publish(self, rows: IntArray, upto: IntArray) -> None:
        """Give blocks [num_published, upto) of each row their keys: the hot loop of prefix caching.

        One gather and one `tobytes` for the whole batch, then one hashlib call per block whose key is
        not known yet (keys looked up at admission are reused).
        """
        t, pool = self.tables, self.pool
        starts = t.num_published[rows]
        t.num_published[rows] = upto
        counts = upto - starts
        if len(rows) == 1:  # one sequence (an admitted prompt): its blocks are one slice of its row
            block_ids = t.table[rows[0], starts[0] : upto[0]]
        elif counts.max() == 1:  # decode: each row filled exactly one block
            block_ids = t.table[rows, starts]
        else:
            owner = np.repeat(rows, counts)
            first = np.cumsum(counts) - counts
            block_ids = t.table[owner, np.arange(len(owner)) + np.repeat(starts - first, counts)]
        data = self.block_tokens[block_ids].tobytes()
        ids = block_ids.tolist()
        width = self.block_size * 4
        index, key_of, keyed = pool.index, pool.key_of, pool.keyed
        inline, sha = self.key_fn is sha256_key or self.key_fn is fast_key, hashlib.sha256
        stored: list[int] = []
        pos = 0
        for row, start, stop in zip(rows.tolist(), starts.tolist(), upto.tolist()):
            keys = self.keys[row]
            count = stop - start
            if keys.epoch != self.epoch:  # computed under weights of an earlier epoch: never matchable
                pos += count
                continue
            known = keys.keys
            if count == 1 and len(known) == stop and inline and not keys.block_extra:
                # the decode case: one newly filled block, its key chained from the last one
                chunk = data[pos * width : (pos + 1) * width]
                parent = known[-1]
                key: Key
                if isinstance(parent, bytes):  # sha256 chains bytes, the fast key ints
                    key = sha(parent + chunk).digest()
                else:
                    key = hash((parent, chunk, b""))
                known.append(key)
                block_id = ids[pos]
                pos += 1
                if key_of[block_id] is None and ((other := index.get(key)) is None or key_of[other] != key):
                    index[key] = block_id
                    key_of[block_id] = key
                    stored.append(block_id)
                continue
            if len(known) <= stop:
                self._extend_keys(keys, start, stop, data[pos * width : (pos + count) * width])
            segment = known[start + 1 : stop + 1]
            segment_ids = ids[pos : pos + count]
            pos += count
            if (
                count > 1
                and index.keys().isdisjoint(segment)
                and not keyed[block_ids[pos - count : pos]].any()
                and len(set(segment)) == count
            ):
                # the common case, a fresh prompt: nothing to de-duplicate, insert in bulk
                index.update(zip(segment, segment_ids))
                boxed = np.empty(count, dtype=object)
                boxed[:] = segment
                fresh = block_ids[pos - count : pos]
                key_of[fresh] = boxed
                keyed[fresh] = True
                if pool.record_events:
                    pool.events.extend(CacheEvent("stored", k, b) for k, b in zip(segment, segment_ids))
                continue
            for key, block_id in zip(segment, segment_ids):
                if key_of[block_id] is None and ((other := index.get(key)) is None or key_of[other] != key):
                    index[key] = block_id
                    key_of[block_id] = key
                    stored.append(block_id)
        if stored:
            keyed[stored] = True
            if pool.record_events:
                pool.events.extend(CacheEvent("stored", key_of[b], b) for b in stored)
        pool._maybe_compact()

    def _extend_keys(self, keys: BlockKeys, start: int, stop: int, data: bytes) -> None:
        """Hash blocks [len(keys) .. stop) of a row from their token bytes (`data` covers [start, stop))."""
        known = keys.keys
        width = self.block_size * 4
        first = len(known) - 1
        assert first >= start, "manager: block keys fell behind the published blocks"
        chunk = data[(first - start) * width :]
        if keys.block_extra:
            for j in range(stop - first):
                known.append(self.key_fn(known[-1], chunk[j * width : (j + 1) * width], keys.block_extra.get(first + j, b"")))
        elif self.key_fn is sha256_key:
            sha, parent = hashlib.sha256, known[-1]
            assert isinstance(parent, bytes), "manager: sha256 keys chain from bytes"
            for j in range(0, len(chunk), width):  # inlined: one hashlib call per published block
                parent = sha(parent + chunk[j : j + width]).digest()
                known.append(parent)
        elif self.key_fn is fast_key:
            parent = known[-1]
            for j in range(0, len(chunk), width):
                parent = hash((parent, chunk[j : j + width], b""))
                known.append(parent)
        else:
            for j in range(stop - first):
                known.append(self.key_fn(known[-1], chunk[j * width : (j + 1) * width], b""))

    # --- release --------------------------------------------------------------------------------
