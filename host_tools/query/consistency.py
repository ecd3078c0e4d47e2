"""Consistent answers by post-processing (no privacy cost: only released data are used).

Two kinds of consistency:

* **Monotone CDF / rank rows** (:func:`monotone_rows`). The true CDF F is
  non-decreasing and in [0, 1]; independent per-point estimates are not.
  The estimates are replaced by their isotonic regression (pool adjacent
  violators, equal weights), the intervals are made monotone by *widening*
  (lo_i <- min over j >= i of lo_j, hi_i <- max over j <= i of hi_j) and
  clipped to the range the truth can take ([0, 1] for F, [0, inf) for a
  rank). Each new interval contains the old one intersected with the
  truth's range, so each point covers at least as often as before. Finally
  every estimate is clipped into its own interval; clipping a monotone
  sequence into monotone bounds keeps it monotone, so the rows come out
  monotone, inside [0, 1] and inside their intervals.

* **Least-squares consistent dyadic trees** (:func:`tree_consistent`), Hay,
  Rastogi, Miklau & Suciu, VLDB 2010, "Boosting the accuracy of
  differentially private histograms through consistency", Theorem 3
  (the two-pass algorithm), generalised here to per-node noise variances
  (the weighted least-squares / best linear unbiased estimate): a node's
  released count y_v = x_v + noise_v, with x_parent = sum of x_children.

  Pass 1 (bottom-up) z_v: the best estimate of x_v from v's own subtree,
  with variance s_v. A leaf has z = y, s = var(y); an inner node combines
  its own reading with the sum of its children's z by inverse variance:
  z_v = (y_v / var_v + c / s_c) / (1 / var_v + 1 / s_c), c = sum of z_child,
  s_c = sum of s_child, s_v = 1 / (1 / var_v + 1 / s_c).

  Pass 2 (top-down) xbar: the root keeps xbar = z; a node's children share
  the difference between the parent's consistent value and the sum of their
  z in proportion to their variances: xbar_u = z_u + s_u / s_c * (xbar_v - c).
  (The children's z are independent given x, so conditioning them on their
  sum being xbar_v is this split.) The result is the generalised
  least-squares solution; the children of every node sum to it.

  A linear sketch's counters are linear in the events, so the consistency
  holds cell by cell: every counter cell of a tree is processed as its own
  tree of counts (all cells of a node have the same noise variance, so the
  weights are shared and one pass over (nodes, cells) arrays does all).
  Any range count that sums consistent nodes is a linear unbiased estimate
  whose variance is at most that of the same range from the raw nodes
  (the least-squares answer is the best linear unbiased one, Gauss-Markov).
  :func:`tree_weights` gives the coefficients of a range answer on the raw
  nodes, from which its exact noise variance follows.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


# -- monotone rows ----------------------------------------------------------------
def isotonic(y: Sequence[float] | np.ndarray) -> np.ndarray:
    """Non-decreasing least-squares fit to y (pool adjacent violators, equal weights)."""
    vals: list[float] = []
    wts: list[int] = []
    for v in y:
        vals.append(float(v))
        wts.append(1)
        while len(vals) > 1 and vals[-2] > vals[-1]:
            w = wts[-2] + wts[-1]
            v2 = (vals[-2] * wts[-2] + vals[-1] * wts[-1]) / w
            vals.pop()
            wts.pop()
            vals[-1], wts[-1] = v2, w
    out = np.empty(len(y), dtype=np.float64)
    i = 0
    for v, w in zip(vals, wts):
        out[i:i + w] = v
        i += w
    return out


def monotone(est: Sequence[float] | np.ndarray, lo: Sequence[float] | np.ndarray,
             hi: Sequence[float] | np.ndarray, floor: float = -math.inf,
             ceil: float = math.inf) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(est, lo, hi) of points in increasing x made monotone and consistent (module doc).

    Intervals are only widened (then clipped to [floor, ceil], where the truth lies),
    so a point's interval covers whenever its old one did."""
    e = np.asarray(est, dtype=np.float64)
    lo_a = np.minimum.accumulate(np.asarray(lo, dtype=np.float64)[::-1])[::-1]
    hi_a = np.maximum.accumulate(np.asarray(hi, dtype=np.float64))
    lo_a = np.clip(lo_a, floor, ceil)
    hi_a = np.clip(hi_a, floor, ceil)
    e = np.clip(np.clip(isotonic(e), floor, ceil), lo_a, hi_a)
    return e, lo_a, hi_a


# -- least-squares consistent trees -------------------------------------------------
def tree_consistent(levels: list[np.ndarray], var: list[np.ndarray]) -> list[np.ndarray]:
    """Hay et al. 2010 Theorem 3 with per-node variances (module doc).

    ``levels[l]`` holds the released values of the 2^(L-1-l) nodes of level l
    (level 0 = leaves, shape (nodes, ...) with any trailing cell dimensions),
    ``var[l]`` their noise variances (shape (nodes,)); node i of level l has the
    children 2i and 2i + 1 of level l - 1. Returns the consistent values."""
    L = len(levels)
    for lv in range(1, L):
        if len(levels[lv]) * 2 != len(levels[lv - 1]):
            raise ValueError("level %d has %d nodes, level %d has %d (need a complete binary tree)"
                             % (lv, len(levels[lv]), lv - 1, len(levels[lv - 1])))
    z = [np.asarray(levels[0], dtype=np.float64)]
    s = [np.asarray(var[0], dtype=np.float64)]
    for lv in range(1, L):
        zc = z[-1][0::2] + z[-1][1::2]
        sc = s[-1][0::2] + s[-1][1::2]
        vv = np.asarray(var[lv], dtype=np.float64)
        wv = sc / (vv + sc)  # the weight of the node's own reading: (1/vv) / (1/vv + 1/sc)
        sh = (-1,) + (1,) * (np.ndim(levels[lv]) - 1)
        z.append(wv.reshape(sh) * np.asarray(levels[lv], dtype=np.float64) + (1.0 - wv).reshape(sh) * zc)
        s.append(vv * sc / (vv + sc))
    out: list[np.ndarray] = [np.empty(0)] * L
    out[L - 1] = z[L - 1]
    for lv in range(L - 1, 0, -1):
        zc = z[lv - 1][0::2] + z[lv - 1][1::2]
        s0, s1 = s[lv - 1][0::2], s[lv - 1][1::2]
        diff = out[lv] - zc
        sh = (-1,) + (1,) * (np.ndim(diff) - 1)
        f0 = (s0 / (s0 + s1)).reshape(sh)
        ch = np.empty_like(z[lv - 1])
        ch[0::2] = z[lv - 1][0::2] + f0 * diff
        ch[1::2] = z[lv - 1][1::2] + (1.0 - f0) * diff
        out[lv - 1] = ch
    return out


def tree_weights(var: list[np.ndarray], level: int, index: int) -> list[np.ndarray]:
    """Coefficients a (one array per level) with consistent node (level, index) = sum a * raw nodes."""
    L = len(var)
    # the map is linear: apply its transpose by running the consistency on unit vectors would cost
    # one pass per raw node; instead push the unit readings of all nodes at once (nodes x nodes).
    sizes = [len(v) for v in var]
    total = sum(sizes)
    eye_levels = []
    off = 0
    for lv in range(L):
        m = np.zeros((sizes[lv], total))
        m[np.arange(sizes[lv]), off + np.arange(sizes[lv])] = 1.0
        eye_levels.append(m)
        off += sizes[lv]
    res = tree_consistent(eye_levels, var)[level][index]
    out = []
    off = 0
    for lv in range(L):
        out.append(res[off:off + sizes[lv]])
        off += sizes[lv]
    return out
