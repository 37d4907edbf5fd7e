"""The four allocators the simulator compares, all speaking the manager protocol to the same scheduler.

Each is a manager kind from `pagedkv.engine.managers.make_manager` (the one factory the engine and the
benchmarks use too) plus what the simulated engine tells it about a request's output length:

- `contiguous-max`: FasterTransformer-style. The `contiguous` kind, one contiguous run of `max_model_len`
  tokens per request reserved at admission (`max_new_tokens = max_model_len - prompt_len`).
- `contiguous-oracle`: Orca "oracle"-style. The `contiguous` kind, one contiguous run of exactly prompt + true
  output length, as if the output length were known in advance (`max_new_tokens` = the true output length).
- `paged`: the `paged` kind, fixed-size blocks on demand, with prefix caching off.
- `paged-prefix`: the same with prefix caching (shared full blocks, LRU eviction of cached-free blocks).

Contiguous reservations are rounded up to whole blocks of `block_size` tokens, like every other allocation.
The paged managers are told `max_new_tokens = max_model_len - prompt_len` (all a real engine knows), which
they do not reserve.
"""

from __future__ import annotations

from pagedkv.core import ContiguousKVManager, PagedKVManager
from pagedkv.core.errors import InvalidArgumentError
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


def check_allocator(name: str) -> str:
    if name not in ALLOCATORS:
        raise InvalidArgumentError(f"unknown allocator {name!r}; choose from {', '.join(ALLOCATORS)}")
    return name


def manager_for(
    name: str, num_blocks: int, block_size: int, *, eviction: str = "lru", partial_reuse: bool = False
) -> PagedKVManager | ContiguousKVManager:
    """A fresh, empty manager for simulator allocator `name` over `num_blocks` blocks of `block_size` tokens;
    `eviction` and `partial_reuse` apply where the allocator caches prefixes."""
    kind, prefix_caching = _MANAGERS[check_allocator(name)]
    if not prefix_caching:
        return make_manager(kind, num_blocks, block_size, enable_prefix_caching=False)
    return make_manager(
        kind, num_blocks, block_size, enable_prefix_caching=True, eviction=eviction, partial_reuse=partial_reuse
    )


def max_new_tokens_for(name: str, prompt_len: int, output_len: int, max_model_len: int) -> int:
    """What the engine tells the allocator about a request's output length under allocator `name`."""
    if name == "contiguous-oracle":
        return output_len
    return max_model_len - prompt_len
