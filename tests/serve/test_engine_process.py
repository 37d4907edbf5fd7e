"""`pagedkv serve` with the engine in a process of its own (`pagedkv.serve.engine_process.ProcessEngine`),
driven by the openai client and raw HTTP: the same answers as the engine in-process, the door's refusals
before anything crosses the pipe, the lifecycle verbs, aborts that free the pool, and an engine process that
dies (every stream ends, /health turns red, nothing hangs) or is stopped with the server."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from serve_support import MODEL_NAME

from pagedkv.core.errors import CapacityError, InvalidArgumentError
from pagedkv.engine.params import SamplingParams
from pagedkv.serve.engine_process import ProcessEngine
from pagedkv.serve.engine_setup import load_engine
from pagedkv.serve.serve_command import add_arguments

PROMPTS = ["Once upon a time", "The capital of France is", "1, 2, 3,", "def fib(n):"]



def serve_args(folder: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    pool = [] if "--kv-budget" in extra else ["--num-blocks", "64"]
    return parser.parse_args(["--model", str(folder), *pool, "--threads", "1", *extra])


class Running:
    """uvicorn over `build_app(ProcessEngine)` in a thread of this process, on a free port."""

    def __init__(self, client: ProcessEngine, **app_kwargs: Any) -> None:
        import uvicorn

        from pagedkv.serve.app import build_app

        self.engine = client
        app = build_app(client, model_name=MODEL_NAME, **app_kwargs)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the test server did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "the test server did not stop"


@pytest.fixture(scope="module")
def running(model_folder: Path) -> Iterator[Running]:
    r = Running(ProcessEngine.spawn(serve_args(model_folder), max_waiting=64))
    yield r
    r.stop()


def _expected(folder: Path, prompts: list[str], max_tokens: int) -> list[list[int]]:
    engine, _ = load_engine(serve_args(folder))
    ids = [engine.tokenizer(p)["input_ids"] for p in prompts]
    outs = engine.generate(ids, SamplingParams(max_new_tokens=max_tokens, ignore_eos=True))
    return [o.output_token_ids for o in outs]


def test_answers_equal_the_in_process_engine_token_for_token(running: Running, model_folder: Path) -> None:
    """Greedy answers of the engine process, streamed and not, at once, equal the same engine's in-process."""
    expected = _expected(model_folder, PROMPTS, 24)
    client = running.client()
    results: dict[int, str] = {}

    def ask(i: int) -> None:
        r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[i], max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
        results[i] = r.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    tok = running.engine.tokenizer
    for i, ids in enumerate(expected):
        assert results[i] == tok.decode(ids, skip_special_tokens=True), PROMPTS[i]
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    )
    assert streamed == tok.decode(expected[1], skip_special_tokens=True)


def test_n_samples_usage_and_prompt_ids_come_back(running: Running) -> None:
    """The prompt's ids are not sent back per token; the server restores them: usage counts them."""
    tok = running.engine.tokenizer
    r = running.client().completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=5, n=3, temperature=0)
    assert len(r.choices) == 3 and len({c.text for c in r.choices}) == 1
    assert r.usage.prompt_tokens == len(tok(PROMPTS[0])["input_ids"]) and r.usage.completion_tokens == 15


def test_the_door_refuses_before_the_pipe(running: Running) -> None:
    """Bad input is a 400, a prompt that never fits is refused, and neither reaches the engine process."""
    steps = running.engine.stats().num_steps
    bad = httpx.post(f"{running.url}/v1/completions", json={"model": MODEL_NAME, "prompt": [[1, 2], [10**9]]})
    assert bad.status_code == 400
    huge = httpx.post(f"{running.url}/v1/completions",
                      json={"model": MODEL_NAME, "prompt": [5] * 900, "max_tokens": 900})  # fmt: skip
    assert huge.status_code == 400
    assert running.engine.stats().num_steps == steps and running.engine.num_waiting() == 0


def test_lifecycle_verbs_run_in_the_engine_process(running: Running) -> None:
    paused = httpx.post(f"{running.url}/pause", params={"mode": "abort"})
    assert paused.status_code == 200 and paused.json()["paused"] == "abort"
    refused = httpx.post(f"{running.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})
    assert refused.status_code == 503
    assert httpx.post(f"{running.url}/wake_up").status_code == 409  # awake: the engine's refusal, as a 409
    assert httpx.post(f"{running.url}/resume").json()["paused"] is None
    asleep = httpx.post(f"{running.url}/sleep", params={"level": 1})
    assert asleep.status_code == 200 and asleep.json()["sleep_level"] == 1
    assert httpx.post(f"{running.url}/wake_up").json()["sleep_level"] == 0
    ok = running.client().completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)
    assert ok.usage.completion_tokens >= 1


def test_a_client_that_leaves_frees_its_blocks(running: Running) -> None:
    with httpx.stream("POST", f"{running.url}/v1/completions",
                      json={"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 500, "stream": True,
                            "ignore_eos": True}, timeout=60) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    deadline = time.monotonic() + 30
    while running.engine.stats().num_in_flight or running.engine.stats().num_running:
        assert time.monotonic() < deadline, running.engine.stats()
        time.sleep(0.05)
    assert running.engine.stats().num_used_blocks == 0


def test_a_bad_source_fails_before_a_process_starts(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError):
        ProcessEngine.spawn(serve_args(tmp_path / "nothing"))


def test_an_engine_that_cannot_be_built_raises_its_error_here(model_folder: Path) -> None:
    """A KV budget below one block fails in the engine process; its typed error is raised in the server's."""
    with pytest.raises((CapacityError, InvalidArgumentError)):
        ProcessEngine.spawn(serve_args(model_folder, "--kv-budget", "16"))


def test_a_killed_engine_process_ends_every_stream_and_turns_health_red(model_folder: Path) -> None:
    r = Running(ProcessEngine.spawn(serve_args(model_folder)))
    try:
        got: dict[str, Any] = {}

        def stream() -> None:
            try:
                for _ in r.client().completions.create(model=MODEL_NAME, prompt="Once", max_tokens=400,
                                                       stream=True, extra_body={"ignore_eos": True}):  # fmt: skip
                    got.setdefault("first", time.monotonic())
                got["ended"] = "normally"
            except Exception as err:  # the stream's error event, or a cut connection
                got["ended"] = type(err).__name__

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 60
        while "first" not in got:
            assert time.monotonic() < deadline and "ended" not in got, got
            time.sleep(0.02)
        pid = r.engine.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        t.join(30)
        assert not t.is_alive() and "ended" in got
        assert httpx.get(f"{r.url}/health").status_code == 503
        after = httpx.post(f"{r.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})
        assert after.status_code == 503
    finally:
        r.stop()


def test_stopping_the_server_stops_the_engine_process(model_folder: Path) -> None:
    r = Running(ProcessEngine.spawn(serve_args(model_folder)))
    pid = r.engine.pid
    assert pid is not None and r.engine.alive
    r.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_an_id_in_flight_is_refused_and_a_stream_aborts_only_its_own(running: Running) -> None:
    import asyncio

    async def scenario() -> tuple[str | None, int]:
        client = running.engine
        params = SamplingParams(max_new_tokens=300, ignore_eos=True)
        first = client.add_request([1, 2, 3], params, request_id="same-id")
        with pytest.raises(InvalidArgumentError, match="already in use"):
            client.add_request([4, 5], params, request_id="same-id")
        got = [out async for out in _take(first, 2)]
        first.abort()
        async for out in first:
            got.append(out)
        return got[-1].finish_reason, len(got)

    reason, n = asyncio.run(scenario())
    assert reason == "abort" and n >= 3


async def _take(stream: Any, n: int) -> Any:
    async for out in stream:
        yield out
        n -= 1
        if n == 0:
            return
