"""Engine features beyond greedy equivalence: parallel sampling, rejection, stops, seeds, streaming, metrics."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.core.errors import CapacityError
from pagedkv.engine.config import EngineConfig, parse_bytes
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.hf.oracle import reference_generate
from pagedkv.hf.tiny import VOCAB, tiny_model


def prompts_of(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in lengths]


class LetterTokenizer:
    """Token i decodes to one letter: enough for stop strings without a real vocabulary."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_parallel_sampling_shares_prompt_blocks_then_diverges() -> None:
    engine = Engine(tiny_model("llama"), None, EngineConfig(num_blocks=64, block_size=4))
    prompt = prompts_of((18,))[0]  # 4 full blocks + 2 tokens in a shared partial block
    params = SamplingParams(max_new_tokens=10, temperature=1.5, seed=3, n=3, ignore_eos=True)
    rid = engine.add_request(prompt, params)
    engine.step()  # prefill + first tokens: the children are forked here
    ids = [rid, f"{rid}.1", f"{rid}.2"]
    tables = [engine.manager.block_ids(engine.get_request(i).seq_id) for i in ids]
    assert tables[0][:4] == tables[1][:4] == tables[2][:4]  # the prompt's full blocks are shared
    engine.step()  # each writes its first token into its own copy of the partial block (copy-on-write)
    tables = [engine.manager.block_ids(engine.get_request(i).seq_id) for i in ids]
    assert tables[0][:4] == tables[1][:4] == tables[2][:4]
    assert len({t[4] for t in tables}) == 3
    engine.run()
    outputs = [engine.output(i) for i in ids]
    assert all(len(o.output_token_ids) == 10 for o in outputs)
    assert len({tuple(o.output_token_ids) for o in outputs}) == 3  # they diverge
    assert [o.parent_id for o in outputs] == [None, rid, rid]
    engine.manager.check_invariants()
    assert engine.manager.num_used_blocks == 0


def test_parallel_sampling_through_generate_is_seeded() -> None:
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=11, n=2, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = Engine(tiny_model("gpt2"), None, EngineConfig(num_blocks=64, block_size=4))
        outputs = engine.generate(prompts_of((7, 12)), params)
        runs.append([(o.request_id, o.output_token_ids) for o in outputs])
        assert [o.parent_id is None for o in outputs] == [True, False, True, False]
    assert runs[0] == runs[1]


def test_request_that_can_never_fit_is_rejected_and_the_rest_complete() -> None:
    model = tiny_model("llama")
    prompts = prompts_of((5, 60, 9))
    engine = Engine(model, None, EngineConfig(num_blocks=12, block_size=4))  # 11 usable blocks = 44 tokens
    with pytest.raises(CapacityError, match="can never fit"):
        engine.add_request(prompts[1], SamplingParams(max_new_tokens=8))
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=8))
    assert [o.finish_reason for o in outputs][1] == "rejected"
    assert "never fit" in (outputs[1].error or "")
    expected = reference_generate(
        model, [prompts[0], prompts[2]], 8, eos_token_id=2, attn_implementation="eager"
    )
    assert [outputs[0].output_token_ids, outputs[2].output_token_ids] == expected
    assert engine.manager.num_used_blocks == 0


def test_stop_strings_and_stop_token_ids() -> None:
    model = tiny_model("qwen2")
    prompt = prompts_of((6,))[0]
    free = Engine(model, LetterTokenizer(), EngineConfig(num_blocks=64, block_size=4))
    full = free.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    stop = full.output_text[4:6]
    cut = full.output_text.find(stop)
    engine = Engine(model, LetterTokenizer(), EngineConfig(num_blocks=64, block_size=4))
    out = engine.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True, stop=(stop,)))[0]
    assert out.finish_reason == "stop"
    assert out.output_text == full.output_text[:cut]
    assert out.output_token_ids == full.output_token_ids[: len(out.output_token_ids)]
    token = full.output_token_ids[3]
    first = full.output_token_ids.index(token)
    out = engine.generate(
        [prompt], SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=(token,))
    )[0]
    assert (out.finish_reason, out.output_token_ids) == ("stop", full.output_token_ids[: first + 1])


def test_streaming_callback_sees_every_token_and_metrics_are_set() -> None:
    engine = Engine(tiny_model("mistral"), None, EngineConfig(num_blocks=64, block_size=4))
    seen: dict[str, list[int]] = {}

    def on_token(out: object) -> None:
        seen.setdefault(out.request_id, []).append(len(out.output_token_ids))  # type: ignore[attr-defined]

    outputs = engine.generate(
        prompts_of((4, 11)), SamplingParams(max_new_tokens=5, ignore_eos=True), on_token=on_token
    )
    for o in outputs:
        assert seen[o.request_id] == [1, 2, 3, 4, 5]
        assert o.ttft_s is not None and o.ttft_s > 0
        assert o.tpot_s is not None and o.tpot_s > 0
        assert o.e2e_s is not None and o.e2e_s >= o.ttft_s
    assert engine.stats.peak_concurrency == 2
    assert 0 < engine.stats.kv_utilization(engine.capacity_tokens) <= 1


def test_kv_budget_in_bytes_sets_the_block_count() -> None:
    model = tiny_model("llama")  # 2 layers x 2 KV heads x 16 dims x fp32: 512 bytes a token
    engine = Engine(model, None, EngineConfig(kv_budget_bytes=parse_bytes("64KiB"), block_size=16))
    assert engine.kv_budget_bytes == 64 * 1024
    assert engine.manager.num_blocks == 8 - 1  # 8 blocks of 16 tokens, minus the null block
    with pytest.raises(CapacityError, match="at least 2"):
        Engine(model, None, EngineConfig(kv_budget_bytes=4096, block_size=16))


def test_ignore_eos_decodes_past_eos_like_generate_without_eos() -> None:
    model = tiny_model("qwen2")
    prompts = prompts_of((5, 17, 9, 30, 3), seed=1)
    engine = Engine(model, None, EngineConfig(num_blocks=64, block_size=4))
    stopped = engine.generate(prompts, SamplingParams(max_new_tokens=12))
    hit = [i for i, o in enumerate(stopped) if o.finish_reason == "stop"]
    assert hit, "the seeded tiny model emits EOS (id 2) for one of these prompts"
    chosen = [prompts[i] for i in hit]
    full = engine.generate(chosen, SamplingParams(max_new_tokens=12, ignore_eos=True))
    expected = reference_generate(model, chosen, 12, eos_token_id=None, attn_implementation="eager")
    assert [o.output_token_ids for o in full] == expected
    assert all(len(o.output_token_ids) == 12 and 2 in o.output_token_ids[:-1] for o in full)
