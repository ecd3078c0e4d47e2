"""Point estimates and honest intervals from a merged noisy sketch.

Point estimates are dp-linear-sketches.txt Algorithm 2: the median of the
d signed row readings for CountSketch, the minimum for Count-Min. Every
estimate comes with an interval [lo, hi] at a stated confidence 1 - alpha.
The derivation is in docs/HOST.md ("Intervals"); in short:

Setting. Fix the queried item x. Let C be the merged counters and C_o the
counters *without x's own events* (other items' events plus all noise).
Row r reads Y_r = g_r(x) C[r, h_r(x)] = f(x) + g_r(x) C_o[r, h_r(x)]
(g = 1 for Count-Min). The hash of x -- columns h_r(x) and signs g_r(x),
independent across rows (distinct bytes of SHA-256, agent/hashing.py) --
is independent of C_o as long as the stream does not depend on the salt.
So, given C_o, the row errors are independent, and row r's error is the
content of a uniformly random cell of row r of C_o: for any t,

    P(C_o[r, h_r(x)] > t) = #{c : C_o[r, c] > t} / w
                          <= (#{c : C[r, c] > t} + 1) / w,

because C and C_o differ in exactly one cell per row (x's own). The
bound holds for every t simultaneously, so a threshold chosen from C is
never smaller than the one C_o would give, and the coverage below holds
conditionally on everything but x's hash. No model of the data, of the
collisions or of the noise is needed: the counters are their own sample
of the error distribution (noise included, at its true merged scale).

CountSketch (median of d rows, m = ceil(d/2)): the median exceeds
f + t only if at least m rows do (for even d the median averages the two
middle readings, so the upper one, and the d/2 above it, exceed f + t;
:func:`cs_halfwidth` also uses a sharper two-threshold bound for even d).
g_r(x) is an independent fair sign, so each row exceeds f + t with
probability p_r(t) = P(|C_o[r, h]| > t) / 2 <= (#{|C[r,.]| > t} + 1) / (2w).
With S ~ PoissonBinomial(p_1..p_d),

    P(median - f > t) <= P(S >= m),   and the same for the lower side;

t is the smallest value with P(S >= m) <= alpha/2 and the interval is
[median - t, median + t]. t does not depend on the item: one search per
query serves 100,000 candidates.

Count-Min (minimum of d rows), assuming non-negative event weights so
that collisions only add (Cormode & Muthukrishnan's setting; use
CountSketch for turnstile streams):

* lower end: min - f > t needs *every* row above f + t:
  P <= prod_r (#{C[r,.] > t} + 1) / w; t_lo is the smallest t >= 0 with
  this <= alpha/2, lo = min - t_lo.
* upper end, the offset of dp-linear-sketches.txt Theorem 3.1 applied at
  query time: every row reads f + collisions + noise >= f + noise, so
  min >= f - E whenever none of x's d noise values is below -E. E is the
  smallest bound with P(any of d cells' noise < -E) <= alpha/2, i.e.
  P(Z < -E) <= 1 - (1 - alpha/2)^(1/d) for the merged per-cell noise Z,
  from Z's exact distribution (FFT convolution of the discrete Laplace /
  discrete Gaussian pmfs; a Chernoff bound for very large merges), see
  :func:`noise_tail_bound`. hi = min + E.

  In the paper each counter is *initialised* with E + N(0, sigma^2) so the
  minimum never underestimates (Algorithm 3). Devices here add zero-mean
  noise only -- we do NOT add E into the counters: an offset baked into
  releases would be summed by every merge (R releases carry R offsets) and
  would have to be chosen before the host knows how many releases a query
  merges. Adding E to the minimum at query time is post-processing (no
  privacy cost) and gives the paper's estimator for the merged noise; the
  reported point estimate is the plain minimum, and min + E is the upper
  end of the interval. :func:`theorem31_offset` gives the paper's uniform
  version (all d*w cells at once).

Calibration (what :func:`interval_rule` uses). The bounds above are
valid for every item but conservative: the "+ 1" (x's own cell) and, for
even d, the union of two order-statistic events. Tree range queries with
CountSketch d = 4 covered 0.970 at a nominal 0.90 and single-window
queries 0.975-0.98 at 0.95. The same setting gives more than a bound: given
C_o, the row errors are independent draws, row r's from the cells of row r
(CountSketch: times a fair sign), so the error of the estimate has a
*known* conditional distribution, and the interval takes its quantiles:

* CountSketch: t with P(|median - f| > t) <= alpha, the smallest such.
  Odd d: P(median - f > t) = P(S >= m) with p_r(t) = #{c : |C[r,c]| > t}/(2w)
  exactly (the median exceeds t iff m rows do). Even d: the median is the
  mean of the two middle errors; its distribution is taken from
  :func:`mc_size` seeded draws of the rows (:func:`median_error_samples`,
  >= 400 expected in the tail). Noise and collisions are in the cells at
  their true merged scale, however many releases or tree nodes were merged.
* Count-Min: the upper end keeps the offset E (its miss probability given
  the counters, p_hi = 1 - prod_r (1 - #{c : C[r,c] < -E}/w), is far below
  alpha/2 when collisions push every reading up); the lower end spends the
  rest: t_lo is the smallest t with prod_r #{c : C[r,c] > t}/w <= alpha - p_hi
  (at least alpha/2), so the two misses add up to alpha.

C stands in for C_o. They differ in x's own cell, one of w per row: for
an item never seen they are equal; otherwise the share is 1/w of each row's
distribution (for Count-Min's lower end C is even on the safe side, its
cell being C_o's plus f >= 0). A confidence so high that x's own cells alone
could exceed alpha/2 (tiny w) is reported unbounded, as by the bounds.
The bounds stay available (:func:`cs_halfwidth`, ``cms_lower_width(...,
plus_one=True)``) and the dcs heavy-hitter descent still uses them.

Coverage is checked empirically on Zipf streams in
tests/test_host_estimators.py (calibrated: within max(2 points, 3 binomial
sd) of nominal on both sides) and for tree range queries in
tests/test_tree_query.py.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from pansketch.host_tools.query.merge import Merged, NoiseTerm
from pansketch.host_tools.store.numeric import golden_min


# -- noise tails -------------------------------------------------------------
def _log_mgf(terms: Sequence[NoiseTerm], lam: float) -> float:
    """log E[exp(lam * Z)] (an upper bound for dgauss) for Z = sum of the terms' draws."""
    k = 0.0
    for t in terms:
        if t.mech == "dgauss":
            # CKS 2020 Corollary 9: N_Z(0, s2) is subgaussian with parameter s2.
            k += t.count * lam * lam * (t.num / t.den) / 2.0
        else:
            a = t.den / t.num  # 1 / scale
            if lam >= a:
                return math.inf
            # discrete Laplace, q = e^-a: E[e^{lam X}] = (1-q)^2 / ((1 - q e^lam)(1 - q e^-lam))
            k += t.count * (2.0 * math.log(-math.expm1(-a)) - math.log(-math.expm1(lam - a))
                            - math.log(-math.expm1(-lam - a)))
    return k


def chernoff_tail_bound(terms: Sequence[NoiseTerm], delta: float) -> float:
    """E >= 0 with P(Z > E) <= delta by a Chernoff bound (any size of merge).

    P(Z > E) <= exp(K(lam) - lam E) for the log-MGF K, so
    E = min over lam of (K(lam) + ln(1/delta)) / lam. For pure discrete
    Gaussian noise this is sqrt(2 V ln(1/delta)) with V = sum of sigma^2.
    """
    if not 0 < delta < 1:
        raise ValueError("delta must be in (0, 1)")
    terms = [t for t in terms if t.count > 0]
    if not terms:
        return 0.0
    L = math.log(1.0 / delta)
    if all(t.mech == "dgauss" for t in terms):
        v = sum(t.count * t.num / t.den for t in terms)
        return math.sqrt(2.0 * v * L)
    lam_max = min(t.den / t.num for t in terms if t.mech == "dlap")

    def g(u: float) -> float:
        lam = lam_max * u
        return (_log_mgf(terms, lam) + L) / lam

    # g is unimodal in lam (its derivative has the sign of lam K' - K - L, increasing).
    return max(0.0, golden_min(g, 1e-12, 1.0 - 1e-12, 1e-13))


EXACT_MAX_POINTS = 1 << 22  # support size up to which the noise sum is convolved exactly


def _term_pmf(t: NoiseTerm) -> tuple[np.ndarray, float]:
    """pmf of one draw on [-L, L] and the probability mass left outside."""
    if t.mech == "dlap":
        scale = t.num / t.den
        q = math.exp(-1.0 / scale)
        lim = int(math.ceil(40.0 * scale)) + 1  # q^lim < 1e-17
        x = np.arange(-lim, lim + 1)
        p = (1.0 - q) / (1.0 + q) * np.exp(-np.abs(x) / scale)
        return p, 2.0 * q ** (lim + 1) / (1.0 + q)
    s2 = t.num / t.den
    lim = int(math.ceil(12.0 * math.sqrt(s2))) + 2  # mass beyond 12 sigma < 1e-31
    x = np.arange(-lim, lim + 1)
    p = np.exp(-(x.astype(np.float64) ** 2) / (2.0 * s2))
    return p / p.sum(), 1e-30


def noise_distribution(terms: Sequence[NoiseTerm]) -> Optional[tuple[np.ndarray, float]]:
    """pmf of the per-cell noise sum on [-S, S] (index i = value i - S) and the mass
    lost to truncation, by FFT convolution of the exact pmfs; None if too large."""
    terms = [t for t in terms if t.count > 0]
    parts = [(_term_pmf(t), t.count) for t in terms]
    width = 1 + sum(c * (len(p) - 1) for (p, _), c in parts)
    if width > EXACT_MAX_POINTS:
        return None
    n = 1 << (width - 1).bit_length()
    spec = np.ones(n // 2 + 1, dtype=np.complex128)
    lost = 0.0
    for (p, e), c in parts:
        spec *= np.fft.rfft(p, n) ** c
        lost += c * e
    z = np.fft.irfft(spec, n)[:width]
    z = np.clip(z, 0.0, None)
    return z, lost + 1e-12 * width  # plus a bound on the FFT round-off


def noise_tail_bound(terms: Sequence[NoiseTerm], delta: float) -> float:
    """Smallest E >= 0 with P(Z > E) <= delta (= P(Z < -E): the noise is symmetric).

    Z is the merged per-cell noise (sum of independent discrete Laplace /
    discrete Gaussian draws). Computed from the exact distribution (FFT
    convolution of the pmfs, truncation and round-off counted against the
    tail) when its support has at most EXACT_MAX_POINTS values, else by
    :func:`chernoff_tail_bound`. The exact route is much tighter for few
    releases (e.g. 13 instead of 25 for two draws of scale 4 at 5%).
    """
    if not 0 < delta < 1:
        raise ValueError("delta must be in (0, 1)")
    terms = [t for t in terms if t.count > 0]
    if not terms:
        return 0.0
    return _tail_bound(tuple((t.mech, t.num, t.den, t.count) for t in terms), delta)


WINDOW_TAIL = 1e-18  # noise_window: P(|Z| > M) at most twice this (a Chernoff bound), counted as slack


def noise_window(terms: Sequence[NoiseTerm]) -> Optional[tuple[np.ndarray, float]]:
    """:func:`noise_distribution` (same support rule, same slack) computed on [-M, M] only.

    The support of a sum of many draws, sum of each draw's range, is far wider than where its
    mass lies: a month of a fleet's hourly roll-ups is ~10^5 draws of range +-50 each, a support
    of millions of values of which all but 10^-18 lie within a few thousand of 0. M is the
    Chernoff bound of WINDOW_TAIL (:func:`chernoff_tail_bound`), so P(|Z| > M) <= 2 WINDOW_TAIL;
    the convolution is cyclic of length n >= 2M + 1 (each term's pmf folded modulo n), exact for
    the values in [-M, M] but for the mass from beyond M folded onto them (at most that same
    2 WINDOW_TAIL, all non-negative). The slack is noise_distribution's plus 4 WINDOW_TAIL: the mass
    beyond M, missing from the window, and the folded mass, added to it. So a tail P(Z > e) read from
    the window plus the slack is never below the true one, as from noise_distribution, at a cost
    set by the noise's spread instead of its support (the running totals of a series: one per bucket).
    The whole support when that is not larger (then exactly noise_distribution's answer); None when
    noise_distribution gives None.
    """
    terms = [t for t in terms if t.count > 0]
    parts = [(_term_pmf(t), t.count) for t in terms]
    width = 1 + sum(c * (len(p) - 1) for (p, _), c in parts)
    if width > EXACT_MAX_POINTS:
        return None
    m = int(math.ceil(chernoff_tail_bound(terms, WINDOW_TAIL))) + 1
    if 2 * m + 1 >= width:
        return noise_distribution(terms)
    n = 1 << (2 * m).bit_length()  # >= 2m + 1
    spec = np.ones(n // 2 + 1, dtype=np.complex128)
    lost = 0.0
    for (p, e), c in parts:
        lim = (len(p) - 1) // 2
        folded = np.bincount(np.arange(-lim, lim + 1) % n, weights=p, minlength=n)
        spec *= np.fft.rfft(folded, n) ** c
        lost += c * e
    z = np.clip(np.fft.irfft(spec, n), 0.0, None)
    z = np.concatenate((z[n - m:], z[:m + 1]))  # values -m .. m
    return z, lost + 1e-12 * width + 4.0 * WINDOW_TAIL


@functools.lru_cache(maxsize=512)
def _tail_bound(key: tuple[tuple[str, int, int, int], ...], delta: float) -> float:
    """:func:`noise_tail_bound` of the terms ``key``, remembered: a series asks it once per bucket,
    and a fleet's buckets mostly carry the same noise (the same devices, one draw each), where the
    FFT convolution of thousands of draws was almost all of a bucket's cost. A pure function of
    its arguments, so remembering it changes no answer. The distribution is computed where its
    mass lies (:func:`noise_window`): each running total of a series has noise terms of its own."""
    terms = [NoiseTerm(m, n, d, c) for m, n, d, c in key]
    dist = noise_window(terms)
    if dist is None:
        return chernoff_tail_bound(terms, delta)
    z, slack = dist
    s = (len(z) - 1) // 2
    upper = np.cumsum(z[::-1])[::-1]  # upper[i] = P(Z >= i - s)
    # P(Z > e) = upper[e + 1 + s]; want the smallest integer e >= 0 with that + slack <= delta
    ok = np.nonzero(upper[s + 1:] + slack <= delta)[0]
    if len(ok) == 0:
        return chernoff_tail_bound(terms, delta)
    return float(ok[0])


def theorem31_offset(merged: Merged, beta: float) -> float:
    """dp-linear-sketches Theorem 3.1 / Lemma A.1 offset for the merged noise.

    With probability 1 - beta/2 *no* cell's noise is below -E (union over
    all d*w cells, the paper's split of beta), so min + E never
    underestimates any item's non-private Count-Min estimate.
    """
    return noise_tail_bound(merged.noise, (beta / 2.0) / (merged.d * merged.w))


# -- order-statistic tails ---------------------------------------------------
def poisson_binomial_tail(ps: Sequence[float], m: int) -> float:
    """P(S >= m) for S a sum of independent Bernoulli(p_i)."""
    dist = np.zeros(len(ps) + 1)
    dist[0] = 1.0
    for p in ps:
        dist[1:] = dist[1:] * (1.0 - p) + dist[:-1] * p
        dist[0] *= 1.0 - p
    return float(dist[m:].sum())


MAX_CANDIDATES = 1 << 16  # thresholds tried (a coarser grid only makes t larger, never invalid)


def _candidates(values: np.ndarray) -> np.ndarray:
    """Sorted distinct thresholds: 0 and the values >= 0 (thinned to MAX_CANDIDATES)."""
    v = np.unique(np.concatenate(([0], values[values >= 0])))
    if len(v) > MAX_CANDIDATES:
        idx = np.unique(np.linspace(0, len(v) - 1, MAX_CANDIDATES).round().astype(np.int64))
        v = v[idx]
    return v


def _pb_tails(P: np.ndarray, k: int) -> np.ndarray:
    """P(S >= k) for each row of P (n, d): S a sum of independent Bernoulli(P[i, r])."""
    n, d = P.shape
    dist = np.zeros((n, d + 1))
    dist[:, 0] = 1.0
    for r in range(d):
        p = P[:, r:r + 1]
        new = dist * (1.0 - p)
        new[:, 1:] += dist[:, :-1] * p
        dist = new
    return dist[:, k:].sum(axis=1)


def cs_halfwidth(counters: np.ndarray, alpha: float) -> float:
    """Half-width t of the CountSketch interval at confidence 1 - alpha (see module doc).

    For even d the median is the mean of the middle readings e_(m) <= e_(m+1)
    (m = d/2, errors sorted), so median - f > t needs e_(m) + e_(m+1) > 2t:
    either e_(m+1) > u (m rows above u) or e_(m) > 2t - u (m + 1 rows above
    2t - u), for any u in [t, 2t]. The bound used is the smaller of
    P(S_t >= m) and min over u of P(S_u >= m) + P(S_(2t-u) >= m+1).
    """
    d, w = counters.shape
    a = np.sort(np.abs(counters.astype(np.int64)), axis=1)
    cands = _candidates(a.ravel())
    cnt = np.stack([w - np.searchsorted(a[r], cands, side="right") for r in range(d)], axis=1)
    P = np.minimum(1.0, (cnt + 1) / w) / 2.0  # P(row error > threshold), per candidate threshold
    m = (d + 1) // 2
    TA = _pb_tails(P, m)
    target = alpha / 2.0
    if d % 2 == 1:
        ok = np.nonzero(TA <= target)[0]
        return float(cands[ok[0]]) if len(ok) else math.inf
    TB = _pb_tails(P, m + 1)

    def bound(i: int) -> float:
        t = cands[i]
        j1 = int(np.searchsorted(cands, 2 * t, side="right"))
        us = np.arange(i, max(j1, i + 1))
        vi = np.searchsorted(cands, 2 * t - cands[us], side="right") - 1  # largest threshold <= 2t - u
        return float(min(TA[i], np.min(TA[us] + TB[np.clip(vi, 0, None)])))

    lo, hi = 0, len(cands) - 1
    if bound(hi) > target:
        return math.inf
    while lo < hi:
        mid = (lo + hi) // 2
        if bound(mid) <= target:
            hi = mid
        else:
            lo = mid + 1
    return float(cands[lo])


# -- calibrated CountSketch widths ------------------------------------------------
CAL_SAMPLES = 1 << 16  # Monte Carlo draws of the median's conditional distribution (even d), at least
CAL_SEED = 0x5EED  # fixed: the same counters always give the same interval


def median_error_samples(counters: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """n draws of the CountSketch error median_r(g_r C[r, c_r]), c_r uniform, g_r a fair sign,
    rows independent: the error's distribution given the counters (module doc)."""
    c = np.asarray(counters, dtype=np.int64)
    d, w = c.shape
    sym = np.concatenate((c, -c), axis=1).ravel()  # row r: its w cells, then their negatives
    vals = sym[rng.integers(0, 2 * w, size=(n, d)) + (2 * w) * np.arange(d)[None, :]]
    if d == 4:  # the mean of the two middle values, without a partition
        return (vals.sum(axis=1) - vals.min(axis=1) - vals.max(axis=1)) / 2.0
    if d % 2 == 1:
        return np.partition(vals, d // 2, axis=1)[:, d // 2].astype(np.float64)
    part = np.partition(vals, (d // 2 - 1, d // 2), axis=1)
    return (part[:, d // 2 - 1] + part[:, d // 2]) / 2.0


def mc_size(alpha: float) -> int:
    """Draws for a two-sided alpha: >= 400 expected in the tail, 2^16 .. 2^20 (>= 100 down to alpha = 1e-4)."""
    return int(min(1 << 20, max(CAL_SAMPLES, math.ceil(400.0 / alpha))))


def abs_quantile(samples: np.ndarray, alpha: float) -> float:
    """Smallest sample value t of |samples| with (#{|s| > t}) <= alpha * n."""
    a = np.abs(samples)
    j = len(a) - 1 - min(int(math.floor(alpha * len(a))), len(a) - 1)  # #{|s| > a_(j)} <= alpha n
    return float(np.partition(a, j)[j])


def cs_calibrated_halfwidth(counters: np.ndarray, alpha: float) -> float:
    """Half-width t with P(|median - f| > t) = alpha (as nearly as the grid allows) given the counters.

    Row r's error is g_r(x) C_o[r, h_r(x)]: a fair sign times a uniformly random
    cell of row r, independent across rows (module doc), so the error of the
    median has a known conditional distribution, symmetric about 0. Odd d: the
    median exceeds t iff m = (d+1)/2 rows do, each with probability
    p_r(t) = #{c : |C[r, c]| > t} / (2w), so P(median > t) = P(S >= m) exactly,
    S ~ PoissonBinomial(p). Even d: the median averages the two middle errors;
    its distribution is taken from mc_size(alpha) seeded draws of the rows
    (:func:`median_error_samples`), t the (1 - alpha) quantile of |median|.
    C stands in for C_o: they differ in x's own cell only, a 1/w share of each
    row (no change at all for items never seen). :func:`cs_halfwidth` is the
    earlier union bound, valid for every item but conservative (0.97 at a
    nominal 0.90 for d = 4 in tree range queries).
    """
    d, w = counters.shape
    if poisson_binomial_tail([1.0 / (2.0 * w)] * d, (d + 1) // 2) > alpha / 2.0:
        # x's own cell (1/w of each row) alone could carry the error beyond any t: a
        # confidence this sketch cannot resolve is reported as unbounded, as by cs_halfwidth
        return math.inf
    if d % 2 == 1:
        a = np.sort(np.abs(counters.astype(np.int64)), axis=1)
        cands = _candidates(a.ravel())
        cnt = np.stack([w - np.searchsorted(a[r], cands, side="right") for r in range(d)], axis=1)
        TA = _pb_tails(cnt / (2.0 * w), (d + 1) // 2)
        ok = np.nonzero(TA <= alpha / 2.0)[0]
        return float(cands[ok[0]]) if len(ok) else math.inf
    rng = np.random.default_rng(CAL_SEED)
    return abs_quantile(median_error_samples(counters, mc_size(alpha), rng), alpha)


def cms_lower_width(counters: np.ndarray, alpha: float, plus_one: bool = True) -> float:
    """t_lo >= 0 with P(min - f > t_lo) <= alpha/2 (Count-Min lower end).

    ``plus_one`` counts x's own cell once more per row (the old guard); without it the
    probability is the exact one given C_o for unseen items and an upper bound for seen
    ones (x's cell in C is C_o's plus f >= 0, so C never has fewer cells above t)."""
    d, w = counters.shape
    a = np.sort(counters.astype(np.int64), axis=1)
    cands = _candidates(a.ravel())
    cnt = np.stack([w - np.searchsorted(a[r], cands, side="right") for r in range(d)], axis=1)
    if (1.0 / w) ** d > alpha / 2.0:
        return math.inf  # x's own cells alone could exceed any t: unreachable confidence
    prob = np.prod(np.minimum(1.0, (cnt + (1 if plus_one else 0)) / w), axis=1)
    ok = np.nonzero(prob <= alpha / 2.0)[0]
    return float(cands[ok[0]]) if len(ok) else math.inf


def cms_below_probability(counters: np.ndarray, e: float) -> float:
    """P(min - f < -e) given the counters: 1 - prod_r (1 - #{c : C[r, c] < -e} / w).

    Row r's error is a uniformly random cell of row r of C_o (module doc); the minimum
    is below f - e iff some row's is. The probability the upper end min + e misses."""
    d, w = counters.shape
    below = (np.asarray(counters, dtype=np.int64) < -e).sum(axis=1)
    return float(1.0 - np.prod(1.0 - below / w))


def cms_offset(merged: Merged, alpha: float) -> float:
    """E with P(min over x's d cells of noise < -E) <= alpha/2 (Theorem 3.1 offset, point-wise)."""
    delta = -math.expm1(math.log1p(-alpha / 2.0) / merged.d)  # 1 - (1 - alpha/2)^(1/d)
    return noise_tail_bound(merged.noise, delta)


@dataclass(frozen=True)
class IntervalRule:
    """Item-independent interval widths: lo = estimate - below, hi = estimate + above."""

    kind: str
    confidence: float
    below: float
    above: float
    offset: float  # Count-Min: the Theorem 3.1 offset E (= above); CountSketch: 0
    noise_sd: float
    method: str


def interval_rule(merged: Merged, confidence: float) -> IntervalRule:
    """Calibrated widths (module doc, "Calibration"): CountSketch by the conditional distribution
    of the median, Count-Min by the offset E above and the rest of alpha below."""
    if not 0.5 <= confidence < 1:
        raise ValueError("confidence must be in [0.5, 1)")
    alpha = 1.0 - confidence
    if merged.kind == "cs":
        t = cs_calibrated_halfwidth(merged.counters, alpha)
        return IntervalRule("cs", confidence, t, t, 0.0, merged.noise_sd, "cs-median-conditional")
    e = cms_offset(merged, alpha)
    p_hi = cms_below_probability(merged.counters, e)
    t_lo = cms_lower_width(merged.counters, max(alpha / 2.0, alpha - p_hi) * 2.0, plus_one=False)
    return IntervalRule("cms", confidence, t_lo, e, e, merged.noise_sd, "cms-min-offset-conditional")


def row_readings(counters: np.ndarray, cols: np.ndarray, signs: np.ndarray, kind: str) -> np.ndarray:
    """(n, d) readings g_r(x) C[r, h_r(x)] for n items."""
    d = counters.shape[0]
    vals = counters[np.arange(d)[None, :], cols]
    if kind == "cs":
        vals = vals * signs.astype(np.int64)
    return vals


def point_estimates(counters: np.ndarray, cols: np.ndarray, signs: np.ndarray, kind: str) -> np.ndarray:
    """Algorithm 2: min (Count-Min) or median (CountSketch) per item, float64."""
    vals = row_readings(counters, cols, signs, kind)
    if kind == "cms":
        return vals.min(axis=1).astype(np.float64)
    return np.median(vals, axis=1)


def estimate_with_intervals(merged: Merged, cols: np.ndarray, signs: np.ndarray,
                            confidence: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, IntervalRule]:
    """(estimates, lo, hi, rule) for items given by their columns/signs."""
    est = point_estimates(merged.counters, cols, signs, merged.kind)
    rule = interval_rule(merged, confidence)
    return est, est - rule.below, est + rule.above, rule
