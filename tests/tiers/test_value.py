"""The block value format and the store keys: round trips, and every mismatch is caught."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.tiers.keys import key_bytes, model_fingerprint, store_key
from pagedkv.tiers.value import HEADER_BYTES, BlockLayout, CorruptValueError, pack, unpack

LAYOUT = BlockLayout("float16", (2, 2, 4, 2, 8))
KEY = store_key("0123456789abcdef", bytes(range(32)))


def payload(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, LAYOUT.nbytes, dtype=np.uint8)


def test_round_trip_and_layout() -> None:
    assert LAYOUT.nbytes == 2 * 2 * 4 * 2 * 8 * 2
    data = payload()
    value = pack(LAYOUT, KEY, data)
    assert value[:4] == b"PKVB" and len(value) == LAYOUT.value_bytes(len(KEY))
    assert np.array_equal(unpack(LAYOUT, KEY, value), data)


@pytest.mark.parametrize(
    ("offset", "reason"),
    [(0, "header"), (4, "header"), (8, "header"), (24, "header"), (44, "header"), (52, "checksum"),
     (HEADER_BYTES + 3, "header"), (-1, "checksum")],
)  # fmt: skip
def test_any_flipped_byte_is_a_miss_with_its_reason(offset: int, reason: str) -> None:
    value = bytearray(pack(LAYOUT, KEY, payload()))
    value[offset] ^= 0x5A
    with pytest.raises(CorruptValueError) as err:
        unpack(LAYOUT, KEY, value)
    assert err.value.reason == reason


def test_other_key_other_layout_and_truncation_are_misses() -> None:
    value = pack(LAYOUT, KEY, payload())
    with pytest.raises(CorruptValueError):
        unpack(LAYOUT, store_key("0123456789abcdef", bytes(32)), value)
    with pytest.raises(CorruptValueError):
        unpack(BlockLayout("bfloat16", LAYOUT.shape), KEY, value)
    with pytest.raises(CorruptValueError):
        unpack(BlockLayout("float16", (2, 2, 4, 2, 4)), KEY, value)
    with pytest.raises(CorruptValueError):
        unpack(LAYOUT, KEY, value[:-1])
    with pytest.raises(CorruptValueError):
        unpack(LAYOUT, KEY, value[:10])


def test_header_fields_are_little_endian_and_documented() -> None:
    value = pack(LAYOUT, KEY, payload())
    magic, version, key_len, dtype, *shape_and_rest = struct.unpack_from("<4sHH16s5IQI", value)
    assert (magic, version, key_len, dtype.rstrip(b"\0")) == (b"PKVB", 1, len(KEY), b"float16")
    assert tuple(shape_and_rest[:5]) == LAYOUT.shape and shape_and_rest[5] == LAYOUT.nbytes
    assert value[HEADER_BYTES : HEADER_BYTES + key_len] == KEY


def test_bad_layouts_and_payloads_are_refused() -> None:
    with pytest.raises(InvalidArgumentError):
        BlockLayout("int7", (1, 2, 3, 4, 5))
    with pytest.raises(InvalidArgumentError):
        BlockLayout("float16", (1, 2, 3, 4))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        pack(LAYOUT, KEY, payload()[:-2])


def test_fingerprint_separates_every_field() -> None:
    base = dict(model_id="m", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=8, block_size=16)
    fps = {model_fingerprint(**base)}  # type: ignore[arg-type]
    for field, value in [("model_id", "n"), ("dtype", "bfloat16"), ("num_layers", 3), ("num_kv_heads", 4),
                         ("head_dim", 16), ("block_size", 32)]:  # fmt: skip
        fps.add(model_fingerprint(**{**base, field: value}))  # type: ignore[arg-type]
    fps.add(model_fingerprint(**base, tp_rank=1, tp_size=2))  # type: ignore[arg-type]
    fps.add(model_fingerprint(**base, tp_rank=0, tp_size=2))  # type: ignore[arg-type]
    assert len(fps) == 9 and all(len(fp) == 16 for fp in fps)
    assert model_fingerprint(**base) == model_fingerprint(**base)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        model_fingerprint(**base, tp_rank=2, tp_size=2)  # type: ignore[arg-type]


def test_scale_schemes_differ_in_bytes_and_fingerprint() -> None:
    """int8 blocks with a scale per token or per block: other payload sizes, other fingerprints."""
    from pagedkv.storage.kv_spec import KVCacheSpec

    shape = (2, 2, 16, 4, 8)
    token, block = BlockLayout("int8", shape), BlockLayout("int8", shape, "block")
    assert token.nbytes == 2 * 2 * 4 * 16 * (8 + 4) and block.nbytes == 2 * 2 * 4 * (16 * 8 + 4)
    with pytest.raises(InvalidArgumentError, match="needs a quantized"):
        BlockLayout("float16", shape, "block")
    base = dict(model_id="m", dtype="int8", num_layers=2, num_kv_heads=4, head_dim=8, block_size=16)
    ids = [KVCacheSpec(2, 4, 8, "int8", scheme).scale_scheme_id for scheme in ("token", "block")]
    fps = {model_fingerprint(**base, kv_scales=i) for i in ids}  # type: ignore[arg-type]
    assert ids == ["per-token-head-f32", "per-block-head-f32"] and len(fps) == 2


def test_store_key_format() -> None:
    assert store_key("fp", b"\x01\xff") == b"pkv:v1:fp:01ff"
    assert key_bytes(b"ab") == b"ab" and key_bytes(-1) == b"\xff" * 8
