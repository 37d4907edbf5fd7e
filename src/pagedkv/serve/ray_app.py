"""`pagedkv serve --replicas N`: N engine replicas on Ray Serve behind one OpenAI ingress and a KV-aware router.

    ingress (1 replica, FastAPI: the same OpenAI routes as `pagedkv serve`; `pagedkv.serve.ray_ingress`)
        | DeploymentHandle, streaming; the handle's router is PagedKVRequestRouter (pagedkv.serve.ray_router)
        v
    PagedKVReplica x N   each: an Engine(kv_events=True) in an AsyncEngine, a ZMQ publisher of its KV events,
                         record_routing_stats() = where its events are + its sizes and load; all share the Redis
                         tier when --remote-url is given

As a library (a local cluster by default; `address="ray://..."` or `"auto"` joins one):

    from pagedkv.serve.ray_app import ReplicaSet, build_application
    app = build_application(ReplicaSet(replicas=2, engine="pagedkv.serve.ray_app:tiny_engine",
                                       remote_url="redis://10.0.0.5:6379/0"))
    serve.run(app, name="pagedkv", route_prefix="/")

A replica's engine comes from a factory `"module:function"`, called in the replica's process with the store
URL (or None) and returning an `Engine` built with `kv_events=True`; replicas sharing a store must load the
same weights under the same model id. `tiny_engine` is the CPU demo/test replica (a seeded tiny Llama).
Ray restarts a replica whose actor dies or whose `check_health` fails (the engine loop stopped); the router
follows the new one from its first event. Routers (`router=`): `pagedkv` (default), `prefix-affinity` (Ray's
`PrefixCacheAffinityRouter`, which matches prompt text: `ReplicaRequest.prompt` is one character per token),
`pow2` (Ray's default power of two choices).

`running(spec)` is `ray_cluster` (the connected Ray, or one it starts and later stops) around `serve_app`
(deploys; on exit deletes the app, each replica finishing what is in flight for `spec.drain_timeout_s`).
"""

from __future__ import annotations

import importlib
import ipaddress
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.outputs import RequestOutput
from pagedkv.events.publisher import ZmqEventPublisher
from pagedkv.router.replica_stats import EngineGauges, ReplicaStats
from pagedkv.serve.async_engine import AsyncEngine, launch
from pagedkv.serve.replica_calls import ReplicaRequest, ReplicaTarget, WrongReplicaError

ROUTERS = ("pagedkv", "prefix-affinity", "pow2")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
TINY_ENGINE = "pagedkv.serve.ray_app:tiny_engine"
TINY_THREADS = 1


def tiny_engine(remote_url: str | None) -> Any:
    """The demo and test replica: a tiny Llama with seeded weights (the same in every process), CPU, 4-token
    blocks, one torch thread (a 64-wide model gains nothing from more; the replicas share the machine)."""
    from pagedkv.engine.cli_args import use_threads
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.hf.tiny import tiny_model

    use_threads(TINY_THREADS)
    config = EngineConfig(num_blocks=96, block_size=4, kv_events=True, remote_url=remote_url)
    return Engine(tiny_model("llama", 0), None, config)


def load_factory(spec: Any) -> Any:
    """The engine factory `spec` names ("module:function"), or `spec` itself if it is callable."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise InvalidArgumentError(f"an engine factory is 'module:function' or a callable, got {spec!r}")
    module, _, name = spec.partition(":")
    if not module or not name:
        raise InvalidArgumentError(f"an engine factory is 'module:function', got {spec!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise InvalidArgumentError(f"cannot load the engine factory {spec!r}: {err}") from None


class _PublishingEngine(AsyncEngine):
    """An AsyncEngine that publishes the engine's KV events on its own thread after every step."""

    publisher: ZmqEventPublisher | None = None

    def after_step(self) -> None:
        if self.publisher is not None:  # the events first: a client that sees its answer finds them routed
            batch = self.engine.take_event_batch()
            if batch is not None:
                self.publisher.publish(batch)


class PagedKVReplica:
    """The body of one replica (`build_application` makes it a deployment)."""

    def __init__(
        self, engine: str = TINY_ENGINE, remote_url: str | None = None, max_waiting: int = 1024
    ) -> None:
        def build() -> tuple[_PublishingEngine, Any]:
            built = load_factory(engine)(remote_url)
            if getattr(built, "kv_events", None) is None:
                raise InvalidArgumentError(
                    f"the engine from {engine!r} records no KV events: build it with kv_events=True"
                )
            return _PublishingEngine(built, max_waiting=max_waiting), built.config.hash_fn

        host = os.environ.get("PAGEDKV_EVENTS_HOST") or _node_ip()
        self.publisher = ZmqEventPublisher(f"tcp://{host}:*", f"tcp://{host}:*")
        try:
            self.engine, self.hash_fn = launch(build)  # loaded on the thread that steps it (one OpenMP team)
        except BaseException:
            self.publisher.close()
            raise
        self.engine.publisher = self.publisher
        self.replica_id = _replica_id()

    async def generate(self, request: ReplicaRequest) -> AsyncIterator[tuple[str, RequestOutput]]:
        """The request's outputs as they come, each tagged with this replica's id."""
        async for out in self.engine.generate(
            request.prompt_token_ids, request.params, request_id=request.request_id,
            cache_salt=request.cache_salt, priority=request.priority, group_id=request.group_id,
        ):  # fmt: skip
            yield self.replica_id, out

    async def lifecycle(self, target: ReplicaTarget, verb: str, args: dict[str, Any]) -> dict[str, Any] | None:
        """Run a lifecycle verb (`pagedkv.serve.lifecycle_routes.VERBS`) on this replica's engine if it is the
        named one: {"replica", "status" (HTTP), "body" (the single server's JSON answer)}; None if the call
        reached another replica (the ingress sends it again)."""
        from pagedkv.serve.error_bodies import APIError
        from pagedkv.serve.lifecycle_routes import apply_verb

        if target.replica != self.replica_id:
            return None
        try:
            body = await apply_verb(self.engine, verb, args)
        except APIError as err:
            return {"replica": self.replica_id, "status": err.status, "body": err.body()}
        return {"replica": self.replica_id, "status": 200, "body": body}

    def whoami(self) -> tuple[str, int]:
        """(replica id, process id)."""
        return self.replica_id, os.getpid()

    def record_routing_stats(self) -> dict[str, Any]:
        """`routing_message()` as Ray carries it (plain JSON types)."""
        return self.routing_message().as_dict()

    def routing_message(self) -> ReplicaStats:
        """Where this replica's events are, how it names its blocks, its pool and its load."""
        s = self.engine.stats()
        gauges = EngineGauges(s.num_running, s.num_waiting, s.num_swapped, s.num_used_blocks, s.num_blocks)
        return ReplicaStats(
            kv_events=self.publisher.endpoint, kv_replay=self.publisher.replay_endpoint,
            incarnation=self.publisher.first_seq, block_size=self.engine.model_facts.block_size,
            hash_fn=self.hash_fn, epoch=s.kv_epoch,
            num_blocks=s.num_blocks, free_blocks=s.num_blocks - s.num_used_blocks, num_running=s.num_running,
            num_waiting=s.num_waiting + self.engine.num_waiting(), gauges=gauges,
        )  # fmt: skip

    def __del__(self) -> None:
        """Ray Serve's graceful stop: abort what is in flight, stop the engine loop, close its tiers and the
        event sockets."""
        engine, publisher = getattr(self, "engine", None), getattr(self, "publisher", None)
        if engine is not None:
            engine.shutdown(timeout_s=5.0)
        if publisher is not None:
            publisher.close()

    def routing_stats(self, target: ReplicaTarget) -> ReplicaStats:
        """`routing_message` of the named replica (for a router outside Ray's handles, and tests)."""
        self._check(target)
        return self.routing_message()

    def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError("the engine loop stopped")

    def describe(self) -> dict[str, Any]:
        """What the ingress needs to serve the OpenAI routes for this model."""
        facts = self.engine.model_facts
        return {
            "tokenizer": self.engine.tokenizer, "model_facts": facts, "pid": os.getpid(),
            "replica": self.replica_id, "weight_version": self.engine.weight_version,
        }  # fmt: skip

    def kv_contents(self, target: ReplicaTarget) -> dict[str, list[int]]:
        """The hashes this replica can serve, per medium (the GPU from the manager itself, the others from the
        event log: what the tiers reported). For tests; read while the replica is idle."""
        self._check(target)
        return self.engine.kv_contents()

    def kill(self, target: ReplicaTarget) -> None:
        """Die at once, as a crash would (tests: Ray must restart the replica)."""
        self._check(target)
        os._exit(1)

    def _check(self, target: ReplicaTarget) -> None:
        if target.replica != self.replica_id:
            raise WrongReplicaError(f"this is replica {self.replica_id}, not {target.replica}")


def _replica_id() -> str:
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # not inside a Serve replica
        return f"pid{os.getpid()}"


def _node_ip() -> str:
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:  # not inside Ray: loopback
        return "127.0.0.1"


@dataclass(frozen=True)
class ReplicaSet:
    """What `build_application` deploys (validated here, before Ray starts anything)."""

    replicas: int = 2
    engine: Any = TINY_ENGINE  # "module:function", or a picklable callable(remote_url) -> Engine
    remote_url: str | None = None
    router: str = "pagedkv"
    model_name: str = "pagedkv"
    api_key: str | None = None
    num_cpus: float = 1.0
    max_ongoing_requests: int = 64
    stats_period_s: float = 1.0
    router_kwargs: dict[str, Any] = field(default_factory=dict)
    drain_timeout_s: float = 30.0  # on delete, a replica finishes what is in flight for up to this long
    log_level: str = "warning"  # of Serve's controller, proxy and replicas (access lines at info and debug)

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise InvalidArgumentError(f"replicas must be an int >= 1, got {self.replicas!r}")
        if self.router not in ROUTERS:
            raise InvalidArgumentError(f"unknown router {self.router!r}; choose one of {', '.join(ROUTERS)}")
        if self.num_cpus < 0 or self.max_ongoing_requests < 1 or self.stats_period_s <= 0:
            raise InvalidArgumentError("num_cpus must be >= 0, max_ongoing_requests >= 1, stats_period_s > 0")
        if self.drain_timeout_s < 0:
            raise InvalidArgumentError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s!r}")
        if self.log_level not in LOG_LEVELS:
            raise InvalidArgumentError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        load_factory(self.engine)  # a bad factory is one line here, not a crash loop in every replica


def serve_logging(log_level: str) -> dict[str, Any]:
    """Serve's logging config for `log_level` (one of LOG_LEVELS): a line per request only at info and debug."""
    return {"log_level": log_level.upper(), "enable_access_log": log_level in ("info", "debug")}


def router_class(name: str) -> Any:
    if name == "pagedkv":
        from pagedkv.serve.ray_router import PagedKVRequestRouter

        return PagedKVRequestRouter
    if name == "prefix-affinity":
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
            PrefixCacheAffinityRouter,
        )

        return PrefixCacheAffinityRouter
    from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter

    return PowerOfTwoChoicesRequestRouter


def build_application(spec: ReplicaSet) -> Any:
    """The Ray Serve application: the ingress bound to N replicas (deploy it with `serve.run`)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    config = RequestRouterConfig(
        request_router_class=router_class(spec.router), request_router_kwargs=dict(spec.router_kwargs),
        request_routing_stats_period_s=spec.stats_period_s, request_routing_stats_timeout_s=10.0,
    )  # fmt: skip
    stopping: dict[str, Any] = {"graceful_shutdown_timeout_s": spec.drain_timeout_s, "graceful_shutdown_wait_loop_s": 0.5,
                "logging_config": serve_logging(spec.log_level)}  # fmt: skip
    replica = serve.deployment(
        PagedKVReplica, name="PagedKVReplica", num_replicas=spec.replicas,
        ray_actor_options={"num_cpus": spec.num_cpus}, request_router_config=config,
        max_ongoing_requests=spec.max_ongoing_requests, health_check_period_s=1.0, health_check_timeout_s=30.0,
        **stopping,
    )  # fmt: skip
    from pagedkv.serve.ray_ingress import OpenAIIngress

    ingress = serve.deployment(
        serve.ingress()(OpenAIIngress), name="OpenAIIngress", ray_actor_options={"num_cpus": 0}, **stopping
    )
    return ingress.bind(replica.bind(spec.engine, spec.remote_url), spec.model_name, spec.api_key)


@dataclass(frozen=True)
class Deployed:
    """A running application: its OpenAI base URL and a handle to its replicas (routed like the ingress's)."""

    url: str
    replicas: Any
    app_name: str


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


LOOPBACK = ("127.0.0.1", "localhost", "::1")
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's single-machine cluster, on the loopback


def check_port(host: str, port: int) -> None:
    """One line (`InvalidArgumentError`) if nothing can listen on `host:port` (port 0: any free port can)."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            raise InvalidArgumentError(f"cannot listen on {host}:{port}: {err.strerror}") from None


@contextmanager
def ray_cluster(
    address: str | None = None, *, num_cpus: int | None = None, host: str = "127.0.0.1", log_level: str = "warning"
) -> Iterator[bool]:  # fmt: skip
    """Ray for `running`; yields whether this call started it (then it shuts it down on exit). The cluster
    this process is connected to, else `ray.init(address)`: None starts a local cluster of `num_cpus` whose
    servers listen on `host` as far as Ray allows (Ray turns a loopback node address into the machine's
    address, so for a loopback `host` it starts as Ray's single-machine cluster, LOCAL_ONLY_ENV=0, which
    works only before `ray` is first imported in this process; another host becomes the node's address,
    where Ray's gRPC servers still listen on every interface); "auto" or "ray://HOST:PORT" joins one.
    Ray logs at `log_level` (LOG_LEVELS) in this process; its workers' lines reach it through Serve's
    logging config (`serve_logging`)."""
    local_only = address is None and host in LOOPBACK and "ray" not in sys.modules and LOCAL_ONLY_ENV not in os.environ
    if local_only:
        os.environ[LOCAL_ONLY_ENV] = "0"
    try:
        import ray

        started = not ray.is_initialized()
        if started:
            env = {"env_vars": {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0")}}
            node: dict[str, Any] = {"_node_ip_address": host} if address is None and _is_address(host) and not local_only else {}
            ray.init(address=address, num_cpus=num_cpus, include_dashboard=False, dashboard_host=host,
                     runtime_env=env, logging_level=getattr(logging, log_level.upper()), **node)  # fmt: skip
        from ray import serve

        logging.getLogger("ray.serve").setLevel(log_level.upper())  # `import ray.serve` set it to INFO
        try:
            yield started
        finally:
            if started:
                serve.shutdown()
                ray.shutdown()
    finally:
        if local_only:
            os.environ.pop(LOCAL_ONLY_ENV, None)


def _is_address(host: str) -> bool:
    """An IP address of one interface (not a name, not a wildcard such as 0.0.0.0)."""
    try:
        return not ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


@contextmanager
def serve_app(spec: ReplicaSet, *, host: str = "127.0.0.1", port: int = 0, app_name: str = "pagedkv") -> Iterator[Deployed]:
    """Deploy `spec` on the Ray this process is connected to, with Serve's HTTP proxy on `host:port` (0: a
    free port), and yield it; on exit delete the app: each replica first finishes what is in flight, for up
    to `spec.drain_timeout_s`."""
    from ray import serve

    port = port or free_port(host)
    serve.start(http_options={"host": host, "port": port}, logging_config=serve_logging(spec.log_level))
    serve.run(build_application(spec), name=app_name, route_prefix="/")
    try:
        yield Deployed(f"http://{host}:{port}", serve.get_deployment_handle("PagedKVReplica", app_name), app_name)
    finally:
        serve.delete(app_name)


@contextmanager
def running(
    spec: ReplicaSet, *, address: str | None = None, num_cpus: int | None = None, host: str = "127.0.0.1",
    port: int = 0, app_name: str = "pagedkv",
) -> Iterator[Deployed]:  # fmt: skip
    """Deploy `spec` and yield it; undo on exit what this call started (the app; Serve and Ray if it started
    them): `ray_cluster` then `serve_app`."""
    with ray_cluster(address, num_cpus=num_cpus, host=host, log_level=spec.log_level), serve_app(
        spec, host=host, port=port, app_name=app_name
    ) as deployed:
        yield deployed
