"""Tiers below the device: host RAM, local disk and a remote store (Redis), under one policy.

Torch-free: the tiers hold block values as bytes (numpy `uint8` rows); moving them to and from device KV
pages is the engine's job (`pagedkv.engine.tiering`). See `docs/tiers.md`.

- `keys`: the model fingerprint and the store key `pkv:v1:{fingerprint}:{block key hex}`;
- `value`: the binary value of one block (header with magic, version, dtype, shape, byte count, CRC32 and
  the key, then raw bytes);
- `events`: `TierEvent` records (stored / removed, key, medium) for a KV-aware router's event log;
- `slots`: the torch-free index of a fixed-size local tier (key -> slot, one LRU clock, pins);
- `host`, `disk`, `remote`: the three tiers, one interface (`tier.Tier`);
- `store`: `TieredStore`, the policy (write-back, demotion, write-through, lookup, two-phase load/store).
"""

from __future__ import annotations

from pagedkv.tiers.events import Medium, TierEvent
from pagedkv.tiers.keys import model_fingerprint, store_key
from pagedkv.tiers.value import BlockLayout, CorruptValueError

__all__ = ["BlockLayout", "CorruptValueError", "Medium", "TierEvent", "model_fingerprint", "store_key"]
