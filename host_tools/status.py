"""``pansketch status``: devices, last releases, windows, gaps, privacy ledger.

For each device: its sketch parameters, number of releases, sequence
numbers (gaps = releases never received: still in the device's outbox,
lost with a wiped device, or rejected), last release (received time and
the end of its epochs), windows, missing epochs (epoch ranges between its
first and last release that no release covers: the device was off, or
releases are still on their way), and the per-event guarantee from the
ledger (host_tools/ledger.py), and the mean and largest number of noise
draws per cell (``nz``: internal draws re-added at every persist/restart
plus the output draw; they widen intervals, the guarantee is unchanged).
Then the fleet's guarantee and the most
recent rejections with their reasons. ``--json`` prints the same as one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from fractions import Fraction
from typing import Any, Optional

from host_tools import ledger as ledger_mod
from host_tools.query import iso
from host_tools.store import Store, StoredRelease


def _seq_gaps(seqs: list[int], limit: int = 50) -> tuple[list[int], int]:
    s = sorted(set(seqs))
    out: list[int] = []
    total = 0
    for a, b in zip(s, s[1:]):
        if b > a + 1:
            total += b - a - 1
            for x in range(a + 1, b):
                if len(out) >= limit:
                    break
                out.append(x)
    return out, total


def report(store: Store, delta: float = 1e-6, now: Optional[float] = None, windows: int = 10) -> dict[str, Any]:
    """The status as a dict (what ``--json`` prints)."""
    now = time.time() if now is None else now
    rels = store.releases()
    led = ledger_mod.build(rels, delta)
    by_dev: dict[str, list[StoredRelease]] = defaultdict(list)
    for r in rels:
        by_dev[r.device].append(r)
    devices = []
    for dev, salt, hv, kind, d, w, ep_s, first in store.devices():
        rs = by_dev.get(dev, [])
        if not rs:
            continue
        last = max(rs, key=lambda r: r.received)
        covered = ledger_mod.union((r.elo, r.ehi) for r in rs)
        gaps = ledger_mod.gaps(covered, covered[0][0], covered[-1][1])
        seq_missing, seq_missing_n = _seq_gaps([r.seq for r in rs])
        seen: dict[int, int] = defaultdict(int)
        for r in rs:
            seen[r.seq] += 1
        wins = sorted({(r.win_s, r.win) for r in rs})
        modes = sorted({"%s %ds" % (r.mode, r.win_s) + ("/%ds" % r.ep_s if r.mode == "keep" else "") for r in rs})
        budgets = sorted({"%s %s" % (r.mech, ledger_mod._frac(Fraction(*r.budget))) for r in rs})
        g = led.device(dev)
        devices.append({
            "device": dev, "kind": kind, "d": d, "w": w, "salt_id": salt, "mode": ", ".join(modes),
            "budget": ", ".join(budgets), "releases": len(rs),
            "seq": [min(seen), max(seen)], "missing_seqs": seq_missing, "missing_seq_count": seq_missing_n,
            "seq_reused": sorted(s for s, n in seen.items() if n > 1)[:20],
            "last_received": iso(last.received), "last_received_unix": last.received,
            "last_epoch_end": iso(max(r.t1 for r in rs)), "last_epoch_end_unix": max(r.t1 for r in rs),
            "windows": len(wins), "first_window": wins[0][1], "last_window": wins[-1][1],
            "missing_epochs": [{"from": iso(a * ep_s), "until": iso(b * ep_s), "epochs": b - a,
                                "elo": a, "ehi": b} for a, b in gaps[:50]],
            "missing_epoch_count": sum(b - a for a, b in gaps),
            "guarantee": g.as_dict(), "guarantee_text": g.text(),
            "noise_draws_mean": round(sum(r.nz for r in rs) / len(rs), 3), "noise_draws_max": max(r.nz for r in rs),
        })
    fleet_windows = led.fleet_windows()
    out = {
        "db": store.path, "now": iso(now), "releases": len(rels), "rejections": store.rejection_count(),
        "duplicates": store.duplicate_count(), "devices": devices,
        "fleet": {
            "guarantee": led.fleet().as_dict(), "guarantee_text": led.fleet().text(),
            "windows": [{"win_s": ws, "window": wn, "start": iso(wn * ws), "devices": n, "guarantee": g.as_dict()}
                        for ws, wn, n, g in fleet_windows[-windows:]],
            "window_count": len(fleet_windows),
        },
        "recent_rejections": [{"received": iso(rc), "topic": tp, "device": dv, "code": code, "reason": why, "size": sz}
                              for _id, rc, tp, dv, code, why, sz, _h in store.rejections(limit=10)],
    }
    return out


def _ago(t: float, now: float) -> str:
    s = max(0, int(now - t))
    if s < 120:
        return "%ds ago" % s
    if s < 7200:
        return "%dm ago" % (s // 60)
    if s < 172800:
        return "%dh ago" % (s // 3600)
    return "%dd ago" % (s // 86400)


def print_report(rep: dict[str, Any], now: float, out: Any = sys.stdout) -> None:
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p("pansketch status: %s: %d device(s), %d release(s), %d rejected, %d duplicate deliveries ignored"
      % (rep["db"], len(rep["devices"]), rep["releases"], rep["rejections"], rep["duplicates"]))
    if rep["devices"]:
        p("")
        p("%-20s %-10s %-18s %8s %-13s %-32s %7s %7s  %s" % (
            "DEVICE", "SKETCH", "MODE", "RELEASES", "SEQ", "LAST RELEASE (received)", "WINDOWS", "MISSING",
            "BUDGET / GUARANTEE PER EVENT; NOISE DRAWS PER CELL"))
        for d in rep["devices"]:
            p("%-20s %-10s %-18s %8d %-13s %-32s %7d %7d  %s; %s; noise draws %.3g (max %d)" % (
                d["device"][:20], "%s %dx%d" % (d["kind"], d["d"], d["w"]), d["mode"][:18], d["releases"],
                "%d-%d" % tuple(d["seq"]),
                "%s (%s)" % (d["last_received"], _ago(d["last_received_unix"], now)), d["windows"],
                d["missing_epoch_count"], d["budget"], d["guarantee_text"], d["noise_draws_mean"],
                d["noise_draws_max"]))
        gaps = [d for d in rep["devices"] if d["missing_epochs"] or d["missing_seq_count"] or d["seq_reused"]]
        if gaps:
            p("")
            p("gaps:")
            for d in gaps:
                for g in d["missing_epochs"][:10]:
                    p("  %s: no release for epochs [%s, %s) (%d epoch(s))" % (d["device"], g["from"], g["until"],
                                                                           g["epochs"]))
                if d["missing_seq_count"]:
                    more = d["missing_seq_count"] - len(d["missing_seqs"])
                    p("  %s: sequence numbers not received: %s%s" % (
                        d["device"], ", ".join(map(str, d["missing_seqs"][:20])),
                        " (+%d more)" % (more + max(0, len(d["missing_seqs"]) - 20)) if more > 0 or len(d["missing_seqs"]) > 20 else ""))
                if d["seq_reused"]:
                    p("  %s: sequence numbers used twice (device state reset?): %s" % (
                        d["device"], ", ".join(map(str, d["seq_reused"]))))
    f = rep["fleet"]
    p("")
    p("privacy ledger (unit: one event; windows hold disjoint events, so these do not add up):")
    p("  fleet, any window: %s" % f["guarantee_text"])
    if f["windows"]:
        p("  last %d of %d window(s):" % (len(f["windows"]), f["window_count"]))
        for wdw in f["windows"]:
            g = wdw["guarantee"]
            gtxt = ", ".join("%s=%s" % (k, g[k]) for k in ("eps", "rho") if k in g)
            p("    window %d (%ss from %s): %d device(s), %s, eps=%.3g at delta=%g" % (
                wdw["window"], wdw["win_s"], wdw["start"], wdw["devices"], gtxt, g["eps_at_delta"], g["delta"]))
    if rep["recent_rejections"]:
        p("")
        p("recent rejections (newest first):")
        for r in rep["recent_rejections"]:
            p("  %s %s (%d bytes): %s: %s" % (r["received"], r["topic"], r["size"], r["code"], r["reason"]))


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("status", help="devices, windows, gaps and the privacy ledger",
                              description="Summarise the release database: devices, last release, windows, "
                                          "missing epochs, budgets and the per-event guarantee.")
    p.add_argument("--config", required=True, metavar="FILE", help="host config TOML")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--windows", type=int, default=10, metavar="N", help="list the last N fleet windows (10)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from host_tools import hostconfig

    try:
        cfg = hostconfig.load(args.config)
    except hostconfig.ConfigError as exc:
        print("pansketch: config error: %s" % exc, file=sys.stderr)
        return 2
    try:
        store = Store(cfg.aggregator.db, readonly=True)
    except Exception as exc:
        print("pansketch status: %s" % exc, file=sys.stderr)
        return 1
    now = time.time()
    try:
        rep = report(store, cfg.query.delta, now, max(0, args.windows))
    finally:
        store.close()
    if args.json:
        print(json.dumps(rep, ensure_ascii=False))
    else:
        print_report(rep, now)
    return 0
