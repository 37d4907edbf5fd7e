"""`TokenRows`: each live sequence's token ids, one row of an int32 matrix per sequence.

The hybrid manager's block tables (one per KV cache group) hold slots, and a windowed group gives back the
blocks its window has passed, so no table holds all of a sequence's tokens; this matrix does. Its rows are
the tables' rows (a sequence id indexes both), so a decode step's new tokens are one numpy write for the
whole batch, and the keys of a row's full blocks are hashed straight from its bytes
(`hotpath.Backend.publish_groups`):

    ids[r]     | t0 t1 ... t15 | t16 ... t31 | t32 .. t40 | (unused) |    length[r] = 41
                 block 0 bytes   block 1 bytes   partial

Invariants: `length[r]` is the sequence's token count (0 for a row no sequence holds); columns at or past
`length[r]` mean nothing; `longest` is at least every length (a bound kept without a pass over the rows).
Both dimensions grow by doubling, never shrink.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]
Tokens = npt.NDArray[np.int32]


class TokenRows:
    """Token ids by row (see the module docstring)."""

    def __init__(self, rows: int = 64, cols: int = 256) -> None:
        self.ids: Tokens = np.zeros((rows, cols), dtype=np.int32)
        self.length: IntArray = np.zeros(rows, dtype=np.int64)
        self.longest = 0

    def _fit(self, rows: int, cols: int) -> None:
        """Room for rows [0, rows) of `cols` tokens."""
        old_rows, old_cols = self.ids.shape
        if rows <= old_rows and cols <= old_cols:
            return
        new_rows = max(rows, 2 * old_rows) if rows > old_rows else old_rows
        new_cols = max(cols, 2 * old_cols) if cols > old_cols else old_cols
        ids = np.zeros((new_rows, new_cols), dtype=np.int32)
        ids[:old_rows, :old_cols] = self.ids
        self.ids = ids
        if new_rows > old_rows:
            length = np.zeros(new_rows, dtype=np.int64)
            length[:old_rows] = self.length
            self.length = length

    def start(self, row: int, tokens: Tokens) -> None:
        """Row `row` holds `tokens` (an admission)."""
        n = len(tokens)
        self._fit(row + 1, n)
        self.ids[row, :n] = tokens
        self.length[row] = n
        self.longest = max(self.longest, n)

    def append(self, rows: IntArray, lengths: IntArray, tokens: Tokens | None, k: int) -> None:
        """Each of `rows` (distinct rows that hold a sequence), whose lengths are `lengths`, grows by `k`
        tokens: `tokens[i]` (`[B, k]`), or zeros when None."""
        if self.longest + k > self.ids.shape[1]:  # the bound first: most steps take no pass over the rows
            self.longest = int(self.length.max())
            self._fit(len(self.length), self.longest + k)
        self.longest += k
        if k == 1:
            self.ids[rows, lengths] = 0 if tokens is None else tokens[:, 0]
        else:
            self.ids[rows[:, None], lengths[:, None] + np.arange(k)] = 0 if tokens is None else tokens
        self.length[rows] = lengths + k

    def truncate(self, row: int, n: int) -> None:
        """Row `row` keeps its first `n` tokens (a rollback)."""
        self.length[row] = min(int(self.length[row]), n)

    def copy(self, src: int, dst: int) -> None:
        """Row `dst` holds row `src`'s tokens (a fork)."""
        n = int(self.length[src])
        self._fit(dst + 1, n)
        self.ids[dst, :n] = self.ids[src, :n]
        self.length[dst] = n
        self.longest = max(self.longest, n)

    def drop(self, row: int) -> None:
        self.length[row] = 0

    def of(self, row: int) -> Tokens:
        """Row `row`'s tokens (a view: copy it to keep it)."""
        return self.ids[row, : self.length[row]]
