"""Per-device and per-window summaries of the stored releases, kept by the write path.

``pansketch status`` and the dashboard's fleet page need, per device, figures over all of its
releases (how many, the seqs stored, the epochs covered, the windows, modes, budgets, noise
draws, the last one received, the late ones, the privacy guarantee) and, per window, how many
devices released in it and the largest guarantee among them (the ledger,
pansketch.host_tools.store.ledger). Read from the releases that is every row of the store
(N devices x W windows); kept here it is one row per device (and aggregator).

``device_summaries``: one JSON document per device and writer shard (:class:`DeviceSummary`'s
fields as an array, :meth:`DeviceSummary.doc`; PostgreSQL: each writer its own row, as the
roll-ups, so aggregators storing one device's releases never wait on one row; SQLite: shard 0).
Every figure composes exactly as releases are added and as shards are merged
(:meth:`DeviceSummary.merge`, on read): counts and sums add, maxima take the max, seqs are kept as inclusive runs and epochs as merged half-open ranges (the canonical
form ledger.union gives), the windows as runs of (first, last, guarantee label) where the label is
the device-window's largest eps and rho (exact fractions, as text). Only a purge deletes releases
(retention's prune keeps the row, exclusion changes no row): the purged device's documents are
replaced by one built again from its remaining releases.

The per-window figures the ledger needs (how many devices released in a window and the largest
guarantee among them) are the devices' window runs summed on read (:func:`read_windows`): one pass
over the runs, nothing more written per commit.

``late``: releases received more than max(ep_s, 300 s) after their epochs ended (status's default
grace). A status asked with another grace reads the releases that late (``late_rows``).

Built once from the releases by :func:`rebuild` (a writer's open of a store without them or with an
older form: meta ``summaries`` is :data:`FORMAT`; the fleet-scale benchmark after its bulk copies); a
read-only open of such a store reads every release, as before (``pansketch.host_tools.query.status``).
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
from fractions import Fraction
from typing import Any, Iterable, Optional, Sequence

_log = logging.getLogger("pansketch.store")
_dumps = json.JSONEncoder(separators=(",", ":")).encode

LATE_GRACE_MIN_S = 300  # the default late grace: max(ep_s, this); pansketch.host_tools.query.status
LATE_LIST = 50  # late seqs kept per device (status lists 50 per class; counts are complete)
FORMAT = "2"  # meta ``summaries``: 2 = per-shard device documents (1: one per device, plus window_summary)
_OLD_TABLES = ("device_summary", "window_summary")  # format 1's tables, dropped when a writer rebuilds


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


def runs_union(a: list[list[int]], b: list[list[int]]) -> list[list[int]]:
    """The union of two sorted disjoint run lists, adjacent runs joined (the form runs_add keeps)."""
    out: list[list[int]] = []
    for lo, hi in sorted([list(r) for r in a] + [list(r) for r in b]):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


def runs_common(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """The integers in both run lists (the seqs two shards both stored: reused)."""
    out: list[int] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        out.extend(range(lo, hi + 1))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _omax(x: Any, y: Any) -> Any:
    """The larger of two optional numbers (None: absent)."""
    return y if x is None else x if y is None or x >= y else y


def _label_max(x: Optional[str], y: Optional[str]) -> Optional[str]:
    """The label of a device-window both labelled ``x`` and ``y`` (either None: absent)."""
    if x is None or x == y:
        return y
    if y is None:
        return x
    (e1, r1), (e2, r2) = unlabel(x), unlabel(y)
    return label(_fmax(e1, e2), _fmax(r1, r2))


def _merge_wins(a: list[list[Any]], b: list[list[Any]]) -> list[list[Any]]:
    """Two sorted [first, last, label] run lists as one, each window labelled with both labels' maxima."""
    cuts = sorted({r[0] for r in a + b} | {r[1] + 1 for r in a + b})
    out: list[list[Any]] = []
    i = j = 0
    for lo, nxt in zip(cuts, cuts[1:]):
        while i < len(a) and a[i][1] < lo:
            i += 1
        while j < len(b) and b[j][1] < lo:
            j += 1
        la = a[i][2] if i < len(a) and a[i][0] <= lo else None
        lb = b[j][2] if j < len(b) and b[j][0] <= lo else None
        lab = _label_max(la, lb)
        if lab is None:
            continue
        if out and out[-1][1] + 1 == lo and out[-1][2] == lab:
            out[-1][1] = nxt - 1
        else:
            out.append([lo, nxt - 1, lab])
    return out


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
        """The document: the fields' values as one JSON array in ``__slots__`` order (an object with
        the field names reads too); an array writes and parses in about 60 % of an object's time, on
        every commit of the write path and 10^4 times in a status."""
        return _dumps([getattr(self, k) for k in self.__slots__])

    @classmethod
    def load(cls, text: str) -> "DeviceSummary":
        v = json.loads(text)
        return cls(dict(zip(cls.__slots__, v)) if isinstance(v, list) else v)

    def add(self, seq: int, elo: int, ehi: int, win_s: int, win: int, received: float, t1: int, mode: str,
            ep_s: int, mech: str, bnum: int, bden: int, nz: int, g: tuple[str, str]) -> None:
        """One more release."""
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
        runs = self.wins.get(str(win_s))
        if runs is None:
            runs = self.wins[str(win_s)] = []
            if len(self.wins) > 1:  # keys in numeric order: a document's text does not depend on arrival order
                self.wins = dict(sorted(self.wins.items(), key=lambda kv: int(kv[0])))
        old = _win_get(runs, win)
        e, r = unlabel(old) if old is not None else (None, None)
        new = label(_fmax(e, g[1]) if g[0] == "eps" else e, _fmax(r, g[1]) if g[0] == "rho" else r)
        if new != old:
            _win_set(runs, win, new)

    def merge(self, o: "DeviceSummary") -> None:
        """Another shard's document of the same device added (in place): the figures one document would
        hold had one writer stored both shards' releases."""
        if not o.n:
            return
        if not self.n:
            for k in self.__slots__:
                setattr(self, k, getattr(o, k))
            return
        self.reused = sorted(set(self.reused) | set(o.reused) | set(runs_common(self.seqs, o.seqs)))
        self.seqs = runs_union(self.seqs, o.seqs)
        self.n += o.n
        for a, b in o.cov:
            ranges_add(self.cov, a, b)
        wins = dict(self.wins)
        for ws, runs in o.wins.items():
            mine = wins.get(ws)
            wins[ws] = _merge_wins(mine, runs) if mine else [list(r) for r in runs]
        self.wins = dict(sorted(wins.items(), key=lambda kv: int(kv[0])))
        self.last_rx, self.last_t1 = _omax(self.last_rx, o.last_rx), _omax(self.last_t1, o.last_t1)
        self.modes = sorted(set(self.modes) | set(o.modes))
        self.budgets = sorted(set(self.budgets) | set(o.budgets))
        self.eps, self.rho = _fmax(self.eps, o.eps), _fmax(self.rho, o.rho)
        self.nz_sum += o.nz_sum
        self.nz_max = _omax(self.nz_max, o.nz_max)
        self.late_n += o.late_n
        self.late_max = _omax(self.late_max, o.late_max)
        self.late_seqs = sorted(self.late_seqs + o.late_seqs)[:LATE_LIST]

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


def _add_row(s: DeviceSummary, r: Sequence[Any]) -> None:
    (_dev, seq, elo, ehi, win_s, win, received, t1, mode, ep_s, mech, bn, bd, nz, kind, d, clip, L, onum, oden) = r
    s.add(int(seq), int(elo), int(ehi), int(win_s), int(win), float(received), int(t1), mode, int(ep_s), mech,
          int(bn), int(bd), int(nz), _guarantee(mech, int(onum), int(oden), kind, int(d), int(clip), int(L)))


def _shard(store: Any) -> int:
    return getattr(store, "_rollup_shard", None) or 0


_CACHE_DOCS = 100_000  # parsed documents a writer keeps (its devices); past that it starts again


def _cache(store: Any) -> dict[tuple[str, int], tuple[str, DeviceSummary]]:
    """A writer's last saved documents by (device, shard), text and parsed: a document read back with the
    same text is used as parsed instead of parsed again (another writer's or a rolled-back change has
    other text)."""
    c: dict[tuple[str, int], tuple[str, DeviceSummary]] = store.__dict__.setdefault("_summary_docs", {})
    if len(c) > _CACHE_DOCS:
        c.clear()
    return c


def _lock_devices(store: Any, cur: Any, devs: list[str]) -> dict[str, DeviceSummary]:
    """This writer's shard documents of ``devs`` (sorted), created empty where missing and locked
    (PostgreSQL) for this transaction; each a copy the caller may change."""
    shard = _shard(store)
    cache = _cache(store)
    # a row this writer saved exists unless a purge took it since: created only for the others
    new = [d for d in devs if (d, shard) not in cache]
    out = _select_locked(store, cur, shard, cache, devs, new)
    gone = [d for d in devs if d not in out]
    if gone:  # purged since this writer saved them (or created just now by the rows above: none left then)
        out.update(_select_locked(store, cur, shard, cache, gone, gone))
    return out


def _select_locked(store: Any, cur: Any, shard: int, cache: dict[tuple[str, int], tuple[str, DeviceSummary]],
                   devs: list[str], create: list[str]) -> dict[str, DeviceSummary]:
    if create:
        cur.executemany(store._sql("INSERT INTO device_summaries (device, shard, doc) VALUES (?, ?, '{}') "
                                   "ON CONFLICT (device, shard) DO NOTHING"), [(d, shard) for d in create])
    out: dict[str, DeviceSummary] = {}
    for i in range(0, len(devs), 500):
        part = devs[i:i + 500]
        rows = store._x(cur, "SELECT device, doc FROM device_summaries WHERE shard = ? AND device IN (%s) "
                        "ORDER BY device%s" % (",".join("?" * len(part)), store._for_update), [shard] + part).fetchall()
        for dev, doc in rows:
            hit = cache.pop((str(dev), shard), None)  # out of the cache while it changes: put back once saved
            out[str(dev)] = hit[1] if hit is not None and hit[0] == doc else DeviceSummary.load(doc)
    return out


def _save_devices(store: Any, cur: Any, sums: dict[str, DeviceSummary]) -> None:
    shard = _shard(store)
    rows = [(s.doc(), dev, shard) for dev, s in sorted(sums.items())]
    cur.executemany(store._sql("UPDATE device_summaries SET doc = ? WHERE device = ? AND shard = ?"), rows)
    cache = _cache(store)
    for doc, dev, _s in rows:
        cache[(dev, shard)] = (doc, sums[dev])


def note_group(store: Any, cur: Any, stored: Sequence[tuple[Any, float]]) -> None:
    """The write path's part (GroupWriter._close_group): add the group's stored releases (Release, received)."""
    if not stored:
        return
    sums = _lock_devices(store, cur, sorted({rel.dev for rel, _rx in stored}))
    for rel, rx in stored:
        g = _guarantee(rel.mech, rel.nout[0], rel.nout[1], rel.kind, rel.d, rel.clip, rel.L)
        sums[rel.dev].add(rel.seq, rel.elo, rel.ehi, rel.win_s, rel.win, rx, rel.t1, rel.mode, rel.ep_s,
                          rel.mech, rel.budget[0], rel.budget[1], rel.nz, g)
    _save_devices(store, cur, sums)


def device_from_releases(store: Any, cur: Any, dev: str) -> DeviceSummary:
    s = DeviceSummary()
    for r in store._x(cur, "SELECT %s FROM releases WHERE device = ?" % _sum_select(store._release_columns(cur)),
                      (dev,)).fetchall():
        _add_row(s, r)
    return s


def after_purge(store: Any, cur: Any, dev: str) -> None:
    """``dev``'s documents (every shard's) replaced by one built again from the releases a purge left,
    in the purge's transaction."""
    if not store._x(cur, "SELECT shard FROM device_summaries WHERE device = ? ORDER BY shard" + store._for_update,
                    (dev,)).fetchall():
        return
    s = device_from_releases(store, cur, dev)
    store._x(cur, "DELETE FROM device_summaries WHERE device = ?", (dev,))
    cache = _cache(store)
    for k in [k for k in cache if k[0] == dev]:
        del cache[k]
    if s.n:
        store._x(cur, "INSERT INTO device_summaries (device, shard, doc) VALUES (?, ?, ?)", (dev, _shard(store), s.doc()))


def rebuild(store: Any, cur: Any) -> int:
    """Every summary from the stored releases (one pass, in any order), into this writer's shard; format 1's
    tables dropped; meta ``summaries`` set. Returns the number of releases read."""
    for t in _OLD_TABLES:
        store._x(cur, "DROP TABLE IF EXISTS %s" % t)
    store._x(cur, "DELETE FROM device_summaries")
    _cache(store).clear()
    sums: dict[str, DeviceSummary] = {}
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
            _add_row(s, r)
        n += len(rows)
    shard = _shard(store)
    cur.executemany(store._sql("INSERT INTO device_summaries (device, shard, doc) VALUES (?, ?, ?)"),
                    [(dev, shard, s.doc()) for dev, s in sorted(sums.items())])
    store._x(cur, "INSERT INTO meta (key, value) VALUES ('summaries', ?) ON CONFLICT (key) DO UPDATE "
                  "SET value = excluded.value", (FORMAT,))
    return n


def _old_writer(store: Any, cur: Any) -> bool:
    """Whether format 1's table is there again: an aggregator of that version opened the store after this
    one's rebuild dropped it, and stored releases these summaries lack."""
    from pansketch.host_tools.store.excltable import is_sqlite

    if is_sqlite(store):
        return store._x(cur, "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                        (_OLD_TABLES[0],)).fetchone() is not None
    return store._x(cur, "SELECT to_regclass(?)", (_OLD_TABLES[0],)).fetchone()[0] is not None


def init(store: Any, cur: Any) -> None:
    """A writer's open: build the summaries of a store written before them or in an older form, or
    after an older aggregator wrote to it (once each time)."""
    row = store._x(cur, "SELECT value FROM meta WHERE key = 'summaries'").fetchone()
    if row is None or row[0] != FORMAT or _old_writer(store, cur):
        if store._x(cur, "SELECT 1 FROM releases LIMIT 1").fetchone() is None:  # a new store: nothing to say
            rebuild(store, cur)
            return
        _log.info("building the per-device summaries of %s from its releases (once)", store.path)
        n = rebuild(store, cur)
        _log.info("summaries of %s built from %d release(s)", store.path, n)


# -- the read side ----------------------------------------------------------------------------------------
def present(store: Any) -> bool:
    """Whether the store keeps summaries in this form, complete (a read-only open of an older file may
    not; nor a store an older aggregator wrote to since: :func:`_old_writer`)."""
    from pansketch.host_tools.store.excltable import has_table

    try:
        return store._meta("summaries") == FORMAT and not has_table(store, _OLD_TABLES[0])
    except store._db_errors:
        return False


def read_devices(store: Any) -> dict[str, DeviceSummary]:
    """device -> its summary, the shards' documents merged."""
    out: dict[str, DeviceSummary] = {}
    for dev, doc in store._q("SELECT device, doc FROM device_summaries"):
        s = DeviceSummary.load(doc)
        have = out.get(str(dev))
        if have is None:
            out[str(dev)] = s
        else:
            have.merge(s)
    return out


def read_windows(sums: dict[str, DeviceSummary]) -> list[tuple[int, int, int, Optional[Fraction], Optional[Fraction]]]:
    """(win_s, win, devices, largest eps, largest rho) per window holding releases (any order), from the
    devices' window runs: each run adds its label at its first window and takes it out past its last,
    so one sweep per window length gives every window's count of device-windows per label."""
    ev: dict[int, dict[int, dict[str, int]]] = {}
    for s in sums.values():
        for key, runs in s.wins.items():
            e = ev.setdefault(int(key), {})
            for a, b, lab in runs:
                at = e.setdefault(a, {})
                at[lab] = at.get(lab, 0) + 1
                past = e.setdefault(b + 1, {})
                past[lab] = past.get(lab, 0) - 1
    out: list[tuple[int, int, int, Optional[Fraction], Optional[Fraction]]] = []
    for win_s, e in ev.items():
        live: dict[str, int] = {}
        pos = sorted(e)
        for p, nxt in zip(pos, pos[1:]):
            for lab, c in e[p].items():
                live[lab] = live.get(lab, 0) + c
                if not live[lab]:
                    del live[lab]
            if not live:
                continue
            n = sum(live.values())
            es = [v for v in (unlabel(lab)[0] for lab in live) if v is not None]
            rs = [v for v in (unlabel(lab)[1] for lab in live) if v is not None]
            fe = max(map(_fraction, es)) if es else None
            fr = max(map(_fraction, rs)) if rs else None
            out.extend((win_s, w, n, fe, fr) for w in range(p, nxt))
    return out


def late_rows(store: Any, grace: float) -> Iterable[tuple[str, int, float]]:
    """(device, seq, received - t1) of the releases received more than ``grace`` after their epochs ended."""
    return [(str(d), int(s), float(rx) - int(t1))
            for d, s, rx, t1 in store._q("SELECT device, seq, received, t1 FROM releases WHERE received - t1 > ?",
                                         (float(grace) - 1.0,))
            if float(rx) - int(t1) > grace]
