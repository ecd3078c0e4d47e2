"""Fleet scale: the cost of a month of answers, by number of devices N and windows W.

    python -m pansketch.host_tools.bench.fleetscale [--sizes 100x24,100x168,1000x168] [--out bench-results]
                                          [--code DIR] [--keep DIR]

Each store holds N devices x W hourly windows of small cms sketches (d=2, w=16: the shape of the
store is what is measured, not the sketch). It is built in two steps: window 0 of every device goes
through the aggregator's own write path (real encoder, decoder, roll-ups, devices table), then
windows 1..W-1 are copies of those rows made by bulk SQL (``INSERT ... SELECT`` with the times,
epochs, seqs and window ids shifted), roll-ups and their noise and device rows included, then the kept
summaries built from them (as a writer's first open of an older store builds them; a kept store from
older code gets them on its first run here). The counters repeat from window to window; no query here
depends on their values.

Measured per store, CPU time (user + system) of whole processes, median of ``--repeat`` runs:
``pansketch query freq`` over all windows, ``pansketch query series --step 1h`` over all windows
(with its running totals, the CLI's default), ``pansketch status --json``, one ``/metrics``
scrape of the store collector (in a child process, the scrape alone: with the store unchanged since
the previous scrape, and right after a write transaction), and the dashboard's fleet, item and top-k
pages (the first request of a fresh server process, through the WSGI app; 200 candidates). ``--code DIR`` measures the
host_tools of another checkout on the same stores (a before/after comparison).

The growth law of each is fitted by least squares on log cost = a + b log N + c log W over the
sizes (b, c: the exponents in devices and windows). Figures, not assertions; written to
bench-results/fleetscale.json. tests/test_fleetscale.py checks the shape at two small sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

SALT = "fleetscale-salt-0001"
T0 = 1_700_000_000 // 3600 * 3600  # an hour boundary
D, W_CELLS = 2, 16

# the columns of a release row, shifted by k windows where they name a time, epoch, seq or window
_SHIFTED = {"elo": "elo + k", "ehi": "ehi + k", "seq": "seq + k", "win": "win + k",
            "t0": "t0 + k * 3600", "t1": "t1 + k * 3600", "received": "received + k * 3600"}


def copy_statements(win0: int, w: int, sqlite: bool) -> list[str]:
    """The bulk SQL that copies window ``win0``'s rows to windows win0+1 .. win0+w-1 (module docstring):
    releases, roll-ups (PostgreSQL: each writer shard's), their noise and device rows, the flag windows
    the write path would have marked. ``sqlite``: its dialect (a recursive CTE for the window offsets)."""
    from pansketch.host_tools.store.schema import _INSERT_COLS

    if sqlite:
        with_ks, ks = "WITH RECURSIVE ks(k) AS (SELECT 1 UNION ALL SELECT k + 1 FROM ks WHERE k < %d) " % (w - 1), "ks"
    else:
        with_ks, ks = "", "generate_series(1, %d) AS ks(k)" % (w - 1)
    shard = "" if sqlite else ", shard"
    cols = ", ".join(_INSERT_COLS)
    sel = ", ".join(_SHIFTED.get(c, c) for c in _INSERT_COLS)
    same = ("FROM rollups r1 JOIN rollups r2 ON r2.win > r1.win AND r2.win_s = r1.win_s AND r2.kind = r1.kind "
            "AND r2.d = r1.d AND r2.w = r1.w AND r2.hv = r1.hv AND r2.salt = r1.salt "
            + ("" if sqlite else "AND r2.shard = r1.shard "))
    return [
        "INSERT INTO releases (%s) %sSELECT %s FROM releases, %s WHERE win = %d" % (cols, with_ks, sel, ks, win0),
        "INSERT INTO rollups (win_s, win, kind, d, w, hv, salt%s, releases, t0, t1, sums) %sSELECT win_s, win + k, "
        "kind, d, w, hv, salt%s, releases, t0 + k * 3600, t1 + k * 3600, sums FROM rollups, %s WHERE win = %d"
        % (shard, with_ks, shard, ks, win0),
        "INSERT INTO rollup_noise (rollup, mech, num, den, count) SELECT r2.id, x.mech, x.num, x.den, x.count "
        + same + "JOIN rollup_noise x ON x.rollup = r1.id WHERE r1.win = %d" % win0,
        "INSERT INTO rollup_devices (rollup, device) SELECT r2.id, x.device " + same
        + "JOIN rollup_devices x ON x.rollup = r1.id WHERE r1.win = %d" % win0,
        # the write path marks each window's flags to compute (schema flag_windows): so for the copies
        "INSERT INTO flag_windows (win_s, win, gen, done, setting) %sSELECT win_s, win + k, 1, 0, '' "
        "FROM flag_windows, %s WHERE win = %d ON CONFLICT DO NOTHING" % (with_ks, ks, win0),
    ]


def build(db: str, n: int, w: int) -> dict[str, float]:
    """A store of ``n`` devices x ``w`` hourly windows (see the module docstring); build timings."""
    from pansketch.agent import release
    from pansketch.agent.params import Params
    from pansketch.host_tools import hostconfig
    from pansketch.host_tools.ingest.aggregator import Aggregator

    t = time.perf_counter()
    cfg = hostconfig.from_dict({"fleet": {"salt": SALT}, "aggregator": {"db": db}})
    agg = Aggregator(cfg)
    rng = np.random.default_rng(1)
    import array

    for i in range(n):
        dev = "dev%05d" % i
        p = Params({"device": dev, "salt": SALT, "kind": "cms", "d": D, "w": W_CELLS, "window_s": 3600})
        ctr = array.array("i", rng.integers(-3, 40, D * W_CELLS).tolist())
        raw = release.encode(p, 0, T0 // 3600, T0 // 3600 + 1, 0, ctr, 2)
        if not agg.handle("pansketch/%s/release" % dev, raw).stored:
            raise RuntimeError("release of %s not stored" % dev)
    agg.close()
    t_write = time.perf_counter() - t
    import sqlite3

    t = time.perf_counter()
    con = sqlite3.connect(db)
    con.execute("PRAGMA journal_mode = WAL")
    win0 = T0 // 3600
    if w > 1:
        for stmt in copy_statements(win0, w, sqlite=True):
            con.execute(stmt)
        dcols = {r[1] for r in con.execute("PRAGMA table_info(devices)")}
        if "max_seq" in dcols:  # the SQLite store's per-device highest seq (pansketch.host_tools.store.sqlite)
            con.execute("UPDATE devices SET max_seq = max_seq + ? WHERE max_seq IS NOT NULL", (w - 1,))
    con.commit()
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    t_sql = time.perf_counter() - t
    return {"write_path_s": round(t_write, 2), "bulk_sql_s": round(t_sql, 2), "flags_s": keep_flags(db),
            "summaries_s": keep_summaries(db, rebuild=True)}


def keep_summaries(db: str, rebuild: bool = False) -> float:
    """The per-device and per-window summaries (pansketch.host_tools.store.summary) of the copied rows, built
    by the code a writer's open of an older store runs; ``rebuild`` False: only if the store has none (a
    store kept from a build by older code). Returns the seconds it took."""
    from pansketch.host_tools.store import summary
    from pansketch.host_tools.store.sqlite import Store

    t = time.perf_counter()
    st = Store(db)  # a store without them gets them here (its first open for writing)
    try:
        if rebuild:
            st._exec_tx(lambda cur: summary.rebuild(st, cur))
    finally:
        st.close()
    return round(time.perf_counter() - t, 2)


def keep_flags(db: str) -> float:
    """Compute and keep the recent windows' flags, as a running aggregator's flag scanner does
    (pansketch.host_tools.metrics.FlagScanner, no CPU budget here): readers then find them stored.
    Returns the seconds it took."""
    from pansketch.host_tools.query import influence
    from pansketch.host_tools.store.sqlite import Store

    t = time.perf_counter()
    st = Store(db)
    try:
        influence.refresh(st)
    finally:
        st.close()
    return round(time.perf_counter() - t, 2)


_SCRAPE = ("import sys, time\n"
           "from pansketch.host_tools.metrics import StoreCollector\n"
           "c = StoreCollector(sys.argv[1], salt=None)\n"
           "list(c.collect())\n"  # the first scrape fills any cache a collector keeps
           "t = time.thread_time(); list(c.collect()); print(time.thread_time() - t)\n")
# a scrape right after a write transaction (the change counter moved): the scrape's own thread's CPU
_SCRAPE_CHANGED = ("import sys, time\n"
                   "from pansketch.host_tools.metrics import StoreCollector\n"
                   "from pansketch.host_tools.store.sqlite import Store\n"
                   "c = StoreCollector(sys.argv[1], salt=None)\n"
                   "list(c.collect())\n"
                   "w = Store(sys.argv[1]); w._exec_tx(lambda cur: None); w.close()\n"
                   "t = time.thread_time(); list(c.collect()); print(time.thread_time() - t)\n")
# dashboard pages through the WSGI app, each the first request of a fresh server process (CPU of the call)
_PAGES = ("import sys, time\n"
          "from pansketch.host_tools import hostconfig\n"
          "from pansketch.host_tools.web.app import Dashboard as App\n"
          "app = App(hostconfig.load(sys.argv[1]), candidates=['item-%d' % i for i in range(200)])\n"
          "def get(path, qs):\n"
          "    env = {'REQUEST_METHOD': 'GET', 'PATH_INFO': path, 'QUERY_STRING': qs, 'wsgi.url_scheme': 'http',\n"
          "           'SERVER_NAME': 'localhost', 'SERVER_PORT': '80'}\n"
          "    st = []\n"
          "    t = time.process_time(); b''.join(app(env, lambda s, h, *a: st.append(s)))\n"
          "    dt = time.process_time() - t\n"
          "    assert st[0].startswith('200'), (path, st)\n"
          "    return dt\n"
          "get('/healthz', '')\n"
          "print(get(sys.argv[2], sys.argv[3]))\n")
PAGES = {"page_fleet": ("/", ""), "page_item": ("/item", "item=item-1"), "page_topk": ("/topk", "k=10")}


def _cpu(argv: list[str], code: Optional[str]) -> tuple[float, str]:
    """CPU seconds (user + system) of the child running ``argv``, and its stdout."""
    env = dict(os.environ)
    # an installed package's modules are compiled once (pip writes their bytecode): without this a
    # child recompiles every host module of the checkout, about 60 ms of each process (_warm wrote them)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if code:
        env["PYTHONPATH"] = code
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(argv, env=env, cwd=code or None, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise RuntimeError("%s failed: %s" % (" ".join(argv[:6]), out.stderr[-500:]))
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), out.stdout


_WARM = ("import pansketch.host_tools.cli, pansketch.host_tools.query.cli, pansketch.host_tools.query.point_cli, "
         "pansketch.host_tools.query.series_cli, pansketch.host_tools.query.status, pansketch.host_tools.web.app, "
         "pansketch.host_tools.metrics")


def _warm(code: Optional[str]) -> None:
    """Import what the measured processes import once, so that their bytecode is written (see _cpu)."""
    _cpu([sys.executable, "-c", _WARM], code)


def measure(db: str, conf: str, code: Optional[str], repeat: int,
            only: Optional[set[str]] = None) -> dict[str, float]:
    py = [sys.executable, "-c", "import sys; from pansketch.host_tools.cli import main; sys.exit(main(sys.argv[1:]))"]
    cmds = {
        "freq": py + ["query", "--config", conf, "freq", "item-1", "item-2"],
        "series_1h": py + ["query", "--config", conf, "series", "item-1", "--step", "1h"],
        "status": py + ["status", "--config", conf, "--json"],
    }
    out: dict[str, float] = {}
    def want(k: str) -> bool:
        return only is None or k in only
    for name, argv in cmds.items():
        if want(name):
            out[name] = round(statistics.median(_cpu(argv, code)[0] for _ in range(repeat)), 3)
    for name, script in (("metrics_scrape", _SCRAPE), ("metrics_scrape_changed", _SCRAPE_CHANGED)):
        if want(name):
            runs = [float(_cpu([sys.executable, "-c", script, db], code)[1].split()[-1]) for _ in range(repeat)]
            out[name] = round(statistics.median(runs), 4)
    for name, (path, qs) in PAGES.items():
        if want(name):
            runs = [float(_cpu([sys.executable, "-c", _PAGES, conf, path, qs], code)[1].split()[-1])
                    for _ in range(repeat)]
            out[name] = round(statistics.median(runs), 3)
    return out


MEASURES = ("freq", "series_1h", "status", "metrics_scrape", "metrics_scrape_changed") + tuple(PAGES)


def fit(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Least squares of log cost = a + b log N + c log W (b, c: exponents; needs both to vary)."""
    x = np.array([[1.0, np.log(r["devices"]), np.log(r["windows"])] for r in rows])
    y = np.log(np.array([max(r[key], 1e-4) for r in rows]))
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    return {"exp_devices": round(float(coef[1]), 2), "exp_windows": round(float(coef[2]), 2)}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pansketch.host_tools.bench.fleetscale", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="100x168,1000x168,100x720", help="NxW,... (devices x hourly windows)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--name", default="fleetscale", help="the figures file: OUT/NAME.json")
    ap.add_argument("--code", action="append", default=[], metavar="DIR",
                    help="also measure the host_tools of this checkout (repeatable; the first run is this one)")
    ap.add_argument("--keep", metavar="DIR", help="build the stores here and keep them (default: a temporary dir)")
    ap.add_argument("--only", metavar="M,...", help="measure only these (of %s)" % ", ".join(MEASURES))
    a = ap.parse_args(argv)
    sizes = [tuple(int(v) for v in s.split("x")) for s in a.sizes.split(",")]
    root = Path(a.keep or tempfile.mkdtemp(prefix="fleetscale-"))
    root.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for code in [None] + a.code:
        _warm(code)
    try:
        for n, w in sizes:
            db = str(root / ("fleet-%dx%d.db" % (n, w)))
            timing: dict[str, Any] = {}
            if not os.path.exists(db):
                timing = build(db, n, w)
            else:
                timing = {"summaries_s": keep_summaries(db)}
            conf = str(root / ("fleet-%dx%d.toml" % (n, w)))
            Path(conf).write_text('[fleet]\nsalt = "%s"\n[aggregator]\ndb = "%s"\n' % (SALT, db))
            for label, code in [("this", None)] + [(os.path.basename(c.rstrip("/")), c) for c in a.code]:
                row = {"devices": n, "windows": w, "releases": n * w, "code": label, **timing,
                       **measure(db, conf, code, a.repeat, set(a.only.split(",")) if a.only else None)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    laws = {}
    for label in dict.fromkeys(r["code"] for r in rows):
        mine = [r for r in rows if r["code"] == label]
        if len({r["devices"] for r in mine}) > 1 and len({r["windows"] for r in mine}) > 1:
            laws[label] = {k: fit(mine, k) for k in MEASURES if all(k in r for r in mine)}
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, a.name + ".json")
    with open(path, "w") as f:
        json.dump({"rows": rows, "growth": laws}, f, indent=1)
    print(json.dumps(laws, indent=1))
    print("wrote %s" % path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
