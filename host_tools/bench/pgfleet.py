"""Fleet-wide answers on PostgreSQL: their cost with and without the per-roll-up device counts.

    python -m pansketch.host_tools.bench.pgfleet [--devices 1000] [--windows 168] [--shards 2]
                                                 [--rounds 5] [--out bench-results]

A throwaway PostgreSQL server (pansketch.host_tools.store.pgserver) holds N devices x W hourly windows
of small cms sketches (d=2, w=16), the shape of host_tools/bench/fleetscale.py's SQLite stores: window
0 of every device goes through the aggregator's write path (``--shards`` aggregators, device i stored
by aggregator i mod shards, each its own writer shard: a window's devices spread over shard rows as
with several aggregators), windows 1..W-1 are copies made by bulk SQL (releases, roll-ups, noise and
device rows; the device rows' insert trigger counts them), then the kept summaries are built.

Measured, in one process and interleaved: ``freq`` over all windows and ``series --step 1h`` (running
totals) over all windows, each as the store answers it (one count row per roll-up row and window) and
with the counts hidden (``rollup_device_counts`` None: the N rows of every window, what a PostgreSQL
store answered before it kept counts). CPU time (user + system) of this process plus that of its
PostgreSQL backend (/proc of pg_backend_pid()) per answer (freq timed over 20 calls, series over 3: the
backend's CPU is read in clock ticks), median and spread of ``--rounds``; the two answers are checked
equal, and the answers with the counts must read no device rows. Figures, not assertions; written to OUT/pgfleet.json.
"""

from __future__ import annotations

import argparse
import array
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional

SALT = "pgfleet-salt-0001"
T0 = 1_700_000_000 // 3600 * 3600
ITEMS = ["item-%d" % i for i in range(8)]


def build(dsn: str, n: int, w: int, shards: int) -> dict[str, float]:
    """The store (module docstring); its build timings."""
    import numpy as np
    import psycopg

    from pansketch.agent import release
    from pansketch.agent.params import Params
    from pansketch.host_tools import hostconfig
    from pansketch.host_tools.ingest.aggregator import Aggregator
    from pansketch.host_tools.store import summary
    from pansketch.host_tools.store.pg import PgStore
    from pansketch.host_tools.bench.fleetscale import copy_statements

    t = time.perf_counter()
    cfg = hostconfig.from_dict({"fleet": {"salt": SALT}, "aggregator": {"db": dsn}})
    aggs = [Aggregator(cfg) for _ in range(shards)]
    rng = np.random.default_rng(1)
    for i in range(n):
        dev = "dev%05d" % i
        p = Params({"device": dev, "salt": SALT, "kind": "cms", "d": 2, "w": 16, "window_s": 3600})
        ctr = array.array("i", rng.integers(-3, 40, 32).tolist())
        raw = release.encode(p, 0, T0 // 3600, T0 // 3600 + 1, 0, ctr, 2)
        if not aggs[i % shards].handle("pansketch/%s/release" % dev, raw).stored:
            raise RuntimeError("release of %s not stored" % dev)
    for a in aggs:
        a.close()
    t_write = time.perf_counter() - t
    t = time.perf_counter()
    win0 = T0 // 3600
    with psycopg.connect(dsn) as con:
        for stmt in copy_statements(win0, w, sqlite=False):
            con.execute(stmt)
        con.execute("ANALYZE")
    t_sql = time.perf_counter() - t
    t = time.perf_counter()
    st = PgStore(dsn)
    try:
        st._exec_tx(lambda cur: summary.rebuild(st, cur))
    finally:
        st.close()
    return {"write_path_s": round(t_write, 2), "bulk_sql_s": round(t_sql, 2),
            "summaries_s": round(time.perf_counter() - t, 2)}


def _backend_cpu(pid: int) -> float:
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cost(store: Any, pid: int, fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(CPU s of this process, CPU s of its backend, the answer) of ``fn``."""
    c0, b0 = time.process_time(), _backend_cpu(pid)
    out = fn()
    return time.process_time() - c0, _backend_cpu(pid) - b0, out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pansketch.host_tools.bench.pgfleet",
                                 description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--windows", type=int, default=168)
    ap.add_argument("--shards", type=int, default=2, help="aggregators (writer shards) of the build")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="bench-results")
    a = ap.parse_args(argv)
    if a.devices < 1 or a.windows < 2 or a.shards < 1 or a.rounds < 1:
        ap.error("--devices, --shards and --rounds must be >= 1, --windows >= 2")
    from pansketch.host_tools.query import core as query
    from pansketch.host_tools.query import series as series_mod
    from pansketch.host_tools.store import pgserver
    from pansketch.host_tools.store.pg import PgStore

    srv = pgserver.PgServer.start()
    try:
        dsn = srv.create_database("pgfleet")
        timings = build(dsn, a.devices, a.windows, a.shards)
        print("built %d devices x %d windows (%d shards): %s" % (a.devices, a.windows, a.shards, timings), flush=True)
        st = PgStore(dsn, readonly=True)
        pid = int(st._q("SELECT pg_backend_pid()")[0][0])
        kept = st.rollup_device_counts

        def hidden(ids: Any) -> None:
            return None

        # (each timed call repeated: the backend's CPU is read in clock ticks, 10 ms)
        asks: dict[str, Callable[[], Any]] = {
            "freq": lambda: [[x.to_dict() for x in query.freq(st, ITEMS, salt=SALT)] for _ in range(20)][0],
            "series": lambda: [series_mod.series(st, ITEMS[:1], salt=SALT, step=3600, running=True).to_dict()
                               for _ in range(3)][0]}
        per_call = {"freq": 20, "series": 3}
        reads = [0]
        rows_of = st.rollup_devices

        def counted_rows(ids: Any) -> Any:
            reads[0] += 1
            return rows_of(ids)

        st.rollup_devices = counted_rows  # type: ignore[method-assign]
        figs: dict[str, dict[str, list[float]]] = {m: {"counts": [], "rows": []} for m in asks}
        for r in range(a.rounds + 1):  # round 0 warms the caches, not counted
            for m, fn in asks.items():
                answers = {}
                for how in (("counts", "rows") if r % 2 else ("rows", "counts")):
                    st.rollup_device_counts = kept if how == "counts" else hidden  # type: ignore[method-assign]
                    st._all_devices = None
                    reads[0] = 0
                    cpu, be, answers[how] = _cost(st, pid, fn)
                    if how == "counts" and reads[0]:
                        raise SystemExit("%s read the device rows of %d selections with the counts kept" % (m, reads[0]))
                    if r:
                        figs[m][how].append((cpu + be) / per_call[m])
                if answers["counts"] != answers["rows"]:
                    raise SystemExit("%s: the answers with and without the counts differ" % m)
        st.close()
    finally:
        srv.stop()
    out: dict[str, Any] = {"devices": a.devices, "windows": a.windows, "shards": a.shards, "rounds": a.rounds,
                           "build": timings, "cpu_s": {}}
    for m, f in figs.items():
        med = {h: statistics.median(v) for h, v in f.items()}
        out["cpu_s"][m] = {h: {"median": round(med[h], 4), "min": round(min(v), 4), "max": round(max(v), 4)}
                           for h, v in f.items()}
        out["cpu_s"][m]["rows_over_counts"] = round(med["rows"] / med["counts"], 2)
        print("%-6s CPU (client + backend) with counts %.3f s [%.3f-%.3f], rows %.3f s [%.3f-%.3f]: %.2fx"
              % (m, med["counts"], min(f["counts"]), max(f["counts"]), med["rows"], min(f["rows"]), max(f["rows"]),
                 med["rows"] / med["counts"]))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "pgfleet.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
