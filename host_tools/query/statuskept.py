"""``pansketch status``'s devices from the kept summaries: one row per device instead of its releases.

The same entries as :func:`pansketch.host_tools.query.status.report_full` computes from every
release (the tests compare the two byte for byte), read from ``device_summaries``
(pansketch.host_tools.store.summary): seqs as runs, so delivery classification
works on runs where the full read has the sorted list of stored seqs; covered epochs as merged
ranges; guarantees as exact fractions. Late releases at the default grace are kept; another grace
reads the releases that late (``summary.late_rows``).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any, Optional

from pansketch.host_tools.query import delivery
from pansketch.host_tools.query.core import iso
from pansketch.host_tools.store import ledger as ledger_mod
from pansketch.host_tools.store import summary as summary_mod
from pansketch.host_tools.store.summary import DeviceSummary, runs_add, runs_has


class RunSet:
    """Membership in sorted inclusive runs (what ``q in stored`` asks of a set of seqs)."""

    def __init__(self, runs: list[list[int]]) -> None:
        self.runs = runs

    def __contains__(self, q: object) -> bool:
        return isinstance(q, int) and runs_has(self.runs, q)


def _absent(lo: int, hi: int, have: list[list[int]], limit: int) -> tuple[list[int], int]:
    """status._absent with ``have`` as sorted inclusive runs: seqs in [lo, hi) not in it (first ``limit``, count)."""
    if hi <= lo:
        return [], 0
    inside = sum(max(0, min(b + 1, hi) - max(a, lo)) for a, b in have)
    if inside == hi - lo:  # none absent (a device that lost nothing): no list to walk for
        return [], 0
    out: list[int] = []
    x = lo
    for a, b in have + [[hi, hi]]:
        if b < x:
            continue
        while x < min(a, hi) and len(out) < limit:
            out.append(x)
            x += 1
        if len(out) >= limit or a >= hi:
            break
        x = b + 1
    return out, (hi - lo) - inside


def classify(stored: list[list[int]], rejected: dict[int, str], st: Any, limit: int,
             max_jump: Optional[int]) -> dict[str, Any]:
    """status.classify with the stored seqs as runs."""

    rej = sorted(q for q in rejected if not runs_has(stored, q)) if rejected else []
    have = stored
    if rej:
        have = [list(r) for r in stored]
        for q in rej:
            runs_add(have, q)
    head = {"stored_count": sum(b - a + 1 for a, b in stored), "rejected_seqs": rej[:limit],
            "rejected_count": len(rej), "rejected_codes": {str(q): rejected[q] for q in rej[:limit]}}
    return delivery.by_status(head, have, have[-1][1] + 1 if have else 0, st, limit, max_jump, _absent)


class _Guarantees:
    """as_dict / text of each distinct (eps, rho) once (a fleet's devices share a few)."""

    def __init__(self, delta: float) -> None:
        self.delta = delta
        self.seen: dict[tuple[Optional[str], Optional[str]], tuple[dict[str, Any], str]] = {}

    def get(self, eps: Optional[str], rho: Optional[str]) -> tuple[dict[str, Any], str]:
        hit = self.seen.get((eps, rho))
        if hit is None:
            g = ledger_mod.Guarantee(eps=Fraction(eps) if eps else None, rho=Fraction(rho) if rho else None,
                                     delta=self.delta)
            hit = self.seen[(eps, rho)] = (g.as_dict(), g.text())
        return dict(hit[0]), hit[1]


def _delivery(s: DeviceSummary, rejected: dict[int, str], quarantined: Optional[dict[int, str]], st: Any,
              limit: int, max_jump: Optional[int], late: tuple[list[int], int, float]) -> dict[str, Any]:
    """status._delivery from a device's summary (the same keys in the same order); ``late``: its late
    seqs (the first ``limit``), their number and the largest lateness."""
    dl = classify(s.seqs, rejected, st, limit, max_jump)
    if quarantined:
        delivery._quarantine(dl, quarantined, RunSet(s.seqs))  # type: ignore[arg-type]
    else:  # what _quarantine gives without quarantined seqs
        dl.update(quarantined_seqs=[], quarantined_count=0, quarantined_codes={})
    dl.update(late_seqs=late[0], late_count=late[1], late_max_s=late[2],
              backlog=st.pending if st is not None and dl["status_ignored"] is None else None,
              status=delivery._status_dict(st, 0) if st is not None else None)
    ms = dl["lost_seqs"] + dl["pending_seqs"] + dl["unknown_seqs"] + dl["rejected_seqs"]
    dl["missing_seqs"] = sorted(ms)[:limit] if ms else []
    dl["missing_seq_count"] = ((dl["lost_count"] or 0) + (dl["pending_count"] or 0) + dl["unknown_count"]
                               + dl["rejected_count"])
    return dl


def _lite(dev: str, s: DeviceSummary, st: Any, limit: int, max_jump: Optional[int], late_n: int,
          late_seqs: list[int], gaps: list[tuple[int, int]]) -> dict[str, Any]:
    """The :data:`LITE_KEYS` of the entry of a device without rejected or quarantined seqs: the values
    :func:`_delivery` gives it (tests/test_status_kept.py checks they are the same), without the rest of
    its entry. Nearly every device of a fleet is one of these, and the fleet page lists a few of them."""
    dl = delivery.by_status({}, s.seqs, s.seqs[-1][1] + 1, st, limit, max_jump, _absent)
    ignored = dl["status_ignored"]
    return {"device": dev, "lost_count": dl["lost_count"], "pending_count": dl["pending_count"], "rejected_count": 0,
            "late_count": late_n, "unknown_count": dl["unknown_count"], "quarantined_count": 0,
            "lost_seqs": dl["lost_seqs"], "pending_seqs": dl["pending_seqs"], "rejected_seqs": [], "late_seqs": late_seqs,
            "backlog": st.pending if st is not None and ignored is None else None,
            "status": delivery._status_dict(st, 0) if st is not None else None, "status_ignored": ignored,
            "missing_seq_count": (dl["lost_count"] or 0) + (dl["pending_count"] or 0) + dl["unknown_count"],
            "missing_epoch_count": sum(b - a for a, b in gaps), "seq_reused": s.reused[:20]}


# what a device entry outside the listed page keeps: the fleet's delivery totals (status._finish), and
# what the fleet page's flags and delivery columns read of it (fleetview: delivery(), the flags)
LITE_KEYS = ("device", "lost_count", "pending_count", "rejected_count", "late_count", "unknown_count",
             "quarantined_count", "lost_seqs", "pending_seqs", "rejected_seqs", "late_seqs", "backlog", "status",
             "status_ignored", "missing_seq_count", "missing_epoch_count", "seq_reused")


def device_entries(store: Any, delta: float, devices: list[tuple[Any, ...]], sums: dict[str, DeviceSummary],
                   statuses: dict[str, Any], rejected: dict[str, dict[int, str]],
                   quarantined: dict[str, dict[int, str]], grace: Optional[float],
                   max_jump: Optional[int], whole: Optional[set[str]] = None) -> list[dict[str, Any]]:
    """The status entries of the devices with releases (rows of store.devices(), in that order).
    ``whole``: the devices that get their whole entry (None: all); the others get :data:`LITE_KEYS`."""

    late_other: dict[str, list[tuple[int, float]]] = {}
    if grace is not None:  # not the grace the summaries keep: the releases that late
        for dev, seq, late in summary_mod.late_rows(store, float(grace)):
            late_other.setdefault(dev, []).append((seq, late))
    gs = _Guarantees(delta)
    out = []
    limit = delivery.LIST_LIMIT
    memo: dict[Any, Optional[str]] = {}  # iso() of times many devices share (epoch ends)

    def iso_m(t: Any) -> Optional[str]:
        r = memo.get(t)
        if r is None:
            r = memo[t] = iso(t)
        return r

    for dev, salt, _hv, kind, d, w, ep_s, _first in devices:
        s = sums.get(dev)
        if s is None or not s.n:
            continue
        st = statuses.get(dev)
        rej, quar = rejected.get(dev), quarantined.get(dev)
        if grace is None:
            late_seqs, late_n = s.late_seqs[:limit], s.late_n
        else:
            mine = sorted(late_other.get(dev, []), key=lambda t: t[0])
            late_seqs, late_n = [q for q, _l in mine[:limit]], len(mine)
        cov = s.cov
        gaps = [] if len(cov) == 1 else ledger_mod.gaps([(a, b) for a, b in cov], cov[0][0], cov[-1][1])
        if whole is not None and dev not in whole and not rej and not quar:
            out.append(_lite(dev, s, st, limit, max_jump, late_n, late_seqs, gaps))
            continue
        if grace is None:
            late_max = round(s.late_max, 1) if s.late_n and s.late_max is not None else 0.0
        else:
            late_max = round(max((lt for _q, lt in mine), default=0.0), 1)
        dl = _delivery(s, rej or {}, quar, st, limit, max_jump, (late_seqs, late_n, late_max))
        if whole is not None and dev not in whole:  # off the page, with refused seqs: the whole figures, cut
            dl.update(device=dev, seq_reused=s.reused[:20], missing_epoch_count=sum(b - a for a, b in gaps))
            out.append({k: dl[k] for k in LITE_KEYS})
            continue
        wins = s.wins
        if len(wins) == 1:  # one window length (the usual case): its runs alone
            runs = next(iter(wins.values()))
            w0, w1 = runs[0][0], runs[-1][1]
            nwin = runs[0][1] - runs[0][0] + 1 if len(runs) == 1 else sum(b - a + 1 for a, b, _l in runs)
        else:
            (_ws0, w0), (_ws1, w1) = s.window_keys()
            nwin = s.window_count()
        g, gtext = gs.get(s.eps, s.rho)
        out.append({
            "device": dev, "kind": kind, "d": d, "w": w, "salt_id": salt, "mode": ", ".join(s.modes),
            "budget": ", ".join(s.budgets), "releases": s.n, "seq": [s.seqs[0][0], s.seqs[-1][1]],
            **dl,
            "seq_reused": s.reused[:20],
            "last_received": iso(s.last_rx), "last_received_unix": s.last_rx,
            "last_epoch_end": iso_m(s.last_t1), "last_epoch_end_unix": s.last_t1,
            "windows": nwin, "first_window": w0, "last_window": w1,
            "missing_epochs": [{"from": iso_m(a * ep_s), "until": iso_m(b * ep_s), "epochs": b - a,
                                "elo": a, "ehi": b} for a, b in gaps[:50]],
            "missing_epoch_count": sum(b - a for a, b in gaps) if gaps else 0,
            "guarantee": g, "guarantee_text": gtext,
            "noise_draws_mean": round(s.nz_sum / s.n, 3), "noise_draws_max": s.nz_max,
        })
    return out


def kept_ledger(store: Any, delta: float, sums: dict[str, DeviceSummary], ep_s: dict[str, int]) -> ledger_mod.KeptLedger:
    spans: dict[str, tuple[Optional[tuple[int, int]], dict[int, int]]] = {}
    for dev, s in sums.items():
        if len(s.wins) == 1:  # one window length (the usual case): its first and last window
            ((key, runs),) = s.wins.items()
            if runs:
                spans[dev] = ((int(key), runs[-1][1]), {int(key): runs[0][0]})
            continue
        fl = s.first_last()
        if fl:
            last = max((ws, b) for ws, (_a, b) in fl.items())
            spans[dev] = (last, {ws: a for ws, (a, _b) in fl.items()})
    return ledger_mod.KeptLedger(delta, store, summary_mod.read_windows(sums), spans, ep_s)
