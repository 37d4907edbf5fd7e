"""What a server needs from the engine: log-probabilities of generated and prompt tokens, `release` of a
finished request's outputs and ids, and bounded per-step statistics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.outputs import EngineStats
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.scheduler import SchedulerConfig
from pagedkv.hf.tiny import VOCAB, tiny_model


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=n).tolist()


def eager_logprobs(ids: list[int]) -> torch.Tensor:
    """log_softmax of a fresh copy of the tiny llama's logits at every position, with transformers' own
    attention (the oracle)."""
    model = tiny_model("llama")
    model.set_attn_implementation("eager")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), -1)


def test_generated_logprobs_match_the_model_and_leave_tokens_unchanged() -> None:
    engine = Engine(tiny_model("llama"), None, EngineConfig(num_blocks=64, block_size=4))
    prompt = prompt_of(9)
    greedy, sampled, sampled_plain = engine.generate(
        [prompt] * 3,
        [
            SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=3),
            SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=1.0, seed=5, logprobs=0),
            SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=1.0, seed=5),
        ],
    )
    assert sampled.output_token_ids == sampled_plain.output_token_ids  # asking costs no draw
    assert sampled_plain.logprobs is None and sampled.logprobs is not None
    assert all(e.top == () for e in sampled.logprobs)
    assert greedy.logprobs is not None and len(greedy.logprobs) == 6
    oracle = eager_logprobs(prompt + greedy.output_token_ids)
    for i, entry in enumerate(greedy.logprobs):
        row = oracle[len(prompt) - 1 + i]
        assert entry.token_id == greedy.output_token_ids[i]
        assert entry.top[0][0] == entry.token_id  # greedy: the most likely token
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-4)
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()


@pytest.mark.parametrize("budget", [512, 8])  # one prefill chunk, or chunks of 8 tokens
def test_prompt_logprobs_score_every_prompt_token_even_when_cached(budget: int) -> None:
    config = EngineConfig(num_blocks=64, block_size=4, scheduler=SchedulerConfig(max_num_batched_tokens=budget))
    engine = Engine(tiny_model("llama"), None, config)
    prompt = prompt_of(21, seed=1)
    engine.generate([prompt], SamplingParams(max_new_tokens=2))  # the prompt's blocks are now cached
    [plain, scored] = engine.generate(
        [prompt, prompt], [SamplingParams(max_new_tokens=3), SamplingParams(max_new_tokens=3, prompt_logprobs=2)]
    )
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None
    assert scored.num_cached_tokens == 0  # it computed its whole prompt
    assert scored.output_token_ids == plain.output_token_ids
    got = scored.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    oracle = eager_logprobs(prompt)
    for p in range(1, len(prompt)):
        entry = got[p]
        assert entry is not None and entry.token_id == prompt[p]
        assert entry.logprob == pytest.approx(float(oracle[p - 1, prompt[p]]), abs=1e-4)
        assert [t for t, _ in entry.top] == oracle[p - 1].topk(2).indices.tolist()
    engine.manager.check_invariants()
    assert engine.manager.num_used_blocks == 0


def test_parallel_samples_each_get_their_own_logprobs() -> None:
    engine = Engine(tiny_model("llama"), None, EngineConfig(num_blocks=64, block_size=4))
    params = SamplingParams(max_new_tokens=5, temperature=1.0, seed=2, n=3, ignore_eos=True, logprobs=1)
    outputs = engine.generate([prompt_of(7)], params)
    assert len(outputs) == 3
    for out in outputs:
        assert out.logprobs is not None
        assert [e.token_id for e in out.logprobs] == out.output_token_ids


def test_release_hands_back_a_family_once_it_has_ended_and_frees_its_ids() -> None:
    engine = Engine(tiny_model("llama"), None, EngineConfig(num_blocks=64, block_size=4))
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=0, n=2, ignore_eos=True)
    rid = engine.add_request(prompt_of(6), params, request_id="a")
    assert engine.release(rid) is None  # still running: nothing changes
    engine.step()
    assert engine.release(rid) is None
    engine.run()
    outputs = engine.release(rid)
    assert outputs is not None and [o.request_id for o in outputs] == ["a", "a.1"]
    assert all(o.finished for o in outputs)
    with pytest.raises(InvalidArgumentError, match="never added, or released"):
        engine.release(rid)
    engine.add_request(prompt_of(6), params, request_id="a")  # the ids are free again
    engine.finish("a")  # aborted before its prompt ran: no child is ever forked
    assert engine.release("a") is None  # its end has not been delivered by step() yet
    engine.run()
    released = engine.release("a")
    assert released is not None and [(o.request_id, o.finish_reason) for o in released] == [("a", "abort")]
    assert not engine._outputs and not engine._ids_in_use


def test_stats_trim_keeps_the_latest_samples() -> None:
    stats = EngineStats(num_steps=5, step_times=[1.0, 2.0, 3.0], running=[1, 2, 3], live_tokens=[4, 5, 6], used_blocks=[7, 8, 9])
    stats.trim(2)
    assert (stats.step_times, stats.running, stats.live_tokens, stats.used_blocks) == ([2.0, 3.0], [2, 3], [5, 6], [8, 9])
    assert stats.num_steps == 5
    with pytest.raises(InvalidArgumentError):
        stats.trim(0)


@pytest.mark.parametrize("bad", [-1, 21, True, 2.0, "3"])
def test_logprob_counts_are_checked(bad: object) -> None:
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidArgumentError, match=field):
            SamplingParams(**{field: bad})  # type: ignore[arg-type]


def test_a_vanishing_temperature_samples_the_argmax_instead_of_failing_the_step() -> None:
    """1e-300 rounds to 0 in float32: the scaled maxima were 0 / 0 = NaN and the step raised for everyone."""
    engine = Engine(tiny_model("llama"), None, EngineConfig(num_blocks=64, block_size=4))
    prompt = prompt_of(8, seed=4)
    tiny, greedy = engine.generate(
        [prompt, prompt],
        [SamplingParams(max_new_tokens=5, temperature=1e-300, seed=1), SamplingParams(max_new_tokens=5)],
    )
    assert tiny.finish_reason == greedy.finish_reason and tiny.output_token_ids == greedy.output_token_ids
