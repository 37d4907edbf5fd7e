"""KV events on the wire, in vLLM's format (`vllm/distributed/kv_events.py`), encoded with msgspec msgpack.

    batch   = [ts, [event, ...], data_parallel_rank]                      (an array: `array_like`)
    event   = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
               lora_name, extra_keys]
            | ["BlockRemoved", block_hashes, medium]
            | ["AllBlocksCleared"]

Events are tagged arrays (msgspec `tag=True, array_like=True`: the class name first, then the fields in
declaration order), so a consumer written against vLLM's structs decodes them. A block hash is the low 64 bits
of pagedkv's block key (`external_hash`): the last 8 bytes of a SHA-256 key read big-endian, or a `fast` key
(a signed Python hash) modulo 2**64. `medium` is one of `MEDIA`; `None` (older vLLM) means GPU.
`token_ids` holds the tokens of every block in `block_hashes`, in order (block_size each).
"""

from __future__ import annotations

from typing import Any

import msgspec

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.prefix import Key

GPU, CPU, DISK, REMOTE = "GPU", "CPU", "DISK", "REMOTE"
MEDIA: tuple[str, ...] = (GPU, CPU, DISK, REMOTE)
_MASK = (1 << 64) - 1


def external_hash(key: Key) -> int:
    """The block hash published for `key`: its low 64 bits, as an unsigned int."""
    if isinstance(key, bytes):
        if len(key) < 8:
            raise InvalidArgumentError(f"a block key needs at least 8 bytes, got {len(key)}")
        return int.from_bytes(key[-8:], "big")
    if isinstance(key, int) and not isinstance(key, bool):
        return key & _MASK
    raise InvalidArgumentError(f"a block key is bytes or int, got {type(key).__name__}")


def check_medium(medium: str) -> str:
    if medium not in MEDIA:
        raise InvalidArgumentError(f"unknown medium {medium!r}; choose one of {', '.join(MEDIA)}")
    return medium


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the three events (tagged with the class name on the wire)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> EventBatch:
    """One batch from its msgpack bytes; a malformed payload raises `InvalidArgumentError`."""
    try:
        return _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidArgumentError(f"not a KV event batch: {exc}") from None
