"""`AsyncEngine` with sample groups (`group_id`) under the interleavings a Ray replica sees: requests come
one by one from the ingress while the engine steps, a client or Ray cancels a call at any time (the stream's
`abort`, or `abort(id)`), an id comes again. The engine thread steps only when the test lets it (a gate in
`Engine.step`), and after each operation the test waits until the thread is at the gate or idle, so one run
is one exact interleaving: commands sent while a step is held apply after it, before the next.

Whatever the order: the engine loop never fails, every stream ends exactly once with one final output per
completion it started (all of them, "length", unless it was aborted), an abort reaches only its own stream's
request, and the engine and its pool are idle at the end. 9-token prompts on an 8-token step budget."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.core.errors import InvalidArgumentError, PagedKVError
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.intake import family_ids
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.scheduler import SchedulerConfig
from pagedkv.hf.tiny import tiny_model
from pagedkv.serve.async_engine import AsyncEngine, RequestStream

PROMPTS = ([(7 * i) % 120 + 5 for i in range(9)], [(11 * i) % 120 + 5 for i in range(9)])
PICK = st.integers(0, 63)  # which of the streams sent so far (modulo their number)


@pytest.fixture(scope="module")
def tiny() -> Any:
    return tiny_model("llama", 0)


class _Signalling(threading.Event):
    """The engine thread's wake-up event, saying "idle" each time the thread waits on it."""

    def __init__(self, signals: queue.Queue[str]) -> None:
        super().__init__()
        self.signals = signals

    def wait(self, timeout: float | None = None) -> bool:
        self.signals.put("idle")
        return super().wait(timeout)


class Turns:
    """An AsyncEngine whose thread steps only when `step()` lets it. The thread is always either held at the
    gate before a step or idle once `settle()` returned: a command sent then applies at its next turn."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.signals: queue.Queue[str] = queue.Queue()
        self.go = threading.Semaphore(0)
        self.opened = False
        self.at_gate = False
        inner = engine.engine
        real = inner.step

        def gated() -> list[Any]:
            if not self.opened:
                self.signals.put("gate")
                self.go.acquire()
            return real()

        send = engine._send

        def counted_send(kind: str, payload: Any) -> None:
            self.pending = True
            send(kind, payload)

        inner.step = gated  # type: ignore[method-assign]
        engine._send = counted_send  # type: ignore[method-assign]
        engine._wake = _Signalling(self.signals)
        self.pending = False
        engine.start()
        self.settle()

    def settle(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                self.at_gate = self.signals.get(timeout=0.05) == "gate"
                return
            except queue.Empty:
                assert self.engine.alive, f"the engine loop stopped: {self.engine._dead_reason()}"
                assert time.monotonic() < deadline, "the engine thread neither stepped nor went idle in 30 s"

    def sent(self) -> None:
        """After the caller's side acted: a command it sent is taken by an idle thread now (by a held one
        after its step)."""
        if self.pending and not self.at_gate:
            self.settle()
        self.pending = False

    def step(self) -> bool:
        if not self.at_gate:
            return False
        self.go.release()
        self.settle()
        return True

    def open(self) -> None:
        """Steps no longer wait (the end of the test)."""
        self.opened = True
        self.go.release()


@dataclass
class Sent:
    stream: RequestStream
    n: int
    again: bool  # its id was in use by an earlier stream when sent
    aborted: bool = False  # closed, or its id aborted, at some point
    task: Any = None
    finals: list[Any] = field(default_factory=list)
    error: BaseException | None = None


async def consume(sent: Sent) -> None:
    try:
        async for out in sent.stream:
            if out.finished:
                sent.finals.append(out)
    except PagedKVError as e:
        sent.error = e


ADD = st.tuples(
    st.just("add"),
    st.sampled_from(["g", "g", "h", None]),
    st.sampled_from([0, 0, 1]),
    st.sampled_from([1, 1, 2]),
)
OPS = st.one_of(
    ADD,
    ADD,
    st.tuples(st.just("again"), PICK),  # a new stream with the id of an earlier one
    st.tuples(st.just("close"), PICK),  # the stream's consumer left: `RequestStream.abort`
    st.tuples(st.just("abort"), PICK),  # `AsyncEngine.abort(id)`
    st.tuples(st.just("step"), st.integers(1, 3)),
)


async def play(engine: AsyncEngine, turns: Turns, ops: Sequence[tuple[Any, ...]]) -> list[Sent]:
    sent: list[Sent] = []
    params = {n: SamplingParams(n=n, max_new_tokens=2, ignore_eos=True) for n in (1, 2)}

    def add(prompt: int, n: int, group: str | None, rid: str, again: bool) -> None:
        stream = engine.add_request(PROMPTS[prompt], params[n], request_id=rid, group_id=group)
        s = Sent(stream, n, again)
        s.task = asyncio.ensure_future(consume(s))
        sent.append(s)
        turns.sent()

    for op in ops:
        if op[0] == "add":
            add(op[2], op[3], op[1], f"r{len(sent)}", again=False)
        elif op[0] == "step":
            for _ in range(op[1]):
                turns.step()
        elif sent:
            s = sent[op[1] % len(sent)]
            if op[0] == "again":
                add(0, 1, "g", s.stream.request_id, again=True)
            elif op[0] == "close":
                s.aborted = True
                s.stream.abort()
                turns.sent()
            else:
                for other in sent:
                    other.aborted |= other.stream.request_id == s.stream.request_id
                engine.abort(s.stream.request_id)
                turns.sent()
        for _ in range(5):  # the streams take this turn's outputs (a closed one may have ended meanwhile)
            await asyncio.sleep(0)
    for _ in range(500):
        if not turns.step():
            break
    await asyncio.wait_for(asyncio.gather(*(s.task for s in sent)), 10)
    return sent



def gated_engine(tiny: Any) -> tuple[Engine, AsyncEngine, Turns]:
    """The tests' engine (48 blocks of 4, 8 tokens a step), its AsyncEngine and the gate of its turns."""
    inner = Engine(
        tiny, None, EngineConfig(num_blocks=48, block_size=4, scheduler=SchedulerConfig(max_num_batched_tokens=8))
    )
    engine = AsyncEngine(inner)
    return inner, engine, Turns(engine)

@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.tuples(ADD, ADD).map(list) | st.just([]), more=st.lists(OPS, max_size=30))
def test_group_requests_end_once_whatever_the_order_of_adds_aborts_and_steps(
    tiny: Any, ops: list[Any], more: list[Any]
) -> None:
    inner, engine, turns = gated_engine(tiny)
    try:
        sent = asyncio.run(play(engine, turns, ops + more))
        assert engine.alive, engine._dead_reason()
        for s in sent:
            rid = s.stream.request_id
            if s.error is not None:  # only a stream whose id was in use when it came
                assert s.again and isinstance(s.error, InvalidArgumentError) and "in use" in str(s.error), (
                    s.error
                )
                continue
            family = family_ids(rid, s.n)
            ids = [o.request_id for o in s.finals]
            assert len(ids) == len(set(ids)) and rid in ids and set(ids) <= set(family), (rid, ids)
            reasons = {o.finish_reason for o in s.finals}
            if s.aborted:
                assert reasons <= {"abort", "length"}, (rid, reasons)
            else:
                assert sorted(ids) == family and reasons == {"length"}, (rid, ids, reasons)
        assert not inner.has_unfinished() and not inner._ids_in_use and not inner._outputs
        assert inner.manager.num_used_blocks == 0
        inner.manager.check_invariants()
        assert not engine._streams and not engine._arrivals and not engine._queue_s
        assert engine.num_waiting() == 0 and engine.stats().num_in_flight == 0
    finally:
        turns.open()
        engine.shutdown(timeout_s=10)


def test_a_held_group_request_aborted_after_its_leaders_prefill_ends_and_the_loop_lives(tiny: Any) -> None:
    """The Ray replica's failure: L leads and A waits (it came during L's first prompt step); B comes during
    L's last prompt step; then A's client leaves. A ends with "abort", L and B answer (B with L's prompt), and
    the engine loop goes on."""
    inner, engine, turns = gated_engine(tiny)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)

    async def scenario() -> dict[str, list[Any]]:
        streams = {"L": engine.add_request(PROMPTS[0], params, request_id="L", group_id="g")}
        turns.sent()  # the thread holds L's first prompt step
        streams["A"] = engine.add_request(PROMPTS[0], params, request_id="A", group_id="g")
        turns.step()  # A comes while L computes: held
        streams["B"] = engine.add_request(PROMPTS[0], params, request_id="B", group_id="g")
        turns.step()  # L's prompt is written; B comes before A is queued
        streams["A"].abort()
        while turns.step():
            pass
        return {rid: [o async for o in s if o.finished] for rid, s in streams.items()}

    try:
        got = asyncio.run(asyncio.wait_for(scenario(), 30))
        assert engine.alive, engine._dead_reason()
        assert {rid: [o.finish_reason for o in outs] for rid, outs in got.items()} == {
            "L": ["length"],
            "A": ["abort"],
            "B": ["length"],
        }
        assert got["L"][0].num_cached_tokens == 0 and got["B"][0].num_cached_tokens == 8
    finally:
        turns.open()
        engine.shutdown(timeout_s=10)


def test_a_stream_the_engine_lost_ends_alone_and_the_loop_goes_on(tiny: Any) -> None:
    """The guard behind the contract: an engine that forgets a request (a bug, injected here twice: an add
    that queues nothing, a finish that does not know the id) ends that stream with InvariantError; the other
    streams answer and the loop lives."""
    from pagedkv.core.errors import InvariantError

    inner = Engine(tiny, None, EngineConfig(num_blocks=48, block_size=4))
    add, finish = inner.add_request, inner.finish

    def forgetful_add(prompt: Any, params: Any = None, **kw: Any) -> str:
        return str(kw["request_id"]) if kw["request_id"] == "dropped" else add(prompt, params, **kw)

    def forgetful_finish(request_id: str, reason: str = "abort") -> bool:
        if request_id == "unknown":
            raise InvalidArgumentError(f"no request {request_id!r} in this engine")
        return finish(request_id, reason)

    inner.add_request = forgetful_add  # type: ignore[method-assign]
    inner.finish = forgetful_finish  # type: ignore[method-assign]
    engine = AsyncEngine(inner)
    engine.start()
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)

    async def outcome(stream: RequestStream) -> str:
        try:
            return ",".join([o.finish_reason or "" async for o in stream if o.finished])
        except InvariantError as e:
            return f"InvariantError: {e}"

    async def scenario() -> list[str]:
        streams = [
            engine.add_request(PROMPTS[0], params, request_id=rid) for rid in ("dropped", "unknown", "ok")
        ]
        streams[1].abort()
        return list(await asyncio.gather(*(outcome(s) for s in streams)))

    try:
        dropped, unknown, ok = asyncio.run(asyncio.wait_for(scenario(), 30))
        assert dropped.startswith("InvariantError") and "'dropped'" in dropped
        assert unknown.startswith("InvariantError") and "'unknown'" in unknown
        assert ok == "length" and engine.alive
    finally:
        engine.shutdown(timeout_s=10)
