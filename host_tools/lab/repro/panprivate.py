"""Reproduction for pan-private-sketches.txt: distinct counts (Alg. 1 / Thm 5) and
cropped sums / heavy-hitter counts (§4.1 Lemma 5, §4.2 Theorem 12).

The paper has no experiments; we measure the estimators' error against the
theorems' bounds on Zipf and uniform streams.

* Distinct count: :class:`pansketch.host_tools.lab.algorithms.distinct.DistinctSketch` (integer Pareto(p)
  projections, |X| <= M, exact discrete Laplace with scale r*M/eps; event
  unit, clip 1). The replay computes the exact noise-free sketch
  (:func:`sketch_exact`, equal to the device's per-event sums) and adds the
  device's own noise draws (pansketch.agent.noise, exact, big integers). We report the
  estimate without noise (the estimator itself), with noise, and Lemma 4's
  additive term xi*sf for several hash resolutions b (M = 2^((b+F)q)).
* Distinct count as the paper writes it (:func:`exact_pstable_exp`): exact
  p-stable projections stable(r1, r2, p) in floats (log space) for every item
  of a universe [m], ||X_j||_inf over the universe, Laplace noise: its floor
  is Theta(m) too, so bounding the projections is not what causes it.
* Cropped sum over U = 2^16 (full space) and HH(k) over a hashed universe of
  size h: exact final-state simulation (:func:`simulate_cropped_sum`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from pansketch.agent import noise as agent_noise
from pansketch.agent.pi import hashvec
from pansketch.agent.rng import DeterministicSource, Rng
from pansketch.host_tools import fasthash
from pansketch.host_tools.lab.algorithms.panprivate import (distinct_estimate, distinct_scale, hh_count_simulated, lemma4_xi,
                                              lemma5_bound, simulate_cropped_sum, theorem12_bounds)

from .common import Timer, check_scale, md_table, plt, save_json, zipf_stream

CONFIG: dict[str, dict[str, Any]] = {
    "tiny": dict(ns=(300, 3000), vbits=(8, 16), r=16, trials=1, cs_trials=20, hh_trials=20, hh_n=20000, ks=(10,),
                 pstable_log_m=(12,)),
    "small": dict(ns=(300, 3000, 30000, 100000), vbits=(8, 12, 16, 20), r=32, trials=2, cs_trials=200, hh_trials=200,
                  hh_n=200000, ks=(10, 30, 100), pstable_log_m=(16, 20)),
    "paper": dict(ns=(300, 3000, 30000, 300000, 3000000), vbits=(8, 12, 16, 20, 24, 30), r=64, trials=10,
                  cs_trials=1000, hh_trials=1000, hh_n=1000000, ks=(10, 30, 100, 300), pstable_log_m=(16, 20, 22)),
}
Q, FRAC = 16, 8
EPS = 1.0


def sketch_exact(keys: np.ndarray, vals: np.ndarray, r: int, salt: str, vbits: int) -> list[int]:
    """Noise-free sk_j = sum_i a_i X_ij, grouping items by their hash value v per row
    (at most 2^b distinct projections per row), with big-integer arithmetic."""
    st = fasthash.streams([int(x) for x in keys], salt, r)
    words = hashvec.row_words(st, r)
    v = (hashvec.row_values(words) >> (30 - vbits)).astype(np.int64)
    sgn = np.where(hashvec.negative(words), -1, 1)
    shift = vbits + FRAC
    table = _TABLES.get(vbits)
    if table is None and vbits <= 16:
        table = _TABLES[vbits] = [((1 << shift) // (vv + 1)) ** Q for vv in range(1 << vbits)]
    sk = []
    for j in range(r):
        wts = (vals * sgn[:, j]).astype(np.int64)
        if vbits <= 20:
            coef = np.bincount(v[:, j], weights=wts.astype(np.float64), minlength=1 << vbits)
            nz = np.nonzero(coef)[0]
            pairs = zip(nz.tolist(), np.round(coef[nz]).astype(np.int64).tolist())
        else:  # 2^b bins would not fit in memory: group the distinct values instead
            uv, inv = np.unique(v[:, j], return_inverse=True)
            pairs = zip(uv.tolist(), np.bincount(inv, weights=wts.astype(np.float64)).round().astype(np.int64).tolist())
        tot = 0
        for vv, cf in pairs:
            if cf:
                x = table[vv] if table is not None else ((1 << shift) // (vv + 1)) ** Q
                tot += cf * x
        sk.append(tot)
    return sk


_TABLES: dict[int, list[int]] = {}


def distinct_exp(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    gen = np.random.default_rng(seed)
    rng = Rng(DeterministicSource(b"repro-distinct-%d" % seed))  # reproducible; NOT private (simulation)
    r = cfg["r"]
    out: dict[str, Any] = {}
    for dist in ("zipf", "uniform"):
        for n in cfg["ns"]:
            for b in cfg["vbits"]:
                sf = distinct_scale(Q, b, FRAC)
                M = 1 << ((b + FRAC) * Q)
                xi = lemma4_xi(M, r, EPS, 0.05, Q)
                rows = []
                for t in range(cfg["trials"]):
                    s = zipf_stream(gen, n, 1 << 24, 1.1) if dist == "zipf" else gen.integers(0, 10 * n, size=n)
                    keys, cnt = np.unique(s, return_counts=True)
                    sk = sketch_exact(keys, np.ones(keys.size, dtype=np.int64), r, "repro/dc/%d" % t, b)
                    # event unit with clip 1 and cash-register counts: a_i = count; but sum |a|^p > D,
                    # so we sketch the count vector itself:
                    sk_c = sketch_exact(keys, cnt.astype(np.int64), r, "repro/dc/%d" % t, b)
                    num, den = r * M, 1  # scale r*M/eps with eps = 1
                    noisy = [v + agent_noise.discrete_laplace(rng, num, den) for v in sk_c]
                    rows.append((keys.size, distinct_estimate(sk, sf, Q, FRAC), distinct_estimate(sk_c, sf, Q, FRAC),
                                 distinct_estimate(noisy, sf, Q, FRAC)))
                a = np.array(rows, dtype=float)
                out["%s n=%d b=%d" % (dist, n, b)] = {
                    "dist": dist, "n": n, "b": b, "D": float(a[:, 0].mean()),
                    "est_indicator_nonoise": float(a[:, 1].mean()), "est_counts_nonoise": float(a[:, 2].mean()),
                    "est_private": float(a[:, 3].mean()),
                    "rel_err_nonoise": float(np.mean(np.abs(a[:, 2] - a[:, 0]) / a[:, 0])),
                    "abs_err_private": float(np.mean(np.abs(a[:, 3] - a[:, 0]))),
                    "lemma4_additive_xi_sf": xi / (1 << FRAC) / sf,
                    "sf": sf}
    return out


def stable_log(gen: np.random.Generator, shape: tuple[int, ...], p: float) -> tuple[np.ndarray, np.ndarray]:
    """(log|X|, sign X) for symmetric p-stable X drawn with the paper's stable(r1, r2, p) (§3.2,
    Chambers-Mallows-Stuck): theta = pi (r1 - 1/2), X = sin(p theta) / cos(theta)^(1/p) *
    (cos(theta (1 - p)) / -ln r2)^((1-p)/p). In log space: for p = 1/16, |X| overflows float64."""
    theta = np.pi * (gen.random(shape) - 0.5)
    w = -np.log1p(-gen.random(shape))  # Exp(1) = -ln r2, r2 in (0, 1]
    st = np.sin(p * theta)
    with np.errstate(divide="ignore"):
        lg = (np.log(np.abs(st)) - np.log(np.cos(theta)) / p
              + (1 - p) / p * (np.log(np.cos((1 - p) * theta)) - np.log(w)))
    return lg, np.where(st < 0, -1, 1).astype(np.int8)


def _signed_logsum(lg: np.ndarray, sg: np.ndarray, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """log|sum sg*exp(lg)| and its sign along ``axis``."""
    mx = np.max(lg, axis=axis, keepdims=True)
    tot = np.sum(sg * np.exp(lg - mx), axis=axis)
    with np.errstate(divide="ignore"):
        return np.squeeze(mx, axis=axis) + np.log(np.abs(tot)), np.where(tot < 0, -1, 1)


def exact_pstable_exp(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    """Algorithm 1 as written, with floats: exact p-stable X_ij = stable(r1, r2, p) for every i of the
    universe [m] (p = 1/Q), ||X_j||_inf computed off-line over the whole universe, Laplace noise
    eta_j ~ Lap(2 Z ||X_j||_inf / alpha) with alpha = eps'/r (Z = 1: one occurrence changes), sf(p) =
    median |X0|^p by simulation, D_hat = median_j |sk_j|^p / sf(p). No projection is bounded, so this
    is the paper's own setting: does its additive term stay polylog(m)?"""
    gen = np.random.default_rng(seed + 21)
    p, r, z = 1.0 / Q, cfg["r"], 1.0
    lg0, _ = stable_log(gen, (1 << 20,), p)
    sf = float(np.median(np.exp(p * lg0)))
    out: dict[str, Any] = {"p": p, "r": r, "eps": EPS, "Z": z, "sf": sf, "rows": {}}
    for log_m in cfg["pstable_log_m"]:
        m = 1 << log_m
        lgX, sgX = stable_log(gen, (m, r), p)
        linf = lgX.max(axis=0)  # log ||X_j||_inf over the universe, per j
        for dist in ("zipf", "uniform"):
            for n in cfg["ns"]:
                if n > m:
                    continue
                ests, nonoise, Ds = [], [], []
                for _t in range(cfg["trials"]):
                    s = (zipf_stream(gen, n, m, 1.1) - 1) if dist == "zipf" else gen.integers(0, m, size=n)
                    keys, cnt = np.unique(s, return_counts=True)
                    lg = lgX[keys] + np.log(cnt)[:, None]
                    lsk, ssk = _signed_logsum(lg, sgX[keys].astype(np.int64))
                    lap = gen.laplace(0.0, 1.0, size=r)
                    leta = np.log(2 * z * r / EPS) + linf + np.log(np.abs(lap))
                    ltot, _ = _signed_logsum(np.stack([lsk, leta]), np.stack([ssk, np.sign(lap).astype(np.int64)]))
                    ests.append(float(np.median(np.exp(p * ltot))) / sf)
                    nonoise.append(float(np.median(np.exp(p * lsk))) / sf)
                    Ds.append(keys.size)
                out["rows"]["%s m=2^%d n=%d" % (dist, log_m, n)] = {
                    "dist": dist, "m": m, "n": n, "D": float(np.mean(Ds)), "est_nonoise": float(np.mean(nonoise)),
                    "est_private": float(np.mean(ests)), "private_over_m": float(np.mean(ests)) / m,
                    # Algorithm 1's last line read literally (median * sf(p), a typo for / sf(p): without
                    # noise it returns about sf^2 D, not D)
                    "private_times_sf_over_m": float(np.mean(ests)) * sf * sf / m,
                    "noise_floor_over_m": float(np.median(np.exp(p * (np.log(2 * z * r / EPS) + linf)))
                                                * np.median(np.abs(gen.laplace(0, 1, 100001)) ** p)) / sf / m}
        del lgX, sgX
    return out


def cropped_exp(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    gen = np.random.default_rng(seed + 3)
    m = 1 << 16
    out: dict[str, Any] = {}
    for dist in ("zipf", "uniform"):
        s = zipf_stream(gen, 100000, m, 1.0) - 1 if dist == "zipf" else gen.integers(0, m, size=100000)
        a = np.bincount(s, minlength=m)
        for tau in (1, 10, 100):
            true = float(np.minimum(a, tau).sum())
            ests = np.array([simulate_cropped_sum(a, tau, EPS, gen)[1] for _ in range(cfg["cs_trials"])])
            alpha = math.sqrt(math.log(2 / 0.05) / 2)  # 95% (Hoeffding)
            bound, _ = lemma5_bound(alpha, tau, m, EPS)
            err = np.abs(ests - true)
            out["%s tau=%d" % (dist, tau)] = {"true": true, "mean_est": float(ests.mean()),
                                              "rmse": float(np.sqrt(np.mean((ests - true) ** 2))),
                                              "q95_abs_err": float(np.quantile(err, 0.95)), "lemma5_95": bound,
                                              "within": float(np.mean(err <= bound))}
    return out


def hh_exp(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    gen = np.random.default_rng(seed + 5)
    n = cfg["hh_n"]
    c, beta, delta = 2.0, 0.25, 0.25
    alpha = math.sqrt(math.log(4 / 0.1))  # Theorem 12 failure 4 exp(-alpha^2)-style, 90%
    out: dict[str, Any] = {}
    for dist in ("zipf", "uniform"):
        s = zipf_stream(gen, n, 1 << 20, 1.1) if dist == "zipf" else gen.integers(0, 1 << 20, size=n)
        keys, cnt = np.unique(s, return_counts=True)
        for k in cfg["ks"]:
            h = int(math.ceil(max(k / (beta * delta), (math.sqrt(2) + 2) * c * k)))
            hh = int(np.sum(cnt >= n / k))
            hh_big = int(np.sum(cnt >= n / (2 * c * c * k * k / delta)))
            ests = []
            for t in range(cfg["hh_trials"]):
                cols, _ = fasthash.cols_signs(fasthash.streams([int(x) for x in keys], "repro/hh/%d" % (t % 8), 1), 1, h)
                nb = np.bincount(cols[:, 0], weights=cnt, minlength=h).astype(np.int64)
                ests.append(hh_count_simulated(nb, k, c, n, EPS, gen))
            e = np.array(ests)
            lo, hi = theorem12_bounds(hh, hh_big, h, c, alpha, EPS, beta)
            out["%s k=%d" % (dist, k)] = {"h": h, "HH(k)": hh, "HH(2c^2k^2/delta)": hh_big, "mean_est": float(e.mean()),
                                          "std_est": float(e.std()), "thm12_lo": lo, "thm12_hi": hi,
                                          "within": float(np.mean((e >= lo) & (e <= hi)))}
    return out


def run(scale: str, out: Path, seed: int = 1) -> dict[str, Any]:
    check_scale(scale)
    cfg = CONFIG[scale]
    out.mkdir(parents=True, exist_ok=True)
    t = Timer()
    res: dict[str, Any] = {"scale": scale}
    t.step("distinct counts")
    res["distinct"] = distinct_exp(cfg, seed)
    t.step("exact p-stable noise")
    res["exact_pstable"] = exact_pstable_exp(cfg, seed)
    t.step("cropped sums")
    res["cropped"] = cropped_exp(cfg, seed)
    t.step("heavy hitters")
    res["hh"] = hh_exp(cfg, seed)
    res["seconds"] = t.elapsed()
    res["summary"] = summarise(res)
    plots(res, cfg, out)
    (out / "panprivate.md").write_text(report(res, cfg))
    save_json(out / "panprivate.json", res)
    return res


def summarise(res: dict[str, Any]) -> dict[str, Any]:
    d = res["distinct"]
    s: dict[str, Any] = {}
    s["distinct_nonoise_max_rel_err_b>=16"] = max(v["rel_err_nonoise"] for v in d.values() if v["b"] >= 16)
    s["distinct_private_abs_err_over_D_min"] = min(v["abs_err_private"] / v["D"] for v in d.values())
    ps = res["exact_pstable"]["rows"].values()
    s["exact_pstable_private_over_m"] = (min(v["private_over_m"] for v in ps), max(v["private_over_m"] for v in ps))
    s["exact_pstable_nonoise_over_D"] = (min(v["est_nonoise"] / v["D"] for v in ps),
                                         max(v["est_nonoise"] / v["D"] for v in ps))
    s["cropped_within_lemma5_min"] = min(v["within"] for v in res["cropped"].values())
    s["hh_within_thm12_min"] = min(v["within"] for v in res["hh"].values())
    return s


def plots(res: dict[str, Any], cfg: dict[str, Any], out: Path) -> None:
    p = plt()
    fig, axes = p.subplots(1, 3, figsize=(17, 6.5))
    bcol = dict(zip(cfg["vbits"], ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")))
    lim = [min(v["D"] for v in res["distinct"].values()), max(v["D"] for v in res["distinct"].values())]
    for ax, dist in zip(axes, ("zipf", "uniform")):
        for b in cfg["vbits"]:  # one colour per b; line style says which quantity
            vs = [v for v in res["distinct"].values() if v["dist"] == dist and v["b"] == b]
            Ds = [v["D"] for v in vs]
            ax.plot(Ds, [v["est_private"] for v in vs], "o-", color=bcol[b], label="private, b=%d" % b)
            ax.plot(Ds, [v["est_counts_nonoise"] for v in vs], "x:", color=bcol[b], label="no noise, b=%d" % b)
            ax.plot(Ds, [v["lemma4_additive_xi_sf"] for v in vs], "--", color=bcol[b], alpha=0.45,
                    label="Lemma 4 xi*sf, b=%d" % b)
        ax.plot(lim, lim, "k-", lw=0.8, label="D (exact answer)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("true distinct count D")
        ax.set_ylabel("estimate")
        ax.set_title("device form (bounded Pareto), %s\nr=%d, p=1/%d, eps=%g" % (dist, cfg["r"], Q, EPS))
    ax = axes[2]
    ps = res["exact_pstable"]
    mcol = {16: "#17becf", 20: "#e377c2", 12: "#bcbd22", 22: "#7f7f7f"}
    for log_m in cfg["pstable_log_m"]:
        for dist, mk in (("zipf", "o"), ("uniform", "s")):
            vs = [v for v in ps["rows"].values() if v["m"] == 1 << log_m and v["dist"] == dist]
            Ds = [v["D"] for v in vs]
            ax.plot(Ds, [v["est_private"] for v in vs], mk + "-", color=mcol[log_m],
                    label="exact p-stable, private, m=2^%d (%s)" % (log_m, dist))
            ax.plot(Ds, [v["est_nonoise"] for v in vs], mk + ":", color=mcol[log_m], mfc="none",
                    label="exact p-stable, no noise, m=2^%d (%s)" % (log_m, dist))
        ax.axhline(1 << log_m, color=mcol[log_m], ls="--", lw=0.9, label="m = 2^%d" % log_m)
    ax.plot(lim, lim, "k-", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("true distinct count D")
    ax.set_ylabel("estimate")
    ax.set_title("Alg. 1 as written: exact stable(r1, r2, p), ||X_j||inf\nover the universe [m], r=%d, p=1/%d, eps=%g"
                 % (ps["r"], Q, EPS))
    from matplotlib.ticker import NullFormatter
    for ax in axes:
        ax.xaxis.set_minor_formatter(NullFormatter())  # 2x10^2, 3x10^2 ... overlapped
    h0, l0 = axes[0].get_legend_handles_labels()
    fig.legend(h0, l0, loc="lower left", bbox_to_anchor=(0.01, 0.0), ncol=3, fontsize=9, frameon=False)
    h2, l2 = axes[2].get_legend_handles_labels()
    fig.legend(h2, l2, loc="lower right", bbox_to_anchor=(0.99, 0.0), ncol=2, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.23, 1, 1))
    fig.savefig(out / "distinct.png", dpi=100)
    p.close(fig)
    fig, ax = p.subplots(figsize=(10, 5.5))
    keys = list(res["hh"])
    x = np.arange(len(keys))
    ax.errorbar(x, [res["hh"][k]["mean_est"] for k in keys], yerr=[res["hh"][k]["std_est"] for k in keys], fmt="o",
                color="#1f77b4", capsize=4, label="estimate (mean ± sd)")
    ax.plot(x, [res["hh"][k]["HH(k)"] for k in keys], "_", color="k", ms=22, mew=2, label="HH(k) (true)")
    ax.plot(x, [res["hh"][k]["thm12_lo"] for k in keys], "v", color="#d62728", ms=8, label="Thm 12 lower bound")
    ax.plot(x, [res["hh"][k]["thm12_hi"] for k in keys], "^", color="#2ca02c", ms=8, label="Thm 12 upper bound")
    # the bounds span -10^3 .. 2*10^5 around counts of 1-100: a linear axis flattened everything to 0
    ax.set_yscale("symlog", linthresh=10)
    ax.axhline(0, color="0.7", lw=0.8)
    ax.set_xticks(x)
    ax.set_xticklabels(keys, rotation=20, fontsize=9)
    ax.set_ylabel("heavy-hitter count (symlog)")
    ax.set_title("§4.2 heavy-hitter count, eps=%g, c=2" % EPS)
    ax.legend(fontsize=10, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(out / "hh_count.png", dpi=100)
    p.close(fig)


def report(res: dict[str, Any], cfg: dict[str, Any]) -> str:
    L = ["# pan-private-sketches reproduction", "", "%.1f s, eps = %g." % (res["seconds"], EPS), "",
         "## Distinct count (Algorithm 1, integer form, r = %d, p = 1/%d, F = %d)" % (cfg["r"], Q, FRAC), ""]
    hdr = ["stream", "b", "D", "no-noise est. (indicator)", "no-noise est. (counts)", "private est.",
           "|err| private", "Lemma 4 xi*sf"]
    rows = [["%s n=%d" % (v["dist"], v["n"]), v["b"], v["D"], v["est_indicator_nonoise"], v["est_counts_nonoise"],
             v["est_private"], v["abs_err_private"], v["lemma4_additive_xi_sf"]] for v in res["distinct"].values()]
    L.append(md_table(hdr, rows))
    ps = res["exact_pstable"]
    L += ["", "## Distinct count, Algorithm 1 as written (exact p-stable projections, floats)", "",
          "X_ij = stable(r1, r2, p) for every item of the universe [m], p = %g, r = %d, eps' = %g (alpha = eps'/r), "
          "Z = %g, eta_j ~ Lap(2 Z ||X_j||_inf / alpha) with ||X_j||_inf over the universe, sf(p) = %.4g, "
          "D_hat = median_j |sk_j|^p / sf(p). 'noise alone' is the median of |eta_j|^p / sf over the noise's "
          "own distribution; 'x sf' reads the paper's last line literally (median * sf, which without noise "
          "returns about sf^2 D)." % (ps["p"], ps["r"], ps["eps"], ps["Z"], ps["sf"]), ""]
    L.append(md_table(["stream", "m", "D", "no-noise est.", "private est.", "private / m", "noise alone / m",
                       "literal x sf: private / m"],
                      [["%s n=%d" % (v["dist"], v["n"]), v["m"], v["D"], v["est_nonoise"], v["est_private"],
                        v["private_over_m"], v["noise_floor_over_m"], v["private_times_sf_over_m"]]
                       for v in ps["rows"].values()]))
    L += ["", "## Cropped sum, full space U = 2^16 (Lemma 5, 95% bound)", ""]
    L.append(md_table(["case", "T1(tau)", "mean est.", "RMSE", "95% |err|", "Lemma 5 (95%)", "fraction within"],
                      [[k, v["true"], v["mean_est"], v["rmse"], v["q95_abs_err"], v["lemma5_95"], v["within"]]
                       for k, v in res["cropped"].items()]))
    L += ["", "## Heavy-hitter count (Theorem 12, c = 2, beta = delta = 1/4)", ""]
    L.append(md_table(["case", "h", "HH(k)", "HH(2c²k²/δ)", "mean est.", "sd", "Thm 12 low", "Thm 12 high",
                       "fraction within"],
                      [[k, v["h"], v["HH(k)"], v["HH(2c^2k^2/delta)"], v["mean_est"], v["std_est"], v["thm12_lo"],
                        v["thm12_hi"], v["within"]] for k, v in res["hh"].items()]))
    L += ["", "## Summary", ""] + ["- %s: %s" % (k, v) for k, v in res["summary"].items()]
    return "\n".join(L) + "\n"
