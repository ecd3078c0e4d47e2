"""Statistics of the audit: Clopper–Pearson bounds, ε lower bounds, zCDP → (ε, δ).

The ε lower bound is the standard construction of Jagielski, Ullman & Oprea,
"Auditing Differentially Private Machine Learning: How Private is Private
SGD?" (NeurIPS 2020), Algorithm 2: a distinguisher between two neighbouring
worlds has false-positive rate FPR and false-negative rate FNR; any
(ε, δ)-DP mechanism satisfies FPR + e^ε FNR ≥ 1 − δ and FNR + e^ε FPR ≥ 1 − δ
(Kairouz, Oh & Viswanath 2015), so with Clopper–Pearson upper confidence
bounds FPR_hi, FNR_hi,

    ε_lb = max( log((1 − δ − FNR_hi) / FPR_hi),  log((1 − δ − FPR_hi) / FNR_hi) )

holds with confidence ≥ 95 % (each bound is the upper end of a two-sided
95 % Clopper–Pearson interval, i.e. a one-sided 97.5 % bound, so both hold
together with probability ≥ 95 % by the union bound).

No scipy on the host path: the regularized incomplete beta function is
evaluated with Lentz's continued fraction (Numerical Recipes §6.4) and
inverted by bisection; ``tests/test_audit.py`` checks it against scipy.
"""

from __future__ import annotations

import math

# the zCDP -> (eps, delta) conversion lives with the privacy ledger (one eps figure everywhere); re-exported
from pansketch.host_tools.store.ledger import zcdp_delta, zcdp_to_dp, zcdp_to_dp_bun_steinke  # noqa: F401

ALPHA = 0.05  # two-sided Clopper–Pearson level: 95 % intervals


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab = a + b
    qap = a + 1.0
    qam = a - 1.0
    c = 1.0
    d = 1.0 - qab * x / qap
    if abs(d) < tiny:
        d = tiny
    d = 1.0 / d
    h = d
    for m in range(1, 10000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = tiny if abs(d) < tiny else d
        c = 1.0 + aa / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = tiny if abs(d) < tiny else d
        c = 1.0 + aa / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta function I_x(a, b) for a, b > 0."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbt = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lbt) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbt) * _betacf(b, a, 1.0 - x) / b


def beta_ppf(p: float, a: float, b: float) -> float:
    """Quantile of Beta(a, b) by bisection on :func:`betainc` (absolute error < 1e-13)."""
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if betainc(a, b, mid) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-13:
            break
    return 0.5 * (lo + hi)


def cp_upper(k: int, n: int, alpha: float = ALPHA) -> float:
    """Upper end of the two-sided (1 − alpha) Clopper–Pearson interval for k successes in n."""
    if n <= 0:
        return 1.0
    if k >= n:
        return 1.0
    return beta_ppf(1.0 - alpha / 2.0, k + 1.0, float(n - k))


def cp_lower(k: int, n: int, alpha: float = ALPHA) -> float:
    """Lower end of the two-sided (1 − alpha) Clopper–Pearson interval."""
    if k <= 0:
        return 0.0
    return beta_ppf(alpha / 2.0, float(k), n - k + 1.0)


def eps_from_rates(fpr_hi: float, fnr_hi: float, delta: float = 0.0) -> float:
    """ε lower bound of one direction (Jagielski et al. 2020): log((1 − δ − FNR_hi) / FPR_hi).

    Returns 0 when the bound is vacuous (numerator ≤ FPR_hi).
    """
    num = 1.0 - delta - fnr_hi
    if num <= 0.0 or num <= fpr_hi:
        return 0.0
    return math.log(num / fpr_hi)


def eps_lower_bound(fp: int, n0: int, fn: int, n1: int, delta: float = 0.0) -> float:
    """ε lower bound from counts: fp false positives among n0 world-0 trials,
    fn false negatives among n1 world-1 trials; both directions of the test."""
    fpr_hi = cp_upper(fp, n0)
    fnr_hi = cp_upper(fn, n1)
    return max(eps_from_rates(fpr_hi, fnr_hi, delta), eps_from_rates(fnr_hi, fpr_hi, delta))


def eps_point(fp: int, n0: int, fn: int, n1: int, delta: float = 0.0) -> float:
    """Point estimate of the same quantity (no confidence correction; for choosing thresholds)."""
    fpr = max(fp, 0.5) / n0
    fnr = max(fn, 0.5) / n1
    return max(eps_from_rates(fpr, fnr, delta), eps_from_rates(fnr, fpr, delta))

