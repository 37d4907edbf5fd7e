"""The RL lifecycle over HTTP (pagedkv.serve.lifecycle_routes), driven by real clients: the `openai` package
for completions, raw HTTP (httpx) for the verbs it cannot send."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams

from .serve_support import MODEL_NAME, start_server

PROMPTS = [[1, 28, 29, 30, 31, 32, 33, 34, 35, 36, 40 + i, 50 + i] for i in range(4)]


def perturbed(model: Any) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {k: v + 0.5 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


def engine_of(model: Any, tokenizer: Any) -> Engine:
    config = EngineConfig(num_blocks=160, block_size=4, host_blocks=64, linear_backend="torch")
    return Engine(copy.deepcopy(model), tokenizer, config)


def texts(client: Any) -> list[str]:
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=6, temperature=0.0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    return [c.text for c in sorted(out.choices, key=lambda c: c.index)]


@pytest.fixture
def lifecycle_server(model: Any, tokenizer: Any) -> Any:
    engine = engine_of(model, tokenizer)
    step = engine.step

    def slow_step() -> Any:  # >= 5 ms a step: a 500-token stream outlasts the verbs sent after its first chunk
        time.sleep(0.005)
        return step()

    engine.step = slow_step  # type: ignore[method-assign]
    server = start_server(engine)
    yield server
    server.stop()


def test_update_weights_over_http_serves_only_the_new_weights(
    lifecycle_server: Any, model: Any, tokenizer: Any, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    server, client = lifecycle_server, lifecycle_server.client()
    new = perturbed(model)
    save_file({k: v.contiguous() for k, v in new.items()}, str(tmp_path / "model.safetensors"))
    old = texts(client)
    texts(client)  # the prefix cache and the host tier hold the old weights' KV
    r = httpx.post(f"{server.url}/update_weights", json={"path": str(tmp_path), "version": "7"}, timeout=60)
    assert r.status_code == 200 and r.json()["weight_version"] == "7" and r.json()["flushed"] is True
    raw = client.completions.with_raw_response.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=6,
                                                      temperature=0.0, extra_body={"ignore_eos": True})  # fmt: skip
    assert raw.headers["x-pagedkv-weight-version"] == "7"
    got = [c.text for c in sorted(raw.parse().choices, key=lambda c: c.index)]
    fresh = engine_of(model, tokenizer)
    fresh.update_weights(new)
    want = [o.output_text for o in fresh.generate(PROMPTS, SamplingParams(max_new_tokens=6, ignore_eos=True))]
    assert got == want != old
    assert client.models.list().data[0].model_extra["weight_version"] == "7"
    bad = httpx.post(f"{server.url}/update_weights", json={"path": str(tmp_path / "none")}, timeout=30)
    assert bad.status_code == 400 and "not a folder" in bad.json()["error"]["message"]


def test_the_verbs_need_the_api_key(model: Any, tokenizer: Any) -> None:
    server = start_server(engine_of(model, tokenizer), api_key="secret")
    try:
        for path in ("/pause", "/resume", "/sleep", "/wake_up", "/update_weights", "/reset_prefix_cache"):
            assert httpx.post(f"{server.url}{path}", timeout=30).status_code == 401
        assert httpx.get(f"{server.url}/lifecycle", timeout=30).status_code == 401
        ok = httpx.post(f"{server.url}/reset_prefix_cache", headers={"Authorization": "Bearer secret"}, timeout=30)
        assert ok.status_code == 200 and ok.headers["x-pagedkv-weight-version"] == "0"
    finally:
        server.stop()


def stream_in_thread(client: Any, max_tokens: int, got: dict[str, Any], started: threading.Event) -> threading.Thread:
    def run() -> None:
        try:
            chunks = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=max_tokens,
                                               temperature=0.0, stream=True, extra_body={"ignore_eos": True})  # fmt: skip
            text, reason = "", None
            for chunk in chunks:
                started.set()
                text += chunk.choices[0].text if chunk.choices else ""
                reason = chunk.choices[0].finish_reason if chunk.choices else reason
            got["text"], got["reason"] = text, reason
        except Exception as e:  # the test reads it
            got["error"] = e
        finally:
            started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_pause_abort_ends_streams_and_refuses_with_503_until_resume(lifecycle_server: Any) -> None:
    server, client = lifecycle_server, lifecycle_server.client()
    got: dict[str, Any] = {}
    started = threading.Event()
    thread = stream_in_thread(client, 500, got, started)
    assert started.wait(60)
    r = httpx.post(f"{server.url}/pause", params={"mode": "abort"}, timeout=60)
    assert r.status_code == 200 and r.json()["paused"] == "abort" and len(r.json()["aborted"]) == 1
    thread.join(60)
    assert "error" not in got and got["reason"] is not None and got["text"]
    with pytest.raises(openai.APIStatusError) as refused:
        texts(client)
    assert refused.value.status_code == 503 and "paused" in str(refused.value)
    assert httpx.post(f"{server.url}/resume", timeout=30).status_code == 200
    assert len(texts(client)) == 4


def test_pause_keep_with_an_update_while_a_stream_runs_then_resume(lifecycle_server: Any, model: Any, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    server, client = lifecycle_server, lifecycle_server.client()
    save_file({k: v.contiguous() for k, v in perturbed(model).items()}, str(tmp_path / "model.safetensors"))
    got: dict[str, Any] = {}
    started = threading.Event()
    thread = stream_in_thread(client, 500, got, started)
    assert started.wait(60)
    assert httpx.post(f"{server.url}/pause", params={"mode": "keep"}, timeout=60).json()["paused"] == "keep"
    state = httpx.get(f"{server.url}/lifecycle", timeout=30).json()
    assert state["paused"] == "keep"
    assert state["num_parked"] == 1
    up = httpx.post(f"{server.url}/update_weights", json={"model_path": str(tmp_path)}, timeout=60)
    assert up.status_code == 200 and up.json()["weight_version"] == "1" and up.json()["paused"] == "keep"
    r = httpx.post(f"{server.url}/resume", timeout=30)
    assert r.status_code == 200 and r.json()["paused"] is None
    thread.join(120)
    assert "error" not in got and got["reason"] == "length"


def test_pause_wait_answers_once_in_flight_requests_finished(lifecycle_server: Any) -> None:
    server, client = lifecycle_server, lifecycle_server.client()
    got: dict[str, Any] = {}
    started = threading.Event()
    thread = stream_in_thread(client, 48, got, started)
    assert started.wait(60)
    r = httpx.post(f"{server.url}/pause", params={"mode": "wait"}, timeout=120)
    assert r.status_code == 200 and r.json()["paused"] == "wait"
    thread.join(10)
    assert not thread.is_alive() and got["reason"] == "length"
    assert httpx.post(f"{server.url}/resume", timeout=30).status_code == 200


def test_sleep_gives_kv_back_refuses_requests_then_wake_up_serves(lifecycle_server: Any) -> None:
    server, client = lifecycle_server, lifecycle_server.client()
    before = texts(client)
    r = httpx.post(f"{server.url}/sleep", params={"level": 1}, timeout=60)
    assert r.status_code == 200 and r.json()["kv_bytes"] > 0 and r.json()["sleep_level"] == 1
    with pytest.raises(openai.APIStatusError) as refused:
        texts(client)
    assert refused.value.status_code == 503 and "asleep" in str(refused.value)
    again = httpx.post(f"{server.url}/sleep", params={"level": 1}, timeout=60)
    assert again.status_code == 409
    assert httpx.post(f"{server.url}/sleep", params={"level": 3}, timeout=60).status_code in (400, 409)
    woke = httpx.post(f"{server.url}/wake_up", timeout=60)
    assert woke.status_code == 200 and woke.json()["sleep_level"] == 0
    assert httpx.post(f"{server.url}/wake_up", timeout=60).status_code == 409
    assert texts(client) == before


def test_an_update_while_a_stream_runs_lets_it_finish_under_the_new_weights(
    lifecycle_server: Any, model: Any, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    server, client = lifecycle_server, lifecycle_server.client()
    save_file({k: v.contiguous() for k, v in perturbed(model).items()}, str(tmp_path / "model.safetensors"))
    got: dict[str, Any] = {}
    started = threading.Event()
    thread = stream_in_thread(client, 500, got, started)
    assert started.wait(60)
    up = httpx.post(f"{server.url}/update_weights", json={"path": str(tmp_path), "version": 2}, timeout=60)
    assert up.status_code == 200 and up.json()["weight_version"] == "2" and up.json()["paused"] is None
    assert up.json()["num_parked"] == 1  # it was streaming: parked, then recomputed under the new weights
    thread.join(120)
    assert "error" not in got and got["reason"] == "length"
    assert httpx.get(f"{server.url}/health", timeout=30).headers["x-pagedkv-weight-version"] == "2"


def test_a_verb_after_shutdown_is_refused_not_left_waiting(model: Any, tokenizer: Any) -> None:
    import asyncio

    from pagedkv.serve.async_engine import AsyncEngine, EngineDeadError

    async_engine = AsyncEngine(engine_of(model, tokenizer))
    async_engine.start()
    async_engine.shutdown()
    with pytest.raises(EngineDeadError):
        asyncio.run(async_engine.call(lambda e: e.pause("abort")))
