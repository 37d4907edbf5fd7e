"""`AsyncEngine` without HTTP: the door answers while the engine thread is busy, streams equal the offline
engine, closing a stream aborts its request and frees its blocks, ended requests leave nothing behind, and
a failing engine ends every stream and turns /health red."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import pytest
from serve_support import MODEL_NAME, make_engine, start_server

from pagedkv.core.errors import CapacityError, InvalidArgumentError
from pagedkv.engine.params import SamplingParams
from pagedkv.serve.async_engine import AsyncEngine, EngineDeadError, ServerOverloadedError

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def prompts(tokenizer: Any, n: int) -> list[list[int]]:
    return [list(tokenizer(f"prompt number {i} says")["input_ids"]) for i in range(n)]


async def final_outputs(engine: AsyncEngine, ids: list[int], params: SamplingParams) -> list[Any]:
    return [out async for out in engine.generate(ids, params) if out.finished]


def test_streams_equal_offline_and_leave_nothing_behind(model: Any, tokenizer: Any) -> None:
    ps = prompts(tokenizer, 6)
    expected = make_engine(model, tokenizer).generate(ps, GREEDY)
    engine = AsyncEngine(make_engine(model, tokenizer))
    engine.start()

    async def run_all() -> list[list[Any]]:
        return list(await asyncio.gather(*(final_outputs(engine, p, GREEDY) for p in ps)))

    try:
        got = asyncio.run(run_all())
        assert [[o.output_token_ids for o in outs] for outs in got] == [[o.output_token_ids] for o in expected]
        inner = engine.engine
        assert not inner._outputs and not inner._ids_in_use and not inner.has_unfinished()
        assert engine.stats().num_in_flight == 0 and engine.num_waiting() == 0
        inner.manager.check_invariants()
    finally:
        engine.shutdown()
    assert not engine.alive


def test_the_door_answers_while_the_engine_thread_is_busy(model: Any, tokenizer: Any) -> None:
    """The engine thread is held inside a step; bad requests are refused and good ones accepted at once,
    and the overload limit counts the accepted ones (no timing involved: a wait would deadlock)."""
    inner = make_engine(model, tokenizer)
    engine = AsyncEngine(inner, max_waiting=2)
    in_step, release = threading.Event(), threading.Event()
    real_step = inner.step

    def held_step() -> list[Any]:
        in_step.set()
        release.wait(30)
        return real_step()

    inner.step = held_step  # type: ignore[method-assign]
    engine.start()

    async def scenario() -> list[Any]:
        first = engine.add_request(prompts(tokenizer, 1)[0], GREEDY)
        in_step.wait(30)  # the engine thread is now stuck in a step
        with pytest.raises(InvalidArgumentError, match="vocabulary"):
            engine.add_request([10**9], GREEDY)
        with pytest.raises(CapacityError, match="can never fit"):
            engine.add_request([5] * 300, SamplingParams(max_new_tokens=200, n=30))
        second = engine.add_request(prompts(tokenizer, 2)[1], GREEDY)
        with pytest.raises(ServerOverloadedError, match="max-waiting"):
            engine.add_request(prompts(tokenizer, 3)[2], GREEDY)
        release.set()
        return [[o async for o in s if o.finished] for s in (first, second)]

    try:
        done = asyncio.run(scenario())
        assert [len(outs) for outs in done] == [1, 1] and all(o[0].finish_reason == "length" for o in done)
    finally:
        release.set()
        engine.shutdown()


def test_closing_a_stream_aborts_its_request_and_frees_its_blocks(model: Any, tokenizer: Any) -> None:
    engine = AsyncEngine(make_engine(model, tokenizer))
    engine.start()
    long = SamplingParams(max_new_tokens=300, ignore_eos=True, n=2, temperature=1.0, seed=3)

    async def leave_early() -> int:
        seen = 0
        gen = engine.generate(prompts(tokenizer, 1)[0], long)
        async for _ in gen:
            seen += 1
            if seen == 3:
                break
        await gen.aclose()
        return seen

    try:
        assert asyncio.run(leave_early()) == 3
        deadline = threading.Event()
        for _ in range(3000):
            if engine.stats().num_in_flight == 0:
                break
            deadline.wait(0.01)
        snapshot = engine.stats()
        assert snapshot.num_in_flight == 0 and snapshot.num_used_blocks == 0
        inner = engine.engine
        assert not inner._outputs and not inner._ids_in_use
        assert inner.stats.num_steps < 300  # it did not run to the end
    finally:
        engine.shutdown()


def test_a_failing_engine_ends_every_stream_and_health_turns_red(model: Any, tokenizer: Any) -> None:
    inner = make_engine(model, tokenizer)
    running = start_server(inner)
    try:
        ok = httpx.post(f"{running.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200

        def broken(*args: object) -> None:
            raise RuntimeError("the device fell over")

        inner.runner.execute = broken  # type: ignore[method-assign]
        failed = httpx.post(f"{running.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
        assert failed.status_code == 503 and "device fell over" in failed.json()["error"]["message"]
        assert httpx.get(f"{running.url}/health").status_code == 503
        again = httpx.post(f"{running.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
        assert again.status_code == 503 and again.json()["error"]["code"] == "engine_unavailable"
        with pytest.raises(EngineDeadError):
            asyncio.run(final_outputs(running.async_engine, [5, 6], GREEDY))
    finally:
        running.stop()


def test_a_request_still_queued_when_the_engine_fails_is_not_stranded(model: Any, tokenizer: Any) -> None:
    """The engine thread is held in a step that then raises; a request added meanwhile sits in the command
    queue: both streams end with EngineDeadError, and the door refuses from then on."""
    inner = make_engine(model, tokenizer)
    engine = AsyncEngine(inner)
    in_step, release = threading.Event(), threading.Event()

    def failing_step() -> list[Any]:
        in_step.set()
        release.wait(30)
        raise RuntimeError("the device fell over")

    inner.step = failing_step  # type: ignore[method-assign]
    engine.start()

    async def scenario() -> list[str]:
        first = engine.add_request(prompts(tokenizer, 1)[0], GREEDY)
        in_step.wait(30)
        queued = engine.add_request(prompts(tokenizer, 2)[1], GREEDY)  # stays in the command queue
        release.set()
        ends = []
        for stream in (first, queued):
            with pytest.raises(EngineDeadError, match="device fell over") as caught:
                async for _ in stream:
                    pass
            ends.append(str(caught.value))
        with pytest.raises(EngineDeadError):
            engine.add_request(prompts(tokenizer, 1)[0], GREEDY)
        return ends

    try:
        assert len(asyncio.run(asyncio.wait_for(scenario(), 60))) == 2
        assert not engine.alive
    finally:
        release.set()
        engine.shutdown()


def test_the_snapshot_carries_the_managers_key_epoch(model: Any, tokenizer: Any) -> None:
    """A weight update bumps the manager's key epoch; the snapshot (what a Ray replica reports to the router)
    says the new one after the engine thread's next turn."""
    import time

    engine = AsyncEngine(make_engine(model, tokenizer))
    engine.start()
    try:
        new = asyncio.run(engine.call(lambda e: e.manager.bump_epoch()))
        deadline = time.monotonic() + 10
        while engine.stats().kv_epoch != new:
            assert time.monotonic() < deadline, f"the snapshot says epoch {engine.stats().kv_epoch}, not {new}"
            time.sleep(0.01)
        assert new == engine.engine.manager.epoch >= 1
    finally:
        engine.shutdown()


def test_the_server_reaches_the_engine_only_through_async_engine() -> None:
    """No module of pagedkv.serve reads `x.engine.engine` (the Engine behind an AsyncEngine): what the HTTP
    layer and a Ray replica need is the AsyncEngine's interface (stats, model facts, kv_contents, call)."""
    import ast
    from pathlib import Path

    import pagedkv.serve

    found = []
    for path in sorted(Path(pagedkv.serve.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "engine":
                inner = node.value
                if isinstance(inner, ast.Attribute) and inner.attr == "engine":
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found
