"""Privacy ledger: the guarantee spent per device and window, and fleet-wide.

Unit of privacy: one event (docs/ARCHITECTURE.md "Threat model and unit of privacy"). In ``window`` and ``keep`` mode
every event of a device lands in exactly one accumulator, and each
accumulator is released exactly once, with internal and output noise at
the calibrated scale; the release's guarantee covers the event against
every release plus one intrusion (agent/calibrate.py, docs/ARCHITECTURE.md "Release
modes"). Releases of a device hold disjoint events (epochs, parts of an
epoch, windows), so by parallel composition:

* per device and window: the guarantee is the largest per-release one
  among its releases (normally all equal);
* per device overall: the largest over its windows (not the sum: an
  event is in one window only);
* fleet per window: the largest over devices (an event happens on one
  device).

Reported: eps for discrete Laplace (pure eps-DP); for the discrete
Gaussian rho (zCDP) and the eps it implies at the configured delta
(``[query] delta``, default :data:`DEFAULT_DELTA`) by the tight conversion of
Canonne, Kamath & Steinke 2020 Cor. 13 (zcdp_to_dp, below):
the same conversion and default delta as ``pansketch audit``'s claim, so one
config has one eps figure everywhere (status, dashboard, metrics, audit). The
guarantee is recomputed from the noise a release carries
(pansketch.agent.calibrate.guarantee of ``nout``), not copied from its ``budget``;
decode.py has already refused releases where the two disagree. It does
not depend on ``nz``: the nz - 2 extra internal draws a release may carry
(re-added after each persist or restart, agent/recorder.py) are fresh
independent noise that only adds protection, so the guarantee stays the
one of the calibrated spec.

Queries are post-processing of releases and spend nothing.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Iterable, Optional

from pansketch.agent import calibrate
from pansketch.agent.noise import NoiseSpec
from pansketch.host_tools.store.rows import StoredRelease

def zcdp_to_dp_bun_steinke(rho: float, delta: float) -> float:
    """ε = ρ + 2 sqrt(ρ ln(1/δ)) (Bun & Steinke 2016, Proposition 1.3)."""
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def zcdp_delta(rho: float, eps: float) -> float:
    """Smallest δ the tight conversion gives for ρ-zCDP at ε.

    Canonne, Kamath & Steinke 2020, Corollary 13 (after Asoodeh et al.):
    ρ-zCDP implies (ε, δ)-DP with
    δ = inf_{α>1} exp((α−1)(αρ−ε)) / (α−1) · (1 − 1/α)^α.
    The infimum over α is taken on a fine logarithmic grid (an upper bound on
    the infimum, so the conversion stays valid).
    """
    best = 1.0
    for i in range(1, 4001):
        alpha = 1.0 + 10 ** (-4 + 8 * i / 4000.0)
        lg = (alpha - 1.0) * (alpha * rho - eps) - math.log(alpha - 1.0) + alpha * math.log1p(-1.0 / alpha)
        if lg < 700:
            best = min(best, math.exp(lg))
    return best


@functools.lru_cache(maxsize=4096)
def zcdp_to_dp(rho: float, delta: float) -> float:
    """ε such that ρ-zCDP implies (ε, δ)-DP, by the tight conversion of :func:`zcdp_delta`.

    Bisection on ε; never larger than the Bun–Steinke value. The one conversion of every ε
    figure (audit claims, ``pansketch status``, the dashboard, metrics: host_tools/store/ledger.py),
    so it is vectorised over the same α grid as :func:`zcdp_delta` (milliseconds, not a second).
    """
    import numpy as np

    alpha = 1.0 + 10.0 ** (-4 + 8 * np.arange(1, 4001) / 4000.0)
    c1 = alpha - 1.0
    base = c1 * alpha * rho - np.log(c1) + alpha * np.log1p(-1.0 / alpha)  # lg at eps = 0
    lo, hi = 0.0, zcdp_to_dp_bun_steinke(rho, delta)
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lg = base - c1 * mid
        lg = lg[lg < 700]
        d = min(1.0, math.exp(float(lg.min()))) if lg.size else 1.0
        if d > delta:
            lo = mid
        else:
            hi = mid
    return hi


# delta of every (eps, delta) figure unless configured: host.toml [query] delta, audit --delta
DEFAULT_DELTA = 1e-6


@dataclass
class Guarantee:
    """Per-event guarantee: eps (dlap) and/or rho (dgauss), and eps at ``delta``."""

    eps: Optional[Fraction] = None  # pure DP part (dlap releases)
    rho: Optional[Fraction] = None  # zCDP part (dgauss releases)
    delta: float = 1e-6

    @property
    def eps_delta(self) -> float:
        """eps of the (eps, delta)-DP guarantee implied by both parts (their max)."""
        out = 0.0
        if self.eps is not None:
            out = max(out, float(self.eps))
        if self.rho is not None:
            out = max(out, zcdp_to_dp(float(self.rho), self.delta))
        return out

    def update(self, other: "Guarantee") -> None:
        if other.eps is not None and (self.eps is None or other.eps > self.eps):
            self.eps = other.eps
        if other.rho is not None and (self.rho is None or other.rho > self.rho):
            self.rho = other.rho

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        if self.eps is not None:
            d["eps"] = _frac(self.eps)
        if self.rho is not None:
            d["rho"] = _frac(self.rho)
        d["eps_at_delta"] = math.ceil(self.eps_delta * 1e6) / 1e6  # rounded up: never a smaller eps than proven
        d["delta"] = self.delta if self.rho is not None else 0.0
        return d

    def text(self) -> str:
        """One guarantee per mechanism: dlap releases' eps and dgauss releases' rho (with the eps it gives
        at delta) are figures for different devices or windows, so with both each is named by its mechanism
        rather than joined into one string that reads as one guarantee."""
        parts = []
        if self.eps is not None:
            parts.append("eps=%s" % _frac(self.eps))
        if self.rho is not None:
            eps_rho = math.ceil(zcdp_to_dp(float(self.rho), self.delta) * 1e6) / 1e6
            parts.append("rho=%s (eps=%.3f at delta=%g)" % (_frac(self.rho), eps_rho, self.delta))
        if len(parts) == 2:
            return "dlap releases: %s; dgauss releases: %s" % tuple(parts)
        return parts[0] if parts else "-"


def _frac(f: Fraction) -> str:
    return str(f.numerator) if f.denominator == 1 else "%d/%d" % (f.numerator, f.denominator)


def release_guarantee(r: StoredRelease, delta: float) -> Guarantee:
    """The per-event guarantee of one release, from the noise it carries."""
    eps, rho = noise_guarantee(r.mech, r.nout[0], r.nout[1], r.kind, r.d, r.clip, r.L)
    return Guarantee(eps=eps, rho=rho, delta=delta)


@functools.lru_cache(maxsize=1024)
def noise_guarantee(mech: str, nout_num: int, nout_den: int, kind: str, d: int, clip: int,
                    L: int) -> tuple[Optional[Fraction], Optional[Fraction]]:
    """(eps, rho) of one release from its noise and shape (one of them None); a fleet's releases share a
    few, so each is calibrated once."""
    # kind dbits: one item moves one of the d per-level counts by at most 1 (agent/dbits.py)
    name, (n, dd) = calibrate.guarantee(NoiseSpec(mech, nout_num, nout_den), 1 if kind == "dbits" else d, clip, L)
    return (Fraction(n, dd), None) if name == "eps" else (None, Fraction(n, dd))


def union(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted disjoint union of half-open integer ranges."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def gaps(covered: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """Sub-ranges of [lo, hi) not in ``covered`` (sorted, disjoint)."""
    out: list[tuple[int, int]] = []
    cur = lo
    for a, b in covered:
        if b <= cur:
            continue
        if a >= hi:
            break
        if a > cur:
            out.append((cur, min(a, hi)))
        cur = max(cur, b)
    if cur < hi:
        out.append((cur, hi))
    return out


@dataclass
class WindowEntry:
    device: str
    win_s: int
    win: int
    ep_s: int
    releases: int = 0
    ranges: list[tuple[int, int]] = field(default_factory=list)  # [elo, ehi) of its releases
    guarantee: Guarantee = field(default_factory=Guarantee)

    @property
    def covered(self) -> list[tuple[int, int]]:
        """Union of the releases' epoch ranges, sorted and disjoint."""
        return union(self.ranges)

    @property
    def missing(self) -> list[tuple[int, int]]:
        """Epoch ranges of this window no release covers."""
        lo = self.t0 // self.ep_s
        hi = self.t1 // self.ep_s
        return gaps(self.covered, lo, hi)

    @property
    def t0(self) -> int:
        return self.win * self.win_s

    @property
    def t1(self) -> int:
        return (self.win + 1) * self.win_s

    @property
    def epochs_expected(self) -> int:
        return self.win_s // self.ep_s


@dataclass
class Ledger:
    delta: float
    windows: list[WindowEntry]  # sorted by (device, win_s, win)

    # device -> its window entries, built on the first per-device lookup. A report asks for every
    # device in turn; scanning all N*W entries per lookup made that N^2*W (hours at 10^4 devices).
    _by_device: Optional[dict[str, list[WindowEntry]]] = field(default=None, repr=False, compare=False)

    def device(self, dev: str) -> Guarantee:
        if self._by_device is None:
            idx: dict[str, list[WindowEntry]] = {}
            for e in self.windows:
                idx.setdefault(e.device, []).append(e)
            self._by_device = idx
        g = Guarantee(delta=self.delta)
        for e in self._by_device.get(dev, ()):  # same entries in the same order as a full scan
            g.update(e.guarantee)
        return g

    def fleet_windows(self) -> list[tuple[int, int, int, Guarantee]]:
        """(win_s, win, number of devices, max guarantee) per window, in time order."""
        acc: dict[tuple[int, int], tuple[int, Guarantee]] = {}
        for e in self.windows:
            k = (e.win_s, e.win)
            n, g = acc.get(k, (0, Guarantee(delta=self.delta)))
            g.update(e.guarantee)
            acc[k] = (n + 1, g)
        return [(k[0], k[1], n, g) for k, (n, g) in sorted(acc.items(), key=lambda kv: (kv[0][1] * kv[0][0], kv[0][0]))]

    def fleet(self) -> Guarantee:
        g = Guarantee(delta=self.delta)
        for e in self.windows:
            g.update(e.guarantee)
        return g

    def entries(self, devices: Iterable[str],
                cols: Iterable[tuple[int, int]]) -> dict[str, dict[tuple[int, int], WindowEntry]]:
        """device -> (win_s, win) -> entry, of ``devices`` in the windows ``cols`` (the fleet page's grid)."""
        want, keys = set(devices), set(cols)
        out: dict[str, dict[tuple[int, int], WindowEntry]] = {}
        for e in self.windows:
            if e.device in want and (e.win_s, e.win) in keys:
                out.setdefault(e.device, {})[(e.win_s, e.win)] = e
        return out

    def spans(self) -> dict[str, tuple[Optional[tuple[int, int]], dict[int, int]]]:
        """device -> (its largest (win_s, win), its first window per window length)."""
        per: dict[str, list[tuple[int, int]]] = {}
        for e in self.windows:
            per.setdefault(e.device, []).append((e.win_s, e.win))
        return {dev: _spans(ks) for dev, ks in per.items()}


def build(rels: Iterable[StoredRelease], delta: float = 1e-6) -> Ledger:
    """The ledger of all given releases (metadata only; no payload needed)."""
    acc: dict[tuple[str, int, int], WindowEntry] = {}
    for r in rels:
        k = (r.device, r.win_s, r.win)
        e = acc.get(k)
        if e is None:
            e = acc[k] = WindowEntry(r.device, r.win_s, r.win, r.ep_s, guarantee=Guarantee(delta=delta))
        e.releases += 1
        e.ranges.append((r.elo, r.ehi))
        e.guarantee.update(release_guarantee(r, delta))
    return Ledger(delta, [acc[k] for k in sorted(acc)])


def _spans(keys: Iterable[tuple[int, int]]) -> tuple[Optional[tuple[int, int]], dict[int, int]]:
    """The largest (win_s, win) of ``keys`` and the first window per window length."""
    last: Optional[tuple[int, int]] = None
    first: dict[int, int] = {}
    for ws, wn in keys:
        if last is None or (ws, wn) > last:
            last = (ws, wn)
        first[ws] = min(first.get(ws, wn), wn)
    return last, first


@dataclass
class KeptLedger:
    """The ledger's answers from the kept summaries (pansketch.host_tools.store.summary) instead of every
    release: the fleet windows and per-device guarantees as :class:`Ledger` computes them; the entries of
    a few devices and windows (the fleet page's grid) read from those releases alone."""

    delta: float
    store: Any
    rows: list[tuple[int, int, int, Optional[Fraction], Optional[Fraction]]]  # summary.read_windows
    device_spans: dict[str, tuple[Optional[tuple[int, int]], dict[int, int]]] = field(default_factory=dict)
    ep_s: dict[str, int] = field(default_factory=dict)  # device -> its epoch length (devices table)

    def fleet_windows(self) -> list[tuple[int, int, int, Guarantee]]:
        out = [(ws, wn, n, Guarantee(eps=e, rho=r, delta=self.delta)) for ws, wn, n, e, r in self.rows]
        return sorted(out, key=lambda t: (t[1] * t[0], t[0]))

    def fleet(self) -> Guarantee:
        g = Guarantee(delta=self.delta)
        for _ws, _wn, _n, e, r in self.rows:
            g.update(Guarantee(eps=e, rho=r, delta=self.delta))
        return g

    def spans(self) -> dict[str, tuple[Optional[tuple[int, int]], dict[int, int]]]:
        return self.device_spans

    def entries(self, devices: Iterable[str],
                cols: Iterable[tuple[int, int]]) -> dict[str, dict[tuple[int, int], WindowEntry]]:
        keys = set(cols)
        devs = sorted(set(devices))
        if not keys or not devs:
            return {}
        lo = min(ws * wn for ws, wn in keys)
        # one index range per device (device, elo: the key on PostgreSQL and older files, releases_device
        # on SQLite): a time bound alone ran through every device's releases of those windows. Only the
        # columns an entry needs (its window, epochs and the noise its guarantee follows from): building
        # whole StoredRelease rows was most of the grid's cost
        sql = ("SELECT win_s, win, ep_s, elo, ehi, mech, nout_num, nout_den, kind, d, clip, L FROM releases "
               "WHERE device = ? AND elo >= ?")
        out: dict[str, dict[tuple[int, int], WindowEntry]] = {}
        for dev in devs:
            mine: dict[tuple[int, int], WindowEntry] = {}
            for ws, wn, ep_s, elo, ehi, mech, onum, oden, kind, d, clip, L in self.store._q(
                    sql, (dev, lo // max(1, self.ep_s.get(dev, 1)))):
                k = (int(ws), int(wn))
                if k not in keys:
                    continue
                e = mine.get(k)
                if e is None:
                    e = mine[k] = WindowEntry(dev, k[0], k[1], int(ep_s), guarantee=Guarantee(delta=self.delta))
                e.releases += 1
                e.ranges.append((int(elo), int(ehi)))
                eps, rho = noise_guarantee(mech, int(onum), int(oden), kind, int(d), int(clip), int(L))
                e.guarantee.update(Guarantee(eps=eps, rho=rho))
            if mine:
                out[dev] = {k: mine[k] for k in sorted(mine)}
        return out
