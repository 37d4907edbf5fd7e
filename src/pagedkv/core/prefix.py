"""Content keys for the prefix cache.

A full block's key is a hash of (parent block's key, the block's token ids, the block's extra key). The
first block chains from a root that mixes the cache epoch, the tenant salt and request-level extra keys
(adapter id, ...), so:

- equal keys imply equal token prefixes under the same salt, extras and epoch (up to the hash's strength);
- different salts never share a block, whatever the tokens;
- bumping the epoch makes every earlier key unmatchable at once, without touching the pool.

    tokens:  [ t0 .. t15 ][ t16 .. t31 ][ t32 .. t40 )
    keys:      k0=H(root,b0) k1=H(k0,b1)   (partial: no key)

`sha256` is the default: one hashlib call per block. `fast` is a 64-bit polynomial chain computed for a
whole prompt in a few numpy calls: much cheaper, but collisions can be crafted and occur by chance at
scale, so it is unsafe across tenants (a collision would serve one request another's KV). Use it for
single-tenant serving, ideally with `verify_hits=True`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Literal

import numpy as np
import numpy.typing as npt

from pagedkv.core.errors import InvalidArgumentError

Key = bytes | int
HashName = Literal["sha256", "fast"]
# (parent key, block token bytes, extra key bytes) -> key
KeyFunction = Callable[[Key, bytes, bytes], Key]


def sha256_key(parent: Key, data: bytes, extra: bytes) -> Key:
    assert isinstance(parent, bytes), "prefix: sha256 keys chain from bytes parents"
    return hashlib.sha256(parent + data + extra).digest()


# --- the fast key: a 64-bit polynomial chain, vectorisable over a whole prompt ----------------------
#
#   h_i   = mix(sum_k (tok_k + 1) * C^k)            per-block content hash (numpy over all blocks)
#   key_i = key_{i-1} * P + h_i   (mod 2^64)        linear chain, so a prefix scan computes every key:
#   key_i = P^(i+1) key_{-1} + P^i * cumsum_j(h_j * P^-j)
#
# Linear and 64-bit: a collision can be crafted, so it is unsafe across tenants (use sha256, or
# verify_hits=True). Different salts still never share a block: their roots differ, and P is odd.

_MASK = (1 << 64) - 1
_C = np.uint64(0x9E3779B97F4A7C15)
_P = 0xD6E8FEB86659FD93  # odd: invertible mod 2^64
_P_INV = pow(_P, -1, 1 << 64)


def _powers(base: int, n: int) -> npt.NDArray[np.uint64]:
    out = np.empty(n, dtype=np.uint64)
    out[0] = 1
    if n > 1:
        out[1:] = base
        with np.errstate(over="ignore"):
            np.cumprod(out[1:], out=out[1:])
    return out


_POW_CACHE: dict[tuple[int, int], npt.NDArray[np.uint64]] = {}


def _pow_table(base: int, n: int) -> npt.NDArray[np.uint64]:
    table = _POW_CACHE.get((base, 0))
    if table is None or len(table) < n:
        table = _powers(base, max(n, 2 * len(table) if table is not None else 1024))
        _POW_CACHE[(base, 0)] = table
    return table[:n]


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(33))) * np.uint64(0xFF51AFD7ED558CCD)
        x = (x ^ (x >> np.uint64(33))) * np.uint64(0xC4CEB9FE1A85EC53)
        return x ^ (x >> np.uint64(33))


def fast_block_hashes(tokens: npt.NDArray[np.int32]) -> npt.NDArray[np.uint64]:
    """Content hash of each row of a `[num_blocks, block_size]` token matrix."""
    with np.errstate(over="ignore"):
        weighted = (tokens.astype(np.uint64) + np.uint64(1)) * _pow_table(int(_C), tokens.shape[1])
        return _mix(weighted.sum(axis=1, dtype=np.uint64))


def fast_chain(parent: int, hashes: npt.NDArray[np.uint64]) -> list[int]:
    """Keys of consecutive blocks after `parent`, all at once (the prefix scan above)."""
    n = len(hashes)
    if n <= 2:
        out = []
        for h in hashes.tolist():
            parent = (parent * _P + h) & _MASK
            out.append(parent)
        return out
    with np.errstate(over="ignore"):
        p_pow = _pow_table(_P, n + 1)
        scan = np.cumsum(hashes * _pow_table(_P_INV, n), dtype=np.uint64)
        keys = p_pow[1:] * np.uint64(parent) + p_pow[:n] * scan
    return keys.tolist()  # type: ignore[no-any-return]


def fast_key(parent: Key, data: bytes, extra: bytes) -> Key:
    assert isinstance(parent, int), "prefix: fast keys chain from int parents"
    h = int(fast_block_hashes(np.frombuffer(data, dtype=np.int32)[None, :])[0])
    if extra:
        h ^= int.from_bytes(hashlib.blake2b(extra, digest_size=8).digest(), "little")
    return (parent * _P + h) & _MASK


KEY_FUNCTIONS: dict[str, KeyFunction] = {"sha256": sha256_key, "fast": fast_key}


def key_function(name: str | KeyFunction) -> KeyFunction:
    if callable(name):
        return name
    try:
        return KEY_FUNCTIONS[name]
    except KeyError:
        raise InvalidArgumentError(f"unknown hash {name!r}; choose one of {sorted(KEY_FUNCTIONS)}") from None


def root_key(fn: KeyFunction, epoch: int, salt: bytes, extra: bytes) -> Key:
    """The parent of a sequence's first block: one per (epoch, salt, request-level extras)."""
    seed = b"pagedkv/root/" + epoch.to_bytes(8, "little")
    if fn is fast_key:  # any bytes of salt and extras, folded to 64 bits
        return int.from_bytes(hashlib.blake2b(seed + salt + b"/" + extra, digest_size=8).digest(), "little")
    return fn(hashlib.sha256(seed).digest(), salt, extra)


class BlockKeys:
    """The content keys of one token sequence's full blocks, computed lazily and kept across admissions.

    A request holds one of these for its lifetime; the manager reads keys from it at admission (so a
    request that waits, or is preempted and re-admitted, hashes each block once) and appends the keys of
    blocks it publishes while the request decodes. Contract: the token ids passed with it always extend
    the tokens it has seen (the manager truncates it on rollback).
    """

    __slots__ = ("salt", "extra", "block_extra", "keys", "epoch", "_fn")

    def __init__(
        self, salt: bytes = b"", *, extra: bytes = b"", block_extra: Mapping[int, bytes] | None = None
    ) -> None:
        if not isinstance(salt, bytes) or not isinstance(extra, bytes):
            raise InvalidArgumentError("salt and extra keys must be bytes (encode strings first)")
        self.salt = salt
        self.extra = extra
        self.block_extra: Mapping[int, bytes] = dict(block_extra or {})
        self.keys: list[Key] = []
        self.epoch = -1
        self._fn: KeyFunction | None = None

    def bind(self, fn: KeyFunction, epoch: int) -> None:
        """Forget keys computed under another epoch or hash function."""
        if self.epoch != epoch or self._fn is not fn:
            self.keys.clear()
            self.epoch, self._fn = epoch, fn
            self.keys.append(root_key(fn, epoch, self.salt, self.extra))

    def parent(self, block_index: int) -> Key:
        return self.keys[block_index]  # keys[0] is the root, keys[i + 1] the key of block i

    def num_keys(self) -> int:
        """How many leading blocks have a key."""
        return len(self.keys) - 1

    def key(self, block_index: int, block_tokens: npt.NDArray[np.int32]) -> Key:
        """Key of block `block_index`, computing it (and remembering it) if it is the next one."""
        n = len(self.keys) - 1
        if block_index < n:
            return self.keys[block_index + 1]
        assert block_index == n and self._fn is not None, "prefix: keys must be computed in block order"
        k = self._fn(self.keys[n], block_tokens.tobytes(), self.block_extra.get(block_index, b""))
        self.keys.append(k)
        return k

    def extend_fast(self, tokens: npt.NDArray[np.int32], block_size: int, num_blocks: int) -> None:
        """With the fast key and no per-block extras: compute keys up to `num_blocks` in one pass."""
        have = len(self.keys) - 1
        if num_blocks <= have:
            return
        blocks = tokens[have * block_size : num_blocks * block_size].reshape(num_blocks - have, block_size)
        parent = self.keys[-1]
        assert isinstance(parent, int), "prefix: fast keys chain from int parents"
        self.keys.extend(fast_chain(parent, fast_block_hashes(blocks)))

    @property
    def vectorisable(self) -> bool:
        return self._fn is fast_key and not self.block_extra

    def truncate(self, num_blocks: int) -> None:
        del self.keys[num_blocks + 1 :]

    def copy(self) -> BlockKeys:
        other = BlockKeys(self.salt, extra=self.extra, block_extra=self.block_extra)
        other.keys = list(self.keys)
        other.epoch, other._fn = self.epoch, self._fn
        return other
