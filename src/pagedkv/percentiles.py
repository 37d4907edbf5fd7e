"""Percentiles of measured values, one definition for every layer that reports them (the simulator, the
benchmarks, the server's load generator): numpy's linear interpolation over the finite values only, and None
when there is none (a run that finished no request has no p99, not a p99 of 0)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


def percentile(values: npt.ArrayLike, q: float) -> float | None:
    """The `q`-th percentile (0-100) of the finite `values`; None when none is finite."""
    arr = np.asarray(values, dtype=np.float64).ravel()
    arr = arr[np.isfinite(arr)]
    return float(np.percentile(arr, q)) if arr.size else None
