"""Batch-invariant mode (`EngineConfig.batch_invariant`, `pagedkv.hf.invariant`): a request's tokens and
logprobs are bit-identical whatever else is in its batch, however its prompt is chunked and whether its prefix
came from the cache, in float32 and bfloat16; the default mode is not (its drift is measured here).

The building blocks are checked on this CPU first: a GEMM row's result does not depend on its tile position or
its neighbours at a fixed tile size, and the per-row operations (RMS norm, SiLU * up, log-softmax) do not
depend on the row count."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.scheduler import SchedulerConfig
from pagedkv.hf.cpu_linear import PackedLinear
from pagedkv.hf.invariant import ROW_TILE, invariant_linear
from pagedkv.hf.tiny import VOCAB, tiny_model

DTYPES = [torch.float32] + ([torch.bfloat16] if torch.ops.mkldnn._is_mkldnn_bf16_supported() else [])
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=2)
Result = tuple[list[int], list[tuple[float, tuple[tuple[int, float], ...]]]]


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def wide_llama(dtype: torch.dtype) -> Any:
    """The tiny Llama made wide enough (hidden 256, MLP 1536) that oneDNN's GEMMs sum a row in another order
    for another row count: at `tiny_model`'s 64 they happen not to."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    return tf.LlamaForCausalLM(cfg).eval().to(dtype)


def engine(dtype: torch.dtype, *, invariant: bool = True, budget: int = 512, **kw: Any) -> Engine:
    cfg = EngineConfig(num_blocks=96, block_size=4, batch_invariant=invariant,
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget), **kw)  # fmt: skip
    return Engine(wide_llama(dtype), None, cfg)


def results(
    e: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = PARAMS, *, cached: int = 0
) -> list[Result]:
    """Each output's tokens and logprobs; `cached`: the prompt tokens the first must have found cached."""
    outs = e.generate(prompts, params)
    assert outs[0].num_cached_tokens == cached
    return [(o.output_token_ids, [(lp.logprob, lp.top) for lp in o.logprobs or []]) for o in outs]


def max_logprob_diff(a: Result, b: Result) -> float:
    """The largest |difference| of the chosen tokens' logprobs while the two token streams agree."""
    worst = 0.0
    for ta, tb, (la, _), (lb, _) in zip(a[0], b[0], a[1], b[1], strict=True):
        worst = max(worst, abs(la - lb))
        if ta != tb:
            break
    return worst


TARGET = prompt(0, 29)
OTHERS = [prompt(1, 7), prompt(2, 41), prompt(3, 1), prompt(4, 18)]


def scenarios(dtype: torch.dtype, invariant: bool) -> dict[str, Result]:
    """The target request's result alone, in a batch, chunked, and over a warm prefix."""
    got = {"alone": results(engine(dtype, invariant=invariant), [TARGET])[0]}
    mixed = [SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=2) for n in (3, 9, 1, 5)]
    got["batch"] = results(engine(dtype, invariant=invariant), [OTHERS[0], TARGET, *OTHERS[1:]],
                           [mixed[0], PARAMS, *mixed[1:]])[1]  # fmt: skip
    for budget in (5, 12):
        got[f"chunks of {budget}"] = results(engine(dtype, invariant=invariant, budget=budget), [TARGET])[0]
    warm = engine(dtype, invariant=invariant)
    results(warm, [TARGET[:17] + prompt(5, 9)])  # its first 17 tokens are the target's
    got["warm prefix"] = results(warm, [TARGET], cached=17)[0]  # 4 blocks + 1 token (partial block reuse)
    got["warm, in a batch"] = results(warm, [TARGET, OTHERS[1]], cached=28)[0]
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_tokens_and_logprobs_are_bit_identical_in_every_batch_chunking_and_cache_state(dtype: torch.dtype) -> None:
    got = scenarios(dtype, invariant=True)
    alone = got.pop("alone")
    for name, result in got.items():
        assert result == alone, name  # tokens, logprobs and top-k, as Python floats: bit for bit


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_the_default_mode_drifts_with_the_batch(dtype: torch.dtype, capsys: Any) -> None:
    got = scenarios(dtype, invariant=False)
    alone = got.pop("alone")
    drift = {name: max_logprob_diff(alone, r) for name, r in got.items()}
    with capsys.disabled():
        print(f"\ndefault-mode logprob drift ({dtype}): " + ", ".join(f"{k} {v:.3g}" for k, v in drift.items()))
    assert max(drift.values()) > 0


_ALONE: dict[torch.dtype, Result] = {}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@settings(max_examples=8, deadline=None)
@given(
    others=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 9)), max_size=4),
    at=st.integers(0, 4),
    budget=st.integers(4, 64),
    warm=st.integers(0, 28),
)
def test_any_batch_budget_and_warm_prefix_give_the_request_alone_s_result(
    dtype: torch.dtype, others: list[tuple[int, int]], at: int, budget: int, warm: int
) -> None:
    if dtype not in _ALONE:
        _ALONE[dtype] = results(engine(dtype), [TARGET])[0]
    e = engine(dtype, budget=budget)
    if warm:  # a request that shares the target's first `warm` tokens, then diverges
        results(e, [TARGET[:warm] + prompt(99, 5)])
    prompts = [prompt(10 + i, n) for i, (n, _) in enumerate(others)]
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True, logprobs=2) for _, m in others]
    i = min(at, len(prompts))
    outs = e.generate([*prompts[:i], TARGET, *prompts[i:]], [*params[:i], PARAMS, *params[i:]])
    got = (outs[i].output_token_ids, [(lp.logprob, lp.top) for lp in outs[i].logprobs or []])
    assert got == _ALONE[dtype]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_the_ops_attention_paths_are_invariant_too(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """Without the C decode kernel every row goes through `pagedkv.ops`: the reference, or Triton (here under
    TRITON_INTERPRET, as on a GPU)."""
    from pagedkv.ops import cpu_decode
    from pagedkv.ops.dispatch import use_backend

    monkeypatch.setattr(cpu_decode, "available", lambda *a, **k: False)  # as without the C extension
    with use_backend(backend):
        got = scenarios(torch.float32, invariant=True)
    alone = got.pop("alone")
    for name, result in got.items():
        assert result == alone, name


def test_quantized_pages_are_invariant_too() -> None:
    alone = results(engine(torch.float32, kv_cache_dtype="int8"), [TARGET])[0]
    assert results(engine(torch.float32, kv_cache_dtype="int8", budget=5), [OTHERS[1], TARGET])[1] == alone


# --- the building blocks, on this CPU ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("packed", [True, False], ids=["onednn", "torch"])
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 3 * ROW_TILE + 1), at=st.data(), scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_a_row_s_gemm_result_depends_on_that_row_alone(
    dtype: torch.dtype, packed: bool, rows: int, at: st.DataObject, scale: float
) -> None:
    torch.manual_seed(rows)
    weight, bias = torch.randn(576, 1536).to(dtype), torch.randn(576).to(dtype)  # K = 1536: orders differ by M
    linear = invariant_linear(weight, bias) if packed else _torch_tiles(weight, bias)
    row = torch.randn(1, 1536).to(dtype)
    batch = (torch.randn(rows, 1536) * scale).to(dtype)
    i = at.draw(st.integers(0, rows - 1))
    batch[i] = row[0]
    assert torch.equal(linear(batch)[i], linear(row)[0])


def _torch_tiles(weight: torch.Tensor, bias: torch.Tensor) -> Any:
    """`invariant_linear`'s fallback where oneDNN does not take the dtype."""
    from pagedkv.hf.cpu_linear import tiled_rows

    gemm = lambda t: torch.nn.functional.linear(t, weight, bias)  # noqa: E731
    return lambda x: tiled_rows(x, weight.shape[1], weight.shape[0], gemm, ROW_TILE)


def test_without_tiles_a_row_s_gemm_result_depends_on_the_row_count() -> None:
    """Why the tiles are needed: the default packed GEMM sums a row in another order at another row count."""
    torch.manual_seed(0)
    weight, row = torch.randn(576, 1536), torch.randn(1, 1536)
    default, tiled = PackedLinear(weight), invariant_linear(weight, None)
    differs = []
    for rows in (2, 8, 17, 64, 256):
        batch = torch.cat([row, torch.randn(rows - 1, 1536)])
        differs.append(not torch.equal(default(batch)[0], default(row)[0]))
        assert torch.equal(tiled(batch)[0], tiled(row)[0])
    if not any(differs):  # the premise is the CPU's GEMM kernels': some sum every row count in one order
        pytest.skip("this CPU's packed GEMM gave a row the same result at every row count tried (2-256)")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("width", [64, 576, 2048, 8192])
def test_per_row_operations_do_not_depend_on_the_row_count(dtype: torch.dtype, width: int) -> None:
    from pagedkv.hf.fused_llama import FusedLlama

    norm = FusedLlama.__new__(FusedLlama)
    norm.eps = 1e-5
    weight = torch.randn(width).to(dtype)
    ops = {
        "rms_norm": lambda x: norm._rms_norm(x, weight),
        "silu_mul": lambda x: torch.nn.functional.silu(x[:, : width // 2]) * x[:, width // 2 :],
        "log_softmax": lambda x: torch.log_softmax(x.float(), dim=-1),
    }
    row = torch.randn(1, width).to(dtype)
    for name, op in ops.items():
        want = op(row)[0]
        for rows in (2, 7, 16, 33, 300):
            batch = torch.randn(rows, width).to(dtype)
            i = rows // 3
            batch[i] = row[0]
            assert torch.equal(op(batch)[i], want), (name, rows)


# --- configuration -----------------------------------------------------------------------------------------


def test_the_flag_and_the_backend_are_one_setting() -> None:
    on = EngineConfig(num_blocks=8, batch_invariant=True)
    assert (on.linear_backend, on.model_forward) == ("invariant", "fused")
    assert EngineConfig(num_blocks=8, linear_backend="invariant").batch_invariant
    assert not EngineConfig(num_blocks=8).batch_invariant
    with pytest.raises(InvalidArgumentError, match="linear_backend 'onednn' contradicts"):
        EngineConfig(num_blocks=8, batch_invariant=True, linear_backend="onednn")
    with pytest.raises(InvalidArgumentError, match="model_forward 'transformers' contradicts"):
        EngineConfig(num_blocks=8, batch_invariant=True, model_forward="transformers")
    with pytest.raises(InvalidArgumentError, match="batch_invariant must be a bool"):
        EngineConfig(num_blocks=8, batch_invariant=1)  # type: ignore[arg-type]


def test_a_model_the_fused_forward_cannot_run_is_refused_at_construction() -> None:
    with pytest.raises(InvalidArgumentError, match="batch_invariant needs a Llama-structured model"):
        Engine(tiny_model("gpt2"), None, EngineConfig(num_blocks=16, batch_invariant=True))


def test_the_command_line_flag_selects_the_mode() -> None:
    import argparse

    from pagedkv.engine.cli_args import add_linear_backend

    parser = argparse.ArgumentParser()
    add_linear_backend(parser)
    assert parser.parse_args(["--batch-invariant"]).linear_backend == "invariant"
    assert parser.parse_args([]).linear_backend == "auto"
    assert EngineConfig(num_blocks=8, linear_backend=parser.parse_args(["--batch-invariant"]).linear_backend).batch_invariant


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_ops_attention_of_token_rows_gives_each_row_its_own_result(backend: str) -> None:
    """The path without the C kernel: a row's result in a batch of rows equals the row alone (Triton in
    one call with one KV split, under TRITON_INTERPRET; the reference one call per row), over contexts that
    span several key tiles."""
    from pagedkv.hf.attention import attend_token_rows
    from pagedkv.ops.options import attention_options

    torch.manual_seed(0)
    num_blocks, block_size, kv_heads, heads, dim = 48, 8, 8, 8, 128  # wide: the reference tiles by batch size
    key_cache = torch.randn(num_blocks, block_size, kv_heads, dim)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, dim)
    ids = torch.randperm(num_blocks - 1)[:40] + 1
    tables = torch.stack([ids[:20], ids[20:]]).to(torch.int32)  # two sequences of up to 160 tokens
    positions = [(0, p) for p in range(0, 150, 7)] + [(1, p) for p in range(3, 120, 11)]
    table = tables[[s for s, _ in positions]]
    lens = torch.tensor([p + 1 for _, p in positions], dtype=torch.int32)
    q = torch.randn(len(positions), heads, dim)
    options = attention_options()
    together = attend_token_rows(q, key_cache, value_cache, table, lens, options, backend=backend)
    for r in (0, 5, len(positions) // 2, len(positions) - 1):
        alone = attend_token_rows(q[r : r + 1], key_cache, value_cache, table[r : r + 1], lens[r : r + 1], options,
                                  backend=backend)  # fmt: skip
        assert torch.equal(together[r], alone[0]), r
    reference = attend_token_rows(q, key_cache, value_cache, table, lens, options, backend="reference")
    torch.testing.assert_close(together, reference, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_seeded_samples_are_bit_identical_too(dtype: torch.dtype) -> None:
    """An RL rollout samples: a seeded request draws from its own generator, so equal logits give equal
    samples (and logprobs) in any batch."""
    sampled = SamplingParams(max_new_tokens=8, temperature=1.0, seed=7, ignore_eos=True, logprobs=2)
    alone = results(engine(dtype), [TARGET], sampled)[0]
    others = [SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True) for n in (4, 12)]
    assert results(engine(dtype, budget=9), [OTHERS[0], TARGET, OTHERS[1]], [others[0], sampled, others[1]])[1] == alone


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "default"])
def test_generated_logprobs_equal_a_scoring_pass_over_prompt_and_response(dtype: torch.dtype, invariant: bool) -> None:
    """What a trainer recomputes: the response's logprobs from one forward over prompt + response (here the
    engine's own `prompt_logprobs`, one prefill) equal those reported token by token while generating, bit
    for bit in batch-invariant mode; the default mode differs (decode rows vs one prefill)."""
    e = engine(dtype, invariant=invariant)
    out = e.generate([TARGET], PARAMS)[0]
    generated = [lp.logprob for lp in out.logprobs or []]
    scoring = e.generate([TARGET + out.output_token_ids], SamplingParams(max_new_tokens=1, prompt_logprobs=0))[0]
    scored = [scoring.prompt_logprobs[len(TARGET) + j].logprob for j in range(len(generated))]  # type: ignore[index]
    assert (scored == generated) == invariant
