"""`check_hybrid`: every invariant of a `HybridKVManager`, over every group (tests call it after each step).

- what every manager over a pool keeps (`copies.check_references`, over the group tables): the pool's, the
  host pool's and each group table's own invariants, and the holds:
  each block's count is the table entries naming it over all groups and live on-device rows, plus pins,
  plus a pending copy's hold; a keyed block is never partial in a row that writes in place, and a row
  writes in place only into a block it holds alone;
- each row: entries before `released` are the null block and none after it is (on the device); `released`
  never passes what the group's window lets go (`first_needed(num_computed) // block_size`); published
  never below released; the group's held tokens cover the computed ones and never exceed the sequence;
- keys: a keyed block holds a key of its own group;
- a swapped row has no device entries and keeps host blocks per group.

It reads the manager through `HybridParts` (what it checks), so this module does not import the manager's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from pagedkv.core.copies import check_references
from pagedkv.core.errors import InvariantError
from pagedkv.core.group_keys import split_key
from pagedkv.core.pool import NULL_BLOCK_ID

if TYPE_CHECKING:
    from pagedkv.core.copies import CopyLedger
    from pagedkv.core.group import KVGroupSpec
    from pagedkv.core.hybrid_state import SeqState
    from pagedkv.core.pool import BlockPool
    from pagedkv.core.prefix_index import PrefixIndex
    from pagedkv.core.table import BlockTables
    from pagedkv.core.token_rows import TokenRows


class HybridParts(Protocol):
    """The state of a hybrid manager that `check_hybrid` reads."""

    pool: BlockPool
    host_pool: BlockPool | None
    index: PrefixIndex
    tables: list[BlockTables]
    tokens: TokenRows
    groups: tuple[KVGroupSpec, ...]
    seqs: dict[int, SeqState]
    group_of: npt.NDArray[np.int64]
    copies: CopyLedger

    @property
    def block_size(self) -> int: ...


def _fail(msg: str) -> None:
    raise InvariantError(f"hybrid manager: {msg}")


def check_hybrid(m: HybridParts) -> None:
    check_references(m.pool, m.host_pool, m.tables, m.copies, "hybrid manager")
    for g, t in enumerate(m.tables):
        if not np.array_equal(t.alive, m.tables[0].alive) or not np.array_equal(t.swapped, m.tables[0].swapped):
            _fail(f"group {g}'s table disagrees with group 0's on live or swapped rows")
    if set(m.seqs) != set(np.flatnonzero(m.tables[0].alive).tolist()):
        _fail("sequence states disagree with the live rows")
    for row in m.seqs:
        _check_row(m, row)
    keyed = np.flatnonzero(m.pool.keyed)
    key_of = m.index.key_of
    for b in keyed.tolist():
        key = key_of[b]
        if key is None or split_key(key)[1] != m.group_of[b]:
            _fail(f"block {b} (group {m.group_of[b]}) holds a key of another group")


def _check_row(m: HybridParts, row: int) -> None:
    seq, bs = m.seqs[row], m.block_size
    n = int(m.tokens.length[row])
    computed, hashable = int(m.tables[0].num_computed[row]), int(m.tables[0].hashable_tokens[row])
    if computed > n:
        _fail(f"row {row}: computed {computed} > tokens {n}")
    for g, (spec, t) in enumerate(zip(m.groups, m.tables)):
        blocks, lo = t.blocks_of(row), seq.released[g]
        held, published = int(t.num_tokens[row]), int(t.num_published[row])
        if not computed <= held <= n:
            _fail(f"row {row} group {g}: held tokens {held} outside [computed {computed}, tokens {n}]")
        if int(t.num_computed[row]) != computed or int(t.hashable_tokens[row]) != hashable:
            _fail(f"row {row} group {g}: the table's computed or hashable tokens disagree with group 0's")
        if spec.is_full and (lo or held != n):
            _fail(f"row {row}: full group {g} released blocks or holds {held} of {n} tokens")
        if lo > spec.first_needed(computed) // bs or published < lo:
            _fail(f"row {row} group {g}: released {lo} past its window or above published {published}")
        if (blocks[:lo] != NULL_BLOCK_ID).any():
            _fail(f"row {row} group {g}: a released entry is not the null block")
        if seq.host is not None:
            if (blocks != NULL_BLOCK_ID).any() or len(seq.host[g]) != max(-(-computed // bs) - lo, 0):
                _fail(f"row {row} group {g}: swapped out but holds device blocks or the wrong host blocks")
            continue
        if (blocks[lo:] == NULL_BLOCK_ID).any():
            _fail(f"row {row} group {g}: a held entry is the null block")

