"""Persist noise: release accuracy under persist_noise = refresh vs shadow.

    python -m pansketch.host_tools.bench.persist [--trials 3] [--out bench-results]

The persist-noise stream: Zipf(a = 1) over U = 2^16 items, N = 10^5
events, CountSketch d = 5, w = 2048, one hourly window (mode window),
dgauss at rho = 1 and 1/10. The events are spread evenly over the hour and
fed to the real device Recorder (agent/recorder.py, the Pi daemon's numpy
batch adder), which persists every ``persist_s`` (60, 600, 3600) exactly as
the daemon does and commits the release at the window end; the release's
counters are then read like the host reads them. Reported per cell: the
average relative error over all distinct items of the stream (ARE, as in
dp-linear-sketches.txt Fig. 1) divided by the ARE of the same sketch
without noise, the release's ``nz``, and the measured per-cell noise
variance (release - exact sketch) in units of one output draw's sigma^2.
"restart" runs power-cycle the device once, after the middle persist or
after the last one (shadow's worst case: the rebuilt accumulator then
carries every flash-track draw). Figures, not assertions; written to
bench-results/persist.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from pansketch.agent.pi.batch import add_batch
from pansketch.agent.params import Params
from pansketch.agent.recorder import Recorder
from pansketch.agent.rng import DeterministicSource, Rng
from pansketch.agent.storage import Outbox
from pansketch.host_tools import cborscan, fasthash
from pansketch.host_tools.lab.repro.common import zipf_stream

T0 = 200_000 * 3600
HOUR = 3600
SALT = "bench-persist-salt"


def stream(seed: int, n: int = 100_000, universe: int = 1 << 16) -> list[str]:
    g = np.random.default_rng(seed)
    return ["u%d" % x for x in zipf_stream(g, n, universe, 1.0)]


def run_device(events: list[str], persist_s: int, scheme: str, rho: str, seed: str,
               restart: Optional[str] = None) -> tuple[np.ndarray, int, Params]:
    """One hour through the Recorder; returns (release counters (d, w), nz, params)."""
    p = Params({"device": "bench", "salt": SALT, "kind": "cs", "d": 5, "w": 2048, "mode": "window",
                "window_s": HOUR, "mechanism": "dgauss", "budget": rho, "persist_s": persist_s,
                "persist_noise": scheme})
    root = tempfile.mkdtemp(prefix="bench-persist-")
    try:
        quiet = lambda m: None  # noqa: E731
        rec = Recorder(p, root, T0, rng=Rng(DeterministicSource(seed)), log=quiet)
        k = max(1, HOUR // persist_s)  # persist intervals in the hour
        cuts = [len(events) * j // k for j in range(k + 1)]
        restart_after = {"mid": k // 2, "late": k - 1}.get(restart or "", -1)
        for j in range(k):
            rec.add_many(events[cuts[j]:cuts[j + 1]], adder=add_batch)
            t = T0 + (j + 1) * persist_s
            if t < T0 + HOUR:
                rec.persist(t)
                if j + 1 == restart_after:
                    rec = Recorder(p, root, t, rng=Rng(DeterministicSource(seed + "-boot")), log=quiet)
        assert rec.tick(T0 + HOUR) == 1
        ob = Outbox(root)
        (s,) = ob.pending()
        rel = cborscan.loads(ob.read(s))  # bounded, byte-level checked (the release subset)
        ctr = np.frombuffer(rel["ctr"], dtype="<i4").astype(np.int64).reshape(p.d, p.w)
        return ctr, int(rel["nz"]), p
    finally:
        shutil.rmtree(root, ignore_errors=True)


def are(counters: np.ndarray, keys: list[str], true: np.ndarray) -> float:
    est = fasthash.estimates(counters, keys, "cs", SALT)
    return float(np.mean(np.abs(est - true) / true))


SCENARIOS = (("refresh", None), ("shadow", None), ("refresh", "mid"), ("shadow", "mid"), ("shadow", "late"))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pansketch.host_tools.bench.persist", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=3, help="streams and noise seeds per cell (default 3)")
    ap.add_argument("--out", default="bench-results", help="directory for persist.json")
    a = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    for trial in range(a.trials):
        ev = stream(100 + trial)
        keys, tot = fasthash.aggregate(ev)
        true = tot.astype(float)
        exact = fasthash.sketch_counts(ev, None, "cs", 5, 2048, SALT).astype(np.int64)
        are0 = are(exact, keys, true)
        for rho in ("1", "1/10"):
            for persist_s in (60, 600, 3600):
                for scheme, restart in SCENARIOS:
                    if restart and persist_s == 3600:
                        continue  # no persist inside the hour to restart after
                    ctr, nz, p = run_device(ev, persist_s, scheme, rho, "t%d-%s-%d-%s-%s" % (
                        trial, rho, persist_s, scheme, restart), restart)
                    noise: Optional[np.ndarray] = (ctr - exact).ravel()
                    if restart:  # events after the last persist before the power cut are lost
                        noise = None
                    rows.append({"trial": trial, "rho": rho, "persist_s": persist_s, "scheme": scheme,
                                 "restart": restart or "none", "nz": nz, "are": are(ctr, keys, true),
                                 "are_nonprivate": are0,
                                 "noise_var_over_sigma2": (None if noise is None else
                                                           float(noise.var()) * p.noise.den / p.noise.num)})
                    print("trial %d rho %-4s persist %4d %-7s restart %-4s nz %3d ARE ratio %.3f" % (
                        trial, rho, persist_s, scheme, restart or "-", nz, rows[-1]["are"] / are0,
                        ), file=sys.stderr, flush=True)
    summary: list[dict[str, Any]] = []
    for rho in ("1", "1/10"):
        for persist_s in (60, 600, 3600):
            for scheme, restart in SCENARIOS:
                rs = [r for r in rows if r["rho"] == rho and r["persist_s"] == persist_s and r["scheme"] == scheme
                      and r["restart"] == (restart or "none")]
                if not rs:
                    continue
                ratios = [r["are"] / r["are_nonprivate"] for r in rs]
                nv = [r["noise_var_over_sigma2"] for r in rs if r["noise_var_over_sigma2"] is not None]
                summary.append({"rho": rho, "persist_s": persist_s, "scheme": scheme, "restart": restart or "none",
                                "nz": rs[0]["nz"], "are_ratio_mean": float(np.mean(ratios)),
                                "are_ratio_sd": float(np.std(ratios)),
                                "noise_var_over_sigma2": float(np.mean(nv)) if nv else None})
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "persist.json").write_text(json.dumps({"rows": rows, "summary": summary, "trials": a.trials,
                                                  "seconds": round(time.time() - t0, 1)}, indent=2))
    print("| rho | persist_s | scheme | restart | nz | ARE / non-private ARE | noise var / sigma^2 |")
    print("|---|---|---|---|---|---|---|")
    for s in summary:
        print("| %s | %d | %s | %s | %d | %.3f ± %.3f | %s |" % (
            s["rho"], s["persist_s"], s["scheme"], s["restart"], s["nz"], s["are_ratio_mean"], s["are_ratio_sd"],
            "-" if s["noise_var_over_sigma2"] is None else "%.2f" % s["noise_var_over_sigma2"]))
    print("(%d trials, %.0f s; bench-results/persist.json)" % (a.trials, time.time() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
