"""The core's per-element loops, in two interchangeable backends, and their contract (written here once).

Everything else in the core is batched numpy. These are the loops numpy cannot batch (a block's key chains
from its parent's, and the prefix index is a Python dict) and the few batch calls of every scheduler step
whose numpy form costs a dozen small array operations each. Each keeps its C version because it pays: the
figure after each is the allocator loop's us/token with that one function taken from the Python
specification over all C (`benchmarks/native_payoff.py`, Azure conv 3,000 requests / Mooncake 1,000,
median of 3 interleaved runs on a shared 2-core machine, so +-3% noise; measured 2026-12-01 after issue
12's reshaping; all Python is 2.69x / 2.70x):

- `match`: walk a prompt's leading blocks, computing missing keys, until the first block not in the cache
  (1.04x / 1.07x; more on prompts that hit more);
- `publish_rows`: give the newly written full blocks of a batch of sequences their keys and index them
  (the publishing path when `mark_computed` cannot use `publish_computed`: with `verify_hits`, or while a
  live sequence has per-block extras; 1.71x with `verify_hits` on Azure, unused otherwise);
- `forget_keys`: drop the keys of evicted blocks, marking them in a bitmap for the miss reasons (1.10x /
  1.15x before the bitmap; a dict of evicted keys instead cost 18% of the loop at 16,384 blocks);
- `check_rows`: validate a batch of sequence handles (live, on the device, distinct) in one pass
  (1.18x / 1.13x);
- `growth` / `grow`: a decode step's append: count the new blocks, then write them and the new tokens
  (1.08x / 1.07x and 1.27x / 1.23x);
- `publish_computed`: a whole `mark_computed`: advance the computed counts, publish the newly full blocks
  (1.86x / 1.88x); the one place `num_computed` and `num_published` advance (`table.py` writes them
  only over a row's life), for every key function: `PrefixCache.publish` passes no key lists where it
  keys the blocks itself;
- `take_live`: eviction's scan of an LRU queue with lazily deleted entries (1.19x / 1.14x);
- `release_refs`: the pool's `release`: drop a sequence's references, push the blocks that become free
  and list those that become cached-free, in one pass (it replaced eight numpy calls per freed sequence:
  7% of the allocator loop's instructions, `benchmarks/allocator_instructions.py`, docs/cache-policy.md).

The hybrid manager's KV cache groups (`hybrid.py`) run the same loops, each group under its own
group-qualified keys (`group_key`: the content key with the group appended, as the prefix index holds a
group's copy of a block):

- `match(..., group=g)`: a full group's walk of a prompt's leading blocks, asking for group g's copies;
- `extend_keys`: compute a prompt's keys up to a block without looking anything up (the windowed groups'
  lookups need the keys of every block up to the hit);
- `publish_groups`: a whole hybrid `mark_computed`: advance every group's computed counts, then key each
  row's newly full blocks once from its token ids (`TokenRows`) and index them in every group that has
  not published them yet. The hybrid bench figure with and without these is in docs/benchmarks.md.

Two backends implement `Backend`: `PythonBackend` below, the specification (plain Python and numpy, also
the fallback), and `pagedkv.core._native`, a small C extension with exactly these functions (and its own
SHA-256), built when the package is installed with a C compiler at hand (disable it with
`PAGEDKV_NATIVE=0`). tests/core/test_native*.py run both on the same random states and compare results,
errors and every structure they mutate. The extension's header and stub point here rather than restate
this contract.

Contract of both backends (`kind` is `SHA256` or `FAST`):

- key of a block = `sha256(parent + block bytes).digest()` (SHA256) or `hash((parent, block bytes, b""))`
  (FAST), where block bytes are its token ids as little-endian int32 (`width` bytes): `match` reads them
  from the prompt's tokens, `publish_rows` and `publish_computed` from the whole block store, by block id;
- `index` (key -> block id), `key_of` (block id -> key or None) and `keyed` (bool per block) are the
  prefix index's own structures (`prefix_index.PrefixIndex.arrays`), handed over by their two callers:
  the index itself (`forget_keys`) and the prefix cache's publishing rule (`publish_computed`,
  `publish_rows`, `match`). The index holds no stale entry (`index[key] == b` exactly when `key_of[b] == key`), and the
  functions rely on it: an entry found in the index is a hit, and publishing a block whose key is in the
  index leaves the block private (not indexed), so the index stays a map and events stay exact;
- errors: argument checks happen before anything changes; an error inside a loop (a row whose keys end
  before its first block to publish, a block store too short for a block to hash, an error from hashing
  or comparing keys) leaves the work done so far in place, identically in both backends;
- where the C is stricter (tested): `index` must be a dict, `key_of`, `known`, each row of `key_lists`
  and each key list of `seq_keys`
  lists, of exactly those types; integer arrays C-contiguous 1-D int64 (or lists of ints); `match`'s
  `data` must hold every block it has to hash (the reference would hash a short slice).
"""

from __future__ import annotations

import hashlib
import importlib
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

SHA256 = 0
FAST = 1

Key = bytes | int

MAX_GROUPS = 256  # a KV cache group rides in one byte of its keys
_GROUP_BYTE = [bytes((g,)) for g in range(MAX_GROUPS)]


def group_key(key: Key, group: int) -> Key:
    """The key of content `key` in KV cache group `group`: one byte appended to a bytes key, `key * 256 +
    group` for an int key (`group_keys.py` says why)."""
    if isinstance(key, bytes):
        return key + _GROUP_BYTE[group]
    return key * MAX_GROUPS + group


I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]
Flags = npt.NDArray[np.bool_]


class IndexArrays(NamedTuple):
    """The prefix index's own structures, handed to the backend as one value (`PrefixIndex.arrays`)."""

    by_key: dict[Any, int]  # the index: key -> block id
    key_of: list[Any]  # block id -> key or None
    keyed: Flags  # key_of[b] is not None


class TableArrays(NamedTuple):
    """The block tables' per-row counts and the table itself (`BlockTables`), handed over as one value."""

    num_tokens: I64
    num_computed: I64
    hashable: I64
    num_published: I64
    table: I32


class Backend(Protocol):
    """The functions both backends provide; `PythonBackend` documents each one."""

    NAME: str

    def match(
        self, kind: int, index: dict[Any, int], known: list[Any], data: I32, width: int, max_blocks: int,
        group: int | None = None,
    ) -> list[int]: ...  # fmt: skip

    def extend_keys(self, kind: int, known: list[Any], data: Any, width: int, stop: int) -> None: ...

    def publish_groups(
        self, kind: int, prefix: IndexArrays, seq_keys: list[list[Any] | None], rows: I64, computed: I64 | None,
        groups: tuple[TableArrays, ...], tokens: I32, block_size: int,
    ) -> list[int]: ...  # fmt: skip

    def publish_rows(
        self, kind: int, prefix: IndexArrays, key_lists: Sequence[list[Any]], starts: I64, stops: I64,
        blocks: I32, width: int, ids: I64,
    ) -> list[int]: ...  # fmt: skip

    def forget_keys(self, prefix: IndexArrays, ids: I64, dropped: Any = None) -> None: ...

    def check_rows(self, on_device: Flags, mark: I64, rows: I64) -> int: ...

    def release_refs(self, ref: I32, keyed: Flags, ids: I64, stack: I64, top: int, out: I64) -> tuple[int, int]: ...

    def growth(self, rows: I64, num_tokens: I64, num_blocks: I64, k: int, block_size: int) -> tuple[int, int]: ...

    def take_live(
        self, queue_ids: I64, queue_stamps: I64, head: int, tail: int, stamp: I64, out: I64, filled: int
    ) -> tuple[int, int]: ...

    def publish_computed(
        self, kind: int, prefix: IndexArrays, seq_keys: list[list[Any] | None], epochs: I64, epoch: int, rows: I64,
        computed: I64 | None, tables: TableArrays, blocks: I32,
    ) -> list[int]: ...  # fmt: skip

    def grow(
        self, rows: I64, num_tokens: I64, num_blocks: I64, table: I32, k: int, block_size: int, ids: I64,
        tokens: I32 | None, block_tokens: I32 | None,
    ) -> None: ...  # fmt: skip


def _chain(kind: int, parent: Key, chunk: bytes) -> Key:
    if kind == SHA256:
        assert isinstance(parent, bytes), "hotpath: sha256 keys chain from bytes"
        return hashlib.sha256(parent + chunk).digest()
    return hash((parent, chunk, b""))


def _as_bytes(data: Any) -> bytes:
    return data.tobytes() if isinstance(data, np.ndarray) else bytes(data)


def evicted_slot(key: Any) -> int:
    """Where the memory of evicted keys keeps `key`: for a bytes key its first 8 bytes read little-endian
    xor its last 8 read big-endian (keys are digests, so the low bits are uniform, and a hybrid key's last
    byte, its group, lands in the low bits too), else `hash(key)` (an int key's hash is itself). Python
    salts `hash()` of bytes per process, so the slot must not use it: a run's miss reasons would change with
    PYTHONHASHSEED."""
    if isinstance(key, bytes):
        return int.from_bytes(key[:8], "little") ^ int.from_bytes(key[-8:], "big")
    return hash(key)


def _as_list(values: Any) -> list[int]:
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


def _extend_keys(kind: int, known: list[Any], data: bytes, width: int) -> None:
    """Append the keys of the consecutive `width`-byte blocks in `data`, chained from `known[-1]`."""
    parent = known[-1]
    if kind == SHA256:
        sha = hashlib.sha256
        for off in range(0, len(data), width):
            parent = sha(parent + data[off : off + width]).digest()
            known.append(parent)
    else:
        for off in range(0, len(data), width):
            parent = hash((parent, data[off : off + width], b""))
            known.append(parent)


def _index_blocks(
    index: dict[Any, int], key_of: list[Any], keyed: Any, keys: list[Any], ids: list[int], stored: list[int]
) -> None:
    """Index block ids[i] under keys[i], unless it holds a key already or the key is in the index (another
    block holds it; this one stays private). Stored ids go to `stored`, and to `keyed` (a bool array, or
    None)."""
    for key, b in zip(keys, ids):
        if key_of[b] is None and key not in index:
            index[key] = b
            key_of[b] = key
            if keyed is not None:
                keyed[b] = True
            stored.append(b)


def _check_publish_groups(
    prefix: Any, seq_keys: list[Any], rows: Any, computed: Any, groups: Any, tokens: Any, block_size: int
) -> None:
    """`publish_groups`' argument checks (its docstring), all before anything changes."""
    if not (isinstance(prefix, tuple) and len(prefix) == 3):
        raise TypeError("publish_groups: prefix must be a tuple (index, key_of, keyed)")
    if not (isinstance(groups, tuple) and 1 <= len(groups) <= MAX_GROUPS and all(
        isinstance(t, tuple) and len(t) == 5 for t in groups
    )):  # fmt: skip
        raise TypeError("publish_groups: groups must be a tuple of 1 to 256 (num_tokens, num_computed, "
                        "hashable, num_published, table) tuples")  # fmt: skip
    if block_size < 1:
        raise ValueError(f"publish_groups: block_size must be >= 1, not {block_size}")
    key_of, keyed = prefix[1], prefix[2]
    if keyed is None or len(keyed) < len(key_of):
        raise TypeError("publish_groups: keyed must be a writable 1-byte array at least as long as key_of")
    row_list, computed_list = _as_list(rows), _as_list(computed)
    if len(row_list) != len(computed_list):
        raise ValueError(f"publish_groups: {len(row_list)} rows but {len(computed_list)} computed counts")
    n = min(len(seq_keys), tokens.shape[0], *(len(a) for t in groups for a in t))
    for r, c in zip(row_list, computed_list):
        if not 0 <= r < n:
            raise IndexError(f"publish_groups: row {r} out of range")
        if c < 0:
            raise ValueError(f"publish_groups: row {r} has {c} computed tokens")
        for _, _, hashable, published, table in groups:
            _check_blocks_to_publish(r, min(c, int(hashable[r])) // block_size, max(int(published[r]), 0), table,
                                     tokens.shape[1] // block_size, len(key_of))  # fmt: skip


def _check_blocks_to_publish(r: int, full: int, start: int, table: Any, token_blocks: int, num_keys: int) -> None:
    if full <= start:
        return
    if full > table.shape[1] or full > token_blocks:
        raise ValueError(f"publish_groups: row {r} publishes {full} blocks, past its table or tokens")
    ids = table[r, start:full]
    if ids.min() < 0 or ids.max() >= num_keys:
        raise IndexError(f"publish_groups: block id {int(ids.min())} out of range")


class PythonBackend:
    """The specification (and the fallback when the C extension is not built)."""

    NAME = "python"

    @staticmethod
    def match(
        kind: int, index: dict[Any, int], known: list[Any], data: Any, width: int, max_blocks: int,
        group: int | None = None,
    ) -> list[int]:  # fmt: skip
        """Leading blocks of `data` (token bytes) found in the index, at most `max_blocks`.

        `known[0]` is the root key and `known[i + 1]` block i's key; keys missing from `known` are computed
        in order and appended (including the key of the first block that misses). With a `group` (an int in
        [0, 256)) the index is asked for `group_key(key, group)`, that group's copy of the block.
        """
        if group is not None and not 0 <= group < MAX_GROUPS:
            raise ValueError(f"match: group must be None or in [0, {MAX_GROUPS}), not {group}")
        buf = _as_bytes(data)
        hits: list[int] = []
        for i in range(max_blocks):
            if i + 1 < len(known):
                key = known[i + 1]
            else:
                key = _chain(kind, known[-1], buf[i * width : (i + 1) * width])
                known.append(key)
            block_id = index.get(key if group is None else group_key(key, group))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    @staticmethod
    def publish_rows(
        kind: int, prefix: IndexArrays, key_lists: Sequence[list[Any]], starts: Any, stops: Any, blocks: Any,
        width: int, ids: Any,
    ) -> list[int]:  # fmt: skip
        """Publish blocks [starts[r], stops[r]) of each row r; returns the block ids that entered the index.

        `prefix` is the tuple (index, key_of, keyed) (`IndexArrays`; keyed may be None).

        `ids` holds those blocks' ids, row after row; `blocks` is the whole block store, a C-contiguous
        buffer with block b's token bytes at `blocks[b * width : (b + 1) * width]` (the pool's int32
        matrix of all blocks' tokens). Row r's keys are `key_lists[r]` (root first); it must hold at least
        `starts[r] + 1` keys, and is extended to `stops[r] + 1` by chaining over its blocks' bytes, read
        through their ids. A block b enters the index only if `key_of[b]` is None and its key is not in
        the index: then
        `index[key] = b`, `key_of[b] = key` and, if `keyed` is given (a writable C-contiguous 1-D array
        of 1-byte items, e.g. numpy bool, at least `len(key_of)` long), `keyed[b] = True`.

        Checked before anything changes: TypeError if `prefix` is not a 3-tuple, IndexError if an id to
        publish is outside [0, len(key_of)) (negative ids included), TypeError or ValueError for a `keyed`
        of the wrong kind or length. Checked in the loop (the rows before stay published): ValueError if a
        row's keys end before its start, or if `blocks` ends before the bytes of a block id it has to hash.
        """
        if not (isinstance(prefix, tuple) and len(prefix) == 3):
            raise TypeError("publish_rows: prefix must be a tuple (index, key_of, keyed)")
        keyed: Any  # any writable buffer of 1-byte items, or None (checked below)
        index, key_of, keyed = prefix
        view = memoryview(blocks).cast("B")  # C-contiguous bytes, no copy (TypeError otherwise)
        block_ids = _as_list(ids)
        total = sum(stop - start for start, stop in zip(_as_list(starts), _as_list(stops)))
        used = block_ids[:total]
        if used and not (min(used) >= 0 and max(used) < len(key_of)):
            raise IndexError("publish_rows: block id out of range of key_of")
        if keyed is not None:
            flags = memoryview(keyed)
            if flags.readonly or flags.itemsize != 1 or flags.ndim != 1 or not flags.c_contiguous:
                raise TypeError("publish_rows: keyed must be a writable 1-D array of 1-byte items")
            if flags.nbytes < len(key_of):
                raise ValueError("publish_rows: keyed is shorter than key_of")
        stored: list[int] = []
        pos = 0
        for known, start, stop in zip(key_lists, _as_list(starts), _as_list(stops)):
            have = len(known) - 1
            if have < start:
                raise ValueError("publish_rows: a row's keys end before its first block to publish")
            to_hash = block_ids[pos + have - start : pos + stop - start]
            short = next((b for b in to_hash if (b + 1) * width > view.nbytes), None)
            reachable = to_hash if short is None else to_hash[: to_hash.index(short)]
            _extend_keys(kind, known, b"".join(view[b * width : (b + 1) * width] for b in reachable), width)
            if short is not None:  # the keys before it are kept, as the C code does
                raise ValueError(f"publish_rows: blocks ({view.nbytes} bytes) ends before block id {short}")
            _index_blocks(index, key_of, keyed, known[start + 1 : stop + 1], block_ids[pos : pos + stop - start], stored)
            pos += stop - start
        return stored

    @staticmethod
    def forget_keys(prefix: IndexArrays, ids: Any, dropped: Any = None) -> None:
        """Eviction: drop the keys of blocks `ids` from `key_of`, and from the index where it maps to them;
        `prefix` is the tuple (index, key_of, keyed) (`IndexArrays`). `keyed` is left to the owner, who
        clears it for all `ids` in one numpy call. With a bitmap `dropped` (a writable 1-D array of 1-byte
        items, its length a power of two), each dropped key sets bit `s % 8` of `dropped[s // 8]`, where
        `s = evicted_slot(key) & (8 * len - 1)`: the prefix index's memory of evicted keys. TypeError if `prefix` is not a 3-tuple or `dropped` is not
        such a bitmap (checked before anything changes)."""
        if not (isinstance(prefix, tuple) and len(prefix) == 3):
            raise TypeError("forget_keys: prefix must be a tuple (index, key_of, keyed)")
        mask = -1
        if dropped is not None:
            try:
                view = memoryview(dropped)
            except TypeError:
                view = memoryview(b"")  # refused below
            if view.readonly or view.itemsize != 1 or view.ndim != 1 or not view.c_contiguous or not view.nbytes or (
                view.nbytes & (view.nbytes - 1)
            ):
                raise TypeError("forget_keys: dropped must be a writable 1-D array of 1-byte items, its length a power of two")
            mask = 8 * view.nbytes - 1
        index, key_of, _ = prefix
        block_ids = _as_list(ids)
        if block_ids and not (min(block_ids) >= 0 and max(block_ids) < len(key_of)):
            raise IndexError("forget_keys: block id out of range of key_of")
        for block_id in block_ids:
            key = key_of[block_id]
            if key is not None:
                if index.get(key) == block_id:
                    del index[key]
                if dropped is not None:
                    slot = evicted_slot(key) & mask
                    dropped[slot >> 3] |= 1 << (slot & 7)
                key_of[block_id] = None

    @staticmethod
    def check_rows(on_device: Any, mark: Any, rows: Any) -> int:
        """1 if a row is outside `on_device` or not on the device, else 2 if one repeats, else 0.

        `mark` is an int64 scratch array at least as long as `on_device` (the positions of the rows are
        written into it and read back: a repeated row reads a later position).
        """
        if len(rows) == 0:
            return 0
        if rows.min() < 0 or rows.max() >= len(on_device) or not on_device[rows].all():
            return 1
        positions = np.arange(len(rows))
        mark[rows] = positions
        return 2 if (mark[rows] != positions).any() else 0

    @staticmethod
    def publish_computed(
        kind: int, prefix: IndexArrays, seq_keys: list[list[Any] | None], epochs: Any, epoch: int, rows: Any,
        computed: Any, tables: TableArrays, blocks: Any,
    ) -> list[int]:  # fmt: skip
        """`mark_computed` for a batch of distinct rows, with `prefix` = (index, key_of, keyed) and `tables` =
        (num_tokens, num_computed, hashable, num_published, table) (tuples, e.g. `IndexArrays`, `TableArrays`): row i (r = rows[i]) has computed[i] tokens computed
        (num_tokens[r] when computed is None); its full blocks not published yet, [num_published[r], f)
        with f = min(computed, hashable[r]) // block_size, are published as by `publish_rows` with the keys
        list seq_keys[r] (root first), unless it is None or its keys were computed under another epoch
        (epochs[r] != epoch, `epochs` an int64 array by row): then they stay private.
        Block j's id is table[r, j]; `blocks` is the int32 [num_blocks, block_size] token store.

        Which rows publish is found with numpy; each row's missing keys are hashed in one loop.
        """
        if not (isinstance(prefix, tuple) and len(prefix) == 3 and isinstance(tables, tuple) and len(tables) == 5):
            raise TypeError("publish_computed: prefix must be (index, key_of, keyed), tables (num_tokens, "
                            "num_computed, hashable, num_published, table)")  # fmt: skip
        index, key_of, keyed = prefix
        num_tokens, num_computed, hashable, num_published, table = tables
        block_size = blocks.shape[1]
        width = 4 * block_size
        c = num_tokens[rows] if computed is None else np.asarray(computed, dtype=np.int64)
        num_computed[rows] = c
        full = np.minimum(c, hashable[rows]) // block_size
        first = num_published[rows]
        todo = np.flatnonzero(full > first)
        if len(todo) == 0:
            return []
        rows, full, first = rows[todo], full[todo], first[todo]
        num_published[rows] = full
        stored: list[int] = []
        for r, start, stop in zip(rows.tolist(), first.tolist(), full.tolist()):
            known = seq_keys[r]
            if known is None or epochs[r] != epoch:
                continue
            have = len(known) - 1
            if have < start:
                raise ValueError("publish_computed: a row's keys end before its first block to publish")
            if have < stop:  # hash the missing keys, chained from the last known one
                _extend_keys(kind, known, blocks[table[r, have:stop]].tobytes(), width)
            _index_blocks(index, key_of, keyed, known[start + 1 : stop + 1], table[r, start:stop].tolist(), stored)
        return stored

    @staticmethod
    def extend_keys(kind: int, known: list[Any], data: Any, width: int, stop: int) -> None:
        """Extend `known` (root first) to `stop + 1` keys, chaining over the `width`-byte blocks of `data`
        (block j at `data[j * width : (j + 1) * width]`). ValueError if `known` is empty or `data` ends before a
        block it has to hash (the keys computed before it are kept)."""
        if not known:
            raise ValueError("extend_keys: known must start with the root key")
        buf = _as_bytes(data)
        have = len(known) - 1
        if have >= stop:
            return
        reachable = min(stop, len(buf) // width if width else stop)
        if reachable > have:
            _extend_keys(kind, known, buf[have * width : reachable * width], width)
        if reachable < stop:
            raise ValueError(f"extend_keys: data ({len(buf)} bytes) ends before block {max(reachable, have)}")

    @staticmethod
    def publish_groups(
        kind: int, prefix: IndexArrays, seq_keys: list[list[Any] | None], rows: Any, computed: Any,
        groups: tuple[TableArrays, ...], tokens: Any, block_size: int,
    ) -> list[int]:  # fmt: skip
        """A hybrid manager's `mark_computed` over its KV cache groups, for a batch of distinct rows; returns
        the block ids that entered the index.

        `prefix` = (index, key_of, keyed) (`IndexArrays`, keyed a bool array); `groups` holds one `TableArrays`
        per group (group g's table, counts and published counts). Row i (r = rows[i]) has c = computed[i]
        tokens computed (computed None: the least of the groups' num_tokens[r], every token every group
        holds): every group's num_computed[r] = c; group g's full blocks not published yet,
        [num_published[r], f) with f = min(c, hashable[r]) // block_size, are published (num_published[r] = f)
        under g's keys, `group_key(key, g)`, with the rule of `publish_rows` (a block already keyed, or whose
        key another block holds, stays private). The content keys are the row's list seq_keys[r] (root
        first, bound to the current epoch by the caller), extended as far as any group publishes by chaining
        over the row's token ids, row r of the int32 matrix `tokens` (block j at columns [j * bs, (j+1) * bs)).
        A row whose seq_keys[r] is None (no prefix caching) advances its counts and keys nothing.

        Checked before anything changes: TypeError for a malformed `prefix` or `groups` tuple, a `keyed` that
        is not a writable 1-byte array as long as `key_of`; IndexError for a row out of range or a block id
        to publish out of range of key_of; ValueError for a negative computed count, computed and rows of
        different lengths, or blocks to publish past the table's or the tokens' columns.
        """
        if computed is None and isinstance(groups, tuple) and groups and all(isinstance(t, tuple) for t in groups):
            computed = np.min([np.asarray(t[0])[_as_list(rows)] for t in groups], axis=0)
        _check_publish_groups(prefix, seq_keys, rows, computed, groups, tokens, block_size)
        index, key_of, keyed = prefix
        bs = block_size
        stored: list[int] = []
        for r, c in zip(_as_list(rows), _as_list(computed)):
            fulls = []
            for _, num_computed, hashable, _, _ in groups:
                num_computed[r] = c
                fulls.append(min(c, int(hashable[r])) // bs)
            furthest = max((f for f, t in zip(fulls, groups) if f > t[3][r]), default=0)
            if not furthest:
                continue
            known = seq_keys[r]
            if known is not None:
                PythonBackend.extend_keys(kind, known, tokens[r], 4 * bs, furthest)
            for g, ((_, _, _, published, table), full) in enumerate(zip(groups, fulls)):
                start = int(published[r])
                if full <= start:
                    continue
                published[r] = full
                if known is not None:
                    qualified = [group_key(key, g) for key in known[start + 1 : full + 1]]
                    _index_blocks(index, key_of, keyed, qualified, table[r, start:full].tolist(), stored)
        return stored

    @staticmethod
    def take_live(
        queue_ids: Any, queue_stamps: Any, head: int, tail: int, stamp: Any, out: Any, filled: int
    ) -> tuple[int, int]:
        """Eviction's scan of one LRU queue: take live entries (block stamp == entry stamp) from `head` into
        out[filled:], bumping their stamps, until `out` is full or `tail`; returns (new head, filled)."""
        if not (0 <= head <= tail <= len(queue_ids) and 0 <= filled <= len(out)):
            raise ValueError("take_live: needs 0 <= head <= tail <= queue length and 0 <= filled <= len(out)")
        if tail > head and not (queue_ids[head:tail].min() >= 0 and queue_ids[head:tail].max() < len(stamp)):
            raise IndexError("take_live: block id out of range of stamp")
        need = len(out) - filled
        while need and head < tail:
            window = min(tail - head, max(2 * need, 64))
            ids = queue_ids[head : head + window]
            live = np.flatnonzero(stamp[ids] == queue_stamps[head : head + window])[:need]
            head += int(live[-1]) + 1 if len(live) == need else window
            got = ids[live]
            out[filled : filled + len(got)] = got
            stamp[got] += 1
            filled += len(got)
            need -= len(got)
        return head, filled

    @staticmethod
    def release_refs(ref: Any, keyed: Any, ids: Any, stack: Any, top: int, out: Any) -> tuple[int, int]:
        """The pool's `release`: drop one reference from each of `ids` (distinct block ids, the caller's
        contract). A block reaching zero without a key goes on the free stack above `top`, the first of `ids`
        on top (taken first); one with a key is written to `out` (in the order of `ids`) for the eviction
        policy. Returns (the new top, how many were written to `out`). IndexError for an id out of range of
        `ref`; ValueError if a block holds no reference, `out` is shorter than `ids`, `top` is not in
        [0, len(stack)] or the stack has no room (all checked before anything changes)."""
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) and not (int(ids.min()) >= 0 and int(ids.max()) < len(ref)):
            raise IndexError("release_refs: block id out of range of ref")
        if len(out) < len(ids) or not 0 <= top <= len(stack):
            raise ValueError("release_refs: needs len(out) >= len(ids) and 0 <= top <= len(stack)")
        held = ref[ids]
        if len(ids) and int(held.min()) < 1:
            raise ValueError("release_refs: a block holds no reference")
        zero = ids[held == 1]
        flagged = keyed[zero].astype(bool)
        plain = zero[~flagged]
        if top + len(plain) > len(stack):
            raise ValueError("release_refs: no room on the free stack")
        ref[ids] = held - 1
        stack[top : top + len(plain)] = plain[::-1]
        kept = zero[flagged]
        out[: len(kept)] = kept
        return top + len(plain), len(kept)

    @staticmethod
    def growth(rows: Any, num_tokens: Any, num_blocks: Any, k: int, block_size: int) -> tuple[int, int]:
        """For k more tokens in each row: (blocks needed by all rows, widest table row afterwards)."""
        if len(rows) == 0:
            return 0, 0
        held = num_blocks[rows]
        need = np.maximum((num_tokens[rows] + (k + block_size - 1)) // block_size - held, 0)
        return int(need.sum()), int((held + need).max())

    @staticmethod
    def grow(
        rows: Any, num_tokens: Any, num_blocks: Any, table: Any, k: int, block_size: int, ids: Any, tokens: Any,
        block_tokens: Any,
    ) -> None:  # fmt: skip
        """Grow each row by k tokens: its new blocks are the next `ids` (in batch order), appended to its table
        row; the tokens (`[B, k]`, or None) are written into `block_tokens` at their slots."""
        if (tokens is None) != (block_tokens is None):
            raise ValueError("grow: pass tokens and block_tokens together, or neither")
        old, held = num_tokens[rows], num_blocks[rows]
        need = np.maximum((old + (k + block_size - 1)) // block_size - held, 0)
        if int(need.sum()) != len(ids):
            raise ValueError(f"grow: {len(ids)} ids for {int(need.sum())} new blocks")
        if len(ids):
            first = np.cumsum(need) - need
            table[np.repeat(rows, need), np.repeat(held - first, need) + np.arange(len(ids))] = ids
        num_blocks[rows] = held + need
        if tokens is not None:
            pos = old[:, None] + np.arange(k)
            block_tokens[table[rows[:, None], pos // block_size], pos % block_size] = tokens
        num_tokens[rows] = old + k


def load_extension(module: str) -> ModuleType | None:
    """One of pagedkv's optional C extensions (`"pagedkv.core._native"`, `"pagedkv.ops._cpu_decode"`), or None
    where it is not built or `PAGEDKV_NATIVE=0` turns the C code off (the one switch for every extension)."""
    if os.environ.get("PAGEDKV_NATIVE", "1") == "0":
        return None
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def _load_native() -> Backend | None:
    return load_extension("pagedkv.core._native")


NATIVE: Backend | None = _load_native()
PYTHON: Backend = PythonBackend()


def backend(native: bool | None = None) -> Backend:
    """The C extension if built (None), required (True), or the Python reference (False)."""
    if native is False:
        return PYTHON
    if NATIVE is None:
        if native:
            from pagedkv.core.errors import InvalidArgumentError

            raise InvalidArgumentError(
                "native=True but pagedkv's C extension is not built (reinstall with a C compiler present, "
                "and without PAGEDKV_NATIVE=0)"
            )
        return PYTHON
    return NATIVE

