"""`TieredStore`: the policy over the tiers below the device. Torch-free (values are `uint8` rows).

    device (the manager's prefix cache)
      | evicted: written back                 ^ a hit in any tier is loaded into device blocks
      v                                       |   before the forward (prepare_load, copy, complete_load)
    host RAM  --evicts LRU to-->  disk  --evicts LRU--> dropped
      (one LRU clock across host and disk)
    remote store (Redis): every published full block is written through if the store lacks it;
      the store evicts on its own, so a chain there may have holes

Lookup walks a key chain: each leading key is served by the first local tier holding it; at the first
local miss the rest of the chain is asked of the remote store (one round trip), and the walk stops at its
first miss. So a hit is always a prefix of the chain, and any failure while loading (a value gone since
the lookup, a checksum mismatch, a timeout) truncates it there: the caller recomputes the suffix.

Both directions are two-phase, so a block is never served or dropped before its bytes are complete:

- load: `prepare_load(keys, rows)` copies the hit prefix into the caller's rows and returns a `LoadPlan`;
  the caller copies rows into device blocks, then `complete_load(plan)` (touch, count) or
  `abort_load(plan, reason)` (nothing was served; the reason is counted).
- store: `prepare_store(evicted, published)` decides which blocks each tier wants and returns a
  `StorePlan` whose rows the caller fills from the device; `complete_store(plan)` writes them. Nothing is
  visible in any tier before `complete_store`, and the caller must not reuse the device blocks before it.

Lost keys: a key a tier held and lost (its load failed, it fell off the last local tier, or its write
failed) is remembered (the last `LOST_KEYS_REMEMBERED`, until stored again), so that a later lookup can
say which of the keys it did not serve a tier lost (`LoadPlan.num_lost`; the engine counts their tokens
under the miss reason `tier`, `pagedkv.core.misses`).

Counters (`TierStats`): cached tokens per medium, blocks stored per medium, and losses by reason:
"evicted" (dropped from the last local tier, or gone from the remote store between lookup and load),
"checksum" (header or CRC mismatch: the entry is deleted), "timeout" / "error" (remote store failures, a
local medium's failed read or write); a local medium's failed writes also by errno (`local_failures`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from pagedkv.core.errors import InvalidArgumentError, InvariantError
from pagedkv.tiers.events import Medium, TierEvent
from pagedkv.tiers.slot_index import LruClock
from pagedkv.tiers.tier import LocalTier, Rows, Tier
from pagedkv.tiers.value import BlockLayout

logger = logging.getLogger(__name__)
LOST_KEYS_REMEMBERED = 16_384  # keys a tier lost, remembered for the `tier` miss reason (bounded, oldest out)


@dataclass(slots=True)
class TierStats:
    """Prompt tokens seen at admission; tokens served from each medium ("GPU" = the device prefix cache);
    blocks written to each medium; blocks lost, by reason; failed remote-store calls, by reason (a failed
    lookup loses hits it cannot count)."""

    prompt_tokens: int = 0
    cached_tokens: Counter[str] = field(default_factory=Counter)
    stored_blocks: Counter[str] = field(default_factory=Counter)
    losses: Counter[str] = field(default_factory=Counter)
    remote_failures: Counter[str] = field(default_factory=Counter)
    local_failures: Counter[str] = field(default_factory=Counter)  # "DISK ENOSPC" -> failed writes

    def hit_rate(self, medium: str) -> float:
        return self.cached_tokens[medium] / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, object]:
        media = ("GPU", "CPU", "DISK", "REMOTE")
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": {m: self.cached_tokens[m] for m in media},
            "hit_rate": {m: round(self.hit_rate(m), 4) for m in media},
            "stored_blocks": dict(self.stored_blocks),
            "losses": dict(self.losses),
            "remote_failures": dict(self.remote_failures),
            "local_failures": dict(self.local_failures),
        }


class RemoteSettings(NamedTuple):
    """How the remote tier is reached: per-call timeout, back-off after repeated failures, and whether a
    store that does not answer at start-up is fatal."""

    timeout_s: float = 2.0
    backoff_s: float = 30.0
    max_failures: int = 3
    required: bool = False


def _disk_tier(folder: str, capacity_bytes: int, layout: BlockLayout, clock: LruClock, fingerprint: str) -> LocalTier:
    import os

    from pagedkv.tiers.disk import DiskTier
    from pagedkv.tiers.keys import KEY_PREFIX

    path = os.path.join(folder, f"pagedkv-{fingerprint}-{os.getpid()}.blocks")
    try:
        return DiskTier(path, capacity_bytes, layout, clock, key_prefix=f"{KEY_PREFIX}{fingerprint}:".encode())
    except OSError as err:
        raise InvalidArgumentError(f"the disk tier cannot create its file in {folder!r}: {err.strerror}") from None


def _remote_tier(url: str, layout: BlockLayout, fingerprint: str, settings: RemoteSettings) -> tuple[Tier | None, str | None]:
    """The remote tier, probed once; (None, why) when it does not answer and is not required."""
    from pagedkv.tiers.remote import RedisTier, TierUnavailableError, redact

    tier = RedisTier(url, layout, fingerprint, timeout_s=settings.timeout_s, backoff_s=settings.backoff_s,
                     max_failures=settings.max_failures)  # fmt: skip
    why = tier.probe()
    if why is None:
        return tier, None
    tier.close()
    line = f"remote tier {redact(url)} is off: {why}"
    if settings.required:
        raise TierUnavailableError(f"{line} (remote_required=True)")
    logger.warning("%s", line)
    return None, line


class LoadPlan(NamedTuple):
    """The hit prefix copied into the caller's rows: `keys[i]` came from `media[i]` into `rows[i]`.
    `num_lost`: how many keys right after it a tier held and lost (a failed load, and those after it
    the lookup found; then the run of keys remembered as lost at store time): the tiers should have
    served them."""

    keys: list[bytes]
    media: list[Medium]
    num_lost: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.keys)


class StorePlan(NamedTuple):
    """Fill `rows[i]` with the bytes of block `keys[i]`, then `complete_store`. `write_back` (indices into
    keys) go to the first local tier, `write_through` to the remote store."""

    keys: list[bytes]
    rows: Rows
    write_back: list[int]
    write_through: list[int]


class TieredStore:
    def __init__(
        self, layout: BlockLayout, local: Sequence[LocalTier] = (), remote: Tier | None = None, *,
        off: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.layout = layout
        self.local = list(local)  # fastest first: host, then disk
        self.remote = remote
        self.stats = TierStats()
        self.off = dict(off or {})  # medium -> why a configured tier is not in use (found at start-up)
        self._lost: dict[bytes, None] = {}  # keys a tier lost, oldest first (see the module docstring)
        failures = getattr(remote, "failures", None)
        if failures is not None:  # the remote tier counts its failed calls straight into the stats
            self.stats.remote_failures = failures

    @classmethod
    def build(cls, layout: BlockLayout, fingerprint: str, *, host_blocks: int = 0, disk_path: str | None = None,
              disk_bytes: int = 0, remote_url: str | None = None, pin_memory: bool = False,
              remote: RemoteSettings | None = None) -> TieredStore:  # fmt: skip
        """The tiers a configuration asks for (any of them may be absent). A remote store that does not
        answer at start-up is off, with one line saying why in `inactive()` and the log (or, with
        `remote.required`, a `TierUnavailableError`); a disk folder that cannot hold the tier's file is
        an `InvalidArgumentError`."""
        from pagedkv.tiers.host import HostTier

        clock = LruClock()
        local: list[LocalTier] = []
        if host_blocks:
            local.append(HostTier(host_blocks, layout, clock, pin_memory=pin_memory))
        if disk_path is not None:
            local.append(_disk_tier(disk_path, disk_bytes, layout, clock, fingerprint))
        off: dict[str, str] = {}
        tier: Tier | None = None
        if remote_url:
            tier, why = _remote_tier(remote_url, layout, fingerprint, remote or RemoteSettings())
            if why is not None:
                off["REMOTE"] = why
        return cls(layout, local, tier, off=off)

    def inactive(self) -> dict[str, str]:
        """Configured tiers not in use now, medium -> one line saying why: found dead at start-up, or the
        remote store skipped during a back-off after repeated failures. Empty when every tier works."""
        out = dict(self.off)
        status = getattr(self.remote, "status", None)
        why = status() if status is not None else None
        if why is not None:
            out["REMOTE"] = f"remote tier {getattr(self.remote, 'url', '')}: {why}"
        return out

    @property
    def tiers(self) -> list[Tier]:
        out: list[Tier] = list(self.local)
        if self.remote is not None:
            out.append(self.remote)
        return out

    def count_prompt(self, prompt_tokens: int, device_tokens: int) -> None:
        """A request's first admission: its prompt tokens, and how many the device's prefix cache served."""
        self.stats.prompt_tokens += prompt_tokens
        self.stats.cached_tokens["GPU"] += device_tokens

    # --- load -----------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[Medium]:
        """The medium serving each key of the longest present prefix of `keys`."""
        media: list[Medium] = []
        for key in keys:
            tier = next((t for t in self.local if key in t.index), None)
            if tier is None:
                break
            media.append(tier.medium)
        if self.remote is not None and len(media) < len(keys):
            media.extend(["REMOTE"] * self.remote.lookup(keys[len(media) :]))
            self._count_corrupt()
        return media

    def _count_corrupt(self) -> None:
        """Values the remote store's lookup found unreadable (the wrong size) and deleted: a loss ("header")
        and a key lost, like a corrupt value a `get` meets; deleted, the block is written again by the next
        engine that computes it."""
        take = getattr(self.remote, "take_corrupt", None)
        corrupt = take() if take is not None else []
        if corrupt:
            self.stats.losses["header"] += len(corrupt)
            self._remember_lost(corrupt)

    def prepare_load(self, keys: Sequence[bytes], rows: Rows) -> LoadPlan:
        """Copy the longest loadable prefix of `keys` into `rows` (one batch per tier)."""
        media = self.lookup(keys)
        n = len(media)
        ok = [False] * n
        for tier in self.tiers:
            idx = [i for i in range(n) if media[i] == tier.medium]
            if not idx:
                continue
            batch = np.empty((len(idx), self.layout.nbytes), dtype=np.uint8)
            reasons = tier.get([keys[i] for i in idx], batch)
            for j, (i, reason) in enumerate(zip(idx, reasons)):
                if reason is None:
                    rows[i] = batch[j]
                    ok[i] = True
                else:
                    self.stats.losses[reason] += 1
        good = ok.index(False) if False in ok else n
        self._remember_lost([keys[i] for i in range(good, n) if not ok[i]])
        lost = n - good
        while good + lost < len(keys) and keys[good + lost] in self._lost:
            lost += 1
        return LoadPlan(list(keys[:good]), media[:good], lost)

    def complete_load(self, plan: LoadPlan, block_size: int, keys_per_block: int = 1) -> None:
        """The caller's device copies of the plan's blocks are done: touch them and count the hits. A block
        of `keys_per_block` keys (a hybrid model's copies, one per KV cache group) counts its tokens once,
        under the medium of its first key; a trailing block with only some of its keys is not served."""
        for tier in self.tiers:
            hit = [k for k, m in zip(plan.keys, plan.media) if m == tier.medium]
            if hit:
                tier.touch(hit)
        served = plan.num_blocks // keys_per_block * keys_per_block
        for medium in plan.media[:served:keys_per_block]:
            self.stats.cached_tokens[medium] += block_size

    def abort_load(self, plan: LoadPlan, reason: str) -> None:
        """The device copies failed: nothing of the plan was served."""
        self.stats.losses[reason] += plan.num_blocks

    # --- store ----------------------------------------------------------------------------------

    def prepare_store(self, evicted: Iterable[bytes], published: Iterable[bytes]) -> StorePlan:
        """Which of the device's evicted keys go to the first local tier (those no local tier holds yet:
        the others are touched) and which published keys the remote store lacks."""
        keys: list[bytes] = []
        pos: dict[bytes, int] = {}

        def slot(key: bytes) -> int:
            if key not in pos:
                pos[key] = len(keys)
                keys.append(key)
            return pos[key]

        write_back: list[int] = []
        if self.local:
            for key in dict.fromkeys(evicted):
                holder = next((t for t in self.local if key in t.index), None)
                if holder is None:
                    write_back.append(slot(key))
                else:
                    holder.touch([key])
        write_through: list[int] = []
        if self.remote is not None:
            fresh = list(dict.fromkeys(published))
            write_through = [slot(k) for k, present in zip(fresh, self.remote.contains(fresh)) if not present]
            self._count_corrupt()
        rows = np.empty((len(keys), self.layout.nbytes), dtype=np.uint8)
        return StorePlan(keys, rows, write_back, write_through)

    def complete_store(self, plan: StorePlan) -> None:
        """The plan's rows hold the blocks' bytes: write back (spilling down the local tiers) and through."""
        if plan.write_back:
            keys = [plan.keys[i] for i in plan.write_back]
            tried = list(keys)
            values: Rows | None = plan.rows[plan.write_back]
            stamps: list[int] | None = None
            for tier in self.local:
                if not keys or values is None:
                    break
                spill = tier.put(keys, values, stamps)
                self.stats.stored_blocks[tier.medium] += spill.num_stored
                for name, n in spill.failed.items():  # a full or failing medium: those blocks are lost
                    self.stats.local_failures[f"{tier.medium} {name}"] += n
                    self.stats.losses["error"] += n
                keys, values, stamps = spill.evicted, spill.values, spill.stamps
                tried += keys
            if keys:  # fell off the last local tier
                self.stats.losses["evicted"] += len(keys)
            held = [k for k in tried if any(k in t.index for t in self.local)]
            for key in held:
                self._lost.pop(key, None)
            self._remember_lost([k for k in dict.fromkeys(tried) if not any(k in t.index for t in self.local)])
        if plan.write_through and self.remote is not None:
            spill = self.remote.put([plan.keys[i] for i in plan.write_through], plan.rows[plan.write_through])
            self.stats.stored_blocks["REMOTE"] += spill.num_stored

    def _remember_lost(self, keys: Iterable[bytes]) -> None:
        lost = self._lost
        for key in keys:
            lost.pop(key, None)
            lost[key] = None
        while len(lost) > LOST_KEYS_REMEMBERED:
            del lost[next(iter(lost))]

    # --- events and life cycle ------------------------------------------------------------------

    def audit_remote(self) -> int:
        """Ask the remote store which of the keys this replica reported are still there (one round trip);
        those it evicted by itself are reported removed (`take_events`). Returns how many were gone (0
        without a remote store, or one that cannot audit)."""
        audit = getattr(self.remote, "audit", None)
        return int(audit()) if audit is not None else 0

    def take_events(self) -> list[TierEvent]:
        events: list[TierEvent] = []
        for tier in self.tiers:
            events.extend(tier.take_events())
        return events

    def check_invariants(self) -> None:
        for tier in self.local:
            tier.check_invariants()
        held = [set(t.index.slot_of) for t in self.local]
        for i in range(len(held)):
            for j in range(i + 1, len(held)):
                if held[i] & held[j]:
                    raise InvariantError("tiers: a key is held by two local tiers (they are exclusive)")

    def close(self) -> None:
        for tier in self.tiers:
            close = getattr(tier, "close", None)
            if close is not None:
                close()
