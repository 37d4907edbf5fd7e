"""The four allocators the simulator compares, all speaking the manager protocol to the same scheduler.

- `contiguous-max`: FasterTransformer-style. One contiguous run of `max_model_len` tokens per request,
  reserved at admission (`max_new_tokens = max_model_len - prompt_len`).
- `contiguous-oracle`: Orca "oracle"-style. One contiguous run of exactly prompt + true output length, as if
  the output length were known in advance (`max_new_tokens` = the true output length).
- `paged`: fixed-size blocks on demand, no prefix caching.
- `paged-prefix`: the same with prefix caching (shared full blocks, LRU eviction of cached-free blocks).

Contiguous reservations are rounded up to whole blocks of `block_size` tokens, like every other allocation.
The paged managers are told `max_new_tokens = max_model_len - prompt_len` (all a real engine knows), which
they do not reserve.
"""

from __future__ import annotations

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.protocol import KVManager

ALLOCATORS: tuple[str, ...] = ("contiguous-max", "contiguous-oracle", "paged", "paged-prefix")
CONTIGUOUS = frozenset({"contiguous-max", "contiguous-oracle"})


def check_allocator(name: str) -> str:
    if name not in ALLOCATORS:
        raise InvalidArgumentError(f"unknown allocator {name!r}; choose from {', '.join(ALLOCATORS)}")
    return name


def make_manager(name: str, num_blocks: int, block_size: int) -> KVManager:
    """A fresh, empty manager of kind `name` over `num_blocks` blocks of `block_size` tokens."""
    from pagedkv.core import ContiguousKVManager, PagedKVManager

    check_allocator(name)
    if name in CONTIGUOUS:
        manager: KVManager = ContiguousKVManager(num_blocks, block_size)
    else:
        manager = PagedKVManager(num_blocks, block_size, enable_prefix_caching=name == "paged-prefix")
    return manager


def max_new_tokens_for(name: str, prompt_len: int, output_len: int, max_model_len: int) -> int:
    """What the engine tells the allocator about a request's output length under allocator `name`."""
    if name == "contiguous-oracle":
        return output_len
    return max_model_len - prompt_len


def reserved_tokens(name: str, prompt_len: int, output_len: int, max_model_len: int) -> int:
    """Tokens a request holds at the end of its life under allocator `name` (before block rounding)."""
    if name == "contiguous-max":
        return max_model_len
    return prompt_len + output_len
