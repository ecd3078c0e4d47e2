"""Reproduction of intermittent-queries-dp-count-sketch.txt Figures 3 and 4.

Algorithm 4 (use-and-keep) on a Zipf(1) stream over {1..2^29}, w = 5000,
eps in {0.01, 0.05, 1}, d in {3, 9, 15}, query-set sizes n_Q, query pools
"top u items" u in {50, 5000}; query sets evenly spaced after a warm-up, the
total number of queried elements the same for every n_Q (§VI). Metric: the
cumulative mean relative error over time. Figure 3 averages over u, Figure 4
over n_Q. The replay is :func:`simulate_use_and_keep` (vectorised, same
output distribution as the per-event :class:`UseAndKeep`).

Scales (the paper: stream 2^27, queries after 5e5 arrivals, 1e6 queried
elements, n_Q up to 1e6, 20 repetitions):

* tiny: stream 2^14, 2^9 queried elements, n_Q in {1, 64}, 1 repetition.
* small: stream 2^20, queries after 2^17 arrivals, 2^15 queried elements,
  n_Q in {1, 10^3, 10^4}, 3 repetitions.
* paper: stream 2^23, queries after 5e5, 1e6 queried elements,
  n_Q in {1, 10^3, 10^4, 10^5}, 20 repetitions (hours; not part of the suite).
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from pansketch.host_tools import fasthash
from pansketch.host_tools.lab.algorithms.intermittent import simulate_use_and_keep
from pansketch.host_tools.lab.algorithms.vnoise import BulkNoise

from .common import Timer, check_scale, md_table, plt, save_json, zipf_stream

EPS = (Fraction(1, 100), Fraction(5, 100), Fraction(1))
W = 5000
UNIVERSE = 1 << 29

CONFIG: dict[str, dict[str, Any]] = {
    "tiny": dict(n=1 << 14, start=1 << 11, total_q=1 << 9, nqs=(1, 64), us=(50, 5000), ds=(3, 9), reps=1),
    "small": dict(n=1 << 20, start=1 << 17, total_q=1 << 15, nqs=(1, 1000, 10000), us=(50, 5000), ds=(3, 9, 15),
                  reps=3),
    "paper": dict(n=1 << 23, start=500000, total_q=10**6, nqs=(1, 1000, 10000, 100000), us=(50, 5000),
                  ds=(3, 9, 15), reps=20),
}
GRID = 40


def run(scale: str, out: Path, seed: int = 1) -> dict[str, Any]:
    check_scale(scale)
    cfg = CONFIG[scale]
    out.mkdir(parents=True, exist_ok=True)
    t = Timer()
    gen = np.random.default_rng(seed)
    n, start = cfg["n"], cfg["start"]
    stream = zipf_stream(gen, n, UNIVERSE, 1.0)
    keys, inv = np.unique(stream, return_inverse=True)
    umax = max(cfg["us"])
    pool = np.arange(1, umax + 1)
    allkeys = np.union1d(keys, pool)
    inv_all = np.searchsorted(allkeys, keys)[inv]
    pool_idx = np.searchsorted(allkeys, pool)
    # true counts of pool items over time
    sel = stream <= umax
    occ_keys = stream[sel].astype(np.int64) * n + np.nonzero(sel)[0]
    occ_keys.sort()
    grid = np.linspace(start, n, GRID + 1)[1:]
    dmax = max(cfg["ds"])
    curves: dict[tuple, list[np.ndarray]] = {}
    finals: dict[tuple, list[float]] = {}
    noise = BulkNoise(seed + 100)
    for rep in range(cfg["reps"]):
        t.step("repetition %d of %d" % (rep + 1, cfg["reps"]))
        st = fasthash.streams([int(x) for x in allkeys], "repro/iq/rep%d" % rep, dmax)
        cols, signs = fasthash.cols_signs(st, dmax, W)
        cols = cols.astype(np.int32)
        qgen = np.random.default_rng(seed * 1000 + rep)
        for nq in cfg["nqs"]:
            K = max(1, cfg["total_q"] // nq)
            q_times = start + ((np.arange(K) + 1) * (n - start)) // K
            for u in cfg["us"]:
                q_item_ids = qgen.integers(1, u + 1, size=K * nq)
                q_k = np.repeat(np.arange(K), nq)
                tq = q_times[q_k]
                f = (np.searchsorted(occ_keys, q_item_ids * n + tq) - np.searchsorted(occ_keys, q_item_ids * n))
                q_items = pool_idx[q_item_ids - 1]
                for eps in EPS:
                    for d in cfg["ds"]:
                        est = simulate_use_and_keep(cols, signs, inv_all, W, d, q_times, q_items, q_k, eps, noise)
                        ok = f > 0
                        rel = np.abs(est[ok] - f[ok]) / f[ok]
                        tt = tq[ok]
                        cum = np.cumsum(rel) / np.arange(1, rel.size + 1)
                        idx = np.searchsorted(tt, grid, side="right") - 1
                        curve = np.where(idx >= 0, cum[np.maximum(idx, 0)], np.nan)
                        key = (float(eps), d, nq, u)
                        curves.setdefault(key, []).append(curve)
                        finals.setdefault(key, []).append(float(cum[-1]) if cum.size else float("nan"))
    with np.errstate(all="ignore"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mean_curves = {k: np.nanmean(np.stack(v), axis=0) for k, v in curves.items()}
    final = {k: float(np.nanmean(v)) for k, v in finals.items()}
    summary = summarise(final, cfg)
    secs = t.elapsed()
    plots(mean_curves, cfg, grid, out)
    (out / "intermittent.md").write_text(report(final, summary, cfg, secs))
    res = {"final": {"eps=%g d=%d nQ=%d u=%d" % k: v for k, v in final.items()}, "summary": summary,
           "seconds": secs, "scale": scale, "grid": grid,
           "curves": {"eps=%g d=%d nQ=%d u=%d" % k: v for k, v in mean_curves.items()}}
    save_json(out / "intermittent.json", res)
    return res


def _avg(final: dict[tuple, float], **fix: Any) -> float:
    names = ("eps", "d", "nq", "u")
    vals = [v for k, v in final.items() if all(k[names.index(n)] == x for n, x in fix.items())]
    return float(np.mean(vals))


def summarise(final: dict[tuple, float], cfg: dict[str, Any]) -> dict[str, Any]:
    eps_l = [float(e) for e in EPS]
    s: dict[str, Any] = {}
    s["error_by_eps"] = {e: _avg(final, eps=e) for e in eps_l}
    s["error_decreasing_in_eps"] = bool(all(np.diff([s["error_by_eps"][e] for e in eps_l]) < 0))
    s["error_by_nq"] = {nq: _avg(final, nq=nq) for nq in cfg["nqs"]}
    s["error_decreasing_in_nq"] = bool(all(np.diff([s["error_by_nq"][q] for q in cfg["nqs"]]) < 0))
    s["error_by_u"] = {u: _avg(final, u=u) for u in cfg["us"]}
    best = {}
    for e in eps_l:
        for nq in cfg["nqs"]:
            errs = {d: _avg(final, eps=e, nq=nq, d=d) for d in cfg["ds"]}
            best["eps=%g nQ=%d" % (e, nq)] = min(errs, key=lambda d: errs[d])
    s["best_d"] = best
    return s


def plots(curves: dict[tuple, np.ndarray], cfg: dict[str, Any], grid: np.ndarray, out: Path) -> None:
    p = plt()
    for fig_no, (axis_name, values, avg_over) in enumerate(
            (("nq", cfg["nqs"], cfg["us"]), ("u", cfg["us"], cfg["nqs"])), start=3):
        fig, axes = p.subplots(len(values), len(EPS), figsize=(4 * len(EPS), 3 * len(values)), squeeze=False)
        for r, val in enumerate(values):
            for c, eps in enumerate(EPS):
                ax = axes[r][c]
                for d in cfg["ds"]:
                    if axis_name == "nq":
                        ys = np.mean([curves[(float(eps), d, val, u)] for u in avg_over], axis=0)
                    else:
                        ys = np.mean([curves[(float(eps), d, nq, val)] for nq in avg_over], axis=0)
                    ax.plot(grid, ys, label="d=%d" % d)
                ax.set_title("eps=%g, %s=%d" % (float(eps), "n_Q" if axis_name == "nq" else "u", val), fontsize=9)
                ax.set_yscale("log")
                ax.set_xlabel("time (arrivals)", fontsize=8)
                ax.set_ylabel("cum. mean rel. error", fontsize=8)
        # one legend for all panels (the curves are the same d in every panel), below them: panel
        # legends sat on the curves of some panels
        h, lab = axes[0][0].get_legend_handles_labels()
        fig.legend(h, lab, loc="lower center", ncol=len(cfg["ds"]), fontsize=10, frameon=False)
        fig.suptitle("intermittent-queries Fig. %d (Algorithm 4, w=%d)" % (fig_no, W))
        fig.tight_layout(rect=(0, 0.045, 1, 1))
        fig.savefig(out / ("fig%d_%s.png" % (fig_no, axis_name)), dpi=100)
        p.close(fig)


def report(final: dict[tuple, float], s: dict[str, Any], cfg: dict[str, Any], secs: float) -> str:
    lines = ["# intermittent-queries reproduction (Algorithm 4, use-and-keep)", "",
             "Stream %d Zipf(1) items over 2^29, queries after %d arrivals, %d queried elements per scenario, "
             "w = %d, %d repetitions; discrete Laplace(d/eps); %.1f s." % (
                 cfg["n"], cfg["start"], cfg["total_q"], W, cfg["reps"], secs), "",
             "Final cumulative mean relative error (queries with true count 0 at query time are excluded):", ""]
    hdr = ["eps", "n_Q", "u"] + ["d=%d" % d for d in cfg["ds"]]
    rows = []
    for eps in EPS:
        for nq in cfg["nqs"]:
            for u in cfg["us"]:
                rows.append([float(eps), nq, u] + [final[(float(eps), d, nq, u)] for d in cfg["ds"]])
    lines.append(md_table(hdr, rows))
    lines += ["", "## Summary", ""]
    for k, v in s.items():
        lines.append("- %s: %s" % (k, v))
    return "\n".join(lines) + "\n"
