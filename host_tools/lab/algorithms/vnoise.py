"""Vectorised exact discrete Laplace / Gaussian samplers (numpy, integers only).

The same algorithms as :mod:`pansketch.agent.noise` (Canonne, Kamath & Steinke 2020,
Algorithms 1-3) run on whole numpy arrays at once: every comparison is an
integer comparison of uniform integers drawn with ``Generator.integers``
(exact rejection sampling, no modulo bias), so the output pmf is *exactly*
the discrete Laplace / discrete Gaussian pmf -- no floating point touches a
sample. ``tests/test_algorithms_noise.py`` checks the empirical pmf against
the exact one.

What differs from the device path is only the byte source: numpy's PCG64
is *not* a cryptographic generator. These samplers are therefore for
reproductions and simulations (where we need millions of draws in
seconds), never for a release that claims privacy; the device and anything
that publishes uses :mod:`pansketch.agent.noise` with ``os.urandom``.

Engines (all return ``np.ndarray[int64]``):

* :class:`BulkNoise` -- this module's vectorised sampler (seeded PCG64).
* :class:`ExactNoise` -- :mod:`pansketch.agent.noise` one draw at a time from an
  :class:`pansketch.agent.rng.Rng` (the privacy path; ~10-30 µs per draw).
* :class:`ZeroNoise` -- all zeros, for tests of the noiseless logic.

Parameters are exact rationals (:class:`fractions.Fraction`): ``dgauss(var)``
takes sigma^2, ``dlap(scale)`` takes the scale t (pmf ∝ exp(-|x|/t)).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Protocol

import numpy as np

from pansketch.agent import noise as agent_noise
from pansketch.agent.rng import Rng

_LIMIT = 1 << 62


def _check(a: np.ndarray) -> None:
    if a.size and int(np.max(np.abs(a))) >= _LIMIT:
        raise OverflowError("vectorised sampler parameters exceed int64 range; use pansketch.agent.noise")


def bernoulli_exp(gen: np.random.Generator, num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """Bool array: element i is True with probability exp(-num[i]/den[i]) (CKS Alg. 1)."""
    num = np.asarray(num, dtype=np.int64)
    den = np.asarray(den, dtype=np.int64)
    num, den = np.broadcast_arrays(num, den)
    num = num.copy()
    den = den.copy()
    if np.any(num < 0) or np.any(den <= 0):
        raise ValueError("bernoulli_exp needs num >= 0 and den > 0")
    n = num.shape[0]
    alive = np.ones(n, dtype=bool)
    whole = num // den
    frac = num - whole * den
    # exp(-gamma) = exp(-1)^floor(gamma) * exp(-frac(gamma))
    mw = int(whole.max()) if n else 0
    for r in range(mw):
        idx = np.nonzero(alive & (whole > r))[0]
        if not idx.size:
            break
        ok = _bexp_le1(gen, np.ones(idx.size, dtype=np.int64), np.ones(idx.size, dtype=np.int64))
        alive[idx[~ok]] = False
    idx = np.nonzero(alive)[0]
    if idx.size:
        ok = _bexp_le1(gen, frac[idx], den[idx])
        alive[idx[~ok]] = False
    return alive


def _bexp_le1(gen: np.random.Generator, num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """exp(-num/den) for num <= den: draw A_k ~ Bernoulli(gamma/k) until one fails; K odd."""
    n = num.shape[0]
    res = np.zeros(n, dtype=bool)
    idx = np.arange(n)
    k = 1
    while idx.size:
        dk = den[idx] * k
        _check(dk)
        a = gen.integers(0, dk) < num[idx]
        done = ~a
        res[idx[done]] = (k & 1) == 1
        idx = idx[a]
        k += 1
    return res


def discrete_laplace(gen: np.random.Generator, scale: Fraction | int, size: int) -> np.ndarray:
    """``size`` draws of the discrete Laplace with scale t (CKS Alg. 2), int64."""
    scale = Fraction(scale)
    t, s = scale.numerator, scale.denominator
    if t <= 0:
        raise ValueError("discrete_laplace needs a positive scale")
    if t >= _LIMIT or s >= _LIMIT:
        raise OverflowError("scale too large for the vectorised sampler")
    out = np.empty(size, dtype=np.int64)
    filled = 0
    while filled < size:
        m = max(16, int((size - filled) * 1.3) + 8)
        u = gen.integers(0, t, size=m, dtype=np.int64)
        ok = bernoulli_exp(gen, u, np.full(m, t, dtype=np.int64))
        u = u[ok]
        m = u.size
        if not m:
            continue
        v = np.zeros(m, dtype=np.int64)
        act = np.arange(m)
        while act.size:
            b = bernoulli_exp(gen, np.ones(act.size, dtype=np.int64), np.ones(act.size, dtype=np.int64))
            v[act[b]] += 1
            act = act[b]
        x = u + t * v
        y = x // s
        neg = gen.integers(0, 2, size=m).astype(bool)
        keep = ~(neg & (y == 0))
        y = np.where(neg, -y, y)[keep]
        take = min(y.size, size - filled)
        out[filled:filled + take] = y[:take]
        filled += take
    return out


def discrete_gaussian(gen: np.random.Generator, var: Fraction | int, size: int) -> np.ndarray:
    """``size`` draws of N_Z(0, sigma^2) with sigma^2 = var (CKS Alg. 3), int64."""
    var = Fraction(var)
    n, d = var.numerator, var.denominator
    if n <= 0:
        raise ValueError("discrete_gaussian needs a positive variance")
    t = math.isqrt(n // d) + 1
    den = 2 * n * d * t * t
    if den >= _LIMIT:
        raise OverflowError("variance fraction too large for the vectorised sampler")
    out = np.empty(size, dtype=np.int64)
    filled = 0
    while filled < size:
        m = max(16, int((size - filled) * 1.6) + 8)
        y = discrete_laplace(gen, t, m)
        a = np.abs(y) * (d * t) - n
        num = a * a
        _check(num)
        ok = bernoulli_exp(gen, num, np.full(m, den, dtype=np.int64))
        y = y[ok]
        take = min(y.size, size - filled)
        out[filled:filled + take] = y[:take]
        filled += take
    return out


# -- exact pmfs (for tests and for tail computations; floats are fine here) --

def dgauss_pmf(var: float, support: np.ndarray) -> np.ndarray:
    """pmf of N_Z(0, var) on ``support`` (normalised over |x| <= 60 sigma)."""
    s = math.sqrt(var)
    k = int(60 * s) + 10
    xs = np.arange(-k, k + 1)
    w = np.exp(-(xs.astype(float) ** 2) / (2 * var))
    z = w.sum()
    return np.exp(-(support.astype(float) ** 2) / (2 * var)) / z


def dlap_pmf(scale: float, support: np.ndarray) -> np.ndarray:
    """pmf of the discrete Laplace with scale t: (1-e^{-1/t})/(1+e^{-1/t}) e^{-|x|/t}."""
    q = math.exp(-1.0 / scale)
    return (1 - q) / (1 + q) * np.exp(-np.abs(support.astype(float)) / scale)


def dgauss_lower_tail(var: float, e: float) -> float:
    """P[Z < -e] for Z ~ N_Z(0, var), computed exactly by summing the pmf."""
    s = math.sqrt(var)
    k = int(60 * s) + 10
    xs = np.arange(-k, k + 1)
    p = dgauss_pmf(var, xs)
    return float(p[xs < -e].sum())


# -- engines -----------------------------------------------------------------

class NoiseEngine(Protocol):
    def dgauss(self, var: Fraction, size: int) -> np.ndarray: ...
    def dlap(self, scale: Fraction, size: int) -> np.ndarray: ...


class BulkNoise:
    """Vectorised exact samplers on a seeded PCG64 stream (simulation only)."""

    def __init__(self, seed: int | None = None) -> None:
        self.gen = np.random.Generator(np.random.PCG64(seed))

    def dgauss(self, var: Fraction, size: int) -> np.ndarray:
        return discrete_gaussian(self.gen, var, size)

    def dlap(self, scale: Fraction, size: int) -> np.ndarray:
        return discrete_laplace(self.gen, scale, size)


class ExactNoise:
    """:mod:`pansketch.agent.noise` one draw at a time (the privacy path)."""

    def __init__(self, rng: Rng | None = None) -> None:
        self.rng = rng if rng is not None else Rng()

    def dgauss(self, var: Fraction, size: int) -> np.ndarray:
        var = Fraction(var)
        r = self.rng
        return np.array([agent_noise.discrete_gaussian(r, var.numerator, var.denominator) for _ in range(size)],
                        dtype=np.int64)

    def dlap(self, scale: Fraction, size: int) -> np.ndarray:
        scale = Fraction(scale)
        r = self.rng
        return np.array([agent_noise.discrete_laplace(r, scale.numerator, scale.denominator) for _ in range(size)],
                        dtype=np.int64)


class ZeroNoise:
    """No noise at all: for tests of the deterministic parts of an algorithm."""

    def dgauss(self, var: Fraction, size: int) -> np.ndarray:
        return np.zeros(size, dtype=np.int64)

    def dlap(self, scale: Fraction, size: int) -> np.ndarray:
        return np.zeros(size, dtype=np.int64)


class Pool:
    """Per-draw access to one distribution, refilled in bulk from an engine.

    Draws are i.i.d., so consuming a pre-drawn block in order is the same
    distribution as drawing one at a time; per-event algorithms
    (:mod:`.continual`) use this so their timing measures the algorithm, not
    numpy call overhead.
    """

    def __init__(self, engine: NoiseEngine, mech: str, param: Fraction, block: int = 8192) -> None:
        if mech not in ("dgauss", "dlap"):
            raise ValueError("mech must be 'dgauss' or 'dlap'")
        self.engine = engine
        self.mech = mech
        self.param = Fraction(param)
        self.block = block
        self._buf: list[int] = []
        self._pos = 0

    def _refill(self) -> None:
        f = self.engine.dgauss if self.mech == "dgauss" else self.engine.dlap
        self._buf = f(self.param, self.block).tolist()
        self._pos = 0

    def draw(self) -> int:
        if self._pos >= len(self._buf):
            self._refill()
        v = self._buf[self._pos]
        self._pos += 1
        return v

    def draws(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            if self._pos >= len(self._buf):
                self._refill()
            take = min(n - len(out), len(self._buf) - self._pos)
            out.extend(self._buf[self._pos:self._pos + take])
            self._pos += take
        return out


def ceil_fraction(x: float, den: int | None = None) -> Fraction:
    """Smallest k/den >= x: a rational *upper* bound for a float variance/scale
    (rounding noise parameters up never weakens a privacy guarantee).

    By default den = 10^(6 - floor(log10 x)) (at least 1): about 7 significant
    digits, with a denominator small enough for the int64 samplers.
    """
    if x <= 0:
        raise ValueError("parameter must be positive")
    if den is None:
        den = 10 ** max(0, 6 - math.floor(math.log10(x)))
    return Fraction(math.ceil(x * den), den)
