"""Two engine processes publish KV events over ZMQ; this process routes requests from its index of them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from pagedkv.events import GPU  # noqa: E402
from pagedkv.events.publisher import EventSubscriber  # noqa: E402
from pagedkv.router import Router, request_hashes  # noqa: E402

WORKER = Path(__file__).with_name("replica_worker.py")
BS = 4  # the worker's block size


@pytest.mark.slow
def test_router_process_sends_shared_prefixes_where_their_kv_is(tmp_path) -> None:
    folder = str(tmp_path)
    n = 2
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{folder}/out")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2] / "src"), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(WORKER), folder, str(i)], env=env) for i in range(n)]
    pushes, subs = [], []
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
        router = Router(list(range(n)), "cost")
        docs = [[5 + d] * 4 + list(range(10, 10 + 4 * 5)) for d in range(2)]  # two 24-token documents
        prompts = [docs[k % 2] + [30 + k, 31 + k, 32 + k] for k in range(6)]  # questions about each
        placed, results = [], []
        for k, prompt in enumerate(prompts):
            decision = router.route(request_hashes(prompt, BS), [0.0] * n)
            i = decision.replica
            placed.append(i)
            pushes[i].send(msgspec.msgpack.encode([f"r{k}", prompt, 4]))
            assert pull.poll(120_000), "a replica did not answer"
            index, rid, output, cached, next_seq, held, _ = msgspec.msgpack.decode(pull.recv())
            assert (index, rid) == (i, f"r{k}")
            results.append((output, cached, decision.match.gpu))
            deadline = time.monotonic() + 30
            while subs[i].next_seq < next_seq:  # the events this request caused, before the next route
                assert time.monotonic() < deadline, "events did not arrive"
                for _, batch in subs[i].poll(100):
                    router.index.apply(i, batch)
            assert router.index.state(i).get(GPU, set()) == set(held)  # the index is the replica's cache
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

        ref = Engine(tiny_model("llama", 0), None, EngineConfig(num_blocks=48, block_size=BS, enable_prefix_caching=False))
        expected = [o.output_token_ids for o in ref.generate(prompts, SamplingParams(max_new_tokens=4))]
        assert [o for o, _, _ in results] == expected
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
