"""A fleet: two engine processes sharing one Redis publish their KV events (every medium) over ZMQ; this process
routes from its index of them (cost policy). A prefix computed on replica A is served on replica B from Redis
when A is busy: same output, B reports REMOTE-tier tokens, and the router saw A's REMOTE stores first."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

zmq = pytest.importorskip("zmq")

from pagedkv.events import GPU, REMOTE  # noqa: E402
from pagedkv.events.publisher import EventSubscriber  # noqa: E402
from pagedkv.router import Router, request_hashes  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "router" / "replica_worker.py"
BS = 4  # the worker's block size


@pytest.mark.slow  # three processes that each import torch and transformers
def test_prefix_computed_on_a_is_served_on_b_from_redis_when_the_router_sends_it_there(
    redis_url: str, tmp_path: Path
) -> None:
    folder, n = str(tmp_path), 2
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{folder}/out")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), folder, str(i), redis_url], env=env) for i in range(n)
    ]
    pushes: list[zmq.Socket[bytes]] = []
    subs: list[EventSubscriber] = []
    router = Router(list(range(n)), "cost")

    def serve(replica: int, rid: str, prompt: list[int]) -> tuple[list[int], int, dict[str, int]]:
        """Run one request on `replica`; fold in the events it caused before returning."""
        pushes[replica].send(msgspec.msgpack.encode([rid, prompt, 4]))
        assert pull.poll(120_000), "a replica did not answer"
        index, got, output, cached, next_seq, held, by_tier = msgspec.msgpack.decode(pull.recv())
        assert (index, got) == (replica, rid)
        deadline = time.monotonic() + 30
        while subs[replica].next_seq < next_seq:
            assert time.monotonic() < deadline, "events did not arrive"
            for _, batch in subs[replica].poll(100):
                router.index.apply(replica, batch)
        assert router.index.state(replica).get(GPU, set()) == set(held)  # the index is the replica's cache
        return output, cached, by_tier

    try:
        ready = set()
        while len(ready) < n:
            assert pull.poll(120_000), "a replica process did not start"
            ready.add(msgspec.msgpack.decode(pull.recv())[0])
        for i in range(n):
            push = ctx.socket(zmq.PUSH)
            push.connect(f"ipc://{folder}/req{i}")
            pushes.append(push)
            subs.append(EventSubscriber(f"ipc://{folder}/pub{i}", f"ipc://{folder}/replay{i}", context=ctx))
        time.sleep(0.2)  # let the SUB sockets join; anything missed comes back through the replay socket

        prompt = [7] * 4 + list(range(20, 40)) + [90, 91, 92]  # 27 tokens: 6 cacheable blocks
        hashes = request_hashes(prompt, BS)
        assert len(hashes) == 6
        first = router.route(hashes, [0.0, 0.0])
        assert first.replica == 0 and first.match.total == 0  # nothing cached anywhere: A computes it
        out_a, cached_a, tiers_a = serve(0, "a", prompt)
        assert cached_a == 0 and tiers_a["REMOTE"] == 0
        for h in hashes:  # A's events said: on its GPU, and written through to the shared store
            assert router.index.media(h, 0) == {GPU, REMOTE}
            assert router.index.media(h, 1) == frozenset()

        assert router.route(hashes, [0.0, 0.0]).replica == 0  # idle A holds it on its GPU: A
        busy = router.route(hashes, [8.0, 0.0])  # A has 8 blocks of work queued: load from Redis on B
        assert busy.replica == 1 and (busy.match.gpu, busy.match.remote) == (0, 6)
        out_b, cached_b, tiers_b = serve(1, "b", prompt)
        assert out_b == out_a
        assert cached_b == 24 and tiers_b == {"GPU": 0, "CPU": 0, "DISK": 0, "REMOTE": 24}
        for h in hashes:  # B now holds them on its GPU; the store's copies stay A's (SET NX)
            assert router.index.media(h, 1) == {GPU}
            assert REMOTE in router.index.media(h, 0)

        from pagedkv.engine.config import EngineConfig
        from pagedkv.engine.llm_engine import Engine
        from pagedkv.engine.params import SamplingParams
        from pagedkv.hf.tiny import tiny_model

        ref = Engine(
            tiny_model("llama", 0),
            None,
            EngineConfig(num_blocks=48, block_size=BS, enable_prefix_caching=False),
        )
        assert out_a == ref.generate([prompt], SamplingParams(max_new_tokens=4))[0].output_token_ids
    finally:
        for push in pushes:
            push.send(msgspec.msgpack.encode([None, [], 0]))
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        for s in subs:
            s.close()
        for push in pushes:
            push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
