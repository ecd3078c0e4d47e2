"""Kind strhh vs Apache DataSketches frequent_items at equal memory, on real text.

    python -m pansketch.host_tools.bench.strheavy [--devices 20] [--per-device 100000] [--quick]
                                        [--out bench-results/strheavy.json] [--md bench-results/strheavy.md]

Data: the NAME tokens of the Python standard library's own source (text none of
us wrote), in file order, cut into ``--devices`` consecutive streams of
``--per-device`` tokens (one window per device). strhh counts the L-byte
encodings (agent/strhh.py): identifiers longer than L bytes are their first L-2
bytes plus a hash bucket, so the truth is counted over the same encodings.

strhh: the exact counters (pansketch.host_tools.query.strheavy.exact_counters, equal to the
device's) of the whole stream (linear), plus per device two discrete Laplace draws
per cell (internal + output, exact distribution, numpy) at the recorder's
calibration (scale L*d/eps); host descent (peeling, default FDR and beam), top k.
DataSketches: one frequent_strings_sketch per device (lg_max_k chosen so the
serialized size of the merged sketch is at most strhh's counter bytes), merged,
top k by estimate. Not private.

Configurations:

* Pi: the device default len=12 d=5 w=1024 (245,760 counter bytes) and the
  long-tail one len=8 d=3 w=2048 (196,608 B), 20 devices over the whole stdlib;
* Pico: len=6 d=5 w=80 (2,400 cells: 9,600 B per array, 19,200 B for the
  recorder's two arrays; the Pico W model of firmware/memory.py leaves 4,109
  cells with TLS up), ONE device of 10^5 events, repeated over ``--slices``
  consecutive 10^5-token slices x ``--seeds`` noise seeds (recall mean, min and
  the share of runs with recall >= 0.8 at k = 10).

Reports precision/recall at k (strhh may report fewer than k: recall uses k,
precision the reported count) and the smallest true count c such that every
string with count >= c is reported by strhh with k = 100; the descent's CPU time.
The table it writes (``--md``) is the one in docs/HOST.md "`heavy` (kind `strhh`): heavy-hitter strings".
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import os
import sysconfig
import time
import tokenize
from collections import Counter
from typing import Any

import numpy as np

from pansketch.agent import calibrate
from pansketch.agent.strhh import encode_item
from pansketch.host_tools.query import strheavy
from pansketch.host_tools.query.merge import NoiseTerm

SALT = "bench-fleet-salt"


def stdlib_tokens(limit: int) -> list[str]:
    out: list[str] = []
    root = sysconfig.get_paths()["stdlib"]
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        if "site-packages" in path or "/test" in path:
            continue
        try:
            with open(path, encoding="utf-8") as f:
                src = f.read()
            for t in tokenize.generate_tokens(io.StringIO(src).readline):
                if t.type == tokenize.NAME:
                    out.append(t.string)
        except (SyntaxError, UnicodeDecodeError, tokenize.TokenError, IndentationError):
            continue
        if len(out) >= limit:
            return out[:limit]
    return out


def dlap_sum(rng: np.random.Generator, scale: float, draws: int, shape: tuple[int, ...]) -> np.ndarray:
    q = np.exp(-1.0 / scale)
    tot = np.zeros(shape, dtype=np.int64)
    for _ in range(draws):
        tot += rng.geometric(1 - q, shape) - rng.geometric(1 - q, shape)
    return tot


def run(devices: int, per: int, L: int, d: int, w: int, eps: tuple[int, int], seed: int,
        ks: tuple[int, ...] = (10, 50, 100), offset: int = 0, all_toks: list[str] | None = None) -> dict[str, Any]:
    import datasketches  # type: ignore[import-untyped]

    toks = (all_toks if all_toks is not None else stdlib_tokens(offset + devices * per))[offset:offset + devices * per]
    per = len(toks) // devices  # the stdlib may hold fewer tokens than asked: split evenly
    enc = [encode_item(t, L) for t in toks]
    truth = Counter(e for e in enc if e is not None)
    spec = calibrate.noise_for("dlap", eps, d, 1, L)
    rng = np.random.default_rng(seed)
    C = strheavy.exact_counters(toks, L, d, w, SALT)
    C = C + dlap_sum(rng, spec.num / spec.den, 2 * devices, C.shape)
    v = strheavy.PrefixView(C, L, d, w, SALT, [NoiseTerm("dlap", spec.num, spec.den, 2 * devices)])
    mem = 4 * L * d * w
    lg = 3
    while True:  # largest lg_max_k whose merged sketch fits in strhh's counter bytes
        s = datasketches.frequent_strings_sketch(lg + 1)
        for t in toks[: min(len(toks), 400_000)]:
            s.update(t)
        if s.get_serialized_size_bytes() > mem or lg >= 16:
            break
        lg += 1
    merged = datasketches.frequent_strings_sketch(lg)
    for i in range(devices):  # the last device also takes the remainder
        s = datasketches.frequent_strings_sketch(lg)
        for t in toks[i * per:(i + 1) * per if i < devices - 1 else len(toks)]:
            s.update(t)
        merged.merge(s)
    ds_bytes = merged.get_serialized_size_bytes()
    ds_rows = merged.get_frequent_items(datasketches.frequent_items_error_type.NO_FALSE_NEGATIVES)
    ds_est: Counter[bytes] = Counter()
    for item, est, _lo, _hi in ds_rows:  # estimates per encoding (long identifiers share buckets)
        e = encode_item(item, L)
        if e is not None:
            ds_est[e] += est
    res: dict[str, Any] = {"devices": devices, "per_device": per, "tokens": len(toks), "distinct": len(truth),
                           "L": L, "d": d, "w": w, "eps": "%d" % eps[0] if eps[1] == 1 else "%d/%d" % eps, "strhh_bytes": mem,
                           "ds_lg_max_k": lg, "ds_bytes": ds_bytes}
    cpu = 0.0
    for k in ks:
        top = {x for x, _ in truth.most_common(k)}
        t0 = time.process_time()
        found, _hw, _st = v.heavy(k)
        cpu += time.process_time() - t0
        got = {x for x, _ in found}
        dsk = {x for x, _ in ds_est.most_common(k)}
        res["k%d" % k] = {"strhh_precision": round(len(got & top) / max(1, len(got)), 3),
                          "strhh_recall": round(len(got & top) / k, 3), "strhh_reported": len(got),
                          "ds_precision": round(len(dsk & top) / max(1, len(dsk)), 3),
                          "ds_recall": round(len(dsk & top) / k, 3)}
        if k == max(ks):
            missed = [truth[x] for x in top - got]
            res["strhh_smallest_reliable_count"] = (max(missed) + 1) if missed else min(truth[x] for x in top)
            res["smallest_reliable_fraction"] = round(res["strhh_smallest_reliable_count"] / len(toks), 5)
    res["descent_cpu_s"] = round(cpu / len(ks), 3)
    return res


PI = ((12, 5, 1024), (8, 3, 2048))
PICO = (6, 5, 80)
EPS = ((1, 1), (1, 2))


def pico_runs(L: int, d: int, w: int, eps: tuple[int, int], slices: int, seeds: int, per: int,
              toks: list[str]) -> dict[str, Any]:
    """The Pico configuration over ``slices`` x ``seeds`` single-device windows of ``per`` events."""
    runs = [run(1, per, L, d, w, eps, seed, offset=sl * per, all_toks=toks)
            for sl in range(slices) for seed in range(seeds)]
    out: dict[str, Any] = {k: v for k, v in runs[0].items() if not k.startswith("k") and "smallest" not in k}
    out["runs"] = len(runs)
    for k in (10, 50, 100):
        for key in ("strhh_precision", "strhh_recall", "ds_precision", "ds_recall"):
            out["k%d" % k] = out.get("k%d" % k, {})
            out["k%d" % k][key] = round(float(np.mean([r["k%d" % k][key] for r in runs])), 3)
        out["k%d" % k]["strhh_recall_min"] = min(r["k%d" % k]["strhh_recall"] for r in runs)
    out["k10"]["share_recall_ge_0.8"] = round(float(np.mean([r["k10"]["strhh_recall"] >= 0.8 for r in runs])), 3)
    out["strhh_smallest_reliable_count"] = int(np.median([r["strhh_smallest_reliable_count"] for r in runs]))
    out["smallest_reliable_fraction"] = round(out["strhh_smallest_reliable_count"] / per, 5)
    out["descent_cpu_s"] = round(float(np.mean([r["descent_cpu_s"] for r in runs])), 3)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of docs/HOST.md."""
    out = ["| config | eps | strhh P/R k=10 | k=50 | k=100 | DataSketches P/R k=10 / 50 / 100 | smallest count "
           "always found (k=100) | counter bytes strhh / DS | descent CPU |", "|---" * 9 + "|"]
    for r in rows:
        name = "%s len=%d d=%d w=%d" % ("Pico" if r["devices"] == 1 else "Pi", r["L"], r["d"], r["w"])
        if r["devices"] == 1:
            name += ", 1 device x %d events, %d runs" % (r["per_device"], r["runs"])
        else:
            name += ", %d devices x %d" % (r["devices"], r["per_device"])

        def pr(k: int) -> str:
            x = r["k%d" % k]
            s = "%.2f/%.2f" % (x["strhh_precision"], x["strhh_recall"])
            if "strhh_recall_min" in x:
                s += " (min R %.1f%s)" % (x["strhh_recall_min"], ", R>=0.8 in %d%%" % round(
                    100 * x["share_recall_ge_0.8"]) if "share_recall_ge_0.8" in x else "")
            return s

        ds = " / ".join("%.2f/%.2f" % (r["k%d" % k]["ds_precision"], r["k%d" % k]["ds_recall"]) for k in (10, 50, 100))
        out.append("| %s | %s | %s | %s | %s | %s | %d (%.2f %%) | %d / %d | %.2f s |" % (
            name, r["eps"], pr(10), pr(50), pr(100), ds, r["strhh_smallest_reliable_count"],
            100 * r["smallest_reliable_fraction"], r["strhh_bytes"], r["ds_bytes"], r["descent_cpu_s"]))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", type=int, default=20)
    ap.add_argument("--per-device", type=int, default=100_000)
    ap.add_argument("--pico-events", type=int, default=100_000)
    ap.add_argument("--slices", type=int, default=4, help="Pico: consecutive slices of the stdlib tokens")
    ap.add_argument("--seeds", type=int, default=5, help="Pico: noise seeds per slice")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="the Pi default and the Pico config at eps = 1, 1 seed")
    ap.add_argument("--out", default="bench-results/strheavy.json")
    ap.add_argument("--md", default="bench-results/strheavy.md")
    a = ap.parse_args(argv)
    toks = stdlib_tokens(max(a.devices * a.per_device, a.slices * a.pico_events))
    rows: list[dict[str, Any]] = []
    pis = PI[:1] if a.quick else PI
    epss = EPS[:1] if a.quick else EPS
    for L, d, w in pis:
        for eps in epss:
            rows.append(run(a.devices, a.per_device, L, d, w, eps, a.seed, all_toks=toks))
            print(json.dumps(rows[-1]), flush=True)
    for eps in epss:
        rows.append(pico_runs(*PICO, eps, 1 if a.quick else a.slices, 1 if a.quick else a.seeds, a.pico_events, toks))
        print(json.dumps(rows[-1]), flush=True)
    md = table(rows)
    load = os.getloadavg()
    note = "load average %.1f %.1f %.1f (2 cores shared); descent CPU = mean per query over k = 10, 50, 100" % load
    print(md + "\n\n" + note)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"rows": rows, "load": load}, f, indent=1)
    if a.md:
        with open(a.md, "w") as f:
            f.write(md + "\n\n" + note + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
