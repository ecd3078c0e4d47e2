"""Private Count-Min / CountSketch and the Private Dyadic CountSketch.

Paper: dp-linear-sketches.txt (Zhao et al.) and dp-linear-sketches-appendix.txt.

* Algorithm 3 (DP linear sketch initialisation): every counter starts with
  independent noise of variance sigma^2 = log(2/beta)/rho; Count-Min also gets
  the offset E. Updates and queries are Algorithms 1-2, i.e. exactly
  :class:`pansketch.agent.sketch.Sketch` (same hash version 1, same int32 layout).
* Theorem 3.1 (Count-Min: 0 <= f_hat - f_tilde <= 2E w.p. 1-beta) and
  Theorem 3.2 (CountSketch: |f_hat - f_tilde| <= E) as functions.
* §4 / Appendix B (Algorithms 4-5): Private Dyadic CountSketch over the
  integer universe [0, 2^L) with rank, quantile and range-count queries.

Noise. The paper draws continuous Gaussians; here every counter gets the
exact *discrete* Gaussian N_Z(0, sigma^2) (pansketch.agent.noise or its vectorised twin
:mod:`.vnoise`). Canonne-Kamath-Steinke 2020 Thm 14: adding N_Z(0, sigma^2) to
each of the d*w integer counters is Delta2^2/(2 sigma^2)-zCDP -- the same
formula as Lemma 2.8 for the continuous Gaussian, so with sigma^2 computed as
below the privacy loss is the paper's rho (or smaller, since sigma^2 is
rounded *up* to a rational). The paper uses replace-one neighbours
(Delta2^2 = 2d: two cells per row move by 1); the product uses add/remove
(Delta2^2 = d). :func:`sigma2_for` gives both; the reproductions use the
paper's replace-one calibration, which is the stricter of the two.

Count-Min offset. The paper adds E to every counter at initialisation. Since
E is public and data-independent, adding it at query time gives identical
estimates (post-processing); we keep the counters zero-mean (so the same
release merges with others) and add the offset in :meth:`estimate`.
:func:`paper_E` is the paper's formula, :func:`notebook_E` is the formula in
the authors' public CountMin.py (1/beta outside the logarithm), and
:func:`union_E` is the tighter offset a union bound over the d*w actual noise
draws gives, with the exact discrete Gaussian tail.

Not pan-private: Algorithm 3 puts noise in once at initialisation. An intruder
who reads the counters after a release sees (noise + A + B), the release
showed (noise + A): the difference is the exact sketch of the events B in
between. The product's window/keep modes add the missing output noise.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from pansketch.agent import hashing
from pansketch.agent.sketch import INT32_MAX, INT32_MIN, Sketch
from pansketch.host_tools import fasthash

from .vnoise import BulkNoise, NoiseEngine, dgauss_lower_tail

# --------------------------------------------------------------------------
# Theorem 3.1 / 3.2 quantities (natural logarithms, as in the authors' code)


def paper_rows(beta: float) -> int:
    """Rows of Algorithm 3: log(2/beta) (rounded up)."""
    return math.ceil(math.log(2.0 / beta))


def paper_cols(gamma: float) -> int:
    """Columns of Algorithm 3: 1/gamma (rounded up)."""
    return math.ceil(1.0 / gamma)


def paper_sigma2(beta: float, rho: float) -> float:
    """sigma^2 = log(2/beta)/rho (Algorithm 3 line 3)."""
    return math.log(2.0 / beta) / rho


def paper_E(gamma: float, beta: float, rho: float) -> float:
    """E(beta, gamma, rho) = sqrt(2 log(2/b)/rho) * sqrt(log((4/g) log(2/b) / b)) (Alg. 3 l.4)."""
    lb = math.log(2.0 / beta)
    return math.sqrt(2.0 * lb / rho) * math.sqrt(math.log((4.0 / gamma) * lb / beta))


def notebook_E(gamma: float, beta: float, rho: float) -> float:
    """The offset of the authors' public CountMin.py: 1/beta *outside* the log.

    ``sqrt(2 log(2/b)/rho) * sqrt(log(log(2/b) * 4/g) / b)`` -- larger than
    :func:`paper_E` by about sqrt(1/beta) for small beta.
    """
    lb = math.log(2.0 / beta)
    return math.sqrt(2.0 * lb / rho) * math.sqrt(math.log(lb * 4.0 / gamma) / beta)


def union_E(d: int, w: int, var: float, beta: float) -> int:
    """Smallest integer E with d*w*P[Z < -E] <= beta/2 for Z ~ N_Z(0, var).

    This is exactly what the proof of Theorem 3.1 needs for no
    under-estimation (all d*w draws >= -E with probability 1 - beta/2),
    computed with the exact discrete Gaussian tail instead of the Gaussian
    concentration bound. A public shift: costs no privacy.
    """
    target = beta / 2.0 / (d * w)
    hi = max(1, int(math.sqrt(2 * var * math.log(2 * d * w / beta))) + 2)
    lo = 0
    while lo < hi:
        mid = (lo + hi) // 2
        if dgauss_lower_tail(var, mid) <= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


def theorem31_bound(n: int, gamma: float, E: float) -> tuple[float, float]:
    """Theorem 3.1: 0 <= f_hat(x) - f(x) <= gamma*N + 2E (w.p. 1-beta, per item)."""
    return (0.0, gamma * n + 2 * E)


def theorem32_bound(n: int, gamma: float, E: float) -> float:
    """Theorem 3.2: |f_hat(x) - f(x)| <= gamma*N + E (w.p. 1-beta, per item)."""
    return gamma * n + E


def sigma2_for(d: int, rho: float | Fraction | str, clip: int = 1, arrays: int = 1,
               neighbours: str = "replace") -> Fraction:
    """Exact sigma^2 = Delta2^2/(2 rho) for one event touching ``arrays`` d-row arrays.

    ``neighbours='replace'`` (the paper's): Delta2^2 = 2*arrays*d*clip^2;
    ``'addremove'`` (the product's unit): arrays*d*clip^2. A float rho is rounded
    down to a rational (so sigma^2 only grows).
    """
    if isinstance(rho, str):
        from pansketch.agent.calibrate import parse_ratio

        r = Fraction(*parse_ratio(rho))
    elif isinstance(rho, float):
        r = Fraction(math.floor(rho * 10**9), 10**9)
    else:
        r = Fraction(rho)
    if r <= 0:
        raise ValueError("rho must be positive")
    if neighbours not in ("replace", "addremove"):
        raise ValueError("neighbours must be 'replace' or 'addremove'")
    l2sq = arrays * d * clip * clip * (2 if neighbours == "replace" else 1)
    return Fraction(l2sq) / (2 * r)


# --------------------------------------------------------------------------


class PrivateLinearSketch:
    """Private Count-Min / CountSketch (dp-linear-sketches Algorithms 1-3).

    Counters are int64 numpy arrays on the host (every value is checked to
    fit the device's int32 layout by :meth:`to_device`); they start with
    exact discrete Gaussian noise. ``offset`` (Count-Min only) is added to
    every estimate: a number, or one of ``'paper'`` / ``'union'`` /
    ``'notebook'`` (needs ``gamma``/``beta`` for the formulas), or None.
    """

    def __init__(self, kind: str, d: int, w: int, salt: str | bytes, rho: float | Fraction | None,
                 noise: NoiseEngine | None = None, offset: float | str | None = None,
                 gamma: float | None = None, beta: float | None = None, clip: int = 1,
                 neighbours: str = "replace", counters: np.ndarray | None = None,
                 var: Fraction | None = None) -> None:
        if kind not in ("cms", "cs"):
            raise ValueError("kind must be 'cms' or 'cs'")
        self.kind, self.d, self.w, self.salt, self.clip = kind, d, w, salt, clip
        self.rho = rho
        if var is not None:
            self.var: Fraction | None = Fraction(var)
        elif rho is not None:
            self.var = sigma2_for(d, rho, clip, 1, neighbours)
        else:
            self.var = None
        if counters is not None:
            if counters.shape != (d, w):
                raise ValueError("counters must have shape (d, w)")
            self.counters = counters.astype(np.int64, copy=True)
        else:
            self.counters = np.zeros((d, w), dtype=np.int64)
        if self.var is not None:
            eng = noise if noise is not None else BulkNoise()
            self.counters += eng.dgauss(self.var, d * w).reshape(d, w)
        self.offset = self._resolve_offset(offset, gamma, beta)

    def _resolve_offset(self, offset: float | str | None, gamma: float | None, beta: float | None) -> float:
        if offset is None:
            return 0.0
        if not isinstance(offset, str):
            return float(offset)
        if self.kind != "cms":
            raise ValueError("an offset only makes sense for Count-Min")
        if self.var is None or self.rho is None:
            raise ValueError("a named offset needs a private sketch (rho)")
        if offset == "union":
            return float(union_E(self.d, self.w, float(self.var), beta if beta is not None else 0.01))
        if gamma is None or beta is None:
            raise ValueError("offset %r needs gamma and beta" % offset)
        if offset == "paper":
            return paper_E(gamma, beta, float(self.rho))
        if offset == "notebook":
            return notebook_E(gamma, beta, float(self.rho))
        raise ValueError("unknown offset %r" % offset)

    # -- updates (Algorithm 1) ------------------------------------------------
    def add(self, items: Sequence[Any], weights: Sequence[int] | None = None) -> None:
        """Add a batch of events (vectorised; equal to per-event Sketch.update)."""
        self.counters += fasthash.sketch_counts(items, weights, self.kind, self.d, self.w, self.salt, self.clip)

    def add_counts(self, exact: np.ndarray) -> None:
        """Add exact counters computed elsewhere (same kind, shape and salt)."""
        self.counters += exact

    # -- queries (Algorithm 2) ------------------------------------------------
    def estimate(self, items: Sequence[Any]) -> np.ndarray:
        """Estimates for many items: min (+offset) for Count-Min, median for CountSketch."""
        return fasthash.estimates(self.counters, items, self.kind, self.salt) + self.offset

    def estimate_from_cols(self, cols: np.ndarray, signs: np.ndarray) -> np.ndarray:
        vals = fasthash.row_values(self.counters, cols, signs, self.kind)
        if self.kind == "cms":
            return vals.min(axis=1).astype(np.float64) + self.offset
        return np.median(vals, axis=1)

    def top_k(self, candidates: Sequence[Any], k: int) -> list[Any]:
        est = self.estimate(candidates)
        order = np.argsort(-est, kind="stable")[:k]
        return [candidates[i] for i in order]

    # -- device interop ---------------------------------------------------------
    def to_device(self) -> Sketch:
        """The same state as an :class:`pansketch.agent.sketch.Sketch` (int32 array('i'))."""
        c = self.counters
        if c.size and (c.max() > INT32_MAX or c.min() < INT32_MIN):
            raise OverflowError("counters do not fit int32")
        arr = array("i", c.astype(np.int32).ravel().tobytes())
        return Sketch(self.kind, self.d, self.w, hashing.salt_prefix(self.salt), self.clip, arr)


# --------------------------------------------------------------------------


def dcs_shape(log_u: int, gamma: float) -> tuple[int, int]:
    """(d, w) of a DCS level (dp-linear-sketches §4.1, Wang et al. 2013):
    d = ceil(log(log U/gamma)), w = ceil(sqrt(log U * log(log U/gamma))/gamma)."""
    lu = math.log(2.0**log_u)
    inner = math.log(lu / gamma)
    return math.ceil(inner), math.ceil(math.sqrt(lu * inner) / gamma)


def level_salt(salt: str | bytes, level: int) -> bytes:
    """Salt of dyadic level ``level``: independent hash functions per level."""
    if isinstance(salt, str):
        salt = salt.encode("utf-8")
    return bytes(salt) + b"/dyadic/%d" % level


class DyadicCountSketch:
    """(Private) Dyadic CountSketch over the universe [0, 2^log_u).

    Level j (0 <= j < log_u) is a CountSketch of ``x >> j`` (Algorithm 4);
    one event touches log_u*d cells, so for rho-zCDP every cell gets
    N_Z(0, sigma^2) with Delta2^2 = 2*log_u*d (replace-one), i.e. the paper's
    per-level budget rho/log U (§4.2, Lemma 2.7). ``rho=None`` is the
    non-private DCS.

    Queries: :meth:`rank_lt` (Algorithm 5: items < x), :meth:`rank_le`,
    :meth:`range_count`, :meth:`quantile` (descends the bits of x), and
    :meth:`heavy_hitters` (descends the dyadic levels from the root, docs/ARCHITECTURE.md
    "Beyond frequencies"). All are post-processing of the noisy counters.
    """

    def __init__(self, log_u: int, d: int, w: int, salt: str | bytes, rho: float | Fraction | None,
                 noise: NoiseEngine | None = None, neighbours: str = "replace",
                 exact: np.ndarray | None = None) -> None:
        if not (1 <= log_u <= 62):
            raise ValueError("log_u must be in 1..62")
        self.log_u, self.d, self.w, self.salt = log_u, d, w, salt
        self.U = 1 << log_u
        self.var = sigma2_for(d, rho, 1, log_u, neighbours) if rho is not None else None
        self.counters = np.zeros((log_u, d, w), dtype=np.int64) if exact is None else exact.astype(np.int64, copy=True)
        if self.var is not None:
            eng = noise if noise is not None else BulkNoise()
            self.counters += eng.dgauss(self.var, log_u * d * w).reshape(log_u, d, w)
        self._colcache: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = {}

    @staticmethod
    def exact_counts(values: np.ndarray, log_u: int, d: int, w: int, salt: str | bytes) -> np.ndarray:
        """Noise-free counters (log_u, d, w) of integer values in [0, 2^log_u)."""
        v = np.asarray(values, dtype=np.int64)
        if v.size and (v.min() < 0 or v.max() >= (1 << log_u)):
            raise ValueError("values must lie in [0, 2^log_u)")
        out = np.zeros((log_u, d, w), dtype=np.int64)
        for j in range(log_u):
            nodes, cnt = np.unique(v >> j, return_counts=True)
            out[j] = fasthash.counts_from_distinct([int(x) for x in nodes], cnt.astype(np.int64), "cs", d, w,
                                                   level_salt(salt, j))
        return out

    def add(self, values: np.ndarray) -> None:
        self.counters += self.exact_counts(values, self.log_u, self.d, self.w, self.salt)

    def _node_estimates(self, level: int, nodes: np.ndarray) -> np.ndarray:
        if not nodes.size:
            return np.zeros(0)
        uniq, inv = np.unique(nodes, return_inverse=True)
        cache = self._colcache.setdefault(level, {})
        missing = [int(x) for x in uniq if int(x) not in cache]
        if missing:
            st = fasthash.streams(missing, level_salt(self.salt, level), self.d)
            c, s = fasthash.cols_signs(st, self.d, self.w)
            for i, x in enumerate(missing):
                cache[x] = (c[i], s[i])
        cols = np.stack([cache[int(x)][0] for x in uniq])
        signs = np.stack([cache[int(x)][1] for x in uniq])
        vals = fasthash.row_values(self.counters[level], cols, signs, "cs")
        return np.median(vals, axis=1)[inv]

    def rank_lt(self, xs: np.ndarray | Sequence[int]) -> np.ndarray:
        """Estimated number of items < x, for each x in [0, 2^log_u] (Algorithm 5)."""
        x = np.asarray(xs, dtype=np.int64)
        if x.size and (x.min() < 0 or x.max() > self.U):
            raise ValueError("rank query outside [0, 2^log_u]")
        out = np.zeros(x.shape, dtype=np.float64)
        full = x == self.U
        if full.any():
            top = self._node_estimates(self.log_u - 1, np.array([0, 1])).sum()
            out[full] = top
        xi = np.where(full, 0, x)
        for j in range(self.log_u):
            node = xi >> j
            sel = (node & 1) == 1
            if sel.any():
                out[sel] += self._node_estimates(j, node[sel] - 1)
        return out

    def rank_le(self, xs: np.ndarray | Sequence[int]) -> np.ndarray:
        """Estimated number of items <= x (Definition 2.2)."""
        return self.rank_lt(np.asarray(xs, dtype=np.int64) + 1)

    def range_count(self, a: np.ndarray | Sequence[int], b: np.ndarray | Sequence[int]) -> np.ndarray:
        """Estimated number of items in [a, b] (inclusive)."""
        return self.rank_lt(np.asarray(b, dtype=np.int64) + 1) - self.rank_lt(np.asarray(a, dtype=np.int64))

    def total(self) -> float:
        return float(self.rank_lt([self.U])[0])

    def quantile(self, qs: np.ndarray | Sequence[float], n: float | None = None) -> np.ndarray:
        """Smallest x with estimated rank_le(x) >= q*n, for each q in [0, 1].

        ``n`` defaults to the sketch's own estimate of the stream length.
        """
        q = np.asarray(qs, dtype=np.float64)
        if n is None:
            n = self.total()
        target = q * n
        x = np.zeros(q.shape, dtype=np.int64)
        for bit in range(self.log_u - 1, -1, -1):
            cand = x + (1 << bit)
            r = self.rank_lt(cand)
            x = np.where(r < target, cand, x)
        return np.minimum(x, self.U - 1)

    def heavy_hitters(self, threshold: float, max_nodes: int = 1 << 16) -> list[tuple[int, float]]:
        """Values x whose estimated count is >= threshold, found by descending the levels.

        A node whose estimate is below the threshold is not expanded (its
        children's counts sum to it), so at most ``max_nodes`` nodes are
        examined per level; raises ValueError if that is exceeded (the
        threshold is too low for the noise level). Returns [(x, estimate)].
        """
        nodes = np.array([0, 1], dtype=np.int64)
        for level in range(self.log_u - 1, -1, -1):
            est = self._node_estimates(level, nodes)
            keep = est >= threshold
            nodes, est = nodes[keep], est[keep]
            if level == 0:
                return sorted(((int(x), float(e)) for x, e in zip(nodes, est)), key=lambda t: -t[1])
            nodes = np.concatenate((2 * nodes, 2 * nodes + 1))
            if nodes.size > max_nodes:
                raise ValueError("more than %d candidate nodes at level %d: raise the threshold" % (max_nodes, level))
        return []
