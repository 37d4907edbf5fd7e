"""Helpers for the server tests: a tiny random Llama that speaks SmolLM2's vocabulary (its tokenizer and chat
template come from the bundled GGUF, nothing is downloaded), an engine over it, and an in-process server
(uvicorn in a thread, on a free port of 127.0.0.1), stopped by the test."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.scheduler import SchedulerConfig

MODEL_NAME = "tiny-llama"


def make_engine(model: Any, tokenizer: Any, num_blocks: int = 256, **scheduler: Any) -> Engine:
    config = EngineConfig(num_blocks=num_blocks, block_size=16, scheduler=SchedulerConfig(**scheduler))
    return Engine(model, tokenizer, config)


@dataclass
class Server:
    """A running in-process server: its URL, its AsyncEngine and the Engine below it."""

    url: str
    async_engine: Any
    uvicorn_server: Any
    thread: threading.Thread

    @property
    def engine(self) -> Engine:
        return self.async_engine.engine  # type: ignore[no-any-return]

    def client(self, **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kwargs.pop("api_key", "none"), max_retries=0, **kwargs)

    def stop(self) -> None:
        self.uvicorn_server.should_exit = True
        self.thread.join(30)
        if self.thread.is_alive():
            raise RuntimeError("the test server did not stop")


def start_server(engine: Engine, *, max_waiting: int = 1024, api_key: str | None = None, **app_kwargs: Any) -> Server:
    import uvicorn

    from pagedkv.serve.app import build_app
    from pagedkv.serve.async_engine import AsyncEngine

    async_engine = AsyncEngine(engine, max_waiting=max_waiting)
    app = build_app(async_engine, model_name=MODEL_NAME, api_key=api_key, **app_kwargs)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    return Server(f"http://127.0.0.1:{sock.getsockname()[1]}", async_engine, server, thread)




Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    """Every sample of /metrics by (name, labels other than model_name), through prometheus_client's parser."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            assert s.labels.get("model_name") == MODEL_NAME, s
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[(s.name, labels)] = s.value
    return samples
