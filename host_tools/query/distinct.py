"""Distinct counts from kind ``dbits`` releases (agent/dbits.py), with intervals.

One release holds, per level k = 0..K-1, the number of one-bits among m
plus discrete Laplace noise of scale 1/eps. A level-k bit is Bern(1/2) if
no item of its bucket arrived and Bern(1/2 + eps/4) if one did; level k
receives each distinct item with probability P_k = 2^-(k+1) (the last
level 2^-(K-1)).

Per level: touched fraction f_k = (ones_k/m - 1/2) * 4/eps, items
n_k = -m ln(1 - f_k) (balls into m bins), D_k = n_k / P_k. Per release:
the weighted average of the D_k with weights 1/Var(D_k), the variances
evaluated (delta method) at the expected fill of each level under the
current estimate (two refinements from the plug-in estimate), so the
weights do not follow one level's own noise. Var(ones_k) =
m p (1 - p) + Var(dlap), p = 1/2 + eps f / 4, plus the occupancy
variance of the touched fraction and the sampling variance of D_k (an item
falls in level k with probability P_k). f_k is not clipped at 0 (a level
with no items reads a slightly negative count as often as a positive one);
the reported sum is clipped at 0.

Merging: releases are estimated one by one and **summed**: the answer is
the sum over devices and windows of the per-device, per-window distinct
counts (an item seen by two sensors, or in two windows, counts twice:
docs/PRIVACY.md "Distinct counts"). Interval: estimate +- z * sd (normal
approximation of the sum of binomial counts), lower end clipped at 0;
coverage checked by simulation in tests/test_dbits.py.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any, Optional, Sequence, Union

import numpy as np

from host_tools.query.merge import noise_variance


FILL_MAX = 0.75  # levels filled beyond this are left out (the delta method under-states their variance)


def level_probs(K: int) -> np.ndarray:
    p = 2.0 ** -(np.arange(K) + 1.0)
    p[-1] = 2.0 ** -(K - 1)
    return p


def _level_var(f: np.ndarray, m: int, eps: float, out_var: float) -> np.ndarray:
    """Var of n_k: the bits' randomness and the output noise, plus the occupancy variance of the
    touched fraction given n_k (balls in bins: Var(#empty) = m e^-l (1 - (1 + l) e^-l), l = n/m)."""
    f = np.clip(f, 0.0, 1.0 - 1.0 / m)
    p = 0.5 + eps * f / 4.0
    var_ones = m * p * (1 - p) + out_var
    var_f = 16.0 * var_ones / (m * m * eps * eps)
    lam = -np.log1p(-f)
    var_f += np.exp(-lam) * (1.0 - (1.0 + lam) * np.exp(-lam)) / m
    # delta method to second order: g(f) = -m ln(1 - f), Var ~ g'^2 s^2 + g''^2 s^4 / 2
    return var_f * (m / (1.0 - f)) ** 2 + 0.5 * (m / (1.0 - f) ** 2) ** 2 * var_f ** 2


def estimate_release(counts: Sequence[float] | np.ndarray, m: int, eps: float, out_var: float) -> tuple[float, float]:
    """(D_hat, Var) of one release's per-level counts."""
    c = np.asarray(counts, dtype=np.float64)
    K = len(c)
    P = level_probs(K)
    f = np.clip((c / m - 0.5) * 4.0 / eps, -1.0, 1.0 - 1.0 / m)  # not clipped at 0: unbiased for empty levels
    n = -m * np.log1p(-f)
    Dk = n / P
    ok = f < FILL_MAX
    if not ok.any():
        ok[:] = True
    V = _level_var(f, m, eps, out_var) / P ** 2
    w = np.where(ok, 1.0 / V, 0.0)
    D = float((Dk * w).sum() / w.sum())
    for _ in range(2):
        fe = 1.0 - np.exp(-max(D, 0.0) * P / m)  # expected fill at the current estimate
        # + the sampling variance of D_k = n_k / P_k (n_k ~ Binomial(D, P_k))
        V = _level_var(fe, m, eps, out_var) / P ** 2 + max(D, 0.0) * (1.0 - P) / P
        w = np.where(fe < FILL_MAX, 1.0 / V, 0.0)
        if not w.any():
            w = 1.0 / V
        D = float((Dk * w).sum() / w.sum())
    return D, float(1.0 / w.sum())


def estimate(rels: Sequence[Any], confidence: float = 0.95) -> dict[str, Any]:
    """Sum of per-release estimates with an interval (rels: StoredRelease with payload, kind dbits)."""
    tot = var = 0.0
    for r in rels:
        eps = r.budget[0] / r.budget[1]
        ov = noise_variance(r.mech, r.nout[0], r.nout[1])
        d, v = estimate_release(r.counters()[0], r.w, eps, ov)
        tot += d
        var += v
    z = NormalDist().inv_cdf(1.0 - (1.0 - confidence) / 2.0)
    sd = math.sqrt(var)
    return {"estimate": round(max(0.0, tot), 1), "lo": round(max(0.0, tot - z * sd), 1),
            "hi": round(max(0.0, tot + z * sd), 1),
            "sd": round(sd, 2), "confidence": confidence}


def query(store: Any, *, salt: str, confidence: float = 0.95, window: Optional[int] = None,
          since: Optional[float] = None, until: Optional[float] = None,
          device: Union[None, str, Sequence[str]] = None) -> dict[str, Any]:
    """``pansketch query distinct``: the selection's distinct count (sum over devices and windows)."""
    from host_tools.query.core import QueryError, iso, select_merged

    m, s = select_merged(store, window=window, since=since, until=until, device=device, salt=salt,
                         kinds=("dbits",))
    if m.kind != "dbits":
        raise QueryError("these releases are of kind %r; distinct needs kind 'dbits'" % m.kind)
    rels = store.releases(devices=s.devices, window=window, since=since, until=until, with_payload=True)
    out = estimate(rels, confidence)
    out.update({"window": s.window, "range": {"since": iso(m.t0), "until": iso(m.t1), "since_unix": m.t0,
                                              "until_unix": m.t1},
                "devices": m.devices, "releases": m.releases, "kind": "dbits", "levels": m.d, "bits": m.w,
                "method": "dbits-sum-of-per-release",
                "scope": "sum over devices and windows of each device's distinct count per window"})
    if s.partial:
        out["partial_excluded"] = s.partial
    return out
