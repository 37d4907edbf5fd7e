"""Sample groups (`Engine.add_request(..., group_id=...)`, pagedkv.engine.groups) under the arrival orders a
server sees: a request of the group that comes after the leader wrote the prompt but before the held ones
were queued, a leader that ends before its prompt is written, held requests the caller ends, ids sent
again. No request is ever lost: from `add_request` to `release` each is held, queued or ended, `finish`
knows it, every completion ends exactly once, and the pool is idle at the end.

9-token prompts (two full 4-token blocks and one token) on an 8-token step budget: a prompt takes two steps."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.intake import family_ids
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.scheduler import SchedulerConfig
from pagedkv.hf.tiny import tiny_model

PROMPTS = ([(7 * i) % 120 + 5 for i in range(9)], [(11 * i) % 120 + 5 for i in range(9)])
PICK = st.integers(0, 63)  # which of the requests in flight (modulo their number)
SHARED = 8  # the prompt's full blocks: what a request of the group takes from the leader


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model("llama", 0)


def make_engine(model: Any, budget: int = 8) -> Engine:
    chunked = SchedulerConfig(max_num_batched_tokens=budget)
    return Engine(model, None, EngineConfig(num_blocks=48, block_size=4, scheduler=chunked))


def params(n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, max_new_tokens=2, ignore_eos=True)


def drain(engine: Engine) -> dict[str, Any]:
    """Step until nothing is unfinished; each completion's final output by id (each delivered once)."""
    done: dict[str, Any] = {}
    for _ in range(200):
        if not engine.has_unfinished():
            return done
        for out in engine.step():
            assert out.request_id not in done, f"{out.request_id} delivered twice"
            done[out.request_id] = out
    raise AssertionError("the engine did not drain in 200 steps")


def assert_idle(engine: Engine) -> None:
    assert not engine.has_unfinished() and not engine._ids_in_use and not engine._outputs
    assert engine._groups.held_ids() == set()
    assert engine.manager.num_used_blocks == 0
    engine.manager.check_invariants()


def test_a_request_that_comes_after_the_leaders_prefill_but_before_the_release_keeps_the_held_ones(
    model: Any,
) -> None:
    """The replica's interleaving: L leads, A is held; L's prompt is written in the step that just ran, and B
    comes before the next step queues A. B waits with A (one step at most); A is not forgotten: `finish`
    knows it and it ends, and both take the prompt from L."""
    engine = make_engine(model, budget=64)  # the prompt in one step
    engine.add_request(PROMPTS[0], params(), request_id="L", group_id="g")
    engine.add_request(PROMPTS[0], params(), request_id="A", group_id="g")
    engine.step()  # L's prompt is in
    engine.add_request(PROMPTS[0], params(), request_id="B", group_id="g")
    assert engine._groups.held_ids() == {"A", "B"}
    done = drain(engine)
    assert set(done) == {"L", "A", "B"} and {o.finish_reason for o in done.values()} == {"length"}
    assert [done[i].num_cached_tokens for i in "LAB"] == [0, SHARED, SHARED]
    assert engine.group_prefill_shared_tokens == 2 * SHARED
    for rid in "LAB":
        assert engine.release(rid) is not None
    assert_idle(engine)


def test_a_held_request_ended_after_the_leaders_prefill_ends_once(model: Any) -> None:
    engine = make_engine(model, budget=64)
    engine.add_request(PROMPTS[0], params(), request_id="L", group_id="g")
    engine.add_request(PROMPTS[0], params(), request_id="A", group_id="g")
    engine.step()
    engine.add_request(PROMPTS[0], params(), request_id="B", group_id="g")
    assert engine.finish("A") is True and engine.finish("A") is False
    done = drain(engine)
    assert {i: o.finish_reason for i, o in done.items()} == {"L": "length", "A": "abort", "B": "length"}
    for rid in "LAB":
        assert engine.release(rid) is not None
    assert_idle(engine)


def test_a_leader_ended_before_its_prompt_is_written_hands_the_lead_to_the_first_held_request(
    model: Any,
) -> None:
    """L ends after one of its prompt's two steps: A leads in its place (taking the block L wrote), B still
    waits for A's prompt and then takes both blocks."""
    engine = make_engine(model)
    for rid in "LAB":
        engine.add_request(PROMPTS[0], params(), request_id=rid, group_id="g")
    engine.step()  # L computes 8 of its 9 prompt tokens
    assert engine.finish("L") is True
    done = {o.request_id: o for o in engine.step()}  # A leads, B waits
    assert engine._groups.held_ids() == {"B"} and set(done) == {"L"}
    done |= drain(engine)
    assert {i: o.finish_reason for i, o in done.items()} == {"L": "abort", "A": "length", "B": "length"}
    assert done["A"].num_cached_tokens == SHARED and done["B"].num_cached_tokens == SHARED
    for rid in "LAB":
        assert engine.release(rid) is not None
    assert_idle(engine)


class GroupArrivals(RuleBasedStateMachine):
    """Random arrivals, ends, steps and releases of grouped, ungrouped and `n > 1` requests."""

    model: Any = None

    def __init__(self) -> None:
        super().__init__()
        if GroupArrivals.model is None:
            GroupArrivals.model = tiny_model("llama", 0)
        self.engine = make_engine(GroupArrivals.model)
        self.n: dict[str, int] = {}  # added and not released: root id -> n
        self.delivered: dict[str, Any] = {}  # completion id -> its final output
        self.next_id = 0

    def _family(self, rid: str) -> list[str]:
        return family_ids(rid, self.n[rid])

    @rule(
        group=st.sampled_from(["g", "h", None]), prompt=st.sampled_from([0, 1]), n=st.sampled_from([1, 1, 2])
    )
    def add(self, group: str | None, prompt: int, n: int) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        assert self.engine.add_request(PROMPTS[prompt], params(n), request_id=rid, group_id=group) == rid
        self.n[rid] = n

    def _pick(self, pick: int) -> str | None:
        ids = sorted(self.n)
        return ids[pick % len(ids)] if ids else None

    @rule(pick=PICK)
    def add_an_id_in_use(self, pick: int) -> None:
        if (rid := self._pick(pick)) is None:
            return
        with pytest.raises(InvalidArgumentError):
            self.engine.add_request(PROMPTS[0], params(), request_id=rid, group_id="g")

    @rule(pick=PICK)
    def finish(self, pick: int) -> None:
        if (rid := self._pick(pick)) is None:
            return
        ended = rid in self.engine._outputs
        assert self.engine.finish(rid, "abort") is not ended  # never raises: the engine knows it

    @rule(times=st.integers(1, 3))
    def step(self, times: int) -> None:
        for out in [o for _ in range(times) for o in self.engine.step()]:
            assert out.request_id not in self.delivered, f"{out.request_id} delivered twice"
            self.delivered[out.request_id] = out

    @rule(pick=PICK)
    def release(self, pick: int) -> None:
        """Outputs come back once the whole family has ended and `step()` has returned each end."""
        if (rid := self._pick(pick)) is None:
            return
        engine, family = self.engine, self._family(rid)
        ready = rid in self.delivered and all(
            i not in engine._tracked and (i not in engine._outputs or i in self.delivered) for i in family
        )
        got = engine.release(rid)
        assert (got is not None) == ready
        if got is not None:
            assert [o.request_id for o in got] == [i for i in family if i in self.delivered]
            del self.n[rid]

    @invariant()
    def every_request_is_somewhere(self) -> None:
        engine = self.engine
        engine._groups.check_invariants(engine._tracked.__contains__)
        held = engine._groups.held_ids()
        for rid in self.n:
            assert rid in held or rid in engine._tracked or rid in engine._outputs, f"{rid} is lost"

    def teardown(self) -> None:
        done = drain(self.engine)
        for rid in done:
            assert rid not in self.delivered, f"{rid} delivered twice"
        self.delivered.update(done)
        for rid in list(self.n):
            assert rid in self.delivered, f"{rid} never ended"
            assert self.engine.release(rid) is not None
        assert_idle(self.engine)


TestGroupArrivals = GroupArrivals.TestCase
TestGroupArrivals.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_pause_abort_ends_the_requests_still_held_for_their_leader(model: Any) -> None:
    """`pause("abort")` ends every request in flight, the sample group's held ones too (they are not queued
    yet): none runs on while the engine is paused."""
    engine = make_engine(model)
    for rid in ("L", "A", "B"):
        engine.add_request(PROMPTS[0], params(), request_id=rid, group_id="g")
    assert engine._groups.held_ids() == {"A", "B"}
    ended = engine.pause("abort")
    assert sorted(ended) == ["A", "B", "L"]
    done = drain(engine)
    assert {o.finish_reason for o in done.values()} == {"abort"} and set(done) == {"L", "A", "B"}
    engine.resume()
    for rid in "LAB":
        engine.release(rid)
    assert_idle(engine)
