"""Fingerprints name the weights, not only the model (issue #20.4): two checkpoints with the same
`name_or_path` (here two seeded tiny models, both named "llama") never read each other's KV through a
shared store, and the weights' digest is computed once per GGUF conversion (cached beside it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.hf import loading
from pagedkv.hf.tiny import VOCAB, tiny_model

BS = 4
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)
PROMPT = np.random.default_rng(3).integers(3, VOCAB, size=33).tolist()


def serve(model: Any, **tiers: Any) -> tuple[list[int], dict[str, int]]:
    engine = Engine(model, None, EngineConfig(num_blocks=24, block_size=BS, **tiers))
    out = engine.generate([PROMPT], PARAMS)[0]
    engine.close()
    return out.output_token_ids, out.num_cached_tokens_by_tier or {}


def test_two_models_of_one_name_never_share_kv_through_a_store(redis_url: str) -> None:
    a, b = tiny_model("llama", 0), tiny_model("llama", 1)
    assert a.config._name_or_path == b.config._name_or_path
    alone_b, _ = serve(b)
    _, by_tier = serve(a, remote_url=redis_url)  # a writes its prompt's blocks through to the store
    assert by_tier["REMOTE"] == 0
    _, again = serve(tiny_model("llama", 0), remote_url=redis_url)
    assert again["REMOTE"] == 32  # the same weights (a fresh object) share: the store works
    tokens_b, by_tier_b = serve(b, remote_url=redis_url)
    assert by_tier_b["REMOTE"] == 0 and tokens_b == alone_b


def test_the_digest_follows_the_weights() -> None:
    a, b = tiny_model("llama", 0), tiny_model("llama", 1)
    assert loading.weights_digest(a) == loading.weights_digest(tiny_model("llama", 0))
    assert loading.weights_digest(a) != loading.weights_digest(b)
    assert len(loading.weights_digest(a)) == 64


def test_the_digest_is_cached_beside_a_gguf_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("llama", 0)
    source = loading.ModelSource(tmp_path, "m.gguf", tmp_path / "cache" / "abc")
    assert loading.cached_digest(source, model) is None  # nothing cached yet
    loading._save_conversion(source, model, _NoTokenizer())  # the conversion writes it beside the weights
    saved = (source.cache_folder / loading.DIGEST_FILE).read_text().split()
    assert saved == ["torch.float32", loading.weights_digest(model)]

    def costly(model: Any) -> str:
        raise AssertionError("a restart recomputed the digest of a cached conversion")

    monkeypatch.setattr(loading, "weights_digest", costly)
    assert source.cached and loading.cached_digest(source, model) == saved[1]
    assert loading.cached_digest(source, model.to(dtype=__import__("torch").bfloat16)) is None  # another dtype


class _NoTokenizer:
    def save_pretrained(self, folder: Path) -> None:
        (Path(folder) / "tokenizer.json").write_text("{}")
