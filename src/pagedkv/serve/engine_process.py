"""`ProcessEngine`: the engine in a process of its own, behind the HTTP server's `EngineClient`.

```
server process (uvicorn, the routes, SSE)             engine process (`run_engine_core`)
  ProcessEngine.add_request ──door checks──> pipe ──>  command reader ──> CoreEngine: an AsyncEngine whose
      (raises at once: bad input, never fits,             (main thread)     thread steps the Engine
       overloaded, paused, dead)                                            back to back
  async for out in stream <── call_soon_threadsafe <── output reader <── pipe: the step's outputs and the
                                (one per step and loop)   (a thread)         engine snapshot, once per step
```

Why a process: the engine thread and the event loop of one process share the interpreter lock, so every
token the server streams (its JSON, its SSE frame, its HTTP write) holds up the step, and every step holds
up the streams; vLLM splits its API server from its engine core the same way. What it costs instead (a
pickle of each step's outputs, a second process) is measured against the thread in docs/benchmarks.md.

Contracts (those of `pagedkv.serve.async_engine.AsyncEngine`, which the engine process runs):

- the door is in the server process: `add_request` checks the request with the engine's `RequestIntake`
  (sent once at start-up), counts it against `max_waiting` and refuses while the engine is paused or asleep,
  before anything crosses the pipe;
- a stream yields the same `RequestOutput` snapshots as in-process (the prompt's ids are not sent back per
  token: the server restores them from the request it sent), exactly one finished output per completion;
- `abort` and a consumer that stops iterating end the request at the engine's next turn; `run_verb` runs a
  lifecycle verb (`pagedkv.serve.lifecycle_routes.apply_verb`) on the engine process and answers its body
  or raises its `APIError`;
- `stats()` is the engine's latest snapshot (sent after each turn; the server's metrics observe it);
- the engine process dies with the server: it stops when the pipe closes (the server exited, however), and
  a failure there (or a kill) ends every stream with `EngineDeadError` and turns `alive` False;
- `shutdown` aborts what is in flight, stops the engine process (terminating it after `timeout_s`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedkv.core import errors as error_types
from pagedkv.core.errors import InvalidArgumentError, PagedKVError
from pagedkv.engine.groups import PrefillGroups
from pagedkv.engine.intake import RequestIntake
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.serve.async_engine import (
    AsyncEngine,
    EngineDeadError,
    RequestStream,
    StreamEnd,
    StreamFailure,
    check_door,
    check_max_waiting,
    deliver,
    launch,
)
from pagedkv.serve.engine_client import ModelFacts
from pagedkv.serve.engine_setup import EngineFacts, load_engine
from pagedkv.serve.engine_snapshot import EngineSnapshot
from pagedkv.serve.error_bodies import APIError

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from pagedkv.engine.llm_engine import Engine
    from pagedkv.serve.metrics import ServerMetrics

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading a large model's weights from a slow disk
SHUTDOWN_S = 10.0  # the engine loop's time to end once its requests are aborted
_NO_PROMPT: list[int] = []  # what a snapshot carries across the pipe in place of its prompt's ids


@dataclass(frozen=True, slots=True)
class CoreReady:
    """The engine process's first message: what the server process needs to know of its engine."""

    facts: EngineFacts
    model_facts: ModelFacts
    intake: RequestIntake
    weight_version: str
    tokenizer: Any


@dataclass(frozen=True, slots=True)
class CoreFailed:
    """The engine could not be built: the error's class name (a `pagedkv.core.errors` class, raised again in
    the server process) and its message."""

    kind: str
    message: str

    def error(self) -> PagedKVError:
        cls = getattr(error_types, self.kind, None)
        if isinstance(cls, type) and issubclass(cls, PagedKVError):
            return cls(self.message)
        return EngineDeadError(f"the engine process failed to start: {self.kind}: {self.message}")


# --- the engine process ---------------------------------------------------------------------------------


class _CoreStream:
    """The engine process's handle of one request: its id (its outputs go down the pipe)."""

    __slots__ = ("request_id",)

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


class CoreEngine(AsyncEngine):
    """An `AsyncEngine` whose streams are across a pipe: its turns' outputs and snapshots are sent to the
    server process, and its commands come from it (`serve`)."""

    def __init__(self, engine: Engine, conn: Connection) -> None:
        self._conn = conn
        self._posting = False  # from `serve` on: the server reads `CoreReady` first
        self._send_lock = threading.Lock()
        super().__init__(engine)
        self._verb_loop = asyncio.new_event_loop()
        threading.Thread(target=self._verb_loop.run_forever, name="pagedkv-verbs", daemon=True).start()

    def serve(self) -> None:
        """Read the server's commands until it says stop or the pipe closes; then shut the engine down."""
        self._posting = True
        self.start()
        drain_s = SHUTDOWN_S
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):  # the server process is gone
                break
            kind = message[0]
            if kind == "add":
                _, rid, ids, params, salt, priority, arrival, group_id = message
                self._send("add", (_CoreStream(rid), ids, params, salt, priority, arrival, group_id))
            elif kind == "abort":
                self._send("abort", message[1])
            elif kind == "verb":
                asyncio.run_coroutine_threadsafe(self._verb(*message[1:]), self._verb_loop)
            else:  # "shutdown"
                drain_s = message[1]
                break
        self.shutdown(drain_s)

    async def _verb(self, call_id: int, verb: str, args: dict[str, Any]) -> None:
        from pagedkv.serve.lifecycle_routes import apply_verb

        try:
            status, body = 200, await apply_verb(self, verb, args)
        except APIError as err:
            status, body = err.status, err.body()
        except Exception as err:  # the engine died under the verb
            status, body = 503, APIError(503, f"{type(err).__name__}: {err}", type="server_error").body()
        self._post(("verb", call_id, status, body, self.refusing, self.weight_version))

    def _post(self, message: tuple[Any, ...]) -> None:
        if not self._posting:
            return
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock, contextlib.suppress(OSError):  # the server is gone: nobody is listening
            self._conn.send_bytes(data)

    def _run(self) -> None:
        super()._run()
        self._post(("dead", self._dead_reason() if self._failure is not None else "the engine loop was shut down"))

    def _take_snapshot(self, *, alive: bool) -> EngineSnapshot:
        snapshot = super()._take_snapshot(alive=alive)
        self._post(("snapshot", snapshot))
        return snapshot

    def _dispatch(self, batches: dict[Any, list[Any]]) -> None:
        pairs = []
        for stream, items in batches.items():
            for item in items:
                if isinstance(item, RequestOutput):
                    item.prompt_token_ids = _NO_PROMPT  # the server restores it; the engine keeps no snapshot
                elif isinstance(item, StreamEnd):
                    for out in item.outputs:
                        out.prompt_token_ids = _NO_PROMPT
            pairs.append((stream.request_id, items))
        self._post(("outputs", pairs))


def run_engine_core(conn: Connection, args: argparse.Namespace) -> None:
    """The engine process: build the engine of `pagedkv serve`'s flags, say `CoreReady` (or `CoreFailed`),
    then serve the server's commands until it stops or goes away. Signals are the server's to handle: the
    process ignores SIGINT and SIGTERM (Ctrl-C reaches the whole process group)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    def build() -> tuple[CoreEngine, EngineFacts]:
        engine, facts = load_engine(args)
        return CoreEngine(engine, conn), facts

    try:
        core, facts = launch(build)  # loaded on the thread that steps it (one OpenMP team)
    except Exception as err:  # a bad source or flag, or a model that does not load
        conn.send(CoreFailed(type(err).__name__, str(err)))
        return
    engine = core.engine
    intake = engine.intake
    model_facts = ModelFacts(engine.config.block_size, int(engine.capacity_tokens), engine.spec.max_position_embeddings)
    try:
        tokenizer = pickle.loads(pickle.dumps(engine.tokenizer))
    except Exception:  # a tokenizer that does not pickle: the server loads its own
        tokenizer = None
    conn.send(CoreReady(facts, model_facts, intake, str(engine.weight_version), tokenizer))
    core.serve()
    conn.close()


# --- the server process ---------------------------------------------------------------------------------


class ProcessEngine:
    """The server's `EngineClient` (`pagedkv.serve.engine_client`) over an engine process; see the module
    docstring. `spawn(args)` starts the process and waits until its engine is built."""

    def __init__(
        self,
        conn: Connection,
        process: Any,
        ready: CoreReady,
        tokenizer: Any,
        *,
        max_waiting: int = 1024,
        metrics: ServerMetrics | None = None,
    ) -> None:
        check_max_waiting(max_waiting)
        self._conn = conn
        self._process = process
        self.facts = ready.facts
        self.model_facts: ModelFacts = ready.model_facts
        self.intake = ready.intake
        self.weight_version = ready.weight_version
        self.tokenizer = tokenizer
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.refusing: str | None = None
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._num_waiting = 0
        self._streams: dict[str, tuple[RequestStream, list[int]]] = {}
        self._verbs: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._dead: str | None = None
        self._stopping = False
        self._snapshot = EngineSnapshot(
            alive=True, num_running=0, num_waiting=0, num_swapped=0, num_used_blocks=0,
            num_blocks=ready.facts.num_blocks, num_preemptions=0, num_steps=0, num_in_flight=0,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, name="pagedkv-engine-outputs", daemon=True)
        self._reader.start()

    @classmethod
    def spawn(
        cls, args: argparse.Namespace, *, max_waiting: int = 1024, start_timeout_s: float = START_TIMEOUT_S
    ) -> ProcessEngine:
        """Start the engine process for `pagedkv serve`'s flags and wait until it has built its engine. A bad
        source or flag raises its `PagedKVError` here (the process has exited)."""
        from pagedkv.hf.loading import check_source, load_tokenizer

        check_source(args.model)  # a bad source fails here, before a process starts
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe(duplex=True)
        process = context.Process(
            target=run_engine_core, args=(theirs, args), name="pagedkv-engine", daemon=False
        )
        process.start()
        theirs.close()
        deadline = time.monotonic() + start_timeout_s
        try:
            while not ours.poll(0.2):
                if not process.is_alive():
                    raise EngineDeadError(f"the engine process exited with code {process.exitcode} before it was ready")
                if time.monotonic() > deadline:
                    raise EngineDeadError(f"the engine process was not ready after {start_timeout_s:g} s")
            ready = ours.recv()
        except BaseException:
            _stop_process(process, 1.0)
            ours.close()
            raise
        if isinstance(ready, CoreFailed):
            process.join(5.0)
            ours.close()
            raise ready.error()
        tokenizer = ready.tokenizer if ready.tokenizer is not None else load_tokenizer(check_source(args.model))
        return cls(ours, process, ready, tokenizer, max_waiting=max_waiting)

    # --- EngineClient -----------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._dead is None and not self._stopping and self._process.is_alive()

    @property
    def pid(self) -> int | None:
        """The engine process's id."""
        return self._process.pid

    def start(self) -> None:
        """Nothing: the engine process runs from `spawn` on."""

    def stats(self) -> EngineSnapshot:
        return self._snapshot

    def num_waiting(self) -> int:
        """Requests accepted by the door that have not produced an output yet."""
        return self._num_waiting

    def check_requests(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], cache_salt: str | None
    ) -> None:
        """The door's checks of every request, queueing nothing: a refusal raises here."""
        arrival = time.perf_counter()
        for i, (ids, p) in enumerate(zip(prompts, params)):
            self.intake.build(f"check-{i}", ids, p, priority=0, arrival_time=arrival, cache_salt=cache_salt, ids_in_use=())

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | bytes | None = None,
        priority: int = 0,
        group_id: str | None = None,
    ) -> RequestStream:
        """Check the request and send it to the engine process; its stream (see `AsyncEngine.add_request`).
        Must be called from a running event loop."""
        loop = asyncio.get_running_loop()
        PrefillGroups.check(group_id)
        rid = request_id if request_id is not None else f"{self._prefix}-{next(self._ids)}"
        arrival = time.perf_counter()  # the engine's clock (CLOCK_MONOTONIC: one for every process)
        request = self.intake.build(
            rid, prompt_token_ids, params, priority=priority, arrival_time=arrival, cache_salt=cache_salt, ids_in_use=()
        )  # raises without sending anything
        stream = RequestStream(rid, loop, self)  # type: ignore[arg-type]
        ids = list(request.prompt_token_ids)
        with self._lock:
            check_door(self.alive, self._dead_reason, self.refusing, self._num_waiting, self.max_waiting)
            if rid in self._streams:
                raise InvalidArgumentError(f"request id {rid!r} is already in use by a request in flight; choose another")
            self._num_waiting += 1
            self._streams[rid] = (stream, ids)
        self._post(("add", rid, ids, params, cache_salt, priority, arrival, group_id))
        return stream

    def abort(self, request_id: str) -> None:
        """End a request at the engine's next turn (no-op once it has ended)."""
        self._post(("abort", request_id))

    async def run_verb(self, verb: str, args: dict[str, Any]) -> dict[str, Any]:
        """A lifecycle verb on the engine process (`pagedkv.serve.lifecycle_routes.apply_verb`): its body, or
        its `APIError`."""
        if not self.alive:
            raise APIError(503, self._dead_reason(), type="server_error")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        call_id = next(self._ids)
        with self._lock:
            self._verbs[call_id] = (loop, future)
        self._post(("verb", call_id, verb, args))
        status, body = await future
        if status != 200:
            error = body.get("error") or {}
            raise APIError(status, str(error.get("message", "")), type=error.get("type") or "server_error",
                           param=error.get("param"), code=error.get("code"))  # fmt: skip
        return dict(body)

    async def model_card(self) -> dict[str, Any]:
        """Nothing beyond what the app's `/v1/models` card says of one engine."""
        return {}

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort what is in flight, stop the engine loop and the engine process (terminated after
        `timeout_s`), and end every stream still open."""
        if self._stopping:
            return
        self._post(("shutdown", timeout_s))
        self._stopping = True
        self._process.join(timeout_s + 5.0)
        _stop_process(self._process, 2.0)
        self._reader.join(5.0)
        self._conn.close()
        self._fail_all("the engine process was shut down")

    # --- internals --------------------------------------------------------------------------------

    def _send(self, kind: str, payload: Any) -> None:
        """A stream's own abort (`RequestStream.abort` sends "close" with itself): its request ends, and only
        if the id is still that stream's."""
        if kind == "close":
            entry = self._streams.get(payload.request_id)
            if entry is not None and entry[0] is payload:
                self.abort(payload.request_id)

    def _post(self, message: tuple[Any, ...]) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as err:  # the engine process is gone (ValueError: the pipe is closed)
            self._fail_all(f"the engine process is gone ({type(err).__name__})")

    def _left_waiting(self) -> None:
        with self._lock:
            self._num_waiting -= 1

    def _dead_reason(self) -> str:
        if self._dead is not None:
            return self._dead
        if self._stopping:
            return "the engine loop is not running (shut down)"
        return f"the engine process exited with code {self._process.exitcode}"

    def _read(self) -> None:
        """The output reader: route each message of the engine process until the pipe closes."""
        reason = "the engine process exited"
        try:
            while True:
                message = pickle.loads(self._conn.recv_bytes())
                kind = message[0]
                if kind == "outputs":
                    self._route(message[1])
                elif kind == "snapshot":
                    self._snapshot = message[1]
                    if self.metrics is not None:
                        self.metrics.observe_engine(message[1])
                elif kind == "verb":
                    _, call_id, status, body, self.refusing, self.weight_version = message
                    with self._lock:
                        loop, future = self._verbs.pop(call_id)
                    with contextlib.suppress(RuntimeError):  # the caller's loop is closed
                        loop.call_soon_threadsafe(_settle_verb, future, (status, body))
                else:  # "dead"
                    reason = message[1]
                    break
        except (EOFError, OSError):
            if self._process.exitcode not in (None, 0):
                reason = f"the engine process died (exit code {self._process.exitcode})"
        except Exception:  # a message that does not unpickle: the pipe can no longer be trusted
            logger.exception("pagedkv engine process: the output reader failed")
            reason = "the engine process's outputs could not be read"
        self._fail_all(reason)

    def _route(self, pairs: list[tuple[str, list[Any]]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, list[Any]]]] = {}
        for rid, items in pairs:
            entry = self._streams.get(rid)
            if entry is None:
                continue
            stream, prompt = entry
            for item in items:
                if isinstance(item, RequestOutput):
                    item.prompt_token_ids = prompt
                elif isinstance(item, StreamEnd):
                    for out in item.outputs:
                        out.prompt_token_ids = prompt
                    if self.metrics is not None:
                        self.metrics.observe_request(list(item.outputs))
            if any(isinstance(item, StreamEnd | StreamFailure) for item in items):
                with self._lock:
                    self._streams.pop(rid, None)
            by_loop.setdefault(stream.loop, []).append((stream, items))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(deliver, batch)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                for stream, _ in batch:
                    self.abort(stream.request_id)

    def _fail_all(self, reason: str) -> None:
        """The engine process is gone: every open stream and verb ends with `EngineDeadError`."""
        with self._lock:
            if self._dead is None:
                self._dead = reason
            streams, self._streams = list(self._streams.values()), {}
            verbs, self._verbs = list(self._verbs.values()), {}
        error = EngineDeadError(reason)
        self._snapshot = _dead_snapshot(self._snapshot)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, list[Any]]]] = {}
        for stream, _ in streams:
            by_loop.setdefault(stream.loop, []).append((stream, [StreamFailure(error)]))
        for loop, batch in by_loop.items():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(deliver, batch)
        body = APIError(503, reason, type="server_error").body()
        for loop, future in verbs:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle_verb, future, (503, body))


def _dead_snapshot(snapshot: EngineSnapshot) -> EngineSnapshot:
    import dataclasses

    return dataclasses.replace(snapshot, alive=False, num_in_flight=0)


def _settle_verb(future: asyncio.Future[Any], answer: tuple[int, dict[str, Any]]) -> None:
    if not future.done():
        future.set_result(answer)


def _stop_process(process: Any, grace_s: float) -> None:
    """Kill `process` if it still runs after `grace_s` more seconds (it ignores SIGTERM: the server's)."""
    process.join(grace_s)
    if process.is_alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
        process.join(grace_s)


