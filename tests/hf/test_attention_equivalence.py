"""The paged attention function reproduces transformers' own greedy `generate`, token for token.

Driven here without the engine: the real `PagedKVManager` allocates blocks, every step packs all sequences'
new tokens into one row (prefill of different lengths in the first step, decode after), and the model runs
with attention "pagedkv". Prompts of different lengths share each batch, so block tables are ragged.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv.core import PagedKVManager
from pagedkv.hf.attention import forward_step, prepare_model
from pagedkv.hf.cache import PagedKVCache
from pagedkv.hf.metadata import build_step_batch
from pagedkv.hf.reference import reference_generate
from pagedkv.hf.tiny import VOCAB, tiny_model


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in lengths]


def paged_greedy(
    model, prompts, max_new_tokens, *, block_size=4, num_blocks=128, chunk=None, eos=2, backend="auto"
):
    """Greedy decode on pagedkv pages; prefill in chunks of `chunk` tokens when given."""
    spec = prepare_model(model)
    manager = PagedKVManager(num_blocks, block_size)
    cache = PagedKVCache.for_model(spec, num_blocks, block_size, attention_backend=backend)
    seqs = [manager.admit(p).seq_id for p in prompts]
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    while live:
        ends = [len(tokens[i]) if chunk is None else min(len(tokens[i]), computed[i] + chunk) for i in live]
        ids = np.array([seqs[i] for i in live])
        starts = np.array([computed[i] for i in live])
        batch = build_step_batch(
            [tokens[i][computed[i] : e] for i, e in zip(live, ends)],
            starts,
            manager.block_table(ids, pad_id=0),
            manager.slot_mapping(ids, starts, np.array(ends)),
            [e == len(tokens[i]) for i, e in zip(live, ends)],
        )
        logits = forward_step(model, cache, batch)
        manager.mark_computed(ids, np.array(ends))
        produced = [i for i, e in zip(live, ends) if e == len(tokens[i])]
        for i, e in zip(live, ends):
            computed[i] = e
        for i, tok in zip(produced, logits.argmax(-1).tolist()):
            outputs[i].append(tok)
            if tok == eos or len(outputs[i]) == max_new_tokens:
                manager.free(seqs[i])
                live.remove(i)
            else:
                assert manager.append([seqs[i]], [tok]), "test pool too small"
                tokens[i].append(tok)
        manager.check_invariants()
    assert manager.num_used_blocks == 0, "blocks leaked"
    return outputs


FAMILIES = ["llama", "qwen2", "qwen2-sw", "qwen3", "mistral", "gpt2", "phi3", "gemma2"]


@pytest.mark.parametrize("backend", ["sdpa", "ops"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_generate(family: str, backend: str) -> None:
    model = tiny_model(family)
    prompts = prompts_of([5, 17, 9, 30])
    expected = reference_generate(model, prompts, 14, eos_token_id=2, attn_implementation="eager")
    got = paged_greedy(model, prompts, 14, backend=backend)
    assert got == expected


@pytest.mark.parametrize("backend", ["sdpa", "ops"])
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_chunked_prefill_matches_generate(family: str, backend: str) -> None:
    model = tiny_model(family, seed=1)
    prompts = prompts_of([23, 6, 41], seed=1)
    expected = reference_generate(model, prompts, 10, eos_token_id=2, attn_implementation="eager")
    assert paged_greedy(model, prompts, 10, chunk=7, block_size=8, backend=backend) == expected


def test_block_size_does_not_change_output() -> None:
    model = tiny_model("qwen2", seed=2)
    prompts = prompts_of([11, 19], seed=2)
    a = paged_greedy(model, prompts, 12, block_size=1, num_blocks=128)
    b = paged_greedy(model, prompts, 12, block_size=16, num_blocks=16)
    assert a == b


def test_logits_match_sdpa_closely() -> None:
    """One prefill step: the paged logits equal the model's own within float tolerance."""
    model = tiny_model("llama", seed=3)
    prompt = prompts_of([21], seed=3)[0]
    with torch.inference_mode():
        model.set_attn_implementation("sdpa")
        ref = model(torch.tensor([prompt])).logits[0]
    spec = prepare_model(model)
    manager = PagedKVManager(16, 4)
    cache = PagedKVCache.for_model(spec, 16, 4)
    seq = manager.admit(prompt).seq_id
    n = len(prompt)
    batch = build_step_batch(
        [prompt], [0], manager.block_table([seq], pad_id=0), manager.slot_mapping([seq], [0], [n]), [True]
    )
    # all positions' logits: ask for every row
    batch = type(batch)(
        **{**{f: getattr(batch, f) for f in batch.__slots__}, "logits_indices": torch.arange(n)}
    )
    got = forward_step(model, cache, batch)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
