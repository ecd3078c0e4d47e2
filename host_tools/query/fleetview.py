"""What an operator sees of the fleet: one read-only view for the web UI, its JSON API and /metrics.

Built on :func:`pansketch.host_tools.query.status.report` (devices, gaps, ledger) plus the
per-device, per-window ledger grid (:mod:`pansketch.host_tools.store.ledger`) and the
rejection counts by reason. Delivery classes that the status report may
carry per device -- releases *lost*, *pending*, *late*, *rejected* (the
host acknowledgement protocol, docs/FORMAT.md sections 3 and 7) -- are
read defensively: a key that is absent shows as "not reported" (None),
never as 0, so the view lights up once ``status`` provides them.

Every number here is a count of releases or a guarantee, not an estimate
of events, so none carries an interval; estimates live on the item and
top-k pages (pansketch.host_tools.query.series, pansketch.host_tools.query.core).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Optional

from pansketch.host_tools.query import status as status_mod
from pansketch.host_tools.query.core import iso
from pansketch.host_tools.store.sql import SQLStore as Store

DELIVERY = ("lost", "pending", "late", "rejected")


def _count(v: Any) -> Optional[int]:
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, (list, tuple, set, dict)):
        return len(v)
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


# the names a class's count may go by in a device entry, in the order they are read
_NAMES = {k: ("%s_count" % k, "%s_seq_count" % k, "%s_seqs" % k, k) for k in DELIVERY}


def delivery(dev: dict[str, Any]) -> dict[str, Optional[int]]:
    """lost / pending / late / rejected release counts of a status device entry (None: not reported)."""
    out: dict[str, Optional[int]] = {}
    nested: Optional[dict[str, Any]] = None
    for k in DELIVERY:
        names = _NAMES[k]
        val = dev.get(names[0])
        if type(val) is not int:  # a count as status gives it is taken as it is; anything else is looked for
            if nested is None:
                raw = dev.get("delivery")
                nested = raw if isinstance(raw, dict) else {}
            val = _find(names, dev, nested)
        out[k] = val
    return out


def _find(names: tuple[str, ...], dev: dict[str, Any], nested: dict[str, Any]) -> Optional[int]:
    for src in (dev, nested):
        for name in names:
            if name in src:
                val = _count(src[name])
                if val is not None:
                    return val
    return None


def _seqs(dev: dict[str, Any], k: str, limit: int = 20) -> list[int]:
    for name in ("%s_seqs" % k, k):
        v = dev.get(name)
        if isinstance(v, (list, tuple)):
            return [int(x) for x in v[:limit] if isinstance(x, int) and not isinstance(x, bool)]
    nested = dev.get("delivery")
    if isinstance(nested, dict) and k in nested and isinstance(nested[k], (list, tuple)):
        return [int(x) for x in nested[k][:limit] if isinstance(x, int) and not isinstance(x, bool)]
    return []


def _flags(d: dict[str, Any], dv: dict[str, Optional[int]], window_flags: list[dict[str, Any]],
           behind: int) -> list[str]:
    """What the page says needs attention about device entry ``d`` (``dv``: its delivery(); ``window_flags``:
    its flagged windows; ``behind``: windows the fleet released since its last)."""
    flags: list[str] = []
    if d.get("missing_seq_count"):
        flags.append("%d release(s) missing (sequence gaps)" % d["missing_seq_count"])
    if d.get("missing_epoch_count"):
        flags.append("%d epoch(s) without a release" % d["missing_epoch_count"])
    for k in DELIVERY:
        n = dv[k]
        if n:
            flags.append("%d %s" % (n, k))
    if d.get("seq_reused"):
        flags.append("sequence numbers used twice (state reset?)")
    if d.get("excluded"):
        flags.append("EXCLUDED from every answer (pansketch device include %s undoes it)" % d["device"])
    if d.get("flagged_windows"):
        flags.append("out of line with the fleet in %d recent window(s)%s" % (
            d["flagged_windows"], ": window %d: %s" % (window_flags[0]["window"], window_flags[0]["reason"])
            if window_flags else ""))
    if behind > 0:
        flags.append("quiet: no release for the last %d window(s) the fleet released" % behind)
    return flags


def fleet(store: Store, delta: float = 1e-6, now: Optional[float] = None, windows: int = 12,
          late_grace_s: Optional[float] = None,
          max_seq_jump: Optional[int] = status_mod.DEFAULT_MAX_SEQ_JUMP,
          offset: int = 0, limit: Optional[int] = None) -> dict[str, Any]:
    """The fleet page as a dict: status report + flags + ledger grid + rejections by reason.

    ``late_grace_s``: as ``[status] late_grace_s`` (None: max(epoch length, 300 s)). ``offset``,
    ``limit``: the devices listed (device order; ``devices_page`` says how many there are in all);
    the fleet's figures (counts, flagged devices, totals) are those of every device."""
    with status_mod.no_gc():  # as the status report it is built on (status.no_gc)
        return _fleet(store, delta, now, windows, late_grace_s, max_seq_jump, offset, limit)


def _fleet(store: Store, delta: float, now: Optional[float], windows: int, late_grace_s: Optional[float],
           max_seq_jump: Optional[int], offset: int, limit: Optional[int]) -> dict[str, Any]:
    now = time.time() if now is None else now
    # the report's own ledger: reading and building it a second time doubled the page's cost
    rep, led = status_mod.report_with_ledger(store, delta, now, windows, late_grace_s=late_grace_s,
                                             max_seq_jump=max_seq_jump,
                                             page=(offset, limit) if limit is not None or offset else None)
    fw = led.fleet_windows()
    cols = [(ws, wn) for ws, wn, _n, _g in fw[-max(1, windows):]]
    last_win: dict[int, int] = {}
    for ws, wn, _n, _g in fw:
        last_win[ws] = max(last_win.get(ws, wn), wn)
    every = rep["devices"]
    listed = every[offset:] if limit is None else every[offset:offset + limit]
    # the grid's entries of the listed devices only (the kept ledger reads those releases alone)
    per_dev = led.entries([d["device"] for d in listed], cols)
    spans = led.spans()
    flags_of: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for f in rep.get("flags", []):
        flags_of[f["device"]].append(f)

    rows = []  # the listed devices' rows; every device counts in the flags and delivery columns
    flagged: list[str] = []
    reported = dict.fromkeys(DELIVERY, False)
    shown = {id(d) for d in listed}
    for d in every:
        name = d["device"]
        dv = delivery(d)
        for k, n in dv.items():
            if n is not None:
                reported[k] = True
        # quiet: other devices with the same window length released after this device's last window
        last, first = spans.get(name, (None, {}))
        behind = 0 if last is None else last_win.get(last[0], last[1]) - last[1]
        flags = _flags(d, dv, flags_of.get(name, []), behind)
        if flags:
            flagged.append(name)
        if id(d) not in shown:  # counted in the fleet's figures, not listed: no grid row
            continue
        ents = per_dev.get(name, {})
        cells = []
        for ws, wn in cols:
            e = ents.get((ws, wn))
            if e is not None:
                miss = sum(b - a for a, b in e.missing)
                cells.append({"win_s": ws, "window": wn, "state": "partial" if miss else "ok",
                              "releases": e.releases, "missing_epochs": miss, "guarantee": e.guarantee.as_dict(),
                              "guarantee_text": e.guarantee.text()})
            elif ws in first and wn > first[ws]:
                cells.append({"win_s": ws, "window": wn, "state": "missing"})
            else:
                cells.append({"win_s": ws, "window": wn, "state": "none"})
        rows.append(dict(d, delivery=dv, delivery_seqs={k: _seqs(d, k) for k in DELIVERY},
                         flags=flags, flagged=bool(flags), windows_behind=behind, ledger=cells))
    by_code = [{"code": c, "count": int(n), "last": iso(t), "last_unix": t} for c, n, t in store.rejection_counts()]
    rep = dict(rep)
    if limit is not None or offset:
        rep["devices_page"] = {"offset": offset, "limit": limit, "total": len(every)}
    rep.update({
        "now_unix": now, "devices": rows, "delivery_reported": reported,
        "flagged": flagged,
        "rejections_by_code": by_code,
        "ledger_columns": [{"win_s": ws, "window": wn, "start": iso(ws * wn)} for ws, wn in cols],
    })
    return rep
