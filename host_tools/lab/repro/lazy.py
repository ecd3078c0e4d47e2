"""Reproduction of lazy-sketch-continual-observation.txt Figure 4(a)-(f).

Streams of 2^20 Zipf(skew) updates over 2^20 items, delta = 0.001, depth 3.

* (a) time to process 2^20 updates vs memory, for CMS/CS (per-event
  pansketch.agent.sketch.Sketch), LazyCMS/CS and PunctualCMS/CS (per-event
  :mod:`pansketch.host_tools.lab.algorithms.continual`, pure Python, node noise drawn from a
  pre-drawn pool of exact discrete Gaussians so that the timing measures the
  algorithms' work, as the paper's C++ does with a cheap normal sampler).
  Each configuration is timed ``reps`` times, interleaved (every configuration
  once per round), each time on a prefix of the stream until ~``run_s``
  seconds have passed; the median is extrapolated linearly to 2^20 updates
  (the amortised GaussBM cost is constant per update, so linear extrapolation
  is fair). The work per arrival (binary-mechanism updates, counted from the
  GaussBM counters after each run) is reported next to it: Lazy d, Punctual
  d*w, so their ratio is Punctual's width. Widths per memory budget follow the
  paper's 24 KB example (CMS 2000, Lazy 55, Punctual 33 columns) scaled
  linearly with memory.
* (b) ARE on the top-15 items vs memory; (c) vs depth; (d) vs skew;
  (e)/(f) vs eps at skew 1.1 / 2.1. Accuracy uses the exact end-of-stream
  distribution of the released counters (:func:`lazy_final`,
  :func:`punctual_final`), proven equal to the per-event classes without
  noise by the tests.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from pansketch.agent import hashing
from pansketch.agent.sketch import Sketch
from pansketch.host_tools import fasthash
from pansketch.host_tools.lab.algorithms.continual import (LazySketch, PunctualSketch, co_estimates, gaussbm_sigma2, lazy_final,
                                             punctual_final)
from pansketch.host_tools.lab.algorithms.vnoise import BulkNoise, ExactNoise

from .common import Timer, check_scale, md_table, plt, save_json, zipf_stream

DELTA = 1e-3
PAPER_W = {"CMS": 2000, "Lazy": 55, "Punctual": 33}  # widths at 24 KB (§5.4)
METHODS = ("CMS", "CS", "LazyCMS", "LazyCS", "PunctualCMS", "PunctualCS")

CONFIG: dict[str, dict[str, Any]] = {
    "tiny": dict(T=1 << 12, U=1 << 12, mems=(24, 96), depths=(3, 5), skews=(1.1, 2.1), epss=(0.1, 1.0),
                 trials=1, budget_s=0.15, same_w=(100, 500), vec_n=1 << 14, reps=2, run_s=0.04),
    "small": dict(T=1 << 20, U=1 << 20, mems=(24, 48, 96, 192), depths=(1, 3, 5, 7), skews=(1.1, 1.3, 1.5, 1.7, 1.9, 2.1),
                  epss=(0.05, 0.1, 0.3, 1.0, 3.0), trials=5, budget_s=1.5, same_w=(100, 500, 1000, 2000),
                  vec_n=1 << 20, reps=5, run_s=0.5),
    "paper": dict(T=1 << 20, U=1 << 20, mems=(24, 48, 96, 192, 384), depths=(1, 3, 5, 7, 9),
                  skews=(1.1, 1.3, 1.5, 1.7, 1.9, 2.1), epss=(0.05, 0.1, 0.3, 0.5, 1.0, 2.0, 3.0), trials=20,
                  budget_s=5.0, same_w=(100, 250, 500, 1000, 2000, 4000), vec_n=1 << 20, reps=7, run_s=1.0),
}


def widths(mem_kb: float) -> dict[str, int]:
    return {k: max(2, int(round(v * mem_kb / 24))) for k, v in PAPER_W.items()}


class Data:
    """One stream and its hashes (one salt per trial)."""

    def __init__(self, gen: np.random.Generator, T: int, U: int, skew: float, salt: str, dmax: int) -> None:
        self.stream = zipf_stream(gen, T, U, skew)
        keys, self.inv, cnt = np.unique(self.stream, return_inverse=True, return_counts=True)
        self.keys = keys
        self.top = np.argsort(-cnt, kind="stable")[:15]
        self.true = cnt[self.top].astype(float)
        self.st = fasthash.streams([int(x) for x in keys], salt, dmax)
        self.salt = salt

    def cols(self, d: int, w: int) -> tuple[np.ndarray, np.ndarray]:
        c, s = fasthash.cols_signs(self.st, d, w)
        return c, s


def are_of(data: Data, method: str, d: int, w: int, eps: float, noise: BulkNoise, T: int,
           at: int | None = None) -> float:
    c, s = data.cols(d, w)
    n = T if at is None else at
    ce, se = c[data.inv[:n]], s[data.inv[:n]]
    ct, stp = c[data.top], s[data.top]
    kind = "cms" if method.endswith("CMS") else "cs"
    if method in ("CMS", "CS"):
        O = np.zeros((d, w), dtype=np.int64)
        for i in range(d):
            wt = se[:, i].astype(np.int64) if kind == "cs" else np.ones(n, dtype=np.int64)
            O[i] = np.bincount(ce[:, i], weights=wt, minlength=w).astype(np.int64)
    elif method.startswith("Lazy"):
        var = gaussbm_sigma2(int(np.ceil(T / w)), eps, DELTA, 2 * d)
        O, _ = lazy_final(ce, se, kind, w, var, noise)
    else:
        var = gaussbm_sigma2(T, eps, DELTA, 2 * d)
        O = punctual_final(ce, se, kind, w, var, noise)
    est = co_estimates(O, ct, stp, kind)
    if at is not None:
        true = np.array([np.count_nonzero(data.inv[:n] == t) for t in data.top], dtype=float)
    else:
        true = data.true
    return float(np.mean(np.abs(est - true) / true))


def method_w(method: str, mem: float) -> int:
    ws = widths(mem)
    if method in ("CMS", "CS"):
        return ws["CMS"]
    return ws["Lazy"] if method.startswith("Lazy") else ws["Punctual"]


def time_method(method: str, d: int, w: int, T: int, eps: float, items: list[int],
                budget_s: float) -> tuple[float, int, float]:
    """(seconds per update, prefix length timed, binary-mechanism updates per arrival) for the
    per-event implementation. The last number is counted after the timing from the GaussBM
    counters' own update counts (``GaussBM.t``), so counting costs nothing inside the timed loop;
    it is 0 for the non-private sketches."""
    kind = "cms" if method.endswith("CMS") else "cs"
    sk: Any
    if method in ("CMS", "CS"):
        sk = Sketch(kind, d, w, hashing.salt_prefix("timing"))
    elif method.startswith("Lazy"):
        sk = LazySketch(kind, d, w, "timing", T, eps, DELTA, BulkNoise(7))
    else:
        sk = PunctualSketch(kind, d, w, "timing", T, eps, DELTA, BulkNoise(7))
    upd = sk.update
    for x in items[:8]:  # warm-up: first pool refill, imports
        upd(x)
    n = 0
    t0 = time.perf_counter()
    chunk = 8
    while True:
        batch = items[8 + n:8 + n + chunk]
        for x in batch:
            upd(x)
        n += len(batch)
        el = time.perf_counter() - t0
        if el >= budget_s or 8 + n >= len(items):
            break
        chunk = min(chunk * 2, 4096)
    ops = sum(bm.t for row in sk.O for bm in row) if hasattr(sk, "O") else 0
    return el / n, n, ops / (n + 8)  # every arrival (warm-up included) does the same work


def _one(xs: set[float]) -> float:
    """The single value of a set of per-arrival work counts (every run does the same work)."""
    if len(xs) != 1:
        raise AssertionError("work per arrival differs between runs: %r" % sorted(xs))
    return next(iter(xs))


def timing_runs(cfg: dict[str, Any], T: int, items: list[int], base_eps: float
                ) -> tuple[dict[str, dict[float, dict[str, Any]]], dict[int, dict[str, Any]]]:
    """Fig. 4(a) timing (per method and memory) and Lazy vs Punctual at the same width."""
    # (a) timing vs memory: medians over ``reps`` interleaved runs of ``run_s`` seconds each (one
    # short timed prefix moved by +-60% between runs under load), next to the work per arrival,
    # counted: Lazy feeds d binary-mechanism counters per arrival, Punctual d*w
    reps, run_s = cfg["reps"], cfg["run_s"]
    runs_a: dict[str, dict[float, list[float]]] = {m: {mem: [] for mem in cfg["mems"]} for m in METHODS}
    counts_a: dict[str, dict[float, int]] = {m: {} for m in METHODS}
    ops_a: dict[str, dict[float, set[float]]] = {m: {mem: set() for mem in cfg["mems"]} for m in METHODS}
    for _ in range(reps):  # interleaved: every configuration once per round
        for mem in cfg["mems"]:
            for m in METHODS:
                per, n, ops = time_method(m, 3, method_w(m, mem), T, base_eps, items, run_s)
                runs_a[m][mem].append(per)
                counts_a[m][mem] = counts_a[m].get(mem, 0) + n
                ops_a[m][mem].add(ops)
    timing: dict[str, dict[float, dict[str, Any]]] = {}
    for m in METHODS:
        timing[m] = {}
        for mem in cfg["mems"]:
            w = method_w(m, mem)
            per = float(np.median(runs_a[m][mem]))
            timing[m][mem] = {"w": w, "s_per_update": per, "s_2^20": per * (1 << 20),
                              "timed_updates": counts_a[m][mem], "runs": runs_a[m][mem],
                              "bm_updates_per_arrival": _one(ops_a[m][mem])}
    same: dict[int, dict[str, Any]] = {}
    for w in cfg["same_w"]:
        rl: list[float] = []
        rp: list[float] = []
        ol: set[float] = set()
        op: set[float] = set()
        for _ in range(reps):  # interleaved: Lazy, Punctual, Lazy, ...
            per, _n, ops = time_method("LazyCMS", 3, w, T, base_eps, items, run_s)
            rl.append(per)
            ol.add(ops)
            per, _n, ops = time_method("PunctualCMS", 3, w, T, base_eps, items, run_s)
            rp.append(per)
            op.add(ops)
        row: dict[str, Any] = {"LazyCMS": float(np.median(rl)), "PunctualCMS": float(np.median(rp))}
        row["ratio"] = row["PunctualCMS"] / row["LazyCMS"]
        row["ratio_runs"] = [b / a for a, b in zip(rl, rp)]
        row["ops_LazyCMS"], row["ops_PunctualCMS"] = _one(ol), _one(op)  # counted: 3 and 3w
        row["ops_ratio"] = row["ops_PunctualCMS"] / row["ops_LazyCMS"]
        same[w] = row
    return timing, same


def run(scale: str, out: Path, seed: int = 1) -> dict[str, Any]:
    check_scale(scale)
    cfg = CONFIG[scale]
    out.mkdir(parents=True, exist_ok=True)
    t = Timer()
    T, U = cfg["T"], cfg["U"]
    gen = np.random.default_rng(seed)
    noise = BulkNoise(seed + 5)
    res: dict[str, Any] = {"scale": scale, "T": T}
    base_skew, base_eps = 1.3, 0.3
    items = [int(x) for x in zipf_stream(np.random.default_rng(seed + 9), min(T, 1 << 17), U, base_skew)]

    t.step("timing runs (figure 4a)")
    res["fig4a"], res["same_width"] = timing_runs(cfg, T, items, base_eps)
    # the privacy path: node noise drawn one at a time by pansketch.agent.noise (exact, os.urandom)
    w_ex = cfg["same_w"][1]
    exact: dict[str, float] = {}
    for m in ("LazyCMS", "PunctualCMS"):
        kind = "cms"
        cls = LazySketch if m.startswith("Lazy") else PunctualSketch
        skt = cls(kind, 3, w_ex, "timing", T, base_eps, DELTA, noise=ExactNoise())
        skt.pool.block = 64  # refill in small blocks so the timed prefix pays for its own draws
        t0 = time.perf_counter()
        n = 0
        while time.perf_counter() - t0 < cfg["budget_s"] / 2 and n < len(items):
            skt.update(items[n])
            n += 1
        exact[m] = (time.perf_counter() - t0) / n
        exact[m + " n"] = n
    exact["w"] = w_ex
    exact["ratio"] = exact["PunctualCMS"] / exact["LazyCMS"]
    res["exact_noise_timing"] = exact

    # vectorised host path vs per-event device path on 2^20 (or vec_n) Zipf items
    vn = cfg["vec_n"]
    vitems = [int(x) for x in zipf_stream(np.random.default_rng(seed + 11), vn, U, 1.1)]
    t0 = time.perf_counter()
    vc = fasthash.sketch_counts(vitems, None, "cs", 3, 2000, "speed")
    tv = time.perf_counter() - t0
    sk = Sketch("cs", 3, 2000, hashing.salt_prefix("speed"))
    t0 = time.perf_counter()
    for x in vitems:
        sk.update(x)
    tp = time.perf_counter() - t0
    same_state = bool(np.array_equal(np.frombuffer(sk.counters, dtype=np.int32).reshape(3, 2000), vc))
    res["vectorised"] = {"n": vn, "vectorised_eps": vn / tv, "per_event_eps": vn / tp, "speedup": tp / tv,
                         "identical_state": same_state, "distinct": len(set(vitems))}

    # accuracy experiments
    t.step("accuracy experiments")
    def trials(skew: float) -> list[Data]:
        return [Data(gen, T, U, skew, "repro/lazy/s%g/t%d" % (skew, k), max(9, max(cfg["depths"])))
                for k in range(cfg["trials"])]

    base = trials(base_skew)
    fig_b: dict[str, dict[float, float]] = {m: {} for m in METHODS}
    fig_b_worst: dict[str, dict[float, float]] = {m: {} for m in METHODS}
    for mem in cfg["mems"]:
        for m in METHODS:
            w = method_w(m, mem)
            fig_b[m][mem] = float(np.mean([are_of(dt, m, 3, w, base_eps, noise, T) for dt in base]))
            if m.startswith("Punctual") or m.startswith("Lazy"):
                fig_b_worst[m][mem] = float(np.mean([are_of(dt, m, 3, w, base_eps, noise, T, at=T - 1) for dt in base]))
    res["fig4b"] = fig_b
    res["fig4b_at_T-1"] = fig_b_worst
    fig_c: dict[str, dict[int, float]] = {m: {} for m in METHODS}
    for d in cfg["depths"]:
        for m in METHODS:
            fig_c[m][d] = float(np.mean([are_of(dt, m, d, method_w(m, 24), base_eps, noise, T) for dt in base]))
    res["fig4c"] = fig_c
    fig_d: dict[str, dict[float, float]] = {m: {} for m in METHODS}
    by_skew = {}
    for sk_ in cfg["skews"]:
        by_skew[sk_] = base if sk_ == base_skew else trials(sk_)
        for m in METHODS:
            fig_d[m][sk_] = float(np.mean([are_of(dt, m, 3, method_w(m, 24), base_eps, noise, T)
                                           for dt in by_skew[sk_]]))
    res["fig4d"] = fig_d
    for name, sk_ in (("fig4e", 1.1), ("fig4f", 2.1)):
        data = by_skew.get(sk_) or trials(sk_)
        f: dict[str, dict[float, float]] = {m: {} for m in METHODS}
        for e in cfg["epss"]:
            for m in METHODS:
                f[m][e] = float(np.mean([are_of(dt, m, 3, method_w(m, 24), e, noise, T) for dt in data]))
        res[name] = f
    res["seconds"] = t.elapsed()
    res["summary"] = summarise(res, cfg)
    plots(res, cfg, out)
    (out / "lazy.md").write_text(report(res, cfg))
    save_json(out / "lazy.json", res)
    return res


def summarise(res: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    a = res["fig4a"]
    s["lazy_over_punctual_throughput_by_memory"] = {
        mem: a["PunctualCMS"][mem]["s_per_update"] / a["LazyCMS"][mem]["s_per_update"] for mem in cfg["mems"]}
    s["lazy_over_punctual_same_width"] = {w: r["ratio"] for w, r in res["same_width"].items()}
    s["lazy_over_punctual_ops_by_memory"] = {
        mem: a["PunctualCMS"][mem]["bm_updates_per_arrival"] / a["LazyCMS"][mem]["bm_updates_per_arrival"]
        for mem in cfg["mems"]}
    s["punctual_width_by_memory"] = {mem: a["PunctualCMS"][mem]["w"] for mem in cfg["mems"]}
    s["lazy_over_punctual_same_width_ops"] = {w: r["ops_ratio"] for w, r in res["same_width"].items()}
    s["lazy_faster_at_w_ge_500"] = all(r["ratio"] > 1 for w, r in res["same_width"].items() if w >= 500)
    b = res["fig4b"]
    s["lazy_better_are_than_punctual_all_mem"] = all(
        b["Lazy" + k][m] <= b["Punctual" + k][m] for k in ("CMS", "CS") for m in cfg["mems"])
    s["lazy_better_are_than_punctual_all_mem_at_T-1"] = all(
        res["fig4b_at_T-1"]["Lazy" + k][m] <= res["fig4b_at_T-1"]["Punctual" + k][m] for k in ("CMS", "CS")
        for m in cfg["mems"])
    f = res["fig4f"]
    es = sorted(cfg["epss"])
    s["fig4f_are_decreasing_in_eps"] = {m: bool(f[m][es[0]] > f[m][es[-1]]) for m in METHODS[2:]}
    s["vectorised_events_per_s"] = res["vectorised"]["vectorised_eps"]
    s["per_event_events_per_s"] = res["vectorised"]["per_event_eps"]
    return s


COLOURS = {"CMS": "#000000", "CS": "#7f7f7f", "LazyCMS": "#1f77b4", "LazyCS": "#2ca02c", "PunctualCMS": "#d62728",
           "PunctualCS": "#ff7f0e"}


def plots(res: dict[str, Any], cfg: dict[str, Any], out: Path) -> None:
    p = plt()
    fig, axes = p.subplots(2, 3, figsize=(17, 9))
    ax = axes[0][0]
    for m in METHODS:
        xs = cfg["mems"]
        ax.plot(xs, [res["fig4a"][m][x]["s_2^20"] for x in xs], marker="o", color=COLOURS[m], label=m)
    ax.set_yscale("log")
    ax.set_xlabel("memory (KB; widths scaled from the paper's 24 KB example)")
    ax.set_ylabel("s per 2^20 updates (extrapolated, median)")
    ax.set_title("(a) eps=0.3, skew=1.3")
    # the paper's reference number (§5.4): LazyCMS up to 250x the throughput of PunctualCMS
    mems = cfg["mems"]
    a = res["fig4a"]
    ratio = a["PunctualCMS"][mems[-1]]["s_per_update"] / a["LazyCMS"][mems[-1]]["s_per_update"]
    work = a["PunctualCMS"][mems[-1]]["bm_updates_per_arrival"] / a["LazyCMS"][mems[-1]]["bm_updates_per_arrival"]
    ax.text(0.97, 0.5, "paper: LazyCMS up to 250x PunctualCMS\nhere at %g KB: %.0fx (time, median)\n"
            "work ratio %.0fx (= Punctual's width)" % (mems[-1], ratio, work), transform=ax.transAxes,
            ha="right", va="center", fontsize=9, bbox=dict(facecolor="white", edgecolor="0.6", alpha=0.9))
    panels = [(axes[0][1], "fig4b", "memory (KB)", "(b) ARE top-15 vs memory"),
              (axes[0][2], "fig4c", "depth d (widths of 24 KB)", "(c) ARE vs depth"),
              (axes[1][0], "fig4d", "skew", "(d) ARE vs skew, 24 KB, eps=0.3"),
              (axes[1][1], "fig4e", "eps", "(e) ARE vs eps, skew 1.1"),
              (axes[1][2], "fig4f", "eps", "(f) ARE vs eps, skew 2.1")]
    for ax, key, xl, title in panels:
        for m in METHODS:
            xs = sorted(res[key][m])
            ax.plot(xs, [res[key][m][x] for x in xs], marker="o", color=COLOURS[m], label=m)
        if key == "fig4b":
            for m in METHODS[2:]:
                xs = sorted(res["fig4b_at_T-1"][m])
                ax.plot(xs, [res["fig4b_at_T-1"][m][x] for x in xs], ":", marker="x", color=COLOURS[m],
                        label=m + " queried at T-1")
        ax.set_yscale("log")
        if key in ("fig4e", "fig4f"):
            ax.set_xscale("log")
        ax.set_xlabel(xl)
        ax.set_ylabel("ARE (top-15)")
        ax.set_title(title)
    # one legend for every panel, below them (panel legends covered the curves of (b))
    h, lab = axes[0][1].get_legend_handles_labels()
    fig.legend(h, lab, loc="lower center", ncol=5, fontsize=10, frameon=False)
    fig.suptitle("lazy-sketch Fig. 4 reproduction (T = %d, delta = 0.001)" % res["T"])
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(out / "fig4.png", dpi=100)
    p.close(fig)


def report(res: dict[str, Any], cfg: dict[str, Any]) -> str:
    L = ["# lazy-sketch reproduction (Fig. 4)", "", "T = %d updates, %d trials, %.1f s." % (
        res["T"], cfg["trials"], res["seconds"]), "", "## (a) time per 2^20 updates (s, extrapolated from a prefix)", ""]
    hdr = ["method"] + ["%g KB" % m for m in cfg["mems"]]
    rows = [[m] + ["%.3g s (w=%d, %d timed)" % (res["fig4a"][m][mem]["s_2^20"], res["fig4a"][m][mem]["w"],
                                                 res["fig4a"][m][mem]["timed_updates"]) for mem in cfg["mems"]]
            for m in METHODS]
    L.append(md_table(hdr, rows))
    a = res["fig4a"]
    L += ["", "LazyCMS vs PunctualCMS at the same memory: time ratio (Punctual / Lazy) of the medians of %d "
          "interleaved runs of %g s each, the per-run ratios' range, and the work per arrival (binary-mechanism "
          "updates, counted):" % (cfg["reps"], cfg["run_s"]), ""]
    rr = []
    for mem in cfg["mems"]:
        lz, pu = a["LazyCMS"][mem], a["PunctualCMS"][mem]
        per_run = [q / z for z, q in zip(lz["runs"], pu["runs"])]
        rr.append(["%g KB" % mem, "%d / %d" % (lz["w"], pu["w"]), pu["s_per_update"] / lz["s_per_update"],
                   "%.0f-%.0f" % (min(per_run), max(per_run)),
                   "%g / %g" % (lz["bm_updates_per_arrival"], pu["bm_updates_per_arrival"]),
                   pu["bm_updates_per_arrival"] / lz["bm_updates_per_arrival"]])
    L.append(md_table(["memory", "w Lazy / Punctual", "time ratio (median)", "per-run ratios",
                       "work per arrival Lazy / Punctual", "work ratio"], rr))
    L += ["", "Lazy vs Punctual (CMS) at the same width: medians of %d interleaved timed runs (time ratio = "
          "Punctual / Lazy), the per-run ratios' range, and the work ratio (binary-mechanism updates per "
          "arrival, counted: 3w against 3):" % cfg["reps"], ""]
    L.append(md_table(["w", "Lazy s/update", "Punctual s/update", "time ratio (median)", "per-run ratios",
                       "work ratio"],
                      [[w, r["LazyCMS"], r["PunctualCMS"], r["ratio"],
                        "%.0f-%.0f" % (min(r["ratio_runs"]), max(r["ratio_runs"])), r["ops_ratio"]]
                       for w, r in res["same_width"].items()]))
    ex = res["exact_noise_timing"]
    L += ["", "With the exact per-draw sampler of the device (pansketch.agent.noise on os.urandom) at w = %d: LazyCMS %.3g s/update "
          "(%d timed), PunctualCMS %.3g s/update (%d timed), ratio %.0f." % (
              ex["w"], ex["LazyCMS"], ex["LazyCMS n"], ex["PunctualCMS"], ex["PunctualCMS n"], ex["ratio"])]
    v = res["vectorised"]
    L += ["", "Vectorised host path (fasthash.sketch_counts) vs per-event pansketch.agent.sketch.Sketch.update on %d "
          "Zipf(1.1) items (%d distinct): %.3g vs %.3g events/s (x%.1f), identical state: %s" % (
              v["n"], v["distinct"], v["vectorised_eps"], v["per_event_eps"], v["speedup"], v["identical_state"]), ""]
    for key, title in (("fig4b", "(b) ARE vs memory (KB)"), ("fig4b_at_T-1", "(b') ARE vs memory, queried at T-1"),
                       ("fig4c", "(c) ARE vs depth"), ("fig4d", "(d) ARE vs skew"),
                       ("fig4e", "(e) ARE vs eps, skew 1.1"), ("fig4f", "(f) ARE vs eps, skew 2.1")):
        L += ["## " + title, ""]
        ms = [m for m in METHODS if m in res[key] and res[key][m]]
        xs = sorted(res[key][ms[0]])
        L.append(md_table(["method"] + [str(x) for x in xs], [[m] + [res[key][m][x] for x in xs] for m in ms]))
        L.append("")
    L += ["## Summary", ""] + ["- %s: %s" % (k, v) for k, v in res["summary"].items()]
    return "\n".join(L) + "\n"
