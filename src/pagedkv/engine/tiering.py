"""The engine's side of the tiers: device blocks <-> host RAM, disk and a remote store around each step.

The manager's prefix cache is the device tier; `pagedkv.tiers.TieredStore` holds the tiers below it. The
engine calls two hooks, and nothing else in the engine knows about tiers:

```
out = scheduler.schedule()          # admissions; evictions happen here (the manager's allocate)
tiering.before_forward(out)         # 1. write back evicted blocks (their bytes are still intact: nothing
                                    #    has written the device since they were published)
                                    # 2. load tier hits of every prefill chunk into the sequence's blocks
runner.execute(...)                 # block moves (swap, copy-on-write), forward
scheduler.update(...)               # mark_computed publishes full blocks
tiering.after_update()              # write newly published blocks through to the remote store
```

Evictions and publications come from the manager's events (`record_events=True`): `removed` carries the
key and the block that held it, `stored` the key and its block. The tiering is the one reader that drains
`manager.take_events()`; the engine's event log (`pagedkv.engine.kv_events`, `EngineConfig(kv_events=True)`)
sets `device_events = []` and takes the drained `CacheEvent`s from there, in order, with the tiers' own. Write-back happens before the forward that
could overwrite an evicted block; so a device block is never reused before its copy to the host finished.

Loading a hit (two-phase): for a prefill chunk starting on a block boundary, the keys of the blocks fully
inside the chunk (never the block of its last token: the chunk keeps at least one token to compute, and the
prompt's last token is always computed) are looked up tier by tier; the hit prefix is copied into the
sequence's already allocated blocks, only then marked computed (which publishes it on the device), and the
chunk now starts after it. A failed or short load leaves the rest of the chunk to be computed. A request's
tier hits are counted at its first admission, like the device's (`RequestOutput.num_cached_tokens_by_tier`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from pagedkv.engine.scheduler import SchedulerOutput
from pagedkv.storage.block_rows import block_shape, read_rows, write_rows
from pagedkv.storage.kv import KVStorage
from pagedkv.tiers.events import TierEvent
from pagedkv.tiers.keys import key_bytes, model_fingerprint
from pagedkv.tiers.store import TieredStore, TierStats
from pagedkv.tiers.value import BlockLayout


class EngineTiering:
    def __init__(self, store: TieredStore, storage: KVStorage, manager: Any) -> None:
        self.store = store
        self.storage = storage
        self.manager = manager
        self.block_size = storage.block_size
        self._admitted: dict[str, int | None] = {}  # request id -> the seq id whose admission was counted
        self._miss_at: dict[str, int] = {}  # request id -> first block the tiers missed (skip later lookups)
        self._by_request: dict[str, Counter[str]] = {}  # tokens served per medium, at first admission
        self.device_events: list[Any] | None = None  # a list: keep the manager's drained events for a reader

    @classmethod
    def build(cls, config: Any, storage: KVStorage, manager: Any, model_id: str) -> EngineTiering:
        shape = block_shape(storage)
        fingerprint = model_fingerprint(
            model_id, storage.spec.dtype, shape[0], shape[3], shape[4], storage.block_size
        )
        store = TieredStore.build(
            BlockLayout(storage.spec.dtype, shape), fingerprint, host_blocks=config.host_blocks,
            disk_path=config.disk_path, disk_bytes=config.disk_bytes, remote_url=config.remote_url,
            pin_memory=storage.device.type == "cuda",
        )  # fmt: skip
        return cls(store, storage, manager)

    @property
    def stats(self) -> TierStats:
        return self.store.stats

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

    # --- the two hooks --------------------------------------------------------------------------

    def before_forward(self, out: SchedulerOutput) -> None:
        self._sync()
        self._load_hits(out)

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
        if self.device_events is not None:
            self.device_events.extend(drained)
        for event in drained:
            if event.kind == "removed" and event.key is not None:
                evicted[key_bytes(event.key)] = int(event.block_id)
            elif event.kind == "stored" and event.key is not None:
                published[key_bytes(event.key)] = int(event.block_id)
        if not evicted and not published:
            return
        plan = self.store.prepare_store(evicted, published)
        if not plan.keys:
            return
        source = {**published, **evicted}
        plan.rows[:] = read_rows(self.storage, [source[k] for k in plan.keys])
        self.store.complete_store(plan)

    # --- loads ----------------------------------------------------------------------------------

    def _load_hits(self, out: SchedulerOutput) -> None:
        bs, store = self.block_size, self.store
        changed = False
        for i, chunk in enumerate(out.scheduled):
            r = chunk.request
            rid = r.request_id
            if self._admitted.get(rid) != r.seq_id:  # admitted in this step
                self._admitted[rid] = r.seq_id
                self._miss_at.pop(rid, None)
                if r.num_preemptions == 0 and not r.output_token_ids:  # not a re-admission, not a fork child
                    store.stats.prompt_tokens += r.num_tokens
                    store.stats.cached_tokens["GPU"] += chunk.start
            first, last = chunk.start // bs, (chunk.end - 1) // bs  # candidate blocks [first, last)
            if chunk.start % bs or last <= first or first >= self._miss_at.get(rid, last + 1):
                continue
            keys = self._keys(r, first, last)
            rows = np.empty((len(keys), store.layout.nbytes), dtype=np.uint8)
            plan = store.prepare_load(keys, rows)
            k = plan.num_blocks
            if k < len(keys):
                self._miss_at[rid] = first + k
            if k == 0:
                continue
            try:
                write_rows(self.storage, self.manager.block_ids(r.seq_id)[first : first + k], rows[:k])
            except Exception:
                store.abort_load(plan, "error")
                raise
            store.complete_load(plan, bs)
            start = chunk.start + k * bs
            self.manager.mark_computed([r.seq_id], [start])  # only now: the blocks hold their KV
            r.num_computed_tokens = start
            out.scheduled[i] = chunk._replace(start=start, num_new_tokens=chunk.end - start)
            if r.num_preemptions == 0 and not r.output_token_ids:
                counts = self._by_request.setdefault(rid, Counter())
                for medium in plan.media:
                    counts[medium] += bs
            changed = True
        if changed:
            out.num_batched_tokens = sum(c.num_new_tokens for c in out.scheduled)

    def _keys(self, request: Any, first: int, last: int) -> list[bytes]:
        """Content keys of blocks [first, last), computed in order through the request's `BlockKeys`
        (bound to the manager's key function and epoch at admission), so they equal the device's."""
        bs, keys = self.block_size, request.keys
        tokens = np.asarray(request.all_token_ids[: last * bs], dtype=np.int32)
        for j in range(keys.num_keys(), last):
            keys.key(j, tokens[j * bs : (j + 1) * bs])
        return [key_bytes(k) for k in keys.keys[first + 1 : last + 1]]
