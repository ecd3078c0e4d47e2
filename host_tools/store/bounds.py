"""Bounded influence: is a valid release consistent with at most ``max_events`` events plus its noise?

A stolen device holds the fleet's credentials and salt, so it can publish
well-formed releases with any counters it likes. The host cannot prove a
range in zero knowledge, but it knows each release's noise distribution
exactly (its ``mech``, ``nint``, ``nout`` and ``nz``) and the fleet's
contribution limit (``[fleet] max_events_per_window``). This module decides,
per release and in a few microseconds of numpy, whether the counters could
come from a device that saw at most that many events. docs/PRIVACY.md
"Bounded influence" has the proof; in short, for the counting kinds (cms, cs,
tree nodes, every level of dcs and strhh):

* one event of weight |v| <= clip adds v (times a sign) to exactly one cell of
  every row, so the events' part x of a row has  sum_j |x_j| <= clip * N  and
  every |x_j| <= clip * N  (N events, any weights, any items);
* the counters are y = x + z with z the cell noise (nz - 1 draws of nint plus
  one of nout, independent per cell), so  |y_j| <= clip * N + |z_j|  and
  sum_j |y_j| <= clip * N + sum_j |z_j|;
* a release is refused when some cell exceeds  clip * N + t_cell  or some row's
  mass exceeds  clip * N + t_row,  where t_cell and t_row are Chernoff bounds
  from the exact moment generating function of the noise, at probabilities
  that add up (union bound over every cell and every row) to at most
  FALSE_REFUSAL = 1e-9 for an honest device at or under the limit.

Kind dbits (DNPRY bits, per level the number of one-bits plus one discrete
Laplace draw): every bit is Bern(1/2) unless an item re-drew it from Bern(p),
p = 1/2 + eps/4, and N distinct items touch at most N bits. So each level's
count is at most Bin(m - u, 1/2) + Bin(u, p) + noise (u = min(m, N)), at least
Bin(m, 1/2) + noise, and their total at most Bin(mK - U, 1/2) + Bin(U, p) +
noise (U = min(mK, N)), in the usual stochastic order; the thresholds are
Chernoff bounds of those laws, again at 1e-9 in all.

The thresholds depend only on the release's parameters and are remembered
per distinct set (a fleet has a handful), so the per-release cost is one
pass of numpy over the counters (measured in tests/test_bounds.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from pansketch.host_tools.hostconfig import DEFAULT_MAX_EVENTS, LIMIT_KINDS, MAX_MAX_EVENTS  # noqa: F401 (re-exported)
from pansketch.host_tools.store.numeric import golden_min
from pansketch.host_tools.store.records import Rejected

FALSE_REFUSAL = 1e-9  # per release: the probability that an honest device at the limit is refused


@dataclass(frozen=True)
class Thresholds:
    """What a release of one parameter set may hold (counting kinds: ``cell``, ``row``; dbits the rest)."""

    limit: int  # clip * max_events (counting kinds), or max_events distinct items (dbits)
    cell: float = 0.0  # noise allowance of one cell: refuse |y| > limit + cell
    row: float = 0.0  # noise allowance of one row's mass: refuse sum |y| > limit + row
    level_hi: float = 0.0  # dbits: refuse a level count above this
    level_lo: float = 0.0  # dbits: ... or below this
    total_hi: float = 0.0  # dbits: refuse the sum of the level counts above this


# -- Chernoff bounds from exact moment generating functions ----------------------------------------
def _chernoff(log_mgf: Callable[[float], float], log_inv: float, lam_max: float) -> float:
    """min over 0 < lam < lam_max of (log_mgf(lam) + log_inv) / lam: a T with P(X > T) <= exp(-log_inv)
    for any X whose log E[e^{lam X}] is at most log_mgf(lam) (Markov's inequality on e^{lam X}).

    The objective is unimodal in lam (its derivative has the sign of lam K' - K - log_inv, which
    increases for convex K), so a golden-section search on log(lam) finds the minimum; any lam gives
    a valid bound, so an inexact minimum only costs tightness, never soundness.
    """
    lo, hi = math.log(lam_max) - 40.0, math.log(lam_max) + math.log1p(-1e-9)

    def g(u: float) -> float:
        lam = math.exp(u)
        k = log_mgf(lam)
        return math.inf if math.isinf(k) else (k + log_inv) / lam

    return max(0.0, golden_min(g, lo, hi, 1e-9))


def _dlap_log_mgf(scale: float, lam: float) -> float:
    """log E[e^{lam X}], X discrete Laplace of scale t (pmf ~ q^|x|, q = e^{-1/t}); inf for lam >= 1/t."""
    a = 1.0 / scale
    if lam >= a:
        return math.inf
    return 2.0 * math.log(-math.expm1(-a)) - math.log(-math.expm1(lam - a)) - math.log(-math.expm1(-lam - a))


def _dlap_abs_log_mgf(scale: float, lam: float) -> float:
    """log E[e^{lam |X|}] for X discrete Laplace of scale t: (1 - q)(1 + q e^lam) / ((1 + q)(1 - q e^lam))."""
    a = 1.0 / scale
    if lam >= a:
        return math.inf
    q = math.exp(-a)
    return (math.log(-math.expm1(-a)) + math.log1p(q * math.exp(lam)) - math.log1p(q)
            - math.log(-math.expm1(lam - a)))


def _noise_log_mgf(draws: list[tuple[str, float, int]], lam: float) -> float:
    """log E[e^{lam Z}] (an upper bound for dgauss) of one cell's noise Z = the sum of the draws
    (mech, parameter, count): exact for discrete Laplace; for the discrete Gaussian N_Z(0, s2) the
    bound lam^2 s2 / 2 (Canonne, Kamath & Steinke 2020, Corollary 9: it is subgaussian with s2)."""
    k = 0.0
    for mech, p, c in draws:
        k += c * (lam * lam * p / 2.0 if mech == "dgauss" else _dlap_log_mgf(p, lam))
    return k


def _lam_max(draws: list[tuple[str, float, int]]) -> float:
    caps = [1.0 / p for mech, p, c in draws if mech == "dlap" and c > 0]
    if caps:
        return min(caps)
    return 1.0 / math.sqrt(max(p for _, p, _ in draws))  # dgauss: no pole; the optimum is far below this * 50
    # (the search spans 40 e-folds below lam_max and lam_max itself)


def cell_allowance(draws: list[tuple[str, float, int]], delta: float) -> float:
    """t with P(|Z| > t) <= delta for one cell's noise Z (symmetric: twice the one-sided bound)."""
    lm = _lam_max(draws)
    if all(m == "dgauss" for m, _, _ in draws):
        lm *= 50.0
    return _chernoff(lambda lam: _noise_log_mgf(draws, lam), math.log(2.0 / delta), lm)


def row_allowance(draws: list[tuple[str, float, int]], w: int, delta: float) -> float:
    """T with P(sum of |Z_j| over w independent cells > T) <= delta.

    Two bounds, both from exact moment generating functions, the smaller is used:

    * E[e^{lam |Z|}] <= E[e^{lam Z}] + E[e^{-lam Z}] = 2 E[e^{lam Z}] (Z symmetric), so the row's
      log-MGF is at most w (log 2 + K_Z(lam)) -- good for many draws per cell (nz large);
    * |Z| <= sum of |draws| (triangle inequality) with the exact MGF of |discrete Laplace| --
      good for the usual nz = 2 (discrete Laplace only).
    """
    lm = _lam_max(draws)
    if all(m == "dgauss" for m, _, _ in draws):
        lm *= 50.0
    li = math.log(1.0 / delta)
    best = _chernoff(lambda lam: w * (math.log(2.0) + _noise_log_mgf(draws, lam)), li, lm)
    if all(m == "dlap" for m, _, _ in draws):
        best = min(best, _chernoff(lambda lam: w * sum(c * _dlap_abs_log_mgf(p, lam) for _, p, c in draws), li, lm))
    return best


def _bern_log_mgf(p: float, lam: float) -> float:
    """log E[e^{lam B}] for B ~ Bern(p) (lam of either sign)."""
    return math.log1p(p * math.expm1(lam))


def _dbits_hi(n_half: int, n_p: int, p: float, noise: list[tuple[str, float, int]], delta: float) -> float:
    """T with P(Bin(n_half, 1/2) + Bin(n_p, p) + noise > T) <= delta."""
    mean = n_half / 2.0 + n_p * p

    def k(lam: float) -> float:
        return (n_half * _bern_log_mgf(0.5, lam) + n_p * _bern_log_mgf(p, lam) - lam * mean
                + _noise_log_mgf(noise, lam))

    return mean + _chernoff(k, math.log(1.0 / delta), _lam_max(noise))


def _dbits_lo(n: int, noise: list[tuple[str, float, int]], delta: float) -> float:
    """T with P(Bin(n, 1/2) + noise < T) <= delta."""
    def k(lam: float) -> float:  # the MGF of -(X - n/2) at lam: Bin(n, 1/2) is symmetric about n/2
        return n * _bern_log_mgf(0.5, lam) - lam * n / 2.0 + _noise_log_mgf(noise, lam)

    return n / 2.0 - _chernoff(k, math.log(1.0 / delta), _lam_max(noise))


# -- thresholds per parameter set, remembered --------------------------------------------------------
_CACHE: dict[tuple[Any, ...], Thresholds] = {}
_CACHE_MAX = 1024  # distinct parameter sets (a fleet has a handful; hostile input only empties it)


def cell_draws(rel: Any) -> list[tuple[str, float, int]]:
    """One cell's noise draws (mech, parameter, count): nz - 1 of nint and one of nout."""
    out = [(rel.mech, rel.nout[0] / rel.nout[1], 1)]
    if rel.nz > 1:
        out.append((rel.mech, rel.nint[0] / rel.nint[1], rel.nz - 1))
    return out


def thresholds(rel: Any, max_events: int, alpha: float = FALSE_REFUSAL) -> Thresholds:
    """The refusal thresholds for releases with ``rel``'s parameters (any object with the release's
    fields: mech, nint, nout, nz, clip, kind, d, w, b, budget)."""
    key = (rel.kind, rel.mech, rel.nint, rel.nout, rel.nz, rel.clip, rel.d, rel.w, rel.b,
           getattr(rel, "budget", None), max_events, alpha)
    th = _CACHE.get(key)
    if th is not None:
        return th
    if rel.kind == "dbits":
        th = _dbits_thresholds(rel, max_events, alpha)
    else:
        rows, w = rel.rows, rel.w
        draws = cell_draws(rel)
        # half the budget to the cells (union over rows * w cells), half to the rows' masses
        th = Thresholds(limit=rel.clip * max_events, cell=cell_allowance(draws, alpha / 2.0 / (rows * w)),
                        row=row_allowance(draws, w, alpha / 2.0 / rows))
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.clear()
    _CACHE[key] = th
    return th


def _dbits_thresholds(rel: Any, max_events: int, alpha: float) -> Thresholds:
    levels, m = rel.d, rel.w
    eps = rel.budget[0] / rel.budget[1]
    p = 0.5 + eps / 4.0  # pansketch.agent.dbits: a touched bit is re-drawn from Bern(1/2 + eps/4)
    noise = [("dlap", rel.nout[0] / rel.nout[1], 1)]  # one output draw per level count (the bits are Z_int)
    a = alpha / (2 * levels + 1)  # upper and lower per level, and the total
    u = min(m, max_events)
    big_u = min(m * levels, max_events)
    return Thresholds(limit=max_events, level_hi=_dbits_hi(m - u, u, p, noise, a), level_lo=_dbits_lo(m, noise, a),
                      total_hi=_dbits_hi(m * levels - big_u, big_u, p, [("dlap", noise[0][1], levels)], a))


# -- the check ---------------------------------------------------------------------------------------
def check(rel: Any, max_events: int, counters: Optional[np.ndarray] = None,
          alpha: float = FALSE_REFUSAL, max_clip: Optional[int] = None) -> Optional[Rejected]:
    """None if ``rel`` (a validated Release or a StoredRelease) is consistent with at most ``max_events``
    events per window plus its noise; else a :class:`Rejected` with code ``bound`` and the reason
    (the row and what it holds). ``counters``: ``rel.counters()`` if already read."""
    th = thresholds(rel, max_events, alpha)
    if max_clip is not None and rel.clip > max_clip and rel.kind != "dbits":
        # a clip above the fleet's: its noise is calibrated to it, but its events may weigh max_clip at most
        th = Thresholds(limit=max_clip * max_events, cell=th.cell, row=th.row)
    y = rel.counters() if counters is None else counters
    if rel.kind == "dbits":
        return _check_dbits(rel, th, y.reshape(-1))
    # one cell first (max and min of the int32 counters: no conversion), then the rows' masses: once
    # no cell exceeds the cell limit, |y| fits in int32 (no -2^31) and a row's sum overflows only past
    # 2^31 / w per cell, checked before summing in int32 (the common case: the cheapest pass numpy has)
    cell = th.limit + th.cell
    peak = max(int(y.max()), -int(y.min()))
    if peak > cell:
        top = np.abs(y.astype(np.int64)).max(axis=1)
        r = int(np.argmax(top))
        return Rejected("bound", "%s has a cell of %d, more than %d events of weight <= %d plus noise can give "
                                 "(%d + %.0f; [fleet] max_events_per_window = %d)"
                        % (_row_name(rel, r), int(top[r]), max_events, th.limit // max_events, th.limit, th.cell,
                           max_events))
    a = np.abs(y)
    mass = a.sum(axis=1) if peak * y.shape[1] < (1 << 31) else a.sum(axis=1, dtype=np.int64)
    if mass.max() > th.limit + th.row:  # (argmax only on a refusal: every numpy call costs ~1 us)
        r = int(np.argmax(mass))
        return Rejected("bound", "%s holds counter mass %d, more than %d events of weight <= %d plus noise can give "
                                 "(%d + %.0f; [fleet] max_events_per_window = %d)"
                        % (_row_name(rel, r), int(mass[r]), max_events, th.limit // max_events, th.limit, th.row,
                           max_events))
    return None


def _row_name(rel: Any, r: int) -> str:
    if rel.kind in ("dcs", "strhh"):
        return "level %d row %d" % (r // rel.d, r % rel.d)
    if rel.mode == "tree":
        return "tree node level %d row %d" % (rel.lvl, r)
    return "row %d" % r


def _check_dbits(rel: Any, th: Thresholds, c: np.ndarray) -> Optional[Rejected]:
    hi = int(np.argmax(c))
    if c[hi] > th.level_hi:
        return Rejected("bound", "level %d counts %d one-bits, more than %d distinct items plus the bits' and the "
                                 "noise's randomness can give (at most %.0f; [fleet] max_events_per_window = %d)"
                        % (hi, int(c[hi]), th.limit, th.level_hi, th.limit))
    lo = int(np.argmin(c))
    if c[lo] < th.level_lo:
        return Rejected("bound", "level %d counts %d one-bits, fewer than its %d random bits can give (at least %.0f)"
                        % (lo, int(c[lo]), rel.w, th.level_lo))
    tot = int(c.astype(np.int64).sum())
    if tot > th.total_hi:
        return Rejected("bound", "the levels count %d one-bits in all, more than %d distinct items plus the bits' and "
                                 "the noise's randomness can give (at most %.0f; [fleet] max_events_per_window = %d)"
                        % (tot, th.limit, th.total_hi, th.limit))
    return None


def influence(rel: Any, max_events: int, alpha: float = FALSE_REFUSAL) -> dict[str, float]:
    """What one accepted release of these parameters can at most hold (for docs, status and tests):
    the cell and row-mass limits of the counting kinds, the level and total one-bit limits of dbits."""
    th = thresholds(rel, max_events, alpha)
    if rel.kind == "dbits":
        return {"level_hi": th.level_hi, "level_lo": th.level_lo, "total_hi": th.total_hi}
    return {"cell": th.limit + th.cell, "row_mass": th.limit + th.row, "noise_cell": th.cell, "noise_row": th.row}


def check_window(rels: list[Any], max_events: int, max_clip: Optional[int] = None,
                 alpha: float = FALSE_REFUSAL) -> Optional[Rejected]:
    """The bound on the sum of one device's releases of one window (keep mode: one release per epoch,
    each of which passed :func:`check` alone): the events of the whole window are at most
    ``max_events``, and the noise of the sum is every draw of every release. None if consistent, else a
    :class:`Rejected` (code ``bound``) for pansketch.host_tools.query.influence to flag: the releases are stored
    already, each one valid on its own. Counting kinds only (dbits: one release per epoch, by design)."""
    if len(rels) < 2 or rels[0].kind == "dbits":
        return None
    r0 = rels[0]
    counts: dict[tuple[str, float], int] = {}
    y = np.zeros(r0.shape, dtype=np.int64)
    for r in rels:
        y += r.counters()
        for mech, p, c in cell_draws(r):
            counts[(mech, p)] = counts.get((mech, p), 0) + c
    draws = [(m, p, c) for (m, p), c in sorted(counts.items())]
    rows, w = y.shape
    clip = min(r0.clip, max_clip) if max_clip is not None else r0.clip
    limit = clip * max_events
    cell = cell_allowance(draws, alpha / 2.0 / (rows * w))
    row = row_allowance(draws, w, alpha / 2.0 / rows)
    peak = int(np.abs(y).max())
    mass = int(np.abs(y).sum(axis=1).max())
    if peak > limit + cell:
        return Rejected("bound", "its %d releases of this window add up to a cell of %d, more than %d events of weight "
                                 "<= %d plus noise can give (%d + %.0f)" % (len(rels), peak, max_events, clip, limit, cell))
    if mass > limit + row:
        return Rejected("bound", "its %d releases of this window add up to a row mass of %d, more than %d events of "
                                 "weight <= %d plus noise can give (%d + %.0f)"
                        % (len(rels), mass, max_events, clip, limit, row))
    return None
