"""SQLite store of validated releases (WAL; several aggregators may share it).

Tables (schema version 1)::

    releases    one row per release, PRIMARY KEY (device, elo, ehi, part);
                every map field, the raw payload bytes, their SHA-256, the
                topic and the time received
    devices     per device the parameters fixed by its first release
                (salt id, hash version, kind, d, w, ep_s)
    rejections  every refused message: time, topic, device (if known),
                code, reason, size, SHA-256 and the bytes (if <= max_bytes)
    duplicates  redeliveries of a stored release (identical bytes)
    device_status  per device the latest status message it published
                (docs/FORMAT.md section 3: next_seq, oldest_pending,
                pending, acked_seq, rejected, ts, and online/offline);
                written by host_tools/devstatus.py, read by ``status``
                to tell lost releases from pending ones

Idempotency (DESIGN.md "Host"): a release whose key is stored with
identical bytes is a *duplicate* (QoS 1 redelivery, the device retrying
after a lost ack) and changes nothing but the duplicates log; the same key
with *different* bytes is a *conflict* and is rejected: a device never
generates a release twice, so different bytes mean re-drawn noise (which
would average away privacy if both were kept) or a forged/reset device.
The first stored version is kept.

Older databases (written before releases carried ``nz``) lack the
``releases.nz`` column. Opening one for writing adds it with
``ALTER TABLE ... DEFAULT 2`` (those releases came from devices that drew
exactly one internal and one output noise value per cell); a read-only
open reads such rows as nz = 2 without changing the file. Likewise
``rejections.seq`` (the refused release's seq, when its bytes parse that
far and name the topic's device) is added and filled in from the kept
bytes; a read-only open of such a file attributes no seq to old
rejections.

Concurrency: each insert runs in one ``BEGIN IMMEDIATE`` transaction (the
device check, the key check and the insert see the same snapshot and no
other writer can interleave), with a busy timeout, so any number of
aggregator processes can write to one file. Opening is retried the same
way: several processes opening a fresh file at once race to switch it to
WAL, and SQLite refuses the loser immediately ("database is locked", no
busy wait for a read-to-write lock upgrade). ``synchronous=FULL``: a
commit is on disk before the aggregator acknowledges the MQTT message.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import numpy as np

from host_tools.decode import Rejected, Release

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS releases (
    device TEXT NOT NULL, elo INTEGER NOT NULL, ehi INTEGER NOT NULL, part INTEGER NOT NULL,
    seq INTEGER NOT NULL, win INTEGER NOT NULL, win_s INTEGER NOT NULL, ep_s INTEGER NOT NULL,
    t0 INTEGER NOT NULL, t1 INTEGER NOT NULL, mode TEXT NOT NULL, kind TEXT NOT NULL,
    d INTEGER NOT NULL, w INTEGER NOT NULL, hv INTEGER NOT NULL, salt TEXT NOT NULL,
    clip INTEGER NOT NULL, mech TEXT NOT NULL, budget_num INTEGER NOT NULL, budget_den INTEGER NOT NULL,
    nint_num INTEGER NOT NULL, nint_den INTEGER NOT NULL, nout_num INTEGER NOT NULL, nout_den INTEGER NOT NULL,
    nz INTEGER NOT NULL, L INTEGER NOT NULL, sha256 TEXT NOT NULL, payload BLOB NOT NULL, ctr_off INTEGER NOT NULL,
    topic TEXT, received REAL NOT NULL,
    v INTEGER NOT NULL DEFAULT 1, lvl INTEGER NOT NULL DEFAULT 0, b INTEGER NOT NULL DEFAULT 0,
    map_num INTEGER, map_den INTEGER, map_off INTEGER,
    PRIMARY KEY (device, elo, ehi, part)
);
CREATE INDEX IF NOT EXISTS releases_win ON releases (win, win_s);
CREATE INDEX IF NOT EXISTS releases_t0 ON releases (t0);
CREATE TABLE IF NOT EXISTS devices (
    device TEXT PRIMARY KEY, salt TEXT NOT NULL, hv INTEGER NOT NULL, kind TEXT NOT NULL,
    d INTEGER NOT NULL, w INTEGER NOT NULL, ep_s INTEGER NOT NULL, first_received REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS rejections (
    id INTEGER PRIMARY KEY AUTOINCREMENT, received REAL NOT NULL, topic TEXT, device TEXT,
    code TEXT NOT NULL, reason TEXT NOT NULL, size INTEGER NOT NULL, sha256 TEXT, payload BLOB, seq INTEGER
);
CREATE TABLE IF NOT EXISTS duplicates (
    device TEXT NOT NULL, elo INTEGER NOT NULL, ehi INTEGER NOT NULL, part INTEGER NOT NULL,
    received REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS device_status (
    device TEXT PRIMARY KEY, received REAL NOT NULL, ts INTEGER, next_seq INTEGER, oldest_pending INTEGER,
    pending INTEGER, acked_seq INTEGER, rejected INTEGER, doc TEXT NOT NULL,
    state TEXT NOT NULL, state_received REAL NOT NULL
);
"""

# status fields kept as columns (non-negative integers or null)
STATUS_INTS = ("ts", "next_seq", "oldest_pending", "pending", "acked_seq", "rejected")

# release columns read back for queries (payload last)
_COLS = ("device", "elo", "ehi", "part", "seq", "win", "win_s", "ep_s", "t0", "t1", "mode", "kind", "d", "w",
         "hv", "salt", "clip", "mech", "budget_num", "budget_den", "nint_num", "nint_den", "nout_num",
         "nout_den", "nz", "L", "received", "ctr_off", "v", "lvl", "b", "map_num", "map_den", "map_off")
# columns added after schema version 1 first shipped: (name, SQL type and default, value for old rows)
_ADDED = (("nz", "INTEGER NOT NULL DEFAULT 2", "2"), ("v", "INTEGER NOT NULL DEFAULT 1", "1"),
          ("lvl", "INTEGER NOT NULL DEFAULT 0", "0"), ("b", "INTEGER NOT NULL DEFAULT 0", "0"),
          ("map_num", "INTEGER", "NULL"), ("map_den", "INTEGER", "NULL"), ("map_off", "INTEGER", "NULL"))


@dataclass(frozen=True)
class DeviceStatus:
    """The latest status a device published (docs/FORMAT.md section 3), as kept by the store."""

    device: str
    received: float  # when the host received the status these numbers come from
    ts: Optional[int]  # the device's own time stamp of it
    next_seq: Optional[int]
    oldest_pending: Optional[int]
    pending: Optional[int]
    acked_seq: Optional[int]
    rejected: Optional[int]
    doc: dict[str, Any]
    state: str  # 'online' | 'offline' (last will) | whatever the device said
    state_received: float


def rejected_seq(payload: Optional[bytes], device: Optional[str]) -> Optional[int]:
    """The seq of a refused release, when its bytes decode to a map naming ``device`` (else None)."""
    if payload is None or device is None:
        return None
    try:
        import cbor2

        m = cbor2.loads(bytes(payload))
    except Exception:  # garbage, truncated, too deep: no seq to attribute
        return None
    if not isinstance(m, dict) or m.get("dev") != device:
        return None
    seq = m.get("seq")
    return seq if isinstance(seq, int) and not isinstance(seq, bool) and 0 <= seq < 1 << 63 else None


@dataclass(frozen=True)
class StoredRelease:
    """A release row as read back (counters decoded on demand)."""

    device: str
    elo: int
    ehi: int
    part: int
    seq: int
    win: int
    win_s: int
    ep_s: int
    t0: int
    t1: int
    mode: str
    kind: str
    d: int
    w: int
    hv: int
    salt: str
    clip: int
    mech: str
    budget: tuple[int, int]
    nint: tuple[int, int]
    nout: tuple[int, int]
    nz: int  # noise draws per cell: (nz - 1) x nint + 1 x nout
    L: int
    received: float
    ctr_off: int
    payload: Optional[bytes] = None
    v: int = 1
    lvl: int = 0
    b: int = 0  # dcs: domain bits
    map: Optional[tuple[int, int, int]] = None  # dcs: (scale_num, scale_den, offset)

    @property
    def levels(self) -> int:
        return self.b + 1 if self.kind == "dcs" else 1

    @property
    def rows(self) -> int:
        return self.levels * self.d

    @property
    def shape(self) -> tuple[int, int]:
        return (1, self.d) if self.kind == "dbits" else (self.rows, self.w)

    @property
    def group(self) -> tuple[Any, ...]:
        if self.kind == "dcs":
            return (self.kind, self.d, self.w, self.hv, self.salt, self.b, self.map)
        return (self.kind, self.d, self.w, self.hv, self.salt)

    def counters(self) -> np.ndarray:
        """int32 counters, shape (levels * d, w) (levels = 1 except kind dcs)."""
        if self.payload is None:
            raise ValueError("release loaded without its payload")
        r, c = self.shape
        return np.frombuffer(self.payload, dtype="<i4", count=r * c, offset=self.ctr_off).reshape(r, c)


def _locked(exc: BaseException) -> bool:
    """SQLITE_BUSY / SQLITE_LOCKED: another connection holds the lock; worth retrying."""
    msg = str(exc).lower()
    return "locked" in msg or "busy" in msg


def _row_to_release(r: tuple[Any, ...], with_payload: bool) -> StoredRelease:
    (device, elo, ehi, part, seq, win, win_s, ep_s, t0, t1, mode, kind, d, w, hv, salt, clip, mech,
     bn, bd, inn, ind, onn, ond, nz, L, received, ctr_off, v, lvl, b, mn, md, mo) = r[:34]
    return StoredRelease(device, elo, ehi, part, seq, win, win_s, ep_s, t0, t1, mode, kind, d, w, hv, salt, clip,
                         mech, (bn, bd), (inn, ind), (onn, ond), nz, L, received, ctr_off,
                         bytes(r[34]) if with_payload else None, v, lvl, b,
                         (mn, md, mo) if mn is not None else None)


class Store:
    """The release database at ``path`` (created if missing unless ``readonly``)."""

    def __init__(self, path: str, readonly: bool = False, timeout: float = 30.0) -> None:
        self.path = path
        self.readonly = readonly
        self._lock = threading.Lock()
        if readonly:
            import os

            if not os.path.exists(path):
                raise FileNotFoundError("no database at %s (run `pansketch aggregate` first)" % path)
        self.timeout = timeout
        self.db = sqlite3.connect(path, timeout=timeout, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA busy_timeout = %d" % int(timeout * 1000))
        if not readonly:
            # The switch to WAL takes the write lock while holding a read lock; when several
            # processes open a fresh file at once SQLite refuses one of them at once with
            # "database is locked" instead of waiting (no busy handler for a lock upgrade that
            # could deadlock), so it is retried like a busy BEGIN IMMEDIATE.
            mode = self._retry_locked(lambda: self.db.execute("PRAGMA journal_mode = WAL").fetchone()[0])
            if str(mode).lower() != "wal":
                raise sqlite3.OperationalError("cannot switch %s to WAL journal mode (got %s)" % (path, mode))
            self.db.execute("PRAGMA synchronous = FULL")
            self._exec_tx(self._init_schema)
        else:
            self.db.execute("PRAGMA query_only = 1")
        have = self._retry_locked(self._columns)
        old = {name: dflt for name, _, dflt in _ADDED}
        self._cols = ", ".join(c if c not in old or c in have else "%s AS %s" % (old[c], c) for c in _COLS)
        v = self._retry_locked(lambda: self._meta("schema_version"))
        if v is not None and int(v) != SCHEMA_VERSION:
            raise sqlite3.DatabaseError("%s has schema version %s; this pansketch reads %d" % (path, v, SCHEMA_VERSION))

    # -- plumbing ------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            self.db.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _columns(self) -> set[str]:
        cols = {r[1] for r in self.db.execute("PRAGMA table_info(releases)").fetchall()}
        return cols or set(_COLS)  # no table yet (read-only open of an empty file): nothing to adapt

    def _init_schema(self, cur: sqlite3.Cursor) -> None:
        for stmt in _SCHEMA.split(";"):
            if stmt.strip():
                cur.execute(stmt)
        cols = {r[1] for r in cur.execute("PRAGMA table_info(releases)").fetchall()}
        for name, decl, _ in _ADDED:  # a database from before releases carried nz, v, lvl, b, map
            if name not in cols:
                cur.execute("ALTER TABLE releases ADD COLUMN %s %s" % (name, decl))
        rcols = {r[1] for r in cur.execute("PRAGMA table_info(rejections)").fetchall()}
        if "seq" not in rcols:  # before status told lost from rejected releases: attribute the old ones
            cur.execute("ALTER TABLE rejections ADD COLUMN seq INTEGER")
            for rid, dev, pl in cur.execute("SELECT id, device, payload FROM rejections "
                                            "WHERE device IS NOT NULL AND payload IS NOT NULL").fetchall():
                seq = rejected_seq(pl, dev)
                if seq is not None:
                    cur.execute("UPDATE rejections SET seq = ? WHERE id = ?", (seq, rid))
        cur.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))

    def _meta(self, key: str) -> Optional[str]:
        try:
            r = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):  # a read-only open of a file no aggregator has written yet
                return None
            raise
        return r[0] if r else None

    def _retry_locked(self, fn: Any) -> Any:
        """fn() retried with backoff while SQLite says the database is locked/busy (up to 2x timeout)."""
        delay = 0.01
        deadline = time.monotonic() + max(60.0, 2 * self.timeout)
        while True:
            try:
                return fn()
            except sqlite3.OperationalError as exc:
                if not _locked(exc) or time.monotonic() >= deadline:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _exec_tx(self, fn: Any, *args: Any) -> Any:
        """Run fn(cursor, *args) in one BEGIN IMMEDIATE transaction (retried while locked)."""
        with self._lock:
            delay = 0.01
            deadline = time.monotonic() + max(60.0, 2 * self.timeout)
            while True:
                cur = self.db.cursor()
                try:
                    cur.execute("BEGIN IMMEDIATE")
                except sqlite3.OperationalError as exc:
                    if _locked(exc) and time.monotonic() < deadline:
                        time.sleep(delay)
                        delay = min(delay * 2, 0.5)
                        continue
                    raise
                try:
                    out = fn(cur, *args)
                    cur.execute("COMMIT")
                    return out
                except BaseException:
                    cur.execute("ROLLBACK")
                    raise

    # -- writes --------------------------------------------------------
    def insert(self, rel: Release, topic: Optional[str] = None, received: Optional[float] = None) -> str:
        """Store ``rel``: returns 'stored' or 'duplicate'; raises Rejected('device'|'conflict')."""
        if self.readonly:
            raise PermissionError("store opened read-only")
        now = time.time() if received is None else received
        return self._exec_tx(self._insert, rel, topic, now)

    def _insert(self, cur: sqlite3.Cursor, rel: Release, topic: Optional[str], now: float) -> str:
        row = cur.execute("SELECT sha256, seq FROM releases WHERE device = ? AND elo = ? AND ehi = ? AND part = ?",
                          rel.key).fetchone()
        if row is not None:
            if row[0] == rel.sha256:
                cur.execute("INSERT INTO duplicates (device, elo, ehi, part, received) VALUES (?, ?, ?, ?, ?)",
                            rel.key + (now,))
                return "duplicate"
            raise Rejected("conflict", "release (dev %s, epochs [%d, %d), part %d) is already stored with different "
                           "bytes (stored seq %d, this seq %d): noise re-drawn or device state reset? "
                           "the stored one is kept" % (rel.dev, rel.elo, rel.ehi, rel.part, row[1], rel.seq))
        dev = cur.execute("SELECT salt, hv, kind, d, w, ep_s FROM devices WHERE device = ?", (rel.dev,)).fetchone()
        mine = (rel.salt, rel.hv, rel.kind, rel.d, rel.w, rel.ep_s)
        if dev is None:
            cur.execute("INSERT INTO devices (device, salt, hv, kind, d, w, ep_s, first_received) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", (rel.dev,) + mine + (now,))
        elif tuple(dev) != mine:
            names = ("salt id", "hash version", "kind", "d", "w", "ep_s")
            diffs = ["%s %s -> %s" % (n, a, b) for n, a, b in zip(names, dev, mine) if a != b]
            raise Rejected("device", "device %s changed parameters its earlier releases fixed (%s); "
                           "give the reconfigured device a new id" % (rel.dev, ", ".join(diffs)))
        cur.execute(
            "INSERT INTO releases (device, elo, ehi, part, seq, win, win_s, ep_s, t0, t1, mode, kind, d, w, hv, salt, "
            "clip, mech, budget_num, budget_den, nint_num, nint_den, nout_num, nout_den, nz, L, sha256, payload, "
            "ctr_off, topic, received, v, lvl, b, map_num, map_den, map_off) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
            "?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (rel.dev, rel.elo, rel.ehi, rel.part, rel.seq, rel.win, rel.win_s, rel.ep_s, rel.t0, rel.t1, rel.mode,
             rel.kind, rel.d, rel.w, rel.hv, rel.salt, rel.clip, rel.mech, rel.budget[0], rel.budget[1], rel.nint[0],
             rel.nint[1], rel.nout[0], rel.nout[1], rel.nz, rel.L, rel.sha256, rel.payload, rel.ctr_off, topic, now,
             rel.v, rel.lvl, rel.b) + (tuple(rel.map) if rel.map is not None else (None, None, None)))
        return "stored"

    def reject(self, code: str, reason: str, payload: bytes, topic: Optional[str] = None,
               device: Optional[str] = None, received: Optional[float] = None, keep_bytes: int = 1 << 20) -> None:
        """Log a refused message (the bytes are kept when at most ``keep_bytes``)."""
        import hashlib

        now = time.time() if received is None else received
        keep = bytes(payload) if len(payload) <= keep_bytes else None
        seq = rejected_seq(keep, device)
        self._exec_tx(lambda cur: cur.execute(
            "INSERT INTO rejections (received, topic, device, code, reason, size, sha256, payload, seq) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (now, topic, device, code, reason, len(payload), hashlib.sha256(payload).hexdigest(), keep, seq)))

    def put_status(self, device: str, doc: dict[str, Any], received: Optional[float] = None) -> bool:
        """Keep ``doc`` as ``device``'s latest status (docs/FORMAT.md section 3); True if anything changed.

        ``doc`` is a parsed status object (host_tools/devstatus.py validates it). A status without
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

        def tx(cur: sqlite3.Cursor) -> bool:
            row = cur.execute("SELECT ts, doc, state FROM device_status WHERE device = ?", (device,)).fetchone()
            if not full:
                if row is None:
                    cur.execute("INSERT INTO device_status (device, received, doc, state, state_received) "
                                "VALUES (?, ?, ?, ?, ?)", (device, now, text, state, now))
                    return True
                if row[2] == state:
                    return False
                cur.execute("UPDATE device_status SET state = ?, state_received = ? WHERE device = ?",
                            (state, now, device))
                return True
            ts = doc.get("ts")
            if row is not None and row[0] is not None and ts is not None and ts < row[0]:
                return False
            if row is not None and row[1] == text and row[2] == state:
                return False
            vals = tuple(doc.get(k) for k in STATUS_INTS)
            cur.execute("INSERT OR REPLACE INTO device_status (device, received, %s, doc, state, state_received) "
                        "VALUES (?, ?, %s, ?, ?, ?)" % (", ".join(STATUS_INTS), ", ".join("?" * len(STATUS_INTS))),
                        (device, now) + vals + (text, state, now))
            return True

        return bool(self._exec_tx(tx))

    # -- reads ---------------------------------------------------------
    def _q(self, sql: str, args: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self.db.execute(sql, tuple(args)).fetchall()

    def releases(self, devices: Optional[Iterable[str]] = None, window: Optional[int] = None,
                 since: Optional[float] = None, until: Optional[float] = None,
                 with_payload: bool = False) -> list[StoredRelease]:
        """Releases filtered by device(s), window id, and [since, until) containment."""
        where: list[str] = []
        args: list[Any] = []
        if devices is not None:
            devs = list(devices)
            where.append("device IN (%s)" % ",".join("?" * len(devs)))
            args += devs
        if window is not None:
            where.append("win = ?")
            args.append(window)
        if since is not None:
            where.append("t0 >= ?")
            args.append(since)
        if until is not None:
            where.append("t1 <= ?")
            args.append(until)
        sql = "SELECT %s%s FROM releases" % (self._cols, ", payload" if with_payload else "")
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY device, elo, part"
        return [_row_to_release(r, with_payload) for r in self._q(sql, args)]

    def count_partial(self, since: Optional[float], until: Optional[float],
                      devices: Optional[Iterable[str]] = None) -> int:
        """Releases that overlap [since, until) without lying inside it (cannot be split)."""
        lo = since if since is not None else -1
        hi = until if until is not None else 1 << 62
        args: list[Any] = [hi, lo, lo, hi]
        sql = "SELECT COUNT(*) FROM releases WHERE t0 < ? AND t1 > ? AND NOT (t0 >= ? AND t1 <= ?)"
        if devices is not None:
            devs = list(devices)
            sql += " AND device IN (%s)" % ",".join("?" * len(devs))
            args += devs
        return int(self._q(sql, args)[0][0])

    def release_count(self) -> int:
        return int(self._q("SELECT COUNT(*) FROM releases")[0][0])

    def payload(self, device: str, elo: int, ehi: int, part: int) -> Optional[bytes]:
        r = self._q("SELECT payload FROM releases WHERE device = ? AND elo = ? AND ehi = ? AND part = ?",
                    (device, elo, ehi, part))
        return bytes(r[0][0]) if r else None

    def devices(self) -> list[tuple[Any, ...]]:
        """(device, salt, hv, kind, d, w, ep_s, first_received) per known device."""
        return self._q("SELECT device, salt, hv, kind, d, w, ep_s, first_received FROM devices ORDER BY device")

    def rejections(self, limit: Optional[int] = None) -> list[tuple[Any, ...]]:
        """(id, received, topic, device, code, reason, size, sha256), newest first."""
        sql = "SELECT id, received, topic, device, code, reason, size, sha256 FROM rejections ORDER BY id DESC"
        if limit is not None:
            sql += " LIMIT %d" % int(limit)
        return self._q(sql)

    def rejection_counts(self) -> list[tuple[str, int, float]]:
        """(code, count, last received) per rejection code, most frequent first."""
        return self._q("SELECT code, COUNT(*), MAX(received) FROM rejections GROUP BY code ORDER BY COUNT(*) DESC, code")

    def device_activity(self) -> list[tuple[str, int, float, int]]:
        """(device, releases, last received, end of its latest epochs) per device with releases."""
        return self._q("SELECT device, COUNT(*), MAX(received), MAX(t1) FROM releases GROUP BY device ORDER BY device")

    def device_statuses(self) -> dict[str, DeviceStatus]:
        """The latest status of every device that published one (empty for a database without the table)."""
        import json

        try:
            rows = self._q("SELECT device, received, %s, doc, state, state_received FROM device_status"
                           % ", ".join(STATUS_INTS))
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):  # written before devices reported status
                return {}
            raise
        out = {}
        for r in rows:
            try:
                doc = json.loads(r[8])
            except ValueError:  # pragma: no cover (we wrote it)
                doc = {}
            out[r[0]] = DeviceStatus(r[0], r[1], *r[2:8], doc if isinstance(doc, dict) else {}, r[9], r[10])
        return out

    def rejected_seqs(self) -> dict[str, dict[int, str]]:
        """Per device, the seqs of releases the host refused and the (last) rejection code of each."""
        try:
            rows = self._q("SELECT device, seq, code FROM rejections WHERE seq IS NOT NULL AND device IS NOT NULL "
                           "ORDER BY id")
        except sqlite3.OperationalError as exc:
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
        import hashlib

        h = hashlib.sha256()
        for r in self._q("SELECT device, elo, ehi, part, sha256 FROM releases ORDER BY device, elo, ehi, part"):
            h.update(repr(tuple(r)).encode())
        for r in self._q("SELECT device, salt, hv, kind, d, w, ep_s FROM devices ORDER BY device"):
            h.update(repr(tuple(r)).encode())
        return (self.release_count(), self.rejection_count(), self.duplicate_count(), h.hexdigest())
