"""Heavy-hitter strings with no candidate list, from merged ``strhh`` releases.

A strhh release (agent/strhh.py, docs/FORMAT.md "Kind strhh") holds L levels
of d x w counters; level l counts the (l + 1)-byte prefixes of the items'
L-byte encodings. Low levels whose 256^(l+1) nodes fit in w are
exact-indexed (node = big-endian integer of the prefix, every row, sign +1),
the others are CountSketches under the level's hash prefix.

Node estimate: mean of the d rows (exact levels) or median of the d signed
readings (hashed levels, dp-linear-sketches.txt Algorithm 2), as in
pansketch.host_tools.query.dyadic for kind dcs.

Descent (the string form of the dyadic descent, dp-linear-sketches.txt §4;
the prefix-tree search with a fixed beam of Bassily et al.'s TreeHist):

1. level 0: the 256 one-byte prefixes are the candidates;
2. each candidate gets an estimate and a one-sided p-value for "its count is
   0"; on a hashed level both come from greedy peeling (below), on an exact
   level from the mean of its d cells and the exact noise distribution. The
   Benjamini-Hochberg step-up procedure keeps the discoveries: at the last
   level at the target false-discovery rate q (default 0.05), which is the
   FDR of the reported strings among the last level's candidates; at the
   levels above at the looser rate max(q, 0.5) (``prune``): there a false
   prefix only costs work (its children are candidates at the next level,
   where it must be discovered again under an independent hash), while a
   lost true prefix loses its strings for good. With a count threshold T,
   candidates estimated below T - t_l (t_l the level's half-width at alpha)
   are dropped too (a prefix counts at least as much as any string under
   it). The beam keeps at most B open prefixes and B finished strings (a
   prefix ending in the end marker 0x00 has one child) with the largest
   estimates, B = max(2k + 4, min(64, w/16), 24) (``default_beam``);
3. each open survivor is expanded by every next byte (256 children; a
   finished one only by 0x00, the encoding pads with it);
4. at the last level the discoveries are the strings; the top k (with T:
   those estimated >= T) are reported with intervals +- t at confidence
   1 - alpha/m over the m candidates of the last level: simultaneous over
   the candidates, so they cover although the reported strings were selected
   for large estimates (as dyadic.DyadicView.heavy).

Why peeling (``fit_level``). A level with m candidates (up to 256 B) in w
columns gives every heavy node about m C(d, j) / w^j "twins" that share
its cell in j = ceil(d/2) rows (3m/w^2 at d = 3): null candidates whose
median reads the heavy count, so their estimate equals the heavy node's, and
the row-error model below (a random cell of the row) finds it significant.
At Pico size (w = 80, m ~ 6000) that made every heavy string's p-value no
smaller than its twins' and BH kept nothing. Peeling takes the candidates
one at a time, the one whose SMALLEST signed reading (capped by its
parent's estimate: a child counts at most its parent) is largest: a heavy
node reads high in every row, a twin only in the shared ones. Its estimate
(the median of its readings) is subtracted from its d cells, the readings
of the candidates sharing them are updated, and so on until 2B are taken
or the best is below the noise floor (the per-cell noise quantile at
1 - 1/(2w)); BACKFIT sweeps then re-estimate each taken node with the
others' current estimates removed (a node taken early with a twin's share
gives it back). Every candidate is then read from the residual, plus its own
estimate if taken: a twin of a taken heavy node reads ~0 in the shared
rows. This is the greedy recovery of sparse-recovery CountSketch decoding
(matching pursuit), applied per level to the descent's candidates only.

Error model for the p-values (what "set by the noise" means):

* exact level: the estimate of a node of count 0 is the mean of d cells'
  merged noise; P(mean >= e) from the exact pmf of the sum of the d * draws
  independent draws (estimators.noise_distribution; a normal tail of the
  same variance if the support is too large to convolve);
* hashed level: per row, P(row reading >= e) ~ (#cells of the row's
  residual with |c| >= e + 1) / (2w) (the data-driven CountSketch model of
  estimators.cs_halfwidth on the residual: a random column of the row with a
  fair sign; the node's own cell is left out, as the error of a node is the
  reading of the counters without its own events, docs/HOST.md "The key
  fact"); the statistic "the j-th largest of the d readings is >= e" has
  tail P(at least j rows >= e) (Poisson-binomial); the p-value is the
  smallest over j = ceil(d/2) .. d times their number (Bonferroni): the
  median's test is the strong one against noise (many devices), the
  minimum's against collisions (a small sketch).
  The model's resolution is ~ (1/2w)^ceil(d/2) for the median and (1/2w)^d
  for the minimum; pansketch.agent.params requires d >= 3 for strhh.
"""

from __future__ import annotations

import hashlib
import math
from statistics import NormalDist
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from pansketch.agent import hashing
from pansketch.agent.strhh import LONG, encode_item, exact_levels, level_prefix
from pansketch.host_tools import fasthash
from pansketch.host_tools.query import estimators
from pansketch.host_tools.query.merge import Merged, NoiseTerm

DEFAULT_FDR = 0.05
BACKFIT = 2  # sweeps re-estimating the peeled nodes (fit_level)
DEFAULT_PRUNE = 0.5  # BH rate at the levels above the last: it only bounds the work (module doc)


def node_streams(nodes: Sequence[bytes], lprefix: bytes, d: int) -> np.ndarray:
    """Hash streams of prefix nodes (canonical b"b" + node), equal to pansketch.agent.hashing.digest."""
    if hashing.n_blocks(d) > 1:
        return fasthash.streams_prefix(list(nodes), lprefix, d)
    base = hashlib.sha256(lprefix + b"b")
    cp = base.copy
    buf = bytearray()
    for x in nodes:
        h = cp()
        h.update(x)
        buf += h.digest()
    return np.frombuffer(bytes(buf), dtype=np.uint8).reshape(len(nodes), 32)


def exact_counters(items: Iterable[Any], L: int, d: int, w: int, salt: str | bytes,
                   weights: Optional[Iterable[int]] = None) -> np.ndarray:
    """Noise-free counters (L*d, w) of items, equal to pansketch.agent.strhh.PrefixSketch (weights unclipped)."""
    agg: dict[bytes, int] = {}
    its = list(items)
    ws = [1] * len(its) if weights is None else [int(v) for v in weights]
    for it, v in zip(its, ws):
        e = encode_item(it, L)
        if e is not None:
            agg[e] = agg.get(e, 0) + v
    out = np.zeros((L, d, w), dtype=np.int64)
    ex = exact_levels(L, w)
    prefix = hashing.salt_prefix(salt)
    for lv in range(L - 1, -1, -1):
        if lv < L - 1:
            nxt: dict[bytes, int] = {}
            for e, v in agg.items():
                k = e[:lv + 1]
                nxt[k] = nxt.get(k, 0) + v
            agg = nxt
        keys = [k for k, v in agg.items() if v]
        if not keys:
            continue
        vals = np.array([agg[k] for k in keys], dtype=np.int64)
        if lv < ex:
            idx = np.array([int.from_bytes(k, "big") for k in keys], dtype=np.int64)
            out[lv, :, :] += np.bincount(idx, weights=vals, minlength=w).astype(np.int64)[None, :w]
            continue
        cols, signs = fasthash.cols_signs(node_streams(keys, level_prefix(prefix, lv), d), d, w)
        for r in range(d):
            out[lv, r] = np.bincount(cols[:, r], weights=vals * signs[:, r], minlength=w).astype(np.int64)
    return out.reshape(L * d, w)


def decode_node(node: bytes) -> tuple[str, bool]:
    """(text, long) of a last-level node: the item, or for a long item its L-2 byte prefix
    (long = True; the tail byte is a hash bucket, shown by :func:`label`)."""
    L = len(node)
    if L >= 2 and node[L - 2] == LONG:
        return node[:L - 2].decode("utf-8", "backslashreplace"), True
    return node.rstrip(b"\x00").decode("utf-8", "backslashreplace"), False


def label(node: bytes) -> str:
    text, long = decode_node(node)
    return text + "\u2026#%02x" % node[-1] if long else text


def bh_keep(p: np.ndarray, q: float) -> np.ndarray:
    """Benjamini-Hochberg step-up at rate q: boolean mask of the discoveries."""
    m = len(p)
    if not m:
        return np.zeros(0, dtype=bool)
    order = np.argsort(p, kind="stable")
    ok = np.nonzero(p[order] <= q * np.arange(1, m + 1) / m)[0]
    keep = np.zeros(m, dtype=bool)
    if len(ok):
        keep[order[:ok[-1] + 1]] = True
    return keep


class PrefixView:
    """Estimates, p-values and half-widths over merged strhh counters."""

    def __init__(self, counters: np.ndarray, L: int, d: int, w: int, salt: str | bytes,
                 noise: Sequence[NoiseTerm], confidence: float = 0.95) -> None:
        if not 0.5 <= confidence < 1:
            raise ValueError("confidence must be in [0.5, 1)")
        self.L, self.d, self.w = L, d, w
        self.C = np.asarray(counters, dtype=np.int64).reshape(L, d, w)
        self.exact = exact_levels(L, w)
        self.prefix = hashing.salt_prefix(salt)
        self.noise = [t for t in noise if t.count > 0]
        self.confidence = confidence
        self.alpha = 1.0 - confidence
        self._sorted: dict[int, np.ndarray] = {}
        self._t: dict[tuple[int, float], float] = {}
        self._upper: Optional[tuple[np.ndarray, int, float]] = None
        self._floor: Optional[float] = None

    @classmethod
    def of(cls, m: Merged, salt: str | bytes, confidence: float = 0.95) -> "PrefixView":
        if m.kind != "strhh":
            raise ValueError("releases of kind %r hold no string prefixes (need kind strhh)" % m.kind)
        return cls(m.counters, m.b, m.d, m.w, salt, m.noise, confidence)

    def _dterms(self) -> list[NoiseTerm]:
        return [NoiseTerm(t.mech, t.num, t.den, t.count * self.d) for t in self.noise]

    def node_est(self, level: int, nodes: Sequence[bytes]) -> np.ndarray:
        return self.node_readings(level, nodes)[0]

    def node_readings(self, level: int, nodes: Sequence[bytes]) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """(estimates, |own cells| (n, d) on hashed levels, None on exact ones)."""
        if not len(nodes):
            return np.zeros(0), None
        C = self.C[level]
        if level < self.exact:
            idx = np.array([int.from_bytes(x, "big") for x in nodes], dtype=np.int64)
            return C[:, idx].mean(axis=0), None
        st = node_streams(nodes, level_prefix(self.prefix, level), self.d)
        cols, signs = fasthash.cols_signs(st, self.d, self.w)
        vals = fasthash.row_values(C, cols, signs, "cs")
        return np.median(vals, axis=1), np.abs(vals)

    def pvalues(self, level: int, est: np.ndarray, own: Optional[np.ndarray] = None) -> np.ndarray:
        """One-sided P(a node of count 0 is estimated >= est) under the level's error model
        (``own``: the nodes' own |cells|, left out of the row's error sample as in C_o)."""
        e = np.asarray(est, dtype=np.float64)
        if level < self.exact:
            if not self.noise:
                return np.where(e > 0, 0.0, 1.0)
            if self._upper is None:
                dist = estimators.noise_distribution(self._dterms())
                if dist is None:
                    self._upper = (np.zeros(0), 0, 0.0)
                else:
                    z, slack = dist
                    self._upper = (np.cumsum(z[::-1])[::-1], (len(z) - 1) // 2, slack)
            up, s, slack = self._upper
            if not len(up):  # too wide to convolve: the normal tail of the same variance
                sd = math.sqrt(sum(t.variance() for t in self._dterms()))
                return np.array([0.5 * math.erfc(self.d * x / (sd * math.sqrt(2))) for x in e])
            i = np.ceil(self.d * e - 1e-9).astype(np.int64) + s  # P(sum >= ceil(d e))
            p = np.where(i >= len(up), 0.0, up[np.clip(i, 0, len(up) - 1)])
            return np.minimum(1.0, np.where(i <= 0, 1.0, p) + slack)
        if level not in self._sorted:
            self._sorted[level] = np.sort(np.abs(self.C[level]), axis=1)
        a = self._sorted[level]
        cnt = np.stack([self.w - np.searchsorted(a[r], e, side="left") for r in range(self.d)], axis=1)
        if own is not None:
            cnt = cnt - (own >= e[:, None])
        P = np.minimum(1.0, (cnt + 1) / self.w) / 2.0
        # median >= e needs at least ceil(d/2) of the d readings >= e
        return np.where(e > 0, estimators._pb_tails(P, (self.d + 1) // 2), 1.0)

    def halfwidth(self, level: int, a: float) -> float:
        """t with P(|node estimate - true count| > t) <= a at this level (as dyadic.DyadicView)."""
        key = (level, a)
        if key not in self._t:
            if level < self.exact:
                self._t[key] = (estimators.noise_tail_bound(self._dterms(), a / 2.0) / self.d) if self.noise else 0.0
            else:
                self._t[key] = estimators.cs_halfwidth(self.C[level], a)
        return self._t[key]

    def children(self, nodes: Sequence[bytes]) -> list[bytes]:
        out: list[bytes] = []
        allb = [bytes([c]) for c in range(256)]
        for p in nodes:
            if p[-1] == 0:
                out.append(p + b"\x00")
            else:
                out.extend(p + c for c in allb)
        return out

    def _peel_floor(self) -> float:
        """A cell value pure noise exceeds in about one cell of a row (normal quantile of the
        per-cell noise at 1 - 1/(2w)): peeling stops below it (a heuristic cut, not a test)."""
        if self._floor is None:
            sd = math.sqrt(sum(t.variance() for t in self.noise))
            self._floor = sd * NormalDist().inv_cdf(1.0 - 1.0 / (2 * self.w)) if sd > 0 else 0.0
        return self._floor

    def fit_level(self, level: int, nodes: Sequence[bytes], cap_est: Optional[np.ndarray],
                  budget: int) -> tuple[np.ndarray, np.ndarray]:
        """(estimates, p-values) of the candidates of a hashed level by greedy peeling (module doc).

        Repeatedly take the candidate whose smallest signed reading (capped by its parent's
        estimate) is largest, fix its estimate at the median of its readings and subtract it
        from its d cells, until ``budget`` candidates are taken or the best is below the noise
        floor. Then every candidate is read from the residual (plus its own estimate if taken)
        and tested against the residual's cells (:meth:`pvalues_residual`)."""
        d, w = self.d, self.w
        st = node_streams(nodes, level_prefix(self.prefix, level), d)
        cols, signs = fasthash.cols_signs(st, d, w)
        R = self.C[level].astype(np.float64)
        rows = np.arange(d)[None, :]
        rd = R[rows, cols] * signs
        m = len(nodes)
        order = [np.argsort(cols[:, r], kind="stable") for r in range(d)]
        starts = [np.searchsorted(cols[order[r], r], np.arange(w + 1)) for r in range(d)]
        score = rd.min(axis=1)
        if cap_est is not None:
            score = np.minimum(score, cap_est)
        taken = np.zeros(m, dtype=bool)
        est = np.zeros(m)
        floor = self._peel_floor()
        seq: list[int] = []

        def move(i: int, v: float) -> np.ndarray:
            """Subtract v of node i from its cells; update the readings sharing them."""
            aff = []
            for r in range(d):
                c = cols[i, r]
                R[r, c] -= signs[i, r] * v
                a = order[r][starts[r][c]:starts[r][c + 1]]
                rd[a, r] = R[r, c] * signs[a, r]
                aff.append(a)
            return np.concatenate(aff)

        for _ in range(min(budget, m)):
            i = int(np.argmax(score))
            if score[i] <= floor:
                break
            e = float(np.median(rd[i]))
            taken[i] = True
            est[i] = e
            seq.append(i)
            a = move(i, e)
            score[a] = rd[a].min(axis=1)
            if cap_est is not None:
                score[a] = np.minimum(score[a], cap_est[a])
            score[taken] = -np.inf
        for _ in range(BACKFIT):  # re-estimate each taken node with the others' current estimates removed
            for i in seq:
                move(i, -est[i])
                est[i] = float(np.median(rd[i]))
                move(i, est[i])
        fin = rd + est[:, None]
        return np.median(fin, axis=1), self.pvalues_residual(R, fin, cols)

    def pvalues_residual(self, R: np.ndarray, fin: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """One-sided p-values of candidates with readings ``fin`` (n, d) against the residual R.

        A null candidate reads a random cell of each row with a fair sign, so P(row reading >= e)
        ~ (#cells of the row with |R| >= e, own cell left out, + 1) / (2w). For j = ceil(d/2)..d
        the statistic "the j-th largest reading is >= e" has tail P(at least j rows >= e)
        (Poisson-binomial); the p-value is the smallest of these d - ceil(d/2) + 1 tails times
        their number (Bonferroni): j = ceil(d/2) is the median's test (strong against noise),
        j = d the minimum's (a null colliding with heavy cells in some rows fails it)."""
        d, w = self.d, self.w
        a = np.sort(np.abs(R), axis=1)
        srt = np.sort(fin, axis=1)
        owncell = np.abs(R[np.arange(d)[None, :], cols])
        js = range((d + 1) // 2, d + 1)
        best = np.ones(fin.shape[0])
        for j in js:
            e = srt[:, d - j]
            cnt = np.stack([w - np.searchsorted(a[r], e, side="left") for r in range(d)], axis=1)
            cnt = cnt - (owncell >= e[:, None])
            P = np.minimum(1.0, (cnt + 1) / w) / 2.0
            best = np.minimum(best, np.where(e > 0, estimators._pb_tails(P, j), 1.0))
        return np.minimum(1.0, best * len(js))

    def heavy(self, k: int, threshold: Optional[float] = None, fdr: float = DEFAULT_FDR,
              beam: Optional[int] = None, prune: float = DEFAULT_PRUNE
              ) -> tuple[list[tuple[bytes, float]], float, dict[str, Any]]:
        """Top-k strings by prefix descent: ([(node, estimate)], half-width, stats) (module doc)."""
        if k < 1:
            raise ValueError("k must be at least 1")
        if not 0 < fdr < 1:
            raise ValueError("the false-discovery rate must be in (0, 1)")
        B = beam if beam is not None else default_beam(k, self.w)
        nodes: list[bytes] = [bytes([c]) for c in range(256)]
        examined: list[int] = []
        est = np.zeros(0)
        cap: Optional[np.ndarray] = None
        for lv in range(self.L):
            if lv:
                counts = [1 if p[-1] == 0 else 256 for p in nodes]
                cap = np.repeat(est, counts)  # a child counts at most its parent's count
                nodes = self.children(nodes)
            examined.append(len(nodes))
            if lv < self.exact:
                est, own = self.node_readings(lv, nodes)
                p = self.pvalues(lv, est, own)
            else:
                est, p = self.fit_level(lv, nodes, cap, 2 * B)
            keep = bh_keep(p, fdr if lv == self.L - 1 else max(fdr, prune))
            if threshold is not None:
                keep &= est >= threshold - self.halfwidth(lv, self.alpha)
            idx = np.nonzero(keep)[0]
            if idx.size > B:  # the beam: B open prefixes and B finished strings (ending in the end marker)
                fin = np.array([nodes[i][-1] == 0 for i in idx], dtype=bool)
                parts = []
                for sub in (idx[fin], idx[~fin]):
                    if sub.size > B:
                        sub = sub[np.argpartition(-est[sub], B - 1)[:B]]
                    parts.append(sub)
                idx = np.sort(np.concatenate(parts))
            nodes = [nodes[i] for i in idx]
            est = est[idx]
            if not nodes:
                break
        stats = {"examined": examined, "beam": B, "fdr": fdr}
        m = max(1, examined[-1] if len(examined) == self.L else 1)
        t = self.halfwidth(self.L - 1, self.alpha / m)
        if not nodes:
            return [], t, stats
        order = sorted(range(len(nodes)), key=lambda i: (-float(est[i]), nodes[i]))
        out = [(nodes[i], float(est[i])) for i in order]
        if threshold is not None:
            out = [(x, e) for x, e in out if e >= threshold]
        return out[:k], t, stats


def default_beam(k: int, w: int = 1024) -> int:
    """Prefixes kept per level: 2k + 4, and at least min(64, w/16), at least 24.

    A wide beam on a narrow sketch adds candidates (256 per open prefix), hence collisions
    with the heavy cells, faster than it adds recall (w = 80: 24 beats 64); a wide sketch
    needs room for the busy subtrees whose prefixes all outweigh a short heavy string
    (host_tools/bench/strheavy.py, tests/test_e2e_strhh.py)."""
    return max(2 * k + 4, min(64, w // 16), 24)


@dataclass
class HeavyString:
    rank: int
    node: bytes
    estimate: float
    lo: float
    hi: float

    def to_dict(self) -> dict[str, Any]:
        text, long = decode_node(self.node)
        return {"rank": self.rank, "item": text, "long": long, "label": label(self.node),
                "hex": self.node.hex(), "estimate": round(self.estimate, 3), "lo": round(self.lo, 3),
                "hi": round(self.hi, 3)}
