"""Greedy output through the engine is token-identical to transformers' own `generate`, per prompt.

Several prompts of different lengths share each batch; the runs vary what the engine does underneath
(prefix caching on/off, chunked prefill, forced preemption by recompute and by swap, the contiguous
allocator) and the answer must not change. The reference runs each prompt alone with eager attention.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import numpy as np
import pytest

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.scheduler import SchedulerConfig
from pagedkv.hf.oracle import reference_generate
from pagedkv.hf.tiny import VOCAB, tiny_model


def engine_config(**kw: Any) -> EngineConfig:
    """`EngineConfig` from flat keywords: the scheduler's own go into its `SchedulerConfig`."""
    names = {f.name for f in fields(SchedulerConfig)}
    scheduler = SchedulerConfig(**{k: kw.pop(k) for k in list(kw) if k in names})
    return EngineConfig(**kw, scheduler=scheduler)

MAX_NEW = 12
_REFERENCE_CACHE: dict[tuple[str, int, tuple[int, ...]], list[list[int]]] = {}


def prompts_of(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in lengths]


def reference(family: str, seed: int, lengths: tuple[int, ...], prompts: list[list[int]]) -> list[list[int]]:
    key = (family, seed, lengths)
    if key not in _REFERENCE_CACHE:
        _REFERENCE_CACHE[key] = reference_generate(
            tiny_model(family, seed), prompts, MAX_NEW, eos_token_id=2, attn_implementation="eager"
        )
    return _REFERENCE_CACHE[key]


def run_engine(family: str, prompts: list[list[int]], seed: int = 0, **config: object) -> tuple[Engine, list]:
    engine = Engine(tiny_model(family, seed), None, engine_config(**{"num_blocks": 64, "block_size": 4, **config}))
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    engine.manager.check_invariants()
    assert engine.manager.num_used_blocks == 0, "the engine leaked KV blocks"
    assert not engine.has_unfinished()
    return engine, outputs


LENGTHS = (5, 17, 9, 30, 3)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gpt2"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_batch_matches_generate(family: str, prefix_caching: bool) -> None:
    prompts = prompts_of(LENGTHS)
    _, outputs = run_engine(family, prompts, enable_prefix_caching=prefix_caching)
    assert [o.output_token_ids for o in outputs] == reference(family, 0, LENGTHS, prompts)
    for o in outputs:
        assert o.finish_reason in ("length", "stop")
        assert o.finish_reason == ("stop" if o.output_token_ids[-1] == 2 else "length")


@pytest.mark.parametrize(("family", "backend"), [("llama", "sdpa"), ("mistral", "sdpa"), ("mistral", "ops")])
def test_chunked_prefill_matches_generate(family: str, backend: str) -> None:
    prompts = prompts_of(LENGTHS)
    engine, outputs = run_engine(family, prompts, max_num_batched_tokens=7, attention_backend=backend)
    assert [o.output_token_ids for o in outputs] == reference(family, 0, LENGTHS, prompts)
    assert engine.stats.num_steps > len(prompts) + MAX_NEW  # the 30-token prompt took several steps


def test_prefix_cache_hits_keep_outputs_identical() -> None:
    shared = prompts_of((24,), seed=5)[0]
    prompts = [shared + tail for tail in prompts_of((3, 7, 5), seed=6)]
    lengths = tuple(len(p) for p in prompts)
    engine = Engine(tiny_model("qwen2"), None, EngineConfig(num_blocks=64, block_size=4))
    first = engine.generate(prompts[:1], SamplingParams(max_new_tokens=MAX_NEW))
    rest = engine.generate(prompts[1:], SamplingParams(max_new_tokens=MAX_NEW))
    assert [o.num_cached_tokens for o in rest] == [24, 24]  # six full shared blocks of 4
    assert first[0].num_cached_tokens == 0
    expected = reference("qwen2", 0, lengths, prompts)
    assert [o.output_token_ids for o in first + rest] == expected


@pytest.mark.parametrize(("mode", "backend"), [("recompute", "sdpa"), ("swap", "sdpa"), ("swap", "ops")])
def test_forced_preemption_keeps_outputs_identical(mode: str, backend: str) -> None:
    prompts = prompts_of(LENGTHS)
    # 14 usable blocks of 4 tokens: all five prompts are admitted, decode growth must preempt
    engine, outputs = run_engine(
        "llama", prompts, num_blocks=15, preemption_mode=mode, attention_backend=backend
    )
    assert engine.stats.num_preemptions > 0
    if mode == "swap":
        assert engine.stats.num_swapped_out_blocks > 0
        assert engine.stats.num_swapped_in_blocks == engine.stats.num_swapped_out_blocks
    assert [o.output_token_ids for o in outputs] == reference("llama", 0, LENGTHS, prompts)
    assert sum(o.num_preemptions for o in outputs) == engine.stats.num_preemptions


def test_contiguous_allocator_matches_generate() -> None:
    prompts = prompts_of(LENGTHS)
    engine, outputs = run_engine("gpt2", prompts, allocator="contiguous", num_blocks=40)
    assert [o.output_token_ids for o in outputs] == reference("gpt2", 0, LENGTHS, prompts)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_heavy_preemption_stress(mode: str) -> None:
    """Many requests through a pool that holds ~two of them: requests are preempted, swapped back in and
    preempted again within single steps; every output still equals generate's."""
    lengths = (6, 11, 3, 14, 9, 7, 12, 5)
    prompts = prompts_of(lengths, seed=9)
    engine = Engine(
        tiny_model("gpt2", 4), None, EngineConfig(
            num_blocks=12, block_size=4, scheduler=SchedulerConfig(preemption_mode=mode, admission_lookahead=0)
        ),  # greedy admission: the stress is the preemptions
    )
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
    expected = reference_generate(
        tiny_model("gpt2", 4), prompts, 16, eos_token_id=None, attn_implementation="eager"
    )
    assert engine.stats.num_preemptions >= 5
    assert [o.output_token_ids for o in outputs] == expected
    assert engine.manager.num_used_blocks == 0
