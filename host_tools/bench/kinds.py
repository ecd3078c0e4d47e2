"""Accuracy of the kinds beyond frequencies, by simulation.

* dcs quantiles: rank error of the answered quantile x_q (the distance from
  q to [F(x_q - 1), F(x_q)], 0 for an exact quantile) and the
  coverage and half-width of its calibrated rank interval (the quantile
  row's, DyadicView.rank_le_right) at 90% and 95%, next to the former union
  bound's at 95%, for b = 16 and 32 at the default device parameters
  (d = 4, w = 1024, dgauss rho = 1/2, nz = 2 draws per cell and release)
  merged over ``devices`` releases, 100 trials (``--quantile-trials``);
* dcs heavy hitters: precision and recall of ``heavy -k K`` against the
  true top K of a Zipf stream over 32-bit values (IPv4-like);
* distinct counts: relative error of pan-private-sketches Alg. 1
  (host_tools/lab/algorithms/distinct.py, replayed exactly with its discrete Laplace noise) and
  of kind dbits (DNPRY density bits, host_tools/query/distinct.py) on the same
  item sets (each item seen 1-3 times), eps = 1;

Noise is the exact discrete Gaussian (vectorised sampler,
pansketch.host_tools.lab.algorithms.vnoise) at the variance the device calibrates; the
counters are the device's (pansketch.host_tools.query.dyadic.exact_counters equals
pansketch.agent.dcs.DyadicSketch, tests/test_dcs_device.py). Fixed seeds.

    python -m pansketch.host_tools.bench.kinds [--trials N] [--quantile-trials N] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
from fractions import Fraction
from typing import Any

import numpy as np

from pansketch.host_tools.lab.algorithms.vnoise import BulkNoise
from pansketch.host_tools.query.dyadic import DyadicView, exact_counters
from pansketch.host_tools.query.distinct import estimate_release
from pansketch.host_tools.query.merge import NoiseTerm, noise_variance


def noisy(exact: np.ndarray, var: Fraction, releases: int, gen: BulkNoise) -> tuple[np.ndarray, list[NoiseTerm]]:
    """Merged counters of ``releases`` releases summing to ``exact``, each carrying nz = 2 draws per cell."""
    z = gen.dgauss(var, exact.size * 2 * releases).reshape(2 * releases, *exact.shape).sum(axis=0)
    return exact + z, [NoiseTerm("dgauss", var.numerator, var.denominator, 2 * releases)]


def default_var(b: int, d: int = 4, rho: Fraction = Fraction(1, 2)) -> Fraction:
    return Fraction((b + 1) * d, 1) / (2 * rho)


def readings(b: int, n: int, seed: int) -> np.ndarray:
    """A skewed reading distribution over [0, 2^b): lognormal 'latencies' plus a spike and a uniform tail."""
    g = np.random.default_rng(seed)
    top = (1 << b) - 1
    scale = (1 << b) / 2 ** 12
    x = g.lognormal(math.log(200 * scale), 0.8, n)
    x[: n // 10] = 137 * scale  # a spike (a very common reading)
    x[n // 10: n // 5] = g.uniform(0, top, n // 5 - n // 10)
    return np.clip(x.astype(np.int64), 0, top)


def rank_error(srt: np.ndarray, xs: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """How far q is from [F(x-1), F(x)] (0 when x is an exact q-quantile: F jumps over q at x)."""
    n = len(srt)
    hi = np.searchsorted(srt, xs, side="right") / n
    lo = np.searchsorted(srt, xs, side="left") / n
    return np.maximum(0.0, np.maximum(lo - qs, qs - hi))


def quantile_eval(b: int, n: int = 100_000, devices: int = 4, trials: int = 100, d: int = 4, w: int = 1024,
                  confidences: tuple[float, ...] = (0.9, 0.95), seed: int = 1) -> dict[str, Any]:
    """Rank error of the answered quantiles and coverage of their rank intervals (the rows of
    ``pansketch query quantile``: pansketch.host_tools.query.dyadic.rank_answers) at each confidence; ``union_*``
    is the former union bound over levels (each level at alpha / 2b, for comparison)."""
    qs = np.array([0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99])
    var = default_var(b, d)
    errs: list[float] = []
    cover = {c: 0 for c in confidences}
    width: dict[float, list[float]] = {c: [] for c in confidences}
    ucover, uwidth = 0, []
    total = 0
    for t in range(trials):
        vals = readings(b, n, seed + t)
        srt = np.sort(vals)
        salt = "bench-%d" % t
        ex = exact_counters(vals, b, d, w, salt)
        C, terms = noisy(ex, var, devices, BulkNoise(seed * 1000 + t))
        true = None
        for i, conf in enumerate(confidences):
            v = DyadicView(C, b, d, w, salt, terms, conf)
            xs = v.quantile(qs)  # the estimates do not depend on the confidence
            r, h = v.rank_le_right(xs)
            if true is None:
                true = np.searchsorted(srt, xs, side="right")
                errs += list(rank_error(srt, xs, qs))
            cover[conf] += int(((r - h <= true) & (true <= r + h)).sum())
            width[conf] += list(h / n)
            if conf == 0.95:
                ru, _ = v.rank_le(xs)
                a = v.alpha / (2.0 * b)
                hu = np.array([sum(v.halfwidth(lv, a) for lv in range(b) if ((int(x) + 1) >> lv) & 1) for x in xs])
                ucover += int(((ru - hu <= true) & (true <= ru + hu)).sum())
                uwidth += list(hu / n)
        total += len(qs)
    e = np.array(errs)
    out: dict[str, Any] = {"b": b, "n": n, "devices": devices, "trials": trials, "d": d, "w": w,
                           "sigma2_per_draw": str(var), "rank_err_mean": float(e.mean()),
                           "rank_err_p95": float(np.quantile(e, 0.95)), "rank_err_max": float(e.max()),
                           "answers": total}
    for c in confidences:
        out["coverage_%g" % c] = cover[c] / total
        out["halfwidth_mean_frac_%g" % c] = float(np.mean(width[c]))
    if 0.95 in confidences:
        out["union_coverage_0.95"] = ucover / total
        out["union_halfwidth_mean_frac_0.95"] = float(np.mean(uwidth))
    return out


def zipf_values(b: int, n: int, n_items: int, s: float, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    items = g.choice(1 << min(b, 62), size=n_items, replace=False) if b <= 30 else \
        np.unique(g.integers(0, 1 << b, n_items * 2, dtype=np.int64))[:n_items]
    g.shuffle(items)
    p = np.arange(1, n_items + 1, dtype=np.float64) ** -s
    p /= p.sum()
    return items[g.choice(n_items, size=n, p=p)]


def heavy_eval(b: int = 32, k: int = 10, n: int = 100_000, n_items: int = 50_000, s: float = 1.1, devices: int = 4,
               trials: int = 5, d: int = 4, w: int = 1024, confidence: float = 0.95, seed: int = 7) -> dict[str, Any]:
    var = default_var(b, d)
    prec, rec, cover, total = [], [], 0, 0
    for t in range(trials):
        vals = zipf_values(b, n, n_items, s, seed + t)
        u, c = np.unique(vals, return_counts=True)
        order = np.lexsort((u, -c))
        truth = dict(zip(u.tolist(), c.tolist()))
        kth = c[order[k - 1]]
        top = set(u[order[:k]].tolist())
        tied = set(u[c >= kth].tolist())  # items tied with the k-th count count as correct
        salt = "heavy-%d" % t
        C, terms = noisy(exact_counters(vals, b, d, w, salt), var, devices, BulkNoise(seed * 1000 + t))
        v = DyadicView(C, b, d, w, salt, terms, confidence)
        found, t0 = v.heavy(k)
        fx = [x for x, _ in found]
        prec.append(sum(1 for x in fx if x in tied) / max(1, len(fx)))
        rec.append(len(top & set(fx)) / k)
        cover += sum(1 for x, e in found if e - t0 <= truth.get(x, 0) <= e + t0)
        total += len(found)
    return {"b": b, "k": k, "n": n, "items": n_items, "zipf_s": s, "devices": devices, "trials": trials,
            "precision": float(np.mean(prec)), "recall": float(np.mean(rec)),
            "interval_coverage": cover / max(1, total)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--quantile-trials", type=int, default=100, help="trials of the quantile rows (9 answers each)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    rows = [quantile_eval(16, trials=a.quantile_trials), quantile_eval(32, trials=a.quantile_trials),
            heavy_eval(k=10, trials=max(1, a.trials // 4)), heavy_eval(k=100, trials=max(1, a.trials // 4))]
    rows += distinct_eval(trials=a.trials, m=1024, K=16) + distinct_eval(trials=a.trials)
    for r in rows:
        print(json.dumps(r) if a.json else r)
    return 0



# -- distinct count: pan-private-sketches Alg. 1 vs the DNPRY density estimator ---------------------------
def dnpry_simulate(n_distinct: int, m: int, K: int, eps: float, gen: np.random.Generator) -> np.ndarray:
    """Per-level one-bit counts of a dbits release (agent/dbits.py) after a stream with n_distinct
    items (repeats do not matter: a touched bucket's bit is a fresh Bern(1/2 + eps/4) draw at each
    arrival), plus the output noise: exact discrete Laplace of scale 1/eps (vectorised sampler)."""
    from pansketch.host_tools.lab.algorithms.vnoise import discrete_laplace

    u = gen.random(n_distinct)
    level = np.minimum(np.floor(-np.log2(np.maximum(u, 1e-300))).astype(np.int64), K - 1)
    bucket = gen.integers(0, m, n_distinct)
    touched = np.zeros((K, m), dtype=bool)
    touched[level, bucket] = True
    t = touched.sum(axis=1)
    ones = gen.binomial(t, 0.5 + eps / 4) + gen.binomial(m - t, 0.5)
    return ones + discrete_laplace(gen, Fraction(1) / Fraction(eps).limit_denominator(1000), K)


def distinct_eval(Ds: tuple[int, ...] = (100, 10_000, 1_000_000), trials: int = 5, eps: float = 1.0, m: int = 4096,
                  K: int = 20, r: int = 32, vbits: int = 16, seed: int = 5) -> list[dict[str, Any]]:
    """Relative error |D_hat - D| / D of both estimators on the same streams (each item 1-3 times)."""
    from pansketch.agent import noise as agent_noise
    from pansketch.agent.rng import DeterministicSource, Rng
    from pansketch.host_tools.lab.algorithms.panprivate import distinct_estimate, distinct_scale
    from pansketch.host_tools.lab.repro.panprivate import FRAC, Q, sketch_exact

    out = []
    sf = distinct_scale(Q, vbits, FRAC)
    M = 1 << ((vbits + FRAC) * Q)
    for D in Ds:
        g = np.random.default_rng(seed + D)
        rng = Rng(DeterministicSource(b"bench-distinct-%d" % D))  # simulation only
        e1, e2, sd2, cov2 = [], [], [], []
        for t in range(trials):
            keys = np.unique(g.integers(0, 1 << 40, int(D * 1.01)))[:D]
            cnt = g.integers(1, 4, len(keys))
            if len(keys) <= 200_000 or t == 0:  # Alg. 1's replay is the slow part: one trial at 10^6
                sk = sketch_exact(keys, cnt.astype(np.int64), r, "bench/dc/%d" % t, vbits)
                noisy_sk = [v + agent_noise.discrete_laplace(rng, r * M, 1) for v in sk]  # internal (output: same)
                noisy_sk = [v + agent_noise.discrete_laplace(rng, r * M, 1) for v in noisy_sk]
                e1.append(abs(distinct_estimate(noisy_sk, sf, Q, FRAC) - D) / D)
            fe = Fraction(eps).limit_denominator(1000)
            ov = noise_variance("dlap", fe.denominator, fe.numerator)  # output noise: scale 1/eps
            est, var = estimate_release(dnpry_simulate(D, m, K, eps, g), m, eps, ov)
            e2.append(abs(est - D) / D)
            sd2.append(math.sqrt(var) / D)
            cov2.append(abs(est - D) <= 1.959964 * math.sqrt(var))
        out.append({"D": D, "eps": eps, "alg1_r": r, "alg1_vbits": vbits, "alg1_rel_err": float(np.mean(e1)),
                    "alg1_trials": len(e1), "dnpry_m": m, "dnpry_levels": K, "dnpry_rel_err": float(np.mean(e2)),
                    "dnpry_rel_sd_model": float(np.mean(sd2)), "dnpry_coverage_95": float(np.mean(cov2)),
                    "dnpry_trials": trials})
    return out


if __name__ == "__main__":
    raise SystemExit(main())
