"""Two engine processes sharing one Redis: a prefix computed on replica A is served on replica B from the
store, with output identical to A's and to a tiers-off engine, and B reports its REMOTE-tier tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pagedkv.hf.tiny import VOCAB

ROOT = Path(__file__).resolve().parents[2]

REPLICA = """
import json, sys
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.hf.tiny import tiny_model

url, prompts = sys.argv[1], json.loads(sys.argv[2])
config = EngineConfig(num_blocks=64, block_size=4, remote_url=url or None)
engine = Engine(tiny_model("qwen2", seed=5), None, config)
outputs = engine.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
print(json.dumps([{"ids": o.output_token_ids, "by_tier": o.num_cached_tokens_by_tier} for o in outputs]))
engine.close()
"""


def replica(url: str, prompts: list[list[int]]) -> list[dict[str, object]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", REPLICA, url, json.dumps(prompts)], env=env, capture_output=True,
                         text=True, timeout=300, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    result: list[dict[str, object]] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow  # three processes that each import torch and transformers
def test_prefix_computed_on_a_is_served_on_b_from_redis(redis_url: str) -> None:
    rng = np.random.default_rng(3)
    system = rng.integers(3, VOCAB, size=33).tolist()  # 8 full blocks shared by both turns
    on_a = [system + rng.integers(3, VOCAB, size=5).tolist()]
    on_b = [system + rng.integers(3, VOCAB, size=7).tolist()]
    a = replica(redis_url, on_a)
    b = replica(redis_url, [*on_b, *on_a])
    alone = replica("", on_b)  # no tiers: the ground truth for B's prompt
    assert b[0]["ids"] == alone[0]["ids"]
    assert b[1]["ids"] == a[0]["ids"]  # A's own prompt on B: same output
    assert b[1]["by_tier"] == {
        "GPU": 0,
        "CPU": 0,
        "DISK": 0,
        "REMOTE": 36,
    }  # admitted with b[0]: all 9 via Redis
    assert a[0]["by_tier"] == {"GPU": 0, "CPU": 0, "DISK": 0, "REMOTE": 0}
    assert b[0]["by_tier"] == {"GPU": 0, "CPU": 0, "DISK": 0, "REMOTE": 32}  # 8 blocks of 4 from A's store
    assert alone[0]["by_tier"] == {"GPU": 0}
