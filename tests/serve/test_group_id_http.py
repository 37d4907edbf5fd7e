"""`group_id` over HTTP: separate requests of one sample group prefill their prompt once, driven by the real
`openai` client (extra_body), and `pagedkv:group_prefill_shared_tokens_total` counts what they did not compute.

The engine's step is gated until every request of the round is in, so the requests arrive together and the
group's leader is the only one to compute the prompt."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from .serve_support import MODEL_NAME, make_engine, scrape, start_server

PROMPT = [1] + list(range(100, 139))  # 40 tokens: 2 full blocks of 16 and a partial one
SHARED = "pagedkv:group_prefill_shared_tokens_total"


@pytest.fixture
def gated(model: Any, tokenizer: Any) -> Any:
    """A server whose engine does not step until `gate["want"]` requests have reached it (10 s at most)."""
    engine = make_engine(model, tokenizer)
    gate = {"want": 0, "seen": 0, "deadline": 0.0}
    add, step = engine.add_request, engine.step

    def counting_add(*args: Any, **kwargs: Any) -> str:
        gate["seen"] += 1
        return add(*args, **kwargs)

    def gated_step() -> Any:
        if gate["seen"] < gate["want"] and time.monotonic() < gate["deadline"]:
            time.sleep(0.005)
            return []
        return step()

    engine.add_request = counting_add  # type: ignore[method-assign]
    engine.step = gated_step  # type: ignore[method-assign]
    server = start_server(engine)
    yield server, gate
    server.stop()


def send_together(server: Any, gate: dict[str, Any], chat: bool, n: int, extra: dict[str, Any]) -> list[Any]:
    gate.update(want=gate["seen"] + n, deadline=time.monotonic() + 10)
    client = server.client()

    def one(_: int) -> Any:
        if chat:
            return client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": "a shared prompt " * 8}], max_tokens=4,
                temperature=0.0, extra_body={"ignore_eos": True, **extra},
            )  # fmt: skip
        return client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0.0,
                                         extra_body={"ignore_eos": True, **extra})  # fmt: skip

    with ThreadPoolExecutor(n) as pool:
        outs = list(pool.map(one, range(n)))
    assert gate["seen"] >= gate["want"], "the requests did not arrive together"
    return outs


def text(out: Any) -> str:
    choice = out.choices[0]
    return str(choice.message.content if hasattr(choice, "message") else choice.text)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_group_of_separate_requests_prefills_its_prompt_once(gated: Any, chat: bool) -> None:
    server, gate = gated
    n = 4
    alone = send_together(server, gate, chat, n, {"cache_salt": "alone"})  # a salt of its own: no hit on the next
    before = scrape(server.url)
    assert before[(SHARED, ())] == 0  # no group: nothing counted (the scheduler may still share the prefix)
    grouped = send_together(server, gate, chat, n, {"group_id": "prompt-7"})
    after = scrape(server.url)
    prompt_tokens = grouped[0].usage.prompt_tokens
    full_blocks = prompt_tokens // 16 * 16
    assert full_blocks >= 32
    cached = sorted(o.usage.prompt_tokens_details.cached_tokens for o in grouped)
    assert cached == [0] + [full_blocks] * (n - 1)  # the leader computed it, the others took its full blocks
    assert after[(SHARED, ())] == full_blocks * (n - 1)
    assert [text(o) for o in grouped] == [text(o) for o in alone]  # the same greedy answers


@pytest.mark.parametrize("bad", [5, "", ["a"], "x" * 257])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_bad_group_id_is_a_400_naming_it(gated: Any, chat: bool, bad: Any) -> None:
    server, _ = gated
    client = server.client()
    with pytest.raises(openai.BadRequestError) as err:
        if chat:
            client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, extra_body={"group_id": bad})  # fmt: skip
        else:
            client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, extra_body={"group_id": bad})
    assert err.value.status_code == 400
    body = err.value.body
    assert isinstance(body, dict) and body.get("param") == "group_id", body
    assert server.engine.scheduler.num_waiting == 0 and not server.engine.has_unfinished()
