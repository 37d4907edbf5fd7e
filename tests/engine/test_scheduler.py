"""The scheduler alone, on the real allocators, with made-up sampled tokens (no model)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.core import CapacityError, ContiguousKVManager, InvalidArgumentError, PagedKVManager
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.scheduler import Scheduler, SchedulerConfig


def step(s: Scheduler, now: float = 0.0, token: int = 7):
    out = s.schedule()
    sampled = {c.request.request_id: token for c in out.scheduled if c.produces_token}
    return out, s.update(out, sampled, now)


def test_chunked_prefill_then_decode_first() -> None:
    s = Scheduler(PagedKVManager(64, 4), SchedulerConfig(max_num_batched_tokens=8))
    s.add_request(Request("a", list(range(20)), 3))
    out, _ = step(s)
    assert [(c.request.request_id, c.start, c.num_new_tokens, c.produces_token) for c in out.scheduled] == [("a", 0, 8, False)]
    s.add_request(Request("b", list(range(100, 105)), 2))
    out, _ = step(s)  # the running prefill takes the whole budget: b waits
    assert [(c.request.request_id, c.start, c.num_new_tokens) for c in out.scheduled] == [("a", 8, 8)]
    out, _ = step(s)  # a's last 4 tokens (it samples), then b's first chunk
    got = [(c.request.request_id, c.start, c.num_new_tokens, c.produces_token) for c in out.scheduled]
    assert got == [("a", 16, 4, True), ("b", 0, 4, False)]
    out, _ = step(s)  # decode first, then b's last token
    got = [(c.request.request_id, c.start, c.num_new_tokens, c.produces_token) for c in out.scheduled]
    assert got == [("a", 20, 1, True), ("b", 4, 1, True)]


def test_budget_counts_tokens_exactly() -> None:
    s = Scheduler(PagedKVManager(64, 4), SchedulerConfig(max_num_batched_tokens=10))
    s.add_request(Request("a", list(range(6)), 4))
    s.add_request(Request("b", list(range(50, 56)), 4))
    out, _ = step(s)
    assert [(c.request.request_id, c.num_new_tokens) for c in out.scheduled] == [("a", 6), ("b", 4)]
    out, _ = step(s)
    assert [(c.request.request_id, c.start, c.num_new_tokens) for c in out.scheduled] == [("a", 6, 1), ("b", 4, 2)]


def test_without_chunking_a_prompt_waits_for_a_whole_budget() -> None:
    s = Scheduler(PagedKVManager(64, 4), SchedulerConfig(max_num_batched_tokens=8, enable_chunked_prefill=False))
    s.add_request(Request("a", list(range(6)), 4))
    s.add_request(Request("b", list(range(50, 56)), 4))
    out, _ = step(s)
    assert [c.request.request_id for c in out.scheduled] == ["a"]
    assert s.manager.num_sequences == 1  # b's blocks were given back


def test_priority_admits_first_and_is_preempted_last() -> None:
    m = PagedKVManager(8, 4)  # 7 usable blocks
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=64, admission_lookahead=0))  # greedy: it must preempt
    s.add_request(Request("low", list(range(12)), 20, arrival_time=0.0, priority=0))
    s.add_request(Request("high", list(range(50, 62)), 20, arrival_time=1.0, priority=1))
    out, _ = step(s)
    assert [c.request.request_id for c in out.scheduled] == ["high", "low"]
    preempted = []
    for _ in range(8):
        out, _ = step(s)
        preempted += [r.request_id for r in out.preempted]
    assert preempted and set(preempted) == {"low"}
    assert s.get("low").status is RequestStatus.WAITING and s.get("low").output_token_ids


def test_recompute_and_swap_finish_every_request_without_leaks() -> None:
    for mode in ("recompute", "swap"):
        m = PagedKVManager(16, 4, num_host_blocks=32)
        s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=16, preemption_mode=mode, admission_lookahead=0))
        rng = np.random.default_rng(1)
        for i in range(10):
            s.add_request(Request(f"r{i}", rng.integers(0, 50, size=int(rng.integers(2, 20))).tolist(), int(rng.integers(1, 15))))
        finished = []
        for t in range(500):
            if not s.has_unfinished():
                break
            _, done = step(s, now=float(t), token=int(rng.integers(0, 50)))
            finished += done
            m.check_invariants()
        assert len(finished) == 10 and s.num_preemptions > 0, mode
        assert all(len(r.output_token_ids) == r.max_new_tokens for r in finished)
        assert m.num_used_blocks == 0 and m.num_sequences == 0


def test_eos_and_stop_tokens_finish_early() -> None:
    s = Scheduler(PagedKVManager(32, 4))
    s.add_request(Request("a", [1, 2, 3], 10, eos_token_id=9))
    s.add_request(Request("b", [4, 5, 6], 10, stop_token_ids=(8,)))
    out = s.schedule()
    done = s.update(out, {"a": 9, "b": 3}, now=1.0)
    assert [r.request_id for r in done] == ["a"] and done[0].finish_reason == "stop"
    out = s.schedule()
    done = s.update(out, {"b": 8}, now=2.0)
    assert done[0].finish_reason == "stop" and done[0].output_token_ids == [3, 8]


def test_a_request_that_can_never_fit_is_rejected_and_the_rest_run() -> None:
    s = Scheduler(PagedKVManager(4, 4))  # 3 usable blocks: 12 tokens
    s.add_request(Request("big", list(range(40)), 2))
    s.add_request(Request("ok", list(range(5)), 2))
    out, _ = step(s)
    assert [r.request_id for r in out.rejected] == ["big"]
    assert out.rejected[0].finish_reason == "rejected" and "blocks" in out.rejected[0].error
    assert [c.request.request_id for c in out.scheduled] == ["ok"]


def test_contiguous_baseline_under_the_same_scheduler() -> None:
    m = ContiguousKVManager(17, 4)  # 16 blocks
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=64))
    for i in range(4):
        s.add_request(Request(f"r{i}", list(range(8)), 24))  # each reserves 8 blocks: only 2 fit at once
    out, _ = step(s)
    assert len(out.scheduled) == 2
    while s.has_unfinished():
        step(s)
    assert m.num_used_blocks == 0


def test_fork_shares_prompt_blocks() -> None:
    m = PagedKVManager(32, 4)
    s = Scheduler(m)
    parent = Request("p", list(range(10)), 5)
    s.add_request(parent)
    out = s.schedule()
    child = s.fork(parent, "p#1")
    assert m.block_ids(child.seq_id) == m.block_ids(parent.seq_id)
    assert child.num_computed_tokens == 10  # the step being run computes the prompt for both
    s.update(out, {"p": 1, "p#1": 2})
    assert m.num_computed_tokens(child.seq_id) == 10 == m.num_computed_tokens(parent.seq_id)
    out = s.schedule()
    assert m.block_ids(child.seq_id)[:2] == m.block_ids(parent.seq_id)[:2]
    assert m.block_ids(child.seq_id)[2] != m.block_ids(parent.seq_id)[2]
    assert len(out.copies.src) == 1
    with pytest.raises(InvalidArgumentError):
        s.fork(parent, "p#1")


def test_config_and_request_validation() -> None:
    with pytest.raises(InvalidArgumentError):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(InvalidArgumentError):
        SchedulerConfig(preemption_mode="drop")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        Request("x", [], 3)
    with pytest.raises(InvalidArgumentError):
        Request("x", [1], 0)
    with pytest.raises(InvalidArgumentError):
        Scheduler(ContiguousKVManager(8, 4), SchedulerConfig(preemption_mode="swap"))
    s = Scheduler(PagedKVManager(8, 4))
    s.add_request(Request("x", [1], 3))
    with pytest.raises(InvalidArgumentError):
        s.add_request(Request("x", [2], 3))


def test_a_preempted_request_goes_back_ahead_of_later_arrivals() -> None:
    m = PagedKVManager(6, 4)  # 5 usable blocks
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=64, admission_lookahead=0))  # greedy: b is preempted
    for i, name in enumerate("abc"):
        s.add_request(Request(name, list(range(10 * i, 10 * i + 7)), 30))  # same arrival: FCFS by order added
    out, _ = step(s)
    assert [c.request.request_id for c in out.scheduled] == ["a", "b"]
    while not out.preempted:
        out, _ = step(s)
    assert [r.request_id for r in out.preempted] == ["b"]
    assert s._waiting[0][-1].request_id == "b"  # ahead of c, which was added after it


def test_a_malformed_admission_ends_that_request_with_error_and_the_planned_swap_in_stands() -> None:
    """Defence in depth behind the engine's door (issue 15, case 1): the allocator refuses a token id it
    cannot store while a swap-in is already planned; the bad request ends with "error", the step keeps its
    swap-in and everyone else's chunks."""
    m = PagedKVManager(12, 4, num_host_blocks=12)
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=64, preemption_mode="swap"))
    s.add_request(Request("a", list(range(10, 22)), 20, arrival_time=0.0))
    s.add_request(Request("b", list(range(40, 52)), 20, arrival_time=0.0, priority=-1))
    while not s.swapped:
        step(s)
    s.finish(s.get("a"), "abort")  # room for b to come back
    s.add_request(Request("bad", [5, 2**31], 2, arrival_time=3.0))
    out = s.schedule(now=7.0)
    assert len(out.swap_in.src) > 0 and [c.request.request_id for c in out.scheduled] == ["b"]
    (bad,) = out.rejected
    assert (bad.request_id, bad.finish_reason, bad.finish_time) == ("bad", "error", 7.0)
    assert "2^31" in (bad.error or "")
    m.check_invariants()


def test_rejections_are_stamped_with_the_step_time_or_the_arrival() -> None:
    """Issue 15, case 13: a rejected request never finishes before it arrived."""
    s = Scheduler(PagedKVManager(4, 4))  # 12 tokens
    s.add_request(Request("big", list(range(40)), 2, arrival_time=5.0))
    (r,) = s.schedule(now=9.0).rejected
    assert r.finish_time == 9.0
    s.add_request(Request("big2", list(range(41)), 2, arrival_time=6.0))
    (r,) = s.schedule().rejected
    assert r.finish_time == 6.0


def test_without_chunking_rejection_ignores_the_prefix_cache_and_recompute_is_chunked() -> None:
    """Issue 15, case 12, at the scheduler: a prompt above the budget is rejected even when most of it is
    cached; a preempted request whose prompt + output exceed the budget is recomputed in chunks."""
    m = PagedKVManager(64, 4)
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=15, enable_chunked_prefill=False))
    s.add_request(Request("warm", list(range(12)) + [90, 91], 1))
    while s.has_unfinished():
        step(s)
    s.add_request(Request("long", list(range(12)) + [92, 93, 94, 95], 1))  # 16 tokens, 12 of them cached
    out = s.schedule()
    assert [r.request_id for r in out.rejected] == ["long"] and "exceeds max_num_batched_tokens" in out.rejected[0].error
    m2 = PagedKVManager(9, 4)  # 8 usable blocks = 32 tokens
    s2 = Scheduler(m2, SchedulerConfig(max_num_batched_tokens=15, enable_chunked_prefill=False, admission_lookahead=0))
    s2.add_request(Request("a", list(range(10, 24)), 18))
    s2.add_request(Request("b", list(range(40, 54)), 18))
    finished = []
    for _ in range(200):
        if not s2.has_unfinished():
            break
        finished += step(s2)[1]
    assert s2.num_preemptions > 0
    assert sorted((r.request_id, r.finish_reason, len(r.output_token_ids)) for r in finished) == [
        ("a", "length", 18), ("b", "length", 18),
    ]  # fmt: skip


def test_forks_count_against_max_num_seqs() -> None:
    s = Scheduler(PagedKVManager(32, 4), SchedulerConfig(max_num_seqs=2))
    s.add_request(Request("p", list(range(10)), 5))
    s.add_request(Request("q", list(range(20, 25)), 5))
    s.schedule()
    with pytest.raises(CapacityError, match="max_num_seqs"):
        s.fork(s.get("p"), "p.1")
    assert s.num_running == 2 and s.manager.num_sequences == 2


def test_finish_reasons_are_checked() -> None:
    s = Scheduler(PagedKVManager(8, 4))
    s.add_request(Request("x", [1, 2], 3))
    with pytest.raises(InvalidArgumentError):
        s.finish(s.get("x"), "banana")
    s.finish(s.get("x"), "abort", now=1.0)
    assert not s.has_unfinished()


def test_admission_headroom_admits_one_new_request_when_short_of_free_blocks() -> None:
    """transformers' safety_margin semantics: below the headroom at the start of a step, a new request is
    admitted only while nothing else is scheduled; at 0 (the default) admission is greedy."""

    def first_step(headroom: float) -> list[str]:
        m = PagedKVManager(16, 4)
        held = m.admit(list(range(500, 540)))  # 10 blocks held outside the scheduler: 5 of 15 free
        assert held is not None
        s = Scheduler(m, SchedulerConfig(admission_headroom=headroom, admission_lookahead=0))
        for rid in "abc":
            s.add_request(Request(rid, list(range(100 * ord(rid), 100 * ord(rid) + 4)), 2))
        out, _ = step(s)
        return [c.request.request_id for c in out.scheduled]

    assert first_step(0.0) == ["a", "b", "c"]
    assert first_step(0.3) == ["a", "b", "c"]  # 5 of 15 free: roomy
    assert first_step(0.5) == ["a"]  # short of free blocks: only the first request of the step goes in

    s = Scheduler(PagedKVManager(16, 4), SchedulerConfig(admission_headroom=0.5, admission_lookahead=0))
    for rid in "abc":
        s.add_request(Request(rid, list(range(100 * ord(rid), 100 * ord(rid) + 12)), 8))
    step(s)  # 9 blocks taken: 6 of 16 free at the next step's start, under the headroom
    s.add_request(Request("d", [1, 2, 3], 2))
    out, _ = step(s)
    assert [c.request.request_id for c in out.scheduled] == ["a", "b", "c"], "decodes run, d waits"
    for bad in (-0.1, 1.0, True, "0.1"):
        with pytest.raises(InvalidArgumentError, match="admission_headroom"):
            SchedulerConfig(admission_headroom=bad)  # type: ignore[arg-type]


def test_growth_reserve_keeps_the_blocks_running_requests_are_about_to_need() -> None:
    """With the default 16-token growth reserve a second request waits while admitting it would leave the
    running one without the blocks it needs for its next 16 tokens; greedy admission (0) takes it and then
    has to preempt. The first request of a step is always admitted, and a request whose `max_new_tokens`
    ends sooner reserves only what it can still use."""

    def run(lookahead: int, max_new: int = 40) -> tuple[list[list[str]], int]:
        m = PagedKVManager(9, 4)  # 8 usable blocks = 32 tokens
        s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=64, admission_lookahead=lookahead))
        s.add_request(Request("a", list(range(12)), max_new))  # 3 blocks, 4 more for 16 tokens of growth
        s.add_request(Request("b", list(range(20, 32)), 8))  # 3 blocks
        steps = []
        while s.has_unfinished() and len(steps) < 200:
            out, _ = step(s)
            steps.append([c.request.request_id for c in out.scheduled])
            m.check_invariants()
        assert not s.has_unfinished()
        return steps, s.num_preemptions

    greedy, preemptions = run(0)
    assert greedy[0] == ["a", "b"] and preemptions > 0
    reserved, preemptions = run(16)
    assert reserved[0] == ["a"] and preemptions == 0, "b waits: 8 - 3 - 3 < 4 blocks"
    assert "b" in {r for s in reserved for r in s}, "b runs once a has finished"
    short, _ = run(16, max_new=3)  # a can grow by 3 tokens only: no block beyond its 3
    assert short[0] == ["a", "b"]
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidArgumentError, match="admission_lookahead"):
            SchedulerConfig(admission_lookahead=bad)  # type: ignore[arg-type]
