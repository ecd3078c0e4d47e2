"""Retention: the payloads of rolled-up releases dropped after ``[aggregator] retain_raw_s``."""

from __future__ import annotations

from typing import Any, Iterable

from pansketch.host_tools.store import excltable
from pansketch.host_tools.store.base import SQLBase


class Pruner(SQLBase):
    """:meth:`prune` and its count."""

    def _bump_flag_windows(self, cur: Any, wins: Any) -> None:  # the write path's (GroupWriter)
        raise NotImplementedError

    def prune(self, before: float, limit: int = 2000, keep: Iterable[str] = ()) -> int:
        """Retention: drop the payload of rolled-up releases received before ``before``; returns how many.

        Only releases a roll-up sums (:func:`rollup_key`: modes window/keep,
        kinds cms/cs, not tree nodes) are pruned; the roll-up was updated in
        the transaction that stored the release, so it is safe as soon as the
        release is committed. The aggregator calls this between group
        commits (everything before is committed and acknowledged) with
        ``before = now - retain_raw_s``. The row stays, without its bytes
        (an empty payload): key, seq, SHA-256, parameters and time received.
        So a late re-send is still a duplicate (same hash) and different
        bytes still a conflict (the insert meets the primary key; the hash
        decides), ``status`` still counts the seq as stored, and the ledger
        still sees the budget spent. Queries that need the raw counters of a
        pruned release (one device, a range inside a window) raise
        :class:`PrunedError`; whole-window fleet queries use the roll-ups.

        At most ``limit`` releases per call, in one short transaction, oldest
        received first; a watermark (meta ``pruned_to``) keeps each call from
        rescanning what earlier calls passed.
        """
        if self.readonly:
            raise PermissionError("store opened read-only")
        if not self.has_rollups:
            return 0  # nothing is summed yet (a read-only opener's old file): keep every byte

        spare = sorted(set(keep) | set(excltable.excluded(self)))

        def tx(cur: Any) -> int:
            if not self.__dict__.get("_prune_index"):  # only stores with retention pay for this index
                self._x(cur, "CREATE INDEX IF NOT EXISTS releases_received ON releases (received)")
            row = self._x(cur, "SELECT value FROM meta WHERE key = 'pruned_to'").fetchone()
            lo = float(row[0]) if row else -1.0
            # excluded devices (pansketch.host_tools.store.exclusions) and those the caller keeps (flagged ones) keep
            # their payloads: a purge must be able to subtract them from the roll-ups. The watermark passes
            # them, so payloads kept here stay kept (until the device is purged)
            skip = " AND device NOT IN (%s)" % ",".join("?" * len(spare)) if spare else ""
            rows = self._x(cur, "SELECT device, elo, ehi, part, received, win_s, win FROM releases WHERE received >= ? "
                                "AND received < ? AND mode IN ('window', 'keep') AND kind IN ('cms', 'cs') "
                                "AND lvl = 0 AND length(payload) > 0" + skip + " ORDER BY received LIMIT ?",
                           [lo, before] + spare + [limit]).fetchall()
            if rows:
                cur.executemany(self._sql("UPDATE releases SET payload = ? WHERE device = ? AND elo = ? AND ehi = ? "
                                          "AND part = ?"), [(b"",) + tuple(r[:4]) for r in rows])
                self._bump_flag_windows(cur, {(int(r[5]), int(r[6])) for r in rows})  # their flags leave them out
            to = float(rows[-1][4]) if len(rows) == limit else before
            if to > lo:
                self._x(cur, "INSERT INTO meta (key, value) VALUES ('pruned_to', ?) ON CONFLICT (key) DO UPDATE "
                             "SET value = excluded.value", (repr(to),))
            return len(rows)

        n = int(self._exec_tx(tx))
        self.__dict__["_prune_index"] = True
        return n

    def pruned_count(self) -> int:
        """Releases kept as a record without their payload (retention)."""
        return int(self._q("SELECT COUNT(*) FROM releases WHERE length(payload) = 0")[0][0])
