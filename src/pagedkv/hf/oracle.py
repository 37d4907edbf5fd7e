"""transformers' own `generate`, as the oracle pagedkv's engine is compared against.

`reference_generate` runs each prompt alone (no padding, so nothing but the attention backend differs from a
pagedkv run) with greedy decoding and the model's own attention (`sdpa` by default), and returns the new
token ids. The model's attention implementation is restored afterwards, so one model object can serve both
sides of an equivalence test.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from transformers import GenerationConfig


@contextmanager
def attention_implementation(model: Any, name: str) -> Iterator[None]:
    """Temporarily switch `model` to attention `name` (e.g. "sdpa", "eager")."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@contextmanager
def model_eos(model: Any, eos_token_id: int | None) -> Iterator[None]:
    """Temporarily set the model's default EOS: `generate` falls back to it when a config leaves EOS unset,
    so `None` (never stop on a token) has to be written there."""
    config = model.generation_config
    previous = config.eos_token_id
    config.eos_token_id = eos_token_id
    try:
        yield
    finally:
        config.eos_token_id = previous


@torch.inference_mode()
def reference_generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    *,
    eos_token_id: int | None = None,
    attn_implementation: str = "sdpa",
) -> list[list[int]]:
    """Greedy continuation of each prompt by `model.generate`, one prompt at a time; stops at
    `eos_token_id` (included in the output; None: never) or after `max_new_tokens` (one value, or one per
    prompt)."""
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    outputs: list[list[int]] = []
    with attention_implementation(model, attn_implementation), model_eos(model, eos_token_id):
        for prompt, limit in zip(prompts, limits):
            ids = torch.tensor([list(prompt)], dtype=torch.long, device=model.device)
            config = GenerationConfig(  # type: ignore[no-untyped-call]
                max_new_tokens=limit,
                do_sample=False,
                num_beams=1,
                eos_token_id=eos_token_id,
                pad_token_id=eos_token_id if eos_token_id is not None else 0,
            )
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs
