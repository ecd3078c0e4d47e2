"""The audit of one configuration: scenarios × views → ε lower bounds.

For each scenario of the configured mode (scenarios.py):

1. learn the view's exact structure from seeded real runs and verify it
   bit for bit on real runs with ``os.urandom`` (model.py);
2. list candidate statistics per view (distinguish.py);
3. draw a *calibration* set of trials per world and pick the statistic and
   threshold with the best Clopper–Pearson bound on it;
4. draw a fresh *evaluation* set and report the Clopper–Pearson ε lower
   bound of that one test (Jagielski et al. 2020).

Trials come from the verified model (fast, numpy) when the model
reproduces the real views exactly, and from the real code path otherwise
(always when ``real=True``). The summary of a view picks the scenario on
the calibration sets too, so its bound is a single pre-chosen test and
holds at 95 % without a multiple-comparison correction.
"""

from __future__ import annotations

import copy
import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from pansketch.agent.params import Params
from pansketch.agent.rng import DeterministicSource, NoEntropyError, SystemSource

from pansketch.host_tools.audit import device, distinguish, model as mdl, scenarios, stats
from pansketch.host_tools.audit.results import Result, ScenarioAudit, summarize
from pansketch.host_tools.audit.scenarios import Scenario

from pansketch.host_tools.store.ledger import DEFAULT_DELTA  # δ of a ρ-zCDP claim: the host's default, one ε everywhere

VIEWS = ("release", "intrusion")


@dataclass
class Claim:
    mech: str
    budget: str
    eps: float  # the claimed ε (dlap) or the (ε, δ) conversion of ρ (dgauss)
    delta: float
    conversion: str


def claim_of(p: Params, delta: float = DEFAULT_DELTA) -> Claim:
    b = p.budget[0] / p.budget[1]
    budget = "%d/%d" % p.budget if p.budget[1] != 1 else "%d" % p.budget[0]
    if p.mechanism == "dlap":
        return Claim("dlap", "eps=" + budget, b, 0.0, "pure ε-DP")
    return Claim("dgauss", "rho=" + budget, stats.zcdp_to_dp(b, delta), delta,
                 "ρ-zCDP → (ε, δ) by CKS 2020 Cor. 13 at δ=%g (Bun–Steinke: %.3f)"
                 % (delta, stats.zcdp_to_dp_bun_steinke(b, delta)))


def _group_size(p: Params) -> int:
    """Most statistics a joint test sums: every level's node and its releases in tree mode."""
    return max(2, 2 * p.levels) if p.mode == "tree" else 2


def _scheme(p: Params) -> str:
    return "shadow" if p.shadow else "refresh"


@dataclass
class Sets:
    """LLRs of every candidate on one set of trials: cand index -> (world-0, world-1); and, per
    candidate with a pooled tail test, its counts per atom (world-0 hits, cells, world-1 hits, cells)."""

    llr: list[tuple[np.ndarray, np.ndarray]]
    cells: list[list[tuple[int, int, int, int]] | None] = field(default_factory=list)


def _model_sets(m: mdl.Model, cands: list[distinguish.Candidate], L: distinguish.LLR, T: int,
                gen: np.random.Generator, plans: list[distinguish.CellPlan | None] | None = None) -> Sets:
    """Trials sampled from the verified model: s = world*m + a·Z on the touched cells
    (a joint test sums the LLRs of its statistics, computed on the same draws; the pooled
    tail tests of ``plans`` count on the same draws too)."""
    d = len(m.cells)
    out = []
    cells: list[list[tuple[int, int, int, int]] | None] = []
    z = [mdl.sample_arrays(L.bases or [L.base] * m.K, T, d, gen) for _ in (0, 1)]
    for ci, c in enumerate(cands):
        pair = []
        plan = plans[ci] if plans else None
        hits: dict[tuple[int, int], tuple[int, int]] = {}
        for w in (0, 1):
            tot = None
            for ai, part in enumerate(c.atoms()):
                s = np.einsum("k,tkd->td", part.a, z[w]) + w * part.m[None, :]
                x = L.llr(part, s)
                tot = x if tot is None else tot + x
                if plan is not None:
                    for ca in plan.atoms:
                        if ca.atom == ai:
                            hits[(ai, w)] = distinguish.cell_counts(ca, s)
            assert tot is not None  # every candidate has at least one atom
            pair.append(tot)
        out.append((pair[0], pair[1]))
        cells.append(None if plan is None else [hits[(ca.atom, 0)] + hits[(ca.atom, 1)] for ca in plan.atoms])
    return Sets(out, cells)


class _Dry:
    def read(self, n: int) -> bytes:
        raise NoEntropyError("the intruder holds no more bytes")


def predicted_draws(p: Params, r: device.Run, decs: list[device.Decoded], mo: int) -> dict[int, int]:
    """Draws an intruder at moment ``mo`` computes from the Rng's RAM (global index -> value).

    The intruder runs the device's sampler on the bytes the Rng holds
    (a copy with a source that has no more bytes); each sample that completes
    is a future draw of the device, of the distribution the device used for
    that draw (recorded by device.run). The auditor finds its index by
    matching the Rng's state against the replayed stream.
    """
    mom = r.moments[mo]
    n = p.cells
    offset = sum(len(decs[i].draws) for i in range(mom.instance))
    state = (mom.consumed, device._rng_state(mom.rng))
    try:
        done = decs[mom.instance].states.index(state)
    except ValueError:
        return {}
    rng = copy.copy(mom.rng)
    rng.__dict__ = copy.deepcopy(mom.rng.__dict__)
    rng.source = _Dry()
    out: dict[int, int] = {}
    g = offset + done
    specs = decs[mom.instance].specs
    j = done
    while len(out) < n:
        spec = specs[j] if j < len(specs) else p.noise  # a draw the run never made: the configured noise
        try:
            out[g] = spec.sample(rng)
        except NoEntropyError:
            break
        g += 1
        j += 1
    return out


def _real_sets(m: mdl.Model, cands: list[distinguish.Candidate], L: distinguish.LLR, T: int,
               source: Callable[[], Any]) -> Sets:
    """Trials on the real code path: run the Recorder, read the view, apply each statistic
    (a joint test: each of its statistics, LLRs summed)."""
    p = m.p
    n = p.cells
    cells = [c for c, _ in m.cells]
    E0 = m.E0[:, cells]
    atoms = [(ci, ai, a) for ci, c in enumerate(cands) for ai, a in enumerate(c.atoms())]
    S: dict[tuple[int, int, int], list[np.ndarray]] = {(ci, ai, w): [] for ci, ai, _ in atoms for w in (0, 1)}
    K: dict[tuple[int, int, int], list[dict[int, int]]] = {(ci, ai, w): [] for ci, ai, _ in atoms for w in (0, 1)}
    for w in (0, 1):
        for _ in range(T):
            r = device.run(p, m.scenario, w, lambda i: source())
            v = mdl.view_arrays(r)
            X = np.stack([v[k][cells] for k in m.keys]) - E0
            _, decs = mdl.draws_of(p, r)
            pred: dict[int | None, dict[int, int]] = {None: {}}
            for ci, ai, c in atoms:
                if c.moment is not None and c.moment not in pred:
                    pred[c.moment] = predicted_draws(p, r, decs, c.moment)
                S[(ci, ai, w)].append(sum(coef * X[i] for i, coef in c.u))
                K[(ci, ai, w)].append(pred[c.moment])
    out = []
    for ci, c in enumerate(cands):
        pair = []
        for w in (0, 1):
            tot = None
            for ai, a in enumerate(c.atoms()):
                x = L.llr_known(a, np.array(S[(ci, ai, w)]), K[(ci, ai, w)], cells, n)
                tot = x if tot is None else tot + x
            assert tot is not None  # every candidate has at least one atom
            pair.append(tot)
        out.append((pair[0], pair[1]))
    return Sets(out)


def metadata_leaks(p: Params, sc: Scenario, seeds: int = 3) -> dict[str, str]:
    """Signature keys (device.signature) that differ between the worlds for the
    same CSPRNG bytes, with the world-1 value they take in every seed."""
    sig = []
    for s in range(seeds):
        src = lambda i, s=s: DeterministicSource("audit-meta-%s-%d-%d" % (sc.name, s, i))  # noqa: E731
        sig.append((device.signature(device.run(p, sc, 0, src)), device.signature(device.run(p, sc, 1, src))))
    leaks: dict[str, str] = {}
    for k in sig[0][1]:
        if all(s0.get(k) != s1.get(k) for s0, s1 in sig) and len({s1.get(k) for _, s1 in sig}) == 1:
            leaks[k] = sig[0][1][k]
    return leaks


def _metadata_counts(p: Params, sc: Scenario, keys: dict[str, str], T: int,
                     source: Callable[[], Any]) -> tuple[int, int]:
    """(false positives, false negatives) of 'world 1 iff every leaking key has its world-1 value'."""
    fp = fn = 0
    for w in (0, 1):
        for _ in range(T):
            sig = device.signature(device.run(p, sc, w, lambda i: source()))
            guess = all(sig.get(k) == v for k, v in keys.items())
            fp += int(w == 0 and guess)
            fn += int(w == 1 and not guess)
    return fp, fn


def audit_scenario(p: Params, sc: Scenario, views: Iterable[str], trials: int, seed: int,
                   real: bool = False, real_trials: int = 1000, verify_trials: int = 10,
                   delta: float = DEFAULT_DELTA, source: Callable[[], Any] = SystemSource) -> ScenarioAudit:
    """Audit one scenario; ``trials`` evaluation trials in all (half per world)."""
    claim = claim_of(p, delta)
    leaks = metadata_leaks(p, sc)
    try:
        m = mdl.learn(p, sc)
    except mdl.ModelError:
        if not leaks:
            raise
        return _metadata_audit(p, sc, views, trials, real_trials, claim, leaks, source)
    mdl.verify(m, verify_trials, source)
    L = distinguish.LLR.for_model(m)
    use_real = real or not m.exact
    T = max(trials // 2, 1)
    Tc = max(trials // 4, 1)
    if use_real:
        T = min(T, real_trials)
        Tc = min(Tc, real_trials)
    # fixed per (seed, mode, scenario); crc32, not hash(): str hashes change per process
    gen = np.random.default_rng([seed, zlib.crc32(p.mode.encode()), zlib.crc32(sc.name.encode())])
    results: dict[str, Result] = {}
    cal_eps: dict[str, float] = {}
    for view in views:
        # joint tests (sums of LLRs of statistics with independent noise): shadow puts an event before
        # the intrusion in two coordinates at half the budget each; tree mode puts it in L nodes and
        # their releases; a failed write can leave an event in two increments (docs/PRIVACY.md "Failed writes and failed commits: a write that was attempted counts as written")
        cands = distinguish.candidates(m, view, joint=True, group=_group_size(p))
        if not cands:
            raise RuntimeError("scenario %s: the event leaves no trace in the %s view" % (sc.name, view))
        plans: list[distinguish.CellPlan | None] | None = None
        if use_real:
            cal = _real_sets(m, cands, L, Tc, source)
            ev = _real_sets(m, cands, L, T, source)
        else:
            # the pooled tail tests' thresholds come from the exact pmf, before any trial is drawn
            plans = [distinguish.plan_product(c, L, T, claim.delta) for c in cands]
            cal = _model_sets(m, cands, L, Tc, gen, plans)
            ev = _model_sets(m, cands, L, T, gen, plans)
        best_i, best = 0, distinguish.Test(math.inf, -1.0, 0, 0, 0, 0)
        for i, (l0, l1) in enumerate(cal.llr):
            t = distinguish.best_threshold(l0, l1, claim.delta)
            if t.eps > best.eps:
                best_i, best = i, t
        cell_i, cell_cal = -1, best.eps
        for i, cnt in enumerate(cal.cells):
            plan = plans[i] if plans else None
            if plan is not None and cnt is not None:
                e = distinguish.product_bound(plan, cnt, claim.delta)
                if e > cell_cal:
                    cell_i, cell_cal = i, e
        l0, l1 = ev.llr[best_i]
        if cell_i >= 0 and plans is not None:  # the pooled tail test won on the calibration set
            plan = plans[cell_i]
            cnt = ev.cells[cell_i]
            assert plan is not None and cnt is not None
            eps = distinguish.product_bound(plan, cnt, claim.delta)
            fp, fn = sum(c[0] for c in cnt), sum(c[3] - c[2] for c in cnt)
            stat, tau, cal_best = plan.label, float(plan.atoms[0].tau), cell_cal
        else:
            fp, fn = distinguish.counts(l0, l1, best.tau)
            eps = stats.eps_lower_bound(fp, len(l0), fn, len(l1), claim.delta)
            stat, tau, cal_best = cands[best_i].label, best.tau, best.eps
        results[view] = Result(
            mode=p.mode, view=view, scenario=sc.name, mech=claim.mech, budget=claim.budget,
            eps_claimed=claim.eps, delta=claim.delta, eps_lower=eps, trials=len(l0) + len(l1),
            calibration_trials=2 * Tc, fp=fp, fn=fn, path="real" if use_real else "model",
            statistic=stat, threshold=tau, verified_real_trials=m.verified,
            kind=p.kind, d=p.d, w=p.w, cal_eps=cal_best, notes=list(m.notes), persist_noise=_scheme(p))
        cal_eps[view] = cal_best
        vleaks = {k: v for k, v in leaks.items() if device.in_view(k, view)}
        if vleaks:  # the event changes something that is not a noisy array: test that too
            meta = _metadata_audit(p, sc, [view], trials, real_trials, claim, vleaks, source)
            if meta.cal[view] > cal_eps[view]:
                results[view] = meta.results[view]
                cal_eps[view] = meta.cal[view]
    return ScenarioAudit(sc, m, results, cal_eps)


def _metadata_audit(p: Params, sc: Scenario, views: Iterable[str], trials: int, real_trials: int, claim: Claim,
                    leaks: dict[str, str], source: Callable[[], Any]) -> "ScenarioAudit":
    """Audit with the metadata test only (real code path): the event changes a
    non-array attribute, a release field or the shape of the view."""
    T = min(max(trials // 2, 1), real_trials)
    Tc = min(max(trials // 4, 1), real_trials)
    results: dict[str, Result] = {}
    cal: dict[str, float] = {}
    note = "depends on the event: " + ", ".join(sorted(leaks)[:5])
    for view in views:
        keys = {k: v for k, v in leaks.items() if device.in_view(k, view)}
        if not keys:
            cal[view] = 0.0
            results[view] = Result(p.mode, view, sc.name, claim.mech, claim.budget, claim.eps, claim.delta, 0.0, 0, 0,
                                   0, 0, "real", "metadata (none visible)", math.inf, 0, p.kind, p.d, p.w, 0.0, [note],
                                   _scheme(p))
            continue
        cfp, cfn = _metadata_counts(p, sc, keys, Tc, source)
        cal[view] = stats.eps_lower_bound(cfp, Tc, cfn, Tc, claim.delta)
        fp, fn = _metadata_counts(p, sc, keys, T, source)
        eps = stats.eps_lower_bound(fp, T, fn, T, claim.delta)
        results[view] = Result(p.mode, view, sc.name, claim.mech, claim.budget, claim.eps, claim.delta, eps, 2 * T,
                               2 * Tc, fp, fn, "real", "metadata: " + ", ".join(sorted(keys)[:3]), math.inf, 0,
                               p.kind, p.d, p.w, cal[view], [note], _scheme(p))
    return ScenarioAudit(sc, None, results, cal)  # type: ignore[arg-type]


def audit(p: Params, views: Iterable[str] = VIEWS, trials: int = 100_000, seed: int = 1,
          scenario_names: list[str] | None = None, real: bool = False, real_trials: int = 1000,
          verify_trials: int = 10, delta: float = DEFAULT_DELTA,
          progress: Callable[[str], None] | None = None,
          source: Callable[[], Any] = SystemSource) -> tuple[list[ScenarioAudit], list[Result]]:
    """Audit every scenario of ``p.mode``; returns the per-scenario audits and one summary per view.
    ``source`` makes the byte source of each real run (the system CSPRNG; a test may seed it)."""
    views = list(views)
    if p.kind == "dbits":  # bits, not a linear function of noise draws: the real code path (bits.py)
        from pansketch.host_tools.audit import bits

        scs = [s for s in scenarios.for_mode(p.mode, scenario_names)
               if scenario_names or not s.name.startswith("persist-fail")]  # dbits writes no state file
        return bits.audit(p, scs, views, trials, real_trials, delta, claim_of(p, delta), progress, source)
    out = []
    for sc in scenarios.for_mode(p.mode, scenario_names):
        a = audit_scenario(p, sc, views, trials, seed, real, real_trials, verify_trials, delta, source)
        if progress:
            for v in views:
                r = a.results[v]
                progress("  %-26s %-9s eps_lower %.3f (claim %.3f, %s path, %d trials)"
                         % (sc.name, v, r.eps_lower, r.eps_claimed, r.path, r.trials))
        out.append(a)
    return out, [summarize(out, v) for v in views]
