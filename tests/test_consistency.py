"""Consistency by post-processing (pansketch.host_tools.query.consistency): monotone CDF rows, and
Hay et al. 2010 least-squares consistent dyadic trees."""

from __future__ import annotations

import numpy as np
import pytest

from pansketch.host_tools.query.consistency import isotonic, monotone, tree_consistent
from pansketch.host_tools.query.core import cover


def test_isotonic_is_the_least_squares_monotone_fit():
    y = np.array([1.0, 3.0, 2.0, 2.0, 0.0, 5.0, 4.0])
    f = isotonic(y)
    assert np.all(np.diff(f) >= 0)
    # PAV pools {3, 2, 2, 0} -> 1.75, then {1, 1.75...}: the fit must beat every other monotone candidate
    rng = np.random.default_rng(0)
    best = float(np.sum((f - y) ** 2))
    for _ in range(2000):
        g = np.sort(rng.uniform(-1, 6, len(y)))
        assert np.sum((g - y) ** 2) >= best - 1e-9
    assert np.allclose(isotonic([0.1, 0.2, 0.3]), [0.1, 0.2, 0.3])


def test_monotone_rows_are_monotone_clipped_inside_and_only_widened():
    rng = np.random.default_rng(1)
    for _ in range(200):
        n = int(rng.integers(2, 30))
        truth = np.sort(rng.uniform(0, 1, n))
        est = truth + rng.normal(0, 0.05, n)
        h = rng.uniform(0.01, 0.1, n)
        lo, hi = est - h, est + h
        e2, lo2, hi2 = monotone(est, lo, hi, 0.0, 1.0)
        assert np.all(np.diff(e2) >= -1e-12) and np.all(np.diff(lo2) >= 0) and np.all(np.diff(hi2) >= 0)
        assert np.all((0 <= lo2) & (lo2 <= e2) & (e2 <= hi2) & (hi2 <= 1))
        # widened: a truth the old interval held is still held
        old = (lo <= truth) & (truth <= hi)
        new = (lo2 <= truth) & (truth <= hi2)
        assert np.all(new[old])


def _gls(levels, var):
    """Weighted least squares over the leaves (the unknowns) by linear algebra."""
    L = len(levels)
    m = len(levels[0])
    rows, ys, ws = [], [], []
    for lv in range(L):
        for i in range(len(levels[lv])):
            r = np.zeros(m)
            r[i << lv:(i + 1) << lv] = 1.0
            rows.append(r)
            ys.append(levels[lv][i])
            ws.append(1.0 / np.sqrt(var[lv][i]))
    A = np.array(rows) * np.array(ws)[:, None]
    x, *_ = np.linalg.lstsq(A, np.array(ys) * np.array(ws), rcond=None)
    return [np.array([x[i << lv:(i + 1) << lv].sum() for i in range(len(levels[lv]))]) for lv in range(L)]


def test_tree_consistent_is_the_weighted_least_squares_solution():
    rng = np.random.default_rng(2)
    L = 5
    levels = [rng.normal(10 * 2 ** lv, 3, 2 ** (L - 1 - lv)) for lv in range(L)]
    var = [rng.uniform(0.5, 8.0, 2 ** (L - 1 - lv)) for lv in range(L)]
    got = tree_consistent(levels, var)
    want = _gls(levels, var)
    for lv in range(L):
        assert np.allclose(got[lv], want[lv], atol=1e-8)
    for lv in range(1, L):  # consistent: every parent is the sum of its children
        assert np.allclose(got[lv], got[lv - 1][0::2] + got[lv - 1][1::2])
    # cell dimensions are processed independently with the same weights
    two = tree_consistent([np.stack([x, 2 * x], axis=1) for x in levels], var)
    assert np.allclose(two[0][:, 1], 2 * got[0])


def test_tree_consistent_rejects_an_incomplete_tree():
    with pytest.raises(ValueError):
        tree_consistent([np.zeros(4), np.zeros(3)], [np.ones(4), np.ones(3)])


@pytest.mark.slow
def test_consistent_ranges_have_lower_error_than_the_raw_cover():
    """Noise-only trees (L = 11, unit variance): the canonical cover's range error vs the consistent one.
    Least squares is the best linear unbiased estimate, so its error is never larger in expectation;
    for ranges >= 64 leaves the variance ratio is about 3.5 (RMSE ~1.9x); 1.3x leaves room for 400 draws."""
    rng = np.random.default_rng(3)
    L, T = 11, 400
    noise = [rng.normal(0, 1, (2 ** (L - 1 - lv), T)) for lv in range(L)]
    cons = tree_consistent(noise, [np.ones(2 ** (L - 1 - lv)) for lv in range(L)])
    nodes = {(i << lv, (i + 1) << lv): (lv, i) for lv in range(L) for i in range(2 ** (L - 1 - lv))}
    for k in (64, 200, 700):
        raw, con = [], []
        for t, st in enumerate(rng.integers(0, 2 ** (L - 1) - k, T)):
            used, _ = cover(nodes, int(st), int(st) + k)
            raw.append(sum(noise[nodes[u][0]][nodes[u][1], t] for u in used))
            con.append(sum(cons[nodes[u][0]][nodes[u][1], t] for u in used))
        ratio = np.sqrt(np.mean(np.square(raw)) / np.mean(np.square(con)))
        assert ratio >= 1.3, (k, ratio)


@pytest.mark.slow
def test_cdf_rows_are_monotone_inside_and_quantile_rows_stand_alone():
    """A noisy dcs sketch over few readings (most of the domain empty: raw rows overshoot 1 and go
    below 0 there): the CDF rows come out monotone, in [0, 1] and inside their intervals; a quantile
    row is the same whichever other quantiles are asked with it."""
    from fractions import Fraction

    from pansketch.host_tools.lab.algorithms.vnoise import BulkNoise
    from pansketch.host_tools.query.dyadic import DyadicView, exact_counters, rank_answers
    from pansketch.host_tools.query.merge import NoiseTerm

    b, d, w = 16, 4, 1024
    g = np.random.default_rng(5)
    vals = np.clip(g.normal(600, 150, 5000).astype(np.int64), 0, 1199)
    ex = exact_counters(vals, b, d, w, "consistency-salt")
    var = Fraction(68)
    C = ex + BulkNoise(3).dgauss(var, ex.size * 40).reshape(40, *ex.shape).sum(axis=0)
    v = DyadicView(C, b, d, w, "consistency-salt", [NoiseTerm("dgauss", 68, 1, 40)], 0.95)
    xs = np.unique(np.linspace(0, (1 << b) - 1, 65).astype(np.int64))
    rows = rank_answers(v, xs, None, (1, 1, 0))
    f = [r.frac for r in rows]
    assert all(a <= b_ for a, b_ in zip(f, f[1:]))
    assert all(0.0 <= r.frac_lo <= r.frac <= r.frac_hi <= 1.0 for r in rows)
    assert all(r.rank_lo <= r.rank <= r.rank_hi and r.rank_lo >= 0 for r in rows)
    # the raw estimates were not already consistent (else this test would prove nothing)
    raw_r, _ = v.rank_le(xs)
    n = v.total()[0]
    assert (raw_r / n > 1).any() or (np.diff(raw_r) < 0).any()
    qa = rank_answers(v, v.quantile([0.99]), [0.99], (1, 1, 0))[0]
    qs = [0.1, 0.5, 0.99]
    qb = rank_answers(v, v.quantile(qs), qs, (1, 1, 0))[2]
    assert (qa.x, qa.rank, qa.rank_lo, qa.rank_hi) == (qb.x, qb.rank, qb.rank_lo, qb.rank_hi)
