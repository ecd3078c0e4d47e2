"""Differentially private Count Sketch for intermittent queries.

Paper: intermittent-queries-dp-count-sketch.txt (Yildirim et al.).

* :class:`DynamicCountSketch` -- Algorithm 1 (Count Sketch as an event-driven
  system: arrivals and query sets), on :class:`pansketch.agent.sketch.Sketch`.
* :func:`m_hat_q` -- Algorithm 2, the upper bound m̂_Q of the number of
  sensitive queries (Proposition 1: m_Q <= m̂_Q); :func:`m_q_exact` is eq. (3)
  by brute force for small query sets (tests).
* :func:`median_perturbation` -- eq. (2): median + Laplace(m_Q/eps).
* :func:`cell_perturbation` -- eqs. (4)-(5): Laplace(d/eps) on the relevant
  cells once, then medians.
* :class:`UseAndForget` -- Algorithm 3: fresh noise per use of a cell with the
  geometric budget schedule eps'_k = (eps/d)(1-eta)eta^U(i,j).
* :class:`UseAndKeep` -- Algorithm 4: Laplace(d/eps) added to a cell each time
  it is used and *kept* in the cell.
* :func:`theorem5_bound` / :func:`theorem5_error` -- Theorem 5.
* :func:`simulate_use_and_keep` -- a vectorised replay of Algorithm 4 for
  the reproduction (exactly the same output distribution; see its docstring).

Noise. The paper's continuous Laplace(b) is replaced by the discrete Laplace
with the same scale b (pmf ∝ exp(-|x|/b)): for integer counts with L1
sensitivity Delta, scale Delta/eps gives eps-DP exactly as the continuous
one does (the geometric mechanism), so every privacy statement carries over
unchanged. Scales are exact rationals (eps and eta as Fractions).

Privacy gaps (docs/ARCHITECTURE.md "Release modes"). Algorithms 1-3 keep the exact sketch in memory:
an intrusion reveals it, so none of them is pan-private. Algorithm 4 keeps
noise only in cells that were used by a query; unused cells are exact, and an
intruder who compares the state with earlier answers learns the exact
increments since the last use -- noise "only at query time then kept" is not
pan-private. The paper's own remedy (§VII c: start C with Laplace(d/eps))
covers one intrusion *before* any release; our window/keep modes add fresh
output noise per release as well.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from itertools import product
from typing import Any

import numpy as np

from pansketch.agent import hashing
from pansketch.agent.sketch import Sketch

from .vnoise import ExactNoise, NoiseEngine


def _frac(x: float | Fraction | int | str) -> Fraction:
    if isinstance(x, float):
        return Fraction(str(x))
    return Fraction(x)


def _median(vals: list[int] | list[float]) -> float:
    v = sorted(vals)
    n = len(v)
    return float(v[n // 2]) if n & 1 else (v[n // 2 - 1] + v[n // 2]) / 2


class DynamicCountSketch:
    """Algorithm 1: Count Sketch as a dynamic system (no privacy).

    ``update(x)`` handles an arrival; ``query(Q)`` returns the median
    estimates. The cells are an :class:`pansketch.agent.sketch.Sketch` (kind 'cs').
    """

    def __init__(self, d: int, w: int, salt: str | bytes) -> None:
        self.sketch = Sketch("cs", d, w, hashing.salt_prefix(salt))
        self.d, self.w = d, w

    def update(self, x: Any, weight: int = 1) -> None:
        self.sketch.update(x, weight)

    def cells(self, x: Any) -> list[tuple[int, int, int]]:
        """[(row, column, sign)] of item x."""
        return [(i, c, s) for i, (c, s) in enumerate(hashing.columns(self.sketch.prefix, x, self.d, self.w))]

    def query(self, Q: Sequence[Any]) -> list[float]:
        return [float(self.sketch.estimate(x)) for x in Q]


def m_hat_q(cols: np.ndarray, w: int) -> int:
    """Algorithm 2: m̂_Q = sum over rows of the largest column load of Q.

    ``cols`` is the (n_Q, d) column matrix of the query items.
    """
    cols = np.asarray(cols)
    if cols.size == 0:
        return 0
    return int(sum(np.bincount(cols[:, i], minlength=w).max() for i in range(cols.shape[1])))


def m_q_exact(cols: np.ndarray) -> int:
    """Eq. (3) by brute force over the columns used by Q (small Q only)."""
    cols = np.asarray(cols)
    n, d = cols.shape
    cand = [sorted(set(cols[:, i].tolist())) for i in range(d)]
    best = 0
    for js in product(*cand):
        hit = np.zeros(n, dtype=bool)
        for i, j in enumerate(js):
            hit |= cols[:, i] == j
        best = max(best, int(hit.sum()))
    return best


def median_perturbation(dcs: DynamicCountSketch, Q: Sequence[Any], eps: float | Fraction,
                        noise: NoiseEngine | None = None, m_q: int | None = None) -> list[float]:
    """Eq. (2): f_hat_x + Laplace(m_Q/eps) per x in Q (m_Q from Algorithm 2 by default).

    eps-DP for this one query set (composition over the m_Q sensitive answers).
    """
    eng = noise if noise is not None else ExactNoise()
    if m_q is None:
        cols = np.array([[c for (_, c, _) in dcs.cells(x)] for x in Q]).reshape(len(Q), dcs.d)
        m_q = m_hat_q(cols, dcs.w)
    m_q = max(1, min(m_q, len(Q)))
    z = eng.dlap(Fraction(m_q) / _frac(eps), len(Q))
    return [e + float(v) for e, v in zip(dcs.query(Q), z)]


def cell_perturbation(dcs: DynamicCountSketch, Q: Sequence[Any], eps: float | Fraction,
                      noise: NoiseEngine | None = None) -> list[float]:
    """Eqs. (4)-(5): Laplace(d/eps) once on every cell some x in Q reads; medians.

    eps-DP for the query set (d sensitive cells at eps/d each); the noisy
    copy is discarded afterwards (the exact sketch is kept, as in §III-B2).
    """
    eng = noise if noise is not None else ExactNoise()
    scale = Fraction(dcs.d) / _frac(eps)
    noisy: dict[tuple[int, int], int] = {}
    a = dcs.sketch.counters
    out = []
    for x in Q:
        vals = []
        for i, c, s in dcs.cells(x):
            if (i, c) not in noisy:
                noisy[(i, c)] = a[i * dcs.w + c] + int(eng.dlap(scale, 1)[0])
            vals.append(s * noisy[(i, c)])
        out.append(_median(vals))
    return out


class UseAndForget(DynamicCountSketch):
    """Algorithm 3: use-and-forget with the geometric budget schedule.

    The k-th use (k = U(i,j), 0-based) of a cell adds fresh Laplace(1/eps'),
    eps' = (eps/d)(1-eta)eta^k, to a *copy*; the exact sketch is kept.
    sum_k eps' = eps/d per cell, so the whole run is eps-DP. The scale grows
    geometrically: after a few dozen uses a cell's answers are pure noise.
    """

    def __init__(self, d: int, w: int, salt: str | bytes, eps: float | Fraction, eta: float | Fraction = Fraction(1, 2),
                 noise: NoiseEngine | None = None) -> None:
        super().__init__(d, w, salt)
        self.eps = _frac(eps)
        self.eta = _frac(eta)
        if not (0 < self.eta < 1):
            raise ValueError("eta must be in (0, 1)")
        self.uses = [0] * (d * w)
        self.noise = noise if noise is not None else ExactNoise()

    def scale(self, uses: int) -> Fraction:
        """1/eps' for a cell used ``uses`` times before."""
        return Fraction(self.d) / (self.eps * (1 - self.eta) * self.eta**uses)

    def query(self, Q: Sequence[Any]) -> list[float]:
        a = self.sketch.counters
        noisy: dict[int, int] = {}
        out = []
        for x in Q:
            vals = []
            for i, c, s in self.cells(x):
                k = i * self.w + c
                if k not in noisy:
                    noisy[k] = a[k] + int(self.noise.dlap(self.scale(self.uses[k]), 1)[0])
                    self.uses[k] += 1
                vals.append(s * noisy[k])
            out.append(_median(vals))
        return out


class UseAndKeep(DynamicCountSketch):
    """Algorithm 4: use-and-keep. A cell used by a query set gets fresh
    Laplace(d/eps) *added to the cell itself*, once per query set; the noise
    stays and later arrivals keep counting on top (Lemma 1, Theorem 4: eps-DP).
    Not pan-private (see the module docstring)."""

    def __init__(self, d: int, w: int, salt: str | bytes, eps: float | Fraction,
                 noise: NoiseEngine | None = None) -> None:
        super().__init__(d, w, salt)
        self.eps = _frac(eps)
        self.noise = noise if noise is not None else ExactNoise()
        self.uses = [0] * (d * w)

    def query(self, Q: Sequence[Any]) -> list[float]:
        a = self.sketch.counters
        scale = Fraction(self.d) / self.eps
        used: set[int] = set()
        out = []
        for x in Q:
            vals = []
            for i, c, s in self.cells(x):
                k = i * self.w + c
                if k not in used:
                    a[k] = a[k] + int(self.noise.dlap(scale, 1)[0])
                    used.add(k)
                    self.uses[k] += 1
                vals.append(s * a[k])
            out.append(_median(vals))
        return out


def theorem5_bound(kappa: float, d: int, w: int, eps: float, f2: float, us: Sequence[int],
                   laplace_var_factor: float = 1.0) -> float:
    """Theorem 5: P(|f_hat_x - f_x| > kappa) <= e^{-d/2 (1-2λ)} [2(1-λ)]^{d/2},
    λ = ||f||²/(κ² w) + d/(κ² ε²) Σ u_i, valid for κ² > 2 max_i(||f||²/w + d² u_i/ε²).

    Returns 1.0 where the theorem gives no bound. The appendix bounds the
    variance of Laplace(d/ε) by d²/ε²; its true variance is 2d²/ε², which
    ``laplace_var_factor=2`` puts in (the corrected bound).
    """
    us = list(us)
    noise_var = laplace_var_factor * d * d / (eps * eps)
    if kappa * kappa <= 2 * max(f2 / w + noise_var * u for u in us):
        return 1.0
    lam = f2 / (kappa * kappa * w) + laplace_var_factor * d / (kappa * kappa * eps * eps) * sum(us)
    if lam >= 0.5:
        return 1.0
    return min(1.0, math.exp(-d / 2 * (1 - 2 * lam)) * (2 * (1 - lam)) ** (d / 2))


def theorem5_error(prob: float, d: int, w: int, eps: float, f2: float, us: Sequence[int],
                   laplace_var_factor: float = 1.0) -> float:
    """Smallest κ (bisection) with theorem5_bound(κ) <= prob (inf if none)."""
    lo, hi = 0.0, 1.0
    while theorem5_bound(hi, d, w, eps, f2, us, laplace_var_factor) > prob:
        hi *= 2
        if hi > 1e18:
            return math.inf
    for _ in range(100):
        mid = (lo + hi) / 2
        if theorem5_bound(mid, d, w, eps, f2, us, laplace_var_factor) <= prob:
            hi = mid
        else:
            lo = mid
    return hi


def simulate_use_and_keep(item_cols: np.ndarray, item_signs: np.ndarray, inv: np.ndarray, w: int, d: int,
                          q_times: np.ndarray, q_items: np.ndarray, q_k: np.ndarray, eps: Fraction,
                          noise: NoiseEngine) -> np.ndarray:
    """Vectorised replay of Algorithm 4; returns the answer to every query.

    Stream: event t (0-based) is item ``inv[t]`` whose row-i column/sign are
    ``item_cols[inv[t], i]`` / ``item_signs[...]``. Query set k is answered
    after the first ``q_times[k]`` events; query number m asks item
    ``q_items[m]`` in set ``q_k[m]``.

    Same output distribution as running :class:`UseAndKeep` event by event:
    a cell's value at query set k is (exact count of the events before
    q_times[k]) + (sum of the Laplace(d/eps) draws it received at every set
    k' <= k that used it) -- Algorithm 4 adds noise once per set and per used
    cell, and arrivals only add exact increments, so the two orders commute.
    """
    n = inv.shape[0]
    K = q_times.shape[0]
    scale = Fraction(d) / eps
    rows = np.empty((q_items.shape[0], d), dtype=np.float64)
    for i in range(d):
        c = item_cols[inv, i].astype(np.int64)
        s = item_signs[inv, i].astype(np.int64)
        order = np.argsort(c, kind="stable")
        keys = c[order] * n + order
        csum = np.concatenate(([0], np.cumsum(s[order])))
        j = item_cols[q_items, i].astype(np.int64)
        t = q_times[q_k].astype(np.int64)
        pos = np.searchsorted(keys, j * n + t, side="left")
        start = np.searchsorted(keys, j * n, side="left")
        val = csum[pos] - csum[start]
        # noise: one draw per (set k, used cell j) in this row, accumulated per cell over k
        used = np.unique(q_k.astype(np.int64) * w + j)
        uk, uj = used // w, used % w
        key2 = uj * K + uk
        o2 = np.argsort(key2, kind="stable")
        key2s = key2[o2]
        z = noise.dlap(scale, key2s.shape[0]).astype(np.int64)
        cz = np.cumsum(z)
        cell = key2s // K
        first = np.concatenate(([True], cell[1:] != cell[:-1]))
        base = np.maximum.accumulate(np.where(first, np.arange(cell.shape[0]), 0))
        acc = cz - np.concatenate(([0], cz))[base]
        idx = np.searchsorted(key2s, j * K + q_k.astype(np.int64))
        rows[:, i] = item_signs[q_items, i] * (val + acc[idx])
    return np.median(rows, axis=1)
