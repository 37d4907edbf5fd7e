"""Stub of the C extension `pagedkv.core._native` (src/pagedkv/core/_native.c).

The functions are `hotpath.PythonBackend`'s, in C; their contract is written once, in `hotpath.py`. The
parameters are typed as loosely as the `hotpath.Backend` protocol allows, so that the module satisfies it.
"""

from collections.abc import Sequence
from typing import Any

from _typeshed import ReadableBuffer

NAME: str

def match(
    kind: int,
    index: dict[Any, int],
    known: list[Any],
    data: Any,
    width: int,
    max_blocks: int,
    group: int | None = None,
) -> list[int]: ...
def extend_keys(kind: int, known: list[Any], data: Any, width: int, stop: int) -> None: ...
def publish_groups(
    kind: int,
    prefix: tuple[dict[Any, int], list[Any], Any],
    seq_keys: list[Any],
    rows: Any,
    computed: Any,
    groups: tuple[tuple[Any, Any, Any, Any, Any], ...],
    tokens: Any,
    block_size: int,
) -> list[int]: ...
def publish_rows(
    kind: int,
    prefix: tuple[dict[Any, int], list[Any], Any],
    key_lists: Sequence[list[Any]],
    starts: Any,
    stops: Any,
    blocks: Any,
    width: int,
    ids: Any,
) -> list[int]: ...
def forget_keys(prefix: tuple[dict[Any, int], list[Any], Any], ids: Any, dropped: Any = None) -> None: ...
def check_rows(on_device: Any, mark: Any, rows: Any) -> int: ...
def publish_computed(
    kind: int,
    prefix: tuple[dict[Any, int], list[Any], Any],
    seq_keys: list[Any],
    epochs: Any,
    epoch: int,
    rows: Any,
    computed: Any,
    tables: tuple[Any, Any, Any, Any, Any],
    blocks: Any,
) -> list[int]: ...
def take_live(
    queue_ids: Any, queue_stamps: Any, head: int, tail: int, stamp: Any, out: Any, filled: int
) -> tuple[int, int]: ...
def release_refs(ref: Any, keyed: Any, ids: Any, stack: Any, top: int, out: Any) -> tuple[int, int]: ...
def growth(rows: Any, num_tokens: Any, num_blocks: Any, k: int, block_size: int) -> tuple[int, int]: ...
def grow(
    rows: Any,
    num_tokens: Any,
    num_blocks: Any,
    table: Any,
    k: int,
    block_size: int,
    ids: Any,
    tokens: Any,
    block_tokens: Any,
) -> None: ...
def sha256(data: ReadableBuffer, *, portable: bool = False) -> bytes: ...
def has_sha_ni() -> bool: ...
