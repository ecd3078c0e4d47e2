"""Accuracy on real offline data, per salt, next to Apache DataSketches at equal memory.

    python -m pansketch.host_tools.bench.accuracy [--salts 30] [--devices 20] [--out bench-results/accuracy.json]
                                        [--figures bench-results] [--quick]
    make bench-accuracy

Data: the Python standard library's own sources on this machine
(``sysconfig.get_paths()["stdlib"]``, every ``.py`` file, site-packages
left out), read once and spread over ``devices`` devices file by file
(round robin): identifier tokens (tokenize NAME tokens), line lengths
(characters per line) and file sizes (bytes). Nobody here wrote them.

The sketches are the devices' own (pansketch.host_tools.fasthash and
pansketch.host_tools.query.dyadic.exact_counters equal pansketch.agent.sketch / pansketch.agent.dcs, the
tests check it); a fleet's merged release is their sum plus, per device,
the noise the device calibrates at the default configuration
(pansketch.agent.params.Params: one internal and one output draw per cell, exact
discrete Gaussian from pansketch.host_tools.lab.algorithms.vnoise). Each *salt* is
one fleet: a fixed hash key. What a fleet sees is its own salt's coverage,
so coverage is reported per salt -- the median and the 5th percentile
over salts -- not only averaged over salts.

Sections (each a table in the JSON and in docs/HOST.md "Accuracy on real data"):

* ``freq``: CountSketch (default d = 4, w = 1024) and Count-Min at equal
  memory: per-salt coverage of the frequency intervals over all tokens
  (calibrated, pansketch.host_tools.query.estimators) and RMSE over the top 1000.
* ``topk``: precision at k = 50 and 100 with the whole vocabulary as the
  candidate list: CountSketch by median, CountSketch with the least-squares
  refit (pansketch.host_tools.query.ranking, what ``query topk`` does), Count-Min,
  and DataSketches ``frequent_strings_sketch`` (no candidate list) at about
  the same memory.
* ``quantiles``: kind dcs on line lengths and file sizes (b = 16), default
  (d = 4, w = 1024) and board-sized (d = 3, w = 16) configurations:
  per-salt coverage of the quantile rank intervals at 0.95, rank error,
  and DataSketches KLL at about the same memory (its rank error).
* ``distinct``: the number of distinct tokens, HLL / CPC (DataSketches)
  at about the memory of a default dbits release, for reference (kind dbits
  has its own benchmark in pansketch.host_tools.bench.kinds).

Figures (matplotlib, if installed): per-salt coverage histograms and the
top-k precision per method, in ``--figures``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sysconfig
import time
import tokenize
from fractions import Fraction
from pathlib import Path
from typing import Any, Optional

import numpy as np

from pansketch.host_tools import fasthash
from pansketch.host_tools.lab.algorithms.vnoise import BulkNoise
from pansketch.host_tools.query import estimators, ranking
from pansketch.host_tools.query.dyadic import DyadicView, exact_counters
from pansketch.host_tools.query.merge import Merged, NoiseTerm


# -- data ---------------------------------------------------------------------------------
def stdlib_files() -> list[str]:
    """Every .py file of the standard library (sorted; site-packages and caches left out)."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dp, dn, fn in os.walk(root):
        dn[:] = sorted(x for x in dn if x not in ("site-packages", "dist-packages", "__pycache__"))
        out += [os.path.join(dp, f) for f in sorted(fn) if f.endswith(".py")]
    return out


def file_tokens(path: str) -> list[str]:
    """The identifier (NAME) tokens of one file ([] if it does not tokenize)."""
    try:
        with open(path, "rb") as fh:
            return [t.string for t in tokenize.tokenize(fh.readline) if t.type == tokenize.NAME]
    except (SyntaxError, tokenize.TokenError, UnicodeDecodeError, OSError):
        return []


def stdlib_data(every: int = 1) -> dict[str, Any]:
    """{'tokens': [per file list], 'line_lengths': array, 'file_sizes': array} of every ``every``-th file."""
    files = stdlib_files()[::every]
    toks, lines, sizes = [], [], []
    for p in files:
        toks.append(file_tokens(p))
        try:
            raw = Path(p).read_bytes()
        except OSError:
            continue
        sizes.append(len(raw))
        lines += [len(x) for x in raw.split(b"\n")]
    return {"files": len(files), "tokens": toks, "line_lengths": np.array(lines, dtype=np.int64),
            "file_sizes": np.array(sizes, dtype=np.int64)}


def vocabulary(per_file: list[list[str]]) -> tuple[list[str], np.ndarray]:
    cnt: dict[str, int] = {}
    for f in per_file:
        for t in f:
            cnt[t] = cnt.get(t, 0) + 1
    keys = sorted(cnt, key=lambda x: (-cnt[x], x))
    return keys, np.array([cnt[k] for k in keys], dtype=np.int64)


# -- the fleet's noise -------------------------------------------------------------------
def device_noise(kind: str, d: int, w: int, b: int = 0) -> list[tuple[str, Fraction]]:
    """(mechanism, parameter) of the draws one default-configured device adds to each cell of a release."""
    from pansketch.agent.params import Params

    cfg: dict[str, Any] = {"device": "bench", "salt": "bench-salt", "kind": kind, "d": d, "w": w}
    if kind == "dcs":
        cfg["b"] = b
    p = Params(cfg)
    return [(p.inoise.mech, Fraction(p.inoise.num, p.inoise.den)), (p.noise.mech, Fraction(p.noise.num, p.noise.den))]


def add_fleet_noise(exact: np.ndarray, draws: list[tuple[str, Fraction]], devices: int, gen: BulkNoise
                    ) -> tuple[np.ndarray, list[NoiseTerm]]:
    out = np.asarray(exact, dtype=np.int64).copy()
    terms = []
    for mech, par in draws:
        z = (gen.dgauss(par, out.size * devices) if mech == "dgauss" else gen.dlap(par, out.size * devices))
        out += z.reshape(devices, *out.shape).sum(axis=0)
        terms.append(NoiseTerm(mech, par.numerator, par.denominator, devices))
    return out, terms


def pct(xs: list[float], q: float) -> float:
    return float(np.quantile(np.asarray(xs, dtype=np.float64), q)) if xs else math.nan


# -- frequencies and top-k ---------------------------------------------------------------------
def _fleet_answers(keys: list[str], vals: np.ndarray, kind: str, d: int, w: int, salt: str, cols: np.ndarray,
                   signs: np.ndarray, devices: int, seed: int, confidence: float) -> tuple[Any, ...]:
    """One fleet's merged noisy sketch of the true counts ``vals`` under ``salt``: (counters, Merged,
    point estimates, interval rule, whether each true count is inside its interval)."""
    ex = fasthash.counts_from_distinct(keys, vals, kind, d, w, salt)
    C, terms = add_fleet_noise(ex, device_noise(kind, d, w), devices, BulkNoise(seed))
    m = Merged(kind=kind, d=d, w=w, hv=1, salt="", counters=C, releases=devices, devices=[], noise=terms, t0=0, t1=0)
    est = estimators.point_estimates(C, cols, signs, kind)
    rule = estimators.interval_rule(m, confidence)
    return C, m, est, rule, (est - rule.below <= vals) & (vals <= est + rule.above)


def freq_topk(keys: list[str], vals: np.ndarray, salts: int, devices: int, ks: tuple[int, ...] = (50, 100),
              d: int = 4, w: int = 1024, confidence: float = 0.95) -> dict[str, Any]:
    out: dict[str, Any] = {"d": d, "w": w, "memory_bytes": 4 * d * w, "devices": devices, "salts": salts,
                           "tokens": int(vals.sum()), "distinct": len(keys), "confidence": confidence}
    prec: dict[str, dict[int, list[float]]] = {m: {k: [] for k in ks} for m in ("cs_median", "cs_refit", "cms")}
    cov: dict[str, list[float]] = {"cs": [], "cms": []}
    rmse: dict[str, list[float]] = {"cs": [], "cs_refit": [], "cms": []}
    cov_refit: list[float] = []
    cov_med_s: list[float] = []  # the median's intervals on the same (leading, selected) candidates
    cov_topk: list[float] = []  # the intervals of the k rows topk reports
    top_true = {k: set(range(k)) for k in ks}  # keys are sorted by count
    for s in range(salts):
        salt = "accuracy-salt-%03d" % s
        st = fasthash.streams(keys, salt, d)
        cols, signs = fasthash.cols_signs(st, d, w)
        for kind in ("cs", "cms"):
            C, m, est, rule, inside = _fleet_answers(keys, vals, kind, d, w, salt, cols, signs, devices, 1000 + s,
                                                     confidence)
            cov[kind].append(float(inside.mean()))
            rmse[kind].append(float(np.sqrt(np.mean((est[:1000] - vals[:1000]) ** 2))))
            if kind == "cms":
                for k in ks:
                    prec["cms"][k].append(len(top_true[k] & set(np.argsort(-est, kind="stable")[:k].tolist())) / k)
                continue
            for k in ks:
                prec["cs_median"][k].append(len(top_true[k] & set(np.argsort(-est, kind="stable")[:k].tolist())) / k)
                fit = ranking.refit(C, cols, signs, est, k)
                assert fit is not None
                S, f = fit
                e2 = est.copy()
                e2[S] = f
                prec["cs_refit"][k].append(len(top_true[k] & set(np.argsort(-e2, kind="stable")[:k].tolist())) / k)
                if k == ks[0]:
                    lo = np.minimum(est - rule.below, e2)
                    hi = np.maximum(est + rule.above, e2)
                    cov_refit.append(float(((lo <= vals) & (vals <= hi))[S].mean()))
                    cov_med_s.append(float(inside[S].mean()))
                    shown = np.argsort(-e2, kind="stable")[:k]  # the rows `query topk` prints
                    cov_topk.append(float(((lo <= vals) & (vals <= hi))[shown].mean()))
                    rmse["cs_refit"].append(float(np.sqrt(np.mean((e2[:1000] - vals[:1000]) ** 2))))
    out["coverage_per_salt"] = {k: {"median": pct(v, 0.5), "p05": pct(v, 0.05), "min": min(v)} for k, v in cov.items()}
    out["coverage_per_salt"]["cs_refit_candidates"] = {"median": pct(cov_refit, 0.5), "p05": pct(cov_refit, 0.05),
                                                       "min": min(cov_refit)}
    out["coverage_per_salt"]["cs_refit_reported_topk"] = {"median": pct(cov_topk, 0.5), "p05": pct(cov_topk, 0.05),
                                                          "min": min(cov_topk)}
    out["coverage_per_salt"]["cs_median_on_refit_candidates"] = {"median": pct(cov_med_s, 0.5),
                                                                 "p05": pct(cov_med_s, 0.05), "min": min(cov_med_s)}
    out["rmse_top1000"] = {k: pct(v, 0.5) for k, v in rmse.items()}
    out["precision"] = {m: {str(k): {"median": pct(v, 0.5), "p05": pct(v, 0.05), "mean": float(np.mean(v))}
                            for k, v in pk.items()} for m, pk in prec.items()}
    out["_raw_coverage"] = cov
    out["_raw_precision"] = {m: {str(k): v for k, v in pk.items()} for m, pk in prec.items()}
    try:
        out["datasketches_frequent_items"] = frequent_items(keys, vals, ks, 4 * d * w)
    except ImportError:
        out["datasketches_frequent_items"] = None
    return out


def freq_cov(keys: list[str], vals: np.ndarray, salts: int, devices: int, d: int, w: int,
             confidence: float = 0.95) -> dict[str, Any]:
    """Per-salt coverage of the cs and cms frequency intervals over every token at (d, w) (one
    noise draw per salt: 23k items per draw, so a salt's coverage is measured to ~0.2 points)."""
    out: dict[str, Any] = {"d": d, "w": w, "salts": salts, "confidence": confidence}
    for kind in ("cs", "cms"):
        cov = []
        for s in range(salts):
            salt = "accuracy-salt-%03d" % s
            cols, signs = fasthash.cols_signs(fasthash.streams(keys, salt, d), d, w)
            inside = _fleet_answers(keys, vals, kind, d, w, salt, cols, signs, devices, 7000 + s, confidence)[-1]
            cov.append(float(inside.mean()))
        out[kind] = {"median": pct(cov, 0.5), "p05": pct(cov, 0.05), "min": min(cov),
                     "share_ok": float(np.mean([c >= confidence - 0.05 for c in cov]))}
        print("freq %s d=%d w=%d: per-salt coverage median %.4f p05 %.4f" % (kind, d, w, out[kind]["median"],
                                                                            out[kind]["p05"]), flush=True)
    return out


def frequent_items(keys: list[str], vals: np.ndarray, ks: tuple[int, ...], budget: int) -> dict[str, Any]:
    """DataSketches frequent_strings_sketch with the largest map that fits ``budget`` bytes serialized."""
    import datasketches as ds  # type: ignore[import-untyped,import-not-found,unused-ignore]

    rng = np.random.default_rng(0)
    order = rng.permutation(np.repeat(np.arange(len(keys)), vals))
    best: Optional[dict[str, Any]] = None
    for lg in range(6, 14):
        sk = ds.frequent_strings_sketch(lg)
        for i in order:
            sk.update(keys[i])
        size = len(sk.serialize())
        if size > budget and best is not None:
            break
        rows = sk.get_frequent_items(ds.frequent_items_error_type.NO_FALSE_NEGATIVES)
        got = [r[0] for r in rows]
        idx = {k: i for i, k in enumerate(keys)}
        prec = {str(k): len(set(range(k)) & {idx[x] for x in got[:k]}) / k for k in ks}
        best = {"lg_max_map_size": lg, "serialized_bytes": size, "precision": prec}
    assert best is not None
    return best


# -- quantiles ---------------------------------------------------------------------------------
QS = np.array([0.01, 0.05, 0.1, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.9, 0.95, 0.99])


def add_sum_noise(exact: np.ndarray, draws: list[tuple[str, Fraction]], devices: int, rng: np.random.Generator
                  ) -> tuple[np.ndarray, list[NoiseTerm]]:
    """Counters plus the fleet's summed noise drawn as one rounded normal per cell of the same variance
    (devices x draws discrete Gaussians of sigma^2 = 68 each: their sum is within ~1e-3 of it in total
    variation; the exact draws, :func:`add_fleet_noise`, cost 20 s per merged dcs sketch). The terms
    the host reads are the exact ones."""
    from pansketch.host_tools.query.merge import noise_variance

    terms = [NoiseTerm(mech, par.numerator, par.denominator, devices) for mech, par in draws]
    var = sum(t.count * noise_variance(t.mech, t.num, t.den) for t in terms)
    z = np.rint(rng.normal(0.0, math.sqrt(var), np.shape(exact))).astype(np.int64)
    return np.asarray(exact, dtype=np.int64) + z, terms


def quantiles(name: str, values: np.ndarray, salts: int, devices: int, configs: tuple[tuple[int, int], ...],
              b: int = 16, confidence: float = 0.95, reps: int = 4) -> dict[str, Any]:
    """Per-salt coverage of dcs rank intervals: for each salt (a fleet's fixed hash key) ``reps``
    independent noise draws (the noise is fresh in every release, the salt is not), each answering
    the QS quantiles and a 17-point default CDF; a salt's coverage is the share of its rows whose
    interval holds the true rank (rows without an honest interval are counted apart). 'after' are
    the answers of ``query quantile`` / ``query cdf`` (dyadic.rank_answers: per-salt least-squares
    intervals, values coarsened to the resolution the salt's sketch resolves); 'before' the
    hash-averaged calibrated intervals at the uncoarsened values (DyadicView.rank_le_right / rank_le)."""
    from pansketch.host_tools.query.dyadic import rank_answers

    vals = np.clip(values, 0, (1 << b) - 1)
    srt = np.sort(vals)
    n = len(vals)
    out: dict[str, Any] = {"data": name, "n": n, "b": b, "devices": devices, "salts": salts, "reps": reps,
                           "distinct_values": int(len(np.unique(vals))), "confidence": confidence, "configs": []}
    cdf_q = np.linspace(0.0, 1.0, 17)
    ident = (1, 1, 0)
    for d, w in configs:
        before: list[float] = []
        after: list[float] = []
        honest: list[float] = []
        rank_err: list[float] = []
        width: list[float] = []
        width0: list[float] = []
        res_blocks: list[int] = []
        draws = device_noise("dcs", d, w, b)
        for s in range(salts):
            salt = "accuracy-dcs-%03d" % s
            ex = exact_counters(vals, b, d, w, salt)
            cb = tb = ca = ta = hn = 0
            for rep in range(reps):
                C, terms = add_sum_noise(ex, draws, devices, np.random.default_rng([5000, d, w, s, rep]))
                v = DyadicView(C, b, d, w, salt, terms, confidence)
                xq = v.quantile(QS)
                xc = np.unique(np.minimum((1 << b) - 1, v.quantile(cdf_q)))
                for xs, right in ((xq, True), (xc, False)):
                    r, h = v.rank_le_right(xs) if right else v.rank_le(xs)
                    true = np.searchsorted(srt, xs, side="right")
                    cb += int(((r - h <= true) & (true <= r + h)).sum())
                    tb += len(xs)
                    width0 += list(h / n)
                    rows = rank_answers(v, xs, list(QS) if right else None, ident, coarsen=True)
                    for a in rows:
                        ta += 1
                        if not a.honest:
                            continue
                        hn += 1
                        t_ = int(np.searchsorted(srt, a.x, side="right"))
                        ca += int(a.rank_lo <= t_ <= a.rank_hi)
                        width.append((a.rank_hi - a.rank_lo) / (2.0 * n))
                    res_blocks.append(rows[0].resolution)
                lo = np.searchsorted(srt, xq, side="left") / n
                hi = np.searchsorted(srt, xq, side="right") / n
                rank_err += list(np.maximum(0.0, np.maximum(lo - QS, QS - hi)))
            before.append(cb / tb)
            after.append(ca / hn if hn else math.nan)
            honest.append(hn / ta)
        aft = [x for x in after if not math.isnan(x)]
        row: dict[str, Any] = {
            "d": d, "w": w, "memory_bytes": 4 * d * w * (b + 1),
            "before": {"median": pct(before, 0.5), "p05": pct(before, 0.05), "min": min(before)},
            "after": {"median": pct(aft, 0.5), "p05": pct(aft, 0.05), "min": min(aft) if aft else math.nan,
                      "share_ok": float(np.mean([x >= confidence - 0.05 for x in aft])) if aft else math.nan},
            "honest_share": float(np.mean(honest)), "resolution_median": int(np.median(res_blocks)),
            "rank_err_mean": float(np.mean(rank_err)), "halfwidth_mean_frac": float(np.mean(width)) if width else math.nan,
            "halfwidth_before_mean_frac": float(np.mean(width0)), "_per_salt": aft, "_per_salt_before": before}
        print("dcs %s d=%d w=%d: per-salt coverage before median %.3f p05 %.3f | after median %.3f p05 %.3f "
              "(share >= %.2f: %.3f), honest %.3f, block %d"
              % (name, d, w, row["before"]["median"], row["before"]["p05"], row["after"]["median"],
                 row["after"]["p05"], confidence - 0.05, row["after"]["share_ok"], row["honest_share"],
                 row["resolution_median"]), flush=True)
        try:
            row["kll"] = kll(vals, row["memory_bytes"])
        except ImportError:
            row["kll"] = None
        out["configs"].append(row)
    return out


def kll(vals: np.ndarray, budget: int) -> dict[str, Any]:
    """DataSketches KLL (floats) with the largest k whose serialized size fits ``budget`` bytes: rank error."""
    import datasketches as ds  # type: ignore[import-untyped,import-not-found,unused-ignore]

    srt = np.sort(vals)
    n = len(vals)
    best: Optional[dict[str, Any]] = None
    for k in (8, 16, 32, 64, 128, 200, 256, 512, 1024, 2048, 4096):
        sk = ds.kll_floats_sketch(k)
        sk.update(vals.astype(np.float32))
        size = len(sk.serialize())
        if size > budget and best is not None:
            break
        xs = np.array([sk.get_quantile(float(q)) for q in QS])
        hi = np.searchsorted(srt, xs, side="right") / n
        lo = np.searchsorted(srt, xs, side="left") / n
        err = np.maximum(0.0, np.maximum(lo - QS, QS - hi))
        best = {"k": k, "serialized_bytes": size, "rank_err_mean": float(err.mean()),
                "normalized_rank_error": sk.normalized_rank_error(False)}
    assert best is not None
    return best


def distinct_reference(keys: list[str], budget: int) -> Optional[dict[str, Any]]:
    try:
        import datasketches as ds  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError:
        return None
    out: dict[str, Any] = {"true": len(keys), "budget_bytes": budget}
    for lg in range(4, 22):
        h = ds.hll_sketch(lg, ds.tgt_hll_type.HLL_8)
        for k in keys:
            h.update(k)
        if len(h.serialize_compact()) > budget:
            break
        out["hll"] = {"lg_k": lg, "estimate": h.get_estimate(), "rel_err": h.get_estimate() / len(keys) - 1}
    for lg in range(4, 22):
        c = ds.cpc_sketch(lg)
        for k in keys:
            c.update(k)
        if len(c.serialize()) > budget:
            break
        out["cpc"] = {"lg_k": lg, "estimate": c.get_estimate(), "rel_err": c.get_estimate() / len(keys) - 1}
    return out


# -- dbits -------------------------------------------------------------------------------------
def dbits_coverage(trials: int, Ds: tuple[int, ...] = (1_000, 10_000, 100_000, 300_000, 1_000_000),
                   epss: tuple[tuple[int, int], ...] = ((1, 4), (1, 2), (1, 1), (3, 2)), K: int = 16, m: int = 1024,
                   confidence: float = 0.95, seed: int = 2026) -> list[dict[str, Any]]:
    """Coverage of one release's interval, the default dbits (16 levels x 1024 bits), by n and eps
    (1/4 .. 3/2: the accepted budgets go up to 1.5936): the releases are exact simulations of the
    device's bits (pansketch.host_tools.bench.kinds.dnpry_simulate: every item's level and bucket drawn, not
    the host's simulator), the interval the host's (pansketch.host_tools.query.distinct.release_interval)."""
    from pansketch.host_tools.bench.kinds import dnpry_simulate
    from pansketch.host_tools.query.distinct import release_interval
    from pansketch.host_tools.query.merge import noise_variance

    rows: list[dict[str, Any]] = []
    for en, ed in epss:
        eps = en / ed
        ov = noise_variance("dlap", ed, en)
        for D in Ds:
            g = np.random.default_rng([seed, D, en, ed])
            inside = 0
            err, half = [], []
            for _ in range(trials):
                d, lo, hi = release_interval(dnpry_simulate(D, m, K, eps, g), K, m, (en, ed), ed / en, ov, confidence)
                inside += lo <= D <= hi
                err.append(d / D - 1.0)
                half.append((hi - lo) / (2.0 * D))
            rows.append({"eps": "%d/%d" % (en, ed), "n": D, "trials": trials, "coverage": inside / trials,
                         "rel_err_rmse": float(np.sqrt(np.mean(np.square(err)))),
                         "halfwidth_median": float(np.median(half))})
            print("dbits eps %d/%d n %d: coverage %.3f, relative RMSE %.3f, median half-width %.3f of n"
                  % (en, ed, D, rows[-1]["coverage"], rows[-1]["rel_err_rmse"], rows[-1]["halfwidth_median"]),
                  flush=True)
    return rows


def dbits_device_path(trials: int, Ds: tuple[int, ...] = (1_000, 10_000, 100_000), eps: str = "1/2",
                      K: int = 16, m: int = 1024, confidence: float = 0.95, workdir: Optional[str] = None
                      ) -> list[dict[str, Any]]:
    """Coverage through the real path: the device's recorder (pansketch.agent.recorders.make_recorder, kind
    dbits, window mode) fed ``D`` distinct items, its release bytes from the outbox, the aggregator's
    decode, the SQLite store and ``pansketch query distinct`` (pansketch.host_tools.query.distinct.query).
    ``trials`` per D, a fresh salt each (the device's randomness from a seeded source)."""
    import tempfile

    from pansketch.agent.params import Params
    from pansketch.agent.recorders import make_recorder
    from pansketch.agent.rng import DeterministicSource, Rng
    from pansketch.host_tools.ingest.decode import decode
    from pansketch.host_tools.query import distinct
    from pansketch.host_tools.store.sqlite import Store

    t0 = 200_000 * 3600
    rows = []
    for D in Ds:
        inside = 0
        for t in range(trials):
            with tempfile.TemporaryDirectory(dir=workdir) as tmp:
                salt = "dbits-path-%d-%d" % (D, t)
                p = Params({"device": "pi-1", "salt": salt, "kind": "dbits", "d": K, "w": m, "mechanism": "dlap",
                            "budget": eps, "mode": "window", "window_s": 3600})
                rec = make_recorder(p, tmp, t0, rng=Rng(DeterministicSource(b"dbits-path-%d-%d" % (D, t))),
                                    log=lambda msg: None)
                rec.add_many(["item-%d-%d" % (t, i) for i in range(D)])
                rec.tick(t0 + 3600)
                st = Store(os.path.join(tmp, "db"))
                for f in sorted(Path(tmp, "outbox").glob("*.cbor")):
                    st.insert(decode(f.read_bytes(), "pansketch/pi-1/release"))
                a = distinct.query(st, salt=salt, confidence=confidence)
                st.close()
                hi = math.inf if a["hi"] is None else a["hi"]
                inside += a["lo"] <= D <= hi
        rows.append({"eps": eps, "n": D, "trials": trials, "coverage": inside / trials, "path": "device"})
        print("dbits device path eps %s n %d: %d of %d covered" % (eps, D, inside, trials), flush=True)
    return rows


# -- output ------------------------------------------------------------------------------------
def figures(res: dict[str, Any], outdir: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    os.makedirs(outdir, exist_ok=True)
    made = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, xs in res["freq"]["_raw_coverage"].items():
        ax.hist(xs, bins=20, alpha=0.6, label="%s frequency intervals" % kind)
    for q in res["quantiles"]:
        for c in q["configs"]:
            ax.hist(c["_per_salt"], bins=20, alpha=0.4, label="dcs %s d=%d w=%d" % (q["data"], c["d"], c["w"]))
            ax.hist(c["_per_salt_before"], bins=20, alpha=0.2, histtype="step",
                    label="before: dcs %s d=%d w=%d" % (q["data"], c["d"], c["w"]))
    ax.axvline(res["freq"]["confidence"], color="k", ls="--", lw=1)
    ax.set_xlabel("coverage per salt (one fleet = one salt)")
    ax.set_ylabel("salts")
    ax.legend(fontsize=7)
    p = os.path.join(outdir, "accuracy_coverage_per_salt.png")
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    made.append(p)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names, means = [], []
    for m, pk in res["freq"]["precision"].items():
        names.append(m)
        means.append(pk["50"]["median"])
    fi = res["freq"].get("datasketches_frequent_items")
    if fi:
        names.append("ds frequent_items")
        means.append(fi["precision"]["50"])
    ax.bar(names, means)
    ax.axhline(0.9, color="k", ls="--", lw=1)
    ax.set_ylabel("precision at k = 50 (median over salts)")
    ax.set_ylim(0, 1)
    p = os.path.join(outdir, "accuracy_topk.png")
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    made.append(p)
    plt.close(fig)
    return made


def tables(res: dict[str, Any]) -> str:
    """Markdown tables for docs/HOST.md."""
    f = res["freq"]
    lines = ["Identifier tokens of the standard library: %d tokens, %d distinct, %d files over %d devices, "
             "%d salts; d = %d, w = %d (%d bytes per release)."
             % (f["tokens"], f["distinct"], res["files"], f["devices"], f["salts"], f["d"], f["w"], f["memory_bytes"]),
             "", "| frequencies | coverage per salt at %.2f: median | 5th pct | RMSE, top 1000 |" % f["confidence"],
             "|---|---|---|---|"]
    for k in ("cs", "cms"):
        c = f["coverage_per_salt"][k]
        lines.append("| %s | %.4f | %.4f | %.1f |" % (k, c["median"], c["p05"], f["rmse_top1000"][k]))
    c = f["coverage_per_salt"]["cs_refit_candidates"]
    c0 = f["coverage_per_salt"]["cs_median_on_refit_candidates"]
    lines.append("| cs median, on the m leading candidates only | %.4f | %.4f | - |" % (c0["median"], c0["p05"]))
    lines.append("| cs + refit, on the m leading candidates | %.4f | %.4f | %.1f |"
                 % (c["median"], c["p05"], f["rmse_top1000"]["cs_refit"]))
    c1 = f["coverage_per_salt"].get("cs_refit_reported_topk")
    if c1:
        lines.append("| cs + refit, the %d rows `query topk` prints | %.4f | %.4f | - |"
                     % (int(next(iter(f["precision"]["cs_refit"]))), c1["median"], c1["p05"]))
    lines += ["", "| top-k, whole vocabulary as candidates | precision at 50: median | 5th pct | at 100: median "
              "| 5th pct |", "|---|---|---|---|---|"]
    for m, pk in f["precision"].items():
        lines.append("| %s | %.2f | %.2f | %.2f | %.2f |" % (m, pk["50"]["median"], pk["50"]["p05"],
                                                             pk["100"]["median"], pk["100"]["p05"]))
    fi = f.get("datasketches_frequent_items")
    if fi:
        lines.append("| DataSketches frequent_items (lg map %d, %d bytes, no candidates) | %.2f | - | %.2f | - |"
                     % (fi["lg_max_map_size"], fi["serialized_bytes"], fi["precision"]["50"], fi["precision"]["100"]))
    lines += ["", "Per-salt coverage at 0.95 (one salt = one fleet). dcs rows: each salt answers %s noise draws "
              "(fresh releases) x (15 quantiles + a 17-point default CDF); before = the hash-averaged calibrated "
              "intervals, after = the per-salt least-squares ones (`query quantile` / `query cdf`)."
              % (res["quantiles"][0].get("reps", "?") if res.get("quantiles") else "?"), "",
              "| kind, data | d x w | before: median | 5th pct | after: median | 5th pct | min | salts >= 0.90 | "
              "honest rows | block | mean half-width (of n) | KLL rank error (bytes) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for fc in [f.get("coverage_per_salt") and {"d": f["d"], "w": f["w"], **{k: dict(f["coverage_per_salt"][k],
               share_ok=float(np.mean([c >= f["confidence"] - 0.05 for c in f["_raw_coverage"][k]])))
               for k in ("cs", "cms")}}] + list(res.get("freq_small", [])):
        for k in ("cs", "cms"):
            c = fc[k]
            lines.append("| %s frequency, tokens | %d x %d | %.4f | %.4f | %.4f | %.4f | %.4f | %.2f | 1.00 | - | - | - |"
                         % (k, fc["d"], fc["w"], c["median"], c["p05"], c["median"], c["p05"], c["min"],
                            c["share_ok"]))
    for q in res.get("quantiles", []):
        for c in q["configs"]:
            kl = c.get("kll")
            lines.append("| dcs rank, %s (n = %d, %d values) | %d x %d | %.3f | %.3f | %.3f | %.3f | %.3f | %.2f | "
                         "%.2f | %d | %.4f (was %.4f) | %s |"
                         % (q["data"], q["n"], q.get("distinct_values", 0), c["d"], c["w"], c["before"]["median"],
                            c["before"]["p05"], c["after"]["median"], c["after"]["p05"], c["after"]["min"],
                            c["after"]["share_ok"], c["honest_share"], c["resolution_median"],
                            c["halfwidth_mean_frac"], c["halfwidth_before_mean_frac"],
                            "%.4f (%d)" % (kl["rank_err_mean"], kl["serialized_bytes"]) if kl else "-"))
    ds_ = res.get("distinct")
    if ds_ and "hll" in ds_:
        lines += ["", "Distinct tokens (%d) at %d bytes: DataSketches HLL (lg k %d) relative error %+.4f, CPC (lg k %d) "
                  "%+.4f (not private; kind dbits: table below)." % (ds_["true"], ds_["budget_bytes"], ds_["hll"]["lg_k"],
                                                                     ds_["hll"]["rel_err"], ds_["cpc"]["lg_k"],
                                                                     ds_["cpc"]["rel_err"])]
    return "\n".join(lines)


BEGIN, END = "<!-- bench.accuracy:begin -->", "<!-- bench.accuracy:end -->"


def update_docs(md: str, path: str = "docs/HOST.md") -> None:
    """Replace the block between the markers in docs/HOST.md by the tables."""
    doc = Path(path).read_text()
    i, j = doc.index(BEGIN), doc.index(END)
    Path(path).write_text(doc[:i + len(BEGIN)] + "\n" + md + "\n" + doc[j:])


def dbits_table(rows: list[dict[str, Any]]) -> str:
    ns = sorted({r["n"] for r in rows})
    out = ["| dbits 16 x 1024, 95%% intervals (%d trials per cell) | %s |" % (
        rows[0]["trials"], " | ".join("n = %g" % n for n in ns)), "|---" * (len(ns) + 1) + "|"]
    for eps in sorted({r["eps"] for r in rows}, key=lambda e: Fraction(e)):
        by = {r["n"]: r for r in rows if r["eps"] == eps}
        out.append("| eps = %s: coverage | %s |" % (eps, " | ".join(
            "%.3f" % by[n]["coverage"] if n in by else "-" for n in ns)))
        out.append("| eps = %s: relative RMSE / median half-width | %s |" % (eps, " | ".join(
            "%.3f / %.3f" % (by[n]["rel_err_rmse"], by[n].get("halfwidth_median", math.nan)) if n in by else "-"
            for n in ns)))
    return "\n".join(out)


def dbits_device_line(rows: list[dict[str, Any]]) -> str:
    cov = sum(round(r["coverage"] * r["trials"]) for r in rows)
    tot = sum(r["trials"] for r in rows)
    return ("Through the real device path (the recorder, release bytes, decode, SQLite store, `query distinct`; "
            "eps = %s, `--dbits-device %d`): %s; %d of %d covered (%.3f)."
            % (rows[0]["eps"], rows[0]["trials"], ", ".join("n = %g: %d of %d" % (r["n"], round(r["coverage"] * r["trials"]),
                                                                               r["trials"]) for r in rows), cov, tot, cov / tot))


def _dbits_md(out: Path) -> str:
    md = ""
    dj = out.with_name("accuracy_dbits.json")
    if dj.exists():
        md += "\n\n" + dbits_table(json.loads(dj.read_text()))
    dv = out.with_name("accuracy_dbits_device.json")
    if dv.exists():
        md += "\n\n" + dbits_device_line(json.loads(dv.read_text()))
    return md


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--salts", type=int, default=30, help="fleets (hash keys) per configuration")
    ap.add_argument("--devices", type=int, default=20)
    ap.add_argument("--reps", type=int, default=8, help="noise draws per salt for the dcs rows")
    ap.add_argument("--quick", action="store_true", help="every 4th file and 6 salts (a minute)")
    ap.add_argument("--dbits", type=int, default=0, metavar="TRIALS",
                    help="only the dbits interval coverage, TRIALS per (eps, n) (2000 for the docs)")
    ap.add_argument("--dbits-device", type=int, default=0, metavar="TRIALS",
                    help="only the dbits coverage through the device's recorder, release bytes, store and query "
                    "(TRIALS per n; 40 for the docs)")
    ap.add_argument("--section", choices=("all", "freq", "quantiles"), default="all",
                    help="run one section only (written to accuracy_<section>.json; 'all' merges them)")
    ap.add_argument("--out", default="bench-results/accuracy.json")
    ap.add_argument("--figures", default="bench-results")
    ap.add_argument("--render", action="store_true",
                    help="only redraw the tables (and docs with --update-docs) from the JSON written before")
    ap.add_argument("--update-docs", action="store_true",
                    help="write the tables (and accuracy_dbits.json's, if present) into docs/HOST.md")
    a = ap.parse_args(argv)
    t = time.time()
    if a.render:
        res0 = json.loads(Path(a.out).read_text())
        md = tables(res0) + _dbits_md(Path(a.out))
        print(md)
        if a.update_docs:
            update_docs(md)
        return 0
    if a.dbits_device:
        rows = dbits_device_path(a.dbits_device)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).with_name("accuracy_dbits_device.json").write_text(json.dumps(rows, indent=1))
        return 0
    if a.dbits:
        rows = dbits_coverage(a.dbits)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).with_name("accuracy_dbits.json").write_text(json.dumps(rows, indent=1))
        return 0
    data = stdlib_data(4 if a.quick else 1)
    salts = 6 if a.quick else a.salts
    keys, vals = vocabulary(data["tokens"])
    print("data: %d files, %d tokens (%d distinct), %d lines, %.0f s"
          % (data["files"], int(vals.sum()), len(keys), len(data["line_lengths"]), time.time() - t), flush=True)
    res: dict[str, Any] = {"files": data["files"], "devices": a.devices}
    out = Path(a.out)
    if a.section in ("all", "freq"):
        res["freq"] = freq_topk(keys, vals, salts, a.devices)
        res["freq_small"] = [freq_cov(keys, vals, salts, a.devices, 3, 64), freq_cov(keys, vals, salts, a.devices, 3, 16)]
        res["distinct"] = distinct_reference(keys, 16 * 1024 // 8)
        print("freq/topk done, %.0f s" % (time.time() - t), flush=True)
    if a.section in ("all", "quantiles"):
        grid = ((4, 1024), (4, 256), (3, 64), (3, 16))  # default .. board-sized (docs/FIRMWARE.md)
        reps = 3 if a.quick else a.reps
        res["quantiles"] = [quantiles("line lengths", data["line_lengths"], salts, a.devices, grid, reps=reps),
                            quantiles("file sizes", data["file_sizes"], salts, a.devices, grid, reps=reps)]
        print("quantiles done, %.0f s" % (time.time() - t), flush=True)
    if a.section != "all":
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_name("accuracy_%s.json" % a.section).write_text(json.dumps(res, indent=1, default=float))
        other = out.with_name("accuracy_%s.json" % ("quantiles" if a.section == "freq" else "freq"))
        if not other.exists():
            print("wrote", out.with_name("accuracy_%s.json" % a.section))
            return 0
        res.update({k: v for k, v in json.loads(other.read_text()).items() if k not in res})
    res["figures"] = figures(res, a.figures)
    md = tables(res) + _dbits_md(out)
    print(md)
    if a.update_docs:
        update_docs(md)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=float))
    Path(a.out).with_suffix(".md").write_text(md + "\n")
    print("wrote", a.out, "and", str(Path(a.out).with_suffix(".md")), *res["figures"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
