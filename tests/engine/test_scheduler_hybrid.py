"""The scheduler over a `HybridKVManager`: prompts many windows long on pools far smaller than one prompt
are admitted and finished (the window bounds what a windowed group needs; vLLM #39734's deadlock), with
preemption by recompute and by swap, and the plan never reads a released block."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.core.group import KVGroupSpec
from pagedkv.core.hybrid import HybridKVManager
from pagedkv.engine.request import Request
from pagedkv.engine.scheduler import Scheduler, SchedulerConfig


def _drive(m: HybridKVManager, s: Scheduler, rng: np.random.Generator, steps: int = 3000) -> list[Request]:
    finished: list[Request] = []
    for t in range(steps):
        if not s.has_unfinished():
            break
        out = s.schedule(now=float(t))
        for c in out.scheduled:  # what the runner would read: every chunk's slots exist in every group
            for g in range(m.num_groups):
                m.slot_mapping([c.request.seq_id], [c.start], [c.end], group=g)
        sampled = {c.request.request_id: int(rng.integers(0, 50)) for c in out.scheduled if c.produces_token}
        finished += s.update(out, sampled, now=float(t))
        m.check_invariants()
    return finished


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("groups", [(KVGroupSpec("sliding", 16),), (KVGroupSpec(), KVGroupSpec("sliding", 8))])
def test_long_prompts_on_a_small_pool_all_finish(mode: str, groups: tuple[KVGroupSpec, ...]) -> None:
    sliding_only = len(groups) == 1
    # sliding only: 11 usable blocks of 4 tokens (44 tokens) serve prompts of up to 400 tokens
    m = HybridKVManager(12 if sliding_only else 40, 4, groups, num_host_blocks=64)
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=8, preemption_mode=mode, admission_lookahead=0))
    rng = np.random.default_rng(2)
    lengths = rng.integers(100, 400, 6) if sliding_only else rng.integers(20, 90, 8)
    for i, n in enumerate(lengths.tolist()):
        s.add_request(Request(f"r{i}", rng.integers(0, 50, size=n).tolist(), int(rng.integers(1, 40))))
    finished = _drive(m, s, rng)
    assert len(finished) == len(lengths), f"{len(lengths) - len(finished)} requests never finished"
    assert all(r.finish_reason == "length" for r in finished)
    assert m.num_used_blocks == 0 and m.num_sequences == 0
    if not sliding_only:
        assert s.num_preemptions > 0, "the pool was large enough: preemption was not exercised"
