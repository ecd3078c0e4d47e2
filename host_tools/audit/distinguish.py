"""Distinguishers: likelihood-ratio tests on the touched cells.

The adversary knows everything but the event (both neighbouring streams,
the salt, the parameters, the mechanism): so it knows the exact part E of
every array in both worlds and the structure C of the noise (model.py).
A statistic is a ±1 combination u of at most three arrays of the view
(as in ``tests/test_intruder_view.py``); on the d cells the target touches,

    s_r = sum_i u_i (V_i - E_i(0))[cell_r] = world * m_r + sum_k a_k Z_k[cell_r],

with m = u·δ (the event's trace) and a = u·C (the noise draws left in it).
The proof of docs/PRIVACY.md says every event sits in one increment of the
view carrying its own full-scale draw: the best u leaves exactly one draw
(a = e_k) next to the event, and then the view is a bijective image of
independent increments, so the likelihood ratio of that one statistic *is*
the likelihood ratio of the whole view (the other increments have the same
law in both worlds). Code that breaks the proof shows up as a u with fewer
draws (none: an exact recovery) or a larger m.

For each u the test is the Neyman–Pearson one: the log-likelihood ratio

    LLR = sum_r log P_a(s_r - m_r) - log P_a(s_r)

with P_a the exact pmf of sum_k a_k Z_k (convolution of the dlap or dgauss
pmfs, each Z_k with its own distribution: under ``persist_noise = "shadow"``
the internal and the output noise have different scales), thresholded. When the intruder reads CSPRNG bytes in RAM that fix
some future draws (a kept Rng tail), those draws are subtracted from
s_r and removed from a before the LLR (:func:`llr_known`).

Each candidate also gets the pooled per-cell tail test (end of this module),
whose precision does not depend on events of probability ~2^-cells.
Candidate statistics, the test, the threshold and the scenario are chosen on a
calibration set; FPR and FNR are then estimated on fresh trials
(Jagielski et al. 2020; stats.py).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from pansketch.agent.noise import NoiseSpec
from pansketch.host_tools.audit import stats
from pansketch.host_tools.audit import device
from pansketch.host_tools.audit.model import Model, Pmf, base_pmf, pmf_mixed, pmf_of


@dataclass
class Candidate:
    view: str
    moment: int | None
    u: tuple[tuple[int, int], ...]  # (array index, coefficient)
    a: np.ndarray  # (K,) noise coefficients left in the statistic
    m: np.ndarray  # (d,) the event's trace on the touched cells
    label: str
    score: float
    parts: tuple["Candidate", ...] = ()  # a joint test: the LLRs of these statistics, summed

    def atoms(self) -> tuple["Candidate", ...]:
        """The single statistics whose LLRs this test sums (itself when it is one)."""
        return self.parts or (self,)


def visible(model: Model, view: str, moment: int | None) -> list[int]:
    """Indices of the arrays a view holds ('release': all releases; 'intrusion':
    RAM at the moment, every state.bin version written by then, all releases)."""
    if view == "release" or moment is None:
        return list(model.release_idx)
    label, ram, n_flash = model.moments[moment]
    return list(ram) + list(model.flash_idx[:n_flash]) + list(model.release_idx)


def candidates(model: Model, view: str, per_moment: int = 3, cap: int = 24, joint: bool = False,
               joint_cap: int = 12, group: int = 2) -> list[Candidate]:
    """The most promising statistics of a view, best first (score = |m|^2 / |a|^2).

    ``joint``: also pairs of statistics of one moment whose noises are
    independent (disjoint draws: a_1 and a_2 have disjoint supports), tested
    by the sum of their LLRs -- the exact LLR of the pair. Under
    ``persist_noise = "shadow"`` the proof puts an event before the intrusion
    in two coordinates (R and one increment of the flash track), each at half
    the budget: only the pair sees the whole loss. At most ``joint_cap``
    pairs are added to the ``cap`` single statistics."""
    cells = [c for c, _ in model.cells]
    sig = model.delta[:, cells]
    wvar = _relative_variances(model)  # None: one distribution, every draw weighs 1
    moments: list[int | None] = [None] if view == "release" else list(range(len(model.moments)))
    out: list[Candidate] = []
    pairs: list[Candidate] = []
    seen: set[tuple] = set()
    for mo in moments:
        vis = []
        rows: set[tuple] = set()
        for i in visible(model, view, mo):
            key: tuple = (tuple(model.C[i]), tuple(sig[i]))
            if key in rows or (not model.C[i].any() and not sig[i].any()):
                continue  # a duplicate, or an array with no noise and no event (e.g. a wiped buffer)
            rows.add(key)
            vis.append(i)
        found: list[Candidate] = []
        for k in (1, 2, 3):
            for idx in itertools.combinations(vis, k):
                for signs in itertools.product((1, -1), repeat=k - 1):
                    u = ((idx[0], 1),) + tuple(zip(idx[1:], signs))
                    a = sum(c * model.C[i] for i, c in u)
                    m = sum(c * sig[i] for i, c in u)
                    if not np.any(m):
                        continue
                    na = float((a * a).sum()) if wvar is None else float((a * a * wvar).sum())
                    score = math.inf if na == 0 else float((m * m).sum()) / na
                    found.append(Candidate(view, mo, u, a, m, _label(model, mo, u), score))
        found.sort(key=lambda c: (-c.score, len(c.u)))
        for c in found[:per_moment]:
            key = (tuple(c.a), tuple(c.m))
            if key not in seen:
                seen.add(key)
                out.append(c)
        if joint:
            for c in _pairs(found, per_moment) + (_groups(found, per_moment, group) if group > 2 else []):
                key = tuple(tuple(x) for p in c.parts for x in (p.a, p.m))
                if key not in seen:
                    seen.add(key)
                    pairs.append(c)
    out.sort(key=lambda c: (-c.score, len(c.u)))
    pairs.sort(key=lambda c: -c.score)
    return out[:cap] + pairs[:joint_cap]


def _variance(spec: NoiseSpec) -> float:
    if spec.mech == "dlap":
        q = math.exp(-spec.den / spec.num)
        return 2 * q / (1 - q) ** 2
    return spec.num / spec.den  # dgauss: ~sigma^2


def _relative_variances(model: Model) -> np.ndarray | None:
    """Variance of each noise array's draws relative to the configured output noise
    (ranks statistics whose noises have different scales); None if all are equal."""
    if not model.specs or len({device.spec_key(s) for s in model.specs}) <= 1:
        return None
    v0 = _variance(model.p.noise)
    return np.array([_variance(s) / v0 for s in model.specs])


def _pairs(found: list[Candidate], keep: int, top: int = 40) -> list[Candidate]:
    """The best pairs of statistics with independent noise (disjoint draws), by summed score."""
    pool = [c for c in found if math.isfinite(c.score)][:top]
    supp = [frozenset(np.nonzero(c.a)[0].tolist()) for c in pool]
    best: list[Candidate] = []
    for i in range(len(pool)):
        for j in range(i + 1, len(pool)):
            if supp[i] & supp[j]:
                continue
            c1, c2 = pool[i], pool[j]
            best.append(Candidate(c1.view, c1.moment, c1.u + c2.u, c1.a + c2.a,  # the draws involved
                                  np.concatenate([c1.m, c2.m]), _joint_label(c1, c2), c1.score + c2.score,
                                  (c1, c2)))
    best.sort(key=lambda c: -c.score)
    return best[:keep]


def _groups(found: list[Candidate], keep: int, size: int, top: int = 40) -> list[Candidate]:
    """Summed evidence (tree mode: every level and later release): from each of the best
    statistics, greedily add the next best whose noise is independent of all chosen so far,
    up to ``size`` statistics; the test sums their LLRs (exact for independent noises)."""
    pool = [c for c in found if math.isfinite(c.score)][:top]
    supp = [frozenset(np.nonzero(c.a)[0].tolist()) for c in pool]
    out: list[Candidate] = []
    seen: set[tuple[int, ...]] = set()
    # two greedy orders: best score first, and fewest arrays first (a sum of two releases would
    # otherwise take the place of the two releases as separate, independently noised atoms)
    orders = (list(range(len(pool))), sorted(range(len(pool)), key=lambda k: (len(pool[k].u), -pool[k].score)))
    for i, order in ((i, o) for o in orders for i in o):
        chosen = [i]
        used = set(supp[i])
        for j in order:
            if len(chosen) >= size:
                break
            if j != i and not (supp[j] & used):
                chosen.append(j)
                used |= supp[j]
        key = tuple(sorted(chosen))
        if len(chosen) < 3 or key in seen:
            continue
        seen.add(key)
        cs = [pool[k] for k in chosen]
        out.append(Candidate(cs[0].view, cs[0].moment, sum((c.u for c in cs), ()), np.sum([c.a for c in cs], axis=0),
                             np.concatenate([c.m for c in cs]), _group_label(cs), sum(c.score for c in cs),
                             tuple(cs)))
    out.sort(key=lambda c: -c.score)
    return out[:keep]


def _group_label(cs: list[Candidate]) -> str:
    where = ""
    terms = []
    for c in cs:
        lab = c.label
        if " @ " in lab:
            lab, where = lab.split(" @ ", 1)
        terms.append("(%s)" % lab)
    return " & ".join(terms) + (" @ " + where if where else "")


def _joint_label(c1: Candidate, c2: Candidate) -> str:
    where = ""
    l1, l2 = c1.label, c2.label
    if " @ " in l1:
        l1, where = l1.split(" @ ", 1)
        l2 = l2.split(" @ ", 1)[0]
        where = " @ " + where
    return "(%s) & (%s)%s" % (l1, l2, where)


def _name(model: Model, i: int) -> str:
    key = model.keys[i]
    if key[0] == "ram":
        return "%s" % key[2]
    return "%s[%d]" % key


def _label(model: Model, mo: int | None, u: tuple[tuple[int, int], ...]) -> str:
    terms = " ".join(("+" if c > 0 else "-") + _name(model, i) for i, c in u).lstrip("+")
    where = "" if mo is None else " @ %s" % model.moments[mo][0]
    return terms + where


class LLR:
    """Log-likelihood ratios of statistics, with the pmfs cached by noise pattern.

    ``base`` is the pmf of every noise array; ``bases`` (optional, one per
    array k) gives each Z_k its own pmf instead (:meth:`for_model`)."""

    def __init__(self, base: Pmf, bases: list[Pmf] | None = None, groups: list[int] | None = None) -> None:
        self.base = base
        self.bases = bases  # None: every array has ``base``
        self.groups = groups  # bases[k] is the group-th distinct pmf (cache keys)
        self._cache: dict[tuple, Pmf] = {}

    @classmethod
    def for_model(cls, model: Model) -> "LLR":
        """One pmf per distinct distribution of the model's noise arrays."""
        p = model.p
        specs = model.specs or [p.noise] * model.K
        uniq: dict[tuple, int] = {}
        pm: list[Pmf] = []
        groups = []
        for sp in specs:
            key = device.spec_key(sp)
            if key not in uniq:
                uniq[key] = len(pm)
                pm.append(base_pmf(sp))
            groups.append(uniq[key])
        if len(pm) <= 1:
            return cls(pm[0] if pm else base_pmf(p.noise))
        return cls(pm[0], [pm[g] for g in groups], groups)

    @property
    def mixed(self) -> bool:
        return self.bases is not None

    def pmf(self, a: np.ndarray) -> Pmf:
        if self.bases is None:
            key: tuple = tuple(sorted(abs(int(x)) for x in a if x))
            if key not in self._cache:
                self._cache[key] = pmf_of(self.base, key)
            return self._cache[key]
        assert self.groups is not None
        terms = sorted((self.groups[k], abs(int(x))) for k, x in enumerate(a) if x)
        key = ("mixed",) + tuple(terms)
        if key not in self._cache:
            first: dict[int, int] = {}
            for k, g in enumerate(self.groups):
                first.setdefault(g, k)
            self._cache[key] = pmf_mixed(tuple((self.bases[first[g]], c) for g, c in terms))
        return self._cache[key]

    def llr(self, cand: Candidate, s: np.ndarray) -> np.ndarray:
        """LLR of (T, d) statistics (no known draws): one pmf for all trials."""
        P = self.pmf(cand.a)
        return (P.logpmf(s - cand.m[None, :]) - P.logpmf(s)).sum(axis=1)

    def llr_known(self, cand: Candidate, s: np.ndarray, known: list[dict[int, int]], cells: list[int], n: int) -> np.ndarray:
        """LLR when the intruder knows some draws (global index k*n + cell -> value)."""
        out = np.zeros(s.shape[0])
        nzk = [k for k in range(len(cand.a)) if cand.a[k]]
        for t in range(s.shape[0]):
            tot = 0.0
            for r, cell in enumerate(cells):
                x = int(s[t, r])
                a = cand.a.copy()
                for k in nzk:
                    g = k * n + cell
                    if g in known[t]:
                        x -= int(a[k]) * known[t][g]
                        a[k] = 0
                P = self.pmf(a)
                tot += float(P.logpmf(np.array([x - int(cand.m[r])]))[0] - P.logpmf(np.array([x]))[0])
            out[t] = tot
        return out


@dataclass
class Test:
    tau: float
    eps: float  # Clopper–Pearson ε lower bound on the set it was measured on
    fp: int
    fn: int
    n0: int
    n1: int


def counts(l0: np.ndarray, l1: np.ndarray, tau: float) -> tuple[int, int]:
    """(false positives, false negatives) of 'world 1 iff LLR >= tau'."""
    return int((l0 >= tau).sum()), int((l1 < tau).sum())


def best_threshold(l0: np.ndarray, l1: np.ndarray, delta: float) -> Test:
    """The threshold with the largest Clopper–Pearson ε bound on this (calibration) set.

    All distinct LLR values are candidates (at most 400 quantiles when the
    LLR is nearly continuous); a cheap upper-bound proxy ranks them and the
    exact Clopper–Pearson bound decides among the best ten.
    """
    allv = np.unique(np.concatenate([l0, l1]))
    if len(allv) > 400:
        allv = np.unique(np.quantile(np.concatenate([l0, l1]), np.linspace(0, 1, 401)))
    s0 = np.sort(l0)
    s1 = np.sort(l1)
    n0, n1 = len(l0), len(l1)
    fp = n0 - np.searchsorted(s0, allv, side="left")
    fn = np.searchsorted(s1, allv, side="left")
    fpr = (fp + 2 + 2 * np.sqrt(fp + 1)) / n0
    fnr = (fn + 2 + 2 * np.sqrt(fn + 1)) / n1
    with np.errstate(divide="ignore", invalid="ignore"):
        prox = np.maximum(np.log(np.clip(1 - delta - fnr, 1e-300, None) / fpr),
                          np.log(np.clip(1 - delta - fpr, 1e-300, None) / fnr))
    best = Test(math.inf, 0.0, 0, n1, n0, n1)
    for j in np.argsort(-prox)[:10]:
        e = stats.eps_lower_bound(int(fp[j]), n0, int(fn[j]), n1, delta)
        if e > best.eps:
            best = Test(float(allv[j]), e, int(fp[j]), int(fn[j]), n0, n1)
    return best


# -- the pooled per-cell tail test ------------------------------------------------------
#
# A statistic's cells are independent and identically distributed given the world: each cell r
# holds sign(m_r) s_r = world * h + sum_k a_k Z_k[cell_r], the same noise pattern a in every cell
# (every noise array is n independent draws of one distribution, model.py). For the product set
# S = {every cell >= tau}, P_w(S) = P_w(cell >= tau)^k, so an (eps, delta)-DP view satisfies
#
#     P_1(cell >= tau)^k <= e^eps P_0(cell >= tau)^k + delta,
#
# and one-sided Clopper–Pearson bounds on the two per-cell rates, each measured on the k cells of
# every trial pooled (T k independent Bernoulli observations per world), give
#
#     eps_lb = log(b_lo^k - delta) - k log a_hi.
#
# For the discrete Laplace the set {all cells >= 1} is where the worst-case ratio e^(k h / t) is
# reached, so this test is exactly tight, and pooling makes its precision grow with the number of
# cells: an audit of k touched cells needs no event of probability ~2^-k, which the LLR test over
# whole trials does. A joint statistic multiplies the product sets of its atoms (independent noise:
# disjoint draws); its 2 x atoms rate bounds share the 95 % (Bonferroni). tau is chosen from the
# exact pmf before any trial is drawn.


@dataclass
class CellAtom:
    atom: int  # index into Candidate.atoms()
    cells: np.ndarray  # indices r of the cells used (|m_r| = h)
    sign: np.ndarray  # sign(m_r) of those cells
    h: int  # the event's shift per cell
    tau: int  # world 1 iff every cell's sign(m_r) s_r >= tau


@dataclass
class CellPlan:
    atoms: list[CellAtom]
    label: str
    predicted: float  # the bound expected at the planned number of trials (normal approximation)


def _tails(P: Pmf) -> tuple[np.ndarray, np.ndarray]:
    """(x, P[X >= x]) over the pmf's support."""
    x = np.arange(P.lo, P.lo + len(P.p))
    tail = np.cumsum(P.p[::-1])[::-1]
    return x, np.clip(tail, 0.0, 1.0)


def _approx_bound(p: np.ndarray, n: float, z: float, upper: bool) -> np.ndarray:
    """A normal (Wilson) approximation of the one-sided bound on a rate p from n trials (planning only)."""
    c = z * z / n
    mid = (p + c / 2) / (1 + c)
    half = z * np.sqrt(np.maximum(p * (1 - p) / n + c / (4 * n), 0.0)) / (1 + c)
    return np.clip(mid + half if upper else mid - half, 1e-300, 1.0)


def _product_eps(logb: float, loga: float, delta: float) -> float:
    if delta:
        num = math.exp(logb) - delta if logb > -700 else -1.0
        return math.log(num) - loga if num > 0 else 0.0
    return logb - loga


def plan_product(cand: Candidate, L: "LLR", per_world: int, delta: float, alpha: float = stats.ALPHA) -> CellPlan | None:
    """The per-cell thresholds of the pooled tail test of ``cand`` (None: no usable cells)."""
    atoms = cand.atoms()
    z = _z_one_sided(alpha / (2 * len(atoms)))
    plans: list[tuple[CellAtom, np.ndarray, np.ndarray, np.ndarray, int]] = []
    for ai, a in enumerate(atoms):
        mag = np.abs(a.m).astype(np.int64)
        if not mag.any():
            return None
        vals, cnt = np.unique(mag[mag > 0], return_counts=True)
        h = int(vals[np.argmax(cnt)])
        cells = np.nonzero(mag == h)[0]
        k = len(cells)
        P = L.pmf(a.a)
        x, t0 = _tails(P)
        # P[X + h >= tau] = P[X >= tau - h]
        t1 = np.concatenate([np.ones(h), t0])[: len(t0)] if h < len(t0) else np.ones_like(t0)
        n = float(per_world * k)
        ok = (t1 * n >= 5) & (t0 < 1)
        if not ok.any():
            return None
        lb = np.log(_approx_bound(t1, n, z, False))
        la = np.log(_approx_bound(t0, n, z, True))
        plans.append((CellAtom(ai, cells, np.sign(a.m[cells]).astype(np.int64), h, 0), x[ok], k * lb[ok],
                      k * la[ok], k))
    # coordinate ascent over the atoms' thresholds (separable when delta = 0)
    pick = [int(np.argmax(lb - la)) for _, _, lb, la, _ in plans]
    for _ in range(2 if delta and len(plans) > 1 else 0):
        for i, (_, _, lb, la, _) in enumerate(plans):
            rest_b = sum(plans[j][2][pick[j]] for j in range(len(plans)) if j != i)
            rest_a = sum(plans[j][3][pick[j]] for j in range(len(plans)) if j != i)
            scores = [_product_eps(rest_b + b, rest_a + a_, delta) for b, a_ in zip(lb, la)]
            pick[i] = int(np.argmax(scores))
    if delta and len(plans) == 1:
        _, _, lb, la, _ = plans[0]
        pick[0] = int(np.argmax([_product_eps(b, a_, delta) for b, a_ in zip(lb, la)]))
    out = []
    for (ca, xs, _, _, _), j in zip(plans, pick):
        ca.tau = int(xs[j])
        out.append(ca)
    pred = _product_eps(sum(p[2][j] for p, j in zip(plans, pick)), sum(p[3][j] for p, j in zip(plans, pick)), delta)
    taus = ",".join(str(c.tau) for c in out)
    return CellPlan(out, "cells>=%s: %s" % (taus, cand.label), max(pred, 0.0))


def _z_one_sided(a: float) -> float:
    """The standard normal quantile 1 - a (planning only; bisection on erfc)."""
    lo, hi = 0.0, 40.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if 0.5 * math.erfc(mid / math.sqrt(2)) > a:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def cell_counts(ca: CellAtom, s: np.ndarray) -> tuple[int, int]:
    """(cells >= tau, cells) of one atom's (T, d) statistics of one world, pooled over trials."""
    x = s[:, ca.cells] * ca.sign[None, :]
    return int((x >= ca.tau).sum()), int(x.size)


def product_bound(plan: CellPlan, counts: list[tuple[int, int, int, int]], delta: float,
                  alpha: float = stats.ALPHA) -> float:
    """eps lower bound of the pooled tail test from (world-0 hits, world-0 cells, world-1 hits,
    world-1 cells) per atom; the 2 x atoms one-sided bounds hold together with 1 - alpha."""
    a = alpha / len(plan.atoms)  # two-sided alpha/atoms = one-sided alpha/(2 atoms) per bound
    logb = loga = 0.0
    for ca, (h0, n0, h1, n1) in zip(plan.atoms, counts):
        k = len(ca.cells)
        b_lo = stats.cp_lower(h1, n1, a)
        if b_lo <= 0:
            return 0.0
        logb += k * math.log(b_lo)
        loga += k * math.log(stats.cp_upper(h0, n0, a))
    return max(_product_eps(logb, loga, delta), 0.0)
