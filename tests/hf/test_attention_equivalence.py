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
from pagedkv.hf.oracle import reference_generate
from pagedkv.hf.step_metadata import build_step_batch
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


@pytest.mark.parametrize("family", ["llama", "qwen2-sw", "gemma2"])
def test_greedy_matches_generate_through_the_triton_kernel(family: str) -> None:
    """The whole model through the Triton kernels (interpreter on CPU), step by step:
    GQA, a sliding window on one layer, soft cap + window (gemma2), chunked prefill mixed with decodes."""
    pytest.importorskip("triton")
    from pagedkv.ops.dispatch import use_backend

    model = tiny_model(family, seed=4)
    prompts = prompts_of([5, 17, 30], seed=4)
    expected = reference_generate(model, prompts, 8, eos_token_id=2, attn_implementation="eager")
    with use_backend("triton"):
        got = paged_greedy(model, prompts, 8, chunk=11, backend="ops")
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


@pytest.mark.parametrize("backend", ["sdpa", "reference", "triton"])
def test_step_metadata_is_computed_once_per_step_not_per_layer(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation, dispatch, query tiling and gather/mask set-up run once per step (per attention group);
    each layer only launches its write and attention."""
    import transformers as tf

    from pagedkv.hf import cache as hf_cache
    from pagedkv.hf import sdpa as hf_sdpa
    from pagedkv.ops import attention as ops_attention
    from pagedkv.ops import plan as ops_plan
    from pagedkv.ops.dispatch import use_backend

    if backend == "triton":
        pytest.importorskip("triton")
    num_layers = 4
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                               num_hidden_layers=num_layers, num_attention_heads=4,
                                               num_key_value_heads=2, max_position_embeddings=128)).eval()
    spec = prepare_model(model)
    calls: dict[str, int] = {}

    def counted(module: object, name: str) -> None:
        original = getattr(module, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            calls[name] = calls.get(name, 0) + 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    for name in ("check_attention_shapes", "check_attention_metadata", "choose_backend", "query_tiles"):
        counted(ops_plan, name)
    counted(hf_cache, "check_write_args")
    counted(ops_attention, "run_planned")
    monkeypatch.setattr(hf_cache.SdpaPlan, "build", _counting(hf_sdpa.SdpaPlan.build, calls, "SdpaPlan.build"))

    manager = PagedKVManager(64, 4)
    cache = PagedKVCache.for_model(spec, 64, 4, attention_backend="sdpa" if backend == "sdpa" else "ops")
    prompts = prompts_of([9, 5, 6])
    ids = np.array([manager.admit(p).seq_id for p in prompts])
    manager.mark_computed(ids[1:], np.array([4, 5]))  # seqs 1 and 2 decode their last prompt token
    starts = np.array([0, 4, 5])
    ends = np.array([9, 5, 6])
    batch = build_step_batch([p[s:] for p, s in zip(prompts, starts)], starts, manager.block_table(ids, pad_id=0),
                             manager.slot_mapping(ids, starts, ends), [True, True, True])
    num_groups = len(batch.groups)
    assert num_groups == 2, "expected a prefill group and a decode group on CPU"
    with use_backend("triton" if backend == "triton" else "reference"):
        forward_step(model, cache, batch)
    assert calls.get("check_write_args") == 1, calls
    if backend == "sdpa":
        assert calls.get("SdpaPlan.build") == num_groups, calls
        assert "run_planned" not in calls, calls
    else:
        assert calls.get("run_planned") == num_layers * num_groups, "the layers did not all run attention"
        assert calls.get("check_attention_shapes") == num_groups, calls
        assert calls.get("choose_backend") == num_groups, calls
        if backend == "triton":
            assert calls.get("query_tiles") == num_groups, calls
            assert "check_attention_metadata" not in calls, calls
        else:
            assert calls.get("check_attention_metadata") == num_groups, calls


def _counting(fn, calls, name):  # type: ignore[no-untyped-def]
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[name] = calls.get(name, 0) + 1
        return fn(*args, **kwargs)

    return staticmethod(wrapper)
