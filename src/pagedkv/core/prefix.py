"""Content keys for the prefix cache.

A full block's key is a hash of (parent block's key, the block's token ids, the block's extra key). The
first block chains from a root that mixes the cache epoch, the tenant salt and request-level extra keys
(adapter id, ...), so:

- equal keys imply equal token prefixes under the same salt, extras and epoch (up to the hash's strength);
- different salts never share a block, whatever the tokens;
- bumping the epoch makes every earlier key unmatchable at once, without touching the pool.

    tokens:  [ t0 .. t15 ][ t16 .. t31 ][ t32 .. t40 )
    keys:      k0=H(root,b0) k1=H(k0,b1)   (partial: no key)

`sha256` is the default: one hashlib call per block, stable across processes (an external KV-aware router
can recompute keys). `fast` is Python's built-in hash (SipHash-1-3 with a per-process random key,
64 bits): about half the cost, but process-local and too short to rule out collisions at scale or
against a determined tenant, so it is unsafe across tenants (a collision would serve one request
another's KV). Use it for single-tenant serving, ideally with `verify_hits=True`.
`vllm` computes vLLM's own block hashes (`sha256_cbor` chain from its NONE_HASH; see `VllmKeyFunction`), so
routers written for vLLM's KV events can index pagedkv replicas; its CBOR is pure Python: 6.5 us per 16-token block
here against 0.43 us for `sha256`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Literal

import numpy as np
import numpy.typing as npt

from pagedkv.core.errors import InvalidArgumentError

Key = bytes | int
HashName = Literal["sha256", "fast", "vllm"]
# (parent key, block token bytes, extra key bytes) -> key
KeyFunction = Callable[[Key, bytes, bytes], Key]


def sha256_key(parent: Key, data: bytes, extra: bytes) -> Key:
    assert isinstance(parent, bytes), "prefix: sha256 keys chain from bytes parents"
    return hashlib.sha256(parent + data + extra).digest()


def fast_key(parent: Key, data: bytes, extra: bytes) -> Key:
    """Python's built-in hash: SipHash-1-3 keyed per process, 64 bits. Process-local (keys differ
    between processes, so an external router cannot recompute them) and weaker than SHA-256."""
    return hash((parent, data, extra))


KEY_FUNCTIONS: dict[str, KeyFunction] = {"sha256": sha256_key, "fast": fast_key}


# --- vLLM's block hashes (hash_fn="vllm") ----------------------------------------------------------------
#
# vLLM v1 (vllm/v1/core/kv_cache_utils.py, `hash_block_tokens` with `sha256_cbor`, its default since 0.10):
#
#     key(block) = sha256(cbor2.dumps((parent_key, tuple(token_ids), extra_keys), canonical=True))
#     parent_key of the first block = NONE_HASH = sha256_cbor(PYTHONHASHSEED or "vllm-none-hash")
#     extra_keys = None, or a tuple: ("cache_salt", salt) on the first block of a salted request, ...
#
# and publishes a block as the low 64 bits of its key, as `external_hash` does. With these keys a router built
# for vLLM's events (llm-d's precise prefix scorer, Dynamo's KV router) indexes pagedkv replicas unchanged.
# pagedkv's salt maps to vLLM's cache_salt (a str: the salt bytes decoded as UTF-8). What vLLM has no name for
# goes into the extra keys under pagedkv's own tags, so keys stay distinct but match no vLLM key: an epoch
# above 0 ("pagedkv_epoch", n) and request-level extras ("pagedkv_extra", bytes) on the first block, a
# block's own extras ("pagedkv_extra", bytes) on that block.

VLLM_NONE_HASH_SEED = "vllm-none-hash"  # vLLM's DEFAULT_NONE_HASH_SEED


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes([major << 5 | extra]) + n.to_bytes(size, "big")
    raise InvalidArgumentError(f"cbor: integer {n} does not fit 64 bits")


def cbor_canonical(obj: object) -> bytes:
    """Canonical CBOR (RFC 8949 4.2.1, as `cbor2.dumps(obj, canonical=True)`) of None, bools, ints of up to
    64 bits, bytes, str, and tuples or lists of them: the types vLLM's block hashes are made of."""
    if obj is None:
        return b"\xf6"
    if isinstance(obj, bool):
        return b"\xf5" if obj else b"\xf4"
    if isinstance(obj, int):
        return _cbor_head(0, obj) if obj >= 0 else _cbor_head(1, -1 - obj)
    if isinstance(obj, bytes):
        return _cbor_head(2, len(obj)) + obj
    if isinstance(obj, str):
        data = obj.encode()
        return _cbor_head(3, len(data)) + data
    if isinstance(obj, tuple | list):
        return _cbor_head(4, len(obj)) + b"".join(cbor_canonical(x) for x in obj)
    raise InvalidArgumentError(f"cbor: cannot encode {type(obj).__name__}")


def sha256_cbor(obj: object) -> bytes:
    """vLLM's `sha256_cbor`."""
    return hashlib.sha256(cbor_canonical(obj)).digest()


class _VllmRoot(bytes):
    """A vLLM chain's root: NONE_HASH, carrying the extra keys vLLM puts on the first block."""

    first: tuple[object, ...] = ()


class VllmKeyFunction:
    """The key function of `hash_fn="vllm"` (see above); `none_hash` is vLLM's NONE_HASH for `seed`."""

    def __init__(self, seed: str | None = None) -> None:
        import os

        self.seed = seed if seed is not None else os.environ.get("PYTHONHASHSEED", VLLM_NONE_HASH_SEED)
        self.none_hash = sha256_cbor(self.seed)

    def root(self, epoch: int, salt: bytes, extra: bytes) -> Key:
        root = _VllmRoot(self.none_hash)
        first: list[object] = []
        if salt:
            try:
                first.append(("cache_salt", salt.decode()))
            except UnicodeDecodeError:
                first.append(("cache_salt", salt))
        if epoch:
            first.append(("pagedkv_epoch", epoch))
        if extra:
            first.append(("pagedkv_extra", extra))
        root.first = tuple(first)
        return root

    def __call__(self, parent: Key, data: bytes, extra: bytes) -> Key:
        assert isinstance(parent, bytes), "prefix: vllm keys chain from bytes parents"
        keys: list[object] = list(parent.first) if isinstance(parent, _VllmRoot) else []
        if extra:
            keys.append(("pagedkv_extra", extra))
        tokens = tuple(np.frombuffer(data, dtype=np.int32).tolist())
        return sha256_cbor((bytes(parent), tokens, tuple(keys) if keys else None))


vllm_key = VllmKeyFunction()
KEY_FUNCTIONS["vllm"] = vllm_key


def key_function(name: str | KeyFunction) -> KeyFunction:
    if callable(name):
        return name
    if not isinstance(name, str):
        raise InvalidArgumentError(f"hash_fn must be a name in {sorted(KEY_FUNCTIONS)} or a function, got {name!r}")
    try:
        return KEY_FUNCTIONS[name]
    except KeyError:
        raise InvalidArgumentError(f"unknown hash {name!r}; choose one of {sorted(KEY_FUNCTIONS)}") from None


def root_key(fn: KeyFunction, epoch: int, salt: bytes, extra: bytes) -> Key:
    """The parent of a sequence's first block: one per (epoch, salt, request-level extras)."""
    custom = getattr(fn, "root", None)
    if custom is not None:  # a key function with its own root (vllm: NONE_HASH)
        return custom(epoch, salt, extra)  # type: ignore[no-any-return]
    seed = b"pagedkv/root/" + epoch.to_bytes(8, "little")
    return fn(hashlib.sha256(seed).digest(), salt, extra)


def _block_extras(given: object) -> dict[int, bytes]:
    """`block_extra` checked: a mapping from block index (an int >= 0) to that block's extra key (bytes)."""
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise InvalidArgumentError(f"block_extra must map block indices to bytes, got {type(given).__name__}")
    for index, extra in given.items():
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise InvalidArgumentError(f"block_extra: block indices are ints >= 0, got {index!r}")
        if not isinstance(extra, bytes):
            raise InvalidArgumentError(
                f"block_extra[{index}] must be bytes (encode strings first), got {type(extra).__name__}"
            )
    return dict(given)


class BlockKeys:
    """The content keys of one token sequence's full blocks, computed lazily and kept across admissions.

    A request holds one of these for its lifetime; the manager reads keys from it at admission (so a
    request that waits, or is preempted and re-admitted, hashes each block once) and appends the keys of
    blocks it publishes while the request decodes. Contract: the token ids passed with it always extend
    the tokens it has seen (the manager truncates it on rollback); the manager refuses a `BlockKeys` passed
    with token ids that disagree with the longest ones it was passed with before.
    """

    __slots__ = ("salt", "extra", "block_extra", "keys", "epoch", "_fn", "_tokens")

    def __init__(
        self, salt: bytes = b"", *, extra: bytes = b"", block_extra: Mapping[int, bytes] | None = None
    ) -> None:
        if not isinstance(salt, bytes) or not isinstance(extra, bytes):
            raise InvalidArgumentError("salt and extra keys must be bytes (encode strings first)")
        self.salt = salt
        self.extra = extra
        self.block_extra: Mapping[int, bytes] = _block_extras(block_extra)
        self.keys: list[Key] = []  # keys[0] is the root, keys[i + 1] the key of block i
        self.epoch = -1
        self._fn: KeyFunction | None = None
        self._tokens = b""  # the longest token ids passed with these keys (int32 bytes)

    def agrees_with(self, tokens: npt.NDArray[np.int32]) -> bool:
        """Whether `tokens` (int32) and the token ids these keys were used with agree where both are defined."""
        m = min(len(tokens), len(self._tokens) // 4)
        return m == 0 or tokens[:m].tobytes() == self._tokens[: 4 * m]

    def remember(self, tokens: npt.NDArray[np.int32]) -> None:
        """These keys are now used with `tokens` (int32, which `agrees_with` them)."""
        if 4 * len(tokens) > len(self._tokens):
            self._tokens = tokens.tobytes()

    def bind(self, fn: KeyFunction, epoch: int) -> None:
        """Forget keys computed under another epoch or hash function."""
        if self.epoch != epoch or self._fn is not fn:
            self.keys.clear()
            self.epoch, self._fn = epoch, fn
            self.keys.append(root_key(fn, epoch, self.salt, self.extra))

    def num_keys(self) -> int:
        """How many leading blocks have a key."""
        return len(self.keys) - 1

    def extend(self, stop: int, data: bytes, block_size: int) -> None:
        """Compute the keys of blocks `num_keys()` .. `stop - 1`, in order, from `data`: those blocks' token
        ids (int32 bytes, starting at block `num_keys()`). One loop for a run of blocks (`key`, per block)."""
        n = len(self.keys) - 1
        assert self._fn is not None and len(data) >= 4 * block_size * (stop - n), "prefix: keys need their tokens"
        fn, keys, extras, width = self._fn, self.keys, self.block_extra, 4 * block_size
        parent = keys[n]
        for i in range(n, stop):
            off = (i - n) * width
            parent = fn(parent, data[off : off + width], extras.get(i, b""))
            keys.append(parent)

    def key(self, block_index: int, block_tokens: npt.NDArray[np.int32]) -> Key:
        """Key of block `block_index`, computing it (and remembering it) if it is the next one."""
        n = len(self.keys) - 1
        if block_index < n:
            return self.keys[block_index + 1]
        assert block_index == n and self._fn is not None, "prefix: keys must be computed in block order"
        k = self._fn(self.keys[n], block_tokens.tobytes(), self.block_extra.get(block_index, b""))
        self.keys.append(k)
        return k

    def truncate(self, num_blocks: int, num_tokens: int | None = None) -> None:
        """Keep the keys of the first `num_blocks` blocks (and the first `num_tokens` token ids seen)."""
        del self.keys[num_blocks + 1 :]
        if num_tokens is not None:
            self._tokens = self._tokens[: 4 * num_tokens]

    def copy(self) -> BlockKeys:
        other = BlockKeys(self.salt, extra=self.extra, block_extra=self.block_extra)
        other.keys = list(self.keys)
        other.epoch, other._fn = self.epoch, self._fn
        other._tokens = self._tokens
        return other
