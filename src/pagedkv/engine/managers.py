"""`make_manager`: the one place a KV manager is built from a kind name. Torch-free.

The engine (`EngineConfig.allocator`), the simulator (`pagedkv.sim.allocators`) and the allocator benchmark
(`pagedkv bench allocator --allocator`) all build their managers here, so a kind means one thing everywhere:

- `"paged"`: `PagedKVManager`, fixed-size blocks on demand; prefix caching, a host pool for swapping and
  event recording are its options.
- `"hybrid"`: `HybridKVManager`, KV cache groups (full, sliding window, chunked local) over one pool,
  one block table per group, windowed groups releasing blocks as the window passes (`groups`: the
  model's; one full group when not given).
- `"contiguous"`: `ContiguousKVManager`, one contiguous run per request reserved at admission (the
  baseline). It has none of the paged options and ignores them: the engine's default configuration turns
  prefix caching on for either kind, and the benchmark passes its hash and hot-path flags to both.

Prefix caching is an option of the paged kind, not a kind of its own: the simulator's names `paged-prefix`,
`contiguous-max` and `contiguous-oracle` are comparison policies built on these two kinds (see
`pagedkv.sim.allocators`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pagedkv.core import ContiguousKVManager, PagedKVManager
from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.group import KVGroupSpec
from pagedkv.core.hybrid import HybridKVManager

# The kinds most entry points name in their types; "hybrid" is accepted too (MANAGER_KINDS), built with the
# model's KV cache groups (`groups`). `make_manager` has one signature (no per-kind overloads): every caller
# uses what the three managers have in common (the manager protocol), so none needs a narrower type.
ManagerKind = Literal["paged", "contiguous"]
MANAGER_KINDS: tuple[str, ...] = ("paged", "contiguous", "hybrid")


def is_hybrid(kind: str) -> bool:
    """Whether allocator `kind` is the hybrid one (KV cache groups from the model)."""
    return kind == "hybrid"


def make_manager(
    kind: str,
    num_blocks: int,
    block_size: int,
    *,
    enable_prefix_caching: bool = True,
    num_host_blocks: int = 0,
    record_events: bool = False,
    hash_fn: str = "sha256",
    native: bool | None = None,
    eviction: str = "lru",
    partial_reuse: bool = False,
    groups: Sequence[KVGroupSpec] | None = None,
) -> PagedKVManager | ContiguousKVManager | HybridKVManager:
    """A fresh, empty manager of `kind` over `num_blocks` blocks (block 0 the null block) of `block_size`
    tokens. An unknown kind raises `InvalidArgumentError`; the managers check their own arguments."""
    if kind == "paged":
        return PagedKVManager(
            num_blocks,
            block_size,
            enable_prefix_caching=enable_prefix_caching,
            num_host_blocks=num_host_blocks,
            record_events=record_events,
            hash_fn=hash_fn,
            native=native,
            eviction=eviction,
            partial_reuse=partial_reuse,
        )
    if kind == "contiguous":
        return ContiguousKVManager(num_blocks, block_size)
    if kind == "hybrid":
        return HybridKVManager(
            num_blocks, block_size, tuple(groups) if groups is not None else (KVGroupSpec(),),
            enable_prefix_caching=enable_prefix_caching, num_host_blocks=num_host_blocks,
            record_events=record_events, hash_fn=hash_fn, native=native, eviction=eviction,
        )  # fmt: skip
    raise InvalidArgumentError(f"unknown allocator {kind!r}; choose from {', '.join(MANAGER_KINDS)}")
