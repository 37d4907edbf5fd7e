"""pagedkv.percentiles: the one percentile every report uses (simulator, bench e2e, bench serve)."""

from __future__ import annotations

import numpy as np

from pagedkv.percentiles import percentile


def test_linear_interpolation_over_the_finite_values() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 99) == np.percentile([1, 2, 3, 4], 99)
    assert percentile(np.array([1.0, np.nan, 3.0, np.inf]), 50) == 2.0  # nan/inf are not measurements


def test_no_finite_value_has_no_percentile() -> None:
    assert percentile([], 99) is None and percentile(np.array([np.nan, -np.inf]), 50) is None


def test_every_report_uses_it() -> None:
    from pagedkv.bench import e2e, serve_load
    from pagedkv.sim import run_metrics

    assert e2e.percentile is percentile and serve_load.percentile is percentile
    assert run_metrics.percentile is percentile
