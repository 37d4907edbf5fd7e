"""The engine's side of the tiers: device blocks <-> host RAM, disk and a remote store around each step.

The manager's prefix cache is the device tier; `pagedkv.tiers.TieredStore` holds the tiers below it. The
tiering is the scheduler's `BlockSource` and two engine hooks; nothing else in the engine knows about tiers:

```
out = scheduler.schedule()          # admissions (evictions happen here, in the manager's allocate); for a
                                    #   prefill chunk on a block boundary the scheduler asks the manager to
                                    #   `fetch_blocks`: the manager keys the chunk's full blocks and calls
                                    #   `tiering.fetch`, which returns the hit prefix's bytes; the plan gets
                                    #   them as a `BlockFill` and the chunk starts after them
tiering.before_forward(out)         # write back blocks evicted since the last sync (their bytes are still
                                    #   intact: nothing has written the device since they were published)
runner.execute(...)                 # block moves (swap, copy-on-write, tier fills), forward
scheduler.update(...)               # mark_computed publishes full blocks, the fetched ones too
tiering.after_update()              # write newly published blocks through to the remote store
```

Evictions and publications come from the manager's events (`record_events=True`): `removed` carries the
key and the block that held it, `stored` the key and its block. The tiering is the one reader of
`manager.take_events()`; built with `keep_device_events=True` (the engine's event log,
`pagedkv.engine.kv_events`) it keeps what it drained for `take_device_events()`, in order. Every sync
(`fetch` runs one first, so a block evicted by an admission earlier in the same schedule is found in the
host tier) reads evicted blocks before the runner writes anything: a device block is never reused before
its copy to the host finished.

A fetch (two-phase in the store: `prepare_load` copies the hit prefix into rows, `complete_load` touches
and counts it) never covers the block of a chunk's last token: the chunk keeps at least one token to
compute, and the prompt's last token is always computed. A failed or short load leaves the rest of the
chunk to be computed. A request's tier hits are counted at its first admission, like the device's
(`RequestOutput.num_cached_tokens_by_tier`). Blocks a tier held and lost (a failed load, or a key the store
remembers it dropped or failed to write: `LoadPlan.num_lost`) count under the miss reason `tier` in the
manager's `misses` (the engine's `stats.cache_misses`; both allocators keep one).

With KV cache groups (the hybrid allocator: `KVManager.num_groups`, `grouped_events`) a block has one
copy per group: the tiers store each under its group-qualified key (`pagedkv.core.group_keys`), a fetch asks for every group's key of a
block before the next block's (`core/hybrid_fetch.py`), and a block counts once per request, in the
request's counts and in `TierStats.cached_tokens` alike.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from pagedkv.core.errors import InvalidArgumentError, InvariantError
from pagedkv.core.group_keys import GroupCacheEvent, group_key
from pagedkv.core.prefix import Key
from pagedkv.core.prefix_index import CacheEvent
from pagedkv.engine.request import Request
from pagedkv.engine.scheduler import SchedulerOutput
from pagedkv.storage.block_rows import block_shape, read_rows
from pagedkv.storage.kv import KVStorage
from pagedkv.tiers.events import TierEvent
from pagedkv.tiers.keys import key_bytes, model_fingerprint
from pagedkv.tiers.store import RemoteSettings, TieredStore, TierStats
from pagedkv.tiers.value import BlockLayout

if TYPE_CHECKING:
    from pagedkv.core.protocol import KVManager
    from pagedkv.engine.config import EngineConfig


class EngineTiering:
    """The tiers around one engine's device: a `BlockSource` for its scheduler, and the two hooks."""

    def __init__(
        self, store: TieredStore, storage: KVStorage, manager: KVManager, *,
        keep_device_events: bool = False,
    ) -> None:  # fmt: skip
        self.store = store
        self.storage = storage
        self.manager = manager
        self._keys_per_block = manager.num_groups  # a block has one copy (and tier key) per KV cache group
        self.block_size = storage.block_size
        self._admitted: dict[str, int | None] = {}  # request id -> the seq id whose admission was counted
        self._miss_at: dict[str, tuple[int, int]] = {}  # request id -> (its preemptions, first block missed)
        self._by_request: dict[str, Counter[str]] = {}  # tokens served per medium, at first admission
        self._device_events: list[CacheEvent | GroupCacheEvent] | None = [] if keep_device_events else None

    @classmethod
    def build(
        cls, config: EngineConfig, storage: KVStorage, manager: KVManager, model_id: str, *,
        weights: str = "", keep_device_events: bool = False,
    ) -> EngineTiering:  # fmt: skip
        """The tiers `config` asks for; their keys carry the model's fingerprint: `model_id`, the weights'
        digest `weights` and the KV layout."""
        if not manager.records_events:
            raise InvalidArgumentError(
                "tiers need a manager that records its cache events: the paged or hybrid allocator with prefix "
                "caching on, built with record_events=True"
            )
        store = _build_store(config, storage, model_id, weights)
        return cls(store, storage, manager, keep_device_events=keep_device_events)

    def renew(self, config: EngineConfig, model_id: str, weights: str) -> TieredStore:
        """Empty tiers keyed under a new fingerprint (`weights`: the weights' digest and version) in place of
        the present ones, whose host and disk blocks are released; returns the old store, closed. Sync first:
        its events not taken yet are lost with it. The counters carry on."""
        old = self.store
        old.close()  # first: a disk tier under the same fingerprint reuses its file's name
        self.store = new = _build_store(config, self.storage, model_id, weights)
        if new.remote is not None:  # the new remote tier counts its failures into a counter of its own
            old.stats.remote_failures = new.stats.remote_failures
        new.stats = old.stats
        self._miss_at.clear()
        return old

    @property
    def stats(self) -> TierStats:
        return self.store.stats

    def inactive(self) -> dict[str, str]:
        """Configured tiers not in use now ("REMOTE", "DISK", ...) -> one line saying why (dead at start-up,
        or skipped during a back-off); empty when all work. `pagedkv generate` prints it."""
        return self.store.inactive()

    def cached_by_tier(self, request_id: str, device_tokens: int) -> dict[str, int]:
        """Tokens of a request's prompt served by each medium at its first admission."""
        counts = self._by_request.get(request_id, Counter())
        return {"GPU": device_tokens, **{m: counts[m] for m in ("CPU", "DISK", "REMOTE")}}

    def forget(self, request_id: str) -> None:
        for table in (self._admitted, self._miss_at, self._by_request):
            table.pop(request_id, None)

    def take_events(self) -> list[TierEvent]:
        """Stored/removed events of the tiers below the device (CPU, DISK, REMOTE)."""
        return self.store.take_events()

    def audit_remote(self) -> int:
        """`TieredStore.audit_remote`: keys the remote store dropped by itself become `removed` tier events."""
        return self.store.audit_remote()

    def take_device_events(self) -> list[CacheEvent | GroupCacheEvent]:
        """The manager's events drained since the last call, in order (needs `keep_device_events=True`)."""
        if self._device_events is None:
            return []
        events, self._device_events = self._device_events, []
        return events

    # --- the block source and the two hooks -----------------------------------------------------

    def fetch(self, keys: Sequence[Key], first_block: int, tag: object) -> tuple[int, npt.NDArray[np.uint8]]:
        """`BlockSource.fetch`: the bytes of the leading blocks of `keys` the tiers hold, for the request
        `tag` (the scheduler passes the `Request`). After a miss at block j, later chunks of the same
        admission starting at or past j ask nothing."""
        store = self.store
        rows = np.empty((len(keys), store.layout.nbytes), dtype=np.uint8)
        if not isinstance(tag, Request):
            raise InvariantError(f"tiering: fetch takes the scheduler's Request as its tag, got {type(tag).__name__}")
        rid, tries = tag.request_id, tag.num_preemptions
        missed = self._miss_at.get(rid)
        if missed is not None and missed[0] == tries and first_block >= missed[1]:
            return 0, rows
        self._sync()  # blocks evicted earlier in this schedule reach the host tier before the lookup
        plan = store.prepare_load([key_bytes(k) for k in keys], rows)
        k, per = plan.num_blocks, self._keys_per_block
        if k < len(keys):
            self._miss_at[rid] = (tries, first_block + k // per)
            if tag.seq_id is not None:  # admitted: the scheduler fetches for a request it placed
                self._count_lost(tag.seq_id, k, plan.num_lost)
        if k:
            store.complete_load(plan, self.block_size, per)  # a block's tokens once, not once per group
            if tries == 0 and not tag.output_token_ids:  # a first admission, not a fork child
                counts = self._by_request.setdefault(rid, Counter())
                for medium in plan.media[: k // per * per : per]:  # a block once, not once per group
                    counts[medium] += self.block_size
        return k, rows

    def _count_lost(self, seq_id: int, served: int, lost: int) -> None:
        """The whole blocks after the `served` keys that a tier held and lost (`LoadPlan.num_lost`): their
        tokens move from the admission's miss reason to `tier` (`pagedkv.core.misses`), in the manager's
        counter, so the reasons still add up to the misses."""
        per = self._keys_per_block
        blocks = (served + lost) // per - served // per
        if blocks:
            self.manager.count_tier_miss(seq_id, blocks * self.block_size)

    def before_forward(self, out: SchedulerOutput) -> None:
        self._sync()
        for chunk in out.scheduled:
            r = chunk.request
            if self._admitted.get(r.request_id) != r.seq_id:  # admitted in this step
                self._admitted[r.request_id] = r.seq_id
                if r.num_preemptions == 0 and not r.output_token_ids:  # not a re-admission, not a fork child
                    self.store.count_prompt(r.num_tokens, int(r.num_cached_tokens))

    def after_update(self) -> None:
        self._sync()

    def close(self) -> None:
        self.store.close()

    # --- stores ---------------------------------------------------------------------------------

    def _sync(self) -> None:
        """Drain the manager's events: evicted blocks are written back, published ones written through."""
        evicted: dict[bytes, int] = {}
        published: dict[bytes, int] = {}
        drained = self.manager.take_events()
        if self._device_events is not None:
            self._device_events.extend(drained)
        for event in drained:
            if event.key is None or event.block_id is None:
                continue
            if isinstance(event, GroupCacheEvent) and event.group is not None:  # the tiers keep each group's copy
                key = key_bytes(group_key(event.key, event.group))
            else:
                key = key_bytes(event.key)
            if event.kind == "removed":
                evicted[key] = event.block_id
            elif event.kind == "stored":
                published[key] = event.block_id
        if not evicted and not published:
            return
        plan = self.store.prepare_store(evicted, published)
        if not plan.keys:
            return
        source = {**published, **evicted}
        plan.rows[:] = read_rows(self.storage, [source[k] for k in plan.keys])
        self.store.complete_store(plan)


def _build_store(config: EngineConfig, storage: KVStorage, model_id: str, weights: str) -> TieredStore:
    """The tiers `config` asks for, keyed under the fingerprint of the model, its weights and the KV layout."""
    shape = block_shape(storage)
    fingerprint = model_fingerprint(
        model_id, storage.spec.dtype, shape[0], shape[3], shape[4], storage.block_size, weights=weights,
        kv_scales=storage.spec.scale_scheme_id,
    )
    remote = RemoteSettings(config.remote_timeout_s, config.remote_backoff_s, required=config.remote_required)
    return TieredStore.build(
        BlockLayout(storage.spec.dtype, shape, storage.spec.kv_scale_scheme), fingerprint, host_blocks=config.host_blocks,
        disk_path=config.disk_path, disk_bytes=config.disk_bytes, remote_url=config.remote_url,
        pin_memory=storage.device.type == "cuda", remote=remote,
    )  # fmt: skip
