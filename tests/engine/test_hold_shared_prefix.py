"""`SchedulerConfig.hold_shared_prefix`: a request whose first uncached block another request admitted in the
same step computes waits one step and hits it (SGLang's in-batch prefix caching); it changes when requests
start, never what they generate.

Scenario tests on a tiny model (the paged and the hybrid manager), the bounds on the scheduler alone (held at
most once per admission, only beside another admission, never with the switch off or without a prefix cache),
and a Hypothesis test that the outputs are the same with the switch on and off.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.core import ContiguousKVManager, InvalidArgumentError, PagedKVManager
from pagedkv.core.group import KVGroupSpec
from pagedkv.core.hybrid import HybridKVManager
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.scheduler import Scheduler, SchedulerConfig
from pagedkv.hf.oracle import reference_generate
from pagedkv.hf.tiny import tiny_model

BS = 4
SHARED = [5, 9, 14, 3, 27, 8, 11, 40]  # two full blocks of 4 tokens
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)
_MODELS: dict[str, Any] = {}


def model_of(family: str) -> Any:
    if family not in _MODELS:
        _MODELS[family] = tiny_model(family)
    return _MODELS[family]


def engine_of(family: str, hold: bool, **config: Any) -> Engine:
    sched = SchedulerConfig(hold_shared_prefix=hold)
    return Engine(model_of(family), None, EngineConfig(num_blocks=64, block_size=BS, scheduler=sched, **config))


@pytest.mark.parametrize(("family", "allocator"), [("llama", "paged"), ("mistral", "hybrid")])
def test_second_request_of_a_shared_prefix_waits_a_step_and_hits_it(family: str, allocator: str) -> None:
    prompts = [SHARED + [17, 18, 19], SHARED + [60, 61, 62, 63, 64]]
    runs = {}
    for hold in (False, True):
        engine = engine_of(family, hold, allocator=allocator)
        ids = [engine.add_request(p, GREEDY) for p in prompts]  # both arrive before the first step
        engine.step()
        status = [engine.get_request(i).status for i in ids]
        if hold:  # the second waits: its first missing block is the first's first block
            assert status == [RequestStatus.RUNNING, RequestStatus.WAITING]
            engine.step()
            assert engine.get_request(ids[1]).status is RequestStatus.RUNNING
        else:
            assert status == [RequestStatus.RUNNING, RequestStatus.RUNNING]
        engine.run()
        outputs = [engine.output(i) for i in ids]
        runs[hold] = [(o.output_token_ids, o.num_cached_tokens) for o in outputs]
        engine.manager.check_invariants()
        assert engine.manager.num_used_blocks == 0
    assert [cached for _, cached in runs[False]] == [0, 0]  # both computed the shared blocks
    assert [cached for _, cached in runs[True]] == [0, len(SHARED)]  # the second hit them
    assert [out for out, _ in runs[True]] == [out for out, _ in runs[False]]
    expected = reference_generate(model_of(family), prompts, GREEDY.max_new_tokens, eos_token_id=None,
                                  attn_implementation="eager")  # fmt: skip
    assert [out for out, _ in runs[True]] == expected


def test_requests_behind_a_held_one_are_still_admitted_and_it_keeps_its_place() -> None:
    engine = engine_of("llama", True)
    a, b, c = SHARED + [17, 18], SHARED + [60, 61, 62], [70, 71, 72, 73, 74, 75, 76, 77, 78]
    ids = [engine.add_request(p, GREEDY) for p in (a, b, c)]
    engine.step()
    assert [engine.get_request(i).status for i in ids] == [RequestStatus.RUNNING, RequestStatus.WAITING,
                                                           RequestStatus.RUNNING]  # fmt: skip
    engine.step()
    assert engine.get_request(ids[1]).status is RequestStatus.RUNNING
    engine.run()
    assert [engine.output(i).num_cached_tokens for i in ids] == [0, len(SHARED), 0]


# --- the scheduler alone: bounds -----------------------------------------------------------------


def step(s: Scheduler, token: int = 7) -> list[str]:
    """One step with a made-up sampled token; the ids it scheduled."""
    out = s.schedule()
    sampled = {c.request.request_id: token for c in out.scheduled if c.produces_token}
    s.update(out, sampled)
    return [c.request.request_id for c in out.scheduled]


def test_a_request_is_held_at_most_once_then_admitted_even_if_the_prefix_is_again_being_computed() -> None:
    s = Scheduler(PagedKVManager(64, BS), SchedulerConfig())
    s.add_request(Request("a", SHARED + [17], 4))
    s.add_request(Request("late", SHARED + [60, 61], 4))
    out = s.schedule()
    assert [c.request.request_id for c in out.scheduled] == ["a"]  # "late" is held
    s.abort(["a"])  # aborted before its blocks were published: the shared prefix is still uncached
    s.update(out, {})
    s.add_request(Request("first", SHARED + [30], 4, priority=1))  # ahead of "late", computing it again
    assert step(s) == ["first", "late"]  # held once already: admitted though the condition holds again
    assert s.get("late").num_cached_tokens == 0
    s.manager.check_invariants()


def test_nothing_is_held_without_another_admission_in_the_step() -> None:
    # "a" was admitted in an earlier step and computes block 3 in this one; "late" misses exactly block 3,
    # but the hold counts only this step's admissions, so "late" (alone in the queue) is admitted at once
    s = Scheduler(PagedKVManager(64, BS), SchedulerConfig(max_num_batched_tokens=12))
    head = [1, 2, 3, 4, *SHARED, 17, 18, 19, 20]
    s.add_request(Request("a", [*head, 21, 22, 23, 24], 4))
    assert step(s) == ["a"]  # tokens 0-11: blocks 0-2
    s.add_request(Request("late", [*head, 99], 4))
    assert step(s) == ["a", "late"]  # a: tokens 12-19; late: tokens 12-16
    assert s.get("late").num_cached_tokens == 12


@pytest.mark.parametrize("manager", ["contiguous", "paged-no-prefix"])
def test_without_a_prefix_cache_nothing_is_held(manager: str) -> None:
    m = ContiguousKVManager(256, BS) if manager == "contiguous" else PagedKVManager(64, BS, enable_prefix_caching=False)
    s = Scheduler(m, SchedulerConfig())
    s.add_request(Request("a", SHARED + [17], 4))
    s.add_request(Request("b", SHARED + [60], 4))
    assert step(s) == ["a", "b"]


def test_the_switch_is_a_bool() -> None:
    with pytest.raises(InvalidArgumentError, match="hold_shared_prefix"):
        SchedulerConfig(hold_shared_prefix=1)  # type: ignore[arg-type]
    assert SchedulerConfig().hold_shared_prefix is True


# --- outputs unchanged: Hypothesis over random arrivals on the scheduler alone -----------------------


def _next_token(tokens: list[int]) -> int:
    """A deterministic 'model': the next token is a function of the whole sequence (as greedy decoding is)."""
    return 3 + zlib.crc32(np.asarray(tokens, dtype=np.int32).tobytes()) % 40


def _replay(
    manager: str, config: SchedulerConfig, arrivals: list[tuple[int, list[int], int]]
) -> tuple[dict[str, list[int]], int]:
    """Run the requests (arrival step, prompt, max new tokens) to the end: each one's output, and the most
    steps any request waited, between two admissions of it, while a request queued behind it was admitted."""
    m: Any = (
        PagedKVManager(48, BS, partial_reuse=True) if manager == "paged"
        else HybridKVManager(96, BS, (KVGroupSpec(), KVGroupSpec("sliding", 6)))
    )  # fmt: skip
    s = Scheduler(m, config)
    pending = sorted(enumerate(arrivals), key=lambda x: x[1][0])
    added: dict[str, Request] = {}  # in queue order (all priorities 0, arrival order)
    outputs: dict[str, list[int]] = {}
    skipped: dict[str, int] = {}
    worst = 0
    t = 0
    while pending or s.has_unfinished():
        while pending and pending[0][1][0] <= t:
            i, (_, prompt, n) = pending.pop(0)
            added[f"r{i}"] = Request(f"r{i}", prompt, n, arrival_time=float(t))
            s.add_request(added[f"r{i}"])
        waiting = [r for r, req in added.items() if req.status is RequestStatus.WAITING]
        out = s.schedule()
        admitted = {c.request.request_id for c in out.scheduled} & set(waiting)
        for k, r in enumerate(waiting):
            if r in admitted:
                skipped.pop(r, None)
            elif admitted & set(waiting[k + 1 :]):  # a request behind it went first
                skipped[r] = skipped.get(r, 0) + 1
                worst = max(worst, skipped[r])
        sampled = {c.request.request_id: _next_token(c.request.all_token_ids) for c in out.scheduled if c.produces_token}
        for r in s.update(out, sampled, float(t)):
            outputs[r.request_id] = list(r.output_token_ids)
        m.check_invariants()
        t += 1
        assert t < 2000, "scheduler: the replay does not end"
    assert m.num_used_blocks == 0
    return outputs, worst


# mostly shared prefixes, mostly arriving together: most examples hold a request back somewhere
prefixes = st.sampled_from([SHARED, SHARED, SHARED[:4], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], []])
requests = st.tuples(
    st.sampled_from([0, 0, 0, 1, 3]), prefixes, st.lists(st.integers(3, 50), min_size=1, max_size=9), st.integers(1, 6)
).map(lambda x: (x[0], x[1] + x[2], x[3]))


@settings(max_examples=60, deadline=None)
@given(
    manager=st.sampled_from(["paged", "hybrid"]),
    arrivals=st.lists(requests, min_size=1, max_size=10),
    budget=st.sampled_from([8, 16, 512]),
    max_num_seqs=st.sampled_from([2, 256]),
)
def test_outputs_are_the_same_with_the_switch_on_and_off(
    manager: str, arrivals: list[tuple[int, list[int], int]], budget: int, max_num_seqs: int
) -> None:
    base = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, hold_shared_prefix=False)
    off, worst_off = _replay(manager, base, arrivals)
    on, worst_on = _replay(manager, dataclasses.replace(base, hold_shared_prefix=True), arrivals)
    assert on == off
    assert worst_off == 0  # without the switch admission is in queue order
    assert worst_on <= 1  # held at most once per admission
