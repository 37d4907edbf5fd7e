"""`hash_fn="vllm"`: block keys exactly as vLLM's `hash_block_tokens(sha256_cbor, ...)` makes them, checked
against vectors computed by vLLM 0.33.0's own functions (`vllm_reference.py`) and, when a vLLM source tree
and a Python with cbor2 are at hand (VLLM_SRC, PEER_PY: see the peers' setup), against vLLM run now; then
published in events by a real manager, under the same 64-bit names vLLM's events use."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from vllm_reference import CASES

from pagedkv.core import PagedKVManager
from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.prefix import BlockKeys, VllmKeyFunction, cbor_canonical, key_function, sha256_key
from pagedkv.events import GPU, BlockStored, EventFeed, EventLog, external_hash
from pagedkv.router import request_hashes

# vLLM 0.33.0's hash_block_tokens + sha256_cbor on CASES (VLLM_SRC=... PEER_PY tests/events/vllm_reference.py)
VLLM_0_33 = {
    "plain": [
        "58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111",
        "e1bc29393a2da9fd798f35ff04d215f846aee6df4b803ce3d43b57df56b58fb1",
        "321cf73a943519e37f9c8afa804132a5b9076e22b40b2d5fe6f7a2886960a68a",
        "01dc4cca389391f8af911f65044fcfa1ab6371852fdf6b81dd13503db99baf5a",
    ],
    "salted": [
        "0e172de9010f20a975885630390148d0769af6bbe75a732d3b66b62598433cae",
        "16b216d1060dcaf9a3f4b1caed8b937b3ce79af482f1eaf94af0fa33435a03c4",
    ],
    "wide ids": [
        "dc7fbfd287fac7b6243222eb8a406c3a145df86542e11806ae74c52db0f7a8e2",
        "b0cc7356293ff635e256f7b0120d2b249755f0bc63f948804f3da592017522ac",
        "883156dfe4c4d550d72f8e4e97e96403a7081388541144cd964af21eaf579da5",
    ],
    "seed 0": [
        "a7783c6ae24b33fd807d60052097d7f1eb6ee09d1b5574d75e61ec84e5d900c2",
        "4cade116f7e89d102fd0f4348a717fd352aafaa5a07d1073a9ee7b0ba2051709",
    ],
}


def pagedkv_hashes() -> dict[str, list[str]]:
    out = {}
    for name, seed, salt, tokens, bs in CASES:
        fn = VllmKeyFunction(seed)  # None: PYTHONHASHSEED or vLLM's default seed, as vLLM does
        keys = BlockKeys(salt.encode() if salt else b"")
        keys.bind(fn, 0)
        arr = np.asarray(tokens, dtype=np.int32)
        out[name] = [bytes(keys.key(i, arr[i * bs : (i + 1) * bs])).hex() for i in range(len(tokens) // bs)]
    return out


def test_keys_equal_vllms_on_fixed_vectors_and_on_vllm_run_now(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    ours = pagedkv_hashes()
    assert ours == VLLM_0_33
    src, py = os.environ.get("VLLM_SRC"), os.environ.get("PEER_PY")
    if src and py and Path(src, "vllm/utils/hashing.py").exists():  # the peers' setup: vLLM itself, now
        script = Path(__file__).with_name("vllm_reference.py")
        run = subprocess.run([py, str(script)], capture_output=True, text=True, check=True)
        assert ours == json.loads(run.stdout)


def test_the_cbor_encoding_is_canonical_at_every_width() -> None:
    assert cbor_canonical(None) == b"\xf6"
    assert cbor_canonical(23) == b"\x17" and cbor_canonical(24) == b"\x18\x18"
    assert cbor_canonical(256) == b"\x19\x01\x00" and cbor_canonical(65536) == b"\x1a\x00\x01\x00\x00"
    assert cbor_canonical(2**32) == b"\x1b" + (2**32).to_bytes(8, "big")
    assert cbor_canonical(-1) == b"\x20" and cbor_canonical(True) == b"\xf5"
    assert cbor_canonical((b"ab", "é", [1])) == b"\x83\x42ab\x62\xc3\xa9\x81\x01"
    with pytest.raises(InvalidArgumentError):
        cbor_canonical(2**64)
    with pytest.raises(InvalidArgumentError):
        cbor_canonical(1.5)


def test_pagedkv_only_inputs_stay_distinct() -> None:
    fn = key_function("vllm")
    assert isinstance(fn, VllmKeyFunction)
    tokens = np.arange(4, dtype=np.int32)

    def first(salt: bytes = b"", epoch: int = 0, extra: bytes = b"", block_extra: bytes = b"") -> bytes:
        keys = BlockKeys(salt, extra=extra, block_extra={0: block_extra} if block_extra else None)
        keys.bind(fn, epoch)
        return bytes(keys.key(0, tokens))

    variants = [
        first(),
        first(b"a"),
        first(b"\xff"),
        first(epoch=1),
        first(extra=b"x"),
        first(block_extra=b"y"),
    ]
    assert len(set(variants)) == len(variants)
    assert first() != sha256_key(b"\x00" * 32, tokens.tobytes(), b"")  # the default chain differs


def test_a_manager_with_vllm_keys_publishes_vllms_64_bit_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    fn = VllmKeyFunction()  # what hash_fn="vllm" is in a process without PYTHONHASHSEED
    m = PagedKVManager(16, 4, record_events=True, hash_fn=fn)
    feed = EventFeed(m, [EventLog(4)])
    tokens = np.asarray(CASES[0][3] + [99], dtype=np.int32)  # "plain": 4 full blocks, then one more token
    adm = m.admit(tokens)
    m.mark_computed([adm.seq_id])
    feed.poll()
    stored = [h for e in feed.log.take_batch().events if isinstance(e, BlockStored) for h in e.block_hashes]
    # vLLM's int block hashes: int.from_bytes(hash, "big") & (2**64 - 1)
    want = [int.from_bytes(bytes.fromhex(h), "big") & (2**64 - 1) for h in VLLM_0_33["plain"]]
    assert stored == want
    assert request_hashes(tokens, 4, hash_fn=fn) == want
    assert {external_hash(k) for k in feed.log.holds(GPU)} == {external_hash(k) for k in m.index.all_keys()}
    assert request_hashes(tokens, 4) != want  # the default stays pagedkv's chain


def test_an_engine_with_hash_fn_vllm_publishes_vllms_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """`EngineConfig(hash_fn="vllm")` reaches the engine's manager: its KV events carry vLLM's block names for
    the prompt's full blocks, and the greedy output is the default chain's (keys name KV, never change it)."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.engine.params import SamplingParams
    from pagedkv.hf.tiny import tiny_model

    prompt = CASES[0][3] + [99]  # "plain": 4 full blocks of 4, then one more token
    params = SamplingParams(max_new_tokens=2)
    outputs = []
    for hash_fn in ("vllm", "sha256"):
        engine = Engine(tiny_model("llama", 0), config=EngineConfig(num_blocks=32, block_size=4, hash_fn=hash_fn, kv_events=True))
        outputs.append(engine.generate([prompt], params)[0].output_token_ids)
        batch = engine.take_event_batch()
        stored = [h for e in batch.events if isinstance(e, BlockStored) for h in e.block_hashes]
        want = [int.from_bytes(bytes.fromhex(h), "big") & (2**64 - 1) for h in VLLM_0_33["plain"]]
        assert (stored[:4] == want) == (hash_fn == "vllm")
    assert outputs[0] == outputs[1]
    with pytest.raises(InvalidArgumentError, match="hash_fn"):
        EngineConfig(num_blocks=32, hash_fn="md5")
