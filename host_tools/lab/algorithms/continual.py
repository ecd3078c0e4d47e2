"""Differentially private sketches under continual observation.

Paper: lazy-sketch-continual-observation.txt (Holland).

* :class:`GaussBM` -- Algorithm 1, the Gaussian binary mechanism.
* :class:`PrivateCounters` -- Algorithm 2, n counters with GaussBM.
* :class:`PunctualSketch` -- Algorithm 3 (Epasto et al.): every one of the
  d*w counters gets an update (0 or ±1) at every arrival.
* :class:`LazySketch` -- Algorithm 5: exact per-interval counts P, one column
  pushed to the GaussBM outputs O per arrival (round robin).
* :meth:`PunctualSketch.query` / :meth:`LazySketch.query` -- Algorithm 4 (CO
  query: min for CMS, median for CS over the counters' noisy sums).
* :func:`lemma4_bound`, :func:`lemma5_gamma`, :func:`lemma5_bounds`.
* :func:`punctual_final` / :func:`lazy_final` -- the exact distribution of the
  released counters at the end of a stream, drawn without replaying every
  step (used for the accuracy figures; the per-event classes are used for
  timing and are tested against these in the noiseless case).

Hashing is hash version 1 (:mod:`pansketch.agent.hashing`): the d columns and signs of
an item come from one SHA-256 stream, exactly as on the device.

Noise. Algorithm 1 draws continuous N(0, sigma^2) with
sigma = eps^-1 sqrt(2 h m ln(1.25/delta)) (classic Gaussian mechanism,
Lemma 1, only valid for eps < 1). We draw the exact discrete Gaussian
N_Z(0, sigma^2) with sigma^2 from :func:`gaussbm_sigma2`: the *larger* of the
paper's sigma^2 and the sigma^2 that makes the tree release
rho-zCDP (Canonne-Kamath-Steinke 2020 Thm 14, Delta2^2 = h*m) for the rho
whose Bun-Steinke conversion rho + 2 sqrt(rho ln(1/delta)) equals eps. So the
(eps, delta) guarantee holds rigorously for every eps (no eps < 1 caveat) and
the noise is never smaller than the paper's.

Not pan-private: GaussBM keeps the *exact* count of every tree node next to
its noise, and LazySketch keeps the exact array P; an intruder reads both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any, Callable

import numpy as np

from pansketch.agent import hashing

from .vnoise import BulkNoise, NoiseEngine, Pool, ceil_fraction


def tree_height(T: int) -> int:
    """h = ceil(log2(T + 1)) (Algorithm 1 line 4)."""
    return max(1, math.ceil(math.log2(T + 1)))


def gaussbm_sigma2_paper(T: int, eps: float, delta: float, m: int) -> float:
    """The paper's sigma^2 = 2 h m ln(1.25/delta) / eps^2 (Algorithm 1 line 5)."""
    return 2 * tree_height(T) * m * math.log(1.25 / delta) / (eps * eps)


def rho_for(eps: float, delta: float) -> float:
    """The rho with rho + 2 sqrt(rho ln(1/delta)) = eps (Bun & Steinke 2016 Prop. 1.3)."""
    L = math.log(1 / delta)
    return (math.sqrt(L + eps) - math.sqrt(L)) ** 2


def gaussbm_sigma2(T: int, eps: float, delta: float, m: int) -> Fraction:
    """Discrete Gaussian sigma^2 for GaussBM(T, eps, delta, m): max(paper, zCDP), rounded up."""
    z = tree_height(T) * m / (2 * rho_for(eps, delta))
    return ceil_fraction(max(gaussbm_sigma2_paper(T, eps, delta, m), z))


class GaussBM:
    """Algorithm 1: binary mechanism with (discrete) Gaussian node noise.

    ``draw`` returns one noise value per call. ``update(c)`` appends leaf
    (c, noise) and merges the two last nodes while bit l of the (0-based)
    update index is set, giving every merged node fresh noise; ``query()``
    sums the nodes' counts and noises: popcount(t) <= floor(log2 t) + 1 nodes.
    """

    __slots__ = ("counts", "noises", "t", "draw")

    def __init__(self, draw: Callable[[], int]) -> None:
        self.counts: list[int] = []
        self.noises: list[int] = []
        self.t = 0
        self.draw = draw

    def update(self, c: int) -> None:
        t = self.t
        counts, noises = self.counts, self.noises
        counts.append(c)
        noises.append(self.draw())
        lvl = 0
        while len(counts) > 1 and t & (1 << lvl):
            cr = counts.pop()
            noises.pop()
            cl = counts.pop()
            noises.pop()
            counts.append(cl + cr)
            noises.append(self.draw())
            lvl += 1
        self.t = t + 1

    def query(self) -> int:
        return sum(self.counts) + sum(self.noises)

    def exact(self) -> int:
        return sum(self.counts)

    def nodes(self) -> int:
        return len(self.counts)


class PrivateCounters:
    """Algorithm 2: n GaussBM counters; (eps, delta)-DP for m-neighbouring inputs (Thm 1)."""

    def __init__(self, n: int, T: int, eps: float, delta: float, m: int, noise: NoiseEngine | None = None) -> None:
        self.var = gaussbm_sigma2(T, eps, delta, m)
        self.pool = Pool(noise if noise is not None else BulkNoise(), "dgauss", self.var)
        self.counters = [GaussBM(self.pool.draw) for _ in range(n)]

    def update(self, v: Sequence[int]) -> None:
        for o, c in zip(self.counters, v):
            o.update(c)

    def query(self) -> list[int]:
        return [o.query() for o in self.counters]


def _cells(prefix: bytes, x: Any, d: int, w: int) -> list[tuple[int, int]]:
    s = hashing.digest(prefix, x, d)
    return [(hashing.row_value(s, i) % w, hashing.row_sign(s, i)) for i in range(d)]


def _combine(vals: list[int], kind: str) -> float:
    if kind == "cms":
        return float(min(vals))
    v = sorted(vals)
    n = len(v)
    return float(v[n // 2]) if n & 1 else (v[n // 2 - 1] + v[n // 2]) / 2


class _COSketch:
    def __init__(self, kind: str, d: int, w: int, salt: str | bytes) -> None:
        if kind not in ("cms", "cs"):
            raise ValueError("kind must be 'cms' or 'cs'")
        self.kind, self.d, self.w = kind, d, w
        self.prefix = hashing.salt_prefix(salt)
        self.O: list[list[GaussBM]] = []

    def query(self, x: Any) -> float:
        """Algorithm 4 (CO sketch query)."""
        vals = []
        for i, (c, s) in enumerate(_cells(self.prefix, x, self.d, self.w)):
            v = self.O[i][c].query()
            vals.append(s * v if self.kind == "cs" else v)
        return _combine(vals, self.kind)

    def released(self) -> np.ndarray:
        """The current output array (d, w): every counter's noisy sum."""
        return np.array([[o.query() for o in row] for row in self.O], dtype=np.int64)


class PunctualSketch(_COSketch):
    """Algorithm 3: every counter O[i][j] is a GaussBM(T, eps, delta, 2d) and gets an
    update at every arrival (±1/1 at the item's cell, 0 elsewhere). O(d*w) per update."""

    def __init__(self, kind: str, d: int, w: int, salt: str | bytes, T: int, eps: float, delta: float,
                 noise: NoiseEngine | None = None, pool: Pool | None = None) -> None:
        super().__init__(kind, d, w, salt)
        self.var = gaussbm_sigma2(T, eps, delta, 2 * d)
        self.pool = pool if pool is not None else Pool(noise if noise is not None else BulkNoise(), "dgauss", self.var)
        draw = self.pool.draw
        self.O = [[GaussBM(draw) for _ in range(w)] for _ in range(d)]

    def update(self, x: Any) -> None:
        cs = self.kind == "cs"
        for i, (h, s) in enumerate(_cells(self.prefix, x, self.d, self.w)):
            c = s if cs else 1
            row = self.O[i]
            for j in range(self.w):
                row[j].update(c if j == h else 0)


class LazySketch(_COSketch):
    """Algorithm 5: exact interval counts P (d x w) and GaussBM(T/w, eps, delta, 2d)
    outputs O; each arrival updates P and pushes column pos = t mod w to O."""

    def __init__(self, kind: str, d: int, w: int, salt: str | bytes, T: int, eps: float, delta: float,
                 noise: NoiseEngine | None = None, pool: Pool | None = None) -> None:
        super().__init__(kind, d, w, salt)
        self.var = gaussbm_sigma2(math.ceil(T / w), eps, delta, 2 * d)
        self.pool = pool if pool is not None else Pool(noise if noise is not None else BulkNoise(), "dgauss", self.var)
        draw = self.pool.draw
        self.O = [[GaussBM(draw) for _ in range(w)] for _ in range(d)]
        self.P = [[0] * w for _ in range(d)]
        self.pos = 0

    def update(self, x: Any) -> None:
        cs = self.kind == "cs"
        pos = self.pos
        for i, (h, s) in enumerate(_cells(self.prefix, x, self.d, self.w)):
            P = self.P[i]
            P[h] += s if cs else 1
            self.O[i][pos].update(P[pos])
            P[pos] = 0
        self.pos = pos + 1 if pos + 1 < self.w else 0


# -- bounds ---------------------------------------------------------------------

def lemma4_bound(T: int, n: int, eps: float, delta: float, m: int, beta: float, n_times: int) -> float:
    """Lemma 4: max additive error of n GaussBM counters at |I| = n_times steps, w.p. 1-beta."""
    return (math.log2(T) + 1) / eps * math.sqrt(2 * m * math.log(1.25 / delta) * math.log(2 * n_times * n / beta))


def lemma5_gamma(T: int, w: int, d: int, eps: float, delta: float, beta: float) -> float:
    """Lemma 5 noise term gamma = 3 log(T/w)/eps * sqrt(d ln(2Td/beta) ln(1.25/delta))."""
    return 3 * math.log2(T / w) / eps * math.sqrt(d * math.log(2 * T * d / beta) * math.log(1.25 / delta))


def lemma5_bounds(kind: str, T: int, w: int, d: int, eps: float, delta: float, beta: float, f1: float,
                  f2: float) -> tuple[float, float]:
    """Lemma 5: (lower, upper) of f_hat - f for LazyCMS: [-gamma - w, eta*t + gamma] with
    eta = 2/w; for LazyCS: ±(sqrt(3 F2 / w) + gamma + w)."""
    g = lemma5_gamma(T, w, d, eps, delta, beta)
    if kind == "cms":
        return (-g - w, 2.0 / w * f1 + g)
    b = math.sqrt(3 * f2 / w) + g + w
    return (-b, b)


# -- exact end-of-stream distributions (vectorised) -------------------------------

def _popcount(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.int64)
    c = np.zeros_like(x)
    while np.any(x):
        c += x & 1
        x = x >> 1
    return c


def punctual_final(cols: np.ndarray, signs: np.ndarray, kind: str, w: int, var: Fraction,
                   noise: NoiseEngine) -> np.ndarray:
    """Released array (d, w) of a PunctualSketch after the stream with per-event
    columns ``cols`` (T, d) / ``signs``: exact counts + popcount(T) node noises per cell."""
    T, d = cols.shape
    out = np.zeros((d, w), dtype=np.int64)
    for i in range(d):
        wt = signs[:, i].astype(np.int64) if kind == "cs" else np.ones(T, dtype=np.int64)
        out[i] = np.bincount(cols[:, i], weights=wt, minlength=w).astype(np.int64)
    k = int(_popcount(np.array([T]))[0])
    z = noise.dgauss(var, d * w * k).reshape(k, d, w).sum(axis=0) if k else 0
    return out + z


def lazy_final(cols: np.ndarray, signs: np.ndarray, kind: str, w: int, var: Fraction,
               noise: NoiseEngine) -> tuple[np.ndarray, np.ndarray]:
    """(released O (d, w), exact P residue (d, w)) of a LazySketch after T events.

    Column j is pushed after events t = j, j+w, ... <= T-1 (k_j pushes); O[i][j]
    holds the events up to its last push plus popcount(k_j) node noises.
    """
    T, d = cols.shape
    j = np.arange(w)
    k = np.where(j <= T - 1, (T - 1 - j) // w + 1, 0)
    last = j + (k - 1) * w  # last push time per column (-w if never)
    t = np.arange(T)
    O = np.zeros((d, w), dtype=np.int64)
    P = np.zeros((d, w), dtype=np.int64)
    for i in range(d):
        wt = signs[:, i].astype(np.int64) if kind == "cs" else np.ones(T, dtype=np.int64)
        pushed = t <= last[cols[:, i]]
        O[i] = np.bincount(cols[pushed, i], weights=wt[pushed], minlength=w).astype(np.int64)
        P[i] = np.bincount(cols[~pushed, i], weights=wt[~pushed], minlength=w).astype(np.int64)
    pc = _popcount(k)
    kmax = int(pc.max()) if pc.size else 0
    if kmax:
        z = noise.dgauss(var, kmax * d * w).reshape(kmax, d, w)
        mask = (np.arange(kmax)[:, None] < pc[None, :])  # (kmax, w)
        O = O + (z * mask[:, None, :]).sum(axis=0)
    return O, P


def co_estimates(O: np.ndarray, cols: np.ndarray, signs: np.ndarray, kind: str) -> np.ndarray:
    """Algorithm 4 on a released array for items with columns/signs (n, d)."""
    d = O.shape[0]
    v = O[np.arange(d)[None, :], cols]
    if kind == "cs":
        return np.median(v * signs, axis=1)
    return v.min(axis=1).astype(np.float64)
