"""A fleet (`pagedkv.router.fleet`): two engine processes sharing one Redis publish their KV events (every
medium) over ZMQ; this process routes from its index of them (cost policy). A prefix computed on replica A is
served on replica B from Redis when A is busy: same output, B reports REMOTE-tier tokens, and the router saw
A's REMOTE stores before it chose."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("zmq")

from pagedkv.engine.config import EngineConfig  # noqa: E402
from pagedkv.engine.llm_engine import Engine  # noqa: E402
from pagedkv.engine.params import SamplingParams  # noqa: E402
from pagedkv.events import GPU, REMOTE  # noqa: E402
from pagedkv.hf.tiny import tiny_model  # noqa: E402
from pagedkv.router.fleet import Fleet  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BS = 4  # the fleet's tiny engine's block size


# not slow: 7-18 s here (three processes that import torch; a shared 2-core machine)
def test_prefix_computed_on_a_is_served_on_b_from_redis_when_the_router_sends_it_there(
    redis_url: str,
) -> None:
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    prompt = [7] * 4 + list(range(20, 40)) + [90, 91, 92]  # 27 tokens: 6 cacheable blocks
    with Fleet(2, remote_url=redis_url, policy="cost", env=env) as fleet:
        index = fleet.router.index
        hashes = fleet.hashes(prompt)
        assert len(hashes) == 6
        first = fleet.route(prompt)
        assert first.replica == 0 and first.match.total == 0  # nothing cached anywhere: A computes it
        a = fleet.run(0, prompt, 4)
        assert a.num_cached_tokens == 0 and a.num_cached_tokens_by_tier["REMOTE"] == 0
        for h in hashes:  # A's events said: on its GPU, and written through to the shared store
            assert index.media(h, 0) == {GPU, REMOTE}
            assert index.media(h, 1) == frozenset()

        assert fleet.route(prompt).replica == 0  # an idle A holds it on its GPU: A
        busy = fleet.route(prompt, [8.0, 0.0])  # A has 8 blocks of work queued: B, loading from Redis
        assert busy.replica == 1 and (busy.match.gpu, busy.match.remote) == (0, 6)
        b = fleet.run(1, prompt, 4)
        assert b.output_token_ids == a.output_token_ids
        assert b.num_cached_tokens == 24
        assert b.num_cached_tokens_by_tier == {"GPU": 0, "CPU": 0, "DISK": 0, "REMOTE": 24}
        for h in hashes:  # B now holds them on its GPU; the store's copies stay A's (SET NX)
            assert index.media(h, 1) == {GPU}
            assert REMOTE in index.media(h, 0)
        assert fleet.route(prompt).match.gpu == 6  # both GPUs hold it now
    ref = Engine(
        tiny_model("llama", 0), None, EngineConfig(num_blocks=48, block_size=BS, enable_prefix_caching=False)
    )
    assert a.output_token_ids == ref.generate([prompt], SamplingParams(max_new_tokens=4))[0].output_token_ids


@pytest.mark.slow  # two more replica processes
def test_the_one_command_demo_serves_from_the_store(redis_url: str) -> None:
    import subprocess
    import sys

    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pagedkv.router.fleet", "--replicas", "2", "--remote-url", redis_url]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines()[2:]]
    assert [r[:5] for r in rows] == [
        ["0", "1", "0", "0", "(0/0/0/0)"],
        ["1", "0", "1", "40", "(0/0/0/40)"],  # the busy replica's prefix, from Redis
        ["2", "1", "0", "40", "(40/0/0/0)"],
        ["3", "0", "1", "40", "(40/0/0/0)"],
    ]


def test_fleet_misuse_is_one_typed_error() -> None:
    from pagedkv.core.errors import InvalidArgumentError
    from pagedkv.router.fleet import load_factory

    with pytest.raises(InvalidArgumentError, match="at least one replica"):
        Fleet(0)
    with pytest.raises(InvalidArgumentError, match="module:function"):
        load_factory("pagedkv.router.fleet")
