"""The store's read queries: releases and their counters, devices, refusals, status, roll-ups."""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Iterable, Iterator, Optional, Sequence

import numpy as np

from pansketch.host_tools.store import payloadcodec
from pansketch.host_tools.store.base import SQLBase
from pansketch.host_tools.store.rows import DeviceStatus, RollupInfo, StoredRelease, _row_to_release
from pansketch.host_tools.store.schema import STATUS_INTS, _ORDER

_CHUNK = 500  # ids per IN (...) list


class Reader(SQLBase):
    """Every query of the stored data (one read snapshot for several: :meth:`read_tx`)."""

    _read_begin = "BEGIN"

    @contextlib.contextmanager
    def read_tx(self) -> Iterator[None]:
        """One read snapshot for several reads (roll-ups + boundary releases, metadata + payloads):
        releases committed meanwhile by an aggregator are either all seen or not at all."""
        with self._lock:
            cur = self._cursor()
            cur.execute(self._read_begin)
            try:
                yield
            finally:
                try:
                    cur.execute("COMMIT")
                except self._db_errors:
                    pass

    def _release_where(self, devices: Optional[Iterable[str]], window: Optional[int], since: Optional[float],
                       until: Optional[float], win_s: Optional[int] = None) -> tuple[str, list[Any]]:
        where: list[str] = []
        args: list[Any] = []
        if devices is not None:
            devs = list(devices)
            where.append("device IN (%s)" % ",".join("?" * len(devs)))
            args += devs
        for cond, val in (("win = ?", window), ("win_s = ?", win_s), ("t0 >= ?", since), ("t1 <= ?", until)):
            if val is not None:
                where.append(cond)
                args.append(val)
        return (" WHERE " + " AND ".join(where)) if where else "", args

    def releases(self, devices: Optional[Iterable[str]] = None, window: Optional[int] = None,
                 since: Optional[float] = None, until: Optional[float] = None,
                 with_payload: bool = False, win_s: Optional[int] = None) -> list[StoredRelease]:
        """Releases filtered by device(s), window id, and [since, until) containment."""
        where, args = self._release_where(devices, window, since, until, win_s)
        sql = "SELECT %s%s FROM releases%s ORDER BY %s" % (
            self._cols, ", payload" if with_payload else "", where, _ORDER)
        return [_row_to_release(r, with_payload) for r in self._q(sql, args)]

    def release_lengths(self, devices: Optional[Iterable[str]] = None) -> set[int]:
        """The distinct bucket lengths of the selected releases: the window length, for tree-mode
        releases the epoch length (aggregated in SQL: a month of a large fleet is millions of rows)."""
        where, args = self._release_where(devices, None, None, None)
        sql = "SELECT DISTINCT CASE WHEN mode = 'tree' THEN ep_s ELSE win_s END FROM releases%s" % where
        return {int(r[0]) for r in self._q(sql, args)}

    def release_extents(self, devices: Optional[Iterable[str]] = None, since: Optional[float] = None,
                        until: Optional[float] = None) -> dict[str, tuple[int, int]]:
        """device -> (earliest t0, latest t1) of its releases inside [since, until) (as :meth:`releases`
        selects them), one aggregate row per device instead of every release."""
        where, args = self._release_where(devices, None, since, until)
        sql = "SELECT device, MIN(t0), MAX(t1) FROM releases%s GROUP BY device" % where
        return {str(d): (int(a), int(b)) for d, a, b in self._q(sql, args)}

    def iter_counters(self, devices: Optional[Iterable[str]] = None, window: Optional[int] = None,
                      since: Optional[float] = None, until: Optional[float] = None,
                      win_s: Optional[int] = None) -> Iterator[np.ndarray]:
        """The counters of :meth:`releases` (same order), one payload in memory at a time."""
        where, args = self._release_where(devices, window, since, until, win_s)
        sql = "SELECT %s, payload FROM releases%s ORDER BY %s" % (self._cols, where, _ORDER)
        for row in self._iter(sql, args):  # shape from kind, d, w, b (dcs: (b + 1) * d rows; dbits: 1 x d)
            yield _row_to_release(row, True).counters()

    def has_tree(self) -> bool:
        """True if any tree-mode release is stored (they are never rolled up)."""
        return bool(self._q("SELECT 1 FROM releases WHERE mode = 'tree' LIMIT 1"))

    def long_releases(self, since: float, until: float,
                      devices: Optional[Iterable[str]] = None) -> list[tuple[str, int, int]]:
        """(device, t0, t1) of the window/keep releases longer than one epoch that overlap [since, until).

        A release spans several epochs only when the device could not release at an epoch's end (a
        failed commit, a full outbox: its range grew), so these are few, and only they can straddle
        a bucket boundary that is a multiple of the epoch length. Read through the partial index
        ``releases_long`` (pansketch.host_tools.store.schema), never a scan of every release.
        """
        sql = "SELECT device, t0, t1 FROM releases WHERE ehi - elo > 1 AND t0 < ? AND t1 > ? AND mode != 'tree'"
        args: list[Any] = [until, since]
        if devices is not None:
            devs = list(devices)
            sql += " AND device IN (%s)" % ",".join("?" * len(devs))
            args += devs
        return [(str(d), int(a), int(b)) for d, a, b in self._q(sql + " ORDER BY t0, device", args)]

    def count_partial(self, since: Optional[float], until: Optional[float],
                      devices: Optional[Iterable[str]] = None,
                      windows: Optional[Iterable[tuple[int, int]]] = None) -> int:
        """Releases that overlap [since, until) without lying inside it (cannot be split).
        Tree-mode nodes are not counted (pansketch.host_tools.query.core.cover uses smaller ones).

        ``windows`` ((win_s, win) pairs) restricts the count to those windows.
        """
        lo = since if since is not None else -1
        hi = until if until is not None else 1 << 62
        # tree nodes are not counted: smaller nodes of the same device cover what a straddling one holds
        base = ("SELECT COUNT(*) FROM releases WHERE t0 < ? AND t1 > ? AND NOT (t0 >= ? AND t1 <= ?) "
                "AND mode != 'tree'")
        args: list[Any] = [hi, lo, lo, hi]
        if devices is not None:
            devs = list(devices)
            base += " AND device IN (%s)" % ",".join("?" * len(devs))
            args += devs
        if windows is None:
            return int(self._q(base, args)[0][0])
        return sum(int(self._q(base + " AND win = ? AND win_s = ?", args + [win, ws])[0][0])
                   for ws, win in sorted(set(windows)))

    def change_count(self) -> Optional[int]:
        """A number that moves at every write transaction (SQLStore's change counter; None when this store
        has none yet: written only by code from before it, or never). Equal values: nothing was written
        in between, so what was read from the store then is still what it holds."""
        try:
            v = self._meta("changes")
        except self._db_errors:
            return None
        return None if v is None else int(v)

    def release_count(self) -> int:
        return int(self._q("SELECT COUNT(*) FROM releases")[0][0])

    def payload(self, device: str, elo: int, ehi: int, part: int) -> Optional[bytes]:
        """The bytes of a stored release exactly as the device sent them (empty: pruned), or None."""
        r = self._q("SELECT payload FROM releases WHERE device = ? AND elo = ? AND ehi = ? AND part = ?",
                    (device, elo, ehi, part))
        return payloadcodec.decode(bytes(r[0][0])) if r else None

    def devices(self) -> list[tuple[Any, ...]]:
        """(device, salt, hv, kind, d, w, ep_s, first_received) per known device."""
        return self._q("SELECT device, salt, hv, kind, d, w, ep_s, first_received FROM devices ORDER BY device")

    def devices_with_releases(self) -> list[str]:
        """The devices holding at least one stored release, sorted: the ``devices`` table, whose row is
        written in the transaction of the device's first release and deleted with its last
        (pansketch.host_tools.store.exclusions.purge); one row per device instead of the GROUP BY of
        every release that :meth:`device_activity` is."""
        return [str(r[0]) for r in self._q("SELECT device FROM devices ORDER BY device")]

    def kind_counts(self) -> dict[str, int]:
        """kind -> number of devices (a device row is written with its first stored release)."""
        return {str(k): int(n) for k, n in self._q("SELECT kind, COUNT(*) FROM devices GROUP BY kind")}

    def devices_of_kind(self, kind: str) -> list[str]:
        return [str(r[0]) for r in self._q("SELECT device FROM devices WHERE kind = ? ORDER BY device", (kind,))]

    def rejections(self, limit: Optional[int] = None) -> list[tuple[Any, ...]]:
        """(id, received, topic, device, code, reason, size, sha256), newest first."""
        sql = "SELECT id, received, topic, device, code, reason, size, sha256 FROM rejections ORDER BY id DESC"
        if limit is not None:
            sql += " LIMIT %d" % int(limit)
        return self._q(sql)

    def rejection_counts(self) -> list[tuple[str, int, float]]:
        """(code, count, last received) per rejection code, most frequent first: every message refused since
        the database was created (``rejection_totals``; the rows of ``rejections`` are capped and pruned)."""
        try:
            rows = self._q("SELECT code, count, last FROM rejection_totals ORDER BY count DESC, code")
        except self._db_errors as exc:
            if "no such table" not in str(exc) and "does not exist" not in str(exc):
                raise
            rows = []
        if rows:
            return [(r[0], int(r[1]), float(r[2])) for r in rows]
        return self._q("SELECT code, COUNT(*), MAX(received) FROM rejections GROUP BY code ORDER BY COUNT(*) DESC, code")

    def quarantined(self, limit: int = 1000) -> list[tuple[Any, ...]]:
        """(device, seq, elo, ehi, part, t0, code, reason, count, received, last) of quarantined releases, newest
        first (empty for a database written before quarantine existed)."""
        try:
            return self._q("SELECT device, seq, elo, ehi, part, t0, code, reason, count, received, last FROM quarantine "
                           "ORDER BY id DESC LIMIT %d" % int(limit))
        except self._db_errors as exc:
            if "no such table" in str(exc) or "does not exist" in str(exc):
                return []
            raise

    def rejection_bytes(self) -> int:
        """Bytes the kept rejection prefixes and quarantined payloads occupy (for checks and the benchmark)."""
        r = self._q("SELECT COALESCE(SUM(LENGTH(payload)), 0) FROM rejections")[0][0]
        try:
            q = self._q("SELECT COALESCE(SUM(LENGTH(payload)), 0) FROM quarantine")[0][0]
        except self._db_errors:
            q = 0
        return int(r) + int(q)

    def device_activity(self) -> list[tuple[str, int, float, int]]:
        """(device, releases, last received, end of its latest epochs) per device with releases."""
        return self._q("SELECT device, COUNT(*), MAX(received), MAX(t1) FROM releases GROUP BY device ORDER BY device")

    def device_statuses(self) -> dict[str, DeviceStatus]:
        """The latest status of every device that published one (empty for a database without the table)."""
        import json

        try:
            rows = self._q("SELECT device, received, %s, doc, state, state_received FROM device_status"
                           % ", ".join(STATUS_INTS))
        except self._db_errors as exc:
            if "no such table" in str(exc):  # written before devices reported status
                return {}
            raise
        out = {}
        for r in rows:
            try:
                doc = json.loads(r[8])
            except ValueError:  # pragma: no cover (we wrote it)
                doc = {}
            out[r[0]] = DeviceStatus(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], doc if isinstance(doc, dict) else {}, r[9], r[10])
        return out

    def rejected_seqs(self) -> dict[str, dict[int, str]]:
        """Per device, the seqs of releases the host refused and the (last) rejection code of each."""
        try:
            rows = self._q("SELECT device, seq, code FROM rejections WHERE seq IS NOT NULL AND device IS NOT NULL "
                           "ORDER BY id")
        except self._db_errors as exc:
            if "no such column" in str(exc):  # a read-only open of a file no new aggregator has opened
                return {}
            raise
        out: dict[str, dict[int, str]] = {}
        for dev, seq, code in rows:
            out.setdefault(dev, {})[int(seq)] = code
        return out

    def rejection_count(self) -> int:
        return int(self._q("SELECT COUNT(*) FROM rejections")[0][0])

    def duplicate_count(self) -> int:
        return int(self._q("SELECT COUNT(*) FROM duplicates")[0][0])

    def snapshot(self) -> tuple[int, int, int, str]:
        """(releases, rejections, duplicates, digest of all release keys+hashes): to check 'nothing touched'."""
        h = hashlib.sha256()
        for r in self._q("SELECT device, elo, ehi, part, sha256 FROM releases ORDER BY device, elo, ehi, part"):
            h.update(repr(tuple(r)).encode())
        for r in self._q("SELECT device, salt, hv, kind, d, w, ep_s FROM devices ORDER BY device"):
            h.update(repr(tuple(r)).encode())
        return (self.release_count(), self.rejection_count(), self.duplicate_count(), h.hexdigest())

    # -- roll-up reads ---------------------------------------------------
    def rollups(self, window: Optional[int] = None, since: Optional[float] = None,
                until: Optional[float] = None) -> list[RollupInfo]:
        """Roll-up metadata, all or those of one window id; with ``since``/``until`` only those whose
        releases overlap [since, until) (the others play no part in a range query: a series asks once
        per bucket, and reading every roll-up each time made it quadratic in the windows)."""
        sql = "SELECT id, win_s, win, kind, d, w, hv, salt, releases, t0, t1 FROM rollups"
        conds: list[str] = []
        args: list[Any] = []
        if window is not None:
            conds.append("win = ?")
            args.append(window)
        if until is not None:
            conds.append("t0 < ?")
            args.append(until)
        if since is not None:
            conds.append("t1 > ?")
            args.append(since)
        if conds:
            sql += " WHERE " + " AND ".join(conds)
        sql += " ORDER BY win_s, win, id"
        return [RollupInfo(int(r[0]), int(r[1]), int(r[2]), r[3], int(r[4]), int(r[5]), int(r[6]), r[7], int(r[8]),
                           int(r[9]), int(r[10])) for r in self._q(sql, args)]

    def _by_ids(self, sql: str, ids: Sequence[int]) -> Iterator[tuple[Any, ...]]:
        for i in range(0, len(ids), _CHUNK):
            chunk = list(ids[i:i + _CHUNK])
            yield from self._iter(sql % ",".join("?" * len(chunk)), chunk)

    def rollup_sums(self, ids: Sequence[int]) -> Iterator[np.ndarray]:
        """The int64 (d, w) sums of the given roll-ups, one at a time."""
        for d, w, blob in self._by_ids("SELECT d, w, sums FROM rollups WHERE id IN (%s)", ids):
            yield np.frombuffer(blob, dtype="<i8").reshape(int(d), int(w))

    def rollup_noise(self, ids: Sequence[int]) -> dict[tuple[str, int, int], int]:
        """Noise draws per cell summed over the given roll-ups: (mech, num, den) -> count."""
        out: dict[tuple[str, int, int], int] = {}
        for mech, num, den, c in self._by_ids("SELECT mech, num, den, count FROM rollup_noise WHERE rollup IN (%s)",
                                              ids):
            k = (mech, int(num), int(den))
            out[k] = out.get(k, 0) + int(c)
        return out

    def rollup_device_counts(self, ids: Sequence[int]) -> Optional[dict[int, int]]:
        """Roll-up id -> how many devices contributed to it, for the given roll-ups (a roll-up with none
        left is absent or 0); None when this store keeps no such counts (then read :meth:`rollup_devices`).
        The SQLite and PostgreSQL stores keep them (pansketch.host_tools.store.sqlite, .pg: there per writer
        shard row, a roll-up's rows summing to its devices); this reader does not."""
        return None

    def device_count(self) -> int:
        """How many devices hold at least one stored release (rows of ``devices``)."""
        return int(self._q("SELECT COUNT(*) FROM devices")[0][0])

    _all_devices: Optional[tuple[int, list[str]]] = None

    def all_devices(self) -> list[str]:
        """:meth:`devices_with_releases`, read once per state of the store (its change counter): a series
        asks per bucket. The same list object while nothing was written: callers must not change it."""
        n = self.change_count()
        if n is not None and self._all_devices is not None and self._all_devices[0] == n:
            return self._all_devices[1]
        out = self.devices_with_releases()
        if n is not None:
            self._all_devices = (n, out)
        return out

    def rollup_extent(self) -> Optional[tuple[int, int]]:
        """(earliest t0, latest t1) over every roll-up, None without any: with every release rolled up
        (no tree nodes, :meth:`has_unrolled` false) the extent of every release, from one row per window."""
        r = self._q("SELECT MIN(t0), MAX(t1) FROM rollups")[0]
        return None if r[0] is None else (int(r[0]), int(r[1]))

    def rollup_lengths(self) -> set[int]:
        """The distinct window lengths of the roll-ups (with every release rolled up: of every release)."""
        return {int(r[0]) for r in self._q("SELECT DISTINCT win_s FROM rollups")}

    def rollup_devices(self, ids: Sequence[int]) -> set[str]:
        """The devices that contributed to the given roll-ups. Each IN list's distinct devices are one
        fetch (at most one row per device): a whole fleet per hourly bucket of a series, row by row
        through :meth:`_by_ids`, was about a third of the series' Python time."""
        out: set[str] = set()
        for i in range(0, len(ids), _CHUNK):
            chunk = list(ids[i:i + _CHUNK])
            out.update(r[0] for r in self._q("SELECT DISTINCT device FROM rollup_devices WHERE rollup IN (%s)"
                                             % ",".join("?" * len(chunk)), chunk))
        return out
