"""The audit of kind ``dbits`` (agent/dbits.py): every trial on the real code path.

The view of a dbits device is not a linear function of noise draws (the
state is a bit array of Bernoulli draws), so model.py does not apply. Every
trial runs the real :class:`pansketch.agent.dbits.DistinctRecorder` through the
scenario (device.run: the same flash log, faults and snapshots as the
counting kinds) with the system CSPRNG, and the adversary reads:

* at the intrusion moment, the target's bit b₀ and the number of one-bits of
  its level (all of RAM: the bytearray ``rec.counters``);
* every copy of the target level's count on flash (releases, and the
  ``.tmp`` of a commit that failed) and every published release.

Candidate statistics (the adversary knows both streams, the level and
bucket of the target, p = 1/2 + ε/4 and the dlap(1/ε) output noise):

* ``bit @ m``: b₀ (its LLR is log 2p or log 2(1 − p): the two-sided
  ratios of docs/PRIVACY.md "Distinct counts");
* ``count[j]``: the j-th copy of the level's count (release view);
* ``bit + counts @ m``: log P₁(b₀)/P₀(b₀) plus, for every copy y_j, the LLR of
  y_j − (ones − b₀) under "present" (a fresh Bern(p) bit b₁ + Z) against
  "absent" (b₀ + Z): the evidence of the bit and of every copy of its count,
  summed (two copies with independent Z_out add up: a failed commit).

The statistic and threshold are chosen on a calibration set, the bound is
measured on a fresh evaluation set (Clopper–Pearson, stats.py). Any
statistic gives a valid lower bound; these are the likely strong ones.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import numpy as np

from pansketch.agent.params import Params
from pansketch.agent.rng import SystemSource

from pansketch.host_tools.audit import device, distinguish, stats
from pansketch.host_tools.audit.results import Result, ScenarioAudit, summarize
from pansketch.host_tools.audit.scenarios import Scenario


def _dlap_logpmf(x: np.ndarray, t: float) -> np.ndarray:
    q = math.exp(-1.0 / t)
    return math.log((1 - q) / (1 + q)) - np.abs(x) / t


def _target(p: Params) -> tuple[int, int]:
    """(bit position, level) of the target item in the bit array."""
    from pansketch.agent import hashing
    from pansketch.agent.dbits import DensityBits

    sk = DensityBits(p.d, p.w, hashing.salt_prefix(p.salt), p.budget, bytearray(p.d * p.w // 8))
    pos = sk.position(device.target_item(p))
    return pos, pos // p.w


def _bit(buf: bytes, pos: int) -> int:
    return (buf[pos >> 3] >> (pos & 7)) & 1


def _ones(buf: bytes, level: int, w: int) -> int:
    lo = level * w // 8
    return sum(bin(x).count("1") for x in buf[lo:lo + w // 8])


def features(p: Params, r: device.Run, pos: int, level: int) -> dict[str, float]:
    """Every candidate statistic of one run (see the module docstring)."""
    eps = p.budget[0] / p.budget[1]
    pr = 0.5 + eps / 4.0
    t = p.noise.num / p.noise.den
    # every release is first an outbox .tmp image: the flash log holds every copy, published or not
    copies = [a[level] for a in r.flash if len(a) == p.d]
    out: dict[str, float] = {}
    for j, y in enumerate(copies):
        out["count[%d]" % j] = float(y)
    for mi, m in enumerate(r.moments):
        buf = m.buffers.get("rec.counters")
        if buf is None:
            continue
        b0 = _bit(buf, pos)
        lb = math.log(2 * pr) if b0 else math.log(2 * (1 - pr))
        out["bit @ %d" % mi] = float(b0)
        rest = _ones(buf, level, p.w) - b0
        tot = lb
        for y in copies:
            z = np.array([y - rest - 1, y - rest])
            present = math.log(pr * math.exp(_dlap_logpmf(z[:1], t)[0]) + (1 - pr) * math.exp(_dlap_logpmf(z[1:], t)[0]))
            absent = float(_dlap_logpmf(np.array([y - rest - b0]), t)[0])
            tot += present - absent
        out["bit + counts @ %d" % mi] = tot
    return out


def _sets(p: Params, sc: Scenario, T: int, source: Callable[[], Any], pos: int, level: int,
          view: str) -> tuple[list[str], np.ndarray, np.ndarray]:
    rows: list[list[dict[str, float]]] = [[], []]
    for w in (0, 1):
        for _ in range(T):
            r = device.run(p, sc, w, lambda i: source())
            rows[w].append(features(p, r, pos, level))
    keys = sorted(rows[0][0])
    if view == "release":
        keys = [k for k in keys if k.startswith("count")]
    X = [np.array([[f.get(k, 0.0) for k in keys] for f in rows[w]]) for w in (0, 1)]
    return keys, X[0], X[1]


def audit(p: Params, scs: Iterable[Scenario], views: list[str], trials: int, real_trials: int,
          delta: float, claim: Any, progress: Callable[[str], None] | None = None,
          source: Callable[[], Any] = SystemSource) -> tuple[list[Any], list[Any]]:
    """Audit every scenario on the real code path; returns (per-scenario audits, per-view summaries)."""
    pos, level = _target(p)
    T = min(max(trials // 2, 1), real_trials)
    Tc = min(max(trials // 4, 1), real_trials)
    out = []
    for sc in scs:
        results: dict[str, Any] = {}
        cal: dict[str, float] = {}
        for view in views:
            keys, c0, c1 = _sets(p, sc, Tc, source, pos, level, view)
            best_i, best = 0, distinguish.Test(math.inf, -1.0, 0, 0, 0, 0)
            for i in range(len(keys)):
                for sgn in (1.0, -1.0):  # either tail may be the world-1 side of a count
                    tst = distinguish.best_threshold(sgn * c0[:, i], sgn * c1[:, i], delta)
                    if tst.eps > best.eps:
                        best_i, best = i * 2 + (sgn < 0), tst
            k, sgn = best_i // 2, (-1.0 if best_i % 2 else 1.0)
            _, e0, e1 = _sets(p, sc, T, source, pos, level, view)
            fp, fn = distinguish.counts(sgn * e0[:, k], sgn * e1[:, k], best.tau)
            eps = stats.eps_lower_bound(fp, T, fn, T, delta)
            label = ("-" if sgn < 0 else "") + keys[k]
            results[view] = Result(
                mode=p.mode, view=view, scenario=sc.name, mech=claim.mech, budget=claim.budget,
                eps_claimed=claim.eps, delta=claim.delta, eps_lower=eps, trials=2 * T, calibration_trials=2 * Tc,
                fp=fp, fn=fn, path="real", statistic=label, threshold=best.tau, verified_real_trials=0,
                kind=p.kind, d=p.d, w=p.w, cal_eps=best.eps, notes=[], persist_noise="refresh")
            cal[view] = best.eps
            if progress:
                progress("  %-26s %-9s eps_lower %.3f (claim %.3f, real path, %d trials)"
                         % (sc.name, view, eps, claim.eps, 2 * T))
        out.append(ScenarioAudit(sc, None, results, cal))  # type: ignore[arg-type]
    return out, [summarize(out, v) for v in views]
