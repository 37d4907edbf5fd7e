"""Bad input gets an OpenAI error body naming what is wrong, and the server keeps serving: malformed JSON,
wrong types, absurd values, a 10 MB body, an unknown model, a wrong API key, a prompt that can never fit
the KV pool, unknown paths. Overload is a 429 with Retry-After that leaves admitted requests untouched."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httpx
import openai
import pytest
from serve_support import MODEL_NAME, Server, make_engine, start_server

from pagedkv.engine.params import SamplingParams

GOOD = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3, "temperature": 0}

# (body, status, param, a word the message must contain)
BAD_BODIES: list[tuple[Any, int, str | None, str]] = [
    (b"{not json", 400, None, "JSON"),
    (b"", 400, None, "JSON"),
    (b"[1, 2]", 400, None, "object"),
    ({**GOOD, "max_tokens": "3"}, 400, "max_tokens", "integer"),
    ({**GOOD, "max_tokens": 2.5}, 400, "max_tokens", "integer"),
    ({**GOOD, "max_tokens": -1}, 400, "max_tokens", "greater"),
    ({**GOOD, "max_tokens": 10**30}, 400, None, "512 positions"),  # absurd: it names the limit
    ({**GOOD, "max_tokens": 0}, 400, "max_tokens", "echo"),
    ({**GOOD, "temperature": "hot"}, 400, "temperature", "number"),
    ({**GOOD, "temperature": 1e308}, 400, "temperature", "less"),
    ({**GOOD, "top_p": 0}, 400, "top_p", "greater"),
    ({**GOOD, "n": 0}, 400, "n", "greater"),
    ({**GOOD, "n": 10**9}, 400, "n", "less"),
    ({**GOOD, "n": True}, 400, "n", "integer"),
    ({**GOOD, "seed": -5}, 400, "seed", "greater"),
    ({**GOOD, "logprobs": 99}, 400, "logprobs", "less"),
    ({**GOOD, "stop": [""]}, 400, "stop", "non-empty"),
    ({**GOOD, "stop": 5}, 400, "stop", "string"),
    ({**GOOD, "stream": "yes"}, 400, "stream", "boolean"),
    ({**GOOD, "prompt": []}, 400, "prompt", "prompt"),
    ({**GOOD, "prompt": ""}, 400, "prompt", "empty"),
    ({**GOOD, "prompt": [1, -2]}, 400, "prompt", "accepted forms"),
    ({**GOOD, "prompt": [10**12]}, 400, "prompt", "vocabulary"),
    ({**GOOD, "prompt": [[1, 2], "x"]}, 400, "prompt", "prompt"),
    ({**GOOD, "prompt": {"a": 1}}, 400, "prompt", "prompt"),
    ({**GOOD, "prompt": "word " * 5000}, 400, None, "512 positions"),
    ({**GOOD, "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    ({**GOOD, "cache_salt": 7}, 400, "cache_salt", "string"),
    ({key: v for key, v in GOOD.items() if key != "model"}, 400, "model", "required"),
    ({**GOOD, "model": "gpt-4"}, 404, "model", "does not exist"),
]

BAD_CHAT: list[tuple[Any, int, str | None, str]] = [
    ({"model": MODEL_NAME, "messages": []}, 400, "messages", "at least 1"),
    ({"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", "user"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": 3}]}, 400, "messages.0.content", "string"),
    ({"model": MODEL_NAME, "messages": "hi"}, 400, "messages", "array"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs",
     "logprobs"),
]  # fmt: skip


def post(server: Server, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60, **kwargs)


def check_error(response: httpx.Response, status: int, param: str | None, word: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert word.lower() in error["message"].lower(), error


def serves(server: Server) -> None:
    response = post(server, "/v1/completions", GOOD)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize(("body", "status", "param", "word"), BAD_BODIES)
def test_bad_completion_bodies_get_their_error(server: Server, body: Any, status: int, param: str | None, word: str) -> None:
    check_error(post(server, "/v1/completions", body), status, param, word)
    serves(server)


@pytest.mark.parametrize(("body", "status", "param", "word"), BAD_CHAT)
def test_bad_chat_bodies_get_their_error(server: Server, body: Any, status: int, param: str | None, word: str) -> None:
    check_error(post(server, "/v1/chat/completions", body), status, param, word)
    serves(server)


def test_a_10_mb_body_is_413_and_the_server_keeps_serving(server: Server) -> None:
    body = json.dumps({**GOOD, "prompt": "x" * (10 * 1024 * 1024)}).encode()
    check_error(post(server, "/v1/completions", body), 413, None, "larger than")
    check_error(post(server, "/v1/completions", b"{" * (10 * 1024 * 1024)), 413, None, "larger than")
    serves(server)


def test_unknown_paths_and_methods_are_openai_errors(server: Server) -> None:
    check_error(httpx.get(f"{server.url}/v1/nothing"), 404, None, "not found")
    check_error(httpx.get(f"{server.url}/v1/completions"), 405, None, "not allowed")
    assert server.engine.manager.num_used_blocks == 0


def test_the_openai_client_sees_typed_errors(server: Server) -> None:
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=-3)


def test_api_key(model: Any, tokenizer: Any) -> None:
    running = start_server(make_engine(model, tokenizer, num_blocks=64), api_key="s3cret")
    try:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            check_error(post(running, "/v1/completions", GOOD, headers=headers), 401, None, "api key")
        check_error(httpx.get(f"{running.url}/v1/models"), 401, None, "api key")
        with pytest.raises(openai.AuthenticationError):
            running.client(api_key="wrong").completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
        ok = running.client(api_key="s3cret").completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
        assert ok.choices[0].text is not None
        assert httpx.get(f"{running.url}/health").status_code == 200  # operations endpoints stay open
    finally:
        running.stop()


def test_overload_is_429_with_retry_after_and_admitted_requests_are_unaffected(model: Any, tokenizer: Any) -> None:
    """max_waiting 4, and the engine thread held inside a step so that no request gets an output: of 12
    requests sent at once exactly 4 are admitted and 8 get 429 with Retry-After at once; released, the 4
    finish with the offline outputs."""
    prompts = [f"Overload {i} is a test of" for i in range(12)]
    expected = make_engine(model, tokenizer, num_blocks=64).generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    inner = make_engine(model, tokenizer, num_blocks=64)
    release = threading.Event()
    real_step = inner.step

    def held_step() -> list[Any]:
        release.wait(60)
        return real_step()

    inner.step = held_step  # type: ignore[method-assign]
    running = start_server(inner, max_waiting=4)

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as http:
            bodies = [{**GOOD, "prompt": p, "max_tokens": 6, "ignore_eos": True} for p in prompts]
            tasks = [asyncio.ensure_future(http.post(f"{running.url}/v1/completions", json=b)) for b in bodies]
            while sum(t.done() for t in tasks) < 8:  # the refusals come back while the step is held
                await asyncio.sleep(0.01)
            release.set()
            return list(await asyncio.gather(*tasks))

    try:
        responses = asyncio.run(send_all())
        ok = [(i, r) for i, r in enumerate(responses) if r.status_code == 200]
        refused = [r for r in responses if r.status_code != 200]
        assert (len(ok), len(refused)) == (4, 8), [r.status_code for r in responses]
        for r in refused:
            check_error(r, 429, None, "max-waiting")
            assert r.headers["retry-after"] == "1"
        for i, r in ok:
            assert r.json()["choices"][0]["text"] == expected[i].output_text
        serves(running)
    finally:
        release.set()
        running.stop()


def test_a_prompt_that_can_never_fit_the_kv_pool_is_400_naming_the_limit(model: Any, tokenizer: Any) -> None:
    running = start_server(make_engine(model, tokenizer, num_blocks=8))  # 8 blocks of 16 tokens
    try:
        body = {**GOOD, "prompt": "word " * 150, "max_tokens": 4}
        check_error(post(running, "/v1/completions", body), 400, None, "cache holds")
        message = post(running, "/v1/completions", body).json()["error"]["message"]
        assert "blocks of 16" in message and "this request" in message
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}
        check_error(post(running, "/v1/chat/completions", body), 400, None, "can never fit")
        serves(running)
        assert running.engine.manager.num_used_blocks == 0
    finally:
        running.stop()


ODD_BUT_VALID: list[dict[str, Any]] = [
    {"temperature": 1e-300},  # rounds to 0 in float32: it once killed the engine loop
    {"temperature": 2.0, "top_k": 10**30, "top_p": 1e-9},
    {"temperature": 1.0, "seed": 2**63 - 1, "n": 5},
    {"stop": ["x" * 100_000]},
    {"prompt": ["a"] * 300},
    {"max_tokens": None},
    {"logprobs": 20, "echo": True, "n": 3, "temperature": 1.0},
]


@pytest.mark.parametrize("extra", ODD_BUT_VALID)
def test_odd_but_valid_requests_are_served(server: Server, extra: dict[str, Any]) -> None:
    response = post(server, "/v1/completions", {**GOOD, **extra})
    assert response.status_code == 200, response.text
    assert all(c["finish_reason"] in ("stop", "length") for c in response.json()["choices"])
    serves(server)
