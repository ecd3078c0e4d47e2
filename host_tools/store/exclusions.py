"""Taking a device out of the fleet's answers: exclusion (reversible) and purge (for good).

``pansketch device exclude ID`` records the device in the table
``device_exclusions`` (device, since, reason); every query from then on
leaves it out (pansketch.host_tools.query.core.select_merged: the raw releases of the
others, or the roll-ups minus the excluded device's releases, in memory), and
``include ID`` deletes the row again. Nothing else changes, so an exclusion is
undone exactly.

``pansketch device purge ID [--since T]`` deletes the device's releases (all,
or those whose epochs start at or after T) and, in the same transaction,
subtracts them from every roll-up they were summed into: the counter sums,
the release count, the noise draws, the device list and the covered time
extent (recomputed from the releases that remain). A roll-up left with no
release is deleted. Every answer is then the answer of a store that never
received those releases (tests/test_exclusions.py compares them byte for
byte, SQLite and PostgreSQL, with and without roll-ups).

Subtracting needs the purged releases' counters. Retention
(``[aggregator] retain_raw_s``) keeps a pruned release's row but not its
payload, so a purge that meets a pruned release of a rolled-up window is
refused (:class:`PurgeError`, nothing changed) and says which windows; the
roll-ups of those windows cannot be corrected any more (docs/HOST.md
"Removing a device"). Retention therefore skips the payloads of excluded
devices (:func:`protected`), and the aggregator warns before it prunes those
of a flagged one.

The tables are created by the first exclusion (a store that never excluded a
device has none; readers treat a missing table as "no exclusions"), so
opening an older file read-only changes nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import numpy as np

from pansketch.host_tools.store.excltable import DDL, TABLE, excluded  # noqa: F401 (the names of this module's API)
from pansketch.host_tools.store import summary
from pansketch.host_tools.store.rows import _row_to_release
from pansketch.host_tools.store.write import rollup_key

SQLStore = Any  # pansketch.host_tools.store.sql.SQLStore (not imported: retention, in the store classes, reads the table)


class PurgeError(Exception):
    """A purge that cannot be done exactly (nothing was changed)."""


def set_excluded(store: SQLStore, device: str, exclude: bool, reason: str = "", now: Optional[float] = None) -> bool:
    """Exclude (or include again) ``device``; True if that changed anything."""
    if store.readonly:
        raise PermissionError("store opened read-only")
    t = time.time() if now is None else now

    def tx(cur: Any) -> bool:
        store._x(cur, DDL)
        had = store._x(cur, "SELECT 1 FROM device_exclusions WHERE device = ?", (device,)).fetchone() is not None
        if exclude and not had:
            store._x(cur, "INSERT INTO device_exclusions (device, since, reason) VALUES (?, ?, ?)",
                     (device, t, reason or "excluded by the operator"))
        elif not exclude and had:
            store._x(cur, "DELETE FROM device_exclusions WHERE device = ?", (device,))
        return had != exclude

    return bool(store._exec_tx(tx))


def protected(store: SQLStore) -> set[str]:
    """Devices whose payloads retention must keep (their releases may still have to be subtracted)."""
    return set(excluded(store))


@dataclass
class PurgeReport:
    device: str
    releases: int = 0  # releases deleted
    rollups_corrected: int = 0  # roll-ups it was subtracted from (kept: others remain in them)
    rollups_deleted: int = 0  # roll-ups that held nothing else
    windows: list[tuple[int, int]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "releases_deleted": self.releases, "rollups_corrected": self.rollups_corrected,
                "rollups_deleted": self.rollups_deleted, "windows": [list(w) for w in self.windows]}


_GROUP = "win_s = ? AND win = ? AND kind = ? AND d = ? AND w = ? AND hv = ? AND salt = ?"


def _flag_windows_changed(store: SQLStore, cur: Any, wins: set[tuple[int, int]]) -> None:
    """Purged windows: their stored flags are out of date; a window left without releases is no window."""
    if not wins:  # (a writable store has the table: its open created it)
        return
    store._bump_flag_windows(cur, wins)
    for ws, w in sorted(wins):
        if store._x(cur, "SELECT 1 FROM releases WHERE win = ? AND win_s = ? LIMIT 1", (w, ws)).fetchone() is None:
            store._x(cur, "UPDATE flag_windows SET gen = -gen WHERE win_s = ? AND win = ?", (ws, w))
            store._x(cur, "DELETE FROM flags WHERE win_s = ? AND win = ?", (ws, w))


def purge(store: SQLStore, device: str, since: Optional[float] = None) -> PurgeReport:
    """Delete ``device``'s releases (those whose epochs start at or after ``since``, or all) and subtract
    them from the roll-ups, in one transaction. :class:`PurgeError` (nothing changed) if one of them was
    pruned by retention while a roll-up holds it."""
    if store.readonly:
        raise PermissionError("store opened read-only")
    rep = PurgeReport(device)

    def tx(cur: Any) -> PurgeReport:
        if store.has_rollups:
            store._lock_counts(cur, exclusive=True)  # before any roll-up row (PgStore._lock_counts)
        cond = "device = ?" + (" AND t0 >= ?" if since is not None else "")
        args: tuple[Any, ...] = (device,) if since is None else (device, since)
        rows = store._x(cur, "SELECT %s, payload FROM releases WHERE %s" % (store._cols, cond), args).fetchall()
        rels = [_row_to_release(r, True) for r in rows]
        by_key: dict[tuple[Any, ...], list[Any]] = {}
        pruned: set[tuple[int, int]] = set()
        for r in rels:
            k = rollup_key(r)
            if k is None:
                continue
            if not r.payload:
                pruned.add((r.win_s, r.win))
            by_key.setdefault(k, []).append(r)
        if pruned and store.has_rollups:
            raise PurgeError("%d window(s) of %s (first: win_s %d, window %d) were pruned by retention "
                             "([aggregator] retain_raw_s) while their roll-ups hold them: their counters cannot be "
                             "subtracted any more, nothing was purged (docs/HOST.md \"Removing a device\")"
                             % (len(pruned), device, *min(pruned)))
        store._x(cur, "DELETE FROM releases WHERE " + cond, args)
        rep.releases = len(rels)
        _flag_windows_changed(store, cur, {(r.win_s, r.win) for r in rels})
        if store.has_rollups:
            for key in sorted(by_key):
                _subtract(store, cur, key, by_key[key], device, rep)
        summary.after_purge(store, cur, device)
        left = store._x(cur, "SELECT 1 FROM releases WHERE device = ? LIMIT 1", (device,)).fetchone()
        if left is None:
            store._x(cur, "DELETE FROM devices WHERE device = ?", (device,))
        return rep

    return store._exec_tx(tx)  # type: ignore[no-any-return]


def _subtract(store: SQLStore, cur: Any, key: tuple[Any, ...], rels: list[Any], device: str, rep: PurgeReport) -> None:
    """Take ``rels`` (one roll-up key's releases of ``device``, already deleted from releases) out of the
    roll-up rows of ``key`` (one row; on PostgreSQL one per writer shard: readers add the rows up)."""
    d, w = key[3], key[4]
    ids = store._x(cur, "SELECT id, releases, sums FROM rollups WHERE " + _GROUP + " ORDER BY id" + store._for_update,
                   key).fetchall()
    if not ids:
        return
    sub = np.zeros((d, w), dtype=np.int64)
    noise: dict[tuple[str, int, int], int] = {}
    for r in rels:
        sub += r.counters()
        for k, c in (((r.mech, r.nint[0], r.nint[1]), r.nz - 1), ((r.mech, r.nout[0], r.nout[1]), 1)):
            noise[k] = noise.get(k, 0) + c
    rest = store._x(cur, "SELECT COUNT(*), MIN(t0), MAX(t1) FROM releases WHERE " + _GROUP
                    + " AND mode IN ('window', 'keep') AND lvl = 0", key).fetchone()
    idl = [int(i[0]) for i in ids]
    marks = ",".join("?" * len(idl))
    rep.windows.append((key[0], key[1]))
    if int(rest[0]) == 0:  # nothing else in this roll-up: a store without the device has no such row
        for t, col in (("rollup_noise", "rollup"), ("rollup_devices", "rollup"), ("rollups", "id")):
            store._x(cur, "DELETE FROM %s WHERE %s IN (%s)" % (t, col, marks), idl)
        rep.rollups_deleted += 1
        return
    n = len(rels)
    first = True
    for rid, cnt, blob in ids:  # the counters from the first row, the release count from each as far as it goes
        take = min(int(cnt), n)
        n -= take
        sums = np.frombuffer(bytes(blob), dtype="<i8").reshape(d, w)
        if first:
            sums = sums - sub
            first = False
        store._x(cur, "UPDATE rollups SET releases = ?, t0 = ?, t1 = ?, sums = ? WHERE id = ?",
                 (int(cnt) - take, int(rest[1]), int(rest[2]), sums.astype("<i8").tobytes(), int(rid)))
    for (mech, num, den), c in sorted(noise.items()):
        for rid, have in store._x(cur, "SELECT rollup, count FROM rollup_noise WHERE rollup IN (%s) AND mech = ? "
                                       "AND num = ? AND den = ? ORDER BY rollup" % marks,
                                  idl + [mech, num, den]).fetchall():
            take = min(int(have), c)
            c -= take
            if int(have) == take:
                store._x(cur, "DELETE FROM rollup_noise WHERE rollup = ? AND mech = ? AND num = ? AND den = ?",
                         (rid, mech, num, den))
            elif take:
                store._x(cur, "UPDATE rollup_noise SET count = ? WHERE rollup = ? AND mech = ? AND num = ? AND den = ?",
                         (int(have) - take, rid, mech, num, den))
    still = store._x(cur, "SELECT 1 FROM releases WHERE " + _GROUP + " AND device = ? AND mode IN ('window', 'keep') "
                     "AND lvl = 0 LIMIT 1", key + (device,)).fetchone()
    if still is None:
        store._x(cur, "DELETE FROM rollup_devices WHERE rollup IN (%s) AND device = ?" % marks, idl + [device])
    rep.rollups_corrected += 1


def touched_rollups(store: SQLStore, devices: Iterable[str]) -> set[int]:
    """Ids of the roll-ups that sum a release of any of ``devices``."""
    devs = sorted(set(devices))
    if not devs:
        return set()
    return {int(r[0]) for r in store._q("SELECT DISTINCT rollup FROM rollup_devices WHERE device IN (%s)"
                                          % ",".join("?" * len(devs)), devs)}
