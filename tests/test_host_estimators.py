"""Estimators: noise moments, the Chernoff offset, and interval coverage on Zipf streams.

Coverage is measured end to end: real Recorder releases (internal + output
noise from pansketch.agent.noise, fixed seeds; "-persist" configurations persist the
state several times per window, so their releases carry nz > 2 draws) -> Aggregator.handle -> SQLite ->
query.freq for every item of the universe (including items never seen).
Each configuration queries n = seeds x universe items; the empirical
coverage must be within max(2 points, 3 sqrt(c (1 - c) / n)) (three
binomial standard deviations) of the confidence, on both sides: the
intervals are calibrated, not bounds. Each trial uses its own salt: the interval
statement is over the random hash functions (and the noise), as for every
sketch guarantee; with one fixed salt the same heavy items collide in
every trial and the trials are not independent.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from pansketch.host_tools.query import estimators
from pansketch.host_tools.query import core as query
from pansketch.host_tools.ingest.aggregator import Aggregator
from pansketch.host_tools.query.merge import Merged, NoiseTerm, noise_variance
from tests.support.host import PARAMS, SALT, host_cfg, record, topic, zipf_stream
from tests.support.sketches import params_with


# These tests count the refresh scheme's draws (one per persist); the shadow scheme's
# releases (nz = 2, nint at 2L arrays) have their own coverage config below.
params = params_with(dict(PARAMS, persist_noise="refresh"))


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


def _full_route(terms, delta):
    """noise_tail_bound as computed over the whole support (noise_distribution)."""
    dist = estimators.noise_distribution(terms)
    if dist is None:
        return estimators.chernoff_tail_bound(terms, delta)
    z, slack = dist
    s = (len(z) - 1) // 2
    ok = np.nonzero(np.cumsum(z[::-1])[::-1][s + 1:] + slack <= delta)[0]
    return float(ok[0]) if len(ok) else estimators.chernoff_tail_bound(terms, delta)


@pytest.mark.parametrize("terms", [
    [NoiseTerm("dgauss", 2, 1, 1500), NoiseTerm("dgauss", 4, 1, 1500)],  # a few hours of a 300-device fleet
    [NoiseTerm("dlap", 4, 1, 500)],
    [NoiseTerm("dlap", 8, 3, 2000), NoiseTerm("dgauss", 2, 1, 100)],
])
def test_noise_window_gives_the_whole_support_answer(terms):
    z, slack = estimators.noise_window(terms)
    full, full_slack = estimators.noise_distribution(terms)
    assert len(z) * 20 < len(full)  # the window is where the mass is, not the support
    assert slack > full_slack  # the mass beyond the window is counted against the tail
    s, fs = (len(z) - 1) // 2, (len(full) - 1) // 2
    assert np.abs(z - full[fs - s:fs + s + 1]).max() < 1e-15
    for delta in (0.05, 0.025, 1e-4, 1e-6):
        assert estimators._tail_bound.__wrapped__(tuple((t.mech, t.num, t.den, t.count) for t in terms),
                                                  delta) == _full_route(terms, delta)


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
    "cms-d4-dlap-persist": (dict(kind="cms", d=4, w=256, mechanism="dlap", budget="1"), 3, 1, 8000, 3000, 1.1),
    "cs-d5-dgauss-persist": (dict(kind="cs", d=5, w=256, mechanism="dgauss", budget="1/2"), 3, 1, 8000, 3000, 1.1),
    # persist_noise shadow: 3 persists, yet nz = 2 with the internal draw at the 2-array calibration
    "cs-d5-dgauss-shadow": (dict(kind="cs", d=5, w=256, mechanism="dgauss", budget="1/2", persist_noise="shadow"),
                            3, 1, 8000, 3000, 1.1),
}
PERSISTS = {"cms-d4-dlap-persist": 4, "cs-d5-dgauss-persist": 3,
            "cs-d5-dgauss-shadow": 3}  # Recorder.persist() calls per window
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
        for raw in record(p, str(tmp_path / ("%s-%d-%s" % (name, seed, dev))), windows, seed="%s%d" % (dev, seed),
                          persists=PERSISTS.get(name, 0)):
            assert agg.handle(topic(dev), raw).stored
    rels = agg.store.releases()
    nzs = [r.nz for r in rels]
    if pkw.get("persist_noise") == "shadow":
        assert nzs == [2] * len(rels) and all(r.nint != r.nout for r in rels), nzs
    else:
        assert min(nzs) >= 2 + PERSISTS.get(name, 0), nzs  # every persist added one internal draw
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


@pytest.mark.slow
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
    # calibrated, not conservative: within max(2 points, 3 binomial sd) of nominal on both sides
    assert abs(rate - conf) <= max(0.02, slack(conf, n)), (name, rate)
    # informative, not trivially wide: mean width at most ~5x the empirical 95% error
    assert np.mean(widths) <= 5 * np.mean(errs) + 10, (name, widths, errs)


@pytest.mark.slow
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


# -- nz: every noise draw a release carries is counted -------------------------
def _merged_constant_releases(tmp_path, nz: int, n: int = 3) -> Merged:
    from pansketch.host_tools.query import merge
    from tests.support.host import T0, encoded

    a = Aggregator(host_cfg(tmp_path / ("nz%d" % nz)))
    p = params("m", kind="cms", d=4, w=64, mechanism="dlap", budget="1")  # dlap scale 4
    for k in range(n):
        assert a.handle(topic("m"), encoded(p, seq=k, elo=T0 // 3600 + k, fill=k, nz=nz)).stored
    m = merge.merge(a.store.releases(with_payload=True))
    a.close()
    return m


def test_merged_noise_counts_nz_minus_1_internal_draws(tmp_path):
    (tmp_path / "nz2").mkdir()
    (tmp_path / "nz5").mkdir()
    m2 = _merged_constant_releases(tmp_path, 2)
    m5 = _merged_constant_releases(tmp_path, 5)
    # nint and nout are the same spec (dlap scale 4/1), so their draws pool into one term:
    # 3 releases x (1 nint + 1 nout) vs 3 x (4 nint + 1 nout)
    assert [(t.mech, t.num, t.den, t.count) for t in m2.noise] == [("dlap", 4, 1, 6)]
    assert [(t.mech, t.num, t.den, t.count) for t in m5.noise] == [("dlap", 4, 1, 15)]
    v1 = noise_variance("dlap", 4, 1)
    assert m2.noise_var == pytest.approx(6 * v1) and m5.noise_var == pytest.approx(15 * v1)
    assert m5.noise_sd / m2.noise_sd == pytest.approx(math.sqrt(15 / 6))
    r2 = estimators.interval_rule(m2, 0.95)
    r5 = estimators.interval_rule(m5, 0.95)
    # the Count-Min upper end is the offset of the merged noise: 15 draws, not 6
    assert r5.offset == estimators.cms_offset(m5, 0.05)
    assert r5.offset == estimators.noise_tail_bound([NoiseTerm("dlap", 4, 1, 15)],
                                                    -math.expm1(math.log1p(-0.025) / 4))
    assert r5.offset > 1.4 * r2.offset  # ~ sqrt(15/6) = 1.58 times wider


def test_merged_noise_with_mixed_nz_and_specs(tmp_path):
    """Different budgets: nint and nout of each release are separate terms, nz - 1 and 1 draws."""
    from pansketch.host_tools.query import merge
    from tests.support.host import T0, encoded

    a = Aggregator(host_cfg(tmp_path))
    pa = params("a", kind="cs", d=4, w=32, mechanism="dgauss", budget="1/2")
    pb = params("b", kind="cs", d=4, w=32, mechanism="dgauss", budget="2")
    assert a.handle(topic("a"), encoded(pa, nz=3)).stored
    assert a.handle(topic("a"), encoded(pa, seq=1, elo=T0 // 3600 + 1, nz=2)).stored
    assert a.handle(topic("b"), encoded(pb, nz=7)).stored
    m = merge.merge(a.store.releases(with_payload=True))
    a.close()
    sa, sb = pa.noise, pb.noise
    want = {("dgauss", sa.num, sa.den): (3 - 1 + 1) + (2 - 1 + 1), ("dgauss", sb.num, sb.den): 7}
    assert {(t.mech, t.num, t.den): t.count for t in m.noise} == want
    assert m.noise_var == pytest.approx(5 * sa.num / sa.den + 7 * sb.num / sb.den)


@pytest.mark.slow
def test_cms_offset_covers_pure_noise_with_many_draws(tmp_path):
    """Empty streams, releases with nz = 6 (4 persists): every counter is pure noise, f = 0.

    hi = min + E must cover 0 for all but <= alpha/2 of the items. If the
    merge counted only 2 draws per release, E would be ~40% too small and
    about a quarter of the items would have hi < 0.
    """
    p = params("e", kind="cms", d=4, w=256, mechanism="dlap", budget="1")
    misses, n, offs = 0, 0, []
    for seed in (1, 2, 3):
        salt = "%s-empty-%d" % (SALT, seed)
        cfg = host_cfg(tmp_path / str(seed), fleet={"salt": salt})
        (tmp_path / str(seed)).mkdir()
        agg = Aggregator(cfg)
        for dv in range(2):
            pd = params("e%d" % dv, salt=salt, kind="cms", d=4, w=256, mechanism="dlap", budget="1")
            for raw in record(pd, str(tmp_path / ("%d-%d" % (seed, dv))), [[]], seed="e%d%d" % (dv, seed), persists=4):
                assert agg.handle(topic(pd.device), raw).stored
        rels = agg.store.releases()
        assert all(r.nz >= 6 for r in rels), [r.nz for r in rels]
        ans = query.freq(agg.store, ["item-%d" % k for k in range(2000)], salt=salt, confidence=0.95)
        agg.close()
        total = sum(r.nz for r in rels)
        assert ans[0].offset == estimators.noise_tail_bound([NoiseTerm("dlap", 4, 1, total)],
                                                            -math.expm1(math.log1p(-0.025) / 4))
        offs.append(ans[0].offset)
        hi = np.array([x.hi for x in ans])
        misses += int((hi < 0).sum())
        n += len(ans)
    assert p.noise.num == 4 and p.noise.den == 1
    assert misses / n <= 0.025 + slack(0.025, n) * 3, (misses / n, offs)  # cells are shared: generous slack


# -- calibrated widths against the exact conditional distribution ------------------------------
@pytest.mark.parametrize("d", [3, 4, 5])
def test_cs_calibrated_halfwidth_is_the_quantile_of_the_median_error(d):
    """Given the counters, row r's error is a fair sign times a uniform cell of row r: enumerate
    all (2w)^d row draws and check t is the smallest value with P(|median| > t) <= alpha
    (exact for odd d, within Monte Carlo error for even d), and below the union bound."""
    import itertools

    g = np.random.default_rng(d)
    w = 8 if d == 3 else (6 if d == 4 else 4)
    C = g.integers(-12, 13, (d, w))
    sym = np.concatenate((C, -C), axis=1)
    idx = np.array(list(itertools.product(range(2 * w), repeat=d)))
    meds = np.abs(np.median(sym[np.arange(d)[None, :], idx], axis=1))
    tol = 0.0 if d % 2 else 0.01
    for alpha in (0.05, 0.1, 0.3):
        t = estimators.cs_calibrated_halfwidth(C, alpha)
        if math.isinf(t):  # x's own cell alone could reach alpha/2 at this w: unbounded, as before
            assert math.isinf(estimators.cs_halfwidth(C, alpha))
            continue
        assert float((meds > t).mean()) <= alpha + tol
        below = meds[meds < t]
        if len(below):
            assert float((meds > below.max()).mean()) > alpha - tol  # no smaller value would do
        assert t <= estimators.cs_halfwidth(C, alpha)


def test_cms_below_probability_is_exact():
    import itertools

    g = np.random.default_rng(5)
    C = g.integers(-6, 20, (3, 5))
    mins = np.array([min(C[0, a], C[1, b], C[2, c]) for a, b, c in itertools.product(range(5), repeat=3)])
    for e in (0, 2, 4):
        assert estimators.cms_below_probability(C, e) == pytest.approx(float((mins < -e).mean()))
