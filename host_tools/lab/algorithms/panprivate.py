"""Pan-private cropped sums, heavy-hitter counts and the distinct-count estimator.

Paper: pan-private-sketches.txt (Mir, Muthukrishnan, Nikolov, Wright).

* :class:`CroppedSum` -- §4.1, the full-space cropped-sum estimator (the
  cropped-mean estimator of Dwork et al. 2010 over every element of U): a
  uniformly random counter c_j in {0..tau-1} and a bit b_j ~ D0 = Bern(1/2) per
  element; when c_j wraps to 0 the bit is redrawn from D1 = Bern(1/2 + eps/4);
  the estimate is (o - |U|/2) * 4 tau / eps with o = #{j: b_j = 1}. Per event,
  exact: :class:`pansketch.agent.rng.Rng` draws (integer rejection sampling), so the
  state (c, b) is pan-private against one intrusion exactly as in [4].
  :func:`lemma5_bound` is its error bound.
* :class:`HeavyHitterCount` -- §4.2: hash U to [h] (hash version 1, one row of
  width h), run two cropped sums with tau1 = F1/k and tau2 = F1/(c k), output
  (x1 - x2) / (F1/k - F1/(c k)). 2 eps-pan-private (Theorem 12);
  :func:`theorem12_bounds`.
* :func:`simulate_cropped_sum` -- the exact distribution of the final state
  of :class:`CroppedSum` for a vector of counts, drawn at once (numpy PCG64:
  simulation only).
* Distinct count (Algorithm 1): the sketch is :mod:`.distinct`;
  here are the host-side estimator :func:`distinct_estimate`, the scale
  :func:`distinct_scale` (median |X0|^p of the same integer projection,
  computed by simulation, the paper's sf(p)), the vectorised replay
  :func:`distinct_sketch_counts` and the Lemma 4 bound :func:`lemma4_xi`.

The pan-private state is what an intruder reads; a cropped-sum *release*
(the count o) is a deterministic function of the state, so releasing it more
than once, or after an intrusion, spends the budget again (the paper's
model has one output at the end; the product's modes release once per window).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from pansketch.agent import hashing
from pansketch.agent.pi import hashvec
from pansketch.agent.rng import Rng
from pansketch.host_tools import fasthash


def _eps_frac(eps: float | Fraction | str) -> Fraction:
    e = Fraction(str(eps)) if isinstance(eps, float) else Fraction(eps)
    if not (0 < e <= 2):
        raise ValueError("eps must be in (0, 2] (D1 = Bern(1/2 + eps/4) must be a probability)")
    return e


class CroppedSum:
    """§4.1 full-space cropped sum T_1(tau) = sum_j min(a_j, tau) over U = {0..m-1}."""

    def __init__(self, m: int, tau: int, eps: float | Fraction, rng: Rng | None = None) -> None:
        if m < 1 or tau < 1:
            raise ValueError("need m >= 1 and tau >= 1")
        self.m, self.tau = m, tau
        self.eps = _eps_frac(eps)
        self.rng = rng if rng is not None else Rng()
        r = self.rng
        self.c = [r.randbelow(tau) for _ in range(m)]
        self.b = [1 if r.bernoulli(1, 2) else 0 for _ in range(m)]
        # D1 = Bern(1/2 + eps/4) = Bern((2 den + num) / (4 den))
        self._d1 = (2 * self.eps.denominator + self.eps.numerator, 4 * self.eps.denominator)

    def update(self, j: int, weight: int = 1) -> None:
        """Add ``weight`` >= 0 occurrences of element j (cash-register model)."""
        if weight < 0:
            raise ValueError("the cropped-sum estimator needs non-negative updates")
        if not (0 <= j < self.m):
            raise ValueError("element outside the universe")
        if weight == 0:
            return
        c = self.c[j] + weight
        self.c[j] = c % self.tau
        if c >= self.tau:  # passed 0 at least once: redraw from D1 (later redraws are i.i.d.)
            self.b[j] = 1 if self.rng.bernoulli(*self._d1) else 0

    def ones(self) -> int:
        return sum(self.b)

    def estimate(self) -> float:
        return (self.ones() - self.m / 2) * 4 * self.tau / float(self.eps)


def lemma5_bound(alpha: float, tau: float, m: int, eps: float) -> tuple[float, float]:
    """Lemma 5: |T - T_hat| <= 4 alpha tau sqrt(m)/eps, failing w.p. <= 2 exp(-2 alpha^2)
    (Hoeffding; the paper prints 2 exp(-2 alpha)). Returns (bound, failure prob)."""
    return 4 * alpha * tau * math.sqrt(m) / eps, 2 * math.exp(-2 * alpha * alpha)


def simulate_cropped_sum(counts: np.ndarray, tau: int, eps: float | Fraction,
                         gen: np.random.Generator) -> tuple[int, float]:
    """(o, estimate) with the exact final-state distribution of :class:`CroppedSum`:
    c0 uniform; the bit is from D1 iff c0 + a_j >= tau (it wrapped), else from D0."""
    e = _eps_frac(eps)
    a = np.asarray(counts, dtype=np.int64)
    m = a.shape[0]
    c0 = gen.integers(0, tau, size=m)
    wrapped = c0 + a >= tau
    den = 4 * e.denominator
    p1 = 2 * e.denominator + e.numerator
    u = gen.integers(0, den, size=m)
    b = np.where(wrapped, u < p1, u < 2 * e.denominator)
    o = int(b.sum())
    return o, (o - m / 2) * 4 * tau / float(e)


class HeavyHitterCount:
    """§4.2: estimate HH(k) = #{i : a_i >= F1/k} over a hashed universe [h].

    F1 (the stream length, public in the paper's model) must be given in
    advance. Items are hashed with hash version 1 (one row, width h).
    """

    def __init__(self, h: int, k: float, c: float, f1: int, eps: float | Fraction, salt: str | bytes,
                 rng: Rng | None = None) -> None:
        if c <= 1:
            raise ValueError("c must be > 1")
        self.h, self.k, self.c, self.f1 = h, k, c, f1
        self.prefix = hashing.salt_prefix(salt)
        self.tau1 = max(1, int(round(f1 / k)))
        self.tau2 = max(1, int(round(f1 / (c * k))))
        if self.tau1 <= self.tau2:
            raise ValueError("F1/k and F1/(ck) round to the same crop; increase F1 or c")
        rng = rng if rng is not None else Rng()
        self.s1 = CroppedSum(h, self.tau1, eps, rng)
        self.s2 = CroppedSum(h, self.tau2, eps, rng)

    def bucket(self, item: Any) -> int:
        return hashing.row_value(hashing.digest(self.prefix, item, 1), 0) % self.h

    def update(self, item: Any, weight: int = 1) -> None:
        j = self.bucket(item)
        self.s1.update(j, weight)
        self.s2.update(j, weight)

    def estimate(self) -> float:
        return (self.s1.estimate() - self.s2.estimate()) / (self.tau1 - self.tau2)


def hh_count_simulated(bucket_counts: np.ndarray, k: float, c: float, f1: int, eps: float | Fraction,
                       gen: np.random.Generator) -> float:
    """Vectorised :class:`HeavyHitterCount` from the per-bucket counts N_j."""
    tau1 = max(1, int(round(f1 / k)))
    tau2 = max(1, int(round(f1 / (c * k))))
    _, x1 = simulate_cropped_sum(bucket_counts, tau1, eps, gen)
    _, x2 = simulate_cropped_sum(bucket_counts, tau2, eps, gen)
    return (x1 - x2) / (tau1 - tau2)


def theorem12_bounds(hh_k: int, hh_big: int, h: int, c: float, alpha: float, eps: float,
                     beta: float) -> tuple[float, float]:
    """Theorem 12: [(1-beta) HH(k) - 4(c+1) alpha sqrt(h)/((c-1) eps),
    HH(2c^2k^2/delta) + 4(c+1) alpha sqrt(h)/((c-1) eps)]; ``hh_big`` = HH(2c^2k^2/delta)."""
    add = 4 * (c + 1) * alpha * math.sqrt(h) / ((c - 1) * eps)
    return (1 - beta) * hh_k - add, hh_big + add


# -- distinct count (Algorithm 1, the sketch in distinct.py) ------------------

def projections(st: np.ndarray, r: int, q: int, vbits: int, frac_bits: int) -> list[list[int]]:
    """X_ij of pansketch.host_tools.lab.algorithms.distinct.DistinctSketch for hash streams ``st`` (Python ints)."""
    words = hashvec.row_words(st, r)
    v = (hashvec.row_values(words) >> (30 - vbits)).astype(np.int64)
    neg = hashvec.negative(words) != 0
    shift = vbits + frac_bits
    base = (1 << shift) // (v + 1)
    out = []
    for i in range(base.shape[0]):
        out.append([(-1 if neg[i, j] else 1) * int(base[i, j]) ** q for j in range(r)])
    return out


def distinct_sketch_counts(keys: Sequence[Any], vals: Iterable[int], r: int, salt: str | bytes, q: int = 16,
                           vbits: int = 16, frac_bits: int = 8) -> list[int]:
    """Noise-free sk (r Python ints) for distinct keys with aggregated weights."""
    st = fasthash.streams(list(keys), salt, r)
    X = projections(st, r, q, vbits, frac_bits)
    sk = [0] * r
    for row, a in zip(X, vals):
        a = int(a)
        if a:
            for j in range(r):
                sk[j] += a * row[j]
    return sk


def _pth(x: int, q: int) -> float:
    """|x|^(1/q) for a big integer without overflow."""
    x = abs(x)
    if x == 0:
        return 0.0
    bl = x.bit_length()
    if bl > 1000:
        sh = bl - 60
        return math.exp((math.log(x >> sh) + sh * math.log(2)) / q)
    return float(x) ** (1.0 / q)


def distinct_raw(sk: Sequence[int], q: int, frac_bits: int) -> float:
    """median_j |sk_j|^p / 2^F (p = 1/q)."""
    return float(np.median([_pth(v, q) for v in sk])) / (1 << frac_bits)


def distinct_scale(q: int = 16, vbits: int = 16, frac_bits: int = 8, n_items: int | None = None,
                   trials: int = 4000, seed: int = 0) -> float:
    """sf(p): median over j of |sum of n_items projections|^p / (n_items 2^F), by simulation
    of the same integer projection (the paper computes median |X0|^p numerically).

    ``n_items`` defaults to min(200, 2^vbits / 16): the calibration must stay in the range where
    the estimator scales (D well below 2^b); 200 items at b = 8 are already saturated and made sf
    too small, inflating every estimate (287 for D = 195 without noise)."""
    if n_items is None:
        n_items = max(4, min(200, (1 << vbits) // 16))
    gen = np.random.default_rng(seed)
    shift = vbits + frac_bits
    v = gen.integers(0, 1 << vbits, size=(trials, n_items))
    sgn = np.where(gen.integers(0, 2, size=(trials, n_items)) == 1, -1, 1)
    # |sum|^p computed in log space: values up to 2^(shift*q) overflow floats
    base = ((1 << shift) // (v + 1)).astype(np.float64)
    lg = q * np.log(base)
    mx = lg.max(axis=1, keepdims=True)
    ssum = (sgn * np.exp(lg - mx)).sum(axis=1)
    with np.errstate(divide="ignore"):
        val = np.exp((np.log(np.abs(ssum)) + mx[:, 0]) / q)
    return float(np.median(val)) / (n_items * (1 << frac_bits))


def distinct_estimate(sk: Sequence[int], scale: float, q: int = 16, frac_bits: int = 8) -> float:
    """D_hat = median_j |sk_j|^p / (2^F sf)."""
    return distinct_raw(sk, q, frac_bits) / scale


def lemma4_xi(bound_M: int, r: int, eps: float, delta: float, q: int, z: int = 1) -> float:
    """Lemma 2/4: xi = (2 Z max_j ||X_j||_inf / alpha * log(1/delta))^p, alpha = eps/r, p = 1/q
    (computed in log space: M has hundreds of bits)."""
    ln_m = math.log(bound_M >> max(0, bound_M.bit_length() - 60)) + max(0, bound_M.bit_length() - 60) * math.log(2)
    return math.exp((math.log(2 * z * r / eps * math.log(1 / delta)) + ln_m) / q)
