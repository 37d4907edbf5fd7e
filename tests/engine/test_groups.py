"""Sample groups sent as separate requests (`Engine.add_request(..., group_id=...)`, pagedkv.engine.groups):
the group's prompt is computed once, the other requests take its blocks from the prefix cache, and their
outputs are those of requests without a group. Requests arriving in one step share a prompt without a
group too (the scheduler's `hold_shared_prefix`, one step); a group also waits out a prefill chunked over
several steps (a 16-token budget here, a 41-token prompt)."""

from __future__ import annotations

import pytest

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.scheduler import SchedulerConfig
from pagedkv.hf.tiny import tiny_model

PROMPT = [(7 * i) % 120 + 5 for i in range(41)]  # 10 full blocks of 4 and one token
BLOCK = 4


def engine() -> Engine:
    chunked = SchedulerConfig(max_num_batched_tokens=16)
    return Engine(tiny_model("llama", 0), None, EngineConfig(num_blocks=128, block_size=BLOCK, scheduler=chunked))


def run(eng: Engine, group_id: str | None, n: int = 8) -> list[list[int]]:
    params = [SamplingParams(max_new_tokens=2, ignore_eos=True, temperature=1.0, seed=i) for i in range(n)]
    ids = [eng.add_request(PROMPT, p, group_id=group_id) for p in params]
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = list(o.output_token_ids)
    return [outs[i] for i in ids]


def test_a_group_of_8_computes_its_prompt_once() -> None:
    grouped, alone = engine(), engine()
    got = run(grouped, "g1")
    want = run(alone, None)
    assert got == want  # seeded samples: the same tokens as requests computing the prompt themselves
    shared = (len(PROMPT) // BLOCK) * BLOCK  # the full blocks; the last partial one is computed again
    assert grouped.group_prefill_shared_tokens == 7 * shared
    # prompt once, the 7 others' last token, and one decode each
    assert grouped.stats.num_scheduled_tokens == len(PROMPT) + 7 * (len(PROMPT) - shared) + 8
    assert alone.stats.num_scheduled_tokens > grouped.stats.num_scheduled_tokens  # its hold lasts one step
    assert alone.group_prefill_shared_tokens == 0


def test_other_prompts_and_groups_are_not_held() -> None:
    eng = engine()
    a = eng.add_request(PROMPT, SamplingParams(max_new_tokens=1), group_id="g")
    b = eng.add_request(PROMPT[:-1] + [9], SamplingParams(max_new_tokens=1), group_id="g")
    c = eng.add_request(PROMPT, SamplingParams(max_new_tokens=1), group_id="h")
    assert eng._groups.held_ids() == set()  # another prompt, another group: each leads its own
    d = eng.add_request(PROMPT, SamplingParams(max_new_tokens=1), group_id="g")
    assert eng._groups.held_ids() == {d}  # a's prompt is not written yet
    e = eng.add_request(PROMPT, SamplingParams(max_new_tokens=1), group_id="g")
    assert eng.finish(e) is True and eng._groups.held_ids() == {d}  # ended while held
    done = {}
    while eng.has_unfinished():
        done |= {o.request_id: o.finish_reason for o in eng.step()}
    assert set(done) == {a, b, c, d, e} and done[e] == "abort"
    with pytest.raises(InvalidArgumentError, match="group_id"):
        eng.add_request(PROMPT, group_id="")
