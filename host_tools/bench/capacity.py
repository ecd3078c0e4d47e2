"""Capacity plan from measured per-release costs (deploy/OPERATIONS.md "Capacity plan").

    python -m pansketch.host_tools.bench.capacity [--pg bench-results/host-pg*.json ...] [--soak bench-results/soak.json]
                                        [--devices 1e4,1e5,1e6] [--window-s 3600] [--drain-s 300]
                                        [--retain-days 30] [--keep-days 365] [--cores-per-host 8]
                                        [--utilisation 0.6] [--broker-memory-gb 8] [--out bench-results/capacity.md]

Inputs are the JSON files the benchmarks write, nothing else:

* ``--pg``: ``python -m pansketch.host_tools.bench.host --skip ingest,query`` (the
  PostgreSQL part): CPU microseconds per release of each process of the
  ingest path (aggregator, its MQTT and validation helpers, mosquitto,
  the PostgreSQL sessions and background processes) as medians over the
  runs with one aggregator, the rate one aggregator stored (a ceiling
  per aggregator: its writer commits one group at a time), and bytes per
  release measured in the
  database (releases table with TOAST and indexes, a pruned release's
  row, roll-up rows, WAL);
* ``--soak``: ``python -m pansketch.host_tools.bench.soak``: the broker's resident
  memory per connected device, ack latency;
* ``--fleetscale``: ``python -m pansketch.host_tools.bench.fleetscale`` (optional): the CPU of
  each read (a query, ``status``, a dashboard page) on its largest store and the growth law
  fitted over its sizes (cost ∝ N^b · W^c); the plan's read rows are that figure carried to N
  devices and a month of windows by the law. Whole processes, so the start-up in every figure
  pulls b below the marginal cost's: the rows are a floor past the measured sizes, and the per-device
  work of ``status`` and the fleet page is linear in N.

Every figure in the table is one of the formulas printed beside it, over
those inputs and the deployment parameters (window length, how fast the
hourly burst must drain, retention, cores per host and the share of them
to plan for). Sizes are of the release the ``--pg`` run measured (cs d=4
w=1024, 16.6 KB, by default); smaller sketches scale the byte rows with
the release size.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from typing import Any, Optional


def measured(pgs: list[dict[str, Any]], soak: Optional[dict[str, Any]]) -> dict[str, float]:
    """The per-release costs the plan uses, from the benchmark files (medians over all their rounds)."""
    ings = [pg["ingest_postgresql"] for pg in pgs if "rounds" in pg.get("ingest_postgresql", {})]
    rounds = [r for ing in ings for r in ing["rounds"]]
    runs = [r["1_aggregators"] for r in rounds if "cpu_us_per_release" in r.get("1_aggregators", {})]
    with_bytes = [ing for ing in ings if "bytes" in ing]
    if not runs or not with_bytes:
        raise SystemExit("capacity: no PostgreSQL run with 1 aggregator and measured bytes in --pg")
    ing = with_bytes[-1]

    def med(*roles: str) -> float:
        return statistics.median(sum(r["cpu_us_per_release"].get(k, 0) for k in roles) for r in runs)

    b = ing["bytes"]
    m = {"release_bytes": float(b["release_bytes"]),
         "cpu_aggregator_us": med("aggregator", "pansketch.host_tools.ingest.mqttproc", "pansketch.host_tools.ingest.validproc"),
         "cpu_postgres_us": med("postgres sessions", "postgres background", "postgres"),
         "cpu_broker_us": med("mosquitto"),
         "row_bytes": float(b["releases_table_bytes_per_release"]),
         "pruned_row_bytes": float(b["pruned_releases_table_bytes_per_release"]),
         "rollup_row_bytes": float(b["rollups_bytes_per_row"]),
         "rollup_device_row_bytes": float(b["rollup_devices_bytes_per_row"]),
         "wal_bytes": float(b["wal_bytes_per_release_groups_of_256"]),
         "aggregator_releases_per_s": statistics.median(r["releases_per_second"] for r in runs),
         "rounds": float(len(runs)),
         "load_1min": statistics.median(x["loadavg_at_start"][0] for x in rounds)}
    if soak and (soak.get("broker_rss_mb") or {}).get("bytes_per_device_connection"):
        m["broker_bytes_per_connection"] = float(soak["broker_rss_mb"]["bytes_per_device_connection"])
    return m


# the reads of the fleetscale benchmark the plan carries over, with the name of their row
READS = {"freq": "CPU of `query freq` over a month", "series_1h": "CPU of `query series --step 1h` over a month",
         "status": "CPU of `status --json`", "page_fleet": "CPU of the dashboard's fleet page (first request)",
         "page_item": "CPU of the dashboard's item page", "page_topk": "CPU of the dashboard's top-k page",
         "metrics_scrape": "CPU of a /metrics scrape (store unchanged)"}


def reads(fs: dict[str, Any]) -> dict[str, Any]:
    """The fleetscale benchmark's figures the plan uses: for each read, its CPU seconds on the largest
    store measured (most devices, then most windows) and the exponents fitted over every size, of the
    code measured first (the run's own; a ``--code`` peer is the code before)."""
    label = fs["rows"][0]["code"]
    mine = [r for r in fs["rows"] if r["code"] == label]
    law = fs.get("growth", {}).get(label)
    if not law:
        raise SystemExit("capacity: --fleetscale has no growth law (it needs sizes varying in devices and windows)")
    top = max(mine, key=lambda r: (r["devices"], r["windows"]))
    return {"devices": float(top["devices"]), "windows": float(top["windows"]),
            "cpu_s": {k: float(top[k]) for k in READS if k in top and k in law},
            "exp": {k: (float(law[k]["exp_devices"]), float(law[k]["exp_windows"])) for k in READS if k in law}}


def _si(x: float, unit: str = "B") -> str:
    for div, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return "%.3g %s%s" % (x / div, p, unit)
    return "%.3g %s" % (x, unit)


def read_rows(r: dict[str, Any], n: float, a: argparse.Namespace) -> dict[str, str]:
    """The reads' rows of one column: each read's CPU over a month of windows, carried from the measured
    store to ``n`` devices by its fitted law."""
    month = 30 * 86400.0 / a.window_s
    out = {}
    for k, name in READS.items():
        if k in r["cpu_s"]:
            b, c = r["exp"][k]
            t = r["cpu_s"][k] * (n / r["devices"]) ** b * (month / r["windows"]) ** c
            out[name] = "%.3g s" % t if t >= 0.01 else "%.2g ms" % (t * 1e3)
    return out


def plan(m: dict[str, float], n: float, a: argparse.Namespace) -> dict[str, str]:
    """One column of the plan: ``n`` devices."""
    per_day = 86400.0 / a.window_s
    rate = n / a.window_s
    burst = n / a.drain_s
    cores = a.cores_per_host * a.utilisation
    agg_cores = burst * m["cpu_aggregator_us"] / 1e6
    pg_cores = burst * m["cpu_postgres_us"] / 1e6
    br_cores = burst * m["cpu_broker_us"] / 1e6
    windows = a.keep_days * per_day
    raw = n * per_day * min(a.retain_days, a.keep_days) * m["row_bytes"]
    pruned = n * per_day * max(0.0, a.keep_days - a.retain_days) * m["pruned_row_bytes"]
    # >= 2: one may fail or restart; and no more per aggregator than one stored in the benchmark
    aggs = max(2, math.ceil(agg_cores / cores), math.ceil(burst / m["aggregator_releases_per_s"]))
    rollups = windows * (aggs * m["rollup_row_bytes"] + n * m["rollup_device_row_bytes"])
    out = {"releases/s (mean)": "%.3g" % rate,
           "releases/s to drain the hourly burst": "%.3g" % burst,
           "ingress bytes/day": _si(n * per_day * m["release_bytes"]),
           "WAL bytes/day": _si(n * per_day * m["wal_bytes"]),
           "raw releases kept (retention)": _si(raw),
           "pruned release rows": _si(pruned),
           "roll-ups": _si(rollups),
           "database total": _si(raw + pruned + rollups),
           "aggregator cores at the burst": "%.2f" % agg_cores,
           "aggregators (hosts)": str(aggs),
           "PostgreSQL cores at the burst": "%.2f" % pg_cores,
           "broker cores at the burst": "%.2f" % br_cores}
    if "broker_bytes_per_connection" in m:
        per_node = a.broker_memory_gb * 2**30 / m["broker_bytes_per_connection"]
        nodes = max(3, math.ceil(n / per_node) + 1, math.ceil(br_cores / cores))  # +1: survive a node's loss
        out["connections per broker node (memory)"] = "%.3g" % per_node
        out["broker nodes"] = str(nodes)
    return out


FORMULAS = {
    "releases/s (mean)": "N / window_s",
    "releases/s to drain the hourly burst": "N / drain_s (windows close together: UTC-aligned)",
    "ingress bytes/day": "N x 86400/window_s x release_bytes",
    "WAL bytes/day": "N x 86400/window_s x wal_bytes",
    "raw releases kept (retention)": "N x 86400/window_s x retain_days x row_bytes",
    "pruned release rows": "N x 86400/window_s x (keep_days - retain_days) x pruned_row_bytes",
    "roll-ups": "keep_days x 86400/window_s x (aggregators x rollup_row_bytes + N x rollup_device_row_bytes)",
    "database total": "the three above",
    "aggregator cores at the burst": "burst rate x cpu_aggregator_us / 10^6",
    "aggregators (hosts)": "max(2, ceil(aggregator cores / (cores_per_host x utilisation)), "
                           "ceil(burst rate / aggregator_releases_per_s))",
    "PostgreSQL cores at the burst": "burst rate x cpu_postgres_us / 10^6",
    "broker cores at the burst": "burst rate x cpu_broker_us / 10^6 (+ TLS: not measured here)",
    **{name: "measured at N0 x W0, x (N/N0)^b x (W/W0)^c, W = 30 x 86400/window_s" for name in READS.values()},
    "connections per broker node (memory)": "broker_memory / broker_bytes_per_connection",
    "broker nodes": "max(3, ceil(N / connections per node) + 1, ceil(broker cores / (cores_per_host x utilisation)))",
}


def table(m: Optional[dict[str, float]], a: argparse.Namespace, r: Optional[dict[str, Any]] = None) -> str:
    """The plan as markdown: the write path's rows from ``m`` (:func:`measured`), the reads' from ``r``
    (:func:`reads`); either may be None (its rows left out)."""
    ns = [float(x) for x in a.devices.split(",")]
    cols: list[dict[str, str]] = [{} for _n in ns]
    lines: list[str] = []
    if m is not None:
        cols = [plan(m, n, a) for n in ns]
        lines += ["Measured inputs (medians over %d PostgreSQL rounds with one aggregator, load average %.1f):"
                  % (m["rounds"], m["load_1min"]), ""]
        for k, v in m.items():
            if k not in ("load_1min", "rounds"):
                lines.append("* %s = %s" % (k, ("%.0f" % v) if v >= 10 else ("%.3g" % v)))
        lines += ["", "Parameters: window_s = %g, drain_s = %g, retain_days = %g, keep_days = %g, cores_per_host = %g, "
                  "utilisation = %g, broker_memory = %g GB" % (a.window_s, a.drain_s, a.retain_days, a.keep_days,
                                                              a.cores_per_host, a.utilisation, a.broker_memory_gb), ""]
    if r is not None:
        for col, n in zip(cols, ns):
            col.update(read_rows(r, n, a))
        lines += ["Reads (fleetscale, CPU of whole processes on a store of N0 = %d devices x W0 = %d hourly windows; "
                  "exponents b, c of N^b W^c fitted over its sizes; W = a month of %g s windows):"
                  % (r["devices"], r["windows"], a.window_s), ""]
        for k, name in READS.items():
            if k in r["cpu_s"]:
                lines.append("* %s: %.3g s, b = %.2f, c = %.2f" % (k, r["cpu_s"][k], *r["exp"][k]))
        lines.append("")
    lines.append("| quantity | formula | " + " | ".join("N = 10^%d" % round(math.log10(n)) for n in ns) + " |")
    lines.append("|---|---|" + "---|" * len(ns))
    for k in cols[0]:
        lines.append("| %s | %s | %s |" % (k, FORMULAS[k], " | ".join(c[k] for c in cols)))
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pg", nargs="+", default=["bench-results/host-pg.json"],
                    help="bench.host JSON file(s) with the PostgreSQL part")
    ap.add_argument("--soak", default="bench-results/soak.json")
    ap.add_argument("--fleetscale", default="bench-results/fleetscale.json",
                    help="bench.fleetscale JSON (the read rows; left out when the file is missing)")
    ap.add_argument("--devices", default="1e4,1e5,1e6")
    ap.add_argument("--window-s", type=float, default=3600.0)
    ap.add_argument("--drain-s", type=float, default=300.0, help="the hourly burst is stored within this")
    ap.add_argument("--retain-days", type=float, default=30.0, help="[aggregator] retain_raw_s in days")
    ap.add_argument("--keep-days", type=float, default=365.0, help="the horizon the storage row is for")
    ap.add_argument("--cores-per-host", type=float, default=8.0)
    ap.add_argument("--utilisation", type=float, default=0.6, help="share of a host's cores to plan for")
    ap.add_argument("--broker-memory-gb", type=float, default=8.0, help="memory per broker node for sessions")
    ap.add_argument("--out", default="bench-results/capacity.md")
    a = ap.parse_args(argv)
    pgs = []
    for name in a.pg:
        if not os.path.exists(name) and os.path.exists(a.fleetscale):
            print("capacity: %s not found: the write path's rows left out" % name, file=sys.stderr)
            continue
        with open(name) as f:
            pgs.append(json.load(f))
    soak = None
    if os.path.exists(a.soak):
        with open(a.soak) as f:
            soak = json.load(f)
    fs = None
    if os.path.exists(a.fleetscale):
        with open(a.fleetscale) as f:
            fs = reads(json.load(f))
    text = table(measured(pgs, soak) if pgs else None, a, fs)
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
