"""The server under hostile or odd clients, each driven by a real client against a server on a free port: a
maximal text prompt is refused without freezing the event loop, a client that leaves while sending its body
is no server error, a request with one invalid prompt is a 400 whatever the queue, HTTP/1.0 clients get no
chunked stream, trailing slashes get an OpenAI 404, every counter has a sample from the start, and
`/v1/models` advertises the length the KV pool can really hold."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serve_support import MODEL_NAME, Server, make_engine, scrape, start_server

from pagedkv.serve.app import DEFAULT_MAX_BODY_BYTES

GOOD = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3, "temperature": 0}


def check_error(response: httpx.Response, status: int, param: str | None, code: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code), error
    return error


def serves(server: Server) -> None:
    response = httpx.post(f"{server.url}/v1/completions", json=GOOD, timeout=60)
    assert response.status_code == 200, response.text


# --- 1. a maximal prompt is refused off the event loop -----------------------------------------------


def _maximal_bodies() -> list[tuple[str, bytes]]:
    """A completion and a chat body whose text fills the default body limit (4 MiB) to within a few bytes."""
    room = DEFAULT_MAX_BODY_BYTES - 200
    completion = json.dumps({**GOOD, "prompt": "word " * (room // 5)}).encode()
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "word " * (room // 5)}], "max_tokens": 3}
    bodies = [("/v1/completions", completion), ("/v1/chat/completions", json.dumps(chat).encode())]
    assert all(len(b) <= DEFAULT_MAX_BODY_BYTES for _, b in bodies)
    return bodies


def test_health_answers_within_100_ms_while_a_maximal_prompt_is_refused(server: Server) -> None:
    """Before: the tokenizer ran on the event loop and /health waited 2-20 s behind a 1-4 MB prompt."""
    bodies = _maximal_bodies()
    answers: list[httpx.Response] = []
    sending = threading.Event()

    def send() -> None:
        with httpx.Client(timeout=120) as http:
            for path, body in bodies * 2:
                sending.set()
                answers.append(http.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"}))

    thread = threading.Thread(target=send)
    latencies: list[float] = []
    with httpx.Client(timeout=60) as health:
        assert health.get(f"{server.url}/health").status_code == 200  # the connection is open before
        thread.start()
        sending.wait(10)
        while thread.is_alive():
            start = time.perf_counter()
            assert health.get(f"{server.url}/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.005)
    thread.join()
    assert len(answers) == 4
    for response in answers:
        error = check_error(response, 400, None, "context_length_exceeded")
        assert "512 positions" in error["message"], error
    assert latencies and max(latencies) < 0.1, sorted(latencies)[-5:]
    serves(server)


def test_a_text_past_the_bound_gets_the_token_checks_400_and_one_under_it_is_tokenized(server: Server) -> None:
    ctx = server.uvicorn_server.config.app.state.context  # the app's ServerContext
    bound = ctx.max_prompt_chars
    assert bound == ctx.max_model_len * ctx.longest_token_chars and ctx.max_model_len == 512
    over = check_error(httpx.post(f"{server.url}/v1/completions", json={**GOOD, "prompt": "a" * (bound + 1)}), 400,
                       None, "context_length_exceeded")  # fmt: skip
    under = check_error(httpx.post(f"{server.url}/v1/completions", json={**GOOD, "prompt": "word " * 600}), 400,
                        None, "context_length_exceeded")  # fmt: skip  (tokenized: 600+ tokens > 512 positions)
    assert "512 positions" in over["message"] and "512 positions" in under["message"]
    serves(server)


# --- 2. a client that leaves while sending its body --------------------------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def records() -> Iterator[_Records]:
    """Every record of the server's loggers (uvicorn's do not propagate to the root)."""
    handler = _Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "uvicorn.access", "pagedkv")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
    logging.getLogger("pagedkv").setLevel(logging.INFO)
    yield handler
    for lg, level in zip(loggers, levels):
        lg.removeHandler(handler)
        lg.setLevel(level)


def test_a_client_that_leaves_while_sending_its_body_is_not_a_server_error(server: Server, records: _Records) -> None:
    """Before: starlette's ClientDisconnect reached the catch-all: a 500 and two tracebacks in the log."""
    host, port = server.url.removeprefix("http://").split(":")
    for path in ("/v1/completions", "/v1/chat/completions"):
        with socket.create_connection((host, int(port))) as sock:
            head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
            sock.sendall(head.encode() + b'{"model": "' + b"x" * 1000)
            time.sleep(0.05)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len([r for r in records.records if "disconnected" in r.getMessage()]) < 2:
        time.sleep(0.02)
    left = [r for r in records.records if "disconnected" in r.getMessage()]
    assert len(left) == 2 and all(r.levelno == logging.INFO and not r.exc_info for r in left), left
    loud = [r for r in records.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not loud, [r.getMessage() for r in loud]
    serves(server)


# --- 3. one invalid prompt: a 400 before admission control -------------------------------------------


def test_an_invalid_prompt_beside_a_valid_one_is_400_when_the_queue_is_full(model: Any, tokenizer: Any) -> None:
    """Before: the prompts were checked and queued one by one, so the first met the full queue (429)
    before the second was looked at."""
    inner = make_engine(model, tokenizer, num_blocks=64)
    release = threading.Event()
    real_step = inner.step

    def held_step() -> list[Any]:
        release.wait(60)
        return real_step()

    inner.step = held_step  # type: ignore[method-assign]
    running = start_server(inner, max_waiting=2)
    try:
        with httpx.Client(timeout=60) as http:
            filler = threading.Thread(target=http.post, args=(f"{running.url}/v1/completions",),
                                      kwargs={"json": {**GOOD, "prompt": [5, 6]}})  # fmt: skip
            filler.start()
            deadline = time.monotonic() + 10
            while running.async_engine.num_waiting() < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert running.async_engine.num_waiting() == 1
            for prompt in ([[1, 2], [3, 4], [10**9]], [[1, 2], [10**9]], [[10**9], [1, 2]]):
                response = http.post(f"{running.url}/v1/completions", json={**GOOD, "prompt": prompt})
                error = check_error(response, 400, "prompt", "invalid_value")
                assert "vocabulary" in error["message"], error
                assert running.async_engine.num_waiting() == 1  # nothing of it was queued
            release.set()
            filler.join(60)
        serves(running)
    finally:
        release.set()
        running.stop()


# --- 4. HTTP/1.0 ---------------------------------------------------------------------------------------


def _raw_http10(server: Server, path: str, body: dict[str, Any]) -> tuple[str, dict[str, str], bytes]:
    """Status line, headers and the body read until the server closes (HTTP/1.0: no keep-alive)."""
    host, port = server.url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head.encode() + data)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head_bytes, _, payload = raw.partition(b"\r\n\r\n")
    status, *lines = head_bytes.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return status, headers, payload


def test_http_1_0_clients_get_no_chunked_stream(server: Server) -> None:
    """Before: uvicorn framed the stream as chunked, which an HTTP/1.0 client cannot read."""
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    for path, body in (("/v1/completions", {**GOOD, "stream": True}), ("/v1/chat/completions", chat)):
        status, headers, payload = _raw_http10(server, path, body)
        assert "chunked" not in headers.get("transfer-encoding", ""), (status, headers)
        assert status.split()[1] == "400", status
        assert int(headers["content-length"]) == len(payload)
        error = json.loads(payload)["error"]
        assert (error["param"], error["code"]) == ("stream", "unsupported_http_version") and "HTTP/1.1" in error["message"]
    status, headers, payload = _raw_http10(server, "/v1/completions", GOOD)  # not streamed: served
    assert status.split()[1] == "200" and int(headers["content-length"]) == len(payload)
    assert json.loads(payload)["choices"][0]["finish_reason"] in ("stop", "length")
    assert server.engine.manager.num_used_blocks == 0


# --- 6. smaller: trailing slashes, counters at 0, the advertised length --------------------------------


def test_trailing_slashes_get_an_openai_404_not_a_redirect(server: Server) -> None:
    for method, path in (("GET", "/v1/models/"), ("POST", "/v1/chat/completions/"), ("POST", "/v1/completions/")):
        response = httpx.request(method, f"{server.url}{path}", json=GOOD)
        error = check_error(response, 404, None, "not_found")
        assert path.rstrip("/") in error["message"], error


def test_every_counter_has_a_sample_before_anything_happens(model: Any, tokenizer: Any) -> None:
    running = start_server(make_engine(model, tokenizer, num_blocks=64))
    try:
        samples = scrape(running.url)
        for name in ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens"):
            assert samples[(f"pagedkv:{name}_total", ())] == 0.0, name
        for reason in ("stop", "length", "abort", "error"):
            assert samples[("pagedkv:request_success_total", (("finished_reason", reason),))] == 0.0
        assert samples[("pagedkv:prefix_cache_hits_by_tier_total", (("tier", "GPU"),))] == 0.0
        assert samples[("pagedkv:time_to_first_token_seconds_count", ())] == 0.0
    finally:
        running.stop()


def test_models_advertises_what_the_kv_pool_can_hold(model: Any, tokenizer: Any, server: Server) -> None:
    card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert card["max_model_len"] == 512  # 256 blocks of 16 hold more than the model's 512 positions
    running = start_server(make_engine(model, tokenizer, num_blocks=8))  # 8 blocks of 16 (one is the null block)
    try:
        limit = running.engine.capacity_tokens
        assert limit < 512
        card = httpx.get(f"{running.url}/v1/models").json()["data"][0]
        assert card["max_model_len"] == limit
        fits = {**GOOD, "prompt": [7] * 100, "max_tokens": limit - 100}
        assert httpx.post(f"{running.url}/v1/completions", json=fits, timeout=60).status_code == 200
        too_long = {**GOOD, "prompt": [7] * 100, "max_tokens": limit - 99}
        check_error(httpx.post(f"{running.url}/v1/completions", json=too_long), 400, None, "context_length_exceeded")
    finally:
        running.stop()


# --- 5. the chaos rotation of `bench serve --soak-chaos` ------------------------------------------------


def test_the_chaos_rotation_gets_its_answers_and_leaves_nothing_behind(model: Any, tokenizer: Any) -> None:
    """Every kind of `pagedkv.bench.serve_soak.CHAOS_KINDS` twice, 4 at a time, against one server: each gets
    the answer it must get, and afterwards nothing is in flight, no block is held and no completion failed."""
    import asyncio
    import os
    from types import SimpleNamespace

    from pagedkv.bench.serve_soak import CHAOS_KINDS, _drive

    running = start_server(make_engine(model, tokenizer, num_blocks=256))
    try:
        target = SimpleNamespace(base_url=running.url, model_id=MODEL_NAME, pid=os.getpid())
        words = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "north"]
        samples, errors, first_error = asyncio.run(
            _drive(target, 2 * len(CHAOS_KINDS), 4, 10, words, chaos_prompt_bytes=1 << 20)  # type: ignore[arg-type]
        )
        assert (errors, first_error) == (0, None)
        assert samples[-1][0] == 2 * len(CHAOS_KINDS)
        deadline = time.monotonic() + 30
        while running.async_engine.stats().num_in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        snapshot = running.async_engine.stats()
        assert (snapshot.num_in_flight, snapshot.num_used_blocks) == (0, 0)
        running.engine.manager.check_invariants()
        assert scrape(running.url)[("pagedkv:request_success_total", (("finished_reason", "error"),))] == 0.0
        serves(running)
    finally:
        running.stop()
