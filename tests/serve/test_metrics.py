"""/metrics, scraped with prometheus_client's parser, moves exactly as the requests sent say it must."""

from __future__ import annotations

import threading
from typing import Any

import httpx
from serve_support import MODEL_NAME, Samples, Server, make_engine, scrape, start_server


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_counters_and_histograms_move_as_the_requests_say(model: Any, tokenizer: Any) -> None:
    running = start_server(make_engine(model, tokenizer, num_blocks=128))
    try:
        client = running.client()
        before = scrape(running.url)
        prompt = " ".join(["shared prefix"] * 30)
        usages = []
        for body in ({"prompt": prompt, "max_tokens": 5}, {"prompt": prompt, "max_tokens": 7},
                     {"prompt": "short one", "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 1}):  # fmt: skip
            got = client.completions.create(model=MODEL_NAME, temperature=body.pop("temperature", 0),
                                            extra_body={"ignore_eos": True}, **body)  # fmt: skip
            usages.append(got.usage)
        after = scrape(running.url)
        prompt_tokens = sum(u.prompt_tokens for u in usages)
        cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
        assert cached >= 32  # the second request hit the first one's blocks
        assert delta(after, before, "pagedkv:prompt_tokens_total") == prompt_tokens
        assert delta(after, before, "pagedkv:generation_tokens_total") == 5 + 7 + 2 * 4
        assert delta(after, before, "pagedkv:prefix_cache_queries_total") == prompt_tokens
        assert delta(after, before, "pagedkv:prefix_cache_hits_total") == cached
        assert delta(after, before, "pagedkv:prefix_cache_hits_by_tier_total", tier="GPU") == cached
        assert delta(after, before, "pagedkv:request_success_total", finished_reason="length") == 4
        # the tokens not served cached, by why: the first long prompt found no key, "short one" fits no block
        missed = {r: delta(after, before, "pagedkv:prefix_cache_miss_tokens_total", reason=r)
                  for r in ("no_key", "short_prompt", "evicted", "salt", "partial_block")}  # fmt: skip
        assert missed["no_key"] > 0 and missed["short_prompt"] > 0, missed
        assert 0 < sum(missed.values()) <= prompt_tokens - cached, missed
        for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                     "time_per_output_token_seconds"):  # fmt: skip
            assert delta(after, before, f"pagedkv:{name}_count") == 4, name
            assert delta(after, before, f"pagedkv:{name}_sum") > 0, name
        # queue time ends when the step that first schedules a request starts: before its first token
        ttft_sum = delta(after, before, "pagedkv:time_to_first_token_seconds_sum")
        assert delta(after, before, "pagedkv:request_queue_time_seconds_sum") < ttft_sum
        for gauge in ("num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc"):
            assert after[(f"pagedkv:{gauge}", ())] == 0, gauge
    finally:
        running.stop()


def test_gauges_while_a_request_runs_and_preemptions(model: Any, tokenizer: Any) -> None:
    running = start_server(make_engine(model, tokenizer, num_blocks=10, admission_lookahead=0))
    try:
        first_chunk = threading.Event()
        finish = threading.Event()

        def long_stream() -> None:
            body = {"model": MODEL_NAME, "prompt": "one", "max_tokens": 120, "temperature": 0, "stream": True,
                    "ignore_eos": True}  # fmt: skip
            with httpx.Client(timeout=60) as http, http.stream("POST", f"{running.url}/v1/completions", json=body) as r:
                for _ in r.iter_lines():
                    first_chunk.set()
                    finish.wait(30)

        thread = threading.Thread(target=long_stream)
        thread.start()
        first_chunk.wait(30)
        mid = scrape(running.url)
        finish.set()
        thread.join()
        assert mid[("pagedkv:num_requests_running", ())] == 1
        assert 0 < mid[("pagedkv:kv_cache_usage_perc", ())] <= 1
        # four requests that together outgrow 10 blocks of 16 tokens under greedy admission: preemptions
        before = scrape(running.url)
        _four_growing(running)
        after = scrape(running.url)
        preemptions = delta(after, before, "pagedkv:num_preemptions_total")
        assert preemptions > 0 and after[("pagedkv:num_preemptions_total", ())] == running.engine.stats.num_preemptions
        assert after[("pagedkv:kv_cache_usage_perc", ())] == 0
    finally:
        running.stop()


def _four_growing(running: Server) -> None:
    from concurrent.futures import ThreadPoolExecutor

    client = running.client(timeout=60)

    def one(i: int) -> str | None:
        got = client.completions.create(model=MODEL_NAME, prompt=f"grow {i} " * 8, max_tokens=60, temperature=0,
                                        extra_body={"ignore_eos": True})  # fmt: skip
        return got.choices[0].finish_reason

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(one, range(4))) == ["length"] * 4
