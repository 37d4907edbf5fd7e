"""The engine on quantized KV pages (`EngineConfig.kv_cache_dtype`): the budget buys the blocks the spec
counts (scales included), and everything that moves a block (prefix hits, partial-block reuse, preemption by
swap, the host and disk tiers) gives the same tokens as recomputing it; the C decode kernel and the
reference op read the codes alike; quantized and unquantized KV never share a tier fingerprint. Each runs under
both scale schemes: a quantized dtype alone keeps a scale per token, `dtype/block` one per block
(`EngineConfig.kv_scale_scheme`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.scheduler import SchedulerConfig
from pagedkv.hf.tiny import VOCAB, tiny_model
from pagedkv.storage.kv_spec import KVCacheSpec

BS = 4
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)
CACHED: dict[int, list[int]] = {}  # id(engine) -> each output's num_cached_tokens
RNG = np.random.default_rng(3)
RNG_SWAP = np.random.default_rng(4)
SHARED = RNG.integers(3, VOCAB, size=30).tolist()
OTHERS = [RNG.integers(3, VOCAB, size=30).tolist() for _ in range(3)]
AGAIN = SHARED[:22] + RNG.integers(3, VOCAB, size=6).tolist()  # diverges inside block 5: partial reuse


def kv_config(kv: str) -> dict[str, str]:
    """EngineConfig fields of "dtype" or "dtype/scheme"."""
    dtype, _, scheme = kv.partition("/")
    return {"kv_cache_dtype": dtype, "kv_scale_scheme": scheme or "token"}


def run(kv: str, **config: Any) -> tuple[Engine, list[list[int]]]:
    engine = Engine(tiny_model("llama"), None, EngineConfig(block_size=BS, **kv_config(kv),
                                                            **{"num_blocks": 14, **config}))  # fmt: skip
    outputs = [engine.generate([SHARED], PARAMS)[0]]
    outputs += engine.generate(OTHERS, PARAMS)
    outputs += [engine.generate([p], PARAMS)[0] for p in (SHARED, AGAIN)]
    CACHED[id(engine)] = [o.num_cached_tokens for o in outputs]
    engine.manager.check_invariants()
    assert engine.manager.num_used_blocks == 0, "the engine leaked KV blocks"
    return engine, [o.output_token_ids for o in outputs]


@pytest.fixture(scope="module", params=["int8", "fp8_e4m3", "fp8_e5m2", "int8/block", "fp8_e4m3/block", "fp8_e5m2/block"])
def recomputed(request: pytest.FixtureRequest) -> tuple[str, list[list[int]]]:
    """Every prompt computed from scratch (no prefix caching), on quantized pages."""
    _, tokens = run(request.param, enable_prefix_caching=False)
    return request.param, tokens


def test_prefix_hits_and_partial_reuse_read_the_stored_codes(recomputed: tuple[str, list[list[int]]]) -> None:
    dtype, baseline = recomputed
    engine, tokens = run(dtype, num_blocks=64)  # room to keep SHARED cached
    assert tokens == baseline
    assert engine.cache.storage.spec.is_quantized
    assert CACHED[id(engine)][-2:] == [29, 22], "SHARED hits its cached blocks, AGAIN reuses 22 tokens"


def test_swap_preemption_moves_codes_and_scales(recomputed: tuple[str, list[list[int]]]) -> None:
    """Three requests that outgrow a small pool together: preempted by swap and back, they give the tokens
    they give in a pool large enough to never preempt."""
    dtype, _ = recomputed
    prompts = [RNG_SWAP.integers(3, VOCAB, size=10).tolist() for _ in range(3)]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    swap = SchedulerConfig(preemption_mode="swap", admission_lookahead=0)
    tokens = []
    for num_blocks in (64, 12):
        engine = Engine(tiny_model("llama"), None, EngineConfig(num_blocks=num_blocks, block_size=BS, scheduler=swap,
                                                                **kv_config(dtype)))  # fmt: skip
        tokens.append([o.output_token_ids for o in engine.generate(prompts, params)])
        engine.manager.check_invariants()
    assert engine.stats.num_swapped_in_blocks > 0, "the case did not swap"
    assert tokens[0] == tokens[1]


def test_host_and_disk_tiers_bring_codes_and_scales_back(recomputed: tuple[str, list[list[int]]],
                                                         tmp_path: Path) -> None:  # fmt: skip
    dtype, baseline = recomputed
    engine, tokens = run(dtype, host_blocks=2, disk_path=str(tmp_path), disk_bytes=1 << 20)
    assert tokens == baseline
    stats = engine.stats.tiers
    assert stats is not None and stats.hit_rate("CPU") + stats.hit_rate("DISK") > 0, "the tiers served nothing"


@pytest.mark.parametrize("kv", ["int8", "int8/block"])
def test_c_kernel_and_reference_read_the_same_codes(kv: str) -> None:
    _, sdpa = run(kv, attention_backend="sdpa")  # decode: the C kernel (one thread), prefill: reference
    _, ops = run(kv, attention_backend="ops")  # everything through pagedkv.ops (reference on CPU)
    assert sdpa == ops


def test_bf16_pages_under_a_float32_model() -> None:
    """KV stored in another dtype than the model's: attention upcasts it (pagedkv.ops), not SDPA."""
    engine, tokens = run("bf16")
    assert engine.cache.storage.dtype == torch.bfloat16 and all(len(t) == PARAMS.max_new_tokens for t in tokens)


def test_budget_counts_codes_and_scales() -> None:
    budget = 200_000
    model = tiny_model("llama")  # 2 layers, 2 KV heads, head dim 16, float32
    blocks = {}
    for dtype in ("auto", "bf16", "int8", "fp8_e4m3"):
        engine = Engine(model, None, EngineConfig(kv_budget_bytes=budget, block_size=BS, kv_cache_dtype=dtype))
        blocks[dtype] = engine.cache.num_blocks
        assert engine.kv_budget_bytes == blocks[dtype] * engine.cache.bytes_per_block <= budget
    per_block = {d: BS * KVCacheSpec(2, 2, 16, d).bytes_per_token for d in ("float32", "bf16", "int8")}
    assert per_block == {"float32": BS * 2 * 2 * 2 * 64, "bf16": BS * 2 * 2 * 2 * 32, "int8": BS * 2 * 2 * 2 * 20}
    assert blocks == {"auto": budget // per_block["float32"], "bf16": budget // per_block["bf16"],
                      "int8": budget // per_block["int8"], "fp8_e4m3": budget // per_block["int8"]}  # fmt: skip
    engine = Engine(model, None, EngineConfig(kv_budget_bytes=budget, block_size=BS, **kv_config("int8/block")))
    assert engine.cache.bytes_per_block == 2 * 2 * 2 * (BS * 16 + 4)  # one scale per block, K/V, layer, KV head
    assert engine.cache.num_blocks == budget // engine.cache.bytes_per_block
    assert engine.cache.storage.scales is not None and engine.cache.storage.scales.shape == (2, 2, budget // 544, 1, 2)


def test_quantized_and_full_precision_kv_never_share_a_fingerprint(tmp_path: Path) -> None:
    """The disk tier's file is named after the fingerprint its keys carry: one file per KV dtype."""
    model = tiny_model("llama")
    engines = []
    kinds = ("auto", "bf16", "int8", "fp8_e4m3", "fp8_e5m2", "int8/block", "fp8_e4m3/block", "fp8_e5m2/block")
    for kv in kinds:
        config = EngineConfig(num_blocks=8, block_size=BS, **kv_config(kv), disk_path=str(tmp_path),
                              disk_bytes=1 << 16)  # fmt: skip
        engines.append(Engine(model, None, config))
    assert len({p.name.split("-")[1] for p in tmp_path.glob("pagedkv-*.blocks")}) == len(kinds)


def test_unknown_kv_cache_dtype_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="kv_cache_dtype must be one of auto, bf16, fp8_e4m3, fp8_e5m2, int8"):
        EngineConfig(num_blocks=8, kv_cache_dtype="int4")
    with pytest.raises(InvalidArgumentError, match="kv_scale_scheme must be one of token, block"):
        EngineConfig(num_blocks=8, kv_cache_dtype="int8", kv_scale_scheme="tensor")
    for dtype in ("auto", "bf16"):
        with pytest.raises(InvalidArgumentError, match="'block' needs a quantized KV cache dtype"):
            EngineConfig(num_blocks=8, kv_cache_dtype=dtype, kv_scale_scheme="block")


def test_the_generate_and_serve_flags_reach_the_engine_config() -> None:
    import argparse

    from pagedkv.engine.from_args import config_from_args
    from pagedkv.engine.generate_command import add_arguments
    from pagedkv.serve.serve_command import add_arguments as add_serve_arguments

    for add in (add_arguments, add_serve_arguments):
        parser = argparse.ArgumentParser()
        add(parser)
        argv = ["--num-blocks", "8", "--kv-cache-dtype", "fp8_e5m2"] + (["p"] if add is add_arguments else [])
        assert config_from_args(parser.parse_args(argv)).kv_cache_dtype == "fp8_e5m2"
        assert config_from_args(parser.parse_args(argv[:2] + argv[4:])).kv_cache_dtype == "auto"
        config = config_from_args(parser.parse_args([*argv, "--kv-scale-scheme", "block"]))
        assert (config.kv_cache_dtype, config.kv_scale_scheme) == ("fp8_e5m2", "block")
        assert config_from_args(parser.parse_args(argv)).kv_scale_scheme == "token"


def test_hybrid_model_on_int8_pages() -> None:
    """KV cache groups (a sliding-window layer beside a full one) share quantized pages and their scales."""
    config = dict(block_size=BS, allocator="hybrid", kv_cache_dtype="int8")
    tokens = []
    for prefix_caching in (False, True):
        engine = Engine(tiny_model("qwen2-sw"), None, EngineConfig(num_blocks=40, enable_prefix_caching=prefix_caching,
                                                                   **config))  # type: ignore[arg-type]  # fmt: skip
        outs = [engine.generate([p], PARAMS)[0] for p in (SHARED, AGAIN)]
        engine.manager.check_invariants()
        tokens.append([o.output_token_ids for o in outs])
    assert tokens[0] == tokens[1] and outs[1].num_cached_tokens > 0
