"""Two engine processes publish KV events over ZMQ (`pagedkv.router.fleet`); this process routes requests from
its index of them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("zmq")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from pagedkv.events import GPU  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BS = 4  # the fleet's tiny engine's block size


def fleet_env() -> dict[str, str]:
    """The replicas import this checkout's pagedkv."""
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_router_process_sends_shared_prefixes_where_their_kv_is() -> None:
    from pagedkv.router.fleet import Fleet

    n = 2
    with Fleet(n, policy="cost", env=fleet_env()) as fleet:
        assert fleet.block_size == BS
        docs = [[5 + d] * 4 + list(range(10, 10 + 4 * 5)) for d in range(2)]  # two 24-token documents
        prompts = [docs[k % 2] + [30 + k, 31 + k, 32 + k] for k in range(6)]  # questions about each
        placed, results = [], []
        for prompt in prompts:
            decision = fleet.route(prompt)
            placed.append(decision.replica)
            r = fleet.run(decision.replica, prompt, 4)
            results.append((r.output_token_ids, r.num_cached_tokens, decision.match.gpu))
            # the index is the replica's cache, with the events this request caused
            assert fleet.router.index.state(r.replica).get(GPU, set()) == set(r.gpu_hashes)
    # the first question on each document is computed on its own replica (round-robin on an empty index
    # spreads them); every later question follows its document and hits the whole document
    assert placed[:2] == [0, 1] and placed[2:] == [0, 1, 0, 1]
    for _, cached, predicted in results[2:]:
        assert cached == predicted * BS == 24
    # same weights everywhere: each output equals one engine's, without any prefix cache
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.engine.params import SamplingParams
    from pagedkv.hf.tiny import tiny_model

    ref = Engine(
        tiny_model("llama", 0), None, EngineConfig(num_blocks=48, block_size=BS, enable_prefix_caching=False)
    )
    expected = [o.output_token_ids for o in ref.generate(prompts, SamplingParams(max_new_tokens=4))]
    assert [o for o, _, _ in results] == expected
