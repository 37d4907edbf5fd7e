"""The planner's shared-prefix pass (issue 20 item 7): the same figures as the quadratic definition it
replaced, on random workloads with shared prefixes and multi-turn chains, and work that grows with the
shared blocks, not with pairs of requests."""

from __future__ import annotations

import bisect

import numpy as np
import pytest

from pagedkv.sim.planner import shared_blocks_saved, shared_prefix_chains
from pagedkv.workloads.generators import GeneratedRequest


def _reference_chains(requests: list[GeneratedRequest], bs: int) -> list[list[tuple[int, ...]]]:
    """The definition: per request, per leading full block, the sorted first positions of the other
    conversations holding it; stop at the first block no other conversation holds."""
    by_index = {r.index: r for r in requests}

    def root(r: GeneratedRequest) -> int:
        while r.parent is not None and r.parent in by_index:
            r = by_index[r.parent]
        return r.index

    conv = [root(r) for r in requests]
    holders: dict[tuple[int, bytes], dict[int, int]] = {}
    keys = []
    for pos, r in enumerate(requests):
        ids = np.asarray(r.prompt_token_ids, dtype=np.int32)
        chain = [(j, ids[: (j + 1) * bs].tobytes()) for j in range(len(ids) // bs)]
        for k in chain:
            holders.setdefault(k, {}).setdefault(conv[pos], pos)
        keys.append(chain)
    out = []
    for pos, chain in enumerate(keys):
        shared = []
        for k in chain:
            others = tuple(sorted(p for c, p in holders[k].items() if c != conv[pos]))
            if not others:
                break
            shared.append(others)
        out.append(shared)
    return out


def _reference_saved(chains: list[list[tuple[int, ...]]], window: int) -> np.ndarray:
    half = max(window, 1) // 2
    out = np.zeros(len(chains))
    for pos, shared in enumerate(chains):
        lo, hi = pos - half, pos + half
        out[pos] = sum(1 - 1 / (1 + bisect.bisect_right(o, hi) - bisect.bisect_left(o, lo)) for o in shared)
    return out


def _random_workload(rng: np.random.Generator, n: int, bs: int) -> list[GeneratedRequest]:
    heads = [rng.integers(0, 5, size=int(rng.integers(0, 6 * bs))) for _ in range(4)]
    reqs: list[GeneratedRequest] = []
    for i in range(n):
        parent = None
        if reqs and rng.random() < 0.3:  # a later turn: extends an earlier request's prompt
            parent = int(rng.integers(len(reqs)))
            prompt = np.concatenate(
                [reqs[parent].prompt_token_ids, rng.integers(0, 5, size=int(rng.integers(1, 3 * bs)))]
            )
        else:
            head = heads[int(rng.integers(len(heads)))]
            prompt = np.concatenate(
                [
                    head[: int(rng.integers(0, len(head) + 1))],
                    rng.integers(0, 5, size=int(rng.integers(1, 2 * bs))),
                ]
            )
        out = np.zeros(1, dtype=np.int32)
        reqs.append(
            GeneratedRequest(
                i, 0.0, prompt.astype(np.int32), out, parent=None if parent is None else reqs[parent].index
            )
        )
    return reqs


@pytest.mark.parametrize("seed", range(12))
def test_shared_blocks_saved_matches_the_definition(seed: int) -> None:
    rng = np.random.default_rng(seed)
    bs = int(rng.choice([1, 2, 4]))
    reqs = _random_workload(rng, int(rng.integers(1, 60)), bs)
    ref = _reference_chains(reqs, bs)
    chains = shared_prefix_chains(reqs, bs)
    for window in (1, 2, 3, 8, 33, 10**6):
        np.testing.assert_allclose(
            shared_blocks_saved(chains, window), _reference_saved(ref, window), atol=1e-12
        )


def test_one_block_shared_by_every_request_is_not_quadratic() -> None:
    """Mooncake's conversation trace: every request starts with the same block. The pass keeps one holder
    per (block, conversation), not the other holders per request (20,000^2 here); plan time vs trace size
    is benchmarked in docs/benchmarks.md, not timed here."""
    bs = 16
    head = np.arange(bs, dtype=np.int32)
    rng = np.random.default_rng(0)
    reqs = [
        GeneratedRequest(i, 0.0, np.concatenate([head, rng.integers(100, 10**6, size=3 * bs).astype(np.int32)]),
                         np.zeros(1, dtype=np.int32))
        for i in range(20_000)
    ]  # fmt: skip
    chains = shared_prefix_chains(reqs, bs)
    saved = shared_blocks_saved(chains, 256)
    assert len(chains.owner) == 20_000, "one shared block per request"
    assert len(chains.holders) == 20_000, "one holder per conversation of the shared block"
    assert saved[10_000] == pytest.approx(1 - 1 / 257)


@pytest.mark.parametrize("turns", [0, -1])
def test_multi_turn_with_no_turns_is_a_typed_error(turns: int) -> None:
    """`plan|simulate --workload multi-turn --turns 0` divided by zero (issue 20 item 10)."""
    from pagedkv.core.errors import InvalidArgumentError
    from pagedkv.sim.workload import WorkloadSpec

    with pytest.raises(InvalidArgumentError, match="turns"):
        WorkloadSpec(source="multi-turn", num_requests=10, turns=turns)
