"""pagedkv.core: the torch-free allocator. Python + numpy; only integers cross into it. Its hot loops
(`hotpath`) run in a small optional C extension when the package was built with a C compiler, else in
their Python reference.

Public surface: `PagedKVManager` (paged, prefix caching, copy-on-write), `ContiguousKVManager` (the
baseline), the `KVManager` protocol they share, `BlockKeys` (a request's reusable prefix keys) and the
typed errors.
"""

from pagedkv.core.contiguous import ContiguousKVManager
from pagedkv.core.copies import PinHandle
from pagedkv.core.errors import (
    CapacityError,
    InvalidArgumentError,
    InvariantError,
    NotSupportedError,
    PagedKVError,
    PinError,
    UnknownSequenceError,
)
from pagedkv.core.manager import PagedKVManager
from pagedkv.core.pool import CacheEvent
from pagedkv.core.prefix import BlockKeys
from pagedkv.core.protocol import Admission, BlockMoves, CSRPages, KVManager, ManagerStats

__all__ = [
    "Admission", "BlockKeys", "BlockMoves", "CSRPages", "CacheEvent", "CapacityError",
    "ContiguousKVManager", "InvalidArgumentError", "InvariantError", "KVManager", "ManagerStats",
    "NotSupportedError", "PagedKVError", "PagedKVManager", "PinError", "PinHandle", "UnknownSequenceError",
]  # fmt: skip
