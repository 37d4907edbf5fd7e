"""Argument checks shared by the managers: misuse becomes a typed error before any state changes."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from pagedkv.core.errors import InvalidArgumentError

MAX_TOKEN_ID = 2**31 - 1


def as_tokens(token_ids: npt.ArrayLike, what: str = "token_ids") -> npt.NDArray[np.int32]:
    """A non-empty 1-D int32 array of token ids in [0, 2^31)."""
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        raise InvalidArgumentError(f"{what} is empty; a sequence needs at least one token")
    return _checked(arr, what)


def as_token_matrix(token_ids: npt.ArrayLike, batch: int, k: int) -> npt.NDArray[np.int32]:
    """`[batch, k]` int32 token ids (a `[batch]` vector is accepted when k == 1)."""
    arr = np.asarray(token_ids)
    if arr.ndim == 1 and k == 1:
        arr = arr[:, None]
    if arr.shape != (batch, k):
        raise InvalidArgumentError(f"token_ids must have shape ({batch}, {k}) (or ({batch},) for one token), got {arr.shape}")
    return _checked(arr, "token_ids")


def _checked(arr: npt.NDArray[np.generic], what: str) -> npt.NDArray[np.int32]:
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{what} must be integers, got dtype {arr.dtype}")
    # int32 can only be wrong in sign: skip the max reduction on the hot path
    if arr.size and (int(arr.min()) < 0 or (arr.dtype != np.int32 and int(arr.max()) > MAX_TOKEN_ID)):
        raise InvalidArgumentError(f"{what} must lie in [0, 2^31), got values in [{arr.min()}, {arr.max()}]")
    return arr.astype(np.int32, copy=False)


def as_count(value: object, what: str, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InvalidArgumentError(f"{what} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise InvalidArgumentError(f"{what} must be >= {minimum}, got {value}")
    return int(value)


def as_salt(salt: object) -> bytes:
    if not isinstance(salt, bytes):
        raise InvalidArgumentError(f"salt must be bytes, got {type(salt).__name__} (encode strings first)")
    return salt
