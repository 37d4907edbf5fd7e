"""Sampling: greedy is argmax; temperature / top-k / top-p restrict the support; seeds reproduce draws."""

from __future__ import annotations

import pytest
import torch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.sampler import bad_rows, filter_logits, make_generator, sample


def test_greedy_is_argmax_with_lowest_id_on_ties() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    assert sample(logits, [SamplingParams()] * 2, [None, None]) == [1, 0]


def test_top_k_keeps_only_k_tokens() -> None:
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0, 0.0])
    kept = torch.isfinite(filter_logits(logits, 1.0, 2, 1.0))
    assert kept.tolist() == [False, True, True, False, False]


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = torch.isfinite(filter_logits(probs.log(), 1.0, 0, 0.8))
    assert kept.tolist() == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    kept = torch.isfinite(filter_logits(probs.log(), 1.0, 0, 0.81))
    assert kept.tolist() == [True, True, True, False]
    assert torch.isfinite(filter_logits(probs.log(), 1.0, 0, 0.01)).sum() == 1  # the top token always stays


def test_seeded_draws_repeat_and_ignore_batch_neighbours() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=1.0, seed=7)
    alone = [sample(logits[1:2], [p], [make_generator(7)])[0] for _ in range(3)]
    assert len(set(alone)) == 1
    mixed = sample(
        logits, [SamplingParams(), p, SamplingParams(temperature=0.5)], [None, make_generator(7), None]
    )
    assert mixed[1] == alone[0]


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    gen = make_generator(0)
    p = SamplingParams(temperature=1.0)
    draws = [sample(logits, [p], [gen])[0] for _ in range(2000)]
    freq = [draws.count(i) / len(draws) for i in range(3)]
    assert freq == pytest.approx([0.7, 0.2, 0.1], abs=0.04)


def test_low_temperature_approaches_greedy() -> None:
    torch.manual_seed(1)
    logits = torch.randn(1, 100)
    p = SamplingParams(temperature=1e-4, seed=3)
    assert sample(logits, [p], [make_generator(3)]) == [int(logits.argmax())]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_new_tokens": 0},
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"top_k": -1},
        {"n": 0},
        {"stop": "x"},
        {"stop": ("",)},
    ],
)
def test_invalid_params_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidArgumentError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_child_seeds_differ() -> None:
    p = SamplingParams(seed=10, n=3)
    assert [p.child_seed(i) for i in range(3)] == [10, 11, 12]
    assert SamplingParams().child_seed(1) is None


@pytest.mark.parametrize("seed", range(20))
def test_bad_rows_are_exactly_those_with_nan_posinf_or_nothing_finite(seed: int) -> None:
    """The one-pass check (a row's max is not finite) finds the rows the definition names, and `sample`
    refuses exactly when there is one."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(8, 50, generator=gen)
    for row in range(8):
        kind = int(torch.randint(0, 6, (1,), generator=gen))
        cols = torch.randint(0, 50, (3,), generator=gen)
        if kind == 1:
            logits[row, cols] = float("nan")
        elif kind == 2:
            logits[row, cols] = float("inf")
        elif kind == 3:
            logits[row] = float("-inf")
        elif kind == 4:
            logits[row, cols] = float("-inf")  # still samplable
        elif kind == 5:
            logits[row, cols[0]], logits[row, cols[1]] = float("inf"), float("nan")
    want = (logits.isnan().any(-1) | logits.isposinf().any(-1) | logits.isneginf().all(-1)).nonzero().flatten()
    assert bad_rows(logits) == want.tolist()
    greedy = [SamplingParams(max_new_tokens=1)] * 8
    if want.numel():
        with pytest.raises(InvalidArgumentError):
            sample(logits, greedy, [None] * 8)
    else:
        assert sample(logits, greedy, [None] * 8) == logits.argmax(-1).tolist()
