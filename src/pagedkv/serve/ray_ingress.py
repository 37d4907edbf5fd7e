"""The ingress of `pagedkv serve --replicas N`: `build_app`'s OpenAI routes over the replicas' handle.

    client --HTTP--> Serve's proxy --> OpenAIIngress (FastAPI: `pagedkv.serve.app.build_app`)
                                          RemoteEngine: add_request -> handle.generate (streaming), routed
                                          by the handle's request router -> a PagedKVReplica (ray_app)

`RemoteEngine` is the ingress's `EngineClient` (`pagedkv.serve.engine_client`) for `build_app`; its streams (`RemoteStream`) are what
`pagedkv.serve.fanout` reads, and a client that leaves cancels its replica call. `/metrics` is the
ingress's own request counters and histograms (`IngressMetrics`), with the engine gauges summed over the
replicas' latest routing stats, under the single server's names. The RL lifecycle verbs (`/pause`,
`/update_weights`, ...: `pagedkv.serve.lifecycle_routes`) are broadcast to every replica by directed calls
(`RemoteEngine.broadcast`, docs/rl.md).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from pagedkv.core.errors import EngineStateError
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.router.replica_stats import ReplicaStats
from pagedkv.serve.engine_client import ModelFacts
from pagedkv.serve.error_bodies import APIError, unavailable
from pagedkv.serve.metrics import ServerMetrics
from pagedkv.serve.replica_calls import ReplicaRequest, ReplicaTarget

DIRECTED_TRIES = 32


def own_routing_id() -> None:
    """Give the next handle calls of this task their own internal request id. Ray takes it from the serve
    request context, so every call an HTTP request makes shares it, and Ray's router matches a chosen replica
    to its call by that id: two calls in flight at once with one id leave the second unmatched, its routing
    loop spinning (Ray 2.60's private `_set_request_context`; nothing if it moved)."""
    try:
        from ray.serve.context import _set_request_context

        _set_request_context(_internal_request_id=uuid.uuid4().hex)
    except (ImportError, TypeError):
        pass


def ray_request_router(handle: Any) -> Any:
    """The request router behind `handle` in this process (Ray 2.60 keeps it behind private attributes of
    the handle: None if they moved)."""
    router = getattr(getattr(handle, "_router", None), "_asyncio_router", None)
    return getattr(router, "_request_router", None)


class RemoteStream:
    """One request's outputs streamed from a replica; the interface `pagedkv.serve.fanout` expects."""

    def __init__(self, gen: Any, request_id: str, on_final: Any) -> None:
        self._gen = gen
        self.request_id = request_id
        self._on_final = on_final
        self._finals: list[RequestOutput] = []
        self.replica: str | None = None  # the replica serving it, once its first output came
        self.done = False
        self._aborted = False

    def __aiter__(self) -> RemoteStream:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            self.replica, out = await self._gen.__anext__()
        except StopAsyncIteration:
            self.done = True
            if self._finals:
                self._on_final(self._finals)
            raise
        except Exception:
            if self._aborted:  # the call `abort` cancelled (Ray's RequestCancelledError): the stream just ends
                raise StopAsyncIteration from None
            raise
        if out.finished:
            self._finals.append(out)
        return out

    def abort(self) -> None:
        if not self.done:
            self.done = True
            self._aborted = True
            self._gen.cancel()


class RemoteEngine:
    """The ingress's `EngineClient`: requests go to the replicas through a Ray handle (the handle's request
    router picks the replica); the lifecycle verbs go to every replica (`broadcast`)."""

    def __init__(self, handle: Any, info: dict[str, Any]) -> None:
        self.handle = handle.options(stream=True)
        self.tokenizer = info["tokenizer"]
        self.model_facts: ModelFacts = info["model_facts"]
        self.metrics: ServerMetrics | None = None
        self.alive = True
        self._ids = 0
        self._unary = handle  # directed calls (the lifecycle verbs)
        self.versions: dict[str, str] = {}  # replica -> its weight version, as its last answer said
        if "replica" in info:
            self.versions[info["replica"]] = info["weight_version"]
        self.refusing: str | None = (
            None  # why the replicas refuse requests (paused, asleep), as they last said
        )

    @property
    def weight_version(self) -> str:
        """The replicas' weight version as their last answers said; "mixed" when they differ."""
        known = set(self.versions.values())
        return known.pop() if len(known) == 1 else "mixed" if known else "unknown"

    def replica_ids(self) -> list[str]:
        """The replicas Ray runs now, as this process's request router knows them (Ray 2.60 keeps it behind
        private attributes: the replicas that answered before, if it moved)."""
        replicas = getattr(ray_request_router(self._unary), "curr_replicas", None)
        try:
            ids = sorted(str(r.unique_id) for r in list(replicas or {}))
        except (RuntimeError, AttributeError):
            ids = []
        return ids or sorted(self.versions)

    async def broadcast(self, verb: str, args: dict[str, Any]) -> dict[str, Any]:
        """Run a lifecycle verb on every replica at once and answer when all have: {"replicas": [each one's
        answer, with "replica"], "weight_version"}; if one failed, the first failure's HTTP error with
        "applied" (the replicas that did apply it) and "replicas" (every answer)."""
        ids = self.replica_ids()
        if not ids:
            raise unavailable("no replica is running")
        results = await asyncio.gather(*(self._directed(rid, verb, args) for rid in ids))
        for r in results:
            version = r["body"].get("weight_version") if r["status"] == 200 else None
            if version is not None:
                self.versions[r["replica"]] = str(version)
        for gone in set(self.versions) - set(ids):
            del self.versions[gone]
        states = [r["body"] for r in results if r["status"] == 200]
        if any(b.get("paused") or b.get("sleep_level") for b in states):
            self.refusing = "the replicas are paused or asleep: POST /resume or /wake_up"
        elif len(states) == len(results) and all("paused" in b for b in states):
            self.refusing = None
        failed = [r for r in results if r["status"] != 200]
        if failed:
            raise BroadcastError(failed[0], [r["replica"] for r in results if r["status"] == 200], results)
        answers = [{"replica": r["replica"], **r["body"]} for r in results]
        return {"replicas": answers, "weight_version": self.weight_version}

    async def run_verb(self, verb: str, args: dict[str, Any]) -> dict[str, Any]:
        """A lifecycle verb on every replica (`broadcast`)."""
        return await self.broadcast(verb, args)

    async def _directed(self, replica: str, verb: str, args: dict[str, Any]) -> dict[str, Any]:
        """One replica's answer to a verb (a router that does not honour `ReplicaTarget` may send the call to
        another replica, which declines it: sent again, up to DIRECTED_TRIES times)."""
        own_routing_id()  # this task's own: the replicas' calls are routed at once
        try:
            for _ in range(DIRECTED_TRIES):
                answer = await self._unary.lifecycle.remote(ReplicaTarget(replica), verb, args)
                if answer is not None:
                    return dict(answer)
            failure = unavailable(
                f"replica {replica} could not be reached (the router sent its call elsewhere)"
            )
        except Exception as err:  # the replica died or Ray failed the call: that replica's failure
            failure = unavailable(f"replica {replica} failed: {type(err).__name__}: {err}".splitlines()[0])
        return {"replica": replica, "status": failure.status, "body": failure.body()}

    async def model_card(self) -> dict[str, Any]:
        """The ingress's `/v1/models` card fields: every replica's weight version, asked now;
        `weight_version` is theirs when they agree, else null (and `weight_versions_differ` is true)."""
        answer = await self.broadcast("lifecycle", {})
        versions = {a["replica"]: a["weight_version"] for a in answer["replicas"]}
        agreed = len(set(versions.values())) == 1
        return {"weight_version": next(iter(versions.values())) if agreed else None,
                "weight_versions": versions, "weight_versions_differ": not agreed}  # fmt: skip

    def start(self) -> None:
        self.alive = True

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self.alive = False

    def check_requests(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], cache_salt: str | None
    ) -> None:
        """Nothing: each replica's door checks the requests it gets."""

    def add_request(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, *, request_id: str | None = None,
        cache_salt: str | None = None, priority: int = 0, group_id: str | None = None,
    ) -> RemoteStream:  # fmt: skip
        if self.refusing is not None:
            raise EngineStateError(self.refusing)
        self._ids += 1
        rid = request_id or f"ingress-{os.getpid()}-{self._ids}"
        request = ReplicaRequest(list(prompt_token_ids), params, rid, cache_salt, priority, group_id)
        own_routing_id()
        return RemoteStream(self.handle.generate.remote(request), rid, self._observe)

    def _observe(self, outputs: list[RequestOutput]) -> None:
        if self.metrics is not None:
            self.metrics.observe_request(outputs)

    def replica_stats(self) -> list[ReplicaStats]:
        """Each replica's latest routing message, as this process's request router holds them (Ray refreshes
        them every `stats_period_s`; Ray 2.60 keeps the router behind private attributes: empty if it
        moved)."""
        replicas = getattr(ray_request_router(self.handle), "curr_replicas", None) or {}
        try:
            return [ReplicaStats.from_dict(r.routing_stats) for r in list(replicas.values()) if r.routing_stats]
        except RuntimeError:  # Ray's thread changed the replicas meanwhile: the next scrape reads them
            return []


class BroadcastError(APIError):
    """A verb some replica refused or failed: the first failure's status and error, with which replicas
    applied the verb (`applied`) and every replica's answer (`replicas`)."""

    def __init__(self, first: dict[str, Any], applied: list[str], results: list[dict[str, Any]]) -> None:
        error = dict(first["body"].get("error") or {})
        super().__init__(first["status"], f"replica {first['replica']}: {error.get('message', '')}",
                         type=error.get("type") or "server_error", param=error.get("param"), code=error.get("code"))  # fmt: skip
        self.applied = applied
        self.results = results

    def body(self) -> dict[str, Any]:
        replicas = [{"replica": r["replica"], "status": r["status"], **r["body"]} for r in self.results]
        return {**super().body(), "applied": self.applied, "replicas": replicas}


class IngressMetrics(ServerMetrics):
    """The ingress's metrics: its own request counters and histograms, and the engine gauges summed over
    the replicas when scraped (running and waiting requests; KV usage = blocks held / blocks, all replicas)."""

    def __init__(self, model_name: str, replica_stats: Callable[[], list[ReplicaStats]]) -> None:
        super().__init__(model_name)
        self._replica_stats = replica_stats

    def observe_replicas(self, stats: list[ReplicaStats]) -> None:
        """Set the gauges from the replicas' routing messages (their `gauges`: the single server's)."""
        m, gauges = self.model_name, [s.gauges for s in stats if s.gauges is not None]

        def total(name: str) -> int:
            return sum(int(getattr(g, name)) for g in gauges)

        self.running.labels(m).set(total("num_running"))
        self.waiting.labels(m).set(total("num_waiting"))
        self.swapped.labels(m).set(total("num_swapped"))
        blocks = total("num_blocks")
        self.kv_usage.labels(m).set(total("num_used_blocks") / blocks if blocks else 0.0)

    def exposition(self) -> bytes:
        self.observe_replicas(self._replica_stats())
        return super().exposition()


class OpenAIIngress:
    """The one ingress: `build_app`'s OpenAI routes over a `RemoteEngine`."""

    async def __init__(self, replicas: Any, model_name: str, api_key: str | None) -> None:
        self.replicas = replicas
        self.remote = RemoteEngine(replicas, await replicas.describe.remote())
        self.model_name = model_name
        self.api_key = api_key

    def __serve_build_asgi_app__(self) -> Any:
        from pagedkv.serve.app import build_app

        self.remote.metrics = IngressMetrics(self.model_name, self.remote.replica_stats)
        return build_app(self.remote, model_name=self.model_name, api_key=self.api_key, manage_engine=False)
