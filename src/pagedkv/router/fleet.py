"""A fleet on one machine: N engine processes, one shared Redis, KV events over ZeroMQ, and a router.

    python -m pagedkv.router.fleet --replicas 2          # a demo with the tiny CPU model and its own redis-server

Each replica is a process (`serve_replica`) running an `Engine` built by a factory (`"module:function"`,
called with the shared `remote_url`; the default `tiny_engine` is a seeded tiny Llama with 4-token blocks) with
`EngineConfig(kv_events=True)`. It takes requests on a PULL socket `ipc://{folder}/req{i}` (msgpack
`[request id, prompt ids, max new tokens]`), serves each to completion, publishes `engine.take_event_batch()`
after every step on `ipc://{folder}/pub{i}` (replay: `ipc://{folder}/replay{i}`, see
`pagedkv.events.publisher`) and answers on `ipc://{folder}/out`.

`Fleet` is the router's side: it starts the replicas, subscribes to their events, keeps a
`pagedkv.router.Router` fed with them, and for each request picks a replica (`route`), sends it (`run`), and
folds in every event the request caused before returning, so the next decision sees it. `loads` is the queued
work per replica, in blocks, as the caller measures it (requests here run one at a time: pass a load to model a
replica that is busy). Replicas sharing a store must load the same weights under the same model id (the store
keys carry a fingerprint of both).

This module, unlike the rest of `pagedkv.router`, loads the engine (and so torch) in the replica processes;
`pagedkv.router` itself never imports it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import zmq

from pagedkv.core.errors import InvalidArgumentError, PagedKVError
from pagedkv.core.manager import PagedKVManager
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.events import external_hash
from pagedkv.events.publisher import EventSubscriber, ZmqEventPublisher
from pagedkv.router import Router, request_hashes

DEFAULT_FACTORY = "pagedkv.router.fleet:tiny_engine"


def tiny_engine(remote_url: str | None) -> Engine:
    """The demo and test replica: a tiny Llama with seeded weights (identical in every process) on the CPU."""
    from pagedkv.hf.tiny import tiny_model

    config = EngineConfig(num_blocks=48, block_size=4, kv_events=True, remote_url=remote_url)
    return Engine(tiny_model("llama", 0), None, config)


def load_factory(spec: str) -> Any:
    module, _, name = spec.partition(":")
    if not module or not name:
        raise InvalidArgumentError(f"an engine factory is 'module:function', got {spec!r}")
    return getattr(importlib.import_module(module), name)


def serve_replica(
    folder: str, index: int, factory: str = DEFAULT_FACTORY, remote_url: str | None = None
) -> None:
    """A replica process's loop (returns when it receives a request id of None)."""
    engine: Engine = load_factory(factory)(remote_url)
    if engine.kv_events is None:
        raise InvalidArgumentError("a fleet replica's engine needs EngineConfig(kv_events=True)")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    pub = ZmqEventPublisher(f"ipc://{folder}/pub{index}", f"ipc://{folder}/replay{index}", context=ctx)
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{folder}/req{index}")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"ipc://{folder}/out")
    push.send(msgspec.msgpack.encode([index, None, engine.config.block_size]))
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
            assert result is not None, "fleet replica: the request ended without an output"
            assert isinstance(engine.manager, PagedKVManager), "fleet: kv_events needs the paged manager"
            held = sorted(external_hash(k) for k in engine.manager.index.all_keys())
            push.send(msgspec.msgpack.encode([
                index, rid, [result.output_token_ids, result.num_cached_tokens, result.num_cached_tokens_by_tier,
                             pub.next_seq, held],
            ]))  # fmt: skip
    finally:
        engine.close()
        pub.close()
        pull.close(linger=0)
        push.close(linger=1000)


class Result(NamedTuple):
    """One request's answer: the replica that served it, its output ids, its prompt tokens not computed (all
    media, and by medium), and the replica's GPU hashes right after it (to compare with the router's index)."""

    replica: int
    output_token_ids: list[int]
    num_cached_tokens: int
    num_cached_tokens_by_tier: dict[str, int]
    gpu_hashes: list[int]


class Fleet:
    def __init__(
        self,
        num_replicas: int,
        *,
        remote_url: str | None = None,
        policy: str = "cost",
        factory: str = DEFAULT_FACTORY,
        folder: str | None = None,
        env: dict[str, str] | None = None,
        start_timeout_s: float = 120.0,
    ) -> None:
        if num_replicas < 1:
            raise InvalidArgumentError(f"a fleet needs at least one replica, got {num_replicas}")
        self._tmp = tempfile.TemporaryDirectory(prefix="pagedkv-fleet-") if folder is None else None
        self.folder = folder if folder is not None else self._tmp.name  # type: ignore[union-attr]
        self.timeout_ms = int(start_timeout_s * 1000)
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(f"ipc://{self.folder}/out")
        self._pushes: list[Any] = []
        self._subs: list[EventSubscriber] = []
        self._ids = 0
        cmd = [sys.executable, "-m", "pagedkv.router.fleet", "--serve-replica", self.folder]
        self._procs = [
            subprocess.Popen([*cmd, str(i), factory, remote_url or ""], env=env) for i in range(num_replicas)
        ]
        try:
            sizes: dict[int, int] = {}
            while len(sizes) < num_replicas:
                if not self._pull.poll(self.timeout_ms):
                    raise PagedKVError("a replica process did not start (see its stderr)")
                index, _, block_size = msgspec.msgpack.decode(self._pull.recv())
                sizes[index] = block_size
            if len(set(sizes.values())) != 1:
                raise InvalidArgumentError(f"replicas disagree on the block size: {sizes}")
            self.block_size = sizes[0]
            for i in range(num_replicas):
                push = self._ctx.socket(zmq.PUSH)
                push.connect(f"ipc://{self.folder}/req{i}")
                self._pushes.append(push)
                self._subs.append(
                    EventSubscriber(
                        f"ipc://{self.folder}/pub{i}", f"ipc://{self.folder}/replay{i}", context=self._ctx
                    )
                )
        except BaseException:
            self.close()
            raise
        self.router = Router(list(range(num_replicas)), policy)

    @property
    def num_replicas(self) -> int:
        return len(self._procs)

    def hashes(self, prompt: Sequence[int]) -> list[int]:
        return request_hashes(list(prompt), self.block_size)

    def route(self, prompt: Sequence[int], loads: Sequence[float] | None = None) -> Any:
        """The router's `Decision` for a prompt (replica and its `PrefixMatch`), from the events so far."""
        return self.router.route(
            self.hashes(prompt), list(loads) if loads is not None else [0.0] * self.num_replicas
        )

    def run(self, replica: int, prompt: Sequence[int], max_new_tokens: int = 16) -> Result:
        """Serve one request on `replica`; returns after the router's index holds every event it caused."""
        if not 0 <= replica < self.num_replicas:
            raise InvalidArgumentError(f"replica must be in [0, {self.num_replicas}), got {replica}")
        rid = f"f{self._ids}"
        self._ids += 1
        self._pushes[replica].send(msgspec.msgpack.encode([rid, list(prompt), max_new_tokens]))
        if not self._pull.poll(self.timeout_ms):
            raise PagedKVError(f"replica {replica} did not answer request {rid}")
        index, got, (output, cached, by_tier, next_seq, held) = msgspec.msgpack.decode(self._pull.recv())
        if (index, got) != (replica, rid):
            raise PagedKVError(f"expected {rid} from replica {replica}, got {got} from {index}")
        deadline = time.monotonic() + self.timeout_ms / 1000
        sub = self._subs[replica]
        while sub.next_seq < next_seq:
            if time.monotonic() > deadline:
                raise PagedKVError(f"replica {replica}'s events up to {next_seq} did not arrive")
            for _, batch in sub.poll(100):
                self.router.index.apply(replica, batch)
        return Result(replica, output, cached, by_tier, held)

    def submit(
        self, prompt: Sequence[int], max_new_tokens: int = 16, loads: Sequence[float] | None = None
    ) -> Result:
        """Route, then run."""
        return self.run(self.route(prompt, loads).replica, prompt, max_new_tokens)

    def close(self) -> None:
        for push in self._pushes:
            push.send(msgspec.msgpack.encode([None, [], 0]))
        for p in self._procs:
            try:
                p.wait(timeout=60 if self._pushes else 5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for s in self._subs:
            s.close()
        for push in self._pushes:
            push.close(linger=0)
        self._pushes, self._subs = [], []
        self._pull.close(linger=0)
        self._ctx.term()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _demo(args: argparse.Namespace) -> int:
    from pagedkv.tiers.redis_server import RedisServer

    server, tmp = None, None
    url = args.remote_url
    if url is None:
        tmp = tempfile.TemporaryDirectory(prefix="pagedkv-redis-")
        server = RedisServer(folder=Path(tmp.name))
        server.start()
        url = server.url
    try:
        with Fleet(args.replicas, remote_url=url, policy=args.router, factory=args.engine) as fleet:
            doc = list(range(20, 60))  # a shared 40-token document
            prompts = [doc + [100 + k, 101 + k] for k in range(args.requests)]
            print(f"{args.replicas} replicas, router {args.router}, store {url}")
            print("request  replica  busy  cached (GPU/CPU/DISK/REMOTE)  output")
            for k, prompt in enumerate(prompts):
                busy = k % args.replicas  # pretend one replica is loaded in turn: the prefix must travel
                loads = [8.0 if i == busy else 0.0 for i in range(args.replicas)]
                r = fleet.submit(prompt, args.max_new_tokens, loads)
                t = r.num_cached_tokens_by_tier
                tiers = "/".join(str(t.get(m, 0)) for m in ("GPU", "CPU", "DISK", "REMOTE"))
                print(
                    f"{k:7d}  {r.replica:7d}  {busy:4d}  {r.num_cached_tokens:6d} ({tiers})  {r.output_token_ids}"
                )
    finally:
        if server is not None:
            server.stop()
        if tmp is not None:
            tmp.cleanup()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--serve-replica"]:
        folder, index, factory, url = argv[1:5]
        serve_replica(folder, int(index), factory, url or None)
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m pagedkv.router.fleet", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--router", choices=("round-robin", "prefix", "cost"), default="cost")
    parser.add_argument(
        "--remote-url", default=None, help="shared Redis (default: start a private redis-server)"
    )
    parser.add_argument("--engine", default=DEFAULT_FACTORY, help="replica engine factory, module:function")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    args = parser.parse_args(argv)
    try:
        return _demo(args)
    except PagedKVError as e:
        print(f"fleet: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())
