"""The server through the real `openai` client: greedy outputs equal `Engine.generate` (streamed or not),
n > 1, stop strings, seeds, logprobs, echo scoring, chat through SmolLM2's template, usage and cached tokens,
64 concurrent streams, and clients that leave mid-stream."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from serve_support import MODEL_NAME, Server, make_engine, scrape, start_server

from pagedkv.engine.params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "Paged attention stores the KV cache in fixed-size blocks so that",
]


def offline(model: Any, tokenizer: Any, prompts: list[str], params: SamplingParams) -> list[Any]:
    """The same prompts through `Engine.generate` on a fresh engine (the oracle)."""
    return make_engine(model, tokenizer).generate(prompts, params)


def stream_text(client: Any, **kwargs: Any) -> tuple[str, str | None, int]:
    """(text, finish_reason, chunks) of one streamed completion."""
    text, reason, chunks = "", None, 0
    for chunk in client.completions.create(model=MODEL_NAME, stream=True, **kwargs):
        chunks += 1
        for choice in chunk.choices:
            text += choice.text
            reason = choice.finish_reason or reason
    return text, reason, chunks


def test_greedy_completions_equal_offline_generate_streamed_or_not(server: Server, model: Any, tokenizer: Any) -> None:
    expected = offline(model, tokenizer, PROMPTS, SamplingParams(max_new_tokens=12))
    client = server.client()
    batch = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert batch.object == "text_completion" and batch.model == MODEL_NAME and batch.id.startswith("cmpl-")
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [o.output_text for o in expected]
    assert [c.finish_reason for c in batch.choices] == [o.finish_reason for o in expected]
    assert batch.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    assert batch.usage.completion_tokens == sum(len(o.output_token_ids) for o in expected)
    for prompt, out in zip(PROMPTS, expected):
        text, reason, chunks = stream_text(client, prompt=prompt, max_tokens=12, temperature=0)
        assert (text, reason) == (out.output_text, out.finish_reason)
        assert chunks >= 2  # it did stream
    ids = expected[0].prompt_token_ids
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == expected[0].output_text
    two = client.completions.create(model=MODEL_NAME, prompt=[ids, expected[1].prompt_token_ids], max_tokens=12, temperature=0)
    assert [c.text for c in two.choices] == [expected[0].output_text, expected[1].output_text]


def test_n_seeds_and_stop_strings(server: Server, model: Any, tokenizer: Any) -> None:
    client = server.client()
    prompt = PROMPTS[1]
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=7, n=3, ignore_eos=True)
    expected = [o.output_text for o in offline(model, tokenizer, [prompt], params)]
    got = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=1.0, seed=7, n=3,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == expected  # seeded: child i draws from seed + i
    assert len(set(expected)) == 3
    streamed = ["", "", ""]
    for chunk in client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=1.0, seed=7,
                                           n=3, stream=True, extra_body={"ignore_eos": True}):  # fmt: skip
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == expected
    # a stop string across a token boundary: the text is cut before it, also when streamed (the stream holds
    # back the first character until it knows it does not start the stop string)
    out = offline(model, tokenizer, [PROMPTS[0]], SamplingParams(max_new_tokens=16))[0]
    full = out.output_text
    stop, cut = boundary_stop(tokenizer, out.output_token_ids, full)
    got = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop])
    assert (got.choices[0].text, got.choices[0].finish_reason) == (cut, "stop")
    assert stream_text(client, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=stop)[:2] == (cut, "stop")


def boundary_stop(tokenizer: Any, ids: list[int], full: str) -> tuple[str, str]:
    """A two-character stop string whose first character ends token i's text and whose second starts token
    i + 1's, first occurring there; and the text before it."""
    for i in range(2, len(ids)):
        end = len(tokenizer.decode(ids[:i], skip_special_tokens=True))
        stop = full[end - 1 : end + 1]
        if len(stop) == 2 and "\ufffd" not in stop and full.find(stop) == end - 1:
            return stop, full[: end - 1]
    raise AssertionError(f"no token boundary to stop at in {full!r}")


def test_logprobs_and_echo_scoring(server: Server, model: Any, tokenizer: Any) -> None:
    client = server.client()
    expected = offline(model, tokenizer, [PROMPTS[2]], SamplingParams(max_new_tokens=5, logprobs=3))[0]
    got = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=5, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-5)
    assert lp.tokens == [tokenizer.decode([t]) for t in expected.output_token_ids]
    assert all(len(top) <= 3 for top in lp.top_logprobs)
    # echo + max_tokens 0: the scoring call; the prompt's own tokens score what the first call generated
    ids = expected.prompt_token_ids + expected.output_token_ids
    scored = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert choice.text == tokenizer.decode(ids)
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.token_logprobs) == len(ids)
    tail = choice.logprobs.token_logprobs[len(expected.prompt_token_ids) :]
    assert tail == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
    # echo with generation: the prompt as sent, then the completion; streamed the same
    both = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=5, temperature=0, echo=True)
    assert both.choices[0].text == PROMPTS[2] + expected.output_text
    assert stream_text(client, prompt=PROMPTS[2], max_tokens=5, temperature=0, echo=True)[0] == both.choices[0].text


def test_chat_through_smollm2_template_with_usage_in_the_stream(server: Server, model: Any, tokenizer: Any) -> None:
    client = server.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    expected = make_engine(model, tokenizer).generate([list(ids)], SamplingParams(max_new_tokens=9))[0]
    got = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=9, temperature=0)
    assert got.object == "chat.completion" and got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == expected.output_text
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(expected.output_token_ids)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=9, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.output_text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.output_token_ids)
    assert all(c.usage is None for c in chunks[:-1])
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [expected.finish_reason]


def test_cached_tokens_and_cache_salt(server: Server) -> None:
    client = server.client()
    prompt = " ".join(["memory pages"] * 40)  # several full blocks
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    salted = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0,
                                       extra_body={"cache_salt": "tenant-b"})  # fmt: skip
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 64
    assert salted.usage.prompt_tokens_details.cached_tokens == 0  # another tenant sees none of it


def test_models_and_health(server: Server) -> None:
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_64_concurrent_streams_each_complete_and_equal_offline(model: Any, tokenizer: Any) -> None:
    prompts = [f"Request {i}: tell me about block {i * 7}" for i in range(64)]
    expected = offline(model, tokenizer, prompts, SamplingParams(max_new_tokens=8))
    running = start_server(make_engine(model, tokenizer, num_blocks=256))
    try:
        client = running.client(timeout=120)
        with ThreadPoolExecutor(64) as pool:
            got = list(pool.map(lambda p: stream_text(client, prompt=p, max_tokens=8, temperature=0)[:2], prompts))
        assert got == [(o.output_text, o.finish_reason) for o in expected]
        assert max(running.engine.stats.running) > 1  # they were batched
    finally:
        running.stop()


def test_clients_leaving_mid_stream_leave_no_block_in_use(model: Any, tokenizer: Any) -> None:
    running = start_server(make_engine(model, tokenizer, num_blocks=256))
    try:
        body = {"model": MODEL_NAME, "prompt": "Tell me a long story", "max_tokens": 400, "temperature": 0,
                "stream": True, "extra": 1, "ignore_eos": True}  # fmt: skip
        left = threading.Barrier(9)

        def leave_after_two_chunks() -> None:
            with httpx.Client(timeout=60) as http, http.stream("POST", f"{running.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                for i, _ in enumerate(r.iter_lines()):
                    if i >= 4:
                        break  # closing the stream drops the connection
            left.wait()

        threads = [threading.Thread(target=leave_after_two_chunks) for _ in range(8)]
        for t in threads:
            t.start()
        left.wait()
        for t in threads:
            t.join()
        wait_until(lambda: running.async_engine.stats().num_in_flight == 0)
        snapshot = running.async_engine.stats()
        assert snapshot.num_used_blocks == 0 and snapshot.num_running == 0
        running.engine.manager.check_invariants()
        assert not running.engine.has_unfinished() and not running.engine._outputs
        metrics = scrape(running.url)
        assert metrics[("pagedkv:kv_cache_usage_perc", ())] == 0.0
        assert metrics[("pagedkv:request_success_total", (("finished_reason", "abort"),))] == 8
    finally:
        running.stop()


def test_a_client_that_times_out_has_its_request_aborted(model: Any, tokenizer: Any) -> None:
    running = start_server(make_engine(model, tokenizer, num_blocks=256))
    try:
        body = {"model": MODEL_NAME, "prompt": "Tell", "max_tokens": 500, "temperature": 0, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{running.url}/v1/completions", json=body, timeout=0.3)
        wait_until(lambda: running.async_engine.stats().num_in_flight == 0)
        metrics = scrape(running.url)
        assert metrics[("pagedkv:request_success_total", (("finished_reason", "abort"),))] == 1
        assert running.async_engine.stats().num_used_blocks == 0
        running.engine.manager.check_invariants()
    finally:
        running.stop()


def wait_until(condition: Any, timeout_s: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)
