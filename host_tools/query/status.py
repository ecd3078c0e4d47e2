"""``pansketch status``: devices, last releases, windows, gaps, privacy ledger.

For each device: its sketch parameters, number of releases, last release
(received time and the end of its epochs), windows, missing epochs (epoch
ranges between its first and last release that no release covers: the
device was off, or releases are still on their way), the per-event
guarantee from the ledger (host_tools/store/ledger.py), and the mean and largest
number of noise draws per cell (``nz``: internal draws re-added at every
persist/restart plus the output draw; they widen intervals, the guarantee
is unchanged).

Delivery (docs/FORMAT.md section 3): every seq in [0, ``next_seq``) of a
device (seq starts at 0, so a loss before the first stored release
counts) is *stored*; *rejected* (the host refused it: the rejections
table); *pending* (not stored, and at or above the ``oldest_pending`` of
the device's latest status, or released after that status: the device
still holds it and re-sends it); or *lost* (none of these). Without a
device status the range is [0, highest seq stored or rejected] and an
unstored seq is *unknown* ("missing, no device status yet"; lost and
pending are then null, not 0). A stored
release is *late* when it was received more than a grace period
(``--late-grace``, ``[status] late_grace_s``; default max(ep_s, 300 s))
after the end of its epochs. The device's own backlog (``pending`` in its
status) is shown too.

Then the fleet's guarantee and the most recent rejections with their
reasons. ``--json`` prints the same as one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import sys
import time
from collections import defaultdict
from fractions import Fraction
from typing import Any, Iterator, Optional

from pansketch.host_tools.output import textsafe
from pansketch.host_tools.store import ledger as ledger_mod
from pansketch.host_tools.query.core import iso
from pansketch.host_tools.store.rows import StoredRelease
from pansketch.host_tools.store.sql import SQLStore as Store
from pansketch.host_tools.store.backend import open_store
from pansketch.host_tools.store import exclusions
from pansketch.host_tools.store import summary as summary_mod
from pansketch.host_tools.query import influence


from pansketch.host_tools.query import delivery
from pansketch.host_tools.query.delivery import LIST_LIMIT, _quarantine, _status_dict, implausible  # noqa: F401 (status.X)
DEFAULT_MAX_SEQ_JUMP = 100000  # as [aggregator] max_seq_jump: a release further above the highest seq is quarantined
DEFAULT_LATE_GRACE_MIN_S = summary_mod.LATE_GRACE_MIN_S  # the grace the kept summaries count late releases at

_log = logging.getLogger("pansketch.status")


def _absent(lo: int, hi: int, have: list[int], limit: int = LIST_LIMIT) -> tuple[list[int], int]:
    """Seqs in [lo, hi) not in the sorted list ``have``: (the first ``limit`` of them, how many)."""
    if hi <= lo:
        return [], 0
    import bisect

    i = bisect.bisect_left(have, lo)
    j = bisect.bisect_left(have, hi)
    total = (hi - lo) - (j - i)
    out: list[int] = []
    x = lo
    for h in have[i:j] + [hi]:
        while x < h and len(out) < limit:
            out.append(x)
            x += 1
        if len(out) >= limit:
            break
        x = h + 1
    return out, total


def classify(stored: list[int], rejected: dict[int, str], st: Any = None,
             limit: int = LIST_LIMIT, max_jump: Optional[int] = DEFAULT_MAX_SEQ_JUMP) -> dict[str, Any]:
    """Every seq of one device as stored / rejected / pending / lost (or unknown without a status).

    ``stored``: the seqs stored; ``rejected``: seq -> code of releases the host refused (not
    stored); ``st``: the device's latest status (store.DeviceStatus) or None. Works on counts
    and sorted lists, never on the whole range (a status may claim a huge next_seq). A status
    whose counters are :func:`implausible` is set aside (``status_ignored`` says why): the seqs
    are then classified as without a status.
    """
    s_set = set(stored)
    rej = sorted(q for q in rejected if q not in s_set)
    have = sorted(s_set | set(rej))
    head = {"stored_count": len(s_set), "rejected_seqs": rej[:limit], "rejected_count": len(rej),
            "rejected_codes": {str(q): rejected[q] for q in rej[:limit]}}
    return delivery.by_status(head, have, have[-1] + 1 if have else 0, st, limit, max_jump, _absent)


def late_grace(ep_s: int, grace: Optional[float]) -> float:
    """Seconds after the end of its epochs before a release counts as late."""
    return float(grace) if grace is not None else float(max(ep_s, DEFAULT_LATE_GRACE_MIN_S))


def seq_ranges(seqs: list[int], limit: int = 20) -> str:
    """'0-3, 7, 9-10' for the first ``limit`` seqs of a sorted list."""
    parts: list[str] = []
    run: list[int] = []
    for q in sorted(set(seqs))[:limit]:
        if run and q == run[-1] + 1:
            run.append(q)
            continue
        if run:
            parts.append("%d-%d" % (run[0], run[-1]) if len(run) > 1 else str(run[0]))
        run = [q]
    if run:
        parts.append("%d-%d" % (run[0], run[-1]) if len(run) > 1 else str(run[0]))
    return ", ".join(parts)


def _delivery(dev: str, rs: list[StoredRelease], rejected: dict[int, str], st: Any,
              grace: Optional[float], quarantined: Optional[dict[int, str]] = None,
              max_jump: Optional[int] = DEFAULT_MAX_SEQ_JUMP) -> dict[str, Any]:
    out = classify([r.seq for r in rs], rejected, st, max_jump=max_jump)
    _quarantine(out, quarantined or {}, {r.seq for r in rs})
    late = sorted((r for r in rs if r.received - r.t1 > late_grace(r.ep_s, grace)), key=lambda r: r.seq)
    out.update(late_seqs=[r.seq for r in late[:LIST_LIMIT]], late_count=len(late),
               late_max_s=round(max((r.received - r.t1 for r in late), default=0.0), 1),
               backlog=st.pending if st is not None and out["status_ignored"] is None else None,
               status=_status_dict(st, 0))
    # everything not stored in the checked range (pending, rejected, lost or unknown)
    out["missing_seqs"] = sorted(out["lost_seqs"] + out["pending_seqs"] + out["unknown_seqs"]
                                 + out["rejected_seqs"])[:LIST_LIMIT]
    out["missing_seq_count"] = ((out["lost_count"] or 0) + (out["pending_count"] or 0) + out["unknown_count"]
                                + out["rejected_count"])
    return out


def report(store: Store, delta: float = 1e-6, now: Optional[float] = None, windows: int = 10,
           late_grace_s: Optional[float] = None, max_seq_jump: Optional[int] = DEFAULT_MAX_SEQ_JUMP,
           max_events: Any = None) -> dict[str, Any]:
    """The status as a dict (what ``--json`` prints). ``max_seq_jump``: as ``[aggregator] max_seq_jump``,
    the bound on a device status's ``next_seq`` above the highest seq seen (:func:`implausible`)."""
    return report_with_ledger(store, delta, now, windows, late_grace_s, max_seq_jump, max_events)[0]


def report_with_ledger(store: Store, delta: float = 1e-6, now: Optional[float] = None, windows: int = 10,
                       late_grace_s: Optional[float] = None, max_seq_jump: Optional[int] = DEFAULT_MAX_SEQ_JUMP,
                       max_events: Any = None,
                       page: Optional[tuple[int, Optional[int]]] = None) -> tuple[dict[str, Any], Any]:
    """:func:`report` and the privacy ledger it was built from (the fleet page draws its grid from the
    same ledger instead of reading every release again). From the kept summaries (one row per device
    and window: pansketch.host_tools.store.summary); a store written before them (opened read-only,
    so not upgraded yet) is read release by release, as :func:`report_full`. ``page`` (offset, limit):
    only the devices of that page get their whole entry; the others carry what the fleet's totals and
    the fleet page's flags read (statuskept.LITE_KEYS)."""
    kept = summary_mod.present(store)
    if not kept:
        _log.warning("%s keeps no per-device summaries yet (written before them): status reads every release; "
                     "the next aggregator to open it for writing builds them", store.path)
    with no_gc():
        return _report(store, delta, now, windows, late_grace_s, max_seq_jump, max_events, kept, page)


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """The cyclic garbage collector paused while a report is built: its entries are tens of thousands of
    small dicts and lists (none in a cycle), and the collections their allocation set off, each walking
    every live object, were half of the report's CPU at 10^4 devices. Process-wide: another thread's
    report may turn it back on early, which costs only time."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def report_full(store: Store, delta: float = 1e-6, now: Optional[float] = None, windows: int = 10,
                late_grace_s: Optional[float] = None, max_seq_jump: Optional[int] = DEFAULT_MAX_SEQ_JUMP,
                max_events: Any = None, page: Any = None) -> tuple[dict[str, Any], ledger_mod.Ledger]:
    """The report and ledger from every release (the reference the kept summaries must equal, and the
    read of a store without them); every entry whole whatever ``page`` says."""
    return _report(store, delta, now, windows, late_grace_s, max_seq_jump, max_events, False)  # type: ignore[return-value]


def _report(store: Store, delta: float, now: Optional[float], windows: int, late_grace_s: Optional[float],
            max_seq_jump: Optional[int], max_events: Any, kept: bool,
            page: Optional[tuple[int, Optional[int]]] = None) -> tuple[dict[str, Any], Any]:
    now = time.time() if now is None else now
    statuses = store.device_statuses()
    rejected = store.rejected_seqs()
    quar_rows = store.quarantined()
    quarantined: dict[str, dict[int, str]] = defaultdict(dict)
    for qdev, qseq, *_rest in quar_rows:
        quarantined[qdev][int(qseq)] = _rest[4]
    if kept:
        from pansketch.host_tools.query import statuskept

        sums = summary_mod.read_devices(store)
        rows = store.devices()
        whole = None
        if page is not None:  # the names in report order (devices with releases, then refusals only), sorted
            names = [str(r[0]) for r in rows if r[0] in sums and sums[r[0]].n]
            refused = set(rejected) | set(quarantined)
            if refused:
                names += refused - set(names)
            names.sort()  # as the report sorts (not the database's collation); the rows come nearly so
            whole = set(names[page[0]:] if page[1] is None else names[page[0]:page[0] + page[1]])
        devices = statuskept.device_entries(store, delta, rows, sums, statuses, rejected, quarantined,
                                            late_grace_s, max_seq_jump, whole)
        known = {dv["device"] for dv in devices}
        led: Any = statuskept.kept_ledger(store, delta, sums, {str(r[0]): int(r[6]) for r in rows})
        n_releases = sum(s.n for s in sums.values())
    else:
        devices, known, led, n_releases = _full_devices(store, delta, statuses, rejected, quarantined,
                                                        late_grace_s, max_seq_jump)
    _more_devices(devices, known, statuses, rejected, quarantined, late_grace_s, max_seq_jump)
    return _finish(store, devices, led, n_releases, quar_rows, now, windows, max_events), led


def _full_devices(store: Store, delta: float, statuses: dict[str, Any], rejected: dict[str, dict[int, str]],
                  quarantined: dict[str, dict[int, str]], late_grace_s: Optional[float],
                  max_seq_jump: Optional[int]) -> tuple[list[dict[str, Any]], set[str], ledger_mod.Ledger, int]:
    rels = store.releases()
    led = ledger_mod.build(rels, delta)
    by_dev: dict[str, list[StoredRelease]] = defaultdict(list)
    for r in rels:
        by_dev[r.device].append(r)
    devices = []
    known = set()
    for dev, salt, hv, kind, d, w, ep_s, first in store.devices():
        rs = by_dev.get(dev, [])
        if not rs:
            continue
        known.add(dev)
        last = max(rs, key=lambda r: r.received)
        covered = ledger_mod.union((r.elo, r.ehi) for r in rs)
        gaps = ledger_mod.gaps(covered, covered[0][0], covered[-1][1])
        seen: dict[int, int] = defaultdict(int)
        for r in rs:
            seen[r.seq] += 1
        wins = sorted({(r.win_s, r.win) for r in rs})
        modes = sorted({"%s %ds" % (r.mode, r.win_s) + ("/%ds" % r.ep_s if r.mode == "keep" else "") for r in rs})
        budgets = sorted({"%s %s" % (r.mech, ledger_mod._frac(Fraction(*r.budget))) for r in rs})
        g = led.device(dev)
        devices.append({
            "device": dev, "kind": kind, "d": d, "w": w, "salt_id": salt, "mode": ", ".join(modes),
            "budget": ", ".join(budgets), "releases": len(rs), "seq": [min(seen), max(seen)],
            **_delivery(dev, rs, rejected.get(dev, {}), statuses.get(dev), late_grace_s, quarantined.get(dev),
                        max_seq_jump),
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
    return devices, known, led, len(rels)


def _more_devices(devices: list[dict[str, Any]], known: set[str], statuses: dict[str, Any],
                  rejected: dict[str, dict[int, str]], quarantined: dict[str, dict[int, str]],
                  late_grace_s: Optional[float], max_seq_jump: Optional[int]) -> None:
    # devices that released something the host refused or held back, but stored nothing of yet. A status
    # alone makes no fleet member: anyone allowed to publish could otherwise add rows (and their
    # claimed counters) to the fleet without ever sending a release.
    for dev in sorted((set(rejected) | set(quarantined)) - known):
        st = statuses.get(dev)
        doc = st.doc if st is not None else {}
        devices.append({
            "device": dev, "kind": doc.get("kind"), "d": doc.get("d"), "w": doc.get("w"), "salt_id": None,
            "mode": str(doc.get("mode", "")), "budget": "", "releases": 0, "seq": None,
            **_delivery(dev, [], rejected.get(dev, {}), st, late_grace_s, quarantined.get(dev), max_seq_jump),
            "seq_reused": [], "last_received": None, "last_received_unix": None, "last_epoch_end": None,
            "last_epoch_end_unix": None, "windows": 0, "first_window": None, "last_window": None,
            "missing_epochs": [], "missing_epoch_count": 0, "guarantee": None, "guarantee_text": "nothing stored",
            "noise_draws_mean": None, "noise_draws_max": None,
        })
    devices.sort(key=lambda x: x["device"])


_COUNTS = [(k, k + "_count") for k in ("lost", "pending", "rejected", "late", "unknown", "quarantined")]


def _finish(store: Store, devices: list[dict[str, Any]], led: Any, n_releases: int, quar_rows: list[Any],
            now: float, windows: int, max_events: Any) -> dict[str, Any]:
    # bounded influence: devices left out of every answer, and devices out of line with the fleet in a
    # recent window (pansketch.host_tools.query.influence; a prompt to look, `pansketch device exclude` to act)
    excl = exclusions.excluded(store)
    flags = influence.recent_flags(store, windows=max(1, windows), exclude=excl, max_events=max_events)
    per_dev: dict[str, int] = defaultdict(int)
    for fl in flags:
        per_dev[fl.device] += 1
    for dv in devices:
        dv["excluded"] = dv["device"] in excl
        dv["flagged_windows"] = per_dev.get(dv["device"], 0)
    fleet_windows = led.fleet_windows()
    totals = {k: sum([d[c] or 0 for d in devices]) for k, c in _COUNTS}
    totals["backlog"] = sum(d["backlog"] or 0 for d in devices)
    totals["devices_without_status"] = sum(1 for d in devices if d["status"] is None or d["status"]["next_seq"] is None
                                           or d["status_ignored"] is not None)
    totals["statuses_ignored"] = sum(1 for d in devices if d["status_ignored"] is not None)
    out = {
        "db": store.path, "now": iso(now), "releases": n_releases,
        "rejections": max(store.rejection_count(), sum(n for _c, n, _t in store.rejection_counts())),
        "rejections_kept": store.rejection_count(),
        "quarantined": [{"device": r[0], "seq": r[1], "elo": r[2], "ehi": r[3], "part": r[4], "start": iso(r[5]),
                         "code": r[6], "reason": r[7], "count": r[8], "received": iso(r[9]), "last": iso(r[10])}
                        for r in quar_rows[:LIST_LIMIT]],
        "duplicates": store.duplicate_count(), "delivery": totals, "devices": devices,
        "excluded": [{"device": dv, "since": iso(t), "reason": why} for dv, (t, why) in sorted(excl.items())],
        "flags": [fl.to_dict() for fl in flags[:LIST_LIMIT]], "flag_count": len(flags),
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
    return _dur(now - t) + " ago"


def _dur(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 120:
        return "%ds" % s
    if s < 7200:
        return "%dm" % (s // 60)
    if s < 172800:
        return "%dh" % (s // 3600)
    return "%dd" % (s // 86400)


def _seqs_text(seqs: list[int], count: int) -> str:
    shown = seqs[:20]
    more = count - len(shown)
    return seq_ranges(shown) + (" (+%d more)" % more if more > 0 else "")


def print_report(rep: dict[str, Any], now: float, out: Any = sys.stdout) -> None:
    """The report as text. Strings a device chose (state, kind, mode, topics and the reasons that quote
    them) go through textsafe.term: shown escaped, never acting on the terminal."""
    t_ = textsafe.term
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p("pansketch status: %s: %d device(s), %d release(s), %d rejected, %d duplicate deliveries ignored"
      % (rep["db"], len(rep["devices"]), rep["releases"], rep["rejections"], rep["duplicates"]))
    if rep["devices"]:
        p("")
        p("%-20s %-10s %-18s %8s %-13s %-32s %7s %7s  %s" % (
            "DEVICE", "SKETCH", "MODE", "RELEASES", "SEQ", "LAST RELEASE (received)", "WINDOWS", "MISSING",
            "BUDGET / GUARANTEE PER EVENT; NOISE DRAWS PER CELL"))
        for d in rep["devices"]:
            if not d["releases"]:
                p("%-20s %-10s %-18s %8d %-13s %-32s %7s %7s  %s" % (
                    t_(d["device"][:20]), t_("%s %sx%s" % (d["kind"], d["d"], d["w"])) if d["kind"] else "-",
                    t_(d["mode"] or "-")[:18], 0, "-", "-", "-", "-", d["guarantee_text"]))
                continue
            p("%-20s %-10s %-18s %8d %-13s %-32s %7d %7d  %s; %s; noise draws %.3g (max %d)" % (
                t_(d["device"][:20]), "%s %dx%d" % (d["kind"], d["d"], d["w"]), d["mode"][:18], d["releases"],
                "%d-%d" % tuple(d["seq"]),
                "%s (%s)" % (d["last_received"], _ago(d["last_received_unix"], now)), d["windows"],
                d["missing_epoch_count"], d["budget"], d["guarantee_text"], d["noise_draws_mean"],
                d["noise_draws_max"]))
        t = rep["delivery"]
        p("")
        p("delivery: %d lost, %d pending, %d rejected, %s%d late%s; device backlog %d release(s)%s" % (
            t["lost"], t["pending"], t["rejected"],
            "%d quarantined (held back, not merged), " % t["quarantined"] if t["quarantined"] else "", t["late"],
            ", %d unknown (no device status yet)" % t["unknown"] if t["unknown"] else "", t["backlog"],
            "; %d device(s) without a status yet: lost and pending not known for them" % t["devices_without_status"]
            if t["devices_without_status"] else "")
          + ("; %d device status(es) IGNORED: counters beyond what the host has seen" % t["statuses_ignored"]
             if t["statuses_ignored"] else ""))
        p("%-20s %-13s %7s %6s %8s %9s %6s %8s  %s" % ("DEVICE", "SEQ CHECKED", "STORED", "LOST", "PENDING",
                                                        "REJECTED", "LATE", "BACKLOG", "DEVICE STATUS"))
        for d in rep["devices"]:
            st = d["status"]
            if d["status_ignored"] is not None:
                sttxt = "IGNORED (range: seqs the host has seen): %s" % t_(d["status_ignored"])
            elif st is None:
                sttxt = "none yet (range: seqs the host has seen)"
            else:
                sttxt = "%s, next seq %d, received %s" % (
                    t_(st["state"]), st["next_seq"], _ago(st["received_unix"], now)) if st["next_seq"] is not None \
                    else "%s (no seq report yet)" % t_(st["state"])
            lo, hi = d["checked"]
            p("%-20s %-13s %7d %6s %8s %9d %6d %8s  %s" % (
                t_(d["device"][:20]), "%d-%d" % (lo, hi - 1) if hi > lo else "-", d["stored_count"],
                "?" if d["lost_count"] is None else d["lost_count"],
                "?" if d["pending_count"] is None else d["pending_count"],
                d["rejected_count"], d["late_count"], "-" if d["backlog"] is None else d["backlog"], sttxt))
        gaps = [d for d in rep["devices"] if d["missing_epochs"] or d["missing_seq_count"] or d["seq_reused"]
                or d["late_count"] or d["quarantined_count"]]
        if gaps:
            p("")
            p("gaps:")
            for d in gaps:
                for g in d["missing_epochs"][:10]:
                    p("  %s: no release for epochs [%s, %s) (%d epoch(s))" % (d["device"], g["from"], g["until"],
                                                                           g["epochs"]))
                if d["lost_count"]:
                    p("  %s: LOST (not stored, no longer on the device): seq %s" % (
                        d["device"], _seqs_text(d["lost_seqs"], d["lost_count"])))
                if d["unknown_count"]:
                    p("  %s: sequence numbers not received, no device status yet (lost or still on the device): "
                      "%s" % (d["device"], _seqs_text(d["unknown_seqs"], d["unknown_count"])))
                if d["pending_count"]:
                    p("  %s: pending (still on the device, re-sent until stored): seq %s" % (
                        d["device"], _seqs_text(d["pending_seqs"], d["pending_count"])))
                if d["rejected_count"]:
                    codes = d["rejected_codes"]
                    p("  %s: rejected by the host: seq %s (%s)" % (
                        d["device"], _seqs_text(d["rejected_seqs"], d["rejected_count"]),
                        ", ".join(sorted(set(codes.values())))))
                if d["quarantined_count"]:
                    p("  %s: QUARANTINED (valid but held back as likely forgeries, not merged; a device re-sends "
                      "them): seq %s (%s)" % (d["device"], _seqs_text(d["quarantined_seqs"], d["quarantined_count"]),
                                              ", ".join(sorted(set(d["quarantined_codes"].values())))))
                if d["late_count"]:
                    p("  %s: late (received more than the grace after their epochs ended, up to %s): seq %s" % (
                        d["device"], _dur(d["late_max_s"]), _seqs_text(d["late_seqs"], d["late_count"])))
                if d["seq_reused"]:
                    p("  %s: sequence numbers used twice (device state reset?): %s" % (
                        d["device"], ", ".join(map(str, d["seq_reused"]))))
    if rep.get("excluded") or rep.get("flags"):
        p("")
        p("influence (docs/HOST.md \"Flagged devices\"):")
        for e in rep.get("excluded", []):
            p("  %s: EXCLUDED from every answer since %s (%s); `pansketch device include %s` undoes it"
              % (t_(e["device"]), e["since"], t_(e["reason"]), t_(e["device"])))
        for fl in rep.get("flags", []):
            p("  %s: FLAGGED in window %d (%ds): %s" % (t_(fl["device"]), fl["window"], fl["win_s"], fl["reason"]))
        if rep.get("flag_count", 0) > len(rep.get("flags", [])):
            p("  (%d more flagged device-windows)" % (rep["flag_count"] - len(rep["flags"])))
    f = rep["fleet"]
    p("")
    p("privacy ledger (unit: one event; windows hold disjoint events, so these do not add up):")
    p("  fleet, any window: %s" % f["guarantee_text"])
    if f["windows"]:
        p("  last %d of %d window(s):" % (len(f["windows"]), f["window_count"]))
        for wdw in f["windows"]:
            g = wdw["guarantee"]
            gtxt = ", ".join("%s=%s" % (k, g[k]) for k in ("eps", "rho") if k in g)
            p("    window %d (%ss from %s): %d device(s), %s, eps=%.3f at delta=%g" % (
                wdw["window"], wdw["win_s"], wdw["start"], wdw["devices"], gtxt, g["eps_at_delta"], g["delta"]))
    if rep["recent_rejections"]:
        p("")
        p("recent rejections (newest first):")
        for r in rep["recent_rejections"]:
            p("  %s %s (%d bytes): %s: %s" % (r["received"], t_(r["topic"]), r["size"], t_(r["code"]),
                                            t_(r["reason"])))


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("status", help="devices, windows, gaps and the privacy ledger",
                              description="Summarise the release database: devices, last release, windows, "
                                          "missing epochs, budgets and the per-event guarantee.")
    p.add_argument("--config", required=True, metavar="FILE", help="host config TOML")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--csv", action="store_true", help="CSV: a header row, then one row per device with the "
                   "fields of the JSON's devices entries")
    p.add_argument("--windows", type=int, default=10, metavar="N", help="list the last N fleet windows (10)")
    p.add_argument("--late-grace", type=float, metavar="SECONDS",
                   help="a release received more than this after its epochs ended is late "
                        "(default: [status] late_grace_s, else max(epoch length, 300 s))")
    p.add_argument("--limit", type=_count, metavar="N",
                   help="--json, --csv: list N devices (from --offset, in device order); the JSON then says "
                        "how many there are in all (devices_page)")
    p.add_argument("--offset", type=_count, default=0, metavar="K", help="--json, --csv: skip the first K devices")
    p.set_defaults(func=main)


def _count(txt: str) -> int:
    try:
        v = int(txt, 10)
    except ValueError:
        raise argparse.ArgumentTypeError("not an integer: %r" % txt)
    if v < 0:
        raise argparse.ArgumentTypeError("must be at least 0, got %d" % v)
    return v


def page(rep: dict[str, Any], offset: int, limit: Optional[int]) -> dict[str, Any]:
    """``rep`` with its devices list cut to ``limit`` devices from ``offset`` (device order) and a
    ``devices_page`` entry {offset, limit, total}; the fleet totals are those of every device. A
    fleet of 10^4 devices is a status of several MB; a page of it is what a client shows."""
    out = dict(rep)
    devs = rep["devices"]
    out["devices"] = devs[offset:] if limit is None else devs[offset:offset + limit]
    out["devices_page"] = {"offset": offset, "limit": limit, "total": len(devs)}
    return out


def main(args: argparse.Namespace) -> int:
    from pansketch.host_tools import hostconfig

    if args.json and args.csv:
        print("pansketch status: give --json or --csv, not both", file=sys.stderr)
        return 2
    if (args.limit is not None or args.offset) and not (args.json or args.csv):
        print("pansketch status: --limit and --offset page the devices of --json or --csv", file=sys.stderr)
        return 2
    if args.late_grace is not None and not args.late_grace >= 0:
        print("pansketch status: --late-grace must be at least 0", file=sys.stderr)
        return 2
    cfg = hostconfig.load_for_command(args.config)
    if cfg is None:
        return 2
    try:
        store = open_store(cfg.aggregator.db, readonly=True)
    except Exception as exc:
        print("pansketch status: %s" % exc, file=sys.stderr)
        return 1
    now = time.time()
    try:
        grace = args.late_grace if args.late_grace is not None else cfg.status.late_grace_s
        rep = report(store, cfg.query.delta, now, max(0, args.windows), late_grace_s=grace,
                     max_seq_jump=cfg.aggregator.max_seq_jump, max_events=cfg.fleet.max_events)
    finally:
        store.close()
    if (args.limit is not None or args.offset) and (args.json or args.csv):
        rep = page(rep, args.offset, args.limit)
    if args.json:
        print(textsafe.json_text(rep))
    elif args.csv:
        from pansketch.host_tools.query import csvout

        csvout.write(rep["devices"], sys.stdout)
    else:
        print_report(rep, now)
    return 0
