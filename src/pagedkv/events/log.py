"""The event log of one replica: which block keys each medium holds, and the events that say so.

Every tier reports its changes here, as copies of keys entering or leaving a medium; the log turns them into
vLLM-compatible events (`wire.py`) that describe exactly the set of keys each medium can serve:

    log = EventLog(block_size=16)
    log.stored("CPU", keys, parent=parent_key, token_ids=tokens)   # a chain: keys[i]'s parent is keys[i-1]
    log.removed("CPU", keys)                                        # any keys, any order
    log.cleared("GPU")                                              # the medium forgot everything
    batch = log.take_batch()                                        # EventBatch or None; publish it

Rules (where vLLM's own events misled routers):

- Copies are counted per key per medium. `BlockStored` is sent when a medium goes from 0 to 1 copy of a key,
  `BlockRemoved` only when its last copy goes (two GPU blocks holding one key, evicted one at a time, send
  one removal, after the second). A key stored again after its removal is reported again.
- No event references a parent the consumer does not hold: the parent of a reported chain is sent only while
  some medium of this log holds it; otherwise the chain is sent as a root (`parent_block_hash = None`).
- `AllBlocksCleared` carries no medium in vLLM's format, so it means "this replica holds nothing". It is sent
  only by `cleared` (a reset or an epoch bump); the keys the other media still hold are re-announced right
  after it, parents first, so the consumer's view stays exact.
- Validation happens before any state changes: an unknown medium, or a removal of a copy the medium does not
  hold, raises `InvalidArgumentError` and changes nothing.

The log keeps, per held key, its parent and token ids (for re-announcing), and forgets them when no medium
holds the key any more. Timestamps come from `clock` (default `time.time`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.prefix import Key
from pagedkv.events.wire import (
    MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    check_medium,
    external_hash,
)


class EventLog:
    def __init__(
        self,
        block_size: int,
        *,
        lora_id: int | None = None,
        data_parallel_rank: int | None = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise InvalidArgumentError(f"block_size must be an int >= 1, got {block_size!r}")
        self.block_size = block_size
        self.lora_id = lora_id
        self.data_parallel_rank = data_parallel_rank
        self._clock = clock
        self._copies: dict[str, Counter[Key]] = {m: Counter() for m in MEDIA}
        self._parent: dict[Key, Key | None] = {}  # every key some medium holds -> its parent key
        self._tokens: dict[Key, tuple[int, ...]] = {}  # ... -> its token ids (may be empty if unknown)
        self._pending: list[Event] = []

    # --- queries --------------------------------------------------------------------------------

    def holds(self, medium: str) -> set[Key]:
        """The keys `medium` holds at least one copy of."""
        return set(self._copies[check_medium(medium)])

    def copies(self, medium: str, key: Key) -> int:
        return self._copies[check_medium(medium)][key]

    def is_held(self, key: Key) -> bool:
        return key in self._parent

    def known(self, key: Key) -> tuple[Key | None, tuple[int, ...]] | None:
        """(parent key, token ids) of a key some medium holds, as first reported; None if none holds it."""
        if key not in self._parent:
            return None
        return self._parent[key], self._tokens[key]

    def num_pending(self) -> int:
        return len(self._pending)

    # --- changes --------------------------------------------------------------------------------

    def stored(
        self,
        medium: str,
        keys: Sequence[Key],
        *,
        parent: Key | None = None,
        token_ids: Sequence[int] | None = None,
        lora_id: int | None = None,
    ) -> None:
        """One more copy in `medium` of each key of a chain (`keys[0]`'s parent is `parent`, then each key's
        parent is the one before). `token_ids`: block_size tokens per key, or None if unknown."""
        check_medium(medium)
        bs = self.block_size
        if token_ids is not None and len(token_ids) != bs * len(keys):
            raise InvalidArgumentError(f"token_ids holds {len(token_ids)} ids for {len(keys)} blocks of {bs}")
        counts = self._copies[medium]
        run: list[int] = []  # indexes of consecutive keys new to the medium
        run_parent: Key | None = None
        prev = parent
        for i, key in enumerate(keys):
            counts[key] += 1
            if key not in self._parent:
                self._parent[key] = prev
                self._tokens[key] = tuple(token_ids[i * bs : (i + 1) * bs]) if token_ids is not None else ()
            if counts[key] == 1:
                if not run:
                    run_parent = prev
                run.append(i)
            elif run:
                self._emit_stored(medium, [keys[j] for j in run], run_parent, lora_id)
                run = []
            prev = key
        if run:
            self._emit_stored(medium, [keys[j] for j in run], run_parent, lora_id)

    def removed(self, medium: str, keys: Iterable[Key]) -> None:
        """One copy fewer in `medium` of each key; `BlockRemoved` for those whose last copy went."""
        check_medium(medium)
        keys = list(keys)
        counts = self._copies[medium]
        need = Counter(keys)
        short = [k for k, n in need.items() if counts[k] < n]
        if short:
            raise InvalidArgumentError(
                f"{medium}: removing {len(short)} key(s) the medium does not hold (first: {short[0]!r})"
            )
        gone: list[Key] = []
        for key in keys:
            counts[key] -= 1
            if counts[key] == 0:
                del counts[key]
                gone.append(key)
        if gone:
            self._pending.append(BlockRemoved([external_hash(k) for k in gone], medium))
            for key in gone:
                self._forget_if_unheld(key)

    def cleared(self, medium: str) -> None:
        """`medium` dropped every copy: `AllBlocksCleared`, then what the other media still hold."""
        check_medium(medium)
        dropped = list(self._copies[medium])
        self._copies[medium].clear()
        for key in dropped:
            self._forget_if_unheld(key)
        self._pending.append(AllBlocksCleared())
        todo = [(m, k) for k in self._parent for m in MEDIA if k in self._copies[m]]
        announced: set[Key] = set()
        while todo:  # parents first: defer a key whose parent is held but not announced yet
            later: list[tuple[str, Key]] = []
            for medium_, key in todo:
                p = self._parent[key]
                if p is not None and p in self._parent and p not in announced:
                    later.append((medium_, key))
                    continue
                announced.add(key)
                self._emit_stored(medium_, [key], p, None)
            if len(later) == len(todo):  # cannot happen with chained hashes; never loop forever
                for medium_, key in later:
                    self._parent[key] = None
                    self._emit_stored(medium_, [key], None, None)
                break
            todo = later

    def take_batch(self) -> EventBatch | None:
        """The events since the last call, as one batch (None if there are none)."""
        if not self._pending:
            return None
        events, self._pending = self._pending, []
        return EventBatch(self._clock(), events, self.data_parallel_rank)

    # --- internals ------------------------------------------------------------------------------

    def _emit_stored(self, medium: str, keys: list[Key], parent: Key | None, lora_id: int | None) -> None:
        tokens: list[int] = []
        for key in keys:
            tokens.extend(self._tokens.get(key, ()))
        if len(tokens) != self.block_size * len(keys):
            tokens = []  # unknown for some block: send none rather than a misaligned list
        self._pending.append(
            BlockStored(
                [external_hash(k) for k in keys],
                external_hash(parent) if parent is not None and parent in self._parent else None,
                tokens,
                self.block_size,
                lora_id if lora_id is not None else self.lora_id,
                medium,
            )
        )

    def _forget_if_unheld(self, key: Key) -> None:
        if all(key not in c for c in self._copies.values()):
            self._parent.pop(key, None)
            self._tokens.pop(key, None)
