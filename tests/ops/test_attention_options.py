"""`AttentionOptions`: a layer's scale, sliding window and soft cap carried as one checked value from the model's
call to the backend, and `run_planned`: a layer's call on a plan passes only its query, caches and options."""

from __future__ import annotations

import math

import pytest
import torch
from ops_batch import make_batch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.ops import paged_attention
from pagedkv.ops.attention import run_planned
from pagedkv.ops.contiguous_oracle import sdpa_attention
from pagedkv.ops.options import AttentionOptions, attention_options
from pagedkv.ops.plan import plan_attention
from pagedkv.ops.reference import paged_attention_reference


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [({"scale": 0.0}, "scale"), ({"scale": float("nan")}, "scale"), ({"sliding_window": 0}, "sliding_window"),
     ({"sliding_window": 2.5}, "sliding_window"), ({"soft_cap": -1.0}, "soft_cap"), ({"soft_cap": float("inf")}, "soft_cap")],
)  # fmt: skip
def test_bad_scalars_are_one_typed_line(kwargs: dict[str, float], names: str) -> None:
    for build in (AttentionOptions, attention_options):
        with pytest.raises(InvalidArgumentError, match=names) as info:
            build(**kwargs)
        assert "\n" not in str(info.value)


def test_equal_scalars_are_one_checked_value() -> None:
    a = attention_options(0.25, 4, 30.0)
    assert a is attention_options(0.25, 4, 30.0) and a == AttentionOptions(0.25, 4, 30.0)
    with pytest.raises(AttributeError):
        a.scale = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("options", [AttentionOptions(), AttentionOptions(0.5, 3, 5.0), AttentionOptions(None, 1, None)])
def test_a_planned_call_with_options_equals_the_full_call(options: AttentionOptions) -> None:
    torch.manual_seed(0)
    b = make_batch(3, [9, 5, 12], [1, 5, 3], block_size=4)
    plan = plan_attention(*b.args(), backend="reference")
    want = paged_attention_reference(b.query, b.key_cache, b.value_cache, plan, options)
    got = run_planned(plan, b.query, b.key_cache, b.value_cache, options)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # every option reached the backend
    full = paged_attention(*b.args(), scale=options.scale, sliding_window=options.sliding_window,
                           soft_cap=options.soft_cap, backend="reference")  # fmt: skip
    torch.testing.assert_close(full, want, rtol=0, atol=0)
    assert torch.isfinite(got).all()
    oracle = sdpa_attention(b.query, b.keys, b.values, b.seq_lens, b.cu_seqlens_q, options)  # every option counted
    torch.testing.assert_close(got, oracle, atol=2e-6, rtol=2e-6)


def test_the_default_scale_is_sdpas() -> None:
    assert AttentionOptions().scale_for(128) == 1.0 / math.sqrt(128) != 128**-0.5  # to the bit
    assert AttentionOptions(0.3).scale_for(128) == 0.3


def test_a_call_off_its_plan_is_refused() -> None:
    b = make_batch(3, [9, 5, 12], [1, 5, 3], block_size=4)
    plan = plan_attention(*b.args(), backend="reference")
    with pytest.raises(InvalidArgumentError, match="do not match the plan"):
        run_planned(plan, b.query[:2], b.key_cache, b.value_cache, AttentionOptions())
