"""A thin OpenAI-compatible HTTP shim over OpenVINO GenAI's ContinuousBatchingPipeline (it has no server).

This file is run by the openvino peer's own python (`$PAGEDKV_PEERS_DIR/openvino/venv`), not pagedkv's, so
it imports nothing from pagedkv: the standard library, fastapi, uvicorn, transformers (the tokenizer) and
openvino_genai only. It is a shim, not a product: `pagedkv bench serve` says so wherever it reports it.

One thread owns the pipeline: while a request is unfinished it calls `step()` (one batched forward of every
running request: OpenVINO's scheduler with dynamic split-fuse), and after each step it reads every handle's
new tokens and hands them to the request's asyncio queue. `add_request` is called from the event loop (the
pipeline guards its queue of new requests with its own lock). Prompts are tokenized with the model's
transformers tokenizer (chat templated for chat/completions) and passed as token ids; text is detokenized
incrementally (the full decode's new suffix, held back while it ends in a partial character).

Endpoints: GET /health, GET /v1/models, POST /v1/completions and /v1/chat/completions (greedy or sampled,
`max_tokens`, `ignore_eos`, `stream`, `stream_options.include_usage`). Usage:

    python openvino_shim.py --model IR_FOLDER [--host 127.0.0.1] [--port 0] [--threads N]
        [--num-kv-tokens T] [--max-num-batched-tokens B] [--max-num-seqs S] [--no-prefix-caching]
        [--precision f32|bf16]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request  # at module level: FastAPI resolves the handlers' string annotations here

OV_CPU_BLOCK_TOKENS = 32  # OpenVINO's CPU plugin pages its KV cache in blocks of 32 tokens


class Engine:
    """The pipeline and the thread that steps it; `submit` returns a queue of (token ids, finished)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import openvino_genai as ov_genai
        from transformers import AutoTokenizer

        self.ov_genai = ov_genai
        self.tokenizer = AutoTokenizer.from_pretrained(args.model)
        sched = ov_genai.SchedulerConfig()
        sched.num_kv_blocks = max(1, -(-args.num_kv_tokens // OV_CPU_BLOCK_TOKENS))
        sched.max_num_batched_tokens = args.max_num_batched_tokens
        sched.max_num_seqs = args.max_num_seqs
        sched.enable_prefix_caching = not args.no_prefix_caching
        sched.dynamic_split_fuse = True
        props = {"INFERENCE_NUM_THREADS": args.threads, "INFERENCE_PRECISION_HINT": args.precision,
                 "KV_CACHE_PRECISION": args.precision}  # fmt: skip
        self.pipe = ov_genai.ContinuousBatchingPipeline(args.model, sched, "CPU", props)
        self.eos = self.tokenizer.eos_token_id
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._live: dict[int, tuple[Any, asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="ov-step", daemon=True)
        self._thread.start()

    def submit(self, ids: list[int], max_tokens: int, ignore_eos: bool, temperature: float) -> asyncio.Queue[Any]:
        import openvino as ov

        config = self.ov_genai.GenerationConfig()
        config.max_new_tokens = max_tokens
        config.ignore_eos = ignore_eos
        if self.eos is not None and not ignore_eos:
            config.eos_token_id = self.eos
        if temperature > 0:
            config.do_sample = True
            config.temperature = temperature
        queue: asyncio.Queue[Any] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        tensor = ov.Tensor(__import__("numpy").array([ids], dtype="int64"))
        with self._lock:
            rid = next(self._ids)
            handle = self.pipe.add_request(rid, tensor, config)
            self._live[rid] = (handle, loop, queue)
        self._wake.set()
        return queue

    def _loop(self) -> None:
        running = self.ov_genai.GenerationStatus.RUNNING
        while not self._stop:
            if not self.pipe.has_non_finished_requests():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            self.pipe.step()
            with self._lock:
                items = list(self._live.items())
            for rid, (handle, loop, queue) in items:
                new: list[int] = []
                if handle.can_read():
                    for out in handle.read().values():
                        new.extend(int(t) for t in out.generated_ids)
                done = handle.get_status() != running and not handle.can_read()
                if new or done:
                    loop.call_soon_threadsafe(queue.put_nowait, (new, done))
                if done:
                    with self._lock:
                        self._live.pop(rid, None)

    def close(self) -> None:
        self._stop = True
        self._wake.set()


class Detokenizer:
    """Incremental text of a growing token list (the full decode's new suffix)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.ids, self.sent = tokenizer, list[int](), ""

    def add(self, ids: list[int], final: bool = False) -> str:
        self.ids.extend(ids)
        text: str = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta


def prompt_ids(engine: Engine, body: dict[str, Any], chat: bool) -> list[int]:
    """The request's prompt as token ids: chat messages through the chat template, text tokenized, ids kept."""
    if chat:
        ids: Any = engine.tokenizer.apply_chat_template(body.get("messages", []), add_generation_prompt=True,
                                                   tokenize=True)  # fmt: skip
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    prompt = body.get("prompt", "")
    return list(engine.tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else list(prompt)


class Reply:
    """The OpenAI objects of one request: completion or chat, whole or chunked."""

    def __init__(self, body: dict[str, Any], chat: bool, model_id: str, num_prompt: int) -> None:
        self.chat, self.model_id, self.num_prompt = chat, model_id, num_prompt
        self.max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def finish_reason(self, num_out: int) -> str:
        return "length" if num_out >= self.max_tokens else "stop"

    def usage(self, num_out: int) -> dict[str, int]:
        return {"prompt_tokens": self.num_prompt, "completion_tokens": num_out,
                "total_tokens": self.num_prompt + num_out}  # fmt: skip

    def obj(self, text: str | None, finish: str | None, stream: bool, usage: int | None = None) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if stream else "chat.completion"
            choice = {"index": 0, "delta" if stream else "message": {"role": "assistant", "content": text},
                      "finish_reason": finish}  # fmt: skip
        else:
            kind = "text_completion"
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        out: dict[str, Any] = {"id": self.id, "object": kind, "created": self.created, "model": self.model_id,
                               "choices": [] if text is None else [choice]}  # fmt: skip
        if usage is not None:
            out["usage"] = self.usage(usage)
        return out


async def _tokens(queue: asyncio.Queue[Any]) -> AsyncIterator[tuple[list[int], bool]]:
    while True:
        new, done = await queue.get()
        yield new, done
        if done:
            return


async def _events(engine: Engine, reply: Reply, queue: asyncio.Queue[Any], include_usage: bool) -> AsyncIterator[str]:
    detok, num_out = Detokenizer(engine.tokenizer), 0
    async for new, done in _tokens(queue):
        num_out += len(new)
        text = detok.add(new, final=done)
        finish = reply.finish_reason(num_out) if done else None
        if text or finish:
            yield f"data: {json.dumps(reply.obj(text, finish, True))}\n\n"
    if include_usage:
        yield f"data: {json.dumps(reply.obj(None, None, True, usage=num_out))}\n\n"
    yield "data: [DONE]\n\n"


def build_app(engine: Engine, model_id: str) -> Any:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="OpenVINO GenAI shim (pagedkv bench)")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "server": "openvino-genai shim"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "owned_by": "openvino-shim"}]}

    async def handle(request: Request, chat: bool) -> Any:
        body = await request.json()
        try:
            ids = prompt_ids(engine, body, chat)
        except ValueError as err:  # e.g. chat with a tokenizer that has no chat template
            return JSONResponse({"error": {"message": str(err), "type": "invalid_request_error"}}, 400)
        if not ids:
            return JSONResponse({"error": {"message": "empty prompt", "type": "invalid_request_error"}}, 400)
        reply = Reply(body, chat, model_id, len(ids))
        queue = engine.submit(ids, reply.max_tokens, bool(body.get("ignore_eos", False)),
                              float(body.get("temperature") or 0.0))  # fmt: skip
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(_events(engine, reply, queue, include_usage), media_type="text/event-stream")
        out: list[int] = []
        async for new, _ in _tokens(queue):
            out.extend(new)
        text = Detokenizer(engine.tokenizer).add(out, final=True)
        return reply.obj(text, reply.finish_reason(len(out)), False, usage=len(out))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an OpenVINO IR folder (optimum-cli export openvino)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--num-kv-tokens", type=int, default=4096)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--precision", choices=("f32", "bf16"), default="f32")
    args = parser.parse_args()

    import uvicorn

    engine = Engine(args)
    print("OpenVINO GenAI shim: a thin OpenAI server over ContinuousBatchingPipeline (not an OpenVINO product)",
          flush=True)  # fmt: skip
    try:
        uvicorn.run(build_app(engine, args.served_model_name or args.model), host=args.host, port=args.port,
                    log_level="info")  # fmt: skip
    finally:
        engine.close()


if __name__ == "__main__":
    main()
