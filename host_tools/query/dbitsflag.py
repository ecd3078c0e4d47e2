"""Detection within the bound for kind dbits: flag a device whose distinct-count release is out of line.

A dbits release is one count of one-bits per level (pansketch.agent.dbits; the
fleet's distinct answer is the sum of the per-release estimates,
pansketch.host_tools.query.distinct). pansketch.host_tools.store.bounds keeps every level
and the levels' total within what ``max_events`` distinct items plus the bits'
and the noise's randomness can give. Inside that a stolen device can still add
up to about ``max_events`` to the fleet's distinct count, or craft levels no
number of distinct items produces (which the maximum-likelihood estimate then
reads as some large count). There is no item mix to compare with the other
devices (one number per level), so three tests, each with its false-flag rate
derived or measured (docs/HOST.md "Flagged devices", docs/PRIVACY.md "Bounded
influence"):

* **shape** (per release): at the maximum-likelihood D, each level's count has
  the model's mean and variance (:func:`pansketch.host_tools.query.distinct.level_moments`:
  balls in bins with Binomial(D, 2^-(k+1)) items, Bern(p) / Bern(1/2) bits, the
  output noise). The statistic X = sum_k (c_k - mu_k)^2 / var_k is about
  chi^2 with K - 1 degrees of freedom for an honest release; flagged beyond the
  Chernoff bound of chi^2_K at :data:`FIT_ALPHA` (``(x/K e^{1-x/K})^{K/2}``, a
  bound on the tail of the larger law: the fitted D only takes a degree away).
  Levels raised or lowered against the others (a deep level full while the
  shallow ones are not, every level at the same count) are thousands of
  allowances out.
* **over the limit** (per device and window): the estimate minus :data:`Z`
  standard deviations (inverse-variance sd, :func:`pansketch.host_tools.query.distinct.estimate_many`)
  above ``max_events``: more distinct items than the fleet allows one device.
* **out of line with the fleet** (with at least :data:`MIN_DEVICES` devices in
  the window): the estimate minus Z sd above :data:`RATIO` times the median of
  the others' estimates plus Z sd. Devices do differ in activity (the
  heterogeneous test fleet has one 20x busier than the rest, never flagged); a
  device claiming 100x the median is a prompt to look, like every flag, not a
  verdict. A fleet whose devices honestly differ by more needs the operator's
  judgement (``pansketch device exclude`` is theirs).

The false flags on honest fleets are measured in tests/test_influence_dbits.py
(the demo's dbits parameters, and a heterogeneous fleet with one device 20x
busier): 0 of the honest device-windows there; the shape test's rate on 20,000
simulated releases is in docs/HOST.md.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from pansketch.host_tools.query import distinct
from pansketch.host_tools.query.merge import noise_variance

FIT_ALPHA = 1e-6  # per release: the shape test's tail (chi^2_K Chernoff bound)
Z = 6.0  # standard deviations of the estimate in the limit and fleet tests
RATIO = 100.0  # the fleet test: a device's distinct count beyond this many times the others' median
MIN_DEVICES = 3  # fewer: no fleet to compare with (the shape and limit tests still apply)
LIMIT_ALPHA = 1e-3  # per release at the limit: the limit test's tail (simulated, LIMIT_SIMS draws)
LIMIT_SIMS = 4000


def chi2_bound(k: int, alpha: float) -> float:
    """x with P(chi^2_k > x) <= alpha: the Chernoff bound (x/k e^{1 - x/k})^{k/2} = alpha solved for x > k
    (bisection on the log, which decreases in x beyond k)."""
    target = 2.0 * math.log(alpha) / k

    def g(x: float) -> float:
        r = x / k
        return math.log(r) + 1.0 - r - target

    lo, hi = float(k), float(k)
    while g(hi) > 0:
        hi *= 2.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if g(mid) > 0:
            lo = mid
        else:
            hi = mid
    return hi


_LIMIT: dict[tuple[Any, ...], float] = {}


def limit_estimate(K: int, m: int, budget: tuple[int, int], out_scale: float, out_var: float, max_events: int) -> float:
    """The (1 - LIMIT_ALPHA) quantile of the maximum-likelihood estimate of a release that saw exactly
    ``max_events`` distinct items (LIMIT_SIMS seeded simulations of the device,
    :func:`pansketch.host_tools.query.distinct.simulate_device`; remembered per parameter set). The
    estimate grows with the true count in distribution, so an honest device at or under the limit
    exceeds it with probability at most LIMIT_ALPHA (up to the simulation's error): its right tail is
    long (the sd is ~20 % of D at m = 256), an estimate minus some sd would flag ~1 % at the limit."""
    key = (K, m, budget, out_scale, out_var, max_events)
    t = _LIMIT.get(key)
    if t is None:
        p = float(distinct.device_p(K, m, budget))
        rng = np.random.default_rng(20260407)
        c = distinct.simulate_device(float(max_events), K, m, p, out_scale, LIMIT_SIMS, rng)
        d = distinct.mle_many(c, m, p, out_var)
        t = float(np.quantile(d, 1.0 - LIMIT_ALPHA))
        if len(_LIMIT) > 256:
            _LIMIT.clear()
        _LIMIT[key] = t
    return t


def _zero_sd(K: int, m: int, eps: float, out_var: float) -> float:
    """The estimate's sd at D = 0 (inverse-variance, :func:`pansketch.host_tools.query.distinct.estimate_many`
    at the expected counts m / 2): below Z times this, a count is noise."""
    _d, v = distinct.estimate_many(np.full((1, K), m / 2.0), m, eps, out_var)
    return math.sqrt(float(v[0]))


def _fit(rels: Sequence[Any], max_events: int) -> list[tuple[float, float, float, int, float, float, float]]:
    """Per release: (D_hat, floor, X / bound, the level furthest out, its count, its model mean, the limit's
    threshold of D_hat)."""
    out = []
    for r in rels:
        c = r.counters().reshape(-1).astype(np.float64)
        K, m = r.d, r.w
        ov = noise_variance(r.mech, r.nout[0], r.nout[1])
        p = float(distinct.device_p(K, m, r.budget))
        eps = r.budget[0] / r.budget[1]
        d_hat = float(distinct.mle_many(c[None, :], m, p, ov)[0])
        mu, v = distinct.level_moments(np.array([d_hat]), K, m, p, ov)
        z2 = (c - mu.reshape(-1)) ** 2 / v.reshape(-1)
        x = float(z2.sum()) if np.all(np.isfinite(z2)) else math.inf
        k = int(np.argmax(np.where(np.isfinite(z2), z2, np.inf)))
        out.append((d_hat, Z * _zero_sd(K, m, eps, ov), x / chi2_bound(K, FIT_ALPHA), k, float(c[k]),
                    float(mu.reshape(-1)[k]), limit_estimate(K, m, r.budget, r.nout[0] / r.nout[1], ov, max_events)))
    return out


def compare(devices: dict[str, list[Any]], max_events: int, win_s: int = 0, win: int = 0) -> list[Any]:
    """The flags (pansketch.host_tools.query.flag.Flag) of one window and dbits merge group:
    ``devices`` maps a device to its releases of the window (with payload)."""
    from pansketch.host_tools.query.flag import Flag

    fits = {dev: _fit(rs, max_events) for dev, rs in devices.items()}
    est = {dev: sum(f[0] for f in fs) for dev, fs in fits.items()}
    total = sum(max(d, 0.0) for d in est.values())
    out = []
    for dev in sorted(devices):
        d_i = est[dev]
        share = max(d_i, 0.0) / total if total > 0 else math.nan
        cands: list[tuple[float, tuple[int, int, int], float, int, str]] = []
        worst = max(fits[dev], key=lambda f: f[2])
        bad = sum(1 for f in fits[dev] if f[2] > 1.0)
        if worst[2] > 1.0:
            cands.append((worst[2], (worst[3], 0, 0), worst[4] - worst[5], bad,
                          "level %d counts %.0f one-bits where the best-fitting %.0f distinct items give %.0f: no "
                          "number of distinct items explains its levels (%.0fx the allowance)"
                          % (worst[3], worst[4], worst[0], worst[5], worst[2])))
        over = [f for f in fits[dev] if f[0] > f[6]]
        if over:
            f = max(over, key=lambda f: f[0] / f[6])
            cands.append((f[0] / f[6], (0, 0, 0), f[0] - max_events, len(over),
                          "its levels give %.0f distinct items, more than a device with the %d the fleet allows per "
                          "window gives but once in %.0f (%.0f)" % (f[0], max_events, 1.0 / LIMIT_ALPHA, f[6])))
        if len(devices) >= MIN_DEVICES:
            others = [max(est[k], fits[k][0][1]) for k in devices if k != dev]
            med = float(np.median(others))
            if d_i > RATIO * med:
                cands.append((d_i / (RATIO * med), (0, 0, 0), d_i - RATIO * med, 1,
                              "its levels give %.0f distinct items, more than %.0fx the others' median (%.0f; counts "
                              "under %.0f, noise, taken as that)" % (d_i, RATIO, med, fits[dev][0][1])))
        if cands:
            score, cell, resid, cells, why = max(cands, key=lambda c: c[0])
            out.append(Flag(dev, win_s, win, "dbits", score, cell, resid, share, cells, why))
    return out
