"""`AsyncEngine`: the engine behind an asyncio server. One thread steps it; requests are async streams.

```
caller's event loop(s)                         the engine thread (owns the Engine, nothing else touches it)
  add_request(ids, params) ──validate──> commands ──> add / abort ──> step() back to back while requests
      (raises at once: bad input,          (deque)                     are in flight, waits on an event when
       never fits, overloaded)                                          none is
  async for out in stream  <──── call_soon_threadsafe(one batch per step and loop) <── snapshots, ends
```

Contracts:

- the door never waits on a step: `add_request` checks the request with the engine's intake (a pure
  function of the request and the engine's fixed sizes), counts it against `max_waiting`, queues a command
  and returns its `RequestStream`. `InvalidArgumentError` / `CapacityError` / `ServerOverloadedError`
  come back at once, and nothing is queued;
- a stream yields `RequestOutput` snapshots of each completion of its request (`parent_id` set for the
  children of `n > 1`) as tokens arrive, exactly one `finished` output per completion, then ends. The
  outputs are handed back by `Engine.release` when the last completion has ended, so the engine keeps
  nothing of a finished request;
- `abort(id)` (and a consumer that stops iterating `generate`) ends the request at the engine thread's
  next turn, before the next step: its blocks go back to the pool then. A stream's own `abort` ends only
  its own request, never another stream's that has the same id (one sent again while the first ran, which
  the engine refused, or the first one's after it ended). Aborting a request that has ended is a no-op; a
  sample group's request still waiting for its leader's prompt is ended all the same;
- the engine thread never fails for a client's timing: each stream's request is known to the engine from
  the turn that adds it until the turn that hands its stream the end. A stream the engine has lost anyway
  (a bug) ends alone with `InvariantError` (logged), and the loop goes on;
- a failure of the engine itself (a forward raising) ends every in-flight stream with `EngineDeadError`
  and stops the loop; `alive` turns False (the server's /health says so);
- `stats()` is a snapshot the engine thread publishes after each turn: reading it never touches the engine.

`launch(build)` builds the engine on the thread that will step it. torch's OpenMP runtime (libgomp) keeps a
team of worker threads for each thread that has run a parallel region; with more of them in a process than
cores, its workers stop spinning between regions and sleep, and each of a step's few hundred parallel
regions (matrix products, the C layer and attention kernels) waits for one to wake. Weights loaded on one
thread and stepped on another made two teams: a server's steps took 1.4x the same steps in one thread
(docs/benchmarks.md). `AsyncEngine(engine).start()` still works where the engine was built on a thread that
runs no parallel region of more than one thread (tests, tiny models).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar, Unpack

from pagedkv.core.errors import EngineStateError, InvalidArgumentError, InvariantError, PagedKVError
from pagedkv.engine.groups import PrefillGroups
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.serve.engine_client import ModelFacts
from pagedkv.serve.engine_snapshot import EngineSnapshot
from pagedkv.serve.lifecycle_routes import apply_verb

if TYPE_CHECKING:
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.serve.metrics import ServerMetrics

logger = logging.getLogger(__name__)

A = TypeVar("A", bound="AsyncEngine")

T = TypeVar("T")
STATS_WINDOW = 4096  # per-step samples the engine keeps (its lists would otherwise grow for weeks)


class ServerOverloadedError(PagedKVError):
    """More requests wait for their first token than the server admits (`max_waiting`); retry later."""


class EngineDeadError(PagedKVError):
    """The engine loop has stopped (a failure of the engine itself, or shutdown)."""



def check_max_waiting(max_waiting: int) -> None:
    """An engine client's `max_waiting`: an int >= 1, else `InvalidArgumentError`."""
    if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1:
        raise InvalidArgumentError(f"max_waiting must be an int >= 1, got {max_waiting!r}")


def check_door(
    alive: bool, dead_reason: Callable[[], str], refusing: str | None, num_waiting: int, max_waiting: int
) -> None:
    """The door's state checks of every engine client, taken with its lock held, after the request's own
    checks: a stopped engine (`EngineDeadError`), one paused or asleep (`EngineStateError`, `refusing` says
    why), too many requests waiting for their first token (`ServerOverloadedError`)."""
    if not alive:
        raise EngineDeadError(dead_reason())
    if refusing is not None:
        raise EngineStateError(refusing)
    if num_waiting >= max_waiting:
        raise ServerOverloadedError(
            f"{num_waiting} requests are waiting for their first token (--max-waiting {max_waiting}); retry later"
        )

@dataclass(frozen=True, slots=True)
class StreamEnd:
    """The end of a stream: the final outputs of every completion of its request (`Engine.release`)."""

    outputs: tuple[RequestOutput, ...]


@dataclass(frozen=True, slots=True)
class StreamFailure:
    """A stream ended by an error (the engine refused the request, or died): raised by its iterator."""

    error: BaseException


class RequestStream:
    """The async stream of one request's outputs (see the module docstring). Iterate it once."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, owner: AsyncEngine) -> None:
        self.request_id = request_id
        self.loop = loop  # the event loop its outputs are delivered on
        self._owner = owner
        self._queue: asyncio.Queue[RequestOutput | StreamEnd | StreamFailure] = asyncio.Queue()
        self._finished_ids: set[str] = set()
        self._started = False  # first output seen (the request no longer counts as waiting)
        self._pending: list[RequestOutput] = []
        self.done = False

    def _put(self, items: list[RequestOutput | StreamEnd | StreamFailure]) -> None:
        """On the stream's loop: queue the engine thread's items; the first one ends "waiting"."""
        if not self._started:
            self._started = True
            self._owner._left_waiting()
        for item in items:
            self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._pending:  # final outputs the end carried that were not yielded yet
                out = self._pending.pop(0)
                self._finished_ids.add(out.request_id)
                return out
            if self.done:
                raise StopAsyncIteration
            item = await self._queue.get()
            if isinstance(item, StreamFailure):
                self.done = True
                raise item.error
            if isinstance(item, StreamEnd):
                self.done = True
                self._pending = [o for o in item.outputs if o.request_id not in self._finished_ids]
                continue
            if item.finished:
                if item.request_id in self._finished_ids:
                    continue
                self._finished_ids.add(item.request_id)
            return item

    def abort(self) -> None:
        """End this stream's request (`AsyncEngine.abort`), and only this stream's."""
        if not self.done:
            self._owner._send("close", self)


class RequestOptions(TypedDict, total=False):
    """`AsyncEngine.add_request`'s keyword options, as `generate` passes them on (same names, same defaults)."""

    request_id: str | None
    cache_salt: str | bytes | None
    priority: int
    group_id: str | None


class AsyncEngine:
    """Serve an `Engine` to asyncio callers; see the module docstring."""

    def __init__(self, engine: Engine, *, max_waiting: int = 1024, metrics: ServerMetrics | None = None) -> None:
        check_max_waiting(max_waiting)
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self._commands: collections.deque[tuple[str, Any]] = collections.deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._num_waiting = 0  # accepted at the door, no output yet
        self._stopping = False
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        # owned by the engine thread
        self._streams: dict[str, RequestStream] = {}
        self._notes: list[RequestOutput] = []
        self._arrivals: dict[str, float] = {}  # root id -> arrival, until its first chunk is scheduled
        self._queue_s: dict[str, float] = {}  # root id -> arrival to first scheduled step, until released
        self._snapshot = self._take_snapshot(alive=False)
        # what the lifecycle verbs (`call`) left: why the door refuses (paused, asleep) and the weight version
        self.refusing: str | None = None
        self.weight_version = engine.weight_version

    # --- the caller's side ----------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._failure is None and not self._stopping

    def start(self) -> None:
        """Start the engine thread (idempotent; a no-op for an engine `launch` started)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
        self._thread.start()
        self._snapshot = self._take_snapshot(alive=True)

    def _own_thread(self) -> None:
        """The calling thread is this engine's thread from now on (`launch`: it runs `_run` next)."""
        if self._thread is not None:
            raise EngineStateError("this AsyncEngine's thread has started already")
        self._thread = threading.current_thread()
        self._snapshot = self._take_snapshot(alive=True)

    def stats(self) -> EngineSnapshot:
        return self._snapshot

    @property
    def model_facts(self) -> ModelFacts:
        e = self.engine
        return ModelFacts(e.config.block_size, int(e.capacity_tokens), e.spec.max_position_embeddings)

    def check_requests(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], cache_salt: str | None
    ) -> None:
        """The door's checks of every request (`Engine.intake.build`, as `add_request` runs them), queueing
        nothing: a refusal raises here."""
        arrival = self.engine.clock()
        for i, (ids, p) in enumerate(zip(prompts, params)):
            self.engine.intake.build(
                f"check-{i}", ids, p, priority=0, arrival_time=arrival, cache_salt=cache_salt, ids_in_use=()
            )

    async def run_verb(self, verb: str, args: dict[str, Any]) -> dict[str, Any]:
        """A lifecycle verb on this engine's thread (`pagedkv.serve.lifecycle_routes.apply_verb`)."""
        return await apply_verb(self, verb, args)

    async def model_card(self) -> dict[str, Any]:
        """Nothing beyond what the app's `/v1/models` card says of one engine."""
        return {}

    def kv_contents(self) -> dict[str, list[int]]:
        """The external hashes (`pagedkv.events.wire.external_hash`) of the blocks this engine can serve, per
        medium that holds any: "GPU" from the manager itself, the tiers' from the event log (what they
        reported). Needs `kv_events` on; read while the engine is idle (tests and debugging)."""
        from pagedkv.events.wire import external_hash

        events = self.engine.kv_events
        if events is None:
            raise InvalidArgumentError("this engine records no KV events: build it with kv_events=True")
        out = {
            m: sorted({external_hash(k) for log in events.logs for k in log.holds(m)})
            for m in ("CPU", "DISK", "REMOTE")
        }  # a hybrid engine has one log per KV cache group: a hash held by any group
        out["GPU"] = sorted(external_hash(k) for k in events.feed.device_keys())
        return {m: v for m, v in out.items() if v}

    def num_waiting(self) -> int:
        """Requests accepted by the door that have not produced an output yet."""
        return self._num_waiting

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
        """Check the request and queue it; its stream. Must be called from a running event loop. `group_id`:
        requests of one group with the same prompt prefill it once (`Engine.add_request`)."""
        loop = asyncio.get_running_loop()
        PrefillGroups.check(group_id)
        rid = request_id if request_id is not None else f"{self._prefix}-{next(self._ids)}"
        arrival = self.engine.clock()
        self.engine.intake.build(
            rid, prompt_token_ids, params, priority=priority, arrival_time=arrival, cache_salt=cache_salt, ids_in_use=()
        )  # the door's checks, on this thread: raises without queueing anything
        stream = RequestStream(rid, loop, self)
        with self._lock:  # the engine thread takes this lock to fail what is queued: nothing is stranded
            check_door(self.alive, self._dead_reason, self.refusing, self._num_waiting, self.max_waiting)
            self._num_waiting += 1
            self._send("add", (stream, list(prompt_token_ids), params, cache_salt, priority, arrival, group_id))
        return stream

    async def generate(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, **options: Unpack[RequestOptions]
    ) -> AsyncIterator[RequestOutput]:
        """`add_request` (with its keyword options), then its outputs; closing the iterator early (or
        cancelling) aborts the request."""
        stream = self.add_request(prompt_token_ids, params, **options)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` on the engine thread between two steps (the lifecycle verbs: pause, sleep,
        update_weights, ...); its result, or its exception raised here."""
        if not self.alive:
            raise EngineDeadError(self._dead_reason())
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._send("call", (fn, loop, future))
        return await future

    def abort(self, request_id: str) -> None:
        """End a request at the engine thread's next turn (no-op once it has ended)."""
        self._send("abort", request_id)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort what is in flight, stop the engine thread and close the engine's tiers."""
        self._stopping = True
        self._send("abort_all", None)
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.engine.close()

    def _send(self, kind: str, payload: Any) -> None:
        self._commands.append((kind, payload))
        self._wake.set()

    def _left_waiting(self) -> None:
        with self._lock:
            self._num_waiting -= 1

    def _dead_reason(self) -> str:
        if self._failure is not None:
            return f"the engine loop failed: {type(self._failure).__name__}: {self._failure}"
        return "the engine loop is not running (not started, or shut down)"

    # --- the engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                self._apply_commands()
                if self._stopping and not self.engine.has_unfinished():
                    break
                if not self.engine.has_unfinished() or self.engine.is_frozen:  # frozen: paused in keep mode
                    if self._streams and not self.engine.has_unfinished():
                        self._end_lost()
                    self._snapshot = self._take_snapshot(alive=True)
                    self._wake.wait()
                    continue
                started = self.engine.clock()
                finished = self.engine.step()
                self._note_scheduled(started, finished)
                self.after_step()
                self._publish(finished)
        except BaseException as e:  # the engine itself failed: every stream learns it, /health turns red
            logger.exception("pagedkv engine loop failed")
            self._fail_all(EngineDeadError(f"the engine loop failed: {type(e).__name__}: {e}"), e)
        else:
            self._fail_all(EngineDeadError("the engine loop was shut down"), None)
        finally:
            self._snapshot = self._take_snapshot(alive=False)

    def after_step(self) -> None:
        """Called on the engine thread after every step, before its outputs reach their streams (a
        subclass publishes the step's KV events here, so a client that sees its answer finds them routed).
        Does nothing by default."""

    def _apply_commands(self) -> None:
        while self._commands:
            kind, payload = self._commands.popleft()
            if kind == "add":
                self._add(*payload)
            elif kind == "abort":
                self._abort(payload)
            elif kind == "close":  # a stream's own abort
                self._abort(payload.request_id, payload)
            elif kind == "call":
                self._call(*payload)
            else:  # abort_all
                for rid in list(self._streams):
                    self._abort(rid)

    def _add(
        self, stream: RequestStream, ids: list[int], params: SamplingParams, salt: Any, priority: int, arrival: float,
        group_id: str | None,
    ) -> None:
        try:
            self.engine.add_request(
                ids, params, request_id=stream.request_id, priority=priority, arrival_time=arrival,
                on_token=self._notes.append, cache_salt=salt, group_id=group_id,
            )  # fmt: skip
        except PagedKVError as e:  # checked at the door already; an id clash can still land here
            self._dispatch({stream: [StreamFailure(e)]})
            return
        self._streams[stream.request_id] = stream
        self._arrivals[stream.request_id] = arrival

    def _call(self, fn: Callable[[Engine], Any], loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any]) -> None:
        try:
            outcome: tuple[bool, Any] = (True, fn(self.engine))
        except Exception as e:  # the caller's to handle (a refused verb), not the loop's
            outcome = (False, e)
        self.refusing = self.engine.lifecycle.refusal()
        self.weight_version = self.engine.weight_version
        with contextlib.suppress(RuntimeError):  # a RuntimeError: the caller's loop is closed
            loop.call_soon_threadsafe(_settle, future, outcome)

    def _abort(self, request_id: str, stream: RequestStream | None = None) -> None:
        """End request `request_id` if a stream still waits for it (`stream`, when given: if that one does)."""
        own = self._streams.get(request_id)
        if own is None or (stream is not None and own is not stream):
            return  # ended and handed back already, or the id is another stream's now
        try:
            self.engine.finish(request_id, "abort")
        except InvalidArgumentError as e:  # the engine lost it: end this stream, not the loop
            self._lose(own, e)

    def _lose(self, stream: RequestStream, cause: BaseException | None) -> None:
        """End `stream`, whose request the engine does not know (a broken invariant: logged), with
        `InvariantError`; the other streams go on."""
        rid = stream.request_id
        message = f"AsyncEngine: the engine has no record of request {rid!r}, whose stream is still open"
        logger.error("%s (%s)", message, cause)
        self._streams.pop(rid, None)
        self._arrivals.pop(rid, None)
        self._queue_s.pop(rid, None)
        self._dispatch({stream: [StreamFailure(InvariantError(message))]})

    def _end_lost(self) -> None:
        """With nothing unfinished in the engine, every stream has had its end: end any other (a bug)."""
        for stream in list(self._streams.values()):
            self._lose(stream, None)

    def _note_scheduled(self, started: float, finished: list[RequestOutput]) -> None:
        """Requests whose first chunk ran in the step that began at `started` waited until then (the
        scheduler stamps its own time after the step)."""
        ended = {o.request_id: o for o in finished}
        for rid, arrival in list(self._arrivals.items()):
            if rid in ended:
                scheduled = ended[rid].queue_s is not None
            else:
                try:
                    scheduled = self.engine.get_request(rid).first_scheduled_time is not None
                except InvalidArgumentError:  # a group's request waiting for its leader, or ended unscheduled
                    if not self.engine.is_held(rid):
                        del self._arrivals[rid]
                    continue
            if scheduled:
                self._queue_s[rid] = max(0.0, started - arrival)
                del self._arrivals[rid]

    def _publish(self, finished: list[RequestOutput]) -> None:
        """Route this turn's snapshots and ends to their streams; release families that have ended."""
        batches: dict[RequestStream, list[RequestOutput | StreamEnd | StreamFailure]] = {}
        roots: set[str] = set()
        for out in itertools.chain(self._notes, finished):
            root = out.parent_id or out.request_id
            stream = self._streams.get(root)
            if stream is not None:
                batches.setdefault(stream, []).append(out)
                if out.finished:
                    roots.add(root)
        self._notes.clear()
        for root in roots:
            outputs = self.engine.release(root)
            if outputs is not None:
                self._arrivals.pop(root, None)
                queue_s = self._queue_s.pop(root, None)
                for out in outputs:  # queue time as vLLM's: until the step that first schedules it starts
                    out.queue_s = queue_s if queue_s is not None else out.queue_s
                stream = self._streams.pop(root)
                batches.setdefault(stream, []).append(StreamEnd(tuple(outputs)))
                if self.metrics is not None:
                    self.metrics.observe_request(outputs)
        self._snapshot = self._take_snapshot(alive=True)  # before the streams wake: they may read it
        self._dispatch(batches)
        if len(self.engine.stats.step_times) > 2 * STATS_WINDOW:
            self.engine.stats.trim(STATS_WINDOW)

    def _dispatch(self, batches: dict[RequestStream, list[RequestOutput | StreamEnd | StreamFailure]]) -> None:
        """One `call_soon_threadsafe` per event loop for the whole turn."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, list[Any]]]] = {}
        for stream, items in batches.items():
            by_loop.setdefault(stream.loop, []).append((stream, items))
        for loop, pairs in by_loop.items():
            try:
                loop.call_soon_threadsafe(deliver, pairs)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                for stream, _ in pairs:
                    self._abort(stream.request_id, stream)

    def _fail_all(self, error: BaseException, failure: BaseException | None) -> None:
        """The loop ends: every stream in flight and every request still in the command queue ends with
        `error`. Under the door's lock, so no request is queued after this drain."""
        with self._lock:
            self._failure = failure
            self._stopping = True
            queued = []
            while self._commands:  # popleft, not iteration: an abort may be appended meanwhile
                kind, payload = self._commands.popleft()
                if kind == "add":
                    queued.append(payload[0])
                elif kind == "call":  # a lifecycle verb that will never run: its caller learns why
                    _, loop, future = payload
                    with contextlib.suppress(RuntimeError):
                        loop.call_soon_threadsafe(_settle, future, (False, error))
        self._dispatch({stream: [StreamFailure(error)] for stream in [*self._streams.values(), *queued]})
        self._streams.clear()

    def _take_snapshot(self, *, alive: bool) -> EngineSnapshot:
        engine, scheduler = self.engine, self.engine.scheduler
        snapshot = EngineSnapshot(
            alive=alive,
            num_running=int(scheduler.num_running),
            num_waiting=int(scheduler.num_waiting),
            num_swapped=len(scheduler.swapped),
            num_used_blocks=int(engine.manager.num_used_blocks),
            num_blocks=int(engine.manager.num_blocks),
            num_preemptions=int(engine.stats.num_preemptions),
            num_steps=int(engine.stats.num_steps),
            num_in_flight=len(self._streams),
            miss_tokens=tuple(misses.tokens.items()) if (misses := engine.stats.cache_misses) is not None else (),
            spec=None if (sp := engine.stats.spec) is None else (
                sp.num_drafts, sp.num_draft_tokens, sp.num_accepted_tokens, tuple(sp.accepted_per_pos)
            ),
            group_prefill_shared_tokens=int(engine.group_prefill_shared_tokens),
            kv_epoch=int(engine.manager.epoch),
        )
        if self.metrics is not None:
            self.metrics.observe_engine(snapshot)
        return snapshot


def _settle(future: asyncio.Future[Any], outcome: tuple[bool, Any]) -> None:
    if future.done():  # the caller gave up (cancelled)
        return
    ok, value = outcome
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


def deliver(pairs: list[tuple[RequestStream, list[Any]]]) -> None:
    """On a stream's loop: hand each stream its items of one turn."""
    for stream, items in pairs:
        stream._put(items)


def launch(build: Callable[[], tuple[A, T]], *, name: str = "pagedkv-engine") -> tuple[A, T]:
    """Start the engine thread, run `build` on it (load the weights, build the `Engine` and the
    `AsyncEngine` over it, and whatever else `build` returns beside it), then that `AsyncEngine`'s loop on
    the same thread; returns `build`'s answer once it is built. An exception of `build` is raised here, and
    the thread ends with it. See the module docstring for why the thread that loads is the one that steps."""
    built: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=1)

    def body() -> None:
        try:
            client, extra = build()
            client._own_thread()
        except BaseException as err:  # handed to the caller, which raises it
            built.put((False, err))
            return
        built.put((True, (client, extra)))
        client._run()

    threading.Thread(target=body, name=name, daemon=True).start()
    ok, value = built.get()
    if not ok:
        raise value
    return value
