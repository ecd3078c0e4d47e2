"""Quantiles, CDF and heavy hitters from merged ``dcs`` releases, with intervals.

A dcs release (agent/dcs.py, docs/FORMAT.md §2) holds L = b + 1 levels of
d x w counters; level l counts the dyadic prefixes ``x >> l`` of the
readings' domain values x in [0, 2^b). Levels l >= e = exact_from(b, w)
are exact-indexed (node v in column v of every row, sign +1); the others
are CountSketches under the level's hash prefix.

Node estimate: mean of the d rows (exact levels; error = the mean of d
merged noise draws) or median of the d signed readings (hashed levels,
dp-linear-sketches Algorithm 2).

Per-level error bounds at a level confidence 1 - a (P(|err| > t_l) <= a):

* exact level: t_l = E / d with E the (a/2)-tail of the sum of d cells'
  merged noise (exact distribution, pansketch.host_tools.query.estimators.noise_tail_bound);
* hashed level: the data-driven CountSketch bound of
  pansketch.host_tools.query.estimators.cs_halfwidth (no model of the data or noise: the
  level's own counters are the sample of the error distribution).

Rank: rank_lt(x) (items < x) is the sum of at most b node estimates, one
per level l < b whose bit l of x is set (Algorithm 5). Its error is the sum
of those nodes' errors, and their distributions are known given the merged
counters, independently across levels (each level has its own hash
prefix and its own noise draws):

* exact level: the mean of d cells' merged noise, i.e. (sum of d * draws
  per cell independent draws) / d, from the exact pmf
  (pansketch.host_tools.query.estimators.noise_distribution; a normal of the same variance
  if the support is too large to convolve);
* hashed level: the median over the d rows of g_r * C_o[r, c_r] with c_r a
  uniformly random column and g_r a fair sign -- the CountSketch error
  given the counters without the node's own events (docs/HOST.md, "The key
  fact"; C stands in for C_o, they differ in one cell per row).

The rank interval is r +- h with h the (1 - alpha) quantile of |sum of the
node errors| (the sum is symmetric about 0), from
estimators.mc_size(alpha) seeded draws per level (:meth:`DyadicView.rank_lt`):
a calibrated interval, not a bound. It replaced a union bound over the
levels (each at alpha / 2b, CountSketch order-statistic bound), which
covered 100% at a nominal 95% with half-widths ~20x the typical error.
The total n (level b, exact) keeps its exact-noise tail at alpha / 2; the
fraction interval is [(r - h)/(n + t_n), (r + h)/(n - t_n)] (n's error is
~1e-4 of n, so it covers as the rank interval does). Intervals are per
point, not simultaneous over a whole CDF. Coverage is checked by
simulation in tests/test_dcs_host.py and pansketch.host_tools.bench.kinds.

Quantile q: the smallest x with estimated rank_le(x) >= q * n (descends
the bits of x); the answer carries the rank of that x estimated from the
nodes the search never read (n minus x's right siblings,
:meth:`DyadicView.rank_le_right`), with its interval: the search chose x
by the left nodes' errors, so their estimate at x is a selected one.

Consistency (:func:`make_consistent`): the rows of one CDF answer are made
monotone in x (isotonic regression of the estimates), ranks >= 0 and CDF
values in [0, 1], every estimate inside its interval; the intervals are
only widened to be monotone, so each still covers at least as often.
Quantile rows are clipped row by row (an answer must not depend on which
other quantiles were asked with it).

Heavy hitters without candidates: descend from the root; at each level keep
the ``beam`` (default max(4k, 64)) children with the largest estimates;
with a threshold T, children whose estimate is below T - t_l are dropped
too (a node's count is at least that of any value under it, so a value
with count >= T survives each level with probability >= 1 - alpha). At
level 0 report the k largest (with T: those estimated >= T) with intervals
+- t_0 at level confidence 1 - alpha/m, m = the number of level-0
candidates examined: simultaneous over the candidates, so they cover
although the reported values were selected for their large estimates
(a per-item interval, as ``query topk`` gives, under-covers by selection:
93% at a nominal 95% in pansketch.host_tools.bench.kinds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Optional, Sequence

import numpy as np

from pansketch.agent import hashing
from pansketch.agent.dcs import exact_from, level_prefix, map_value
from pansketch.host_tools import fasthash
from pansketch.host_tools.query import consistency, estimators
from pansketch.host_tools.query.merge import Merged, NoiseTerm


SIG_Z = 2.0  # a node whose estimate is below SIG_Z sd has its children left out of the next level's fit
LS_MAX_SHARE = 0.5  # a level's fit needs at most this share of its d * w counters as unknowns


def exact_counters(values: Sequence[int] | np.ndarray, b: int, d: int, w: int, salt: str | bytes,
                   weights: Optional[Sequence[int]] = None) -> np.ndarray:
    """Noise-free counters ((b+1)*d, w) of domain values, equal to pansketch.agent.dcs.DyadicSketch."""
    v = np.asarray(values, dtype=np.int64) if not isinstance(values, np.ndarray) else values.astype(np.int64)
    wt = np.ones(len(v), dtype=np.int64) if weights is None else np.asarray(weights, dtype=np.int64)
    levels = b + 1
    e = exact_from(b, w)
    out = np.zeros((levels, d, w), dtype=np.int64)
    prefix = hashing.salt_prefix(salt)
    nodes, inv = np.unique(v, return_inverse=True)
    cnt = np.bincount(inv, weights=wt, minlength=len(nodes)).astype(np.int64)
    for lv in range(levels):
        if lv:
            nodes, inv = np.unique(nodes >> 1, return_inverse=True)
            cnt = np.bincount(inv, weights=cnt, minlength=len(nodes)).astype(np.int64)
        keep = cnt != 0
        nd, ct = nodes[keep], cnt[keep]
        if lv >= e:
            out[lv, :, :] += np.bincount(nd, weights=ct, minlength=w).astype(np.int64)[None, :w]
            continue
        if not len(nd):
            continue
        cols, signs = fasthash.cols_signs(fasthash.streams_prefix([int(x) for x in nd], level_prefix(prefix, lv), d),
                                          d, w)
        for r in range(d):
            out[lv, r] = np.bincount(cols[:, r], weights=ct * signs[:, r], minlength=w).astype(np.int64)
    return out.reshape(levels * d, w)


class DyadicView:
    """Estimates and per-level error bounds over merged dcs counters."""

    def __init__(self, counters: np.ndarray, b: int, d: int, w: int, salt: str | bytes,
                 noise: Sequence[NoiseTerm], confidence: float = 0.95) -> None:
        if not 0.5 <= confidence < 1:
            raise ValueError("confidence must be in [0.5, 1)")
        self.b, self.d, self.w = b, d, w
        self.levels = b + 1
        self.C = np.asarray(counters, dtype=np.int64).reshape(self.levels, d, w)
        self.exact = exact_from(b, w)
        self.prefix = hashing.salt_prefix(salt)
        self.noise = list(noise)
        self.confidence = confidence
        self.alpha = 1.0 - confidence
        self._cache: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
        self._t: dict[tuple[int, float], float] = {}
        self._samples: dict[int, np.ndarray] = {}
        self._hsum: dict[tuple[int, ...], float] = {}
        self._fits: dict[int, Optional[dict[int, tuple[float, float]]]] = {}
        self._z = NormalDist().inv_cdf(1.0 - self.alpha / 2.0)

    @classmethod
    def of(cls, m: Merged, salt: str | bytes, confidence: float = 0.95) -> "DyadicView":
        if m.kind != "dcs":
            raise ValueError("releases of kind %r hold no dyadic levels (need kind dcs)" % m.kind)
        return cls(m.counters, m.b, m.d, m.w, salt, m.noise, confidence)

    # -- nodes -----------------------------------------------------------
    def node_est(self, level: int, nodes: np.ndarray) -> np.ndarray:
        nodes = np.asarray(nodes, dtype=np.int64)
        if not nodes.size:
            return np.zeros(0)
        C = self.C[level]
        if level >= self.exact:
            return C[:, nodes].mean(axis=0)
        uniq, inv = np.unique(nodes, return_inverse=True)
        cache = self._cache.setdefault(level, {})
        missing = [int(x) for x in uniq if int(x) not in cache]
        if missing:
            st = fasthash.streams_prefix(missing, level_prefix(self.prefix, level), self.d)
            c, s = fasthash.cols_signs(st, self.d, self.w)
            for i, x in enumerate(missing):
                cache[x] = (c[i], s[i])
        cols = np.stack([cache[int(x)][0] for x in uniq])
        signs = np.stack([cache[int(x)][1] for x in uniq])
        vals = fasthash.row_values(C, cols, signs, "cs")
        return np.median(vals, axis=1)[inv]

    def halfwidth(self, level: int, a: float) -> float:
        """t with P(|node estimate - true node count| > t) <= a at this level."""
        key = (level, a)
        if key not in self._t:
            if level >= self.exact:
                terms = [NoiseTerm(t.mech, t.num, t.den, t.count * self.d) for t in self.noise]
                self._t[key] = estimators.noise_tail_bound(terms, a / 2.0) / self.d
            else:
                self._t[key] = estimators.cs_halfwidth(self.C[level], a)
        return self._t[key]

    # -- error distributions (calibrated rank intervals) ----------------------
    def level_error_samples(self, level: int) -> np.ndarray:
        """Draws of one node estimate's error at ``level``, given the counters (module doc)."""
        if level not in self._samples:
            n = estimators.mc_size(self.alpha)
            rng = np.random.default_rng([estimators.CAL_SEED, level])
            if level >= self.exact:
                terms = [NoiseTerm(t.mech, t.num, t.den, t.count * self.d) for t in self.noise if t.count > 0]
                dist = estimators.noise_distribution(terms) if terms else (np.ones(1), 0.0)
                if dist is None:
                    sd = math.sqrt(sum(t.variance() for t in terms))
                    z = rng.normal(0.0, sd, n)
                else:
                    pmf = dist[0]
                    cdf = np.cumsum(pmf)
                    idx = np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right")
                    z = (np.minimum(idx, len(pmf) - 1) - (len(pmf) - 1) // 2).astype(np.float64)
                self._samples[level] = z / self.d
            else:
                self._samples[level] = estimators.median_error_samples(self.C[level], n, rng)
        return self._samples[level]

    def sum_halfwidth(self, levels: Sequence[int]) -> float:
        """h with P(|sum of the levels' node errors| > h) <= alpha (as the draws give it)."""
        key = tuple(sorted(levels))
        if key not in self._hsum:
            if not key:
                self._hsum[key] = 0.0
            else:
                tot = np.zeros_like(self.level_error_samples(key[0]))
                for lv in key:
                    tot += self.level_error_samples(lv)
                self._hsum[key] = estimators.abs_quantile(tot, self.alpha)
        return self._hsum[key]

    # -- per-salt node estimates: least squares over the level's support -----------------------
    def cell_var(self) -> float:
        """Variance of one merged counter's noise (every draw of every release summed)."""
        return float(sum(t.variance() for t in self.noise))

    def exact_sd(self) -> float:
        return math.sqrt(self.cell_var() / self.d)

    def _significant(self, level: int) -> Optional[dict[int, tuple[float, float]]]:
        """{node: (estimate, sd)} of the nodes at ``level`` estimated above SIG_Z sd (None: unresolved)."""
        if level >= self.exact:
            nodes = np.arange(1 << (self.b - level), dtype=np.int64)
            est = self.C[level][:, nodes].mean(axis=0)
            sd = self.exact_sd()
            keep = est > SIG_Z * sd
            return {int(v): (float(e), sd) for v, e in zip(nodes[keep], est[keep])}
        fit = self.fit(level)
        if fit is None:
            return None
        return {v: fit[v] for v in fit if fit[v][0] > SIG_Z * fit[v][1]}

    def fit(self, level: int) -> Optional[dict[int, tuple[float, float]]]:
        """{node: (estimate, sd)} for the support of a hashed ``level``: the children of the nodes
        significant one level up, estimated jointly by least squares on the level's d x w counters
        (None: the support exceeds LS_MAX_SHARE * d * w nodes, no honest estimate).

        Given the salt, the counters are A f + noise + the mass of the nodes left out (A: the
        support's columns and signs, known), so the estimate's error is (A'A)^-1 A' (noise + rest):
        its variance s^2 [(A'A)^-1]_ii holds for *this* salt, not only on average over salts, with
        s^2 = max(residual variance, the merged noise variance per cell) -- the residual carries
        the left-out mass. The median estimate's error is the collision of this node with the
        heavy ones, fixed for a fleet's salt: its calibrated interval covered 5th-percentile fleets
        0.87 at d = 4, w = 1024 (docs/HOST.md)."""
        if level in self._fits:
            return self._fits[level]
        sig = self._significant(level + 1)
        out: Optional[dict[int, tuple[float, float]]] = None
        if sig is not None:
            par = np.array(sorted(sig), dtype=np.int64)
            S = np.sort(np.concatenate((2 * par, 2 * par + 1)))
            if len(S) == 0:
                out = {}
            elif len(S) <= LS_MAX_SHARE * self.d * self.w:
                out = self._ls(level, S)
        self._fits[level] = out
        return out

    def _ls(self, level: int, S: np.ndarray) -> Optional[dict[int, tuple[float, float]]]:
        d, w = self.d, self.w
        st = fasthash.streams_prefix([int(x) for x in S], level_prefix(self.prefix, level), d)
        cols, signs = fasthash.cols_signs(st, d, w)
        sg = signs.astype(np.float64)
        Y = self.C[level].astype(np.float64)
        N = np.zeros((len(S), len(S)))
        rhs = np.zeros(len(S))
        for r in range(d):
            N += (cols[:, r][:, None] == cols[:, r][None, :]) * np.outer(sg[:, r], sg[:, r])
            rhs += sg[:, r] * Y[r, cols[:, r]]
        try:
            Ninv = np.linalg.inv(N)
        except np.linalg.LinAlgError:
            return None
        if not np.all(np.isfinite(Ninv)) or np.min(np.diag(Ninv)) <= 0:
            return None
        f = Ninv @ rhs
        res = 0.0
        for r in range(d):
            pred = np.bincount(cols[:, r], weights=sg[:, r] * f, minlength=w)
            res += float(((Y[r] - pred) ** 2).sum())
        dof = d * w - len(S)
        s2 = max(res / dof if dof > 0 else math.inf, self.cell_var())
        sd = np.sqrt(s2 * np.diag(Ninv))
        return {int(v): (float(e), float(s)) for v, e, s in zip(S, f, sd)}

    def _walk(self, x: int, right: bool, top: Optional[int] = None) -> tuple[float, float, float, bool]:
        """(estimate, variance, bound, honest) of the events < x (``right`` False: the left siblings
        of x's path, Algorithm 5) or of the events > x within the domain (``right`` True: the right
        siblings), from the exact levels and the least-squares node estimates (:meth:`fit`).
        Where x's ancestor p is not significant, the nodes below it hold between 0 and f(p) events
        in all: ``bound`` adds f(p)'s upper end (estimate + z sd) and the walk stops there (event
        weights >= 0). honest False: a level the walk needs is unresolved."""
        est = var = bound = 0.0
        for lv in range(self.b - 1 if top is None else top - 1, -1, -1):
            bit = (x >> lv) & 1
            low = x & ((1 << lv) - 1)
            need = (bit == 0) if right else (bit == 1)
            if lv >= self.exact:
                if need:
                    v = (x >> lv) + (1 if right else -1)
                    est += float(self.C[lv][:, v].mean())
                    var += self.cell_var() / self.d
                continue
            fit = self.fit(lv)
            if fit is None:  # unresolved: honest only if no node at this level or below is needed
                rest_below = (x & ((1 << (lv + 1)) - 1)) != ((1 << (lv + 1)) - 1 if right else 0)
                return est, var, bound, not rest_below
            v = (x >> lv) + (1 if right else -1)
            if need:
                if v in fit:
                    e, s = fit[v]
                    est += e
                    var += s * s
                else:  # x's parent (v's too) is not significant: the rest lies within it
                    p = x >> (lv + 1)
                    pe, ps = self._node_upper(lv + 1, p)
                    bound += max(0.0, pe + self._z * ps)
                    return est, var, bound, True
            elif (x >> lv) not in fit:  # nothing needed here, but the parent is not significant
                rest = (low != (1 << lv) - 1) if right else (low != 0)
                if rest:
                    p = x >> (lv + 1)
                    pe, ps = self._node_upper(lv + 1, p)
                    bound += max(0.0, pe + self._z * ps)
                return est, var, bound, True
        return est, var, bound, True

    def _node_upper(self, level: int, node: int) -> tuple[float, float]:
        """(estimate, sd) of a node (exact level, or the least-squares fit one level up)."""
        if level >= self.exact:
            return float(self.C[level][:, node].mean()), self.exact_sd()
        fit = self.fit(level)
        if fit is not None and node in fit:
            return fit[node]
        pe, ps = self._node_upper(level + 1, node >> 1)  # its parent bounds it too
        return pe, ps

    def resolved_level(self) -> int:
        """The finest level l such that every hashed level >= l has a fit (:meth:`fit`): ranks at
        multiples of 2^l have per-salt intervals."""
        for lv in range(self.exact - 1, -1, -1):
            if self.fit(lv) is None:
                return lv + 1
        return 0

    def rank_ls(self, xs: Sequence[int] | np.ndarray, right: bool = False
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(estimate, half-width, honest) of rank_le(x) (``right`` False: left siblings of x + 1;
        True: n minus the right siblings of x), per-salt intervals (:meth:`fit`): the Gaussian
        z sd of the summed node errors (independent levels) plus half of the bounds, the estimate
        at the middle of the bounded part. honest False: the half-width is nan."""
        x = np.asarray(xs, dtype=np.int64)
        est = np.zeros(x.shape)
        half = np.zeros(x.shape)
        ok = np.ones(x.shape, dtype=bool)
        n, tn = self.total()
        U = 1 << self.b
        for i, xn in np.ndenumerate(x):
            xv = int(xn)
            if right:
                # x's half of the domain (plus the lower half if x is in the upper one) minus the right
                # siblings below: not n - (right siblings), as the quantile search aims at q * n, so n's
                # error would be a selected one (0.85 at a nominal 0.95 at n = 167). The nodes left of
                # x's path are selected too (the search stopped on them): splitting lower, with x's
                # ancestor at an exact level L and the left siblings above it, covered 0.63-0.81.
                L = self.b - 1
                used = [(xv >> L, L)] + ([(0, L)] if (xv >> L) & 1 else [])
                base = sum(float(self.C[lv][:, u].mean()) for u, lv in used)
                e, v, bd, h = self._walk(xv, True, top=L)
                est[i] = base - e - bd / 2.0
                half[i] = self._z * math.sqrt(v + len(used) * self.cell_var() / self.d) + bd / 2.0
            elif xv + 1 >= U:
                est[i], half[i], h = n, tn, True
            else:
                e, v, bd, h = self._walk(xv + 1, False)
                est[i] = e + bd / 2.0
                half[i] = self._z * math.sqrt(v) + bd / 2.0
            if not h:
                ok[i] = False
                half[i] = math.nan
        return est, half, ok

    # -- ranks -----------------------------------------------------------
    def total(self) -> tuple[float, float]:
        """(estimated number of events n, half-width at alpha/2)."""
        return float(self.node_est(self.b, np.array([0]))[0]), self.halfwidth(self.b, self.alpha / 2.0)

    def rank_est(self, xs: Sequence[int] | np.ndarray) -> np.ndarray:
        """Estimated number of events with value < x (no interval), x in [0, 2^b]."""
        x = np.asarray(xs, dtype=np.int64)
        U = 1 << self.b
        if x.size and (x.min() < 0 or x.max() > U):
            raise ValueError("rank query outside [0, 2^b]")
        est = np.zeros(x.shape, dtype=np.float64)
        full = x == U
        if full.any():
            est[full] = self.total()[0]
        xi = np.where(full, 0, x)
        for lv in range(self.b):
            node = xi >> lv
            sel = (node & 1) == 1
            if sel.any():
                est[sel] += self.node_est(lv, node[sel] - 1)
        return est

    def rank_lt(self, xs: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(estimate, half-width) of the number of events with value < x, x in [0, 2^b].

        The half-width is calibrated: the (1 - alpha) quantile of the absolute
        error of the sum of the nodes used (module doc)."""
        x = np.asarray(xs, dtype=np.int64)
        est = self.rank_est(x)
        U = 1 << self.b
        half = np.zeros(x.shape, dtype=np.float64)
        for i, xn in np.ndenumerate(x):
            xv = int(xn)
            levels = [self.b] if xv == U else [lv for lv in range(self.b) if (xv >> lv) & 1]
            half[i] = self.sum_halfwidth(levels)
        return est, half

    def rank_le(self, xs: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.rank_lt(np.asarray(xs, dtype=np.int64) + 1)

    def rank_le_right(self, xs: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(estimate, half-width) of the events <= x from the complement: n minus the right
        siblings, rank_le(x) = n - sum over levels l < b with bit l of x clear of node (x >> l) + 1.

        For the answers of :meth:`quantile`. Its search reads only rank_lt of candidates,
        i.e. nodes (c >> l) - 1 left of or on x's path, never a right sibling of x's path,
        so the answer x is chosen independently of these nodes' errors (given the
        counters) and the interval keeps its calibration at the chosen x. rank_le(x)
        evaluated on the left nodes is the very estimate that stopped the search (it
        was >= q n), so its error is selected: its intervals over-cover in sparse parts
        of the distribution (0.93 at a nominal 0.90) and under-cover in dense ones.
        """
        x = np.asarray(xs, dtype=np.int64)
        if x.size and (x.min() < 0 or x.max() >= (1 << self.b)):
            raise ValueError("rank query outside [0, 2^b)")
        n, _ = self.total()
        est = np.full(x.shape, n, dtype=np.float64)
        for lv in range(self.b):
            node = x >> lv
            sel = (node & 1) == 0
            if sel.any():
                est[sel] -= self.node_est(lv, node[sel] + 1)
        half = np.zeros(x.shape, dtype=np.float64)
        for i, xn in np.ndenumerate(x):
            xv = int(xn)
            half[i] = self.sum_halfwidth([self.b] + [lv for lv in range(self.b) if not (xv >> lv) & 1])
        return est, half

    def quantile(self, qs: Sequence[float] | np.ndarray, n: Optional[float] = None) -> np.ndarray:
        """Smallest x with estimated rank_le(x) >= q * n, for each q."""
        q = np.asarray(qs, dtype=np.float64)
        if n is None:
            n = self.total()[0]
        target = q * n
        x = np.zeros(q.shape, dtype=np.int64)
        for bit in range(self.b - 1, -1, -1):
            cand = x + (1 << bit)
            r = self.rank_est(cand)
            x = np.where(r < target, cand, x)
        return np.minimum(x, (1 << self.b) - 1)

    # -- heavy hitters ---------------------------------------------------
    def heavy(self, k: int, threshold: Optional[float] = None, beam: Optional[int] = None) -> tuple[
            list[tuple[int, float]], float]:
        """Top-k domain values by dyadic descent: ([(x, estimate)], half-width t_0)."""
        if k < 1:
            raise ValueError("k must be at least 1")
        B = beam if beam is not None else max(4 * k, 64)
        nodes = np.array([0], dtype=np.int64)
        examined = 2
        for lv in range(self.b - 1, -1, -1):
            nodes = np.concatenate((2 * nodes, 2 * nodes + 1))
            examined = len(nodes)
            est = self.node_est(lv, nodes)
            if threshold is not None:
                keep = est >= threshold - self.halfwidth(lv, self.alpha)
                nodes, est = nodes[keep], est[keep]
            if nodes.size > B:
                top = np.argpartition(-est, B - 1)[:B]
                nodes, est = nodes[top], est[top]
            if not nodes.size:
                return [], self.halfwidth(0, self.alpha)
        order = np.lexsort((nodes, -est))
        out = [(int(nodes[i]), float(est[i])) for i in order]
        if threshold is not None:
            out = [(x, e) for x, e in out if e >= threshold]
        # simultaneous over the level-0 candidates: the reported values are *selected* for large
        # estimates, so a per-item interval would under-cover (winner's curse). The candidates are a
        # function of the levels above, whose hashes and noise are independent of level 0's.
        return out[:k], self.halfwidth(0, self.alpha / examined)


# -- readings <-> domain ---------------------------------------------------------
def reading_range(x: int, b: int, mapping: tuple[int, int, int]) -> tuple[Optional[float], Optional[float]]:
    """Readings that map to x: [lo, hi) (None = unbounded: clipped into the domain's edge)."""
    sn, sd, off = mapping
    lo = None if x == 0 else off + x * sd / sn
    hi = None if x == (1 << b) - 1 else off + (x + 1) * sd / sn
    return lo, hi


def _num(x: float) -> str:
    return "%.0f" % x if math.isfinite(x) else "not a number"


def to_value(reading: Any, b: int, mapping: tuple[int, int, int]) -> int:
    x = map_value(reading if isinstance(reading, (int, str)) else repr(reading), b, mapping)
    if x is None:
        raise ValueError("%r is not a reading (decimal, 0x hex, IPv4 or MAC)" % (reading,))
    return x


NO_INTERVAL = ("no honest interval at this value: the sketch cannot separate the readings this finely for this "
               "fleet's salt (too many distinct values per level for d x w; pansketch-agent check --events N warns); "
               "the interval shown is the trivial one")
NO_MASS = ("no honest interval: the merged total of these releases is %s (no set of events has that many); "
           "a release that no honest device could make is in the merge -- see `pansketch status` for flagged "
           "devices and `--exclude-device`")


@dataclass
class RankAnswer:
    q: Optional[float]
    x: int
    reading_lo: Optional[float]
    reading_hi: Optional[float]
    rank: float
    rank_lo: float
    rank_hi: float
    n: float
    n_lo: float
    n_hi: float
    frac: float
    frac_lo: float
    frac_hi: float
    honest: bool = True  # False: no per-salt interval at this value (the trivial [0, n] / [0, 1] is given)
    resolution: int = 1  # the value ends a block of this many domain values (a coarser, honest answer)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        if self.q is not None:
            d["q"] = self.q
        d.update({"value": self.x, "reading": [self.reading_lo, self.reading_hi],
                  "rank": round(self.rank, 3), "rank_lo": round(self.rank_lo, 3), "rank_hi": round(self.rank_hi, 3),
                  "n": round(self.n, 3), "n_lo": round(self.n_lo, 3), "n_hi": round(self.n_hi, 3),
                  "cdf": round(self.frac, 6), "cdf_lo": round(self.frac_lo, 6), "cdf_hi": round(self.frac_hi, 6),
                  "honest_interval": self.honest})
        if self.resolution > 1:
            d["resolution"] = self.resolution
        if not self.honest:
            d["note"] = NO_INTERVAL if math.isfinite(self.n) and self.n > 0 else NO_MASS % _num(self.n)
        return d


def snap(v: DyadicView, xs: np.ndarray) -> tuple[np.ndarray, int]:
    """Values moved to the end of their block at the finest level every rank can be read from
    honestly (:meth:`DyadicView.resolved_level`): (values, block size). A quantile or a default
    CDF point then has a per-salt interval at a coarser resolution instead of none."""
    lr = v.resolved_level()
    if lr == 0:
        return np.asarray(xs, dtype=np.int64), 1
    return np.asarray(xs, dtype=np.int64) | ((1 << lr) - 1), 1 << lr


def rank_answers(v: DyadicView, xs: np.ndarray, qs: Optional[Sequence[float]], mapping: tuple[int, int, int],
                 coarsen: bool = False) -> list[RankAnswer]:
    """Rows for the values ``xs``: quantile answers (``qs`` given: ranks from the right siblings, as
    x was selected by the left ones) or cdf points (Algorithm 5's left siblings), with per-salt
    intervals (:meth:`DyadicView.rank_ls`). ``coarsen``: values finer than the sketch resolves for
    this salt move to the end of their block (:func:`snap`; the row's ``resolution``); otherwise
    such rows say there is no honest interval and carry the trivial one."""
    n, tn = v.total()
    xs = np.asarray(xs, dtype=np.int64)
    res = 1
    if coarsen:
        xs, res = snap(v, xs)
        if qs is None:
            xs = np.unique(xs)
    right = qs is not None
    r, h, ok = v.rank_ls(xs, right=right)
    if not ok.all():
        r0, _ = v.rank_le_right(xs) if right else v.rank_le(xs)
        r = np.where(ok, r, r0)
    # a merged total that is negative, zero or not a number cannot be the count of any set of readings:
    # no interval computed from it is honest (a forged release in the merge; pansketch.host_tools.store.bounds
    # refuses the large ones, smaller ones can still drive a small fleet's total below zero)
    mass_ok = math.isfinite(n) and n > 0
    if not mass_ok:
        ok = np.zeros(len(xs), dtype=bool)
    out: list[RankAnswer] = []
    for i, x in enumerate(xs):
        lo, hi = reading_range(int(x), v.b, mapping)
        if res > 1:
            lo = reading_range(int(x) - res + 1, v.b, mapping)[0]
        if ok[i]:
            rl, rh = float(r[i] - h[i]), float(r[i] + h[i])
        else:
            rl, rh = 0.0, n + tn
        nl, nh = n - tn, n + tn
        fl = max(0.0, rl / nh) if nh > 0 else 0.0
        fh = min(1.0, rh / nl) if nl > 0 else 1.0
        if not ok[i]:
            fl, fh = 0.0, 1.0
            if not mass_ok:
                rl, rh = 0.0, max(0.0, n + tn) if math.isfinite(n + tn) else math.inf
        out.append(RankAnswer(None if qs is None else float(qs[i]), int(x), lo, hi, float(r[i]), rl, rh, n, nl, nh,
                              float(r[i] / n) if n > 0 else math.nan, fl, fh, bool(ok[i]), res))
    return make_consistent(out, across_rows=qs is None)


def make_consistent(rows: list[RankAnswer], across_rows: bool = True) -> list[RankAnswer]:
    """Rows made monotone in x, ranks >= 0 and CDF values in [0, 1], each estimate inside its
    interval (pansketch.host_tools.query.consistency.monotone: isotonic estimates, intervals only widened,
    so each covers at least as often as before). Post-processing: no privacy cost.

    ``across_rows`` False (quantile answers) treats each row alone: clipped into [0, 1] / [0, inf)
    and into its interval, so a row's answer does not depend on which other quantiles were asked."""
    if not rows or any(math.isnan(a.frac) for a in rows):
        return rows
    if not across_rows:
        for a in rows:
            a.rank_lo, a.rank_hi = max(0.0, a.rank_lo), max(0.0, a.rank_hi)
            a.rank = min(max(a.rank, a.rank_lo), a.rank_hi)
            a.frac_lo, a.frac_hi = min(max(a.frac_lo, 0.0), 1.0), min(max(a.frac_hi, 0.0), 1.0)
            a.frac = min(max(a.frac, a.frac_lo), a.frac_hi)
        return rows
    order = sorted(range(len(rows)), key=lambda i: rows[i].x)
    rk, rlo, rhi = consistency.monotone([rows[i].rank for i in order], [rows[i].rank_lo for i in order],
                                        [rows[i].rank_hi for i in order], 0.0)
    fr, flo, fhi = consistency.monotone([rows[i].frac for i in order], [rows[i].frac_lo for i in order],
                                        [rows[i].frac_hi for i in order], 0.0, 1.0)
    for j, i in enumerate(order):
        a = rows[i]
        a.rank, a.rank_lo, a.rank_hi = float(rk[j]), float(rlo[j]), float(rhi[j])
        a.frac, a.frac_lo, a.frac_hi = float(fr[j]), float(flo[j]), float(fhi[j])
    return rows
