from __future__ import annotations

import math

import numpy as np
import pytest

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.workloads import legal


def test_constants_follow_from_the_published_figures() -> None:
    # 1,664,581,107 bytes / 26,632 examples / 4 characters per token
    assert pytest.approx(15_625.8, abs=0.1) == legal.CUAD_MEAN_PROMPT_TOKENS, "mean from the dataset card"
    assert pytest.approx(math.log(75) / (2 * 2.3263), rel=1e-6) == legal.CUAD_PROMPT_SIGMA, "2..150 pages"
    mu, sigma = legal.CUAD_PROMPT_LOGNORMAL
    assert math.exp(mu + sigma**2 / 2) == pytest.approx(legal.CUAD_MEAN_PROMPT_TOKENS), "the mean is kept"


def test_lengths_match_the_cuad_fit() -> None:
    reqs = legal.legal_contract(20_000, seed=1)
    p = np.log([r.prompt_len for r in reqs])
    assert abs(p.mean() - legal.CUAD_PROMPT_MU) < 0.03, "ln prompt mean"
    assert abs(p.std() - legal.CUAD_PROMPT_SIGMA) < 0.03, "ln prompt spread"
    stats = legal.legal_stats(reqs)
    assert 100 <= stats["output_median"] <= 400, "answers of a few hundred tokens"
    assert stats["prompt_median"] > 20 * stats["output_median"], "long documents, short answers"


def test_truncation_to_the_context_and_seeding() -> None:
    reqs = legal.legal_contract(500, seed=3, max_prompt_len=4096, min_prompt_len=256)
    lens = np.array([r.prompt_len for r in reqs])
    assert lens.max() == 4096 and lens.min() >= 256, "prompts cut to the context, at least one page"
    assert legal.legal_stats(reqs, 4096)["truncated"] == (lens == 4096).sum() > 100, "most are cut at 4k"
    again = legal.legal_contract(500, seed=3, max_prompt_len=4096)
    assert all(np.array_equal(a.prompt_token_ids, b.prompt_token_ids) for a, b in zip(reqs, again)), "seeded"


def test_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="num_requests"):
        legal.legal_contract(0)
    with pytest.raises(InvalidArgumentError, match="below min_prompt_len"):
        legal.legal_contract(3, max_prompt_len=100, min_prompt_len=256)
    with pytest.raises(InvalidArgumentError, match="no requests"):
        legal.legal_stats([])


def test_simulator_workload_leaves_room_for_the_answer() -> None:
    from pagedkv.sim.workload import LEGAL_ANSWER_ROOM, WorkloadSpec, build_workload

    wl = build_workload(WorkloadSpec(source="legal", num_requests=200, arrivals="burst"), 8192)
    assert "legal" in wl.name and wl.num_dropped == 0, "every contract is truncated, none dropped"
    assert max(r.prompt_len for r in wl.requests) == 8192 - LEGAL_ANSWER_ROOM, "cut to leave answer room"
