"""The hybrid allocator in the engine: each layer reads its own KV cache group's table; greedy output is
token-identical to transformers' `generate` on the tiny windowed families (windows of 6-8 tokens, prompts
several windows long), with chunked prefill, prefix hits and preemption by recompute and by swap; and the
windowed groups hold fewer blocks than the uniform allocator does on the same requests.

gpt-oss (issue #24) is one of them: alternating sliding / full layers and attention sinks (`s_aux`, a learned
logit per query head in the softmax's denominator; the tiny model draws them wide, and dropping them changes
all 7 continuations), against transformers' eager attention, which adds the sinks itself."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import numpy as np
import pytest

from pagedkv.core.hybrid import HybridKVManager
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.scheduler import SchedulerConfig
from pagedkv.hf.oracle import reference_generate
from pagedkv.hf.tiny import VOCAB, tiny_model

MAX_NEW = 14


def engine_config(**kw: Any) -> EngineConfig:
    """`EngineConfig` from flat keywords: the scheduler's own go into its `SchedulerConfig`."""
    names = {f.name for f in fields(SchedulerConfig)}
    scheduler = SchedulerConfig(**{k: kw.pop(k) for k in list(kw) if k in names})
    return EngineConfig(**kw, scheduler=scheduler)

LENGTHS = (31, 5, 44, 17, 26)  # up to ~7 windows of the tiny models
WINDOWED = ["mistral", "qwen2-sw", "gemma2", "gpt-oss"]
_REF: dict[str, list[list[int]]] = {}


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    shared = rng.integers(3, VOCAB, size=20).tolist()
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in LENGTHS]
    return prompts + [shared + [5, 6], shared + [7, 8, 9]]  # the second hits the first's prefix


def _reference(family: str, prompts: list[list[int]]) -> list[list[int]]:
    if family not in _REF:
        _REF[family] = reference_generate(tiny_model(family, 0), prompts, MAX_NEW, eos_token_id=2, attn_implementation="eager")
    return _REF[family]


def _run(family: str, prompts: list[list[int]], **config: object) -> tuple[Engine, list[list[int]], int]:
    """Run all prompts but the last together, then the last alone (it may hit the cache)."""
    engine = Engine(tiny_model(family, 0), None, engine_config(**{"num_blocks": 96, "block_size": 4, **config}))
    peak = 0
    outs: dict[str, list[int]] = {}
    ids: list[str] = []
    for batch in (prompts[:-1], prompts[-1:]):
        ids += [engine.add_request(p, SamplingParams(max_new_tokens=MAX_NEW)) for p in batch]
        while engine.has_unfinished():
            for o in engine.step():
                outs[o.request_id] = o.output_token_ids
            peak = max(peak, engine.manager.num_used_blocks)
            engine.manager.check_invariants()
    assert engine.manager.num_used_blocks == 0, "the engine leaked KV blocks"
    return engine, [outs[i] for i in ids], peak


@pytest.mark.parametrize("family", WINDOWED)
@pytest.mark.parametrize("variant", ["plain", "chunked", "recompute", "swap"])
def test_hybrid_greedy_matches_generate(family: str, variant: str) -> None:
    prompts = _prompts()
    config: dict[str, object] = {"allocator": "hybrid"}
    if variant == "chunked":
        config["max_num_batched_tokens"] = 5
    if variant in ("recompute", "swap"):  # a pool too small for all at once: preemption
        # mistral is one sliding group: a 44-token prompt runs in 6 usable blocks of 4 tokens
        small, budget = (7, 8) if family == "mistral" else (20, 16)
        config.update(num_blocks=small, preemption_mode=variant, max_num_batched_tokens=budget, admission_lookahead=0)
    engine, outs, _ = _run(family, prompts, **config)
    assert isinstance(engine.manager, HybridKVManager)
    assert outs == _reference(family, prompts)
    if variant in ("recompute", "swap"):
        assert engine.stats.num_preemptions > 0, "the pool was large enough: preemption was not exercised"
    if variant == "plain":
        assert engine.manager.stats.cached_tokens > 0, "the shared prefix never hit"


def test_gpt_oss_has_sinks_and_both_layer_kinds_and_uniform_matches_too() -> None:
    from pagedkv.hf.attention import prepare_model

    model = tiny_model("gpt-oss", 0)
    assert prepare_model(model).sliding_windows == (8, None)
    assert all(layer.self_attn.sinks.abs().max() > 0.5 for layer in model.model.layers)
    prompts = _prompts()
    _, outs, _ = _run("gpt-oss", prompts)  # the uniform allocator: one table for both layers
    assert outs == _reference("gpt-oss", prompts)


def test_gpt_oss_with_its_own_128_token_window() -> None:
    """gpt-oss's real window (128) over 4 alternating layers, prompts up to 3.3 windows long plus 24 tokens:
    hybrid and uniform both equal `generate`."""
    from pagedkv.hf.tiny import tiny_gpt_oss

    model = tiny_gpt_oss(0, sliding_window=128, num_layers=4)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (400, 330, 129, 260)]
    want = reference_generate(model, prompts, 24, eos_token_id=None, attn_implementation="eager")
    for allocator in ("hybrid", "paged"):
        engine = Engine(model, None, engine_config(num_blocks=160, block_size=16, allocator=allocator))
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
        assert [o.output_token_ids for o in outs] == want, allocator


@pytest.mark.parametrize("family", ["gemma2", "mistral"])
def test_hybrid_holds_fewer_blocks_than_uniform_with_identical_outputs(family: str) -> None:
    """The same requests, uniform (every layer's KV in each block) vs hybrid (one group's layers per
    block): identical tokens, and the windowed groups free what they no longer read."""
    prompts = _prompts()
    uniform, out_u, peak_u = _run(family, prompts)
    hybrid, out_h, peak_h = _run(family, prompts, allocator="hybrid")
    assert out_u == out_h
    # bytes: a uniform block holds every layer, a hybrid block one group's layers
    bytes_u = peak_u * uniform.kv_budget_bytes // (uniform.manager.num_blocks + 1)
    bytes_h = peak_h * hybrid.kv_budget_bytes // (hybrid.manager.num_blocks + 1)
    assert bytes_h < bytes_u, f"hybrid peak {bytes_h} bytes, uniform {bytes_u}"


def test_hybrid_kv_events_carry_the_group_and_track_every_groups_blocks() -> None:
    """KV events with the hybrid allocator: every event names its KV cache group (`group_idx`, as vLLM's
    hybrid events do), block hashes are the content keys a uniform engine publishes, and replaying the
    events per group gives exactly the keys each group's blocks hold in the prefix index; outputs unchanged."""
    from pagedkv.core.group_keys import split_key
    from pagedkv.events import BlockRemoved, BlockStored
    from pagedkv.events.wire import decode_batch, encode_batch, external_hash

    prompts = _prompts()
    engine = Engine(tiny_model("gemma2", 0), None, engine_config(num_blocks=40, block_size=4, allocator="hybrid",
                                                                 kv_events=True))  # fmt: skip
    held: dict[int, set[int]] = {0: set(), 1: set()}
    outs: dict[str, list[int]] = {}
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=MAX_NEW)) for p in prompts]
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o.output_token_ids
        batch = engine.take_event_batch()
        if batch is not None:  # the wire keeps group_idx where vLLM puts it, last: a decoder without it reads on
            assert len(decode_batch(encode_batch(batch)).events) == len(batch.events)
        for e in batch.events if batch is not None else []:
            g = getattr(e, "group_idx", None)
            assert isinstance(e, BlockStored | BlockRemoved) and g in held, e
            (held[g].update if isinstance(e, BlockStored) else held[g].difference_update)(e.block_hashes)
        index = engine.manager.index
        truth: dict[int, set[int]] = {0: set(), 1: set()}
        for key in index.all_keys():
            content, group = split_key(key)
            truth[group].add(external_hash(content))
        assert held == truth, "the events say what every group's cache holds"
    assert [outs[i] for i in ids] == _reference("gemma2", prompts)
    assert held[0] and held[1], "both groups published blocks"


def _tier_rounds(family: str, **config: object) -> tuple[Engine, list[list[int]], list[list[int]], dict[str, int]]:
    """Round 1: long prompts; round 2: other prompts that push round 1's blocks off the small device pool;
    round 3: round 1's prompts with a new suffix (their prefix is in the host tier, not on the device)."""
    rng = np.random.default_rng(11)
    first = [rng.integers(3, VOCAB, size=n).tolist() for n in (33, 29)]
    other = [rng.integers(3, VOCAB, size=n).tolist() for n in (30, 34, 31)]
    num_blocks = 12 if family == "mistral" else 36  # mistral's one sliding group holds a window per request
    engine = Engine(tiny_model(family, 0), None, engine_config(num_blocks=num_blocks, block_size=4, allocator="hybrid", **config))
    outs: list[list[int]] = []
    by_tier: dict[str, int] = {}
    for batch in (first, other, [p + [7, 8] for p in first]):
        got: dict[str, list[int]] = {}
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=MAX_NEW)) for p in batch]
        while engine.has_unfinished():
            for o in engine.step():
                got[o.request_id] = o.output_token_ids
                for medium, n in o.num_cached_tokens_by_tier.items():
                    by_tier[medium] = by_tier.get(medium, 0) + n
            engine.manager.check_invariants()
        outs += [got[i] for i in ids]
    assert engine.manager.num_used_blocks == 0
    return engine, first + other + [p + [7, 8] for p in first], outs, by_tier


@pytest.mark.parametrize("family", ["gemma2", "mistral"])
def test_hybrid_host_tier_serves_hits_with_identical_output(family: str) -> None:
    """The host tier with the hybrid allocator: every group's copy of a block is stored under its
    group-qualified key and fetched back; round 3's prompts are served from the host tier (CPU tokens > 0),
    and greedy output equals the run without a tier and transformers'."""
    engine, prompts, outs, by_tier = _tier_rounds(family, host_blocks=96)
    _, _, outs_off, off_tier = _tier_rounds(family)
    assert by_tier.get("CPU", 0) >= 16, f"a tier hit was served: {by_tier}"
    assert not off_tier.get("CPU"), "no tier, no CPU hits"
    assert engine.stats.tiers is not None and sum(engine.stats.tiers.stored_blocks.values()) > 0
    assert outs == outs_off, "the tier changes no token"
    ref = reference_generate(tiny_model(family, 0), prompts, MAX_NEW, eos_token_id=2, attn_implementation="eager")
    assert outs == ref
