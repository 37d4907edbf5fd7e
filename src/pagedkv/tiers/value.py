"""The binary value of one block: a small header, then the block's raw bytes (K and V of every layer).

    offset  size  field
    0       4     magic b"PKVB"
    4       2     version (1)
    6       2     length of the store key, n
    8       16    dtype name, ASCII, NUL-padded ("float16", ...)
    24      20    shape, 5 x uint32: (num_layers, 2, block_size, num_kv_heads, head_dim)
    44      8     payload byte count, uint64
    52      4     CRC32 of the payload (zlib)
    56      n     the store key itself (`pkv:v1:...`)
    56 + n  ...   payload

Little-endian. No pickle: a reader checks every field against what it expects (`unpack`); any mismatch
(wrong magic, version, dtype, shape, size, key or checksum) raises `CorruptValueError`, which the tiers turn
into a miss that deletes the entry. Torch-free.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from pagedkv.core.errors import InvalidArgumentError, PagedKVError
from pagedkv.storage.kv_spec import DTYPE_BYTES, SCALE_BYTES, check_kv_scale_scheme

MAGIC = b"PKVB"
VERSION = 1
_FIXED = struct.Struct("<4sHH16s5IQI")
HEADER_BYTES = _FIXED.size  # 56, before the key
MAX_KEY_BYTES = 160

Bytes = bytes | bytearray | memoryview | npt.NDArray[np.uint8]


def _view(data: Bytes) -> memoryview:
    """The bytes of `data` as a flat memoryview (no copy for contiguous inputs)."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).data.cast("B")
    return memoryview(data).cast("B")


class CorruptValueError(PagedKVError):
    """A stored value does not match what the reader expects; `reason` is "checksum" or "header"."""

    def __init__(self, reason: Literal["checksum", "header"], message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """The dtype and shape of one block's payload: `(num_layers, 2, block_size, num_kv_heads, head_dim)`; a
    quantized dtype's payload also holds its scales, `SCALE_BYTES` per (layer, K/V, token, KV head) under the
    "token" `kv_scale_scheme`, per (layer, K/V, KV head) under "block"."""

    dtype: str
    shape: tuple[int, int, int, int, int]
    kv_scale_scheme: str = "token"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise InvalidArgumentError(
                f"BlockLayout: unknown dtype {self.dtype!r}; use one of {sorted(DTYPE_BYTES)}"
            )
        if len(self.shape) != 5 or any(
            isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in self.shape
        ):
            raise InvalidArgumentError(f"BlockLayout: shape must be 5 positive ints, got {self.shape!r}")
        check_kv_scale_scheme(self.kv_scale_scheme, self.dtype)

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        scale_rows = 1 if self.kv_scale_scheme == "block" else self.shape[2]
        rows = self.shape[0] * self.shape[1] * scale_rows * self.shape[3]
        return n + rows * SCALE_BYTES.get(self.dtype, 0)

    def value_bytes(self, key_len: int) -> int:
        """Size of a whole value (header + key + payload)."""
        return HEADER_BYTES + key_len + self.nbytes


def header(layout: BlockLayout, store_key: bytes, payload: Bytes) -> bytes:
    """The header (with the key) of a value whose payload is `payload` (the block's bytes)."""
    if len(store_key) > MAX_KEY_BYTES:
        raise InvalidArgumentError(f"store keys are at most {MAX_KEY_BYTES} bytes, got {len(store_key)}")
    view = _view(payload)
    if view.nbytes != layout.nbytes:
        raise InvalidArgumentError(f"a block payload of {layout} is {layout.nbytes} bytes, got {view.nbytes}")
    fixed = _FIXED.pack(MAGIC, VERSION, len(store_key), layout.dtype.encode(), *layout.shape, view.nbytes,
                        zlib.crc32(view))  # fmt: skip
    return fixed + store_key


def pack(layout: BlockLayout, store_key: bytes, payload: Bytes) -> bytes:
    """Header + payload as one bytes object (what a remote store keeps)."""
    return header(layout, store_key, payload) + bytes(_view(payload))


def unpack(layout: BlockLayout, store_key: bytes, value: Bytes) -> npt.NDArray[np.uint8]:
    """The payload of `value` as a read-only `uint8` array, after checking every header field."""
    view = _view(value)
    if view.nbytes < HEADER_BYTES:
        raise CorruptValueError("header", f"value of {view.nbytes} bytes is shorter than a header")
    magic, version, key_len, dtype, *rest = _FIXED.unpack_from(view)
    shape, nbytes, crc = tuple(rest[:5]), rest[5], rest[6]
    if magic != MAGIC or version != VERSION:
        raise CorruptValueError("header", f"bad magic/version {magic!r}/{version}")
    if dtype.rstrip(b"\0").decode("ascii", "replace") != layout.dtype or shape != layout.shape:
        raise CorruptValueError(
            "header", f"value holds {dtype!r} {shape}, expected {layout.dtype} {layout.shape}"
        )
    if nbytes != layout.nbytes or view.nbytes != HEADER_BYTES + key_len + nbytes:
        raise CorruptValueError("header", f"value size {view.nbytes} does not match its header")
    if bytes(view[HEADER_BYTES : HEADER_BYTES + key_len]) != store_key:
        raise CorruptValueError("header", "value was stored under another key")
    payload = view[HEADER_BYTES + key_len :]
    if zlib.crc32(payload) != crc:
        raise CorruptValueError("checksum", "payload CRC32 mismatch")
    return np.frombuffer(payload, dtype=np.uint8)
