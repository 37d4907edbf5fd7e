"""`check_hybrid`: every invariant of a `HybridKVManager`, over every group (tests call it after each step).

- the pool's and each group table's own invariants, and the host pool's;
- reference counts: each block's count is the number of table entries naming it over all groups and live
  on-device rows, plus pins, plus a pending copy's hold (the null block: exactly 1);
- each row: entries before `released` are the null block and none after it is (on the device); `released`
  never passes what the group's window lets go (`first_needed(num_computed) // block_size`); published
  never below released; the group's held tokens cover the computed ones and never exceed the sequence;
- keys: a keyed block holds a key of its own group; a keyed block that is partial in a row whose writes
  go in place is a bug (the copy-before-write rule of `manager.py`), and a row writing in place into its
  partial last block holds it alone;
- a swapped row has no device entries and keeps host blocks per group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pagedkv.core.errors import InvariantError
from pagedkv.core.group_keys import split_key
from pagedkv.core.pool import NULL_BLOCK_ID

if TYPE_CHECKING:
    from pagedkv.core.hybrid import HybridKVManager


def _fail(msg: str) -> None:
    raise InvariantError(f"hybrid manager: {msg}")


def check_hybrid(m: HybridKVManager) -> None:
    m.pool.check_invariants()
    if m.host_pool is not None:
        m.host_pool.check_invariants()
    refs = np.zeros(m.pool.num_blocks, dtype=np.int64)
    for g, t in enumerate(m.tables):
        t.check_invariants()
        if not np.array_equal(t.alive, m.tables[0].alive) or not np.array_equal(t.swapped, m.tables[0].swapped):
            _fail(f"group {g}'s table disagrees with group 0's on live or swapped rows")
        for row in np.flatnonzero(t.alive & ~t.swapped).tolist():
            blocks = t.blocks_of(row)
            np.add.at(refs, blocks[blocks != NULL_BLOCK_ID], 1)
    refs[NULL_BLOCK_ID] = 1
    if set(m.seqs) != set(np.flatnonzero(m.tables[0].alive).tolist()):
        _fail("sequence states disagree with the live rows")
    expected = refs + m.pool.pins + m._held
    if not np.array_equal(expected, m.pool.ref):
        bad = np.nonzero(expected != m.pool.ref)[0][:8].tolist()
        _fail(f"ref counts differ from table entries + pins + pending copies at blocks {bad}")
    for row in m.seqs:
        _check_row(m, row)
    keyed = np.flatnonzero(m.pool.keyed)
    key_of = m.index.key_of
    for b in keyed.tolist():
        key = key_of[b]
        if key is None or split_key(key)[1] != m.group_of[b]:
            _fail(f"block {b} (group {m.group_of[b]}) holds a key of another group")
    if set(m._pending) != set(np.concatenate(m._copies_dst).tolist() if m._copies_dst else []):
        _fail("pending copies disagree with the copies not handed out")


def _check_row(m: HybridKVManager, row: int) -> None:
    seq, bs = m.seqs[row], m.block_size
    n = len(seq.tokens)
    if seq.num_computed > n:
        _fail(f"row {row}: computed {seq.num_computed} > tokens {n}")
    for g, (spec, t) in enumerate(zip(m.groups, m.tables)):
        blocks, lo = t.blocks_of(row), seq.released[g]
        held = int(t.num_tokens[row])
        if not seq.num_computed <= held <= n:
            _fail(f"row {row} group {g}: held tokens {held} outside [computed {seq.num_computed}, tokens {n}]")
        if int(t.num_computed[row]) != seq.num_computed:
            _fail(f"row {row} group {g}: the table says {int(t.num_computed[row])} computed, the sequence {seq.num_computed}")
        if spec.is_full and (lo or held != n):
            _fail(f"row {row}: full group {g} released blocks or holds {held} of {n} tokens")
        if lo > spec.first_needed(seq.num_computed) // bs or seq.published[g] < lo:
            _fail(f"row {row} group {g}: released {lo} past its window or above published {seq.published[g]}")
        if (blocks[:lo] != NULL_BLOCK_ID).any():
            _fail(f"row {row} group {g}: a released entry is not the null block")
        if seq.host is not None:
            if (blocks != NULL_BLOCK_ID).any() or len(seq.host[g]) != max(-(-seq.num_computed // bs) - lo, 0):
                _fail(f"row {row} group {g}: swapped out but holds device blocks or the wrong host blocks")
            continue
        if (blocks[lo:] == NULL_BLOCK_ID).any():
            _fail(f"row {row} group {g}: a held entry is the null block")
        _check_partial(m, g, row, held)


def _check_partial(m: HybridKVManager, g: int, row: int, held: int) -> None:
    t, bs = m.tables[g], m.block_size
    if held % bs == 0 or t.cow_risk[row]:
        return
    last = int(t.table[row, (held - 1) // bs])
    if m.pool.keyed[last]:
        _fail(f"row {row} group {g}: a keyed block is partial in a sequence that writes into it")
    if m.pool.ref[last] - int(m._held[last]) != 1:
        _fail(f"row {row} group {g}: a sequence writes in place into a block it shares")
