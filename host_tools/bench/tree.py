"""Evidence for tree mode: range-count error and interval width vs range length.

    python -m pansketch.host_tools.bench.tree [--epochs 10080] [--epoch-s 60] [--levels 15] [--w 256]
                                    [--persist-s 86400] [--persist-noise refresh|shadow]
                                    [--out bench-results/tree_evidence.json]

One stream (Zipf items, a few events per epoch) is counted by two real
device cores with the same parameters and the same per-event guarantee,
one in ``window`` mode (one release per epoch) and one in ``tree`` mode
(L levels). Tree answers are measured twice: from the raw canonical cover
(``--no-consistency``, column ``tree``) and from least-squares consistent
nodes (the default, column ``tree_consistent``, pansketch.host_tools.query.treels). Their releases go through the real aggregator into SQLite, and
every range count is asked through the CLI (``pansketch query freq ...
--since --until --device --json``, a subprocess per query). For each range
length the table gives, per mode: RMSE of the estimates against the true
counts, mean interval width, empirical coverage, releases combined and
noise draws per cell. Both devices see the same events and the same hash
functions, so the sketch collisions are identical: the difference between
the two columns is the noise.

The crossover (the shortest range from which tree mode has the smaller
noise) is also computed from the noise model (pansketch.agent.pi.plan), which is what
``pansketch-agent check`` prints.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from pansketch.agent.params import Params
from pansketch.agent.recorders import make
from pansketch.agent.rng import Rng

SALT = "tree-evidence-salt"
# (column, device, extra query flags): tree = the raw canonical cover (the answers before least-squares
# consistency, pansketch.host_tools.query.treels), tree_consistent = the default answers
MODES: tuple[tuple[str, str, tuple[str, ...]], ...] = (("window", "win-dev", ()), ("tree", "tree-dev", ("--no-consistency",)), ("tree_consistent", "tree-dev", ()))
LENGTHS = (1, 24, 168, 720, 10080)


def stream(epochs: int, rate: float, universe: int, s: float, seed: int) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, universe + 1) ** s
    p /= p.sum()
    out = []
    for _ in range(epochs):
        n = int(rng.poisson(rate))
        out.append(["item-%d" % int(k) for k in rng.choice(universe, size=n, p=p)])
    return out


def run_device(p: Params, root: str, epochs: list[list[str]], e0: int, handle: Any) -> float:
    t = time.perf_counter()
    rec = make(p, root, e0 * p.epoch_s, rng=Rng(), log=lambda _m: None)
    sent = 0
    for k, ev in enumerate(epochs):
        if ev:
            rec.add_many(ev)
        rec.tick((e0 + k + 1) * p.epoch_s)
        for s in rec.outbox.pending():
            handle(p.device, rec.outbox.read(s))
            rec.outbox.ack(s)
            sent += 1
    return time.perf_counter() - t


def cli_freq(conf: str, items: list[str], since: int, until: int, dev: str, *extra: str) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "pansketch.host_tools.cli", "query", "--config", conf, "freq", *items,
                          "--since", str(since), "--until", str(until), "--device", dev, "--json", *extra],
                         capture_output=True, text=True, check=True)
    return [json.loads(x) for x in out.stdout.splitlines()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=10080)
    ap.add_argument("--epoch-s", type=int, default=60)
    ap.add_argument("--levels", type=int, default=15)
    ap.add_argument("--d", type=int, default=4)
    ap.add_argument("--w", type=int, default=256)
    ap.add_argument("--budget", default="1/2")
    ap.add_argument("--persist-s", type=int, default=86400)
    ap.add_argument("--persist-noise", default="refresh", choices=("refresh", "shadow"),
                    help="the tree device's persist scheme (docs/PRIVACY.md); the window device uses auto")
    ap.add_argument("--rate", type=float, default=3.0, help="events per epoch (Poisson mean)")
    ap.add_argument("--positions", type=int, default=12, help="range positions per length")
    ap.add_argument("--lengths", default=",".join(str(x) for x in LENGTHS))
    ap.add_argument("--out", default="bench-results/tree_evidence.json")
    ap.add_argument("--workdir")
    a = ap.parse_args(argv)
    from pansketch.host_tools import hostconfig
    from pansketch.host_tools.ingest.aggregator import Aggregator

    work = a.workdir or tempfile.mkdtemp(prefix="pansketch-tree-evidence-")
    os.makedirs(work, exist_ok=True)
    lengths = [int(x) for x in a.lengths.split(",") if int(x) <= a.epochs]
    e0 = 28_000_000 + 1234  # a minute in 2023, not aligned to the tree (ranges may cross trees)
    base = {"salt": SALT, "kind": "cs", "d": a.d, "w": a.w, "mechanism": "dgauss", "budget": a.budget,
            "epoch_s": a.epoch_s, "persist_s": a.persist_s}
    pw = Params(dict(base, device="win-dev", mode="window", window_s=a.epoch_s))
    pt = Params(dict(base, device="tree-dev", mode="tree", levels=a.levels, persist_noise=a.persist_noise))
    epochs = stream(a.epochs, a.rate, 500, 1.1, 7)
    db = os.path.join(work, "host.db")
    conf = os.path.join(work, "host.toml")
    Path(conf).write_text('[fleet]\nsalt = "%s"\n[aggregator]\ndb = "%s"\n' % (SALT, db))
    if not os.path.exists(db):
        agg = Aggregator(hostconfig.load(conf))

        def handle(dev: str, raw: bytes) -> None:
            o = agg.handle("pansketch/%s/release" % dev, raw)
            assert o.stored, o.reason

        tw = run_device(pw, os.path.join(work, "win"), epochs, e0, handle)
        tt = run_device(pt, os.path.join(work, "tree"), epochs, e0, handle)
        agg.close()
        print("devices: window %.0f s, tree %.0f s" % (tw, tt), flush=True)
    truth = np.zeros((a.epochs, 500), dtype=np.int64)
    for k, ev in enumerate(epochs):
        for x in ev:
            truth[k, int(x.split("-")[1])] += 1
    tot = truth.sum(axis=0)
    order = np.argsort(-tot)
    qitems = [int(i) for i in order[:10]] + [int(i) for i in order[40:50]] + [int(i) for i in order[200:205]]
    rng = np.random.default_rng(3)
    rows = []
    for k in lengths:
        starts = sorted({int(x) for x in rng.integers(0, a.epochs - k + 1, size=a.positions)})
        res: dict[str, dict[str, list[float]]] = {}
        for mode, dev, extra in MODES:
            acc = res.setdefault(mode, {"err": [], "width": [], "cov": [], "rel": [], "draws": [], "sd": []})
            for st in starts:
                since = (e0 + st) * a.epoch_s
                until = (e0 + st + k) * a.epoch_s
                ans = cli_freq(conf, ["item-%d" % i for i in qitems], since, until, dev, *extra)
                f = truth[st:st + k].sum(axis=0)
                for i, an in zip(qitems, ans):
                    acc["err"].append(an["estimate"] - f[i])
                    lo = an["lo"] if an["lo"] is not None else -math.inf
                    hi = an["hi"] if an["hi"] is not None else math.inf
                    acc["width"].append(hi - lo)
                    acc["cov"].append(float(lo <= f[i] <= hi))
                acc["rel"].append(ans[0]["releases"])
                acc["draws"].append(ans[0]["noise_draws"])
                acc["sd"].append(ans[0]["noise_sd"])
        row: dict[str, Any] = {"epochs": k, "positions": len(starts)}
        for mode, _d, _e in MODES:
            r = res[mode]
            row[mode] = {"rmse": float(np.sqrt(np.mean(np.square(r["err"])))),
                         "mean_width": float(np.mean(r["width"])), "coverage": float(np.mean(r["cov"])),
                         "releases": float(np.mean(r["rel"])), "noise_draws": float(np.mean(r["draws"])),
                         "noise_sd_per_cell": float(np.mean(r["sd"]))}
        rows.append(row)
        print("k=%-6d window rmse %7.1f width %7.1f cov %.3f | tree raw rmse %7.1f width %7.1f cov %.3f | "
              "tree consistent rmse %7.1f width %7.1f cov %.3f (%.2fx lower rmse)"
              % (k, row["window"]["rmse"], row["window"]["mean_width"], row["window"]["coverage"],
                 row["tree"]["rmse"], row["tree"]["mean_width"], row["tree"]["coverage"],
                 row["tree_consistent"]["rmse"], row["tree_consistent"]["mean_width"],
                 row["tree_consistent"]["coverage"], row["tree"]["rmse"] / max(1e-9, row["tree_consistent"]["rmse"])),
              flush=True)
    from pansketch.agent.pi import plan

    cross = plan.crossover(pw, pt)
    out = {"config": {"epochs": a.epochs, "epoch_s": a.epoch_s, "levels": a.levels, "d": a.d, "w": a.w,
                      "budget": a.budget, "mechanism": "dgauss", "persist_s": a.persist_s,
                      "persist_noise_tree": a.persist_noise, "rate": a.rate,
                      "events": int(truth.sum()), "items_queried": len(qitems)},
           "rows": rows, "crossover_epochs_model": cross}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print("crossover (model): tree has less noise from %s epochs on" % cross)
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
