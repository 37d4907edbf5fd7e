"""`launch(build)`: the engine is built on the thread that then steps it (one OpenMP team per process), its
answers equal an engine started the plain way, and a failing build raises in the caller with no thread left
behind."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from serve_support import make_engine

from pagedkv.core.errors import EngineStateError, InvalidArgumentError
from pagedkv.engine.params import SamplingParams
from pagedkv.serve.async_engine import AsyncEngine, launch

GREEDY = SamplingParams(max_new_tokens=5, ignore_eos=True)


def _engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "pagedkv-engine" and t.is_alive()]


def test_built_and_stepped_on_one_thread_with_the_plain_answers(model: Any, tokenizer: Any) -> None:
    prompts = [list(tokenizer(f"launch test {i}")["input_ids"]) for i in range(3)]
    expected = [o.output_token_ids for o in make_engine(model, tokenizer).generate(prompts, GREEDY)]
    built_on: list[int] = []
    stepped_on: set[int] = set()

    def build() -> tuple[AsyncEngine, str]:
        built_on.append(threading.get_ident())
        engine = make_engine(model, tokenizer)
        step = engine.step

        def recorded_step() -> Any:
            stepped_on.add(threading.get_ident())
            return step()

        engine.step = recorded_step  # type: ignore[method-assign]
        return AsyncEngine(engine), "facts"

    client, extra = launch(build)
    try:
        assert extra == "facts"
        assert client.alive
        client.start()  # a no-op: launch started it

        async def run_all() -> list[list[int]]:
            async def one(ids: list[int]) -> list[int]:
                return [list(o.output_token_ids) async for o in client.generate(ids, GREEDY) if o.finished][0]

            return list(await asyncio.gather(*(one(p) for p in prompts)))

        assert asyncio.run(run_all()) == [list(e) for e in expected]
    finally:
        client.shutdown()
    assert built_on and built_on[0] != threading.get_ident()
    assert stepped_on == {built_on[0]}
    assert not client.alive


def test_a_failing_build_raises_here_and_leaves_no_thread() -> None:
    before = len(_engine_threads())

    def build() -> tuple[AsyncEngine, None]:
        raise InvalidArgumentError("no such model")

    with pytest.raises(InvalidArgumentError, match="no such model"):
        launch(build)
    deadline = time.monotonic() + 5.0
    while len(_engine_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(_engine_threads()) == before


def test_an_engine_started_already_is_refused(model: Any, tokenizer: Any) -> None:
    started = AsyncEngine(make_engine(model, tokenizer))
    started.start()
    try:
        with pytest.raises(EngineStateError, match="started already"):
            launch(lambda: (started, None))
        assert started.alive  # the refused launch left the running engine alone
    finally:
        started.shutdown()
