"""Reproduction of dp-linear-sketches.txt Figures 1(a,c) and 2(a) (Zipf data).

Figure 1: ARE over all unique items and top-10 F1 of (private) Count-Min and
CountSketch, rho in {0.1, 1, 10}, beta = 1%, Zipf(1) on 1..2^16-1, N = 1e5,
5 runs; gamma in {2^-9, ..., 2^-13}. Two sets of shapes:

* ``paper``: what the paper states -- Algorithm 3 with d = ceil(ln(2/beta)) = 6
  rows and w = 1/gamma = 512..8192 columns (the paper's x-axis labels,
  9.2-147.4 KB, are ln(1/beta)/gamma 4-byte counters, i.e. 4.6 rows).
* ``notebook``: what the authors' public notebook really ran: it calls the
  constructors ``(gamma, beta)`` with ``(beta, gamma)``, so w = ceil(1/0.01) =
  100 columns and d = ceil(ln(1/gamma)) = 7..10 rows (2.7-3.9 KiB), with
  sigma^2 = ln(2/gamma)/rho and its own offset (:func:`notebook_E`).

Count-Min is reported with the paper's E, the notebook's E (notebook shapes)
and the tighter :func:`union_E`. Figure 2: average rank error of (private)
DCS on m evenly spaced quantiles, gamma = 1%, U = 2^16. :func:`hash_check`:
non-private CountSketch at the notebook's shapes with the authors' fixed md5
hash, other prefixes of that construction, and our salts (where the gap to the
published CS comes from).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from pansketch.host_tools import fasthash
from pansketch.host_tools.lab.algorithms.linear import (DyadicCountSketch, dcs_shape, notebook_E, paper_E, paper_rows, sigma2_for,
                                          union_E)
from pansketch.host_tools.lab.algorithms.vnoise import BulkNoise, ceil_fraction

from .common import Timer, check_scale, md_table, plt, save_json, zipf_stream

RHOS = (0.1, 1.0, 10.0)
BETA = 0.01
GAMMAS = (2**-9, 2**-10, 2**-11, 2**-12, 2**-13)

# Printed output of the authors' public Evaluation.ipynb, x = ln(1/beta)/gamma*4/1024 KB. NOT the Zipf
# panel: these are the cell that runs FrequencyEstimation('CAIDA', ...). Kept for reference only.
PUBLISHED_ARE_CAIDA = {
    "CMS": [420.72, 420.72, 411.51, 405.34, 399.95],
    "CS": [49.75, 49.75, 44.28, 43.22, 39.42],
    "PCMS rho=0.1": [920.68, 1167.21, 1520.30, 2045.05, 2817.03],
    "PCMS rho=1": [578.97, 656.75, 762.19, 924.07, 1164.47],
    "PCMS rho=10": [470.77, 495.36, 522.37, 569.32, 641.73],
    "PCS rho=0.1": [49.78, 49.86, 44.54, 43.40, 39.53],
    "PCS rho=1": [49.76, 49.78, 44.29, 43.25, 39.40],
    "PCS rho=10": [49.75, 49.74, 44.29, 43.24, 39.43],
}
# The notebook's Zipf run (Fig. 1(a)), first -> last space point: what our Zipf streams compare to
PUBLISHED_ARE_ZIPF = {
    "CMS": (374.4, 359.3),
    "CS": (50.3, 40.8),
    "PCMS rho=0.1": (942.0, 3100.0),
    "PCMS rho=1": (554.0, 1226.0),
    "PCMS rho=10": (431.0, 633.0),
}

CONFIG: dict[str, dict[str, Any]] = {
    "tiny": dict(n=20000, runs=1, gammas=GAMMAS[:3:2], ms=(1, 4, 16), dcs_runs=1, hash_prefixes=3),
    "small": dict(n=100000, runs=5, gammas=GAMMAS, ms=(1, 2, 4, 8, 16, 32, 64), dcs_runs=5, hash_prefixes=16),
    "paper": dict(n=100000, runs=5, gammas=GAMMAS, ms=(1, 2, 4, 8, 16, 32, 64, 99), dcs_runs=5, hash_prefixes=16),
}


def _counts(cols: np.ndarray, signs: np.ndarray, vals: np.ndarray, kind: str, w: int) -> np.ndarray:
    d = cols.shape[1]
    out = np.zeros((d, w), dtype=np.int64)
    for r in range(d):
        wt = vals * signs[:, r] if kind == "cs" else vals
        out[r] = np.bincount(cols[:, r], weights=wt, minlength=w).astype(np.int64)
    return out


def _est(c: np.ndarray, cols: np.ndarray, signs: np.ndarray, kind: str) -> np.ndarray:
    v = fasthash.row_values(c, cols, signs, kind)
    return v.min(axis=1).astype(float) if kind == "cms" else np.median(v, axis=1)


def _metrics(est: np.ndarray, true: np.ndarray, top_true: set[int], k: int = 10) -> tuple[float, float]:
    are = float(np.mean(np.abs(est - true) / true))
    top_est = set(np.argsort(-est, kind="stable")[:k].tolist())
    tp = len(top_est & top_true)
    f1 = 0.0 if tp == 0 else 2 * tp / (len(top_est) + len(top_true))
    return are, f1


def shapes(kind_set: str, gammas: tuple[float, ...]) -> list[dict[str, Any]]:
    out = []
    for g in gammas:
        label_kb = np.log(1 / BETA) / g * 4 / 1024
        if kind_set == "paper":
            d, w = paper_rows(BETA), int(round(1 / g))
            out.append(dict(gamma=g, d=d, w=w, kib=d * w * 4 / 1024, label_kb=label_kb))
        else:
            d, w = int(np.ceil(np.log(1 / g))), 100
            out.append(dict(gamma=g, d=d, w=w, kib=d * w * 4 / 1024, label_kb=label_kb))
    return out


def fig1(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    gen = np.random.default_rng(seed)
    noise = BulkNoise(seed + 1)
    res: dict[str, Any] = {"paper": {}, "notebook": {}}
    sets = {s: shapes(s, cfg["gammas"]) for s in ("paper", "notebook")}
    for run in range(cfg["runs"]):
        stream = zipf_stream(gen, cfg["n"], (1 << 16) - 1, 1.0)
        keys, true = np.unique(stream, return_counts=True)
        true = true.astype(np.int64)
        top_true = set(np.argsort(-true, kind="stable")[:10].tolist())
        st = fasthash.streams([int(x) for x in keys], "repro/dpl/run%d" % run, 10)
        for sname, shs in sets.items():
            for sh in shs:
                d, w, g = sh["d"], sh["w"], sh["gamma"]
                cols, signs = fasthash.cols_signs(st, d, w)
                ex = {k: _counts(cols, signs, true, k, w) for k in ("cms", "cs")}
                row: dict[str, tuple[float, float]] = {}
                row["CMS"] = _metrics(_est(ex["cms"], cols, signs, "cms"), true, top_true)
                row["CS"] = _metrics(_est(ex["cs"], cols, signs, "cs"), true, top_true)
                for rho in RHOS:
                    if sname == "paper":
                        var = sigma2_for(d, rho)  # Delta2^2 = 2d, sigma^2 = d/rho >= ln(2/beta)/rho
                        offs = {"paper E": paper_E(g, BETA, rho), "union E": union_E(d, w, float(var), BETA)}
                    else:
                        var = ceil_fraction(np.log(2 / g) / rho)  # the notebook's sigma^2 (beta' = gamma)
                        offs = {"notebook E": notebook_E(BETA, g, rho), "paper E": paper_E(BETA, g, rho),
                                "union E": union_E(d, w, float(var), g)}
                    ncs = noise.dgauss(var, d * w).reshape(d, w)
                    row["PCS rho=%g" % rho] = _metrics(_est(ex["cs"] + ncs, cols, signs, "cs"), true, top_true)
                    ncm = noise.dgauss(var, d * w).reshape(d, w)
                    base = _est(ex["cms"] + ncm, cols, signs, "cms")
                    for oname, E in offs.items():
                        row["PCMS rho=%g (%s)" % (rho, oname)] = _metrics(base + E, true, top_true)
                        row["E rho=%g (%s)" % (rho, oname)] = (float(E), float("nan"))
                    row["var rho=%g" % rho] = (float(var), float("nan"))
                acc = res[sname].setdefault(int(round(1 / g)), {"shape": sh, "m": {}})
                for k, v in row.items():
                    acc["m"].setdefault(k, []).append(v)
    # average over runs
    for sname in res:
        for key, acc in res[sname].items():
            acc["m"] = {k: [float(np.mean([x[0] for x in v])), float(np.mean([x[1] for x in v]))]
                        for k, v in acc["m"].items()}
    return res


def md5_columns_signs(keys: np.ndarray, d: int, w: int, prefix: str = "") -> tuple[np.ndarray, np.ndarray]:
    """The authors' hash construction (their CountMin.py / CountMedian.py): row i's column is
    int(md5(s + "0" + "1" + ... + str(i)).hexdigest(), 16) % w with s = prefix + str(hash(x)) (one
    md5 object updated row after row), the sign likewise from sha256 (even -> -1). The authors use
    prefix "" for every run: a single fixed hash. Rows are cumulative, so the first d' < d rows of a
    d-row table are the d'-row table."""
    cols = np.empty((keys.size, d), dtype=np.int64)
    signs = np.empty((keys.size, d), dtype=np.int64)
    for k, x in enumerate(keys.tolist()):
        base = (prefix + str(hash(x))).encode()
        m5, sh = hashlib.md5(base), hashlib.sha256(base)
        for i in range(d):
            tag = str(i).encode()
            m5.update(tag)
            sh.update(tag)
            cols[k, i] = int(m5.hexdigest(), 16) % w
            signs[k, i] = 1 if int(sh.hexdigest(), 16) % 2 else -1
    return cols, signs


def hash_check(cfg: dict[str, Any], seed: int, n_prefixes: int = 16) -> dict[str, Any]:
    """Non-private CountSketch ARE at the notebook's shapes (w = 100, d = 7 and 10) on the same Zipf
    streams as :func:`fig1`, for the authors' fixed md5 hash, for n_prefixes - 1 other prefixes of the
    same construction, and for n_prefixes families of our salts (hash version 1): is the gap between
    our CS and the notebook's Zipf CS (50.3 -> 40.8) the hash draw?"""
    gen = np.random.default_rng(seed)  # the same streams as fig1 (same generator, same calls)
    ds, w = (int(np.ceil(np.log(1 / cfg["gammas"][0]))), int(np.ceil(np.log(1 / cfg["gammas"][-1])))), 100
    dmax = max(ds)
    are: dict[str, dict[int, list[list[float]]]] = {"authors md5": {d: [] for d in ds},
                                                     "md5 prefixes": {d: [] for d in ds},
                                                     "our salts": {d: [] for d in ds}}
    for run in range(cfg["runs"]):
        stream = zipf_stream(gen, cfg["n"], (1 << 16) - 1, 1.0)
        keys, true = np.unique(stream, return_counts=True)
        true = true.astype(np.int64)
        variants: list[tuple[str, int, tuple[np.ndarray, np.ndarray]]] = []
        for k in range(n_prefixes):
            variants.append(("authors md5" if k == 0 else "md5 prefixes", k,
                             md5_columns_signs(keys, dmax, w, "" if k == 0 else "%d:" % k)))
            salt = "repro/dpl/run%d" % run if k == 0 else "repro/dpl/salt%d/run%d" % (k, run)
            variants.append(("our salts", k, fasthash.cols_signs(fasthash.streams([int(x) for x in keys], salt, dmax),
                                                                 dmax, w)))
        for name, k, (cols, signs) in variants:
            for d in ds:
                c, sg = cols[:, :d], signs[:, :d]
                est = _est(_counts(c, sg, true, "cs", w), c, sg, "cs")
                lst = are[name][d]
                while len(lst) <= k:
                    lst.append([])
                lst[k].append(float(np.mean(np.abs(est - true) / true)))
    out: dict[str, Any] = {"w": w, "runs": cfg["runs"], "n_prefixes": n_prefixes}
    for name, by_d in are.items():
        for d, per_k in by_d.items():
            vals = [float(np.mean(v)) for v in per_k if v]  # ARE averaged over the runs, per hash
            out["%s d=%d" % (name, d)] = {"mean": float(np.mean(vals)), "sd": float(np.std(vals, ddof=1)) if len(
                vals) > 1 else 0.0, "n": len(vals), "values": vals}
    return out


def fig2(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    gen = np.random.default_rng(seed + 7)
    noise = BulkNoise(seed + 8)
    log_u = 16
    d_paper, w = dcs_shape(log_u, 0.01)
    shapes_ = {"paper": (d_paper, w), "notebook": (int(np.ceil(np.log(d_paper))), w)}
    ms = cfg["ms"]
    out: dict[str, Any] = {s: {"d": dw[0], "w": dw[1], "err": {}, "qerr": {}} for s, dw in shapes_.items()}
    n = cfg["n"]
    for run in range(cfg["dcs_runs"]):
        vals = zipf_stream(gen, n, (1 << 16) - 1, 1.0)
        srt = np.sort(vals)
        for sname, (d, w_) in shapes_.items():
            exact = DyadicCountSketch.exact_counts(vals, log_u, d, w_, "repro/dcs/run%d" % run)
            for rho in (None,) + RHOS:
                if rho is None or sname == "paper":
                    sk = DyadicCountSketch(log_u, d, w_, "repro/dcs/run%d" % run, rho, noise, exact=exact)
                else:  # notebook: per level CountSketch(1/w, 1/rows, rho/levels): sigma^2 = ln(2*rows)*levels/rho
                    sk = DyadicCountSketch(log_u, d, w_, "repro/dcs/run%d" % run, None, exact=exact)
                    var = ceil_fraction(np.log(2 * d_paper) * log_u / rho)
                    sk.counters += noise.dgauss(var, sk.counters.size).reshape(sk.counters.shape)
                name = "DCS" if rho is None else "DP DCS rho=%g" % rho
                for m in ms:
                    qs = np.arange(1, m + 1) / (m + 1)
                    idx = np.clip(np.ceil(qs * n).astype(int) - 1, 0, n - 1)
                    items = srt[idx]
                    true_r = np.searchsorted(srt, items, side="right")
                    err = float(np.mean(np.abs(sk.rank_le(items) - true_r)))
                    xq = sk.quantile(qs, n)
                    # quantile error in rank space: distance of qN to the true rank interval of the answer
                    lo = np.searchsorted(srt, xq, side="left")
                    hi = np.searchsorted(srt, xq, side="right")
                    tgt = qs * n
                    qerr = float(np.mean(np.maximum(0, np.maximum(lo - tgt, tgt - hi))))
                    out[sname]["err"].setdefault(name, {}).setdefault(m, []).append(err)
                    out[sname]["qerr"].setdefault(name, {}).setdefault(m, []).append(qerr)
    for s in out.values():
        for key in ("err", "qerr"):
            s[key] = {k: {m: float(np.mean(v)) for m, v in d_.items()} for k, d_ in s[key].items()}
    return out


def run(scale: str, out: Path, seed: int = 1) -> dict[str, Any]:
    check_scale(scale)
    cfg = CONFIG[scale]
    out.mkdir(parents=True, exist_ok=True)
    t = Timer()
    t.step("figure 1 (accuracy by width)")
    f1 = fig1(cfg, seed)
    t.step("figure 2")
    f2 = fig2(cfg, seed)
    t.step("hash check")
    hc = hash_check(cfg, seed, cfg["hash_prefixes"])
    res: dict[str, Any] = {"fig1": f1, "fig2": f2, "hash_check": hc, "scale": scale, "seed": seed}
    summary = summarise(f1, f2, cfg)
    summary["cs_are_by_hash"] = {k: (v["mean"], v["sd"], v["n"]) for k, v in hc.items() if isinstance(v, dict)}
    res["summary"] = summary
    res["seconds"] = t.elapsed()
    t.step("plots and report")
    plots(f1, f2, out, cfg["n"])
    (out / "dp_linear.md").write_text(report(f1, f2, summary, cfg, res["seconds"], hc))
    save_json(out / "dp_linear.json", res)
    return res


def summarise(f1: dict[str, Any], f2: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    p = f1["paper"]
    ratios = []
    for w, acc in p.items():
        m = acc["m"]
        for rho in RHOS:
            ratios.append(m["PCS rho=%g" % rho][0] / m["CS"][0])
    s["pcs_over_cs_max_ratio_paper"] = max(ratios)
    s["pcs10_over_cs_max_ratio_paper"] = max(acc["m"]["PCS rho=10"][0] / acc["m"]["CS"][0] for acc in p.values())
    ws = sorted(p)
    s["pcms_degrades_with_space_paperE"] = {
        rho: [p[w]["m"]["PCMS rho=%g (paper E)" % rho][0] for w in ws] for rho in RHOS}
    s["pcms_f1_min_paperE"] = min(p[w]["m"]["PCMS rho=%g (paper E)" % rho][1] for w in ws for rho in RHOS)
    s["pcms_f1_min_unionE"] = min(p[w]["m"]["PCMS rho=%g (union E)" % rho][1] for w in ws for rho in RHOS)
    nb = f1["notebook"]
    ds = sorted(nb)
    s["notebook_cms_are"] = [nb[d]["m"]["CMS"][0] for d in ds]
    s["paper_cms_are"] = [p[w]["m"]["CMS"][0] for w in ws]
    s["notebook_pcms01_are"] = [nb[d]["m"]["PCMS rho=0.1 (notebook E)"][0] for d in ds]
    for sname in ("paper", "notebook"):
        err = f2[sname]["err"]
        s["dcs_%s_max_err" % sname] = {k: max(v.values()) for k, v in err.items()}
    return s


# 11 clearly different colours (tab10 + black), one per Fig. 1 series
SERIES_COLOURS = ("#000000", "#7f7f7f", "#1f77b4", "#17becf", "#9467bd", "#d62728", "#ff7f0e", "#bcbd22",
                  "#8c564b", "#e377c2", "#2ca02c")


def fig1_series(sname: str) -> list[str]:
    series = ["CMS", "CS"] + ["PCS rho=%g" % r for r in RHOS]
    series += ["PCMS rho=%g (%s)" % (r, "paper E" if sname == "paper" else "notebook E") for r in RHOS]
    series += ["PCMS rho=%g (union E)" % r for r in RHOS]
    return series


def plots(f1: dict[str, Any], f2: dict[str, Any], out: Path, n: int) -> None:
    p = plt()
    for sname in ("paper", "notebook"):
        data = f1[sname]
        keys = sorted(data)
        x = [data[k]["shape"]["label_kb"] for k in keys]
        series = fig1_series(sname)
        colour = dict(zip(series, SERIES_COLOURS))
        for mi, metric in enumerate(("ARE", "F1 top-10")):
            fig, ax = p.subplots(figsize=(13, 6.5))
            for sname2 in series:
                ys = [data[k]["m"][sname2][mi] for k in keys]
                style = "--" if "union" in sname2 else ("-." if sname2.startswith("PCMS") else "-")
                marker = "s" if "union" in sname2 else ("^" if sname2.startswith("PCMS") else "o")
                ax.plot(x, ys, style, marker=marker, color=colour[sname2], label=sname2)
            if mi == 0 and len(keys) == len(GAMMAS):
                # the published Fig. 1(a) curves (the notebook's Zipf run, its own shapes and offset), first and
                # last space point, as crosses in the colour of the matching series
                for k2, (a0, a1) in PUBLISHED_ARE_ZIPF.items():
                    ser = k2 + (" (paper E)" if sname == "paper" else " (notebook E)") if k2.startswith("PCMS") else k2
                    ax.plot([x[0], x[-1]], [a0, a1], "X", color=colour[ser], markersize=13, markeredgecolor="k",
                            markeredgewidth=0.8, linestyle="none")
                ax.plot([], [], "X", color="w", markeredgecolor="k", markersize=13,
                        label="published Fig. 1(a) endpoints\n(authors' notebook, Zipf run;\ncolour of the series)")
            if mi == 0:
                ax.set_yscale("log")
            else:
                ax.axhline(1.0, color="k", ls=":", lw=1.2, label="paper §5.3: private CMS F1 = 1.0")
                ax.set_ylim(0.0, 1.05)  # F1 in [0, 1]: a 0.98-1.0 axis magnified one point
            ax.set_xscale("log", base=2)
            ax.set_xlabel("paper's space label (KB) = ln(1/beta)/gamma*4/1024; real shapes: %s" %
                          ("6 x 1/gamma" if sname == "paper" else "d=7..10 x 100"), fontsize=11)
            ax.set_ylabel(metric, fontsize=11)
            ax.set_title("dp-linear-sketches Fig. 1, Zipf(1), %s shapes" % sname, fontsize=12)
            ax.legend(fontsize=10, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)  # outside the data
            fig.tight_layout()
            fig.savefig(out / ("fig1_%s_%s.png" % ("are" if mi == 0 else "f1", sname)), dpi=100)
            p.close(fig)
    fig, axes = p.subplots(1, 2, figsize=(11, 4.5))
    for ax, sname in zip(axes, ("paper", "notebook")):
        for name, v in f2[sname]["err"].items():
            ms = sorted(v)
            ax.plot(ms, [v[m] for m in ms], marker="o", label=name)
        ax.axhline(0.01 * n, color="k", ls=":", label="paper §5.4: bound gamma*N = %g" % (0.01 * n))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("number of evenly spaced quantiles m")
        ax.set_ylabel("average rank error")
        ax.set_title("Fig. 2 DCS, %s shape d=%d w=%d" % (sname, f2[sname]["d"], f2[sname]["w"]))
        ax.legend(fontsize=9, loc="upper right", bbox_to_anchor=(1.0, 0.93))  # between the curves and the bound
    fig.tight_layout()
    fig.savefig(out / "fig2_rank_error.png", dpi=110)
    p.close(fig)


def report(f1: dict[str, Any], f2: dict[str, Any], s: dict[str, Any], cfg: dict[str, Any], secs: float,
           hc: dict[str, Any]) -> str:
    lines = ["# dp-linear-sketches reproduction", "",
             "N = %d, runs = %d, Zipf(1) on 1..2^16-1, beta = 1%%, exact discrete Gaussian noise; %.1f s." % (
                 cfg["n"], cfg["runs"], secs), ""]
    for sname in ("paper", "notebook"):
        data = f1[sname]
        keys = sorted(data)
        lines.append("## Fig. 1, %s shapes (ARE / F1 top-10)" % sname)
        lines.append("")
        hdr = ["method"] + ["d=%d w=%d (%.1f KiB)" % (data[k]["shape"]["d"], data[k]["shape"]["w"],
                                                       data[k]["shape"]["kib"]) for k in keys]
        rows = []
        for name in data[keys[0]]["m"]:
            if name.startswith("E ") or name.startswith("var "):
                rows.append([name] + [data[k]["m"][name][0] for k in keys])
            else:
                rows.append([name] + ["%.4g / %.2f" % tuple(data[k]["m"][name]) for k in keys])
        if sname == "notebook" and len(keys) == 5:
            for k2, (a0, a1) in PUBLISHED_ARE_ZIPF.items():
                rows.append(["published Zipf ARE " + k2, a0, "", "", "", a1])
        lines.append(md_table(hdr, rows))
        lines.append("")
    lines.append("## Non-private CountSketch ARE by hash (notebook shapes, w = %d, the streams of Fig. 1)" % hc["w"])
    lines.append("")
    lines.append("The authors' single fixed md5/sha256 hash, %d other prefixes of the same construction, and %d "
                 "families of our salts (hash version 1, one salt per run); mean and s.d. over the hashes of the "
                 "ARE averaged over %d runs. The notebook's Zipf run printed CS %.1f (d = 7) -> %.1f (d = 10)." % (
                     hc["n_prefixes"] - 1, hc["n_prefixes"], hc["runs"], PUBLISHED_ARE_ZIPF["CS"][0],
                     PUBLISHED_ARE_ZIPF["CS"][1]))
    lines.append("")
    lines.append(md_table(["hash", "ARE mean", "s.d.", "hashes", "values"],
                          [[k, v["mean"], v["sd"], v["n"], " ".join("%.1f" % x for x in v["values"])]
                           for k, v in hc.items() if isinstance(v, dict)]))
    lines.append("")
    lines.append("## Fig. 2, average rank error of DCS (rank of the true quantile items)")
    lines.append("")
    for sname in ("paper", "notebook"):
        err = f2[sname]["err"]
        ms = sorted(next(iter(err.values())))
        lines.append("%s shape: d=%d, w=%d per level, 16 levels" % (sname, f2[sname]["d"], f2[sname]["w"]))
        lines.append("")
        lines.append(md_table(["method"] + ["m=%d" % m for m in ms],
                              [[k] + [v[m] for m in ms] for k, v in err.items()]))
        lines.append("")
        qe = f2[sname]["qerr"]
        lines.append("quantile-query error (|qN - rank interval of the returned x|):")
        lines.append("")
        lines.append(md_table(["method"] + ["m=%d" % m for m in ms], [[k] + [v[m] for m in ms] for k, v in qe.items()]))
        lines.append("")
    lines.append("## Summary")
    lines.append("")
    for k, v in s.items():
        lines.append("- %s: %s" % (k, v))
    return "\n".join(lines) + "\n"
