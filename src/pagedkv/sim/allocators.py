"""The four allocators the simulator compares, all speaking the manager protocol to the same scheduler.

Each is a manager kind from `pagedkv.engine.managers.make_manager` (the one factory the engine and the
benchmarks use too) plus what the simulated engine tells it about a request's output length:

- `contiguous-max`: FasterTransformer-style. The `contiguous` kind, one contiguous run of `max_model_len`
  tokens per request reserved at admission (`max_new_tokens = max_model_len - prompt_len`).
- `contiguous-oracle`: Orca "oracle"-style. The `contiguous` kind, one contiguous run of exactly prompt + true
  output length, as if the output length were known in advance (`max_new_tokens` = the true output length).
- `paged`: the `paged` kind, fixed-size blocks on demand, with prefix caching off.
- `paged-prefix`: the same with prefix caching (shared full blocks, LRU eviction of cached-free blocks).

For hybrid models (sliding-window layers), two more run beside the paged ones (`hybrid_twin`):

- `hybrid`: the `hybrid` kind (`HybridKVManager`, one block table per KV cache group, windowed groups
  releasing blocks as the window passes), prefix caching off: the twin of `paged`.
- `hybrid-prefix`: the same with prefix caching (its own eviction order: out-of-window blocks first): the
  twin of `paged-prefix`. `eviction` and `partial_reuse` are `PagedKVManager` options and do not apply.

Contiguous reservations are rounded up to whole blocks of `block_size` tokens, like every other allocation.
The paged managers are told `max_new_tokens = max_model_len - prompt_len` (all a real engine knows), which
they do not reserve.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.core import ContiguousKVManager, PagedKVManager
from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.group import KVGroupSpec
from pagedkv.core.hybrid import HybridKVManager
from pagedkv.engine.managers import ManagerKind, make_manager

# simulator allocator -> (manager kind, prefix caching)
_MANAGERS: dict[str, tuple[ManagerKind, bool]] = {
    "contiguous-max": ("contiguous", False),
    "contiguous-oracle": ("contiguous", False),
    "paged": ("paged", False),
    "paged-prefix": ("paged", True),
}
ALLOCATORS: tuple[str, ...] = tuple(_MANAGERS)
CONTIGUOUS = frozenset(name for name, (kind, _) in _MANAGERS.items() if kind == "contiguous")
# hybrid allocator -> (its paged twin, prefix caching); run for hybrid models only (not in ALLOCATORS)
_HYBRID: dict[str, tuple[str, bool]] = {"hybrid": ("paged", False), "hybrid-prefix": ("paged-prefix", True)}
HYBRID_ALLOCATORS: tuple[str, ...] = tuple(_HYBRID)


def check_allocator(name: str) -> str:
    if name not in ALLOCATORS and name not in _HYBRID:
        raise InvalidArgumentError(
            f"unknown allocator {name!r}; choose from {', '.join(ALLOCATORS + HYBRID_ALLOCATORS)}"
        )
    return name


def is_hybrid_allocator(name: str) -> bool:
    return name in _HYBRID


def hybrid_twin(name: str) -> str | None:
    """The hybrid allocator run beside paged allocator `name` for a hybrid model (None: it has none)."""
    return next((h for h, (twin, _) in _HYBRID.items() if twin == name), None)


def manager_for(
    name: str,
    num_blocks: int,
    block_size: int,
    *,
    eviction: str = "lru",
    partial_reuse: bool = False,
    groups: Sequence[KVGroupSpec] | None = None,
    record_events: bool = False,
) -> PagedKVManager | ContiguousKVManager | HybridKVManager:
    """A fresh, empty manager for simulator allocator `name` over `num_blocks` blocks of `block_size` tokens;
    `eviction` and `partial_reuse` apply where a paged allocator caches prefixes; `groups`: the hybrid
    allocators' KV cache groups (one full group when not given); `record_events`: the manager records its
    cache events (a replica feeding a router, `pagedkv.sim.replicas`)."""
    if check_allocator(name) in _HYBRID:
        return make_manager("hybrid", num_blocks, block_size, enable_prefix_caching=_HYBRID[name][1], groups=groups,
                            record_events=record_events)  # fmt: skip
    kind, prefix_caching = _MANAGERS[name]
    if not prefix_caching:
        return make_manager(kind, num_blocks, block_size, enable_prefix_caching=False, record_events=record_events)
    return make_manager(
        kind, num_blocks, block_size, enable_prefix_caching=True, eviction=eviction, partial_reuse=partial_reuse,
        record_events=record_events,
    )  # fmt: skip


def max_new_tokens_for(name: str, prompt_len: int, output_len: int, max_model_len: int) -> int:
    """What the engine tells the allocator about a request's output length under allocator `name`."""
    if name == "contiguous-oracle":
        return output_len
    return max_model_len - prompt_len
