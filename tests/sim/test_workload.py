from __future__ import annotations

import numpy as np
import pytest

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.sim.workload import WorkloadSpec, build_workload

MOONCAKE = "/work/shared/data/mooncake-fast25/synthetic_trace.jsonl"


def test_default_is_the_shipped_azure_trace_fitted_to_max_model_len() -> None:
    wl = build_workload(WorkloadSpec(num_requests=300), 4096)
    assert "azure-conv" in wl.name and "300 requests" in wl.name, "names the workload"
    assert all(r.prompt_len + r.output_len <= 4096 for r in wl.requests), "fits max_model_len"
    assert len(wl.requests) + wl.num_dropped == 300, "dropped ones are counted"
    assert wl.requests[0].arrival_s == 0.0 and wl.requests[-1].arrival_s > 10, "timestamps honoured"


def test_burst_and_time_scale() -> None:
    burst = build_workload(WorkloadSpec(num_requests=50, arrivals="burst"), 4096)
    assert {r.arrival_s for r in burst.requests} == {0.0}, "all at t=0"
    fast = build_workload(WorkloadSpec(num_requests=50, time_scale=10.0), 4096)
    slow = build_workload(WorkloadSpec(num_requests=50), 4096)
    assert fast.requests[-1].arrival_s == pytest.approx(slow.requests[-1].arrival_s / 10), "x10 faster"


def test_mooncake_shares_prefixes() -> None:
    wl = build_workload(WorkloadSpec(source=MOONCAKE, num_requests=20), 32768)
    assert wl.requests, "some Mooncake requests fit 32k"


def test_broken_trace_row_is_named(tmp_path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:47.00,x,5\n"
    )
    with pytest.raises(InvalidArgumentError, match=r"bad.csv:3.*ContextTokens"):
        build_workload(WorkloadSpec(source=str(bad)), 4096)


def test_generators_and_errors() -> None:
    wl = build_workload(WorkloadSpec(source="fixed", num_requests=7, prompt_len=100, output_len=10), 4096)
    assert [(r.prompt_len, r.output_len) for r in wl.requests] == [(100, 10)] * 7, "fixed"
    with pytest.raises(InvalidArgumentError, match="unknown workload 'nope'"):
        WorkloadSpec(source="nope")
    with pytest.raises(InvalidArgumentError, match="needs --rate"):
        WorkloadSpec(source="variable", arrivals="poisson")
    with pytest.raises(InvalidArgumentError, match="no request .* fits max_model_len=50"):
        build_workload(WorkloadSpec(source="fixed", num_requests=2, prompt_len=100), 50)


def test_variable_lengths_can_be_refitted() -> None:
    spec = WorkloadSpec(
        source="variable", num_requests=2000, prompt_lognormal=(4.6, 0.5), output_lognormal=(5.0, 0.5)
    )
    wl = build_workload(spec, 4096)
    p = np.log([r.prompt_len for r in wl.requests])
    assert abs(p.mean() - 4.6) < 0.05, "prompt log-normal as given"
    assert "ln prompt ~ N(4.6, 0.5)" in wl.name, "the workload name says which distribution"
