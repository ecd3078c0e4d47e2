"""Numeric helpers the host's noise bounds share (store.bounds, query.estimators)."""

from __future__ import annotations

import math
from typing import Callable

_PHI = (math.sqrt(5.0) - 1.0) / 2.0  # the golden ratio's conjugate, 0.618...


def golden_min(g: Callable[[float], float], lo: float, hi: float, tol: float, steps: int = 200) -> float:
    """min of g over [lo, hi] by golden-section search, for a g that is unimodal there (Kiefer 1953):
    the smaller of g at the last two probes, once the bracket is narrower than ``tol`` or after
    ``steps`` narrowings. For a Chernoff bound any probe is a valid bound, so stopping early costs
    only tightness."""
    a, b = hi - _PHI * (hi - lo), lo + _PHI * (hi - lo)
    ga, gb = g(a), g(b)
    for _ in range(steps):
        if ga <= gb:
            hi, b, gb = b, a, ga
            a = hi - _PHI * (hi - lo)
            ga = g(a)
        else:
            lo, a, ga = a, b, gb
            b = lo + _PHI * (hi - lo)
            gb = g(b)
        if hi - lo < tol:
            break
    return min(ga, gb)
