"""pagedkv.events: KV cache events in vLLM's wire format (torch-free; msgspec, a core dependency; the ZMQ publisher needs the `events` extra: pyzmq).

- `wire`: the event structs (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`, `EventBatch`), msgpack
  encoding, `external_hash` (a block key's low 64 bits) and the media (GPU, CPU, DISK, REMOTE).
- `log`: `EventLog`, one replica's per-medium copy counts and the events they imply. Other tiers report to it
  with `log.stored(medium, keys, parent=..., token_ids=...)` and `log.removed(medium, keys)`.
- `feed`: `EventFeed`, the GPU medium fed from any manager's `take_events()`, one log per KV cache group.
- `publisher`: `ZmqEventPublisher` (PUB + replaying ROUTER) and `EventSubscriber` (imports pyzmq).

The engine keeps one log for all its media with `EngineConfig(kv_events=True)` (`pagedkv.engine.kv_events`):
`Engine.take_event_batch()`.
"""

from pagedkv.events.feed import EventFeed
from pagedkv.events.log import EventLog
from pagedkv.events.wire import (
    CPU,
    DISK,
    GPU,
    MEDIA,
    REMOTE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
    external_hash,
)

__all__ = [
    "CPU", "DISK", "GPU", "MEDIA", "REMOTE", "AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch",
    "EventFeed", "EventLog", "decode_batch", "encode_batch", "external_hash",
]  # fmt: skip
