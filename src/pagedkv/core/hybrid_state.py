"""Per-sequence state of `HybridKVManager`, and its lifecycle verbs: fork, free, preempt, rollback, swap.

The block tables (one `BlockTables` per group, rows in lockstep) hold each group's blocks, its `held`
tokens (those with slots), its computed and published counts and the hashable tokens; `TokenRows` holds the
sequence's token ids; `SeqState` holds the rest: priority, block keys, and per group how many leading
entries were released (null). Swapped out, a sequence's table entries are null and its host blocks are
kept here, per group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.group import KVGroupSpec
from pagedkv.core.pool import NULL_BLOCK_ID, BlockPool
from pagedkv.core.prefix import BlockKeys
from pagedkv.core.protocol import BlockMoves
from pagedkv.core.validate import as_rollback

if TYPE_CHECKING:
    from pagedkv.core.copies import CopyLedger
    from pagedkv.core.misses import MissCounter
    from pagedkv.core.table import BlockTables
    from pagedkv.core.token_rows import TokenRows

IntArray = npt.NDArray[np.int64]
ALL_KNOWN = 2**62


@dataclass(slots=True)
class SeqState:
    """One sequence of a hybrid manager (see the module docstring)."""

    priority: int
    keys: BlockKeys | None
    num_groups: int
    prompt_len: int = 0  # tokens at admission: the hit point a re-sent prompt reaches
    released: list[int] = field(default_factory=list)
    host: list[IntArray] | None = None  # while swapped: host blocks of table columns [released, ...)

    def __post_init__(self) -> None:
        self.released = [0] * self.num_groups

    def copy(self) -> SeqState:
        other = SeqState(self.priority, None if self.keys is None else self.keys.copy(), self.num_groups, self.prompt_len)
        other.released = list(self.released)
        return other


def as_groups(groups: object) -> tuple[KVGroupSpec, ...]:
    if not isinstance(groups, Sequence) or not all(isinstance(g, KVGroupSpec) for g in groups):
        raise InvalidArgumentError("groups must be a sequence of KVGroupSpec (one per KV cache group)")
    return tuple(groups)


class HybridLifecycle:
    """Fork, free, preempt, rollback and swap of `HybridKVManager`."""

    pool: BlockPool
    host_pool: BlockPool | None
    tables: list[BlockTables]
    tokens: TokenRows
    groups: tuple[KVGroupSpec, ...]
    seqs: dict[int, SeqState]
    group_of: IntArray
    copies: CopyLedger
    misses: MissCounter
    _block_size: int
    _preemptions: int

    def _new_row(self) -> int:
        raise NotImplementedError

    def _attach_keys(self, row: int, keys: BlockKeys | None) -> None:
        raise NotImplementedError

    def _detach_keys(self, row: int, keys: BlockKeys | None) -> None:
        raise NotImplementedError

    def _real(self, g: int, row: int) -> IntArray:
        """The real (non-null) blocks of a row in group g, in table order."""
        t = self.tables[g]
        return t.table[row, self.seqs[row].released[g] : t.num_blocks[row]].astype(np.int64)

    def free(self, seq_id: int) -> None:
        """Release a finished sequence's blocks in every group (tail first); keyed ones stay cached."""
        row = self.tables[0].row(seq_id)
        seq = self.seqs[row]
        if seq.host is not None:
            assert self.host_pool is not None, "hybrid manager: a swapped sequence without a host pool"
            for host in seq.host:
                self.host_pool.release(host[::-1])
        else:
            for g in range(len(self.tables)):
                self.pool.release(self._real(g, row)[::-1], seq.priority)
        self._detach_keys(row, seq.keys)
        self.misses.forget(row, None)
        del self.seqs[row]
        self.tokens.drop(row)
        for t in self.tables:
            t.drop_row(row)

    def preempt(self, seq_id: int) -> int:
        n = int(self.tokens.length[self.tables[0].row(seq_id)])
        self.free(seq_id)
        self._preemptions += 1
        return n

    def fork(self, seq_id: int) -> int:
        """A new sequence sharing every block that holds `seq_id`'s tokens in every group."""
        row = self.tables[0].device_row(seq_id)
        bs = self._block_size
        child = self._new_row()
        self.seqs[child] = self.seqs[row].copy()
        self.tokens.copy(row, child)
        self._attach_keys(child, self.seqs[child].keys)
        for t in self.tables:
            held = int(t.num_tokens[row])
            blocks = t.blocks_of(row)[: -(-held // bs)]
            t.set_blocks(child, blocks)
            t.num_tokens[child], t.num_computed[child] = held, t.num_computed[row]
            t.num_published[child], t.hashable_tokens[child] = t.num_published[row], t.hashable_tokens[row]
            self.pool.share(blocks[blocks != NULL_BLOCK_ID])
            if held % bs:
                t.cow_risk[row] = t.cow_risk[child] = t.any_cow_risk = True
        return child

    def rollback(self, seq_id: int, num_tokens: int) -> None:
        """Drop the last `num_tokens` tokens. `InvalidArgumentError` if a windowed group already released
        a block the tokens left would need again."""
        row = self.tables[0].device_row(seq_id)
        seq, bs = self.seqs[row], self._block_size
        old = int(self.tokens.length[row])
        new = as_rollback(num_tokens, old, seq_id)
        computed = int(self.tables[0].num_computed[row])
        for g, spec in enumerate(self.groups):
            if seq.released[g] > spec.first_needed(min(new, computed)) // bs:
                raise InvalidArgumentError(f"cannot roll back to {new} tokens: group {g} ({spec.label()}) released blocks it would read again")
        if new == old:
            return
        for g in range(len(self.tables)):
            self._truncate_group(g, row, new)
        self.tokens.truncate(row, new)
        if seq.keys is not None:
            seq.keys.truncate(new // bs, new)

    def _truncate_group(self, g: int, row: int, new: int) -> None:
        t, seq, bs = self.tables[g], self.seqs[row], self._block_size
        keep = max(-(-new // bs), seq.released[g])
        blocks = t.blocks_of(row)
        self.pool.release(blocks[keep:][::-1], seq.priority)
        t.set_blocks(row, blocks[:keep])
        t.num_tokens[row] = min(int(t.num_tokens[row]), new)
        t.num_computed[row] = min(int(t.num_computed[row]), new)
        t.num_published[row] = max(min(int(t.num_published[row]), new // bs), seq.released[g])
        if t.hashable_tokens[row] >= new:
            t.hashable_tokens[row] = ALL_KNOWN
        if new % bs and seq.released[g] <= (new - 1) // bs < len(blocks):
            last = int(blocks[(new - 1) // bs])
            if self.pool.ref[last] > 1:
                t.cow_risk[row] = t.any_cow_risk = True
            else:
                self.pool.prefix_index.remove(last)

    # --- swap -----------------------------------------------------------------------------------

    def _host(self) -> BlockPool:
        if self.host_pool is None:
            raise InvalidArgumentError("swap needs host blocks: construct the manager with num_host_blocks > 0")
        return self.host_pool

    def swap_out(self, seq_id: int) -> BlockMoves | None:
        """Move a sequence's computed KV in every group to host blocks and release its device blocks (held
        but uncomputed slots get fresh blocks at `swap_in`). `None` if the host pool is short."""
        host, bs = self._host(), self._block_size
        row = self.tables[0].device_row(seq_id)
        seq = self.seqs[row]
        computed = int(self.tables[0].num_computed[row])
        counts = [max(-(-computed // bs) - lo, 0) for lo in seq.released]
        if sum(counts) > host.num_available:
            return None
        srcs, dsts = [], []
        seq.host = []
        for g, t in enumerate(self.tables):
            lo = seq.released[g]
            src = t.table[row, lo : lo + counts[g]].astype(np.int64)
            dst = host.allocate(counts[g]) if counts[g] else np.zeros(0, np.int64)
            src = self.copies.source_of(src)  # a pending copy's destination: read its source, which holds that KV
            self.pool.release(self._real(g, row)[::-1], seq.priority)
            t.table[row, lo : t.num_blocks[row]] = NULL_BLOCK_ID
            t.swapped[row], t.on_device[row], t.cow_risk[row] = True, False, False
            t.num_published[row] = lo
            seq.host.append(dst)
            srcs.append(src)
            dsts.append(dst)
        return BlockMoves(np.concatenate(srcs), np.concatenate(dsts))

    def swap_in(self, seq_id: int) -> BlockMoves | None:
        """Bring a swapped-out sequence back into device blocks (its held slots in every group; moves for
        the computed ones). `None` if the device pool is short."""
        host = self._host()
        row = self.tables[0].row(seq_id)
        seq = self.seqs[row]
        if seq.host is None:
            raise InvalidArgumentError(f"sequence {seq_id} is not swapped out")
        spans = [(seq.released[g], int(t.num_blocks[row])) for g, t in enumerate(self.tables)]
        total = sum(b - a for a, b in spans)
        if total > self.pool.num_available:
            return None
        ids = self.pool.allocate(total) if total else np.zeros(0, np.int64)
        dsts = []
        for g, t in enumerate(self.tables):
            a, b = spans[g]
            mine, ids = ids[: b - a], ids[b - a :]
            self.group_of[mine] = g
            t.table[row, a:b] = mine
            t.swapped[row], t.on_device[row] = False, True
            host.release(seq.host[g][::-1])
            dsts.append(mine[: len(seq.host[g])])
        srcs, seq.host = seq.host, None
        return BlockMoves(np.concatenate(srcs), np.concatenate(dsts))
