"""`HostTier`: block values in host RAM, one `uint8` row per slot.

The rows hold raw payloads (no header): RAM is not a medium that silently flips bits the way a disk or a
network store can, and a checksum per host copy would cost a pass over every block on the hot path. With
`pin_memory=True` (CUDA engines) the rows live in page-locked memory allocated through torch, so device
copies can run asynchronously; the tier itself never touches torch otherwise.
"""

from __future__ import annotations

import numpy as np

from pagedkv.tiers.events import Medium
from pagedkv.tiers.slot_index import LruClock
from pagedkv.tiers.tier import LocalTier, Rows
from pagedkv.tiers.value import BlockLayout


class HostTier(LocalTier):
    medium: Medium = "CPU"
    keeps_evicted_bytes = True  # evicted blocks are handed to the next tier (disk)

    def __init__(
        self, num_blocks: int, layout: BlockLayout, clock: LruClock, *, pin_memory: bool = False
    ) -> None:
        super().__init__(num_blocks, layout, clock)
        if pin_memory:
            import torch

            self._tensor = torch.empty((num_blocks, layout.nbytes), dtype=torch.uint8, pin_memory=True)
            self.rows: Rows = self._tensor.numpy()
        else:
            self.rows = np.zeros((num_blocks, layout.nbytes), dtype=np.uint8)

    def _read(self, slot: int, key: bytes, out: Rows) -> str | None:
        out[:] = self.rows[slot]
        return None

    def _write(self, slot: int, key: bytes, value: Rows) -> None:
        self.rows[slot] = value
