"""Argument checks shared by both managers: misuse becomes a one-line typed error, naming the argument,
before any state changes.

Every integer a caller passes (a count, a priority, a length, a range end) is an `int` or a numpy integer,
never a bool, and lies where int64 arithmetic on it cannot wrap: counts and lengths below `MAX_COUNT`
(2**62), priorities inside int64. Token ids lie in [0, 2**31).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.prefix import BlockKeys

MAX_TOKEN_ID = 2**31 - 1
MAX_COUNT = 2**62  # counts and lengths stay below this, so sums of two never wrap int64
MAX_BLOCK_SIZE = 2**20  # tokens per block: larger is a unit mistake (and a multi-TiB token mirror)
MAX_NUM_BLOCKS = 2**31 - 1  # block ids are int32 in the tables


def as_tokens(token_ids: npt.ArrayLike, what: str = "token_ids") -> npt.NDArray[np.int32]:
    """A non-empty 1-D int32 array of token ids in [0, 2^31)."""
    arr = _array(token_ids, what)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        raise InvalidArgumentError(f"{what} is empty; a sequence needs at least one token")
    return _checked(arr, what)


def as_token_matrix(token_ids: npt.ArrayLike, batch: int, k: int) -> npt.NDArray[np.int32]:
    """`[batch, k]` int32 token ids (a `[batch]` vector is accepted when k == 1)."""
    arr = _array(token_ids, "token_ids")
    if arr.ndim == 1 and k == 1:
        arr = arr[:, None]
    if arr.shape != (batch, k):
        raise InvalidArgumentError(f"token_ids must have shape ({batch}, {k}) (or ({batch},) for one token), got {arr.shape}")
    return _checked(arr, "token_ids")


def _array(value: npt.ArrayLike, what: str) -> npt.NDArray[np.generic]:
    try:
        return np.asarray(value)
    except (ValueError, TypeError, OverflowError) as e:  # ragged lists and the like
        raise InvalidArgumentError(f"{what} must be an array of ints ({e})") from None


def _checked(arr: npt.NDArray[np.generic], what: str) -> npt.NDArray[np.int32]:
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{what} must be integers, got dtype {arr.dtype}")
    # int32 can only be wrong in sign: skip the max reduction on the hot path
    if arr.size and (int(arr.min()) < 0 or (arr.dtype != np.int32 and int(arr.max()) > MAX_TOKEN_ID)):
        raise InvalidArgumentError(f"{what} must lie in [0, 2^31), got values in [{arr.min()}, {arr.max()}]")
    return arr.astype(np.int32, copy=False)


def as_int(value: object, what: str, *, minimum: int, maximum: int) -> int:
    """A Python or numpy integer (not a bool) in [minimum, maximum]."""
    if type(value) is int and minimum <= value <= maximum:  # the common case, first
        return value
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise InvalidArgumentError(f"{what} must be an int, got {type(value).__name__}")
    v = int(value)
    if v < minimum:
        raise InvalidArgumentError(f"{what} must be >= {minimum}, got {v}")
    if v > maximum:
        raise InvalidArgumentError(f"{what} must be <= {maximum}, got {v}")
    return v


def as_count(value: object, what: str, *, minimum: int = 0) -> int:
    return as_int(value, what, minimum=minimum, maximum=MAX_COUNT - 1)


def as_rollback(num_tokens: object, held: int, seq_id: int) -> int:
    """The tokens a sequence holding `held` keeps after `rollback(seq_id, num_tokens)`; `InvalidArgumentError`
    for a count that is not one, or above what it holds."""
    n = as_count(num_tokens, "num_tokens")
    if n > held:
        raise InvalidArgumentError(f"cannot roll back {n} tokens: sequence {seq_id} holds {held}")
    return held - n


def as_priority(value: object) -> int:
    """A retention priority: any int64."""
    return as_int(value, "priority", minimum=-(2**63), maximum=2**63 - 1)


# `admit`'s scalar arguments once checked: (tokens, max_new_tokens, num_lookahead, keep_free, priority); the
# block arithmetic on them is each manager's own. A plain tuple: callers unpack it at once, and a NamedTuple's
# constructor is one more Python call on every admission.
AdmitArgs = tuple[npt.NDArray[np.int32], int, int, int, int]


def as_admission(
    token_ids: npt.ArrayLike, max_new_tokens: object, num_lookahead: object, keep_free: object, priority: object
) -> AdmitArgs:
    """Every manager's `admit` checks, in one order (so equal misuse is refused with equal words by each)."""
    tokens = as_tokens(token_ids)
    return (
        tokens,
        as_count(max_new_tokens, "max_new_tokens"),
        as_count(num_lookahead, "num_lookahead"),
        as_count(keep_free, "keep_free"),
        as_priority(priority),
    )


def as_flag(value: object, what: str) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise InvalidArgumentError(f"{what} must be True or False, got {value!r}")
    return bool(value)


def as_native(value: object) -> bool | None:
    """The `native` switch: None (the C extension when built), True (required) or False (Python)."""
    if value is not None and not isinstance(value, bool):
        raise InvalidArgumentError(f"native must be None, True or False, got {value!r}")
    return value


def as_salt(salt: object) -> bytes:
    if not isinstance(salt, bytes):
        raise InvalidArgumentError(f"salt must be bytes, got {type(salt).__name__} (encode strings first)")
    return salt


def as_keys(keys: object, salt: bytes, tokens: npt.NDArray[np.int32]) -> BlockKeys | None:
    """A request's `BlockKeys` (or None), checked against the salt and the tokens it is passed with.

    The keys must extend the tokens they were last used with (their contract); a `BlockKeys` reused for
    another prompt would serve that prompt's KV, so it is refused.
    """
    if keys is None:
        return None
    if not isinstance(keys, BlockKeys):
        raise InvalidArgumentError(f"keys must be a BlockKeys (or None), got {type(keys).__name__}")
    if salt and keys.salt != salt:
        raise InvalidArgumentError("pass the salt either in keys or as salt, not two different ones")
    if not keys.agrees_with(tokens):
        raise InvalidArgumentError(
            "keys: this BlockKeys was used with other token ids; each request needs its own BlockKeys"
        )
    return keys


def request_keys(tokens: npt.NDArray[np.int32], salt: object, keys: object) -> BlockKeys:
    """The keys an admission, a match or a pin uses: the request's own (checked by `as_keys`, and bound to
    these tokens), or fresh ones for `salt`."""
    salt = as_salt(salt)
    given = as_keys(keys, salt, tokens)
    if given is None:
        return BlockKeys(salt)
    given.remember(tokens)
    return given


def as_index_array(value: npt.ArrayLike, what: str, shape: tuple[int, ...]) -> npt.NDArray[np.int64]:
    """Integer positions (range starts and ends, computed counts), broadcast to `shape`, in [0, MAX_COUNT)."""
    arr = _array(value, what)
    if arr.dtype.kind not in "iu" and not (arr.size == 0 and arr.dtype.kind == "f"):
        raise InvalidArgumentError(f"{what} must be integers, got dtype {arr.dtype}")
    try:
        out = np.broadcast_to(arr, shape)
    except ValueError:
        raise InvalidArgumentError(f"{what} must be one int or one per sequence {shape}, got shape {arr.shape}") from None
    if out.size and (int(out.min()) < 0 or int(out.max()) >= MAX_COUNT):
        raise InvalidArgumentError(f"{what} must lie in [0, 2^62), got values in [{out.min()}, {out.max()}]")
    return np.ascontiguousarray(out, dtype=np.int64)


def as_computed(value: npt.ArrayLike, num_computed: npt.NDArray[np.int64], num_tokens: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """`mark_computed`'s counts for a batch: one per sequence, never backwards nor past its tokens."""
    given = as_index_array(value, "num_computed_tokens", num_tokens.shape)
    if (given > num_tokens).any() or (given < num_computed).any():
        raise InvalidArgumentError("num_computed_tokens must not go backwards nor past the tokens a sequence holds")
    return given


def as_pad_id(value: object) -> int | None:
    if value is None:
        return None
    return as_int(value, "pad_id", minimum=-(2**31), maximum=2**31 - 1)


def as_pool_size(num_blocks: object, block_size: object, *, minimum: int) -> tuple[int, int]:
    """A manager's `num_blocks` and `block_size` (ints, numpy ints too)."""
    bs = as_int(block_size, "block_size", minimum=1, maximum=MAX_BLOCK_SIZE)
    n = as_int(num_blocks, "num_blocks", minimum=minimum, maximum=MAX_NUM_BLOCKS)
    return n, bs
