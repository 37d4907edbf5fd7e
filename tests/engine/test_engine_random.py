"""Seeded random schedules through the whole engine, checked against transformers and against themselves.

Each round draws a tiny model family and an engine configuration (paged or contiguous, block size 1/4/16,
preemption by swap or recompute, chunked prefill on or off, a pool and budget small enough to preempt; the
tier rounds: paged with a small host RAM tier, sometimes a disk tier, swap preemption, chunked prefill and
no growth reserve, so that swaps and tier hits run in one engine; the exact collision of issue #20, a
request swapped out mid-prefill coming back in the step that loads a tier hit, is pinned by
tests/tiers/test_swap_tiers.py), then
interleaves adding requests (greedy or seeded sampling, n > 1, stop tokens, ignore_eos, priorities),
steps, aborts from outside, callbacks that abort other requests, finish themselves or raise, and malformed
requests that must be refused with nothing queued. It checks:

- greedy requests that end naturally equal transformers' `generate` (cut at the first stop token);
- seeded requests equal the same request run alone (independent of their batch);
- what `on_token` streamed equals the final output, one call per new token;
- every accepted completion ends exactly once in what `step()` returns, with a sane reason and timings;
- the pool is empty and consistent at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedkv.core.errors import CapacityError, InvalidArgumentError
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.request import FINISH_REASONS
from pagedkv.engine.scheduler import SchedulerConfig
from pagedkv.hf.oracle import reference_generate
from pagedkv.hf.tiny import VOCAB, tiny_model

FAMILIES = ("llama", "qwen2", "mistral", "gemma2", "gpt2")
EOS = 2
MAX_NEW = 12
_MODELS: dict[str, Any] = {}
_REFERENCE: dict[tuple[str, tuple[int, ...]], list[int]] = {}


def model_of(family: str) -> Any:
    if family not in _MODELS:
        _MODELS[family] = tiny_model(family)
    return _MODELS[family]


def reference(family: str, prompt: list[int]) -> list[int]:
    """Greedy continuation with no stop at all; callers cut it at their stop tokens."""
    key = (family, tuple(prompt))
    if key not in _REFERENCE:
        _REFERENCE[key] = reference_generate(
            model_of(family), [prompt], MAX_NEW, eos_token_id=None, attn_implementation="eager"
        )[0]
    return _REFERENCE[key]


def expected_greedy(family: str, prompt: list[int], p: SamplingParams) -> tuple[list[int], str]:
    stops = set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS})
    tokens = reference(family, prompt)[: p.max_new_tokens]
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1], "stop"
    return tokens, "length"


@dataclass
class Plan:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int
    callback: str  # "record" | "raise" | "abort_other" | "finish_self"
    trigger: int  # the token count at which the callback acts


@dataclass
class Round:
    family: str
    config: EngineConfig
    plans: list[Plan]
    streamed: dict[str, list[RequestOutput]] = field(default_factory=dict)
    ended: list[RequestOutput] = field(default_factory=list)
    aborted: set[str] = field(default_factory=set)  # aborted from outside or by another's callback
    raised: set[str] = field(default_factory=set)
    finished_by_self: set[str] = field(default_factory=set)


def draw_round(seed: int, tier_dir: Path | None = None) -> Round:
    """A round's configuration and requests; with `tier_dir`, a tier round (see the module docstring)."""
    rng = np.random.default_rng(seed)
    family = FAMILIES[seed % len(FAMILIES)]
    allocator = "contiguous" if rng.random() < 0.25 else "paged"
    block_size = int(rng.choice([1, 4, 16]))
    chunked = bool(rng.random() < 0.6)
    capacity = int(rng.integers(32, 64))  # tokens: a few requests at once, so preemption happens
    swap = allocator == "paged" and rng.random() < 0.5
    trng = np.random.default_rng(10_000 + seed)  # the tier round's own stream: rng draws stay the same
    tiers: dict[str, Any] = {}
    if tier_dir is not None:
        allocator, chunked, swap, block_size = "paged", True, True, int(trng.choice([1, 2, 4]))
        capacity = int(trng.integers(24, 40))  # tighter: prefixes leave the device, requests are swapped
        tiers = _tier_settings(trng, tier_dir)
    config = EngineConfig(
        num_blocks=-(-capacity // block_size) + 1,
        block_size=block_size,
        allocator=allocator,  # type: ignore[arg-type]
        scheduler=SchedulerConfig(
            preemption_mode="swap" if swap else "recompute",
            enable_chunked_prefill=chunked,
            max_num_batched_tokens=(
                int(rng.integers(6, 24)) if tier_dir is None else int(trng.integers(4, 10))
            ) if chunked else int(rng.integers(16, 32)),
            max_num_seqs=int(rng.integers(2, 9)) if tier_dir is None else 8,
            admission_lookahead=16 if tier_dir is None else 0,  # no growth reserve: more preemption
        ),
        enable_prefix_caching=bool(rng.random() < 0.8) or bool(tiers),
        **tiers,
    )
    shared = rng.integers(3, VOCAB, size=12).tolist()  # a common head: prefix-cache hits happen
    heads = [trng.integers(3, VOCAB, size=16).tolist() for _ in range(4)]  # tier rounds: four heads
    plans = []
    for i in range(int(rng.integers(5, 9)) if tier_dir is None else int(trng.integers(10, 16))):
        n_prompt = int(rng.integers(1, 18))
        head = shared[: int(rng.integers(0, 12))] if tier_dir is None else heads[int(trng.integers(4))]
        prompt = (head + rng.integers(3, VOCAB, size=n_prompt).tolist())[:20]
        sampled = rng.random() < 0.4
        params = SamplingParams(
            max_new_tokens=int(rng.integers(1, MAX_NEW + 1)),
            temperature=float(rng.choice([0.7, 1.0])) if sampled else 0.0,
            top_k=int(rng.choice([0, 5, 20])) if sampled else 0,
            top_p=float(rng.choice([1.0, 0.9])) if sampled else 1.0,
            seed=int(rng.integers(0, 1000)) if sampled else None,
            n=int(rng.choice([1, 1, 2, 3])),
            stop_token_ids=tuple(int(t) for t in rng.integers(3, VOCAB, size=int(rng.integers(0, 3)))),
            ignore_eos=bool(rng.random() < 0.5),
        )
        callback = str(rng.choice(["record"] * 7 + ["raise", "abort_other", "finish_self"]))
        plans.append(
            Plan(f"r{i}", prompt, params, int(rng.integers(-1, 3)), callback, int(rng.integers(1, 4)))
        )
    return Round(family, config, plans)


def _tier_settings(trng: np.random.Generator, tier_dir: Path) -> dict[str, Any]:
    """A small host RAM tier, half the time a disk tier below it."""
    tiers: dict[str, Any] = {"host_blocks": int(trng.integers(4, 16))}
    if trng.random() < 0.5:
        tiers.update(disk_path=str(tier_dir), disk_bytes=1 << 20)
    return tiers


TAKEN = object()
BAD_INPUTS: list[tuple[Any, dict[str, Any]]] = [
    ([5, VOCAB + 7], {}),
    ([5, 2**31], {}),
    ([1.5, 2.0], {}),
    ([5, 6], {"priority": 0.5}),
    ([5, 6], {"priority": "urgent"}),
    ([5, 6], {"params": SamplingParams(stop=("x",))}),
    ([5, 6], {"request_id": TAKEN}),  # an id in use, or reserved for a child
    ([5, 6], {"request_id": TAKEN}),
    ([5, 6], {"cache_salt": 3.0}),
]


def run_round(rnd: Round, rng: np.random.Generator) -> Engine:
    engine = Engine(model_of(rnd.family), None, rnd.config)
    pending = list(rnd.plans)
    rnd.plans = []  # the accepted ones, in order
    bad_tried = outside_aborts = 0

    def callback_for(plan: Plan) -> Any:
        def on_token(out: RequestOutput) -> None:
            rnd.streamed.setdefault(out.request_id, []).append(out)
            if out.parent_id is not None or len(out.output_token_ids) != plan.trigger or out.finished:
                return
            if plan.callback == "raise":
                rnd.raised.add(out.request_id)
                raise RuntimeError("callback failure")
            if plan.callback == "finish_self" and engine.finish(out.request_id, "stop"):
                rnd.finished_by_self.add(out.request_id)
            if plan.callback == "abort_other":
                others = sorted(engine._tracked)
                if others:
                    victim = others[int(rng.integers(0, len(others)))]
                    if engine.finish(victim):
                        rnd.aborted.add(victim)

        return on_token

    for _ in range(600):
        if not pending and not engine.has_unfinished():
            break
        action = rng.random()
        if pending and action < 0.7:
            plan = pending.pop(0)
            try:
                engine.add_request(
                    plan.prompt, plan.params, request_id=plan.request_id, priority=plan.priority,
                    on_token=callback_for(plan),
                )  # fmt: skip
            except CapacityError:
                continue  # can never be served by this configuration: refused at the door, nothing queued
            rnd.plans.append(plan)
        elif action < 0.75 and bad_tried < len(BAD_INPUTS):
            prompt, kwargs = BAD_INPUTS[bad_tried]
            bad_tried += 1
            if kwargs.get("request_id") is TAKEN:
                in_use = sorted(engine._ids_in_use)
                if not in_use:
                    continue
                kwargs = {"request_id": in_use[int(rng.integers(0, len(in_use)))]}
            kwargs = {"params": SamplingParams(max_new_tokens=2), **kwargs}
            before = (sorted(engine._tracked), engine.scheduler.num_waiting, engine.manager.num_used_blocks)
            with pytest.raises(InvalidArgumentError):
                engine.add_request(prompt, **kwargs)
            assert (
                sorted(engine._tracked),
                engine.scheduler.num_waiting,
                engine.manager.num_used_blocks,
            ) == before
        elif action < 0.77 and engine._tracked and outside_aborts < 1:
            outside_aborts += 1
            victim = sorted(engine._tracked)[int(rng.integers(0, len(engine._tracked)))]
            if engine.finish(victim):
                rnd.aborted.add(victim)
        elif engine.has_unfinished():
            rnd.ended += engine.step()
            engine.manager.check_invariants()
    assert not engine.has_unfinished() and not pending, "the round did not finish"
    return engine


def alone(rnd: Round, plan: Plan) -> dict[str, RequestOutput]:
    """The seeded request by itself in a fresh engine with the same configuration."""
    engine = Engine(model_of(rnd.family), None, rnd.config)
    engine.add_request(plan.prompt, plan.params, request_id=plan.request_id, priority=plan.priority)
    ended: list[RequestOutput] = []
    engine.run(on_step=ended.extend)
    return {o.request_id: o for o in ended}


def check_round(rnd: Round, engine: Engine) -> None:
    ids = [o.request_id for o in rnd.ended]
    assert len(ids) == len(set(ids)), "a request ended more than once"
    final = {o.request_id: o for o in rnd.ended}
    for plan in rnd.plans:
        family_ids = [plan.request_id] + [f"{plan.request_id}.{i}" for i in range(1, plan.params.n)]
        parent = final[plan.request_id]
        if plan.params.n > 1 and len(parent.output_token_ids) >= 1 and parent.finish_reason != "error":
            for child in family_ids[1:]:  # forked (or queued) once the parent's prompt was done
                assert child in final or parent.request_id in rnd.aborted, f"{child} never ended"
        solo = alone(rnd, plan) if plan.params.seed is not None else {}
        for rid in (i for i in family_ids if i in final):
            out = final[rid]
            assert out.finished and out.finish_reason in FINISH_REASONS
            assert out.finish_reason != "rejected", f"{rid} was accepted, then rejected"
            if plan.params.greedy:
                want, reason = expected_greedy(rnd.family, plan.prompt, plan.params)
            else:
                want, reason = solo[rid].output_token_ids, str(solo[rid].finish_reason)
            by_caller = (
                rid in rnd.finished_by_self or plan.request_id in rnd.finished_by_self
            )  # children follow
            natural = out.finish_reason in ("length", "stop") and not by_caller
            if natural:
                assert (out.output_token_ids, out.finish_reason) == (want, reason), (
                    rid,
                    rnd.family,
                    rnd.config,
                )
            else:
                assert out.output_token_ids == want[: len(out.output_token_ids)], (
                    rid,
                    rnd.family,
                    rnd.config,
                )
                if out.finish_reason == "abort":  # aborted itself, or its parent was
                    assert rid in rnd.aborted or plan.request_id in rnd.aborted, rid
                if out.finish_reason == "error":
                    assert rid in rnd.raised, rid
            if out.finish_reason == "error":
                assert out.error
            streamed = rnd.streamed.get(rid, [])
            assert [len(s.output_token_ids) for s in streamed] == list(range(1, len(streamed) + 1))
            assert len(streamed) == len(out.output_token_ids), rid  # one call per token, none after a raise
            if streamed:
                assert streamed[-1].output_token_ids == out.output_token_ids[: len(streamed)]
                assert [s.finished for s in streamed].count(True) <= 1
                assert not any(s.finished for s in streamed[:-1])
            for value in (out.ttft_s, out.tpot_s, out.e2e_s):
                assert value is None or value >= 0
    accepted = {f"{p.request_id}.{i}" if i else p.request_id for p in rnd.plans for i in range(p.params.n)}
    assert set(final) <= accepted
    engine.manager.check_invariants()
    assert engine.manager.num_used_blocks == 0 and engine.manager.num_sequences == 0, "KV leaked"
    if engine.tiering is not None:
        engine.tiering.store.check_invariants()
    assert engine.stats.num_steps == len(engine.stats.running) == len(engine.stats.used_blocks)


@pytest.mark.parametrize("seed", range(10))
def test_random_engine_rounds(seed: int) -> None:
    rnd = draw_round(seed)
    engine = run_round(rnd, np.random.default_rng(1000 + seed))
    check_round(rnd, engine)


@pytest.mark.parametrize("seed", [2, 4, 6, 9, 15, 17])  # rounds that both swap and serve tier hits
def test_random_engine_rounds_with_tiers_and_swap(seed: int, tmp_path: Path) -> None:
    """Tier hits under swap preemption and chunked prefill: outputs still equal transformers', and every
    step's plan had one writer per device block (`SchedulerOutput.check_writes` runs in each schedule)."""
    rnd = draw_round(seed, tmp_path)
    engine = run_round(rnd, np.random.default_rng(2000 + seed))
    check_round(rnd, engine)
    stats = engine.stats.tiers
    assert stats is not None and stats.cached_tokens["CPU"] + stats.cached_tokens["DISK"] > 0
    assert engine.stats.num_swapped_in_blocks > 0
    engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10, 40))
def test_random_engine_rounds_more(seed: int) -> None:
    rnd = draw_round(seed)
    engine = run_round(rnd, np.random.default_rng(1000 + seed))
    check_round(rnd, engine)
