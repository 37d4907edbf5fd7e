"""One engine replica in its own process (tiny model, CPU) for the multi-process router test.

    python replica_worker.py DIR INDEX [REMOTE_URL]

It serves requests arriving on a ZMQ PULL socket `ipc://DIR/req{INDEX}` (msgpack `[id, prompt, max_new]`),
runs them on a real `Engine` built with `EngineConfig(kv_events=True)` (and a Redis tier shared with the other
replicas when REMOTE_URL is given), and after every engine step publishes `engine.take_event_batch()` (every
medium's events) on `ipc://DIR/pub{INDEX}` (replay: `.../replay{INDEX}`). Each result goes back on a PUSH socket
`ipc://DIR/out` as `[index, id, output ids, cached tokens, next seq, sorted GPU hashes, cached tokens by
tier]`, so the router can wait for the events that request caused before routing the next one and can compare
its index with the replica's real state. `[None, ...]` stops the worker.
"""

from __future__ import annotations

import sys

import msgspec
import zmq

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.events import external_hash
from pagedkv.events.publisher import ZmqEventPublisher
from pagedkv.hf.tiny import tiny_model

BLOCK_SIZE = 4


def main(folder: str, index: int, remote_url: str | None = None) -> None:
    config = EngineConfig(num_blocks=48, block_size=BLOCK_SIZE, kv_events=True, remote_url=remote_url)
    engine = Engine(tiny_model("llama", 0), None, config)
    ctx = zmq.Context.instance()
    pub = ZmqEventPublisher(f"ipc://{folder}/pub{index}", f"ipc://{folder}/replay{index}", context=ctx)
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{folder}/req{index}")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"ipc://{folder}/out")
    push.send(msgspec.msgpack.encode([index, "ready", [], 0, 0, [], {}]))
    try:
        while True:
            rid, prompt, max_new = msgspec.msgpack.decode(pull.recv())
            if rid is None:
                break
            engine.add_request(prompt, SamplingParams(max_new_tokens=max_new), request_id=rid)
            result = None
            while engine.has_unfinished():
                for out in engine.step():
                    result = out
                batch = engine.take_event_batch()
                if batch is not None:
                    pub.publish(batch)
            assert result is not None
            held = sorted(external_hash(k) for k in engine.manager.pool.index)
            push.send(msgspec.msgpack.encode(
                [index, rid, result.output_token_ids, result.num_cached_tokens, pub.next_seq, held,
                 result.num_cached_tokens_by_tier]
            ))  # fmt: skip
    finally:
        engine.close()
        pub.close()
        pull.close(linger=0)
        push.close(linger=1000)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
