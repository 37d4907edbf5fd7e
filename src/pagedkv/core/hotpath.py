"""The per-block loops of prefix caching, in two interchangeable backends.

Everything else in the core is batched numpy; these two loops are not, because a block's key chains from
its parent's and the index is a Python dict:

- `match`: walk a prompt's leading blocks, computing missing keys, until the first block not in the cache;
- `publish_rows`: give the newly written full blocks of a batch of sequences their keys and index them.

`pagedkv.core._native` is a small C extension with exactly these functions (and its own SHA-256, with the
x86 SHA instructions when the CPU has them), built when the package is installed with a C compiler at
hand. This module is the reference: the same functions in Python, used when the extension is missing (or
disabled with `PAGEDKV_NATIVE=0`), and the specification the extension is tested against.

Contract of both backends (`kind` is `SHA256` or `FAST`):

- key of a block = `sha256(parent + block bytes).digest()` (SHA256) or `hash((parent, block bytes, b""))`
  (FAST), where block bytes are its token ids as little-endian int32 (`width` bytes);
- `index` is the pool's key -> block dict (entries may be stale: valid only while `key_of[block] == key`);
  `key_of` is the pool's list block -> key or None;
- publishing a block whose key another block already holds leaves it private (not indexed), so the index
  stays a map and events stay exact.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

SHA256 = 0
FAST = 1

Key = bytes | int


class Backend(Protocol):
    NAME: str

    def match(
        self, kind: int, index: dict[Any, int], key_of: list[Any], known: list[Any], data: Any, width: int,
        max_blocks: int,
    ) -> list[int]: ...  # fmt: skip

    def publish_rows(
        self, kind: int, index: dict[Any, int], key_of: list[Any], key_lists: Sequence[list[Any]],
        starts: Any, stops: Any, data: Any, width: int, ids: Any,
    ) -> list[int]: ...  # fmt: skip


def _chain(kind: int, parent: Key, chunk: bytes) -> Key:
    if kind == SHA256:
        assert isinstance(parent, bytes), "hotpath: sha256 keys chain from bytes"
        return hashlib.sha256(parent + chunk).digest()
    return hash((parent, chunk, b""))


def _as_bytes(data: Any) -> bytes:
    return data.tobytes() if isinstance(data, np.ndarray) else bytes(data)


def _as_list(values: Any) -> list[int]:
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


class PythonBackend:
    """The reference implementation (and the fallback when the C extension is not built)."""

    NAME = "python"

    @staticmethod
    def match(
        kind: int, index: dict[Any, int], key_of: list[Any], known: list[Any], data: Any, width: int,
        max_blocks: int,
    ) -> list[int]:  # fmt: skip
        """Leading blocks of `data` (token bytes) found in the cache, at most `max_blocks`.

        `known[0]` is the root key and `known[i + 1]` block i's key; keys missing from `known` are computed
        in order and appended (including the key of the first block that misses).
        """
        buf = _as_bytes(data)
        hits: list[int] = []
        for i in range(max_blocks):
            if i + 1 < len(known):
                key = known[i + 1]
            else:
                key = _chain(kind, known[-1], buf[i * width : (i + 1) * width])
                known.append(key)
            block_id = index.get(key)
            if block_id is None or key_of[block_id] != key:
                break
            hits.append(block_id)
        return hits

    @staticmethod
    def publish_rows(
        kind: int, index: dict[Any, int], key_of: list[Any], key_lists: Sequence[list[Any]],
        starts: Any, stops: Any, data: Any, width: int, ids: Any,
    ) -> list[int]:  # fmt: skip
        """Publish blocks [starts[r], stops[r]) of each row r; returns the block ids that entered the index.

        `data` holds those blocks' token bytes and `ids` their block ids, row after row. Row r's keys are
        `key_lists[r]` (root first); it must hold at least `starts[r] + 1` keys, and is extended to
        `stops[r] + 1` from the data.
        """
        buf, block_ids = _as_bytes(data), _as_list(ids)
        stored: list[int] = []
        pos = 0
        for known, start, stop in zip(key_lists, _as_list(starts), _as_list(stops)):
            have = len(known) - 1
            if have < start:
                raise ValueError("publish_rows: a row's keys end before its first block to publish")
            parent = known[-1]
            for j in range(have, stop):
                offset = (pos + j - start) * width
                parent = _chain(kind, parent, buf[offset : offset + width])
                known.append(parent)
            for j in range(start, stop):
                key, block_id = known[j + 1], block_ids[pos + j - start]
                if key_of[block_id] is None:
                    other = index.get(key)
                    if other is None or key_of[other] != key:
                        index[key] = block_id
                        key_of[block_id] = key
                        stored.append(block_id)
            pos += stop - start
        return stored


def _load_native() -> Backend | None:
    if os.environ.get("PAGEDKV_NATIVE", "1") == "0":
        return None
    try:
        from pagedkv.core import _native  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _native  # type: ignore[no-any-return]


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

