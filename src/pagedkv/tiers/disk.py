"""`DiskTier`: block values in one file of fixed-size slots on a local disk.

Each slot holds one full value (header with CRC32 and the key, then the payload; see `value.py`), written
with one `pwritev` and read with one `preadv`. A read checks the header and the checksum: a mismatch (a torn
write, bit rot, a file edited behind our back) is a miss and the entry is deleted. The file is this
process's cache, not a database: it is created empty (truncated) when the tier opens and removed on `close`.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import numpy as np

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.tiers.events import Medium
from pagedkv.tiers.slot_index import LruClock
from pagedkv.tiers.tier import LocalTier, Rows
from pagedkv.tiers.value import MAX_KEY_BYTES, BlockLayout, CorruptValueError, header, unpack


class DiskTier(LocalTier):
    medium: Medium = "DISK"

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, layout: BlockLayout,
                 clock: LruClock, *, key_prefix: bytes = b"") -> None:  # fmt: skip
        self.slot_bytes = layout.value_bytes(MAX_KEY_BYTES)
        num_blocks = capacity_bytes // self.slot_bytes
        if num_blocks < 1:
            raise InvalidArgumentError(
                f"a disk tier of {capacity_bytes} bytes cannot hold one block value of {self.slot_bytes} bytes; "
                "raise disk_bytes"
            )
        super().__init__(num_blocks, layout, clock)
        self.key_prefix = key_prefix  # stored keys are key_prefix + key.hex() (the store key)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        # an engine that is never closed still leaves no file behind at exit
        self._finalizer = weakref.finalize(self, _remove, self._fd, self.path)

    def _store_key(self, key: bytes) -> bytes:
        return self.key_prefix + key.hex().encode()

    def _read(self, slot: int, key: bytes, out: Rows) -> str | None:
        assert self._fd is not None, "disk tier: read after close"
        buf = bytearray(self.slot_bytes)
        n = os.preadv(self._fd, [buf], slot * self.slot_bytes)
        try:
            skey = self._store_key(key)
            payload = unpack(self.layout, skey, memoryview(buf)[: self.layout.value_bytes(len(skey))][:n])
        except CorruptValueError as err:
            return err.reason
        out[:] = payload
        return None

    def _write(self, slot: int, key: bytes, value: Rows) -> None:
        assert self._fd is not None, "disk tier: write after close"
        payload = np.ascontiguousarray(value)
        head = header(self.layout, self._store_key(key), payload)
        os.pwritev(self._fd, [head, payload.data], slot * self.slot_bytes)

    def close(self) -> None:
        if self._fd is not None:
            self._fd = None
            self._finalizer()


def _remove(fd: int, path: Path) -> None:
    os.close(fd)
    path.unlink(missing_ok=True)
