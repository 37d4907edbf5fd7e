"""Two pagedkv replicas on a local Ray cluster (one per module: Ray Serve's start-up stays out of other tests),
sharing a test-started Redis, behind one OpenAI ingress and PagedKVRequestRouter. Tiny CPU model, 4-token
blocks; 40-token documents are 10 blocks."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from redis_support import private_redis

ray = pytest.importorskip("ray", reason="ray[serve] is not installed (the `ray` extra)")

from pagedkv.engine.params import SamplingParams  # noqa: E402
from pagedkv.events import GPU  # noqa: E402
from pagedkv.router.live import LiveRouter  # noqa: E402
from pagedkv.router.replica_stats import ReplicaStats  # noqa: E402
from pagedkv.serve.ray_app import Deployed, ReplicaSet, running  # noqa: E402
from pagedkv.serve.replica_calls import ReplicaRequest, ReplicaTarget  # noqa: E402

DOC = 40  # tokens: 10 blocks of 4


def document(seed: int) -> list[int]:
    return [(seed * 37 + 11 * i) % 120 + 5 for i in range(DOC)]  # the tiny vocabulary is 128


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    for server in private_redis(tmp_path_factory):
        yield server.url


@pytest.fixture(scope="module")
def app(redis_url: str) -> Iterator[Deployed]:
    spec = ReplicaSet(replicas=2, remote_url=redis_url, num_cpus=0.5, stats_period_s=0.5)
    try:
        with running(spec, num_cpus=2, app_name="pagedkv-test") as deployed:
            yield deployed
    finally:
        ray.shutdown()  # running() stops the cluster it started; this is the module's own guarantee


def ask(app: Deployed, prompt: list[int], max_tokens: int = 4) -> tuple[str, Any]:
    """One request through the replicas' handle (the same router as the ingress): (replica, final output)."""

    async def go() -> tuple[str, Any]:
        final = None
        where = ""
        gen = app.replicas.options(stream=True).generate.remote(
            ReplicaRequest(prompt, SamplingParams(max_new_tokens=max_tokens, ignore_eos=True))
        )
        async for replica, out in gen:
            where = replica
            if out.finished:
                final = out
        return where, final

    return asyncio.run(go())


def replicas(app: Deployed, n: int = 2, timeout_s: float = 60) -> dict[str, int]:
    """Replica id -> pid for `n` live replicas (other calls are spread at random over the replicas)."""
    seen: dict[str, int] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < n:
        assert time.monotonic() < deadline, f"only {len(seen)} replicas answered"
        try:
            rid, pid = app.replicas.whoami.remote().result(timeout_s=10)
            seen[rid] = pid
        except Exception:  # a replica on its way down
            time.sleep(0.2)
    return seen


def wait_for_stats(app: Deployed) -> None:
    """Ray hands the handles each replica's routing stats (its event endpoints) every 0.5 s."""
    time.sleep(1.5)


def test_shared_prefix_requests_land_on_the_replica_holding_it(app: Deployed) -> None:
    replicas(app)
    wait_for_stats(app)
    doc = document(1)
    first, out = ask(app, doc + [1, 2, 3])
    assert out.num_cached_tokens == 0
    for q in range(4):
        time.sleep(0.2)
        where, out = ask(app, doc + [10 + q, 20 + q, 30 + q])
        assert where == first  # its GPU holds the document: no load elsewhere to outweigh that
        assert out.num_cached_tokens_by_tier.get(GPU) == DOC


def test_a_group_id_over_http_reaches_the_replicas_and_the_group_computes_its_prompt_once(app: Deployed) -> None:
    """The `group_id` body field at the Ray ingress: a bad one is the single server's 400 naming it; four
    requests of one group sent together all land where the first went (the router sees its blocks on their
    way), one computes the prompt and the three others take its full blocks, with the ungrouped answer."""
    from concurrent.futures import ThreadPoolExecutor

    replicas(app)
    wait_for_stats(app)
    client = httpx.Client(base_url=app.url, timeout=120)
    body = {"model": "pagedkv", "prompt": document(40) + [9], "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    bad = client.post("/v1/completions", json={**body, "group_id": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "group_id", bad.text
    alone = client.post("/v1/completions", json={**body, "cache_salt": "alone-40"}).json()

    def member(_: int) -> dict[str, Any]:
        answer = client.post("/v1/completions", json={**body, "group_id": "rollout-40", "cache_salt": "group-40"})
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    with ThreadPoolExecutor(4) as pool:
        grouped = list(pool.map(member, range(4)))
    cached = sorted(g["usage"]["prompt_tokens_details"]["cached_tokens"] for g in grouped)
    assert cached == [0, DOC, DOC, DOC]  # 41 tokens: 10 full blocks of 4, the last token always computed
    assert {g["choices"][0]["text"] for g in grouped} == {alone["choices"][0]["text"]}


def test_the_ingress_hands_a_group_id_to_the_replicas_engine() -> None:
    """The ingress app and the replica body outside Ray (a handle that calls the replica directly): four
    requests of one group over HTTP reach the replica's engine as one group, whose step waits until all four
    are in, so the leader alone computes the prompt and the engine counts the 3 x 40 tokens the others took."""
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.hf.tiny import tiny_model
    from pagedkv.serve.app import build_app
    from pagedkv.serve.ray_app import PagedKVReplica
    from pagedkv.serve.ray_ingress import RemoteEngine

    gate = {"want": 4, "seen": 0, "deadline": time.monotonic() + 30}

    def gated_engine(remote_url: str | None) -> Engine:
        engine = Engine(tiny_model("llama", 0), None, EngineConfig(num_blocks=96, block_size=4, kv_events=True))
        add, step = engine.add_request, engine.step

        def counting_add(*args: Any, **kwargs: Any) -> str:
            gate["seen"] += 1
            return add(*args, **kwargs)

        def gated_step() -> Any:
            if gate["seen"] < gate["want"] and time.monotonic() < gate["deadline"]:
                time.sleep(0.005)
                return []
            return step()

        engine.add_request = counting_add  # type: ignore[method-assign]
        engine.step = gated_step  # type: ignore[method-assign]
        return engine

    class Call:  # a streaming handle call, answered by the replica body in this process
        def __init__(self, request: ReplicaRequest) -> None:
            self.gen = replica.generate(request)

        def __anext__(self) -> Any:
            return self.gen.__anext__()

        def cancel(self) -> None:
            asyncio.ensure_future(self.gen.aclose())

    class Handle:
        def __init__(self) -> None:
            self.generate = SimpleNamespace(remote=Call)

        def options(self, **_: Any) -> Handle:
            return self

    replica = PagedKVReplica(engine=gated_engine)
    replica.engine.publisher = SimpleNamespace(publish=lambda batch: None)  # type: ignore[assignment]
    app = build_app(RemoteEngine(Handle(), replica.describe()), model_name="pagedkv", manage_engine=False)
    body = {"model": "pagedkv", "prompt": document(50) + [9], "max_tokens": 3, "ignore_eos": True,
            "group_id": "rollout-50"}  # fmt: skip

    async def send() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as c:
            return list(await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(4))))

    try:
        answers = asyncio.run(send())
        assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
        assert gate["seen"] == 4
        cached = sorted(a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)
        assert cached == [0, DOC, DOC, DOC]
        assert replica.engine.stats().group_prefill_shared_tokens == 3 * DOC
    finally:
        replica.engine.shutdown(timeout_s=10)
        replica.publisher.close()


def test_a_killed_replica_is_restarted_while_requests_elsewhere_finish_and_redis_serves_its_prefix(
    app: Deployed,
) -> None:
    client = httpx.Client(base_url=app.url, timeout=120)
    doc = document(2)
    body = {"model": "pagedkv", "prompt": doc + [7, 8, 9], "max_tokens": 6, "ignore_eos": True}
    on_x = client.post("/v1/completions", json=body).json()
    assert on_x["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    time.sleep(0.3)
    x, _ = ask(app, doc + [1, 2, 3], max_tokens=1)  # the router sends the document where it is: x
    before = replicas(app)
    (y,) = [r for r in before if r != x]

    async def start_on_y() -> tuple[Any, Any]:
        """A long request streaming from y (the router may place a prompt nobody holds on either replica: one
        that lands on x is cancelled and another prompt sent); its stream and first item."""
        for attempt in range(20):
            gen = app.replicas.options(stream=True).generate.remote(
                ReplicaRequest(document(3 + attempt) + [4], SamplingParams(max_new_tokens=60, ignore_eos=True))
            )
            first = await gen.__anext__()
            if first[0] == y:
                return gen, first
            gen.cancel()
        raise AssertionError("the router never placed the long request on y")

    async def long_on_y(gen: Any, first: Any) -> list[Any]:  # in flight on y while x dies
        return [first] + [item async for item in gen]

    async def scenario() -> tuple[list[Any], dict[str, Any]]:
        gen, first = await start_on_y()
        task = asyncio.ensure_future(long_on_y(gen, first))
        await asyncio.sleep(0.1)
        os.kill(before[x], signal.SIGKILL)
        await asyncio.sleep(0.5)  # Ray has not replaced x yet: y is the only one, and must load from Redis
        again = await asyncio.to_thread(client.post, "/v1/completions", json=body)
        return await task, again.json()

    items, on_y = asyncio.run(scenario())
    assert items[-1][1].finished and len(items[-1][1].output_token_ids) == 60
    assert on_y["choices"][0]["text"] == on_x["choices"][0]["text"]
    assert on_y["usage"]["prompt_tokens_details"]["cached_tokens"] == DOC  # from the shared store
    after = replicas(app, timeout_s=90)  # Ray restarted x: two replicas again, a new process
    assert len(after) == 2 and before[x] not in after.values() and y in after


def test_the_router_index_equals_the_replicas_after_a_dropped_subscriber_and_a_restart(app: Deployed) -> None:
    import zmq

    router = LiveRouter(replay_timeout_ms=1000, sync_interval_s=3600)

    def follow(ids: dict[str, int]) -> None:
        for rid in ids:
            stats = app.replicas.routing_stats.remote(ReplicaTarget(rid)).result(timeout_s=10)
            router.observe(rid, stats)

    ids = replicas(app)
    follow(ids)
    try:
        a, b = sorted(ids)
        router.streams.subscriber(b)._sub.setsockopt(zmq.UNSUBSCRIBE, b"")  # b's batches are dropped for us
        for k in range(6):
            ask(app, document(10 + k) + [k], max_tokens=3)
        router.streams.subscriber(b)._sub.setsockopt(zmq.SUBSCRIBE, b"")
        ask(app, document(20) + [1], max_tokens=3)
        router.streams.check()
        assert (
            router.streams.subscriber(b).replayed > 0
        )  # what the drop cost came back through b's replay socket
        os.kill(ids[a], signal.SIGKILL)  # a restarts: the new replica is followed from its first event
        new = replicas(app, timeout_s=90)
        follow(new)
        for k in range(4):
            ask(app, document(30 + k) + [k], max_tokens=3)
        time.sleep(0.5)
        router.streams.poll()
        router.streams.check()
        for rid in new:
            held = app.replicas.kv_contents.remote(ReplicaTarget(rid)).result(timeout_s=10)
            view = {m: sorted(h) for m, h in router.index.state(rid).items()}
            assert view == held, rid
        assert a not in new and router.index.state(a) == {}  # the dead one's stream stopped answering
        assert sum(len(router.index.state(rid).get(GPU, ())) for rid in new) > 0
    finally:
        router.streams.close()


def hybrid_engine(remote_url: str | None) -> Any:
    """A hybrid replica's engine: the tiny sliding-window Gemma2 (a full and a sliding KV cache group) the
    hybrid engine tests use, 4-token blocks."""
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.hf.tiny import tiny_model

    config = EngineConfig(num_blocks=96, block_size=4, allocator="hybrid", kv_events=True, remote_url=remote_url)
    return Engine(tiny_model("gemma2", 0), None, config)


def test_a_hybrid_replica_lists_what_its_groups_hold_as_its_events_reported() -> None:
    """The replica body outside Ray: `kv_contents` of a hybrid replica equals what its KV events told."""
    from pagedkv.events.wire import AllBlocksCleared, BlockRemoved, BlockStored
    from pagedkv.serve.ray_app import PagedKVReplica

    replica = PagedKVReplica(engine=hybrid_engine)
    batches: list[Any] = []
    replica.engine.publisher = SimpleNamespace(publish=batches.append)  # type: ignore[assignment]

    async def run(prompt: list[int]) -> None:
        async for _ in replica.generate(ReplicaRequest(prompt, SamplingParams(max_new_tokens=3))):
            pass

    try:
        for seed in (4, 5):
            asyncio.run(run(document(seed) + [seed]))
    finally:
        replica.engine.shutdown(timeout_s=10)  # the loop stops: the events of its last step are in `batches`
    held: dict[int, set[int]] = {}
    for event in (e for batch in batches for e in batch.events):
        group = getattr(event, "group_idx", None) or 0
        if isinstance(event, BlockStored) and event.medium in (None, GPU):
            held.setdefault(group, set()).update(event.block_hashes)
        elif isinstance(event, BlockRemoved) and event.medium in (None, GPU):
            held.setdefault(group, set()).difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            held.clear()
    contents = replica.kv_contents(ReplicaTarget(replica.replica_id))
    stats = replica.routing_stats(ReplicaTarget(replica.replica_id))  # the hybrid manager's epoch, its pool
    sent = replica.record_routing_stats()
    replica.publisher.close()
    assert ReplicaStats.from_dict(sent) == stats and stats.block_size == 4 and stats.gauges is not None
    assert stats.num_blocks == stats.gauges.num_blocks > 0 and stats.kv_events == replica.publisher.endpoint
    assert sorted(held) == [0, 1], "the tiny Gemma2 has a full and a sliding group"
    assert contents == {GPU: sorted(set().union(*held.values()))}


def test_a_stream_the_client_left_ends_quietly_when_ray_cancels_its_call() -> None:
    """`RemoteStream.abort` cancels the replica call; the read waiting on it then ends the stream instead of
    raising Ray's RequestCancelledError into a task nobody awaits (a traceback at the ingress)."""
    from pagedkv.serve.ray_ingress import RemoteStream

    class Call:  # a streaming call as Ray's handle gives it: a pending read raises once cancelled
        def __init__(self) -> None:
            self.cancelled = asyncio.Event()

        async def __anext__(self) -> Any:
            await self.cancelled.wait()
            raise RuntimeError("Request was cancelled")

        def cancel(self) -> None:
            self.cancelled.set()

    async def scenario() -> list[Any]:
        stream = RemoteStream(Call(), "r1", on_final=lambda outputs: None)
        reader = asyncio.ensure_future(_read_all(stream))
        await asyncio.sleep(0)
        stream.abort()
        return await reader

    assert asyncio.run(scenario()) == []
    unaborted = RemoteStream(Call(), "r2", on_final=lambda outputs: None)
    unaborted._gen.cancel()  # cancelled by someone else: the error is the caller's to see
    with pytest.raises(RuntimeError):
        asyncio.run(_read_all(unaborted))


async def _read_all(stream: Any) -> list[Any]:
    return [out async for out in stream]
