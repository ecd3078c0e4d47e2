"""Detection within the bound: flag a device whose contribution to a window is out of line with the fleet's.

pansketch.host_tools.store.bounds caps what one release may hold (``max_events`` events
plus noise). Inside that cap a stolen device can still plant an item the rest
of the fleet never saw, or cancel the fleet's top item. This module looks, for
every window and merge group with at least :data:`MIN_DEVICES` devices, at each
device's counters next to the sum of the others' (docs/HOST.md "Flagged
devices"):

* the device's expected share: ``a`` = the median, over the cells the other
  devices clearly fill (``|Y_-i| > 4 sd`` of their noise), of ``Y_i / Y_-i``; a
  busy device has a large ``a``, a quiet one a small one, so activity alone
  never flags (the model is "the device sees the fleet's item mix at its own
  rate");
* per cell the residual ``e = Y_i - a Y_-i`` against what noise and sampling
  allow: the noise of the device and ``a`` times that of the others, each a
  Chernoff bound from the exact noise distribution at ``NOISE_ALPHA`` per cell,
  plus ``Z`` standard deviations of the sampling spread
  ``sqrt(phi a (1 + a) |Y_-i|)`` (a Poisson count and its estimate from the
  others), ``phi`` >= 1 the overdispersion measured robustly (median) over the
  device's own cells, so that a fleet whose devices differ a little more
  than Poisson is not flagged wholesale;
* a device is flagged in the window if some cell is beyond that, and the
  flag says where (level, row, column), how much (the residual, in events,
  and the device's share of the cell) and how far (in allowances).

A planted item (a cell the others leave at noise level, holding the device's
mass) and a cancelled one (a negative residual of the item's fleet size) are
both thousands of allowances out; honest devices, also a busy one with 20x
the others' events, stay within (false flags measured in
tests/test_influence.py on the demo fleet's parameters and on a heterogeneous
fleet: 0 of the honest device-windows there, the bound <= 1 %).
Devices that genuinely see items nobody else sees (a sensor in a place of its
own) are flagged too: a flag is a prompt to look (``pansketch status``, the
dashboard), not a verdict; ``pansketch device exclude`` is the operator's.

Kind dbits releases one count per level (no item structure to compare): its
devices are judged by pansketch.host_tools.query.dbitsflag (levels no number of
distinct items explains, an estimate beyond the contribution limit, or beyond
100x the others' median), into the same :class:`Flag`. Tree-mode devices are compared by the
nodes that cover the window (pansketch.host_tools.query.core.cover).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from pansketch.host_tools.query.estimators import chernoff_tail_bound
from pansketch.host_tools.query.flag import Flag  # noqa: F401  (the record every flag test returns; re-exported)
from pansketch.host_tools.query.merge import NoiseTerm

MIN_DEVICES = 3  # fewer: no "rest of the fleet" to compare with
NOISE_ALPHA = 1e-7  # per cell: the noise allowance's one-sided tail (x 2 sides x cells: ~1e-3 per device-window)
Z = 6.0  # sampling allowance in standard deviations (Gaussian tail 2e-9 per cell)
SIGNAL_SD = 4.0  # cells the others fill: |Y_-i| above this many noise sd
MIN_SIGNAL_CELLS = 8  # fewer such cells: the share is taken as 0 (the device is compared with noise alone)
PHI_MAX = 50.0
GREEDY_STEPS = 8  # compare: devices set aside one at a time (the worst first) ...
BATCH_PASSES = 4  # ... then all those out of line at once, this many times at most
RECENT_WINDOWS = 48  # status, dashboard and metrics look at the latest this many windows per window length


def _terms(rels: Sequence[Any]) -> list[NoiseTerm]:
    out: dict[tuple[str, int, int], int] = {}
    for r in rels:
        for k, c in (((r.mech, r.nint[0], r.nint[1]), r.nz - 1), ((r.mech, r.nout[0], r.nout[1]), 1)):
            out[k] = out.get(k, 0) + c
    return [NoiseTerm(m, n, d, c) for (m, n, d), c in sorted(out.items()) if c]


def _var(terms: Sequence[NoiseTerm]) -> float:
    return float(sum(t.variance() for t in terms))


_TAIL: dict[tuple[Any, ...], float] = {}


def _tail(terms: Sequence[NoiseTerm], delta: float) -> float:
    key = (tuple((t.mech, t.num, t.den, t.count) for t in terms), delta)
    v = _TAIL.get(key)
    if v is None:
        if len(_TAIL) > 4096:
            _TAIL.clear()
        v = _TAIL[key] = chernoff_tail_bound(list(terms), delta)
    return v


def compare(devices: dict[str, tuple[np.ndarray, list[NoiseTerm]]], d: int, kind: str = "cs", win_s: int = 0,
            win: int = 0) -> list[Flag]:
    """The flags of one window and merge group: ``devices`` maps a device to its summed counters
    (levels * d rows, w columns, int64) and its noise terms per cell.

    Greedy, so that one forged device does not get honest ones flagged (its planted cell would
    otherwise be in every other device's "rest of the fleet"): the device furthest out of line is set
    aside and the others compared again without it, while someone is out of line; each device set
    aside is then judged against the devices that were not. After GREEDY_STEPS devices set aside one
    by one, every device out of line in a comparison is set aside at once (at most BATCH_PASSES
    times, then the devices left are judged among themselves): one at a time, a window where most of
    1,000 devices are out of line took ~1,000 comparisons of 1,000 devices (minutes per window in the
    soak benchmark's random counters), now at most GREEDY_STEPS + BATCH_PASSES.
    """
    if len(devices) < MIN_DEVICES:
        return []
    aside: list[str] = []
    left: list[Flag] = []  # flags of devices still in the comparison when the passes ran out
    steps = 0
    while len(devices) - len(aside) >= MIN_DEVICES:
        clean = {k: v for k, v in devices.items() if k not in aside}
        flags = _judge(clean, d, kind, win_s, win)
        if not flags:
            break
        if steps >= GREEDY_STEPS + BATCH_PASSES:
            left = flags
            break
        if steps < GREEDY_STEPS:
            aside.append(max(flags, key=lambda f: f.score).device)
        else:
            aside += sorted(f.device for f in flags)
        steps += 1
    out = list(left)
    clean = {k: v for k, v in devices.items() if k not in aside}
    for dev in aside:
        out += [f for f in _judge(dict(clean, **{dev: devices[dev]}), d, kind, win_s, win, only=dev)]
    return sorted(out, key=lambda f: f.device)


def _judge(devices: dict[str, tuple[np.ndarray, list[NoiseTerm]]], d: int, kind: str, win_s: int, win: int,
           only: Optional[str] = None) -> list[Flag]:
    """Each device (or ``only``) against the sum of the others in ``devices``: its flag if out of line."""
    names = sorted(devices)
    total = np.zeros_like(devices[names[0]][0], dtype=np.int64)
    for n in names:
        total += devices[n][0]
    all_terms: dict[tuple[str, int, int], int] = {}
    for n in names:
        for t in devices[n][1]:
            all_terms[(t.mech, t.num, t.den)] = all_terms.get((t.mech, t.num, t.den), 0) + t.count
    out = []
    for n in names if only is None else [only]:
        y, terms = devices[n]
        y = y.astype(np.float64)
        rest = total - devices[n][0]
        others = [NoiseTerm(m, a, b, c - sum(t.count for t in terms if (t.mech, t.num, t.den) == (m, a, b)))
                  for (m, a, b), c in sorted(all_terms.items())]
        others = [t for t in others if t.count > 0]
        v_i, v_o = _var(terms), _var(others)
        r = rest.astype(np.float64)
        sig = np.abs(r) > SIGNAL_SD * math.sqrt(v_o) + 3.0
        a = float(np.median(y[sig] / r[sig])) if int(sig.sum()) >= MIN_SIGNAL_CELLS else 0.0
        a = max(a, 0.0)  # a negative share is no honest device's: it is compared as if it had none
        e = y - a * r
        samp = a * (1.0 + a) * np.abs(r)
        model = samp + v_i + a * a * v_o
        phi = 1.0
        if int(sig.sum()) >= MIN_SIGNAL_CELLS:
            phi = float(np.median((e[sig] ** 2) / model[sig]) / 0.4549)  # median of chi^2_1
            phi = min(max(phi, 1.0), PHI_MAX)
        cells = y.size
        delta = NOISE_ALPHA / cells
        noise = _tail(terms, delta) + (a * _tail(others, delta) if others and a > 0 else 0.0)
        allow = noise + Z * np.sqrt(phi * samp) + 1.0
        ratio = np.abs(e) / allow
        j = int(np.argmax(ratio))
        score = float(ratio.flat[j])
        if score <= 1.0:
            continue
        row, col = divmod(j, y.shape[1])
        level, rr = divmod(row, d)
        tot = float(total.flat[j])
        share = float(y.flat[j]) / tot if tot else math.inf
        resid = float(e.flat[j])
        what = ("holds %.0f more than its share of the fleet predicts" % resid if resid > 0
                else "holds %.0f less than its share of the fleet predicts (cancels the others' count)" % -resid)
        where = ("level %d row %d column %d" % (level, rr, col)) if kind in ("dcs", "strhh") else (
            "row %d column %d" % (rr, col))
        out.append(Flag(n, win_s, win, kind, score, (level, rr, col), resid, share, int((ratio > 1.0).sum()),
                        "%s %s (%.0fx the allowance; its share of the fleet elsewhere %.3f; the fleet's cell %.0f)"
                        % (where, what, score, a, tot)))
    return out


def window_flags(store: Any, win_s: int, win: int, exclude: Iterable[str] = (),
                 max_events: Any = None) -> list[Flag]:
    """Flags of one window (every merge group in it), excluded devices left out of the comparison.
    ``max_events(kind)``: the fleet's contribution limit (default: [fleet]'s default), for the
    window total of keep-mode devices."""
    from pansketch.host_tools.hostconfig import DEFAULT_MAX_EVENTS
    from pansketch.host_tools.query import dbitsflag
    from pansketch.host_tools.store import bounds

    if max_events is None:
        max_events = lambda _k: DEFAULT_MAX_EVENTS  # noqa: E731
    from pansketch.host_tools.query.core import cover

    ex = set(exclude)
    rels = [r for r in store.releases(window=win, win_s=win_s, with_payload=True)
            if r.device not in ex and r.payload]
    groups: dict[tuple[Any, ...], dict[str, list[Any]]] = {}
    for r in rels:
        groups.setdefault(r.group, {}).setdefault(r.device, []).append(r)
    out: list[Flag] = []
    for g, by_dev in sorted(groups.items(), key=lambda kv: repr(kv[0])):
        if g[0] == "dbits":  # one count per level, no item mix: pansketch.host_tools.query.dbitsflag's tests
            out += dbitsflag.compare(by_dev, max_events("dbits"), win_s, win)
            continue
        devs: dict[str, tuple[np.ndarray, list[NoiseTerm]]] = {}
        for dev, rs in by_dev.items():
            # keep mode: each epoch release passed the bound alone; their sum must too (the limit is per window)
            if rs[0].mode == "keep" and len(rs) > 1:
                over = bounds.check_window(rs, max_events(rs[0].kind))
                if over is not None:
                    out.append(Flag(dev, win_s, win, g[0], math.inf, (0, 0, 0), 0.0, math.nan, 0,
                                    "over the contribution limit in this window: " + over.reason))
            if rs[0].mode == "tree":  # overlapping nodes: the fewest that cover the window
                nodes = {(r.elo, r.ehi): r for r in rs}
                used, _ = cover(nodes, min(r.elo for r in rs), max(r.ehi for r in rs))
                rs = [nodes[k] for k in used]
            acc = np.zeros(rs[0].shape, dtype=np.int64)
            for r in rs:
                acc += r.counters()
            devs[dev] = (acc, _terms(rs))
        out += compare(devs, rs[0].d, g[0], win_s, win)
    return out


def _setting(exclude: Iterable[str], max_events: Any) -> str:
    """What a window's flags depend on besides its releases: the excluded devices and the limits."""
    import json

    from pansketch.host_tools.hostconfig import DEFAULT_MAX_EVENTS, LIMIT_KINDS

    me = max_events if max_events is not None else (lambda _k: DEFAULT_MAX_EVENTS)
    return json.dumps({"exclude": sorted(exclude), "max_events": [int(me(k)) for k in LIMIT_KINDS]})


def _flag_doc(f: Flag) -> str:
    import json

    return json.dumps([f.device, f.win_s, f.win, f.kind, f.score, list(f.cell), f.residual, f.share, f.cells, f.reason])


def _doc_flag(doc: str) -> Flag:
    import json

    d = json.loads(doc)
    return Flag(str(d[0]), int(d[1]), int(d[2]), str(d[3]), float(d[4]), (int(d[5][0]), int(d[5][1]), int(d[5][2])),
                float(d[6]), float(d[7]), int(d[8]), str(d[9]))


def has_stored(store: Any) -> bool:
    """The store keeps flags per window (schema ``flag_windows``: a file opened for writing by this version)."""
    hit = store.__dict__.get("_has_flag_windows")
    if hit is None:
        try:
            hit = store._meta("flag_windows") == "1"
        except Exception:  # an older file's read-only open: no such table
            hit = False
        store.__dict__["_has_flag_windows"] = hit
    return bool(hit)


def _latest(pairs: Iterable[tuple[Any, Any]], windows: int) -> list[tuple[int, int]]:
    """The latest ``windows`` window ids of each window length, in (win_s, win) order."""
    per: dict[int, list[int]] = {}
    for ws, w in sorted(((int(a), int(b)) for a, b in pairs), key=lambda t: (t[0], -t[1])):
        lst = per.setdefault(ws, [])
        if len(lst) < windows:
            lst.append(w)
    return [(ws, w) for ws in sorted(per) for w in sorted(per[ws])]


def _windows(store: Any, windows: int) -> tuple[list[tuple[int, int]], dict[tuple[int, int], tuple[int, int, str]]]:
    """The recent windows, and per window its (gen, done, setting) where the store keeps flags."""
    if not has_stored(store):
        return _latest(store._q("SELECT DISTINCT win_s, win FROM releases"), windows), {}
    rows = store._q(store.flag_windows_sql())
    state = {(int(ws), int(w)): (int(g), int(dn), str(st)) for ws, w, g, dn, st in rows if int(g) > 0}
    return _latest(state, windows), state


def _stored_flags(store: Any, wins: list[tuple[int, int]]) -> dict[tuple[int, int], list[Flag]]:
    out: dict[tuple[int, int], list[Flag]] = {k: [] for k in wins}
    per: dict[int, list[int]] = {}
    for ws, w in wins:
        per.setdefault(ws, []).append(w)
    for ws, ids in per.items():
        for w, doc in store._q("SELECT win, doc FROM flags WHERE win_s = ? AND win >= ? AND win <= ? ORDER BY win, pos",
                               (ws, min(ids), max(ids))):
            if (ws, int(w)) in out:
                out[(ws, int(w))].append(_doc_flag(str(doc)))
    return out


def recent_flags(store: Any, windows: int = RECENT_WINDOWS, exclude: Optional[Iterable[str]] = None,
                 max_events: Any = None) -> list[Flag]:
    """Flags of the latest ``windows`` windows of each window length (excluded devices are not compared).

    A window whose flags the store keeps (:func:`refresh`, schema ``flag_windows``) for its current
    releases and this setting is read from there; the others are computed from the releases' payloads
    (the same :func:`window_flags`: the answer is the same either way, tests/test_flag_store.py)."""
    from pansketch.host_tools.store import exclusions

    ex = set(exclusions.excluded(store)) if exclude is None else set(exclude)
    wins, state = _windows(store, windows)
    want = _setting(ex, max_events)
    fresh = [k for k in wins if k in state and state[k][0] == state[k][1] and state[k][2] == want]
    kept = _stored_flags(store, fresh) if fresh else {}
    out: list[Flag] = []
    for ws, w in wins:
        out += kept[(ws, w)] if (ws, w) in kept else window_flags(store, ws, w, ex, max_events)
    return out


def refresh(store: Any, windows: int = RECENT_WINDOWS, max_events: Any = None,
            cpu_budget_s: Optional[float] = None) -> int:
    """Compute and keep the flags of the latest ``windows`` windows whose releases (or exclusions, or
    limits) changed since they were kept (a writable store of this version); returns how many windows
    were computed. Each window's payloads are read once per change, not once per ``status`` call: the
    aggregator's flag scanner (pansketch.host_tools.metrics.FlagScanner) calls this. A release stored
    while a window is computed bumps its ``gen`` past the ``done`` kept here: computed again next time.
    ``cpu_budget_s``: the newest windows first, and no further window once this much CPU time
    went into this call (this thread's); the rest wait for the next call (readers compute them meanwhile)."""
    import time
    from pansketch.host_tools.store import exclusions

    if not has_stored(store):
        return 0
    ex = set(exclusions.excluded(store))
    want = _setting(ex, max_events)
    wins, state = _windows(store, windows)
    n = 0
    t0 = time.thread_time()
    for k in sorted(wins, key=lambda k: (-k[1] * k[0], k[0])):  # newest (by start time) first
        if cpu_budget_s is not None and n and time.thread_time() - t0 > cpu_budget_s:  # (one at least)
            break
        gen, done, setting = state[k]
        if gen == done and setting == want:
            continue
        flags = window_flags(store, k[0], k[1], ex, max_events)

        def tx(cur: Any, k: tuple[int, int] = k, gen: int = gen, flags: list[Flag] = flags) -> None:
            store._x(cur, "DELETE FROM flags WHERE win_s = ? AND win = ?", k)
            if flags:
                cur.executemany(store._sql("INSERT INTO flags (win_s, win, pos, device, doc) VALUES (?, ?, ?, ?, ?)"),
                                [(k[0], k[1], i, f.device, _flag_doc(f)) for i, f in enumerate(flags)])
            store._x(cur, "UPDATE flag_windows SET done = ?, setting = ? WHERE win_s = ? AND win = ?",
                     (gen, want, k[0], k[1]))

        store._exec_tx(tx)
        n += 1
    return n


def flag_state(store: Any) -> Any:
    """Changes whenever some window's flags may: the store's change counter (moved by every write
    transaction), else the windows' generations where the store keeps them (a read of one small
    table), else the store's snapshot (every release key)."""
    ver = store.change_count()
    if ver is not None:
        return ver
    if has_stored(store):
        return tuple(sorted(r[:3] for r in store._q(store.flag_windows_sql())))
    return store.snapshot()


_CACHED: dict[str, tuple[Any, list[Flag]]] = {}


def cached_flags(store: Any) -> list[Flag]:
    """:func:`recent_flags` of the store (excluded devices left out), remembered per store state
    (:func:`flag_state` and the exclusions): the dashboard shows them on every answer page."""
    from pansketch.host_tools.store import exclusions

    excl = exclusions.excluded(store)
    key = (flag_state(store), tuple(sorted(excl)))
    hit = _CACHED.get(store.path)
    if hit is not None and hit[0] == key:
        return hit[1]
    flags = recent_flags(store, exclude=excl)
    if len(_CACHED) > 16:
        _CACHED.clear()
    _CACHED[store.path] = (key, flags)
    return flags
