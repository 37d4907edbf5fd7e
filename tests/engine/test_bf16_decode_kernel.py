"""A bfloat16 model through the engine decodes with the C kernel over its bfloat16 pages
(`pagedkv.ops.cpu_decode`), and greedy decoding gives full-length, valid completions that match the SDPA
gather path's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from native_policy import require_native

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.hf.tiny import VOCAB, tiny_model
from pagedkv.ops import cpu_decode

require_native("pagedkv.ops._cpu_decode", cpu_decode.isa() is not None)

PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)
RNG = np.random.default_rng(7)
PROMPTS = [RNG.integers(3, VOCAB, size=n).tolist() for n in (5, 17, 30, 9)]


def greedy(monkeypatch: pytest.MonkeyPatch, use_kernel: bool) -> tuple[list[list[int]], list[torch.dtype]]:
    """Each prompt's greedy tokens from a tiny bfloat16 Llama, and the page dtype of every kernel call."""
    seen: list[torch.dtype] = []
    decode = cpu_decode.decode_attention

    def spy(query: torch.Tensor, kv: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(kv.dtype)
        return decode(query, kv, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(cpu_decode, "decode_attention", spy)
        if not use_kernel:
            m.setattr(cpu_decode, "available", lambda *_args: False)
        model = tiny_model("llama", 0).to(torch.bfloat16)
        engine = Engine(model, None, EngineConfig(block_size=4, num_blocks=64))
        outputs = engine.generate(PROMPTS, PARAMS)
        assert engine.manager.num_used_blocks == 0
    return [o.output_token_ids for o in outputs], seen


def test_greedy_bf16_decodes_in_the_kernel_like_the_gather_path(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens, dtypes = greedy(monkeypatch, use_kernel=True)
    assert dtypes and set(dtypes) == {torch.bfloat16}, "the decode steps go through the C kernel"
    assert all(len(t) == PARAMS.max_new_tokens and all(0 <= x < VOCAB for x in t) for t in tokens)
    gathered, none = greedy(monkeypatch, use_kernel=False)
    assert none == []
    assert tokens == gathered
