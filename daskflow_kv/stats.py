"""Order statistics shared by the benchmark, the simulator and the KV page's plots."""

from __future__ import annotations

import math


def percentile(xs, q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs``, interpolated linearly between the closest ranks
    (numpy's default); NaN when there is none."""
    xs = sorted(xs)
    if not xs:
        return math.nan
    i = q * (len(xs) - 1)
    lo, hi = math.floor(i), math.ceil(i)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)
