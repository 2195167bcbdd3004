"""Small statistics shared by the probe, the benchmarks and the demo (one definition of a
percentile, so a p99 means the same thing wherever it is printed)."""

from __future__ import annotations

import math


def percentile(values, q: float) -> float | None:
    """The q-th percentile (0-100), linear between closest ranks (numpy's default); None when
    there are no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
