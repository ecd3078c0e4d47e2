"""The store's write path: group commit, with quarantine, the bounded refusal logs and roll-ups.

Group commit (:meth:`GroupWriter.commit_group`): the aggregator stores a
batch of messages in one transaction with one ``SAVEPOINT`` per message:
a message whose storage fails (conflict, device parameters, a database
error on that row) is rolled back alone and the others commit. The
aggregator acknowledges the messages only after the commit.

Idempotency, enforced by the database: the release key
is the primary key and the insert is ``ON CONFLICT DO NOTHING``. A release
whose key is stored with identical bytes is a *duplicate* (QoS 1
redelivery, the device retrying after a lost ack) and changes nothing but
the duplicates log; the same key with *different* bytes is a *conflict*
and is rejected: a device never generates a release twice, so different
bytes mean re-drawn noise (which would average away privacy if both were
kept) or a forged/reset device. The first stored version is kept.

Roll-ups are maintained at ingest, in the same transaction as the releases
they sum, for every v1 release (modes window and keep, kinds cms and cs),
keyed by the window and the full merge group, so any new kind or shape gets
its own roll-ups; a selection a roll-up cannot answer exactly (one device,
releases straddling a range bound, several merge groups) is merged from
the raw releases (pansketch.host_tools.query.core). A database written before roll-ups
existed gets them rebuilt from its releases when an aggregator opens it
for writing; read-only readers of such a file merge raw releases.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from pansketch.host_tools import cborscan
from pansketch.host_tools.store import summary
from pansketch.host_tools.store.base import SQLBase
from pansketch.host_tools.store.records import Rejected, Release
from pansketch.host_tools.store.rows import REASON_KEEP, TOPIC_KEEP, Pending, _row_to_release
from pansketch.host_tools.store.schema import _INSERT_COLS, STATUS_INTS, _select_cols, insert_values

ROLLUP_MODES = ("window", "keep")
ROLLUP_KINDS = ("cms", "cs")


def _cut(s: Optional[str], n: int) -> Optional[str]:
    """``s`` cut to at most ``n`` UTF-8 bytes (whole characters)."""
    if s is None:
        return None
    b = s.encode("utf-8", "replace")
    return s if len(b) <= n else b[:n].decode("utf-8", "ignore")


def rollup_key(rel: Any) -> Optional[tuple[int, int, str, int, int, int, str]]:
    """(win_s, win, kind, d, w, hv, salt) of the roll-up ``rel`` (a Release or StoredRelease) is summed into, or None.

    Only window/keep releases of kinds cms and cs are rolled up: tree nodes (mode tree, ``lvl`` > 0; ``lvl`` is 0
    outside tree mode in format v2) and kinds dcs/dbits are merged from the raw releases.
    """
    if rel.mode not in ROLLUP_MODES or rel.kind not in ROLLUP_KINDS or rel.lvl > 0:
        return None
    return (rel.win_s, rel.win, rel.kind, rel.d, rel.w, rel.hv, rel.salt)


@dataclass
class _Acc:
    """A roll-up's increment from one group (applied at the end of the transaction)."""

    sums: np.ndarray
    releases: int = 0
    t0: int = 1 << 62
    t1: int = -1
    noise: dict[tuple[str, int, int], int] = field(default_factory=dict)
    devices: set[str] = field(default_factory=set)

    def add(self, rel: Any, counters: np.ndarray) -> None:
        self.sums += counters
        self.releases += 1
        self.t0 = min(self.t0, rel.t0)
        self.t1 = max(self.t1, rel.t1)
        for k, c in (((rel.mech, rel.nint[0], rel.nint[1]), rel.nz - 1), ((rel.mech, rel.nout[0], rel.nout[1]), 1)):
            self.noise[k] = self.noise.get(k, 0) + c
        self.devices.add(rel.device if hasattr(rel, "device") else rel.dev)


class _NeedSavepoints(Exception):
    """A group put without savepoints met a message that needs one (SQLStore._group)."""


class GroupWriter(SQLBase):
    """Stores releases and refusals, a group per transaction (see the module docstring)."""

    @staticmethod
    def _roll(accs: dict[tuple[Any, ...], _Acc], rel: Release) -> bool:
        """Add a stored release to its window's roll-up accumulator; False if it has none (it stays unrolled)."""
        k = rollup_key(rel)
        if k is None:
            return False
        acc = accs.get(k)
        if acc is None:
            acc = accs[k] = _Acc(np.zeros((rel.d, rel.w), dtype=np.int64))
        acc.add(rel, rel.counters())
        return True

    def insert(self, rel: Release, topic: Optional[str] = None, received: Optional[float] = None) -> str:
        """Store ``rel``: returns 'stored' or 'duplicate'; raises Rejected('device'|'conflict')."""
        p = Pending(rel.payload, topic, time.time() if received is None else received, rel=rel, device=rel.dev)
        self.commit_group([p], log_rejections=False)
        if p.status == "error":
            assert p.error is not None
            raise p.error
        if p.status == "rejected":
            assert p.rej is not None
            raise p.rej
        return p.status

    def reject(self, code: str, reason: str, payload: bytes, topic: Optional[str] = None,
               device: Optional[str] = None, received: Optional[float] = None, keep_bytes: Optional[int] = None) -> None:
        """Log a refused message (a prefix of at most ``keep_bytes`` of its bytes is kept)."""
        dev, seq = cborscan.peek(bytes(payload)[:self.limits.keep_bytes if keep_bytes is None else keep_bytes])
        p = Pending(bytes(payload), topic, time.time() if received is None else received,
                    rej=Rejected(code, reason), device=device, keep_bytes=keep_bytes, seq=seq, pdev=dev)
        self.commit_group([p])
        if p.status == "error":
            assert p.error is not None
            raise p.error

    def commit_group(self, items: Sequence[Pending], log_rejections: bool = True, sync: bool = True) -> None:
        """Store every item in one transaction, one savepoint each (see module docstring).

        Fills each item's ``status``. A failure of the transaction itself
        (commit, roll-up update, connection lost) raises and nothing of the
        group is stored. ``sync`` False (after :meth:`defer_sync`): it may
        return before the transaction is on disk; :meth:`sync_committed` first,
        then acknowledge.
        """
        if self.readonly:
            raise PermissionError("store opened read-only")
        for p in items:
            p.status, p.error = "", None
        seen: dict[str, tuple[Any, ...]] = {}
        try:
            if self._optimistic:
                try:
                    self._exec_tx(self._put_group, items, log_rejections, seen, False, sync=sync)
                    self._devcache.update(seen)
                    return
                except _NeedSavepoints:  # rolled back: the group again, a savepoint per message
                    for p in items:
                        p.status, p.error = "", None
            self._exec_tx(self._group, items, log_rejections, seen, sync=sync)
            self._devcache.update(seen)  # committed: device rows never change once written
        except BaseException:
            self.__dict__.pop("_maxseq", None)  # it may hold seqs of the rolled-back group: read them again
            raise
        finally:
            self._forget_unstored(items)

    def _group(self, cur: Any, items: Sequence[Pending], log_rejections: bool, seen: dict[str, tuple[Any, ...]]) -> None:
        self._put_group(cur, items, log_rejections, seen, True)

    def _put_group(self, cur: Any, items: Sequence[Pending], log_rejections: bool, seen: dict[str, tuple[Any, ...]],
                   savepoints: bool) -> None:
        """``savepoints`` False (SQLite, :attr:`_optimistic`): no savepoint per message; a message whose
        database error, or whose refusal after it wrote something, needs one raises :class:`_NeedSavepoints`
        (the transaction is rolled back and the group put again with savepoints)."""
        seen.clear()
        logged = [0, 0]  # rejection, quarantine rows written
        totals: dict[str, list[Any]] = {}
        for p in items:
            p.status, p.error = "", None
            # one name for every message's savepoint (each is released before the next begins): the
            # same three statement texts each time stay prepared in the connection's statement cache
            sp = "msg"
            before = 0
            # a device row this message writes is rolled back with it: then it is not known (seen) either
            new_dev = p.rel.dev if p.rel is not None and p.rel.dev not in seen else None
            if savepoints:
                cur.execute("SAVEPOINT " + sp)
            else:
                before = self._changes()
            try:
                if p.rel is not None and p.rej is None:
                    if not self._quarantined(cur, p, logged):
                        try:
                            p.status = self._insert(cur, p.rel, p.topic, p.received, seen)
                        except Rejected as rej:
                            if savepoints:
                                cur.execute("ROLLBACK TO SAVEPOINT " + sp)
                                if new_dev is not None:
                                    seen.pop(new_dev, None)
                            elif self._changes() != before:  # a partial write to undo: needs the savepoint
                                raise _NeedSavepoints()
                            p.rej, p.status = rej, "rejected"
                else:
                    p.status = "rejected"
                if p.status == "rejected" and log_rejections and p.rej is not None:
                    self._log_rejection(cur, p)
                    self._total(totals, p)
                    logged[0] += 1
                if savepoints:
                    cur.execute("RELEASE SAVEPOINT " + sp)
            except self._db_errors as exc:
                if self._retryable(exc):
                    raise  # locked/deadlock: the whole group is retried
                if not savepoints:
                    raise _NeedSavepoints() from exc
                cur.execute("ROLLBACK TO SAVEPOINT " + sp)
                cur.execute("RELEASE SAVEPOINT " + sp)
                if new_dev is not None:
                    seen.pop(new_dev, None)
                p.status, p.error = "error", exc
        self._close_group(cur, items, logged, totals)

    def _close_group(self, cur: Any, items: Sequence[Pending], logged: list[int],
                     totals: dict[str, list[Any]]) -> None:
        """The end of a group put (both back ends): roll the stored items up into their windows' roll-ups,
        flag the store if one could not be, bound the rejection and quarantine logs."""
        accs: dict[tuple[Any, ...], _Acc] = {}
        unrolled = False
        for p in items:
            if p.status == "stored" and p.rel is not None and not self._roll(accs, p.rel):
                unrolled = True
        self._apply_rollups(cur, accs)
        self._bump_flag_windows(cur, {(p.rel.win_s, p.rel.win) for p in items if p.status == "stored" and p.rel})
        self._note_stored(cur, items)
        summary.note_group(self, cur, [(p.rel, p.received) for p in items if p.status == "stored" and p.rel is not None])
        if unrolled:
            self._mark_unrolled(cur)
        self._bound(cur, logged, totals)

    # -- refused and quarantined messages: bounded (Limits) -----------------
    @staticmethod
    def _total(totals: dict[str, list[Any]], p: Pending) -> None:
        assert p.rej is not None
        t = totals.setdefault(p.rej.code, [0, 0, p.received, p.received])
        t[0] += 1
        t[1] += len(p.payload)
        t[2] = min(t[2], p.received)
        t[3] = max(t[3], p.received)

    def _log_rejection(self, cur: Any, p: Pending) -> None:
        assert p.rej is not None
        n = self.limits.keep_bytes if p.keep_bytes is None else min(p.keep_bytes, self.limits.keep_bytes)
        keep = bytes(p.payload[:n])
        seq, pdev = (p.rel.seq, p.rel.dev) if p.rel is not None else (p.seq, p.pdev)  # store-level refusals
        seq = seq if pdev is not None and pdev == p.device else None
        self._x(cur, "INSERT INTO rejections (received, topic, device, code, reason, size, sha256, payload, seq) "
                     "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (p.received, _cut(p.topic, TOPIC_KEEP), _cut(p.device, 64), p.rej.code[:32],
                 _cut(p.rej.reason, REASON_KEEP), len(p.payload), hashlib.sha256(p.payload).hexdigest(), keep, seq))

    def _quarantined(self, cur: Any, p: Pending, logged: list[int]) -> bool:
        """Quarantine a valid release too far ahead (window or seq jump): logged aside, never stored or
        acknowledged, so it cannot take the real release's key. True if it was quarantined."""
        assert p.rel is not None
        if p.quarantine is None:
            p.quarantine = self._seq_jump(cur, p.rel)
        if p.quarantine is None:
            return False
        self._log_quarantine(cur, p)
        p.status = "quarantined"
        logged[1] += 1
        return True

    def _log_quarantine(self, cur: Any, p: Pending) -> None:
        q, rel = p.quarantine, p.rel
        assert q is not None and rel is not None
        self._x(cur, "INSERT INTO quarantine (received, last, count, topic, device, seq, elo, ehi, part, t0, code, "
                     "reason, size, sha256, payload) VALUES (?, ?, 1, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                     "ON CONFLICT (sha256) DO UPDATE SET count = quarantine.count + 1, last = excluded.last",
                (p.received, p.received, _cut(p.topic, TOPIC_KEEP), rel.dev, rel.seq, rel.elo, rel.ehi, rel.part,
                 rel.t0, q.code, _cut(q.reason, REASON_KEEP), len(p.payload), rel.sha256, rel.payload))

    def _forget_unstored(self, items: Sequence[Pending]) -> None:
        """:meth:`_seq_jump` raised its cached highest seq as each release passed; a release that was then
        not stored (refused, failed, or its group rolled back) must not stay in the cache, or the check of
        the device's next releases would start from a seq that is not stored: its figure is read again."""
        cache = self.__dict__.get("_maxseq")
        if cache:
            for p in items:
                if p.rel is not None and p.status != "stored":
                    cache.pop(p.rel.dev, None)

    def _seq_jump(self, cur: Any, rel: Release) -> Optional[Rejected]:
        """Quarantine (code ``seq_jump``) a release whose seq is more than ``max_seq_jump`` above the
        device's highest stored seq (or above 0 for a new device): a forged seq would otherwise make
        ``status`` count billions of releases as pending."""
        cache = self.__dict__.setdefault("_maxseq", {})
        top = cache.get(rel.dev)
        if top is None or rel.seq > top + self.limits.max_seq_jump:
            top = self._stored_top(cur, rel.dev)
            cache[rel.dev] = top
        if rel.seq > top + self.limits.max_seq_jump:
            return Rejected("seq_jump", "seq %d is more than %d above the highest stored seq of %s (%s)"
                            % (rel.seq, self.limits.max_seq_jump, rel.dev, "none" if top < 0 else top))
        if rel.seq > top:
            cache[rel.dev] = rel.seq
        return None

    def _stored_top(self, cur: Any, dev: str) -> int:
        """The highest stored seq of ``dev``, -1 if none (a primary-key prefix probe: the key leads with
        the device here; ``Store`` reads its ``devices`` row)."""
        r = self._x(cur, "SELECT MAX(seq) FROM releases WHERE device = ?", (dev,)).fetchone()
        return -1 if r is None or r[0] is None else int(r[0])

    def _stored_shape(self, cur: Any, dev: str) -> Optional[tuple[str, int, int]]:
        """(mode, L, win_s) of any one stored release of ``dev`` (they all have one shape: _check_shape
        keeps it so), or None if it has none; a primary-key prefix probe, as :meth:`_stored_top`."""
        r = self._x(cur, "SELECT mode, L, win_s FROM releases WHERE device = ? LIMIT 1", (dev,)).fetchone()
        return None if r is None else (str(r[0]), int(r[1]), int(r[2]))

    def _add_device(self, cur: Any, rel: Release, mine: tuple[Any, ...], now: float) -> None:
        """The row of a device's fixed parameters, written with its first stored release."""
        self._x(cur, "INSERT INTO devices (device, salt, hv, kind, d, w, ep_s, first_received) "
                     "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (device) DO NOTHING", (rel.dev,) + mine + (now,))

    def _bump_flag_windows(self, cur: Any, wins: Any) -> None:
        """The windows whose releases changed: their stored flags are out of date (schema ``flag_windows``;
        pansketch.host_tools.query.influence computes them again). One row per window, not per release. A
        window a purge emptied has a negative gen (no window; pansketch.host_tools.store.exclusions): its
        magnitude keeps growing, so flags computed before the purge never match a later gen."""
        if wins:
            cur.executemany(self._sql("INSERT INTO flag_windows (win_s, win, gen, done, setting) VALUES (?, ?, 1, 0, '') "
                                      "ON CONFLICT (win_s, win) DO UPDATE SET gen = ABS(flag_windows.gen) + 1"),
                            sorted(wins))

    def flag_windows_sql(self) -> str:
        """The query of every window's (win_s, win, gen, done, setting) in ``flag_windows`` (PostgreSQL adds
        its writers' shard counts to gen: pansketch.host_tools.store.pg)."""
        return "SELECT win_s, win, gen, done, setting FROM flag_windows"

    def _init_flag_windows(self, cur: Any) -> None:
        """An older database's windows into ``flag_windows`` (once: meta ``flag_windows``), flags to compute."""
        if self._x(cur, "SELECT value FROM meta WHERE key = 'flag_windows'").fetchone() is None:
            self._x(cur, "INSERT INTO flag_windows (win_s, win, gen, done, setting) SELECT DISTINCT win_s, win, 1, 0, '' "
                         "FROM releases WHERE true ON CONFLICT (win_s, win) DO NOTHING")
            self._x(cur, "INSERT INTO meta (key, value) VALUES ('flag_windows', '1')")

    def _note_stored(self, cur: Any, items: Sequence[Pending]) -> None:
        """Per-device figures kept up to date at the end of a group (none here; ``Store`` keeps some)."""

    def _bound(self, cur: Any, logged: list[int], totals: dict[str, list[Any]]) -> None:
        """Counts per code, then the caps and the retention period (:class:`Limits`)."""
        for code, (n, size, first, last) in sorted(totals.items()):
            self._x(cur, "INSERT INTO rejection_totals (code, count, bytes, first, last) VALUES (?, ?, ?, ?, ?) "
                         "ON CONFLICT (code) DO UPDATE SET count = rejection_totals.count + excluded.count, "
                         "bytes = rejection_totals.bytes + excluded.bytes, last = excluded.last",
                    (code, n, size, first, last))
        lim = self.limits
        now = time.time()
        aged = now - self._last_age_prune >= 60.0
        if aged:
            self._last_age_prune = now
            cut = now - lim.retention_s
            self._x(cur, "DELETE FROM rejections WHERE received < ?", (cut,))
            self._x(cur, "DELETE FROM quarantine WHERE last < ?", (cut,))
            self._rej_rows = self._q_rows = None
        if logged[0] or aged:
            if self._rej_rows is None:
                self._rej_rows = int(self._x(cur, "SELECT COUNT(*) FROM rejections").fetchone()[0])
            else:
                self._rej_rows += logged[0]
            cap = lim.rejection_rows
            if self._rej_rows > cap:
                n = int(self._x(cur, "SELECT COUNT(*) FROM rejections").fetchone()[0])  # other writers too
                keep = max(1, cap * 9 // 10)
                if n > cap:
                    self._x(cur, "DELETE FROM rejections WHERE id < (SELECT id FROM rejections ORDER BY id DESC "
                                 "LIMIT 1 OFFSET ?)", (keep - 1,))
                    n = keep
                self._rej_rows = n
        if logged[1]:
            while True:
                n, total = self._x(cur, "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM quarantine").fetchone()
                if int(n) <= lim.quarantine_rows and int(total) <= lim.quarantine_bytes or int(n) == 0:
                    break
                self._x(cur, "DELETE FROM quarantine WHERE id = (SELECT MIN(id) FROM quarantine)")

    def _insert(self, cur: Any, rel: Release, topic: Optional[str], now: float,
                seen: Optional[dict[str, tuple[Any, ...]]] = None) -> str:
        mine = (rel.salt, rel.hv, rel.kind, rel.d, rel.w, rel.ep_s)
        self._check_shape(cur, rel)
        if self._devcache.get(rel.dev) == mine:  # known device, same parameters: insert, classify on conflict
            return self._insert_release(cur, rel, topic, now)
        existing = self._classify(cur, rel, now)
        if existing is not None:
            return existing
        dev = self._x(cur, "SELECT salt, hv, kind, d, w, ep_s FROM devices WHERE device = ?", (rel.dev,)).fetchone()
        if dev is None:
            self._add_device(cur, rel, mine, now)
            dev = self._x(cur, "SELECT salt, hv, kind, d, w, ep_s FROM devices WHERE device = ?",
                          (rel.dev,)).fetchone()
        if tuple(dev) != mine:
            names = ("salt id", "hash version", "kind", "d", "w", "ep_s")
            diffs = ["%s %s -> %s" % (n, a, b) for n, a, b in zip(names, dev, mine) if a != b]
            raise Rejected("device", "device %s changed parameters its earlier releases fixed (%s); "
                           "give the reconfigured device a new id" % (rel.dev, ", ".join(diffs)))
        if seen is not None:
            seen[rel.dev] = mine
        return self._insert_release(cur, rel, topic, now)

    def _check_shape(self, cur: Any, rel: Release) -> None:
        """A device's releases are all tree nodes of one shape (L, win_s) or none is a tree node:
        otherwise a range query would count the same events twice (code ``device``)."""
        tree = rel.mode == "tree"
        shape = (tree, rel.L if tree else 0, rel.win_s if tree else 0)
        cache = self.__dict__.setdefault("_shapecache", {})
        if cache.get(rel.dev) == shape:
            return
        other = self._stored_shape(cur, rel.dev)
        if other is not None and ((other[0] == "tree") != tree or (tree and (other[1], other[2]) != (rel.L, rel.win_s))):
            raise Rejected("device", "device %s sent %s releases before (L=%d, win_s=%d); this one is %s (L=%d, "
                           "win_s=%d): a device's releases are all nodes of one tree shape or none is, or a range "
                           "query would count events twice; give the reconfigured device a new id"
                           % (rel.dev, other[0], other[1], other[2], rel.mode, rel.L, rel.win_s))
        cache[rel.dev] = shape

    def _insert_release(self, cur: Any, rel: Release, topic: Optional[str], now: float) -> str:
        cur = self._x(cur, "INSERT INTO releases (%s) VALUES (%s) ON CONFLICT (device, elo, ehi, part) DO NOTHING"
                      % (", ".join(_INSERT_COLS), ", ".join("?" * len(_INSERT_COLS))),
                      insert_values(rel, topic, now, self.compress_min_bytes()))
        if cur.rowcount == 0:  # another aggregator stored the key meanwhile (PostgreSQL): classify against it
            existing = self._classify(cur, rel, now)
            if existing is not None:
                return existing
            raise RuntimeError("release key %r neither inserted nor found" % (rel.key,))
        return "stored"

    def _classify(self, cur: Any, rel: Release, now: float) -> Optional[str]:
        row = self._x(cur, "SELECT sha256, seq FROM releases WHERE device = ? AND elo = ? AND ehi = ? AND part = ?",
                      rel.key).fetchone()
        if row is None:
            return None
        if row[0] == rel.sha256:
            self._x(cur, "INSERT INTO duplicates (device, elo, ehi, part, received) VALUES (?, ?, ?, ?, ?)",
                    rel.key + (now,))
            return "duplicate"
        raise Rejected("conflict", "release (dev %s, epochs [%d, %d), part %d) is already stored with different "
                       "bytes (stored seq %d, this seq %d): noise re-drawn or device state reset? "
                       "the stored one is kept" % (rel.dev, rel.elo, rel.ehi, rel.part, row[1], rel.seq))

    def _apply_rollups(self, cur: Any, accs: dict[tuple[Any, ...], _Acc]) -> None:
        """Add a group's increments to the roll-ups (sorted: concurrent writers lock rows in one order)."""
        noise: list[tuple[Any, ...]] = []
        devs: list[tuple[Any, ...]] = []
        # PostgreSQL: each writer adds to roll-up rows of its own shard (PgStore), so concurrent
        # aggregators never wait on one hot row; readers sum every row of a window (query.core)
        shard = self._rollup_shard
        kc, kw, ka = ((", shard", " AND shard = ?", (shard,)) if shard is not None else ("", "", ()))
        for key in sorted(accs):
            acc = accs[key]
            d, w = key[3], key[4]
            self._x(cur, "INSERT INTO rollups (win_s, win, kind, d, w, hv, salt%s, releases, t0, t1, sums) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?%s, 0, ?, ?, ?) "
                         "ON CONFLICT (win_s, win, kind, d, w, hv, salt%s) DO NOTHING" % (kc, ", ?" * len(ka), kc),
                    key + ka + (acc.t0, acc.t1, np.zeros(d * w, dtype="<i8").tobytes()))
            rid, n, t0, t1, blob = self._x(
                cur, "SELECT id, releases, t0, t1, sums FROM rollups WHERE win_s = ? AND win = ? AND kind = ? "
                     "AND d = ? AND w = ? AND hv = ? AND salt = ?" + kw + self._for_update, key + ka).fetchone()
            sums = np.frombuffer(blob, dtype="<i8").reshape(d, w) + acc.sums
            self._x(cur, "UPDATE rollups SET releases = ?, t0 = ?, t1 = ?, sums = ? WHERE id = ?",
                    (int(n) + acc.releases, min(int(t0), acc.t0), max(int(t1), acc.t1),
                     sums.astype("<i8").tobytes(), rid))
            noise += [(rid, mech, num, den, c) for (mech, num, den), c in sorted(acc.noise.items())]
            devs += [(rid, dev) for dev in sorted(acc.devices)]
        if noise:  # one batch each (PostgreSQL: pipelined, one round trip)
            cur.executemany(self._sql("INSERT INTO rollup_noise (rollup, mech, num, den, count) VALUES (?, ?, ?, ?, ?) "
                                      "ON CONFLICT (rollup, mech, num, den) DO UPDATE "
                                      "SET count = rollup_noise.count + excluded.count"), noise)
        if devs:
            cur.executemany(self._sql("INSERT INTO rollup_devices (rollup, device) VALUES (?, ?) "
                                      "ON CONFLICT (rollup, device) DO NOTHING"), devs)

    def _rebuild_rollups(self, cur: Any) -> None:
        """Recompute every roll-up from the stored releases (one window at a time)."""
        for t in ("rollup_devices", "rollup_noise", "rollups"):
            cur.execute("DELETE FROM " + t)
        wins = self._x(cur, "SELECT DISTINCT win_s, win FROM releases ORDER BY win_s, win").fetchall()
        cols = _select_cols(self._release_columns(cur))
        unrolled = False
        for win_s, win in wins:
            accs: dict[tuple[Any, ...], _Acc] = {}
            rows = self._x(cur, "SELECT %s, payload FROM releases WHERE win_s = ? AND win = ?" % cols,
                           (win_s, win)).fetchall()
            for row in rows:
                r = _row_to_release(row, True)
                key = rollup_key(r)
                if key is None:
                    unrolled = True
                    continue
                acc = accs.get(key)
                if acc is None:
                    acc = accs[key] = _Acc(np.zeros((r.d, r.w), dtype=np.int64))
                acc.add(r, r.counters())
            self._apply_rollups(cur, accs)
        if unrolled:
            self._mark_unrolled(cur)

    def _mark_unrolled(self, cur: Any) -> None:
        """Note that the store holds releases no roll-up sums (dcs, dbits, tree nodes): fleet-wide
        queries then merge raw releases, so a selection mixing them with cms/cs is reported, not
        answered from the roll-ups alone."""
        self._x(cur, "INSERT INTO meta (key, value) VALUES ('unrolled', '1') ON CONFLICT (key) DO NOTHING")

    def has_unrolled(self) -> bool:
        """Whether any stored release is outside the roll-ups (see :meth:`_mark_unrolled`)."""
        return self._meta("unrolled") == "1"

    def put_status(self, device: str, doc: dict[str, Any], received: Optional[float] = None) -> bool:
        """Keep ``doc`` as ``device``'s latest status (docs/FORMAT.md section 3); True if anything changed.

        ``doc`` is a parsed status object (host_tools/ingest/devstatus.py validates it). A status without
        ``next_seq`` (the last will ``{"state": "offline"}``) only updates the device's state and keeps
        the numbers of its last full status; a full status older (by its ``ts``) than the one kept is
        ignored (a retained copy delivered again, messages crossing), so the numbers never go back.
        """
        if self.readonly:
            raise PermissionError("store opened read-only")
        import json

        now = time.time() if received is None else received
        state = str(doc.get("state", "online"))[:32]
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
        full = doc.get("next_seq") is not None

        def tx(cur: Any) -> bool:
            row = self._x(cur, "SELECT ts, doc, state FROM device_status WHERE device = ?", (device,)).fetchone()
            if not full:
                if row is None:
                    self._x(cur, "INSERT INTO device_status (device, received, doc, state, state_received) "
                                 "VALUES (?, ?, ?, ?, ?)", (device, now, text, state, now))
                    return True
                if row[2] == state:
                    return False
                self._x(cur, "UPDATE device_status SET state = ?, state_received = ? WHERE device = ?",
                        (state, now, device))
                return True
            ts = doc.get("ts")
            if row is not None and row[0] is not None and ts is not None and ts < row[0]:
                return False
            if row is not None and row[1] == text and row[2] == state:
                return False
            vals = tuple(doc.get(k) for k in STATUS_INTS)
            cols = ("received",) + STATUS_INTS + ("doc", "state", "state_received")
            self._x(cur, "INSERT INTO device_status (device, %s) VALUES (?, %s) ON CONFLICT (device) DO UPDATE SET %s"
                    % (", ".join(cols), ", ".join("?" * len(cols)), ", ".join("%s = excluded.%s" % (c, c) for c in cols)),
                    (device, now) + vals + (text, state, now))
            return True

        return bool(self._exec_tx(tx))
