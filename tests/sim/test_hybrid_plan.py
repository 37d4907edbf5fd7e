"""Group-aware KV arithmetic (`pagedkv.sim.hybrid_kv`): the RFC's waste figures from first principles, the
closed forms against brute force, the layer patterns of the catalog, and `pagedkv plan` side by side."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagedkv.cli import main
from pagedkv.core.errors import InvalidArgumentError
from pagedkv.sim.catalog import BUILTIN_MODELS, ModelShape
from pagedkv.sim.hybrid_kv import GroupedKV


def test_rfc_11382_waste_from_first_principles() -> None:
    gemma2, ministral = BUILTIN_MODELS["gemma-2-27b"], BUILTIN_MODELS["ministral-8b"]
    assert GroupedKV(gemma2, 16).waste(gemma2.max_model_len) == 0.25  # half the layers keep 4k of 8k
    assert GroupedKV(ministral, 16).waste(ministral.max_model_len) == 0.5625  # 3/4 keep 32k of 128k
    assert GroupedKV(gemma2, 16).waste(4096) == 0.0  # inside the window nothing is wasted


def test_layer_patterns_of_the_catalog() -> None:
    windows = BUILTIN_MODELS["gemma-3-27b"].layer_windows
    assert len(windows) == 62 and windows.count(None) == 10 and windows[5] is None and windows[0] == 1024
    assert BUILTIN_MODELS["gpt-oss-120b"].layer_windows[:4] == (128, None, 128, None)
    assert set(BUILTIN_MODELS["mistral-7b-v0.1"].layer_windows) == {4096}
    assert not BUILTIN_MODELS["llama-3-8b"].is_hybrid
    with pytest.raises(InvalidArgumentError, match="sliding_window"):
        ModelShape("x", 1, 2, 8, 2, 2, 4, 8, 8, 8, layer_pattern="SF")


@pytest.mark.parametrize("name", ["gemma-2-9b", "gemma-3-12b", "gpt-oss-20b", "ministral-8b"])
def test_blocks_over_life_is_the_sum_of_blocks(name: str) -> None:
    kv = GroupedKV(BUILTIN_MODELS[name], 16)
    rng = np.random.default_rng(0)
    start = rng.integers(0, 3000, 20)
    stop = start + rng.integers(0, 3000, 20)
    brute = [int(kv.blocks(np.arange(a + 1, b + 1)).sum()) for a, b in zip(start.tolist(), stop.tolist())]
    assert kv.blocks_over_life(start, stop).tolist() == brute


def test_hybrid_blocks_by_hand() -> None:
    kv = GroupedKV(BUILTIN_MODELS["gemma-2-9b"], 16)  # 21 sliding (4096) + 21 full layers: 2 groups of 21
    assert kv.layers_per_block == 21 and kv.bytes_per_block == 21 * 16 * 2 * 8 * 256 * 2
    assert kv.blocks(np.array([8192])).tolist() == [512 + 257]  # full: 512, sliding: 4095 tokens + 1 block


def test_plan_shows_uniform_and_hybrid_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "gemma-2-27b", "--gpu", "h100-80gb", "--allocators", "paged", "--num-requests", "200"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "KV cache groups: sliding-4096: 23 layers in 1 group, full: 23 layers in 1 group" in text
    assert "25.00% (vLLM RFC #11382's measure)" in text
    assert main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    rows = plan["kv_groups"]["contexts"]
    assert rows[-1]["context"] == 8192 and rows[-1]["hybrid_concurrent"] > rows[-1]["uniform_concurrent"]
    assert plan["kv_groups"]["hybrid"]["max_concurrent_memory"] >= plan["allocators"]["paged"]["max_concurrent_memory"]
    assert main(["plan", "--model", "llama-3-8b", "--allocators", "paged", "--num-requests", "50", "--json"]) == 0
    assert "kv_groups" not in json.loads(capsys.readouterr().out)
