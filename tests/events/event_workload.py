"""A random multi-replica workload on real `PagedKVManager`s with event feeds (shared by events/router tests)."""

from __future__ import annotations

import numpy as np

from pagedkv.core import PagedKVManager
from pagedkv.events import GPU, EventFeed, EventLog, external_hash

BS = 4


def make_replica(num_blocks: int = 24, *, native: bool | None = None) -> tuple[PagedKVManager, EventFeed]:
    m = PagedKVManager(num_blocks, BS, record_events=True, native=native)
    return m, EventFeed(m, [EventLog(BS)])


def gpu_hashes(m: PagedKVManager, feed: EventFeed) -> set[int]:
    """What the manager can serve now: its index, less keys of an earlier epoch."""
    return {external_hash(k) for k in feed.device_keys()}


def random_steps(
    rng: np.random.Generator, m: PagedKVManager, feed: EventFeed, steps: int, *, ops: bool = True
):
    """Yield after each step (callers poll/publish there). Prompts share a few random prefixes; sequences
    decode, finish, get rolled back; now and then the cache is reset or the epoch bumped."""
    prefixes = [rng.integers(0, 50, size=int(rng.integers(BS, 4 * BS))) for _ in range(4)]
    live: dict[int, list[int]] = {}
    for _ in range(steps):
        r = rng.random()
        if r < 0.35 or not live:
            p = prefixes[int(rng.integers(len(prefixes)))]
            prompt = np.concatenate([p, rng.integers(0, 50, size=int(rng.integers(1, 2 * BS)))]).astype(
                np.int32
            )
            adm = m.admit(prompt)
            if adm is not None:
                m.mark_computed([adm.seq_id])
                live[adm.seq_id] = prompt.tolist()
        elif r < 0.75:
            ids = list(live)
            toks = rng.integers(0, 50, size=len(ids))
            if m.append(ids, toks):
                for s, t in zip(ids, toks.tolist()):
                    live[s].append(t)
                m.mark_computed(ids)
        elif r < 0.93:
            s = list(live)[int(rng.integers(len(live)))]
            m.free(s)
            del live[s]
        elif r < 0.96:
            s = list(live)[int(rng.integers(len(live)))]
            k = int(rng.integers(0, min(3, len(live[s]))))
            m.rollback(s, k)
            if k:
                del live[s][-k:]
        elif ops and r < 0.98:
            feed.reset()
        elif ops:
            feed.bump_epoch()
        yield
    for s in list(live):
        m.free(s)
    yield


__all__ = ["BS", "GPU", "gpu_hashes", "make_replica", "random_steps"]
