"""The engine's promises under malformed input and misbehaving callbacks (issue 15, cases 1-14).

Each test names the case it pins. Unless stated, the engine is `Engine(tiny_model("llama"), None,
EngineConfig(num_blocks=17, block_size=4))` and outputs are checked against transformers' own `generate`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import fields
from typing import Any

import numpy as np
import pytest
import torch

import pagedkv.engine.params as params_module
from pagedkv.core.errors import CapacityError, InvalidArgumentError, PagedKVError
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.scheduler import SchedulerConfig
from pagedkv.hf.oracle import reference_generate
from pagedkv.hf.tiny import VOCAB, tiny_model


def engine_config(**kw: Any) -> EngineConfig:
    """`EngineConfig` from flat keywords: the scheduler's own go into its `SchedulerConfig`."""
    names = {f.name for f in fields(SchedulerConfig)}
    scheduler = SchedulerConfig(**{k: kw.pop(k) for k in list(kw) if k in names})
    return EngineConfig(**kw, scheduler=scheduler)


def small_engine(**config: Any) -> Engine:
    return Engine(tiny_model("llama"), None, engine_config(**{"num_blocks": 17, "block_size": 4, **config}))


def greedy(prompts: list[list[int]], max_new: int, eos: int | None = None) -> list[list[int]]:
    return reference_generate(
        tiny_model("llama"), prompts, max_new, eos_token_id=eos, attn_implementation="eager"
    )


def engine_state(engine: Engine) -> tuple[Any, ...]:
    """Everything a refused request must leave as it was."""
    s = engine.scheduler
    return (
        sorted(engine._tracked), sorted(engine._ids_in_use), s.num_waiting, s.num_running, len(s.swapped),
        engine.manager.num_used_blocks, engine.manager.num_sequences, engine.has_unfinished(),
    )  # fmt: skip


def drain(engine: Engine) -> list[RequestOutput]:
    ended: list[RequestOutput] = []
    engine.run(on_step=ended.extend)
    return ended


# --- 1-4: one bad request must not hurt the others ----------------------------------------------------


BAD_REQUESTS: list[tuple[Any, dict[str, Any]]] = [
    ([5, 2**31], {}),  # case 1: beyond int32
    ([5, VOCAB], {}),  # case 4: token id == vocab size
    ([5, -1], {}),
    ([5.0, 6.0], {}),  # case 4: float ids are refused, not truncated
    ([5, 2**70], {}),
    ([[5, 6]], {}),
    ([], {}),
    ([5, 6, 7], {"priority": 1.5}),  # case 1 / 4
    ([5, 6, 7], {"priority": "high"}),  # case 3
    ([5, 6, 7], {"priority": True}),
    ([5, 6, 7], {"params": SamplingParams(stop=("x",))}),  # case 4: stop strings need a tokenizer
    ([5, 6, 7], {"params": SamplingParams(stop_token_ids=(VOCAB + 3,))}),
    ([5, 6, 7], {"params": "greedy"}),
    ([5, 6, 7], {"request_id": ""}),
    ([5, 6, 7], {"request_id": 7}),
    ([5, 6, 7], {"on_token": "print"}),
    ([5, 6, 7], {"arrival_time": float("nan")}),
    ([5, 6, 7], {"cache_salt": 42}),
    ("text without a tokenizer", {}),
]


@pytest.mark.parametrize(("prompt", "kwargs"), BAD_REQUESTS)
def test_bad_requests_raise_a_typed_error_and_queue_nothing(prompt: Any, kwargs: dict[str, Any]) -> None:
    """Cases 3 and 4: refused at add_request with InvalidArgumentError; no phantom request is left."""
    engine = small_engine()
    engine.add_request([10, 11, 12], SamplingParams(max_new_tokens=3), request_id="ok")
    engine.step()
    before = engine_state(engine)
    with pytest.raises(InvalidArgumentError):
        engine.add_request(prompt, **kwargs)
    assert engine_state(engine) == before
    ended = drain(engine)  # returns: case 3's phantom kept run() spinning forever
    assert [o.request_id for o in ended] == ["ok"]
    assert ended[0].output_token_ids == greedy([[10, 11, 12]], 3, eos=2)[0]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": float("nan")},  # case 2
        {"temperature": float("inf")},
        {"n": 2.0},  # case 2
        {"top_k": 2.5},  # case 4
        {"max_new_tokens": 3.0},
        {"max_new_tokens": True},
        {"top_p": float("nan")},
        {"seed": 1.5},
        {"seed": -1},
        {"stop_token_ids": (1.5,)},
        {"stop_token_ids": (-2,)},
        {"stop": (3,)},
        {"ignore_eos": "yes"},
    ],
)
def test_sampling_params_check_their_own_fields(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        SamplingParams(**kwargs)


def test_case1_bad_admission_during_a_swap_leaves_the_swapped_request_intact() -> None:
    """Case 1: b is swapped out when a malformed request arrives; b's output still equals generate's."""
    engine = small_engine(num_blocks=12, preemption_mode="swap")
    p = SamplingParams(max_new_tokens=20, ignore_eos=True)
    a, b = list(range(10, 22)), list(range(40, 52))
    engine.add_request(a, p, request_id="a")
    engine.add_request(b, p, request_id="b", priority=-1)
    for _ in range(10):
        engine.step()
    assert engine.stats.num_swapped_out_blocks > 0 and engine.scheduler.swapped, "b should be swapped out now"
    for kwargs in ({}, {"priority": 1.5}):
        with pytest.raises(InvalidArgumentError):
            engine.add_request([5, 2**31], SamplingParams(max_new_tokens=2), request_id="bad", **kwargs)
    with pytest.raises(InvalidArgumentError):
        engine.finish("bad")  # it was never accepted
    outputs = {o.request_id: o for o in drain(engine)}
    assert [outputs["a"].output_token_ids, outputs["b"].output_token_ids] == greedy([a, b], 20)
    assert engine.stats.num_swapped_in_blocks == engine.stats.num_swapped_out_blocks
    engine.manager.check_invariants()
    assert engine.manager.num_used_blocks == 0


def seeded_run(neighbour: Any = None) -> Engine:
    engine = small_engine()
    engine.add_request(
        list(range(30, 40)), SamplingParams(max_new_tokens=6, temperature=1.0, seed=7), request_id="s"
    )
    if neighbour is not None:
        neighbour(engine)
    drain(engine)
    return engine


def test_case2_a_bad_neighbour_costs_a_seeded_request_no_draw() -> None:
    alone = seeded_run().output("s").output_token_ids

    def bad_params(engine: Engine) -> None:
        for kwargs in ({"temperature": float("nan")}, {"n": 2.0}):
            with pytest.raises(InvalidArgumentError):
                engine.add_request([5, 6, 7], SamplingParams(**kwargs))

    assert seeded_run(bad_params).output("s").output_token_ids == alone


def poison_logits(engine: Engine, victim: str, from_token: int) -> None:
    """Make the model's logits for `victim` NaN once it has `from_token` output tokens (a model that
    overflows on one request's input)."""
    execute = engine.runner.execute

    def wrapped(manager: Any, out: Any) -> torch.Tensor:
        logits = execute(manager, out).clone()
        rows = [c.request for c in out.scheduled if c.produces_token]
        for i, r in enumerate(rows):
            if r.request_id == victim and len(r.output_token_ids) >= from_token:
                logits[i] = float("nan")
        return logits

    engine.runner.execute = wrapped  # type: ignore[method-assign]


def test_case2_a_request_whose_logits_cannot_be_sampled_ends_alone_with_error() -> None:
    alone = seeded_run().output("s").output_token_ids

    def nan_neighbour(engine: Engine) -> None:
        engine.add_request(
            [5, 6, 7, 8], SamplingParams(max_new_tokens=5, temperature=0.7, seed=3), request_id="nan"
        )
        poison_logits(engine, "nan", from_token=2)

    engine = seeded_run(nan_neighbour)
    assert engine.output("s").output_token_ids == alone
    bad = engine.output("nan")
    assert (bad.finish_reason, len(bad.output_token_ids)) == ("error", 2)
    assert "NaN" in (bad.error or "")
    assert engine.manager.num_used_blocks == 0


def test_a_forward_that_fails_changes_nothing_and_the_next_step_redoes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ "A step that fails changes nothing": the model's forward raises right after the step's swaps were
    applied; step() propagates it, and continuing gives generate's tokens for everyone."""
    lengths = (6, 11, 3, 14, 9)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in lengths]
    engine = small_engine(num_blocks=12, preemption_mode="swap")
    forward, swap = engine.runner.forward, engine.cache.swap
    state = {"swapped": False, "failures": 0}

    def swap_and_note(*args: Any) -> None:
        swap(*args)
        state["swapped"] = True

    def failing_forward(*args: Any) -> torch.Tensor:
        if state["swapped"] and state["failures"] < 4:
            state["swapped"] = False
            state["failures"] += 1
            raise RuntimeError("injected device failure")
        return forward(*args)

    engine.cache.swap = swap_and_note  # type: ignore[method-assign]
    monkeypatch.setattr(engine.runner, "forward", failing_forward)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_new_tokens=16, ignore_eos=True), request_id=f"r{i}")
    ended: list[RequestOutput] = []
    for _ in range(500):
        if not engine.has_unfinished():
            break
        try:
            ended += engine.step()
        except RuntimeError as e:
            assert "injected" in str(e)
    assert state["failures"] == 4
    outputs = {o.request_id: o.output_token_ids for o in ended}
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == greedy(prompts, 16)
    engine.manager.check_invariants()
    assert engine.manager.num_used_blocks == 0


# --- 5-6: callbacks ---------------------------------------------------------------------------------


def three_requests(engine: Engine, callback: Any) -> list[list[int]]:
    prompts = [list(range(10, 16)), list(range(20, 29)), list(range(50, 54))]
    for name, prompt in zip("abc", prompts):
        engine.add_request(
            prompt, SamplingParams(max_new_tokens=6, ignore_eos=True), request_id=name, on_token=callback
        )
    return prompts


def test_case5_a_callback_may_finish_another_request() -> None:
    engine = small_engine(num_blocks=40)
    streamed: dict[str, list[RequestOutput]] = {}

    def on_token(out: RequestOutput) -> None:
        streamed.setdefault(out.request_id, []).append(out)
        if out.request_id == "a" and len(out.output_token_ids) == 2:
            assert engine.finish("b") is True
            assert engine.finish("b") is False  # already ended: left as it is
        with pytest.raises(InvalidArgumentError):
            engine.step()  # not from a callback

    prompts = three_requests(engine, on_token)
    ended = drain(engine)
    assert sorted(o.request_id for o in ended) == ["a", "b", "c"]  # each end exactly once
    final = {o.request_id: o for o in ended}
    expected = greedy(prompts, 6)
    assert final["a"].output_token_ids == expected[0] and final["c"].output_token_ids == expected[2]
    assert [len(s.output_token_ids) for s in streamed["c"]] == [1, 2, 3, 4, 5, 6]  # c lost nothing
    assert final["b"].finish_reason == "abort"
    assert final["b"].output_token_ids == expected[1][:2]  # b got its token of that step, then ended
    assert streamed["b"][-1].output_token_ids == final["b"].output_token_ids
    # every callback of a step sees the state the step left, whatever an earlier callback did since
    assert [s.finished for s in streamed["b"]] == [False, False]
    assert engine.manager.num_used_blocks == 0


def test_case6_a_raising_callback_ends_only_its_request(caplog: pytest.LogCaptureFixture) -> None:
    engine = small_engine(num_blocks=40)
    streamed: dict[str, list[int]] = {}

    def on_token(out: RequestOutput) -> None:
        streamed.setdefault(out.request_id, []).append(len(out.output_token_ids))
        if out.request_id == "a" and len(out.output_token_ids) == 3:
            raise ValueError("client went away")

    prompts = three_requests(engine, on_token)
    with caplog.at_level(logging.WARNING, logger="pagedkv.engine.llm_engine"):
        ended = drain(engine)
    final = {o.request_id: o for o in ended}
    assert len(ended) == 3
    assert final["a"].finish_reason == "error" and "ValueError: client went away" in (final["a"].error or "")
    assert final["a"].output_token_ids == greedy(prompts[:1], 3)[0]
    assert streamed["a"] == [1, 2, 3]  # not called again after it raised
    assert streamed["b"] == streamed["c"] == [1, 2, 3, 4, 5, 6]
    assert [final[k].output_token_ids for k in "bc"] == greedy(prompts[1:], 6)
    assert engine.stats.num_steps == len(engine.stats.running) == len(engine.stats.step_times)
    assert any("client went away" in r.getMessage() for r in caplog.records)


def test_a_callback_raising_on_the_last_token_keeps_the_reason_and_records_the_error() -> None:
    engine = small_engine(num_blocks=40)

    def on_token(out: RequestOutput) -> None:
        if out.finished:
            raise RuntimeError("late failure")

    engine.add_request(
        [10, 11, 12], SamplingParams(max_new_tokens=2, ignore_eos=True), request_id="x", on_token=on_token
    )
    (out,) = drain(engine)
    assert out.finish_reason == "length" and "late failure" in (out.error or "")


# --- 7-11: identity and lifecycle -------------------------------------------------------------------


def test_case7_child_ids_never_collide_with_user_ids() -> None:
    engine = small_engine(num_blocks=40)
    p2 = SamplingParams(max_new_tokens=4, temperature=1.0, seed=1, n=2, ignore_eos=True)
    engine.add_request([10, 11, 12], p2, request_id="A")
    with pytest.raises(InvalidArgumentError, match="'A.1'"):
        engine.add_request([20, 21], SamplingParams(max_new_tokens=2), request_id="A.1")
    engine.add_request([20, 21], SamplingParams(max_new_tokens=2), request_id="B.1")
    with pytest.raises(InvalidArgumentError, match="'B.1'"):
        engine.add_request([10, 11, 12], p2, request_id="B")  # its child would be "B.1"
    ended = drain(engine)
    ids = [o.request_id for o in ended]
    assert sorted(ids) == ["A", "A.1", "B.1"] and len(set(ids)) == len(ids)
    assert engine.output("A.1").parent_id == "A" and engine.output("B.1").parent_id is None


def test_case8_automatic_ids_skip_explicit_ones() -> None:
    engine = small_engine(num_blocks=40)
    engine.add_request([10, 11], SamplingParams(max_new_tokens=2), request_id="req-0")
    engine.add_request([10, 11], SamplingParams(max_new_tokens=2), request_id="req-1.1")
    auto = [engine.add_request([12, 13], SamplingParams(max_new_tokens=2, n=2)) for _ in range(2)]
    assert "req-0" not in auto and len(set(auto)) == 2
    assert all(f"{a}.1" != "req-1.1" for a in auto)
    assert len(drain(engine)) == 2 + 4


def test_case9_finish_validates_reason_and_id() -> None:
    engine = small_engine(num_blocks=40)
    engine.add_request([10, 11, 12], SamplingParams(max_new_tokens=8), request_id="x")
    engine.step()
    with pytest.raises(InvalidArgumentError, match="banana"):
        engine.finish("x", "banana")
    with pytest.raises(InvalidArgumentError, match="no request 'nope'"):
        engine.finish("nope")
    assert engine.get_request("x").status.value == "running"  # the refused calls changed nothing
    assert engine.finish("x", "stop") is True
    assert engine.finish("x") is False  # twice: a no-op, the first reason stays
    (out,) = drain(engine)
    assert (out.finish_reason, len(out.output_token_ids)) == ("stop", 1)
    assert engine.manager.num_used_blocks == 0


def test_case10_aborting_a_parent_aborts_its_children() -> None:
    engine = small_engine(num_blocks=40)
    engine.add_request(
        [10, 11, 12, 13, 14], SamplingParams(max_new_tokens=8, temperature=1.0, seed=2, n=3), request_id="P"
    )
    engine.step()  # prompt done: children forked
    assert {"P.1", "P.2"} <= set(engine._tracked)
    assert engine.finish("P") is True
    ended = drain(engine)
    assert sorted((o.request_id, o.finish_reason) for o in ended) == [
        ("P", "abort"),
        ("P.1", "abort"),
        ("P.2", "abort"),
    ]
    assert engine.manager.num_used_blocks == 0


def test_case10_finishing_a_child_leaves_its_siblings() -> None:
    engine = small_engine(num_blocks=40)
    engine.add_request(
        [10, 11, 12, 13, 14],
        SamplingParams(max_new_tokens=4, temperature=1.0, seed=2, n=3, ignore_eos=True),
        request_id="P",
    )
    engine.step()
    engine.finish("P.1")
    final = {o.request_id: o for o in drain(engine)}
    assert [final[k].finish_reason for k in ("P", "P.1", "P.2")] == ["length", "abort", "length"]


def test_case10_forked_children_count_against_max_num_seqs() -> None:
    p = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5, n=3, ignore_eos=True)
    results = []
    for max_num_seqs in (1, 8):
        engine = small_engine(num_blocks=40, max_num_seqs=max_num_seqs)
        outputs = engine.generate([[10, 11, 12, 13, 14, 15]], p)
        assert max(engine.stats.running) <= max_num_seqs
        results.append([(o.request_id, o.output_token_ids) for o in outputs])
        assert engine.manager.num_used_blocks == 0
    assert max(len(tokens) for _, tokens in results[0]) == 6
    assert results[0] == results[1]  # seeded children: the same completions, forked or queued


def test_case11_a_stop_token_on_the_last_allowed_step_is_stop_as_documented() -> None:
    prompt = [10, 11, 12, 13]
    tokens = greedy([prompt], 3)[0]
    stop = tokens[2]
    assert stop not in tokens[:2], "pick a prompt whose third token is new"
    engine = small_engine()
    (out,) = engine.generate(
        [prompt], SamplingParams(max_new_tokens=3, stop_token_ids=(stop,), ignore_eos=True)
    )
    assert (out.finish_reason, out.output_token_ids) == ("stop", tokens)
    assert 'ends the request with "stop", not "length"' in " ".join((params_module.__doc__ or "").split())


# --- 12-13: scheduling without chunked prefill, timings of rejected requests -----------------------


def test_case12_without_chunked_prefill_a_preempted_request_is_recomputed_in_chunks() -> None:
    # greedy admission (no growth reserve): both go in and one must be preempted
    engine = small_engine(num_blocks=9, enable_chunked_prefill=False, max_num_batched_tokens=15, admission_lookahead=0)
    p = SamplingParams(max_new_tokens=18, ignore_eos=True)
    prompts = [list(range(10, 24)), list(range(40, 54))]  # 14 + 18 = 32 tokens: exactly the capacity
    outputs = engine.generate(prompts, p)
    assert engine.stats.num_preemptions > 0
    assert [o.finish_reason for o in outputs] == ["length", "length"]
    assert [o.output_token_ids for o in outputs] == greedy(prompts, 18)
    assert engine.manager.num_used_blocks == 0


def test_case12_rejection_without_chunking_does_not_depend_on_the_prefix_cache() -> None:
    engine = small_engine(num_blocks=40, enable_chunked_prefill=False, max_num_batched_tokens=15)
    shared = list(range(10, 22))
    engine.generate([shared + [30, 31]], SamplingParams(max_new_tokens=2))  # 12 tokens now cached
    assert engine.manager.match_prefix(shared + [40, 41, 42, 43]) == 12
    for prompt in (shared + [40, 41, 42, 43], list(range(60, 76))):  # 16 tokens, cached head or not
        with pytest.raises(CapacityError, match="max_num_batched_tokens=15"):
            engine.add_request(prompt, SamplingParams(max_new_tokens=2))
        (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=2))
        assert out.finish_reason == "rejected" and out.e2e_s is None and out.tpot_s is None


def test_case13_rejected_outputs_have_sane_timings() -> None:
    engine = small_engine()
    prompts = [[10, 11, 12], [5] * 80, [13, 14]]  # 80 tokens: more than the 64 the cache holds
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=4))
    assert [o.finish_reason == "rejected" for o in outputs] == [False, True, False]
    for o in outputs:
        timings = (o.ttft_s, o.tpot_s, o.e2e_s)
        if o.finish_reason == "rejected":  # never ran: no time to first token, per token or end to end
            assert timings == (None, None, None) and o.output_token_ids == []
            continue
        assert o.ttft_s is not None and o.tpot_s is not None and o.e2e_s is not None, timings  # all measured
        assert all(math.isfinite(v) and v > 0 for v in (o.ttft_s, o.tpot_s, o.e2e_s)), timings
        assert o.ttft_s <= o.e2e_s, timings  # the first token comes before the last


# --- 14: tenants ------------------------------------------------------------------------------------


def test_case14_different_cache_salts_never_share_a_block_and_equal_ones_do() -> None:
    engine = small_engine(num_blocks=40)
    prompt = list(range(10, 28))  # 18 tokens: 4 full blocks of 4
    p = SamplingParams(max_new_tokens=10, ignore_eos=True)
    engine.add_request(prompt, p, request_id="alice-1", cache_salt="alice")
    engine.step()
    engine.step()  # alice-1's prompt blocks are written and published
    engine.add_request(prompt, p, request_id="bob", cache_salt=b"bob")
    engine.add_request(prompt, p, request_id="alice-2", cache_salt="alice")
    engine.add_request(prompt, p, request_id="nobody")
    engine.step()
    blocks = {
        rid: engine.manager.block_ids(engine.get_request(rid).seq_id)
        for rid in ("alice-1", "bob", "alice-2", "nobody")
    }
    assert engine.get_request("alice-2").num_cached_tokens == 16
    assert blocks["alice-2"][:4] == blocks["alice-1"][:4]
    for other in ("bob", "nobody"):
        assert engine.get_request(other).num_cached_tokens == 0
        assert not set(blocks[other]) & set(blocks["alice-1"])
    assert not set(blocks["bob"]) & set(blocks["nobody"])
    outputs = {o.request_id: o.output_token_ids for o in drain(engine)}
    assert len({tuple(v) for v in outputs.values()}) == 1  # the salt changes sharing, never tokens


def test_case14_cache_salt_through_generate() -> None:
    engine = small_engine(num_blocks=40)
    prompt = list(range(10, 28))
    p = SamplingParams(max_new_tokens=2)
    assert engine.generate([prompt], p, cache_salt="t1")[0].num_cached_tokens == 0
    assert engine.generate([prompt], p, cache_salt="t2")[0].num_cached_tokens == 0
    assert engine.generate([prompt], p)[0].num_cached_tokens == 0
    assert engine.generate([prompt], p, cache_salt="t1")[0].num_cached_tokens == 16
    per_prompt = engine.generate([prompt, prompt], p, cache_salt=["t2", "t3"])
    assert [o.num_cached_tokens for o in per_prompt] == [16, 0]
    with pytest.raises(InvalidArgumentError):
        engine.generate([prompt, prompt], p, cache_salt=["t1"])
    with pytest.raises(PagedKVError):
        engine.generate([prompt], p, cache_salt=[3])  # type: ignore[list-item]
    assert not engine.has_unfinished() and engine.manager.num_used_blocks == 0


def test_generate_checks_every_prompt_before_queueing_any() -> None:
    engine = small_engine()
    with pytest.raises(InvalidArgumentError):
        engine.generate([[10, 11], [12, VOCAB], [13]], SamplingParams(max_new_tokens=2))
    assert not engine.has_unfinished() and engine.scheduler.num_waiting == 0 and not engine._ids_in_use


def test_an_absurd_n_is_refused_quickly_with_nothing_queued() -> None:
    engine = small_engine()
    with pytest.raises(CapacityError, match="never fit"):
        engine.add_request([10, 11], SamplingParams(max_new_tokens=2, n=10**9))
    (out,) = engine.generate([[10, 11]], SamplingParams(max_new_tokens=2, n=10**9))
    assert out.finish_reason == "rejected" and not engine.has_unfinished()
