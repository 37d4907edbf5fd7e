"""Random workloads through the scheduler and both allocators: every request finishes, nothing leaks."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.core import CapacityError, ContiguousKVManager, PagedKVManager
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.scheduler import Scheduler, SchedulerConfig

request = st.tuples(
    st.lists(st.integers(0, 3), min_size=1, max_size=40),  # tiny vocabulary: shared prefixes happen
    st.integers(1, 20),  # max_new_tokens
    st.integers(0, 2),  # priority
)


@settings(max_examples=500, deadline=None)
@given(
    requests=st.lists(request, min_size=1, max_size=12),
    num_blocks=st.integers(4, 40),
    budget=st.integers(1, 48),
    chunked=st.booleans(),
    mode=st.sampled_from(["recompute", "swap", "contiguous"]),
    fork_every=st.integers(0, 4),
    abort_every=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_random_workloads_finish_without_leaks(
    requests, num_blocks, budget, chunked, mode, fork_every, abort_every, seed
) -> None:
    if mode == "contiguous":
        manager: PagedKVManager | ContiguousKVManager = ContiguousKVManager(num_blocks, 4)
    else:
        manager = PagedKVManager(num_blocks, 4, num_host_blocks=num_blocks)
    config = SchedulerConfig(
        max_num_seqs=6, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
        preemption_mode="swap" if mode == "swap" else "recompute",
    )  # fmt: skip
    s = Scheduler(manager, config)
    rng = np.random.default_rng(seed)
    for i, (prompt, max_new, prio) in enumerate(requests):
        s.add_request(Request(f"r{i}", prompt, max_new, arrival_time=float(i), priority=prio))
    done: dict[str, Request] = {}
    forks = 0
    for step in range(3000):
        if not s.has_unfinished():
            break
        out = s.schedule()
        for r in out.rejected:
            done[r.request_id] = r
        if out.is_empty and not out.rejected:
            # nothing can run: only possible if every unfinished request is waiting on memory that
            # running requests hold, which cannot happen when nothing runs
            assert s.num_running == 0 and not s.swapped, "scheduler stalled with work in flight"
            break
        sampled = {c.request.request_id: int(rng.integers(0, 4)) for c in out.scheduled if c.produces_token}
        if fork_every and mode != "contiguous" and step % fork_every == 0:
            for c in out.scheduled:
                if c.produces_token and not c.request.output_token_ids and forks < 4:
                    try:  # children count against max_num_seqs: a full batch refuses the fork
                        child = s.fork(c.request, f"{c.request.request_id}#{forks}")
                    except CapacityError:
                        assert s.num_running >= config.max_num_seqs, "fork refused with room to spare"
                        break
                    assert s.num_running <= config.max_num_seqs
                    sampled[child.request_id] = int(rng.integers(0, 4))
                    forks += 1
                    break
        for r in s.update(out, sampled, now=float(step)):
            done[r.request_id] = r
        if abort_every and step % abort_every == 0 and s.running:
            victim = s.running[int(rng.integers(0, len(s.running)))]
            s.abort([victim.request_id])
            done[victim.request_id] = victim
        manager.check_invariants()
    assert not s.has_unfinished(), "some requests never finished"
    assert manager.num_used_blocks == 0 and manager.num_sequences == 0, "blocks leaked"
    for r in done.values():
        assert r.status is RequestStatus.FINISHED
        if r.finish_reason == "length":
            assert len(r.output_token_ids) == r.max_new_tokens
        if r.finish_reason == "rejected":
            assert r.error
