"""Per-device and per-window summaries of the stored releases, kept by the write path.

``pansketch status`` and the dashboard's fleet page need, per device, figures over all of its
releases (how many, the seqs stored, the epochs covered, the windows, modes, budgets, noise
draws, the last one received, the late ones, the privacy guarantee) and, per window, how many
devices released in it and the largest guarantee among them (the ledger,
pansketch.host_tools.store.ledger). Read from the releases that is every row of the store
(N devices x W windows); kept here it is one row per device and one per window.

``device_summary``: one JSON document per device (:class:`DeviceSummary` field names). Every
figure composes exactly as releases are added: counts and sums add, maxima take the max, seqs are
kept as inclusive runs and epochs as merged half-open ranges (the canonical form
ledger.union gives), the windows as runs of (first, last, guarantee label) where the label is the
device-window's largest eps and rho (exact fractions, as text). Only a purge deletes releases
(retention's prune keeps the row, exclusion changes no row): the purged device's document is built
again from its remaining releases.

``window_summary``: per (win_s, win) and writer shard (PostgreSQL: each writer its own row, as
the roll-ups, so concurrent aggregators never wait on one hot row) the number of device-windows
added and, per guarantee value, how many device-windows have it as their largest (+1/-1 deltas; a
window's figures are the sums over its rows). The largest value with a positive count is the
window's guarantee: exact through additions and purges alike.

``late``: releases received more than max(ep_s, 300 s) after their epochs ended (status's default
grace). A status asked with another grace reads the releases that late (``late_rows``).

Built once from the releases by :func:`rebuild` (a writer's open of an older store: meta
``summaries``; the fleet-scale benchmark after its bulk copies); a read-only open of a store without
them reads every release, as before (``pansketch.host_tools.query.status``).
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
from fractions import Fraction
from typing import Any, Iterable, Optional, Sequence

_log = logging.getLogger("pansketch.store")

LATE_GRACE_MIN_S = 300  # the default late grace: max(ep_s, this); pansketch.host_tools.query.status
LATE_LIST = 50  # late seqs kept per device (status lists 50 per class; counts are complete)


def _frac(f: Fraction) -> str:
    return str(f.numerator) if f.denominator == 1 else "%d/%d" % (f.numerator, f.denominator)


@functools.lru_cache(maxsize=1024)
def _guarantee(mech: str, nout_num: int, nout_den: int, kind: str, d: int, clip: int, L: int) -> tuple[str, str]:
    """("eps" | "rho", the fraction as text) of one release, as ledger.release_guarantee computes it."""
    from pansketch.agent import calibrate
    from pansketch.agent.noise import NoiseSpec

    name, (n, dd) = calibrate.guarantee(NoiseSpec(mech, nout_num, nout_den), 1 if kind == "dbits" else d, clip, L)
    return ("eps" if name == "eps" else "rho"), _frac(Fraction(n, dd))


@functools.lru_cache(maxsize=4096)
def _fraction(text: str) -> Fraction:
    return Fraction(text)


@functools.lru_cache(maxsize=1024)
def _budget_text(mech: str, num: int, den: int) -> str:
    return "%s %s" % (mech, _frac(Fraction(num, den)))


def _fmax(a: Optional[str], b: Optional[str]) -> Optional[str]:
    if a is None or a == b:
        return b
    if b is None:
        return a
    return b if _fraction(b) > _fraction(a) else a


def label(eps: Optional[str], rho: Optional[str]) -> str:
    return "%s|%s" % (eps or "", rho or "")


def unlabel(lab: str) -> tuple[Optional[str], Optional[str]]:
    e, r = lab.split("|")
    return e or None, r or None


# -- runs of integers (inclusive [a, b]) and merged half-open ranges ------------------------------------------
def runs_has(runs: list[list[int]], x: int) -> bool:
    i = bisect.bisect_right([r[0] for r in runs], x) - 1
    return i >= 0 and runs[i][1] >= x


def runs_add(runs: list[list[int]], x: int) -> bool:
    """Add ``x`` to the sorted disjoint runs (in place); False if it was there."""
    starts = [r[0] for r in runs]
    i = bisect.bisect_right(starts, x) - 1
    if i >= 0 and runs[i][1] >= x:
        return False
    left = i >= 0 and runs[i][1] == x - 1
    right = i + 1 < len(runs) and runs[i + 1][0] == x + 1
    if left and right:
        runs[i][1] = runs[i + 1][1]
        del runs[i + 1]
    elif left:
        runs[i][1] = x
    elif right:
        runs[i + 1][0] = x
    else:
        runs.insert(i + 1, [x, x])
    return True


def ranges_add(cov: list[list[int]], a: int, b: int) -> None:
    """Add [a, b) to sorted merged ranges (in place), merging overlapping or touching ones as ledger.union."""
    lo = bisect.bisect_left([r[1] for r in cov], a)  # first range ending at or after a
    hi = lo
    while hi < len(cov) and cov[hi][0] <= b:
        hi += 1
    if hi > lo:
        a, b = min(a, cov[lo][0]), max(b, cov[hi - 1][1])
    cov[lo:hi] = [[a, b]]


def _win_get(runs: list[list[Any]], w: int) -> Optional[str]:
    i = bisect.bisect_right([r[0] for r in runs], w) - 1
    return runs[i][2] if i >= 0 and runs[i][1] >= w else None


def _win_set(runs: list[list[Any]], w: int, lab: str) -> None:
    """Window ``w`` labelled ``lab`` in the sorted runs [first, last, label] (in place), neighbours merged."""
    i = bisect.bisect_right([r[0] for r in runs], w) - 1
    if i >= 0 and runs[i][1] >= w:
        a, b, old = runs[i]
        if old == lab:
            return
        parts: list[list[Any]] = [[a, w - 1, old], [w, w, lab], [w + 1, b, old]]
        runs[i:i + 1] = [r for r in parts if int(r[0]) <= int(r[1])]
    else:
        runs.insert(i + 1, [w, w, lab])
    out: list[list[Any]] = []
    for r in runs:
        if out and out[-1][1] + 1 == r[0] and out[-1][2] == r[2]:
            out[-1][1] = r[1]
        else:
            out.append(r)
    runs[:] = out


class DeviceSummary:
    """The figures of one device's releases (module docstring); :meth:`add` one release at a time."""

    __slots__ = ("n", "seqs", "reused", "cov", "wins", "last_rx", "last_t1", "modes", "budgets", "eps", "rho",
                 "nz_sum", "nz_max", "late_n", "late_max", "late_seqs")

    def __init__(self, doc: Optional[dict[str, Any]] = None) -> None:
        d = doc or {}
        self.n: int = d.get("n", 0)
        self.seqs: list[list[int]] = d.get("seqs", [])
        self.reused: list[int] = d.get("reused", [])
        self.cov: list[list[int]] = d.get("cov", [])
        self.wins: dict[str, list[list[Any]]] = d.get("wins", {})  # str(win_s) -> [[first, last, label], ...]
        self.last_rx: Optional[float] = d.get("last_rx")
        self.last_t1: Optional[int] = d.get("last_t1")
        self.modes: list[str] = d.get("modes", [])
        self.budgets: list[str] = d.get("budgets", [])
        self.eps: Optional[str] = d.get("eps")
        self.rho: Optional[str] = d.get("rho")
        self.nz_sum: int = d.get("nz_sum", 0)
        self.nz_max: Optional[int] = d.get("nz_max")
        self.late_n: int = d.get("late_n", 0)
        self.late_max: Optional[float] = d.get("late_max")
        self.late_seqs: list[int] = d.get("late_seqs", [])

    def doc(self) -> str:
        return json.dumps({k: getattr(self, k) for k in self.__slots__}, separators=(",", ":"))

    @classmethod
    def load(cls, text: str) -> "DeviceSummary":
        return cls(json.loads(text))

    def add(self, seq: int, elo: int, ehi: int, win_s: int, win: int, received: float, t1: int, mode: str,
            ep_s: int, mech: str, bnum: int, bden: int, nz: int, g: tuple[str, str]) -> Optional[tuple[str, Optional[str], str]]:
        """One more release; returns its window's change (str(win_s) key, the label before or None, the label
        after) or None when the device-window's label stays."""
        self.n += 1
        if not runs_add(self.seqs, seq):  # stored before: a reused seq (kept once)
            j = bisect.bisect_left(self.reused, seq)
            if j == len(self.reused) or self.reused[j] != seq:
                self.reused.insert(j, seq)
        ranges_add(self.cov, elo, ehi)
        received = float(received)
        self.last_rx = received if self.last_rx is None or received > self.last_rx else self.last_rx
        self.last_t1 = t1 if self.last_t1 is None or t1 > self.last_t1 else self.last_t1
        m = "%s %ds" % (mode, win_s) + ("/%ds" % ep_s if mode == "keep" else "")
        if m not in self.modes:
            bisect.insort(self.modes, m)
        bt = _budget_text(mech, bnum, bden)
        if bt not in self.budgets:
            bisect.insort(self.budgets, bt)
        if g[0] == "eps":
            self.eps = _fmax(self.eps, g[1])
        else:
            self.rho = _fmax(self.rho, g[1])
        self.nz_sum += nz
        self.nz_max = nz if self.nz_max is None or nz > self.nz_max else self.nz_max
        late = received - t1
        if late > float(max(ep_s, LATE_GRACE_MIN_S)):
            self.late_n += 1
            self.late_max = late if self.late_max is None or late > self.late_max else self.late_max
            if len(self.late_seqs) < LATE_LIST or seq < self.late_seqs[-1]:
                bisect.insort(self.late_seqs, seq)
                del self.late_seqs[LATE_LIST:]
        runs = self.wins.setdefault(str(win_s), [])
        old = _win_get(runs, win)
        e, r = unlabel(old) if old is not None else (None, None)
        new = label(_fmax(e, g[1]) if g[0] == "eps" else e, _fmax(r, g[1]) if g[0] == "rho" else r)
        if new == old:
            return None
        _win_set(runs, win, new)
        return str(win_s), old, new

    # read side
    def window_keys(self) -> list[tuple[int, int]]:
        """(win_s, win) of the first and last of the sorted windows (status's first/last window)."""
        ks = sorted(int(k) for k in self.wins if self.wins[k])
        return [(ks[0], self.wins[str(ks[0])][0][0]), (ks[-1], self.wins[str(ks[-1])][-1][1])]

    def window_count(self) -> int:
        return sum(b - a + 1 for runs in self.wins.values() for a, b, _l in runs)

    def first_last(self) -> dict[int, tuple[int, int]]:
        """win_s -> (first, last) window of the device."""
        return {int(k): (v[0][0], v[-1][1]) for k, v in self.wins.items() if v}

    def window_labels(self) -> dict[tuple[int, int], str]:
        return {(int(k), w): lab for k, runs in self.wins.items() for a, b, lab in runs for w in range(a, b + 1)}


# the release columns a summary needs (old files without nz read 2, as schema._select_cols)
_SUM_COLS = ("device", "seq", "elo", "ehi", "win_s", "win", "received", "t1", "mode", "ep_s", "mech",
             "budget_num", "budget_den", "nz", "kind", "d", "clip", "L", "nout_num", "nout_den")


def _sum_select(have: Optional[set[str]]) -> str:
    return ", ".join("2 AS nz" if c == "nz" and have is not None and "nz" not in have else c for c in _SUM_COLS)


def _add_row(s: DeviceSummary, r: Sequence[Any]) -> Optional[tuple[str, Optional[str], str]]:
    (_dev, seq, elo, ehi, win_s, win, received, t1, mode, ep_s, mech, bn, bd, nz, kind, d, clip, L, onum, oden) = r
    return s.add(int(seq), int(elo), int(ehi), int(win_s), int(win), float(received), int(t1), mode, int(ep_s), mech,
                 int(bn), int(bd), int(nz), _guarantee(mech, int(onum), int(oden), kind, int(d), int(clip), int(L)))


class _WinDelta:
    """A group's changes to window_summary rows: (win_s, win) -> [devices added, {eps: n}, {rho: n}]."""

    def __init__(self) -> None:
        self.d: dict[tuple[int, int], list[Any]] = {}

    def note(self, ws: str, win: int, old: Optional[str], new: Optional[str]) -> None:
        e = self.d.setdefault((int(ws), win), [0, {}, {}])
        if old is None:
            e[0] += 1
        if new is None:
            e[0] -= 1
        for lab, sign in ((old, -1), (new, 1)):
            if lab is None:
                continue
            for i, v in enumerate(unlabel(lab)):
                if v is not None:
                    e[1 + i][v] = e[1 + i].get(v, 0) + sign


def _apply_windows(store: Any, cur: Any, delta: _WinDelta) -> None:
    """Add the deltas to this writer's shard rows (sorted keys: concurrent writers lock in one order)."""
    shard = getattr(store, "_rollup_shard", None) or 0
    keys = sorted(delta.d)
    if not keys:
        return
    cur.executemany(store._sql("INSERT INTO window_summary (win_s, win, shard, doc) VALUES (?, ?, ?, ?) "
                               "ON CONFLICT (win_s, win, shard) DO NOTHING"),
                    [k + (shard, '{"n":0,"eps":{},"rho":{}}') for k in keys])
    ups = []
    for k in keys:
        row = store._x(cur, "SELECT doc FROM window_summary WHERE win_s = ? AND win = ? AND shard = ?"
                       + store._for_update, k + (shard,)).fetchone()
        doc = json.loads(row[0])
        n, eps, rho = delta.d[k]
        doc["n"] += n
        for name, add in (("eps", eps), ("rho", rho)):
            m = doc[name]
            for v, c in add.items():
                m[v] = m.get(v, 0) + c
                if m[v] == 0:
                    del m[v]
        ups.append((json.dumps(doc, separators=(",", ":"), sort_keys=True),) + k + (shard,))
    cur.executemany(store._sql("UPDATE window_summary SET doc = ? WHERE win_s = ? AND win = ? AND shard = ?"), ups)


_CACHE_DOCS = 100_000  # parsed documents a writer keeps (its devices); past that it starts again


def _cache(store: Any) -> dict[str, tuple[str, DeviceSummary]]:
    """A writer's last saved documents, text and parsed: a document read back with the same text is used
    as parsed instead of parsed again (another writer's or a rolled-back change has other text)."""
    c: dict[str, tuple[str, DeviceSummary]] = store.__dict__.setdefault("_summary_docs", {})
    if len(c) > _CACHE_DOCS:
        c.clear()
    return c


def _lock_devices(store: Any, cur: Any, devs: list[str]) -> dict[str, DeviceSummary]:
    """The summaries of ``devs`` (sorted), created empty where missing and locked (PostgreSQL) for this
    transaction; each a copy the caller may change."""
    cur.executemany(store._sql("INSERT INTO device_summary (device, doc) VALUES (?, '{}') "
                               "ON CONFLICT (device) DO NOTHING"), [(d,) for d in devs])
    out: dict[str, DeviceSummary] = {}
    cache = _cache(store)
    for i in range(0, len(devs), 500):
        part = devs[i:i + 500]
        rows = store._x(cur, "SELECT device, doc FROM device_summary WHERE device IN (%s) ORDER BY device%s"
                        % (",".join("?" * len(part)), store._for_update), part).fetchall()
        for dev, doc in rows:
            hit = cache.pop(str(dev), None)  # out of the cache while it changes: put back once saved
            out[str(dev)] = hit[1] if hit is not None and hit[0] == doc else DeviceSummary.load(doc)
    return out


def _save_devices(store: Any, cur: Any, sums: dict[str, DeviceSummary]) -> None:
    rows = [(s.doc(), dev) for dev, s in sorted(sums.items())]
    cur.executemany(store._sql("UPDATE device_summary SET doc = ? WHERE device = ?"), rows)
    cache = _cache(store)
    for doc, dev in rows:
        cache[dev] = (doc, sums[dev])


def note_group(store: Any, cur: Any, stored: Sequence[tuple[Any, float]]) -> None:
    """The write path's part (GroupWriter._close_group): add the group's stored releases (Release, received)."""
    if not stored:
        return
    sums = _lock_devices(store, cur, sorted({rel.dev for rel, _rx in stored}))
    delta = _WinDelta()
    for rel, rx in stored:
        g = _guarantee(rel.mech, rel.nout[0], rel.nout[1], rel.kind, rel.d, rel.clip, rel.L)
        ch = sums[rel.dev].add(rel.seq, rel.elo, rel.ehi, rel.win_s, rel.win, rx, rel.t1, rel.mode, rel.ep_s,
                               rel.mech, rel.budget[0], rel.budget[1], rel.nz, g)
        if ch is not None:
            delta.note(ch[0], rel.win, ch[1], ch[2])
    _save_devices(store, cur, sums)
    _apply_windows(store, cur, delta)


def device_from_releases(store: Any, cur: Any, dev: str) -> DeviceSummary:
    s = DeviceSummary()
    for r in store._x(cur, "SELECT %s FROM releases WHERE device = ?" % _sum_select(store._release_columns(cur)),
                      (dev,)).fetchall():
        _add_row(s, r)
    return s


def after_purge(store: Any, cur: Any, dev: str) -> None:
    """``dev``'s summary built again from the releases a purge left (in the purge's transaction), and the
    windows it left or whose label changed taken out of or changed in window_summary."""
    row = store._x(cur, "SELECT doc FROM device_summary WHERE device = ?" + store._for_update, (dev,)).fetchone()
    if row is None:
        return
    old = DeviceSummary.load(row[0]).window_labels()
    s = device_from_releases(store, cur, dev)
    new = s.window_labels()
    delta = _WinDelta()
    for k in sorted(set(old) | set(new)):
        if old.get(k) != new.get(k):
            delta.note(str(k[0]), k[1], old.get(k), new.get(k))
    if s.n:
        _save_devices(store, cur, {dev: s})
    else:
        store._x(cur, "DELETE FROM device_summary WHERE device = ?", (dev,))
    _apply_windows(store, cur, delta)


def rebuild(store: Any, cur: Any) -> int:
    """Every summary from the stored releases (one pass, in any order); meta ``summaries`` set. Returns the
    number of releases read."""
    store._x(cur, "DELETE FROM device_summary")
    store._x(cur, "DELETE FROM window_summary")
    sums: dict[str, DeviceSummary] = {}
    delta = _WinDelta()
    n = 0
    q = store._x(cur, "SELECT %s FROM releases" % _sum_select(store._release_columns(cur)))
    while True:
        rows = q.fetchmany(4096)
        if not rows:
            break
        for r in rows:
            s = sums.get(r[0])
            if s is None:
                s = sums[r[0]] = DeviceSummary()
            ch = _add_row(s, r)
            if ch is not None:
                delta.note(ch[0], int(r[5]), ch[1], ch[2])
        n += len(rows)
    cur.executemany(store._sql("INSERT INTO device_summary (device, doc) VALUES (?, ?)"),
                    [(dev, s.doc()) for dev, s in sorted(sums.items())])
    _apply_windows(store, cur, delta)
    store._x(cur, "INSERT INTO meta (key, value) VALUES ('summaries', '1') ON CONFLICT (key) DO UPDATE "
                  "SET value = excluded.value")
    return n


def init(store: Any, cur: Any) -> None:
    """A writer's open: build the summaries of a store written before them (once: meta ``summaries``)."""
    if store._x(cur, "SELECT value FROM meta WHERE key = 'summaries'").fetchone() is None:
        if store._x(cur, "SELECT 1 FROM releases LIMIT 1").fetchone() is None:  # a new store: nothing to say
            rebuild(store, cur)
            return
        _log.info("building the per-device and per-window summaries of %s from its releases (once)", store.path)
        n = rebuild(store, cur)
        _log.info("summaries of %s built from %d release(s)", store.path, n)


# -- the read side ----------------------------------------------------------------------------------------
def present(store: Any) -> bool:
    """Whether the store keeps summaries (a read-only open of an older file may not)."""
    try:
        return store._meta("summaries") == "1"
    except store._db_errors:
        return False


def read_devices(store: Any) -> dict[str, DeviceSummary]:
    return {str(dev): DeviceSummary.load(doc) for dev, doc in store._q("SELECT device, doc FROM device_summary")}


def read_windows(store: Any) -> list[tuple[int, int, int, Optional[Fraction], Optional[Fraction]]]:
    """(win_s, win, devices, largest eps, largest rho) per window holding releases (any order)."""
    acc: dict[tuple[int, int], list[Any]] = {}
    for ws, wn, doc in store._q("SELECT win_s, win, doc FROM window_summary"):
        d = json.loads(doc)
        e = acc.setdefault((int(ws), int(wn)), [0, {}, {}])
        e[0] += d["n"]
        for i, name in ((1, "eps"), (2, "rho")):
            for v, c in d[name].items():
                e[i][v] = e[i].get(v, 0) + c
    out = []
    for (ws, wn), (n, eps, rho) in acc.items():
        if n <= 0:
            continue
        fe = max((_fraction(v) for v, c in eps.items() if c > 0), default=None)
        fr = max((_fraction(v) for v, c in rho.items() if c > 0), default=None)
        out.append((ws, wn, n, fe, fr))
    return out


def late_rows(store: Any, grace: float) -> Iterable[tuple[str, int, float]]:
    """(device, seq, received - t1) of the releases received more than ``grace`` after their epochs ended."""
    return [(str(d), int(s), float(rx) - int(t1))
            for d, s, rx, t1 in store._q("SELECT device, seq, received, t1 FROM releases WHERE received - t1 > ?",
                                         (float(grace) - 1.0,))
            if float(rx) - int(t1) > grace]
