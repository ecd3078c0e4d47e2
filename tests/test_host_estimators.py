"""Estimators: noise moments, the Chernoff offset, and interval coverage on Zipf streams.

Coverage is measured end to end: real Recorder releases (internal + output
noise from agent.noise, fixed seeds) -> Aggregator.handle -> SQLite ->
query.freq for every item of the universe (including items never seen).
Each configuration queries n = seeds x universe items; the empirical
coverage must be at least confidence - 3 sqrt(c (1 - c) / n) (three
binomial standard deviations). Each trial uses its own salt: the interval
statement is over the random hash functions (and the noise), as for every
sketch guarantee; with one fixed salt the same heavy items collide in
every trial and the trials are not independent.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from host_tools import estimators, query
from host_tools.aggregator import Aggregator
from host_tools.merge import NoiseTerm, noise_variance
from tests.test_host_support import SALT, host_cfg, params, record, topic, zipf_stream


# -- noise distributions -------------------------------------------------------
def dgauss_pmf(s2: float, lim: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.arange(-lim, lim + 1)
    p = np.exp(-x.astype(float) ** 2 / (2 * s2))
    return x, p / p.sum()


def dlap_pmf(t: float, lim: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.arange(-lim, lim + 1)
    p = np.exp(-np.abs(x) / t)
    return x, p / p.sum()


@pytest.mark.parametrize("s2", [0.5, 1.0, 2.5, 8.0, 40.0])
def test_dgauss_variance_and_mgf_bounded_by_sigma2(s2):
    x, p = dgauss_pmf(s2, 400)
    var = float((p * x * x).sum())
    assert var <= s2 * (1 + 1e-12)
    assert noise_variance("dgauss", int(s2 * 2), 2) == s2
    for lam in (0.05, 0.3, 1.0):
        mgf = float((p * np.exp(lam * x)).sum())
        assert mgf <= math.exp(lam * lam * s2 / 2) * (1 + 1e-12)


@pytest.mark.parametrize("num,den", [(1, 1), (4, 1), (9, 2), (200, 3)])
def test_dlap_variance_exact(num, den):
    x, p = dlap_pmf(num / den, 40 * num // den + 200)
    assert noise_variance("dlap", num, den) == pytest.approx(float((p * x * x).sum()), rel=1e-9)


def _sum_pmf(pmfs: list[np.ndarray]) -> np.ndarray:
    out = np.array([1.0])
    for p in pmfs:
        out = np.convolve(out, p)
    return out


@pytest.mark.parametrize("terms", [
    [NoiseTerm("dlap", 4, 1, 2)],
    [NoiseTerm("dlap", 8, 3, 6)],
    [NoiseTerm("dgauss", 5, 1, 4)],
    [NoiseTerm("dlap", 4, 1, 2), NoiseTerm("dgauss", 2, 1, 2)],
])
def test_noise_tail_bound_valid_and_reasonably_tight(terms):
    lim = 120
    pmfs = []
    for t in terms:
        x, p = dlap_pmf(t.num / t.den, lim) if t.mech == "dlap" else dgauss_pmf(t.num / t.den, lim)
        pmfs += [p] * t.count
    z = _sum_pmf(pmfs)
    xs = np.arange(len(z)) - (len(z) - 1) // 2
    for delta in (0.05, 0.01, 1e-4):
        q = xs[np.searchsorted(np.cumsum(z), 1 - delta)]  # exact (1-delta) quantile
        e = estimators.noise_tail_bound(terms, delta)
        assert float(z[xs > e].sum()) <= delta
        assert e <= q  # exact route: the smallest valid integer
        c = estimators.chernoff_tail_bound(terms, delta)  # fallback for huge merges: valid, looser
        assert float(z[xs > c].sum()) <= delta
        assert e <= c <= 2.0 * q + 2, (delta, c, q)


def test_poisson_binomial_tail():
    assert estimators.poisson_binomial_tail([0.5] * 4, 2) == pytest.approx(11 / 16)
    assert estimators.poisson_binomial_tail([0.1, 0.2, 0.3], 3) == pytest.approx(0.006)
    assert estimators.poisson_binomial_tail([0.3] * 5, 0) == pytest.approx(1.0)


# -- coverage on Zipf streams ------------------------------------------------------
CONFIGS = {
    # name: (device params, devices, windows per device, events per window, universe, zipf s)
    "cs-d5-dgauss": (dict(kind="cs", d=5, w=256, mechanism="dgauss", budget="1/2"), 3, 1, 8000, 3000, 1.1),
    "cs-d4-keep-dlap": (dict(kind="cs", d=4, w=256, mechanism="dlap", budget="1", mode="keep", epoch_s=1800),
                        2, 2, 6000, 2000, 1.3),
    "cms-d4-dlap": (dict(kind="cms", d=4, w=256, mechanism="dlap", budget="1"), 3, 1, 8000, 3000, 1.1),
    "cms-d3-dgauss": (dict(kind="cms", d=3, w=512, mechanism="dgauss", budget="1/4"), 2, 2, 5000, 2000, 1.5),
}
SEEDS = (11, 22, 33)


def run_config(tmp_path, name, seed, confidence=0.95):
    pkw, n_dev, n_win, n_ev, universe, s = CONFIGS[name]
    salt = "%s-seed-%d" % (SALT, seed)  # a fresh salt per trial: coverage is over the hash functions
    cfg = host_cfg(tmp_path / ("%s-%d" % (name, seed)), fleet={"salt": salt})
    (tmp_path / ("%s-%d" % (name, seed))).mkdir(exist_ok=True)
    agg = Aggregator(cfg)
    truth: dict[str, int] = {}
    for dv in range(n_dev):
        dev = "dev%d" % dv
        p = params(dev, salt=salt, **pkw)
        windows = [zipf_stream(n_ev, universe, s, seed * 100 + dv * 10 + k) for k in range(n_win)]
        for ev in windows:
            for x in ev:
                truth[x] = truth.get(x, 0) + 1
        for raw in record(p, str(tmp_path / ("%s-%d-%s" % (name, seed, dev))), windows, seed="%s%d" % (dev, seed)):
            assert agg.handle(topic(dev), raw).stored
    items = ["item-%d" % k for k in range(universe)]
    ans = query.freq(agg.store, items, salt=salt, confidence=confidence)
    agg.close()
    f = np.array([truth.get(x, 0) for x in items], dtype=float)
    est = np.array([a.estimate for a in ans])
    lo = np.array([a.lo for a in ans])
    hi = np.array([a.hi for a in ans])
    return f, est, lo, hi, ans


def slack(conf: float, n: int) -> float:
    return 3 * math.sqrt(conf * (1 - conf) / n)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_interval_coverage_on_zipf(tmp_path, name):
    conf = 0.95
    cov, n, widths, errs = 0, 0, [], []
    for seed in SEEDS:
        f, est, lo, hi, ans = run_config(tmp_path, name, seed, conf)
        assert all(a.confidence == conf for a in ans)
        inside = (lo <= f) & (f <= hi)
        cov += int(inside.sum())
        n += len(f)
        widths.append(float(np.mean(hi - lo)))
        errs.append(float(np.quantile(np.abs(est - f), conf)))
        # heavy hitters are estimated well (relative error of the 3 most frequent items)
        top = np.argsort(-f)[:3]
        assert np.all(np.abs(est[top] - f[top]) <= 0.1 * f[top]), (est[top], f[top])
    rate = cov / n
    assert rate >= conf - slack(conf, n), (name, rate)
    # informative, not trivially wide: mean width at most ~5x the empirical 95% error
    assert np.mean(widths) <= 5 * np.mean(errs) + 10, (name, widths, errs)


def test_lower_confidence_gives_narrower_intervals_still_covering(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    f, est, lo, hi, _ = run_config(tmp_path / "a", "cs-d5-dgauss", 44, 0.8)
    f2, est2, lo2, hi2, _ = run_config(tmp_path / "b", "cs-d5-dgauss", 44, 0.95)
    rate = float(((lo <= f) & (f <= hi)).mean())
    assert rate >= 0.8 - slack(0.8, len(f))
    assert np.mean(hi - lo) < np.mean(hi2 - lo2)
    assert np.array_equal(est, est2)


def test_noise_only_intervals_would_undercover(tmp_path):
    """The collision part matters: est +- 1.96 noise_sd covers far less than 95% here."""
    f, est, lo, hi, ans = run_config(tmp_path, "cs-d5-dgauss", 11)
    sd = ans[0].noise_sd
    naive = float(((est - 1.96 * sd <= f) & (f <= est + 1.96 * sd)).mean())
    ours = float(((lo <= f) & (f <= hi)).mean())
    assert naive < 0.9 < ours


def test_cms_upper_end_is_min_plus_theorem31_offset(tmp_path):
    f, est, lo, hi, ans = run_config(tmp_path, "cms-d4-dlap", 11)
    e = ans[0].offset
    assert e > 0 and np.allclose(hi - est, e)
    assert ans[0].to_dict()["offset"] == pytest.approx(e, abs=1e-3)
    # the minimum never underestimates by more than the offset (all items, fixed seed)
    assert float(((est + e) >= f).mean()) >= 0.99
