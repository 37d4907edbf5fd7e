"""The manager protocol: the one interface schedulers and the simulator speak to a KV allocator.

Three implementations exist: `PagedKVManager` (fixed-size blocks on demand, prefix sharing, copy-on-write),
`HybridKVManager` (the same over KV cache groups: full, sliding window, chunked local) and
`ContiguousKVManager` (the baseline: one contiguous run reserved for a request's maximum length at
admission). Every comparison in pagedkv runs the same scheduler with only the allocator swapped, and the
engine, its tiers and its event log ask this protocol what a manager does (`num_groups`, `reserves_chunks`,
`records_events`, `grouped_events`), never its class: only `pagedkv.engine.managers` names the classes.

Contract:
- Sequence ids are handles handed out by `admit`/`fork` (small non-negative ints, reused after `free`, like
  file descriptors). Batched calls take them as an int array and index numpy state directly.
- Capacity shortfall returns `None`/`False` and changes nothing. Misuse raises a `PagedKVError` subclass
  and changes nothing.
- `admit` allocates for the given tokens only (plus `num_lookahead`); `append` grows a batch of sequences by
  `num_tokens` each in one call. Blocks are published to the prefix cache when `mark_computed` says their KV
  is written, never before, so a request admitted in the same step cannot hit them.
- `swap_out`/`swap_in` move a sequence's KV to host blocks and back (the paged manager; the contiguous one
  raises `NotSupportedError`, and says so in `supports_swap`).
- `take_copies` hands out the copy-on-write block copies (src -> dst) that the storage layer must perform
  before the next forward pass; each copy is handed out once.
- `fetch_blocks` is a tier hit: the manager keys a sequence's next full blocks and asks a `BlockSource`
  (the tiers below the device) for their KV; the bytes come back as a `BlockFill` for the step's plan, and
  the blocks count as computed only when the caller's `mark_computed` says so, after the forward.

Block moves of one step (the one safe order, followed by the engine's runner):

1. swap plans (`swap_in` host -> device, `swap_out` device -> host) in the order the calls returned them;
2. then the copies of `take_copies()`, as one batch: destinations are distinct and none is a source, so
   their order does not matter;
3. then the fills of `fetch_blocks` (bytes from a tier into blocks no other move of the step writes);
4. then the forward pass writes the step's new KV.

One writer per device block per step: a block that one of these moves writes is written by no other
(a swap-in's block that the same step swaps out again has been read back first, so it may be written
again). The engine's scheduler checks its whole plan against this rule (`SchedulerOutput.check_writes`).

The managers make this order safe for every sequence of calls: a block that is the source or the
destination of a copy not yet handed out is held until `take_copies` returns it (no swap-in or later copy
can reuse it), a copy from a block that is itself a pending destination copies from that one's source, and
a swap-out plan reads a pending destination's source (which holds the same KV until the forward pass).
Applying a step's copies before its swaps is not safe: a swap-in may fill a block that a copy then reads
(a sequence swapped in, forked and written in the same step), and a swap-out may read a block a later copy
fills.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from pagedkv.core.prefix import BlockKeys, Key

if TYPE_CHECKING:
    from pagedkv.core.group_keys import GroupCacheEvent
    from pagedkv.core.misses import MissCounter
    from pagedkv.core.prefix_index import CacheEvent, PrefixIndex

IntArray = npt.NDArray[np.int64]
TokenIds = npt.ArrayLike  # a 1-D sequence of non-negative ints (list, tuple, numpy array)


class Admission(NamedTuple):
    """What `admit` returns: the new sequence's handle and how many prompt tokens came from the cache."""

    seq_id: int
    num_cached_tokens: int


class BlockMoves(NamedTuple):
    """KV block moves `src[i] -> dst[i]`: a step's copy-on-write copies (device -> device, from
    `take_copies`), a swap-out (device -> host) or a swap-in (host -> device). Run them in the order above."""

    src: IntArray
    dst: IntArray


class BlockFill(NamedTuple):
    """KV from below the device for blocks of one sequence (a tier hit): `rows[i]` (a block's bytes, K and V
    of every layer) is written into device block `dst[i]` after the step's other moves, before the forward."""

    dst: IntArray
    rows: npt.NDArray[np.uint8]


class BlockSource(Protocol):
    """Where a manager may find the KV of blocks no device block holds (the tiers below the device)."""

    def fetch(self, keys: Sequence[Key], first_block: int, tag: object) -> tuple[int, npt.NDArray[np.uint8]]:
        """The bytes of the longest leading run of `keys` (the content keys of blocks `first_block`, ... of
        the sequence the caller's `tag` names) that it holds: (how many, their rows)."""
        ...




@dataclass(frozen=True, slots=True)
class ManagerStats:
    """Cumulative counters. `hit_rate` = cached prompt tokens / prompt tokens admitted. `miss_lookups` and
    `miss_tokens` count admissions and their uncached tokens by reason (`pagedkv.core.misses`; empty where
    the manager has no prefix cache)."""

    admissions: int
    preemptions: int
    prompt_tokens: int
    cached_tokens: int
    evictions: int
    cow_copies: int
    verify_failures: int
    blocks_in_use: int
    num_blocks: int
    miss_lookups: dict[str, int] = field(default_factory=dict)
    miss_tokens: dict[str, int] = field(default_factory=dict)
    partial_hits: int = 0  # admissions that copied a partially matching block (their tokens are in cached_tokens)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class CSRPages(NamedTuple):
    """FlashInfer-style paged layout: pages of sequence i are `indices[indptr[i]:indptr[i+1]]`."""

    indptr: npt.NDArray[np.int32]
    indices: npt.NDArray[np.int32]
    last_page_len: npt.NDArray[np.int32]


@runtime_checkable
class KVManager(Protocol):
    """What a scheduler may ask of an allocator. See the module docstring for the contract."""

    @property
    def block_size(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could take now (free plus evictable cached blocks)."""
        ...

    @property
    def num_used_blocks(self) -> int: ...

    @property
    def capacity_tokens(self) -> int:
        """The most tokens one sequence can ever hold."""
        ...

    def can_admit(self, token_ids: TokenIds, *, max_new_tokens: int = 0) -> bool: ...

    def admit(
        self,
        token_ids: TokenIds,
        *,
        max_new_tokens: int = 0,
        priority: int = 0,
        salt: bytes = b"",
        num_lookahead: int = 0,
        keys: BlockKeys | None = None,
        keep_free: int = 0,
    ) -> Admission | None:
        """Allocate for `token_ids`; `keys` (a request's `BlockKeys`) lets re-admissions skip hashing. `None`
        also when admitting would leave fewer than `keep_free` blocks free (the scheduler's growth reserve)."""
        ...

    def num_blocks_to_append(self, seq_ids: npt.ArrayLike, num_tokens: int = 1) -> int:
        """Blocks that `append(seq_ids, num_tokens)` would take from the pool."""
        ...

    def append(
        self, seq_ids: npt.ArrayLike, token_ids: npt.ArrayLike | None = None, num_tokens: int = 1
    ) -> bool:
        """Grow every sequence by `num_tokens` slots (token ids `[B, num_tokens]` or `[B]` when given)."""
        ...

    def mark_computed(self, seq_ids: npt.ArrayLike, num_computed_tokens: npt.ArrayLike | None = None) -> None:
        """Record that KV is written up to `num_computed_tokens` (default: all tokens); publishes full blocks."""
        ...

    def free(self, seq_id: int) -> None: ...

    def preempt(self, seq_id: int) -> int:
        """Free a running sequence to make room; returns how many tokens it held."""
        ...

    def fork(self, seq_id: int) -> int | None:
        """A new sequence with `seq_id`'s tokens: sharing its blocks (paged), or a copy (`None` if no room)."""
        ...

    def num_tokens(self, seq_id: int) -> int: ...

    def rollback(self, seq_id: int, num_tokens: int) -> None:
        """Drop the last `num_tokens` tokens of a sequence (rejected speculative tokens): blocks they alone
        used go back to the pool, never published."""
        ...

    def take_copies(self) -> BlockMoves: ...

    def fetch_blocks(
        self, seq_id: int, start: int, end: int, source: BlockSource, tag: object = None
    ) -> BlockFill | None:
        """A tier hit: ask `source` for the KV of the full blocks of tokens `[start, end)` (`start` on a block
        boundary at or past the computed tokens; never the block of token `end - 1`, which the caller
        computes). The blocks it fills are marked computed by the caller's `mark_computed` after the
        forward, like computed ones. None when nothing is fetched (or the manager keys no blocks)."""
        ...

    @property
    def num_groups(self) -> int:
        """KV cache groups: each block position of a sequence has one device block and one tier key per group
        (1 for a uniform model; the hybrid manager's groups, `pagedkv.core.group`)."""
        ...

    @property
    def reserves_chunks(self) -> bool:
        """Whether `admit` takes `chunk_tokens` (the tokens its first chunk computes) and later chunks need
        `reserve` first (windowed groups hold only the window and one chunk); False: `admit` and `append`
        take every slot and `reserve` has nothing to do."""
        ...

    def reserve(self, seq_ids: npt.ArrayLike, ends: npt.ArrayLike) -> bool:
        """Slots for tokens up to `ends[i]` of each sequence, all or nothing; False (nothing changed) if the
        pool is short. Always True where `reserves_chunks` is False."""
        ...

    @property
    def records_events(self) -> bool:
        """Whether `take_events` reports the prefix cache's stored/removed/cleared events (built with
        `record_events=True`): what the tiers and the event logs read. False for the contiguous baseline."""
        ...

    @property
    def grouped_events(self) -> bool:
        """Whether events are `GroupCacheEvent`s (a content key and its group) and the tiers key each group's
        copy of a block under its group-qualified key (`pagedkv.core.group_keys`): the hybrid manager, one
        group included. False: `CacheEvent`s and the plain content keys."""
        ...

    def take_events(self) -> Sequence[CacheEvent | GroupCacheEvent]:
        """The cache events since the last call, in order (empty unless `records_events`)."""
        ...

    @property
    def index(self) -> PrefixIndex | None:
        """The prefix index (key <-> block, and with `records_events` each stored block's parent and tokens,
        `PrefixIndex.published_from`), to read: what an event feed asks besides the events. None without a
        prefix cache."""
        ...

    @property
    def misses(self) -> MissCounter | None:
        """Why admitted prompt tokens missed the cache, live (`pagedkv.core.misses`); None without a cache."""
        ...

    def count_tier_miss(self, seq_id: int, num_tokens: int) -> None:
        """`num_tokens` that `seq_id`'s admission missed were lost by a tier below the device too: they move
        to the miss reason `tier` (nothing to do without a prefix cache)."""
        ...

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns how many keys were dropped (0 without a cache)."""
        ...

    @property
    def epoch(self) -> int: ...

    def bump_epoch(self) -> int:
        """Make every key published so far unmatchable (after a weight update); returns the new epoch."""
        ...

    @property
    def hot_path(self) -> str:
        """The backend the per-element loops run in (`pagedkv.core.hotpath`): "native" (the C extension) or
        "python"; "-" for a manager without them (the contiguous baseline)."""
        ...

    @property
    def supports_swap(self) -> bool:
        """Whether `swap_out`/`swap_in` are implemented (the paged manager; it swaps into its host blocks)."""
        ...

    def swap_out(self, seq_id: int) -> BlockMoves | None:
        """Move a running sequence's KV to host blocks (device -> host moves); `None` if the host is short.
        Raises `NotSupportedError` where `supports_swap` is False."""
        ...

    def swap_in(self, seq_id: int) -> BlockMoves | None:
        """Bring a swapped-out sequence back (host -> device moves); `None` if the device is short.
        Raises `NotSupportedError` where `supports_swap` is False."""
        ...

    @property
    def stats(self) -> ManagerStats:
        """Cumulative counters (admissions, preemptions, prompt and cached tokens, ...)."""
        ...

    def block_table(self, seq_ids: npt.ArrayLike, *, pad_id: int | None = None) -> npt.NDArray[np.int32]: ...

    def seq_lens(self, seq_ids: npt.ArrayLike) -> npt.NDArray[np.int32]: ...

    def slot_mapping(
        self, seq_ids: npt.ArrayLike, starts: npt.ArrayLike, ends: npt.ArrayLike
    ) -> npt.NDArray[np.int64]: ...

    def csr(self, seq_ids: npt.ArrayLike) -> CSRPages: ...

    def check_invariants(self) -> None: ...
