"""The release store: an SQL backend interface, with SQLite (default) and PostgreSQL.

:func:`open_store` picks the backend from ``[aggregator] db``: a file path
is SQLite (:class:`Store`, this module; WAL, several aggregator processes
on one host may share the file), a ``postgresql://`` URL is PostgreSQL
(:class:`host_tools.store.pg.PgStore`; any number of aggregators on any
number of hosts). Both run the same SQL from :class:`SQLStore`; a backend
supplies the connection, the transaction start, its DDL and its error types.

Tables (schema version 1)::

    releases        one row per release, PRIMARY KEY (elo, device, ehi, part)
                    in a SQLite file created by this version (TIME_KEY),
                    (device, elo, ehi, part) in older files and on PostgreSQL
                    (DEVICE_KEY); every map field, the raw payload bytes
                    (empty once retention pruned them: SQLStore.prune), their
                    SHA-256, the topic and the time received
    devices         per device the parameters fixed by its first release
                    (salt id, hash version, kind, d, w, ep_s); SQLite also
                    keeps there its highest stored seq (max_seq) and its
                    releases' shape (shape: "mode L win_s"), read by the
                    seq-jump and tree-shape checks instead of its releases
                    (NULL in rows written before: those read the releases)
    rejections      refused messages: time, topic (first 256 characters),
                    device (if known), code, reason, size, SHA-256 and a
                    bounded prefix of the bytes (``reject_keep_bytes``); capped
                    in rows and bytes and pruned after a retention period
                    (:class:`Limits`, docs/HOST.md "Hostile input")
    rejection_totals per code: how many messages were refused and their
                    bytes, since the database was created (never pruned)
    quarantine      valid releases held back as likely forgeries: a window
                    starting beyond now + the clock-skew allowance, or a seq
                    jump beyond ``max_seq_jump``; one row per distinct payload
                    (re-sends counted), never merged, capped like rejections
    duplicates      redeliveries of a stored release (identical bytes)
    device_status   per device the latest status message it published
                    (docs/FORMAT.md section 3: next_seq, oldest_pending,
                    pending, acked_seq, rejected, ts, and online/offline);
                    written by host_tools/ingest/devstatus.py, read by ``status``
                    to tell lost releases from pending ones
    rollups         per (window length, window id, kind, d, w, hv, salt id):
                    the int64 sum of the counters of every stored release of
                    that window, the number of releases, the covered time
                    extent [t0, t1)
    rollup_noise    per roll-up the noise draws per cell: (mech, num, den) ->
                    count, exactly the terms host_tools.query.merge adds up
    rollup_devices  per roll-up the devices that contributed

Roll-ups are maintained at ingest, in the same transaction as the releases
they sum, for every v1 release (modes window and keep, kinds cms and cs),
keyed by the window and the full merge group, so any new kind or shape gets
its own roll-ups; a selection a roll-up cannot answer exactly (one device,
releases straddling a range bound, several merge groups) is merged from
the raw releases (host_tools.query.core). A database written before roll-ups
existed gets them rebuilt from its releases when an aggregator opens it
for writing; read-only readers of such a file merge raw releases.

Idempotency (DESIGN.md "Host"), enforced by the database: the release key
is the primary key and the insert is ``ON CONFLICT DO NOTHING``. A release
whose key is stored with identical bytes is a *duplicate* (QoS 1
redelivery, the device retrying after a lost ack) and changes nothing but
the duplicates log; the same key with *different* bytes is a *conflict*
and is rejected: a device never generates a release twice, so different
bytes mean re-drawn noise (which would average away privacy if both were
kept) or a forged/reset device. The first stored version is kept.

Group commit (:meth:`SQLStore.commit_group`): the aggregator stores a
batch of messages in one transaction with one ``SAVEPOINT`` per message:
a message whose storage fails (conflict, device parameters, a database
error on that row) is rolled back alone and the others commit. The
aggregator acknowledges the messages only after the commit.

Older databases (written before releases carried ``nz``) lack the
``releases.nz`` column. Opening one for writing adds it with
``ALTER TABLE ... DEFAULT 2`` (those releases came from devices that drew
exactly one internal and one output noise value per cell); a read-only
open reads such rows as nz = 2 without changing the file (the same for
``releases.lvl``, format v2's tree level, default 0: the level of every
window/keep and v1 release). A device's releases are all tree nodes of
one shape (L, win_s) or none is (code ``device``): mixing would let a
range query count the same events twice. Likewise
``rejections.seq`` (the refused release's seq, when its bytes parse that
far and name the topic's device) is added and filled in from the kept
bytes; a read-only open of such a file attributes no seq to old
rejections.

SQLite concurrency: each group runs in one ``BEGIN IMMEDIATE`` transaction
(the checks and inserts see one snapshot and no other writer interleaves),
with a busy timeout, so any number of aggregator processes can write to
one file. Opening is retried the same way: several processes opening a
fresh file at once race to switch it to WAL, and SQLite refuses the loser
immediately ("database is locked", no busy wait for a read-to-write lock
upgrade). ``synchronous=FULL``: a commit is on disk before the aggregator
acknowledges the MQTT message. The aggregator's writer instead asks for
deferred syncs (:meth:`Store.defer_sync`): its group commits return without
waiting for the disk, and it calls :meth:`Store.sync_committed` (an fsync
of the WAL, off the writer's thread) before acknowledging anything they
stored, so the next group is written while the last one reaches the disk.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional, Sequence

import numpy as np

from host_tools import cborscan
from host_tools.store import pagecache
from host_tools.store.records import Rejected, Release, ReleaseParams, SketchShape

_log = logging.getLogger("pansketch.store")

SCHEMA_VERSION = 1
ROLLUP_MODES = ("window", "keep")
ROLLUP_KINDS = ("cms", "cs")

# The release key's column order. PostgreSQL keeps the device first. A new SQLite file puts the epoch first
# (``Store``): a group commit from many devices then adds its keys to a few neighbouring index pages, where
# device-first scattered them over one 16 KiB page per device, each written whole to the WAL and again by
# the checkpoint (docs/HOST.md, Performance). Both orders are one UNIQUE key to ``ON CONFLICT``.
DEVICE_KEY = "device, elo, ehi, part"
TIME_KEY = "elo, device, ehi, part"

_SCHEMA_TMPL = """
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
    PRIMARY KEY (%(key)s)
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
CREATE INDEX IF NOT EXISTS rejections_received ON rejections (received);
CREATE TABLE IF NOT EXISTS rejection_totals (
    code TEXT PRIMARY KEY, count INTEGER NOT NULL, bytes INTEGER NOT NULL, first REAL NOT NULL, last REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS quarantine (
    id INTEGER PRIMARY KEY AUTOINCREMENT, received REAL NOT NULL, last REAL NOT NULL, count INTEGER NOT NULL,
    topic TEXT, device TEXT NOT NULL, seq INTEGER NOT NULL, elo INTEGER NOT NULL, ehi INTEGER NOT NULL,
    part INTEGER NOT NULL, t0 INTEGER NOT NULL, code TEXT NOT NULL, reason TEXT NOT NULL, size INTEGER NOT NULL,
    sha256 TEXT NOT NULL UNIQUE, payload BLOB NOT NULL
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
CREATE TABLE IF NOT EXISTS rollups (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    win_s INTEGER NOT NULL, win INTEGER NOT NULL, kind TEXT NOT NULL, d INTEGER NOT NULL, w INTEGER NOT NULL,
    hv INTEGER NOT NULL, salt TEXT NOT NULL,
    releases INTEGER NOT NULL, t0 INTEGER NOT NULL, t1 INTEGER NOT NULL, sums BLOB NOT NULL,
    UNIQUE (win_s, win, kind, d, w, hv, salt)
);
CREATE INDEX IF NOT EXISTS rollups_win ON rollups (win);
CREATE TABLE IF NOT EXISTS rollup_noise (
    rollup INTEGER NOT NULL, mech TEXT NOT NULL, num INTEGER NOT NULL, den INTEGER NOT NULL,
    count INTEGER NOT NULL, PRIMARY KEY (rollup, mech, num, den)
);
CREATE TABLE IF NOT EXISTS rollup_devices (
    rollup INTEGER NOT NULL, device TEXT NOT NULL, PRIMARY KEY (rollup, device)
);
"""


def schema(key: str) -> str:
    """The DDL with the release key's column order ``key`` (DEVICE_KEY or TIME_KEY)."""
    return _SCHEMA_TMPL % {"key": key}


_SCHEMA = schema(DEVICE_KEY)  # PostgreSQL's (host_tools.store.pg)

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
_INSERT_COLS = ("device", "elo", "ehi", "part", "seq", "win", "win_s", "ep_s", "t0", "t1", "mode", "kind", "d", "w",
                "hv", "salt", "clip", "mech", "budget_num", "budget_den", "nint_num", "nint_den", "nout_num",
                "nout_den", "nz", "L", "sha256", "payload", "ctr_off", "topic", "received", "v", "lvl", "b",
                "map_num", "map_den", "map_off")
_ORDER = "device, elo, ehi, part"  # the order of releases() and iter_counters(): a total one (the key)
# per-device figures kept in ``devices`` by the SQLite store (Store._note_stored): the release key does not
# lead with the device there, so a device's releases are not one index range to probe
_DEVICE_FIGURES = (("max_seq", "INTEGER"), ("shape", "TEXT"))
_CHUNK = 500  # ids per IN (...) list
WAL_KEEP_BYTES = 16 << 20  # SQLite journal_size_limit: a reset WAL file is truncated to this
# Page size of a new database file. A 16.6 KB release (d=4, w=1024) is one 16 KiB overflow page plus
# about 2 KB in its leaf, where 4 KiB pages split it into five: each page is a WAL frame, written with
# two system calls and copied again by the checkpoint, and the kernel's part of that was most of the
# aggregator's CPU (docs/HOST.md, Performance). A file keeps the page size it was created with.
PAGE_SIZE = 16384


def _select_cols(have: Optional[set[str]]) -> str:
    """The release columns to select from a table with columns ``have`` (None: all; old files: "2 AS nz", ...)."""
    old = {name: dflt for name, _, dflt in _ADDED}
    return ", ".join(c if have is None or c not in old or c in have else "%s AS %s" % (old[c], c) for c in _COLS)


def insert_values(rel: Release, topic: Optional[str], received: float) -> tuple[Any, ...]:
    """``rel``'s values for :data:`_INSERT_COLS` (both backends)."""
    return (rel.dev, rel.elo, rel.ehi, rel.part, rel.seq, rel.win, rel.win_s, rel.ep_s, rel.t0, rel.t1, rel.mode,
            rel.kind, rel.d, rel.w, rel.hv, rel.salt, rel.clip, rel.mech, rel.budget[0], rel.budget[1], rel.nint[0],
            rel.nint[1], rel.nout[0], rel.nout[1], rel.nz, rel.L, rel.sha256, rel.payload, rel.ctr_off, topic,
            received, rel.v, rel.lvl, rel.b) + (tuple(rel.map) if rel.map is not None else (None, None, None))


class StoreError(Exception):
    """The store cannot be opened or used (message says what and where)."""


class PrunedError(StoreError, ValueError):
    """A query needs the counters of a release whose payload retention has pruned."""


class NotAStoreError(StoreError, FileNotFoundError):
    """The database file is empty or another program's: like a missing one (the dashboard shows its
    'no data yet' page for both; the CLI prints the one line and exits 1)."""


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
    """The seq of a refused release, when its (well-formed prefix of) bytes name ``device`` (else None).

    Read with the bounded byte-level reader (host_tools.cborscan), never a
    CBOR object decoder: this runs in the aggregator's process (migrations).
    """
    if payload is None or device is None:
        return None
    dev, seq = cborscan.peek(bytes(payload))
    return seq if dev == device else None


@dataclass(frozen=True)
class Limits:
    """Bounds on what refused and quarantined messages may occupy ([aggregator] of host.toml, docs/HOST.md).

    A rejection row holds at most ``keep_bytes`` of the payload plus
    :data:`REJECTION_ROW_OVERHEAD` bytes (topic, device, reason are cut to
    fixed lengths), so ``max_bytes`` lowers the row cap to
    ``max_bytes // (keep_bytes + overhead)``. When a cap is exceeded the
    oldest rows go, down to 90 % of it (pruning is amortised over many
    inserts); rows older than ``retention_s`` go at least once a minute.
    Quarantine rows keep the whole (validated) payload and are capped by
    count and by the sum of their sizes.
    """

    keep_bytes: int = 256
    max_rows: int = 10000
    max_bytes: int = 16 << 20
    retention_s: float = 30 * 86400.0
    quarantine_rows: int = 1000
    quarantine_bytes: int = 64 << 20
    max_seq_jump: int = 100000  # a release more than this above the device's highest stored seq is quarantined

    @property
    def rejection_rows(self) -> int:
        return max(1, min(self.max_rows, self.max_bytes // (self.keep_bytes + REJECTION_ROW_OVERHEAD)))


REJECTION_ROW_OVERHEAD = 1024  # topic (cut to 256 bytes), reason (300), device (64), SHA-256, code, numbers
TOPIC_KEEP = 256
REASON_KEEP = 300


@dataclass(frozen=True)
class StoredRelease(ReleaseParams):
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
    received: float
    ctr_off: int
    payload: Optional[bytes] = None
    v: int = 1
    lvl: int = 0
    b: int = 0  # dcs: domain bits
    map: Optional[tuple[int, int, int]] = None  # dcs: (scale_num, scale_den, offset)

    def counters(self) -> np.ndarray:
        """As :meth:`SketchShape.counters`; a release whose bytes retention pruned says so."""
        if self.payload is not None and not self.payload:  # SQLStore.prune kept the row without the bytes
            raise PrunedError("release %s seq %d (epochs [%d, %d)) was pruned by retention ([aggregator] "
                              "retain_raw_s): its counters live on only in its window's roll-up; query whole "
                              "windows of the fleet (answered from the roll-ups)"
                              % (self.device, self.seq, self.elo, self.ehi))
        return SketchShape.counters(self)


def _locked(exc: BaseException) -> bool:
    """SQLITE_BUSY / SQLITE_LOCKED: another connection holds the lock; worth retrying."""
    msg = str(exc).lower()
    return "locked" in msg or "busy" in msg


def _row_to_release(r: Sequence[Any], with_payload: bool) -> StoredRelease:
    (device, elo, ehi, part, seq, win, win_s, ep_s, t0, t1, mode, kind, d, w, hv, salt, clip, mech,
     bn, bd, inn, ind, onn, ond, nz, L, received, ctr_off, v, lvl, b, mn, md, mo) = r[:34]
    return StoredRelease(mode=mode, kind=kind, d=int(d), w=int(w), hv=int(hv), salt=salt, clip=int(clip), mech=mech,
                         budget=(int(bn), int(bd)), nint=(int(inn), int(ind)), nout=(int(onn), int(ond)), nz=int(nz),
                         L=int(L), device=device, elo=int(elo), ehi=int(ehi), part=int(part), seq=int(seq),
                         win=int(win), win_s=int(win_s), ep_s=int(ep_s), t0=int(t0), t1=int(t1),
                         received=float(received), ctr_off=int(ctr_off),
                         payload=bytes(r[34]) if with_payload else None, v=int(v), lvl=int(lvl), b=int(b),
                         map=(int(mn), int(md), int(mo)) if mn is not None else None)


@dataclass(frozen=True)
class RollupInfo:
    """One roll-up's metadata (sums read separately with :meth:`SQLStore.rollup_sums`)."""

    id: int
    win_s: int
    win: int
    kind: str
    d: int
    w: int
    hv: int
    salt: str
    releases: int
    t0: int  # earliest epoch start of its releases
    t1: int  # latest epoch end of its releases

    @property
    def group(self) -> tuple[str, int, int, int, str]:
        return (self.kind, self.d, self.w, self.hv, self.salt)


@dataclass
class Pending:
    """One message for :meth:`SQLStore.commit_group`: a validated release or a refusal.

    After the call, ``status`` is 'stored', 'duplicate', 'rejected' (``rej``
    says why: validation, or the store's ``device``/``conflict`` checks) or
    'error' (``error``: a database error on this message alone; it was
    rolled back to its savepoint and nothing of it is stored).
    """

    payload: bytes
    topic: Optional[str]
    received: float
    rel: Optional[Release] = None
    rej: Optional[Rejected] = None
    device: Optional[str] = None
    keep_bytes: Optional[int] = None  # prefix of a refused payload to keep (None: the store's Limits.keep_bytes)
    status: str = ""
    error: Optional[BaseException] = None
    seq: Optional[int] = None  # a refused message: the seq its bytes name (host_tools.cborscan.peek)
    pdev: Optional[str] = None  # ... and the dev they name
    quarantine: Optional[Rejected] = None  # a valid release held back (code 'future'); status 'quarantined'


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


class SQLStore:
    """Backend-independent store logic (SQL written with ``?`` placeholders)."""

    # a group is first put without a savepoint per message (two statements fewer each), and again with
    # them only if one message needs its own rollback (a database error of its own); _changes() counts
    # the rows written so far on the connection (SQLite: total_changes)
    _optimistic = False

    def _changes(self) -> int:
        return 0

    path: str
    readonly: bool
    timeout: float
    has_rollups: bool = False
    limits: Limits = Limits()
    _rej_rows: Optional[int] = None  # rejection rows, as far as this process knows (pruning trigger)
    _q_rows: Optional[int] = None
    _last_age_prune = 0.0
    _devcache: dict[str, tuple[Any, ...]]  # committed device rows (never updated once written)
    _lock: threading.RLock
    _cols: str  # release columns to select (old files: "2 AS nz")
    _for_update = ""  # row locks for read-modify-write of roll-ups (PostgreSQL)
    _rollup_shard: Optional[int] = None  # PostgreSQL: this writer's roll-up rows (rollups.shard)
    _db_errors: tuple[type[BaseException], ...]  # the driver's errors (sqlite3.Error, psycopg.Error)

    # -- backend hooks (the SQLite / PostgreSQL differences: Store here, PgStore in host_tools.store.pg) --
    def _cursor(self) -> Any:
        raise NotImplementedError

    def _sql(self, s: str) -> str:
        return s

    def _begin(self, cur: Any) -> None:
        raise NotImplementedError

    def _retryable(self, exc: BaseException) -> bool:
        return False

    def background_checkpoints(self, interval: float = 0.25, drop_behind: int = 0) -> None:
        """Backend housekeeping off the commit path (SQLite: WAL checkpoints); default none."""

    # set by defer_sync() (SQLite: the WAL, opened for sync_committed's fsync): commit_group(sync=False)
    # then leaves the fsync to sync_committed()
    _wal_fd: Optional[int] = None
    time_major = False  # the release key leads with the epoch (a new SQLite file: Store)

    def defer_sync(self) -> bool:
        """Let ``commit_group(..., sync=False)`` return before its transaction is on disk; the caller then
        calls :meth:`sync_committed` before it acknowledges what the group stored. True if this backend
        does that (SQLite); False: every commit is durable when it returns (PostgreSQL), nothing to call."""
        return False

    def sync_committed(self) -> None:
        """Make every transaction committed so far durable (after :meth:`defer_sync`; else nothing to do).
        Safe to call from another thread than the one committing."""

    def checkpoint_if_large(self, limit: int = 64 << 20, wait: float = 1.0) -> Optional[tuple[int, int, int]]:
        """Bound the write-ahead log between group commits (SQLite; PostgreSQL: nothing to do)."""
        return None

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> "SQLStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

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

    def _x(self, cur: Any, sql: str, args: Sequence[Any] = ()) -> Any:
        cur.execute(self._sql(sql), tuple(args))
        return cur

    def _exec_tx(self, fn: Any, *args: Any, sync: bool = True) -> Any:
        """Run fn(cursor, *args) in one write transaction (retried while the database is busy); durable when
        it returns unless ``sync`` is False and :meth:`defer_sync` was called."""
        with self._lock:
            delay = 0.01
            deadline = time.monotonic() + max(60.0, 2 * self.timeout)
            while True:
                cur = self._cursor()
                try:
                    self._begin(cur)
                except self._db_errors as exc:
                    if self._retryable(exc) and time.monotonic() < deadline:
                        time.sleep(delay)
                        delay = min(delay * 2, 0.5)
                        continue
                    raise
                try:
                    out = fn(cur, *args)
                    cur.execute("COMMIT")
                except BaseException as exc:
                    try:
                        cur.execute("ROLLBACK")
                    except self._db_errors:
                        pass
                    if isinstance(exc, self._db_errors) and self._retryable(exc) and time.monotonic() < deadline:
                        time.sleep(delay)
                        delay = min(delay * 2, 0.5)
                        continue
                    raise
                if sync and self._wal_fd is not None:
                    self.sync_committed()
                return out

    # -- writes --------------------------------------------------------
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
        self._note_stored(cur, items)
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
                      insert_values(rel, topic, now))
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

    def prune(self, before: float, limit: int = 2000) -> int:
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

        def tx(cur: Any) -> int:
            if not self.__dict__.get("_prune_index"):  # only stores with retention pay for this index
                self._x(cur, "CREATE INDEX IF NOT EXISTS releases_received ON releases (received)")
            row = self._x(cur, "SELECT value FROM meta WHERE key = 'pruned_to'").fetchone()
            lo = float(row[0]) if row else -1.0
            rows = self._x(cur, "SELECT device, elo, ehi, part, received FROM releases WHERE received >= ? "
                                "AND received < ? AND mode IN ('window', 'keep') AND kind IN ('cms', 'cs') "
                                "AND lvl = 0 AND length(payload) > 0 ORDER BY received LIMIT ?",
                           (lo, before, limit)).fetchall()
            if rows:
                cur.executemany(self._sql("UPDATE releases SET payload = ? WHERE device = ? AND elo = ? AND ehi = ? "
                                          "AND part = ?"), [(b"",) + tuple(r[:4]) for r in rows])
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

    def _release_columns(self, cur: Any) -> Optional[set[str]]:
        """The releases table's columns (None: all of _COLS; PostgreSQL adds missing ones at open)."""
        return None

    def _mark_unrolled(self, cur: Any) -> None:
        """Note that the store holds releases no roll-up sums (dcs, dbits, tree nodes): fleet-wide
        queries then merge raw releases, so a selection mixing them with cms/cs is reported, not
        answered from the roll-ups alone."""
        self._x(cur, "INSERT INTO meta (key, value) VALUES ('unrolled', '1') ON CONFLICT (key) DO NOTHING")

    def has_unrolled(self) -> bool:
        """Whether any stored release is outside the roll-ups (see :meth:`_mark_unrolled`)."""
        return self._meta("unrolled") == "1"

    def _meta(self, key: str) -> Optional[str]:
        raise NotImplementedError

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

    # -- reads ---------------------------------------------------------
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

    def _q(self, sql: str, args: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            cur = self._cursor()
            cur.execute(self._sql(sql), tuple(args))
            return [tuple(r) for r in cur.fetchall()]

    def _iter(self, sql: str, args: Iterable[Any] = (), size: int = 64) -> Iterator[tuple[Any, ...]]:
        """Rows of a query fetched ``size`` at a time (memory O(size) rows)."""
        with self._lock:
            cur = self._cursor()
            cur.execute(self._sql(sql), tuple(args))
            yield from self._fetched(cur, size)

    @staticmethod
    def _fetched(cur: Any, size: int) -> Iterator[tuple[Any, ...]]:
        """The rows of an executed cursor, ``size`` at a time."""
        while True:
            rows = cur.fetchmany(size)
            if not rows:
                return
            yield from rows

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

    def count_partial(self, since: Optional[float], until: Optional[float],
                      devices: Optional[Iterable[str]] = None,
                      windows: Optional[Iterable[tuple[int, int]]] = None) -> int:
        """Releases that overlap [since, until) without lying inside it (cannot be split).
        Tree-mode nodes are not counted (host_tools.query.core.cover uses smaller ones).

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

    def release_count(self) -> int:
        return int(self._q("SELECT COUNT(*) FROM releases")[0][0])

    def payload(self, device: str, elo: int, ehi: int, part: int) -> Optional[bytes]:
        r = self._q("SELECT payload FROM releases WHERE device = ? AND elo = ? AND ehi = ? AND part = ?",
                    (device, elo, ehi, part))
        return bytes(r[0][0]) if r else None

    def devices(self) -> list[tuple[Any, ...]]:
        """(device, salt, hv, kind, d, w, ep_s, first_received) per known device."""
        return self._q("SELECT device, salt, hv, kind, d, w, ep_s, first_received FROM devices ORDER BY device")

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
    def rollups(self, window: Optional[int] = None) -> list[RollupInfo]:
        """Roll-up metadata, all or those of one window id."""
        sql = "SELECT id, win_s, win, kind, d, w, hv, salt, releases, t0, t1 FROM rollups"
        args: list[Any] = []
        if window is not None:
            sql += " WHERE win = ?"
            args.append(window)
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

    def rollup_devices(self, ids: Sequence[int]) -> set[str]:
        return {r[0] for r in self._by_ids("SELECT DISTINCT device FROM rollup_devices WHERE rollup IN (%s)", ids)}


class Store(SQLStore):
    """The SQLite release database at ``path`` (created if missing unless ``readonly``)."""

    _db_errors = (sqlite3.Error,)

    def __init__(self, path: str, readonly: bool = False, timeout: float = 30.0) -> None:
        self.path = path
        self.readonly = readonly
        self._lock = threading.RLock()
        self._ckpt: Optional[tuple[threading.Event, threading.Thread]] = None
        self.written_tail: Optional[pagecache.WrittenTail] = None  # set by background_checkpoints
        self.checkpoints = [0, 0]  # writer's RESTART checkpoints: [gave up (readers), completed]
        self._devcache = {}
        if readonly:
            if not os.path.exists(path):
                raise FileNotFoundError("no database at %s (run `pansketch aggregate` first)" % path)
        self.timeout = timeout
        self.db = sqlite3.connect(path, timeout=timeout, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA busy_timeout = %d" % int(timeout * 1000))
        if not readonly:
            # a no-op unless the file is new (SQLite fixes the page size with the first page written)
            self.db.execute("PRAGMA page_size = %d" % PAGE_SIZE)
            # The switch to WAL takes the write lock while holding a read lock; when several
            # processes open a fresh file at once SQLite refuses one of them at once with
            # "database is locked" instead of waiting (no busy handler for a lock upgrade that
            # could deadlock), so it is retried like a busy BEGIN IMMEDIATE.
            mode = self._retry_locked(lambda: self.db.execute("PRAGMA journal_mode = WAL").fetchone()[0])
            if str(mode).lower() != "wal":
                raise sqlite3.OperationalError("cannot switch %s to WAL journal mode (got %s)" % (path, mode))
            self.db.execute("PRAGMA synchronous = FULL")
            # after a checkpoint that resets the WAL, shrink the file to this (else it keeps its peak size)
            self.db.execute("PRAGMA journal_size_limit = %d" % WAL_KEEP_BYTES)
            self._exec_tx(self._init_schema)
        else:
            self.db.execute("PRAGMA query_only = 1")
            self._check_pansketch_file(path)
        self._cols = _select_cols(self._retry_locked(lambda: self._release_columns(self.db)))
        self.time_major = self._retry_locked(self._key_leads_with_epoch)
        v = self._retry_locked(lambda: self._meta("schema_version"))
        if v is not None and int(v) != SCHEMA_VERSION:
            raise sqlite3.DatabaseError("%s has schema version %s; this pansketch reads %d" % (path, v, SCHEMA_VERSION))
        self.has_rollups = self._retry_locked(lambda: self._meta("rollups")) == "1"

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

    def _check_pansketch_file(self, path: str) -> None:
        """A read-only open of an empty or foreign file: one clear StoreError, not 'no such table' later."""
        try:
            names = {r[0] for r in self._retry_locked(
                lambda: self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall())}
        except sqlite3.DatabaseError as exc:  # "file is not a database"
            self.db.close()
            raise NotAStoreError("%s is not a pansketch database (%s)" % (path, exc))
        if "releases" in names:
            return
        self.db.close()
        if not names:
            raise NotAStoreError("%s is an empty file, not a pansketch database yet (run `pansketch aggregate` "
                             "to create it, or fix [aggregator] db)" % path)
        raise NotAStoreError("%s is not a pansketch database (its tables: %s); fix [aggregator] db"
                         % (path, ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")))

    def background_checkpoints(self, interval: float = 0.25, drop_behind: int = 0) -> None:
        """Move WAL checkpoints off the commit path (the aggregator's writer).

        By default the connection that commits copies the WAL into the
        database file whenever the WAL passes 1000 pages, inside COMMIT.
        Here a thread with its own connection runs a PASSIVE checkpoint every
        ``interval`` seconds instead (it never blocks writers; the I/O
        overlaps the next group's validation). Stopped by :meth:`close`.
        With ``drop_behind`` > 0, after each checkpoint that copied the whole
        WAL (this thread's or the writer's RESTART), the kernel is told to
        drop the file's cached pages more than ``drop_behind`` bytes before
        its end (:mod:`host_tools.store.pagecache`).
        """
        if self.readonly or self._ckpt is not None:
            return
        self.db.execute("PRAGMA wal_autocheckpoint = 0")
        stop = threading.Event()
        if drop_behind > 0 and pagecache.supported():
            self.written_tail = pagecache.WrittenTail(self.path, drop_behind)

        def complete(row: Any) -> bool:
            return row is not None and row[0] == 0 and row[1] == row[2]

        def loop() -> None:
            con = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
            restarts = self.checkpoints[1]
            try:
                while not stop.wait(interval):
                    try:
                        row = con.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                    except sqlite3.Error:
                        continue  # busy: next round
                    tail, now = self.written_tail, self.checkpoints[1]
                    if tail is not None and (complete(row) or now != restarts):
                        restarts = now
                        try:
                            tail.forget()
                        except OSError as exc:  # advice only: the data is safe either way
                            self.written_tail = None
                            tail.close()
                            _log.warning("not dropping cached database pages any more: %s", exc)
                con.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            finally:
                con.close()

        t = threading.Thread(target=loop, name="pansketch-checkpoint", daemon=True)
        self._ckpt = (stop, t)
        t.start()

    def defer_sync(self) -> bool:
        """SQLite: ``synchronous = NORMAL`` on this connection, and the WAL opened for :meth:`sync_committed`.

        In WAL mode, NORMAL writes a commit's frames to the WAL without
        waiting for the disk (SQLite still syncs the WAL before each
        checkpoint and the database file after it). ``sync_committed`` then
        does what FULL did at each commit, an fsync of the WAL, for every
        transaction committed before it, from any thread: the aggregator's
        writer commits the next group while the last one's fsync runs.
        Durability is unchanged for what the aggregator acknowledges; a
        commit that never got its fsync can roll back at a power loss, and
        nothing of it was acknowledged (the devices re-send it)."""
        if self.readonly:
            return False
        with self._lock:
            self.db.execute("PRAGMA synchronous = NORMAL")
            self._wal_fd = os.open(self.path + "-wal", os.O_RDONLY)
        return True

    def sync_committed(self) -> None:
        fd = self._wal_fd
        if fd is None:
            return
        os.fsync(fd)
        # SQLite keeps the WAL file while a connection has it open; if it was replaced anyway, what was
        # committed may not be in the file just synced: an error, never an acknowledgement
        try:
            same = os.fstat(fd).st_ino == os.stat(self.path + "-wal").st_ino
        except OSError:
            same = False
        if not same:
            raise OSError(errno.ESTALE, "the WAL %s-wal is not the file opened for fsync any more" % self.path)

    def checkpoint_if_large(self, limit: int = 64 << 20, wait: float = 1.0) -> Optional[tuple[int, int, int]]:
        """Bound the WAL: if it is larger than ``limit`` bytes, checkpoint it completely and rewind it.

        Called by the aggregator's writer between group commits. The passive
        checkpoints of :meth:`background_checkpoints` copy frames into the
        database file but, under steady ingest, never catch up with the writer,
        and SQLite only rewinds the WAL after a checkpoint that copied every
        frame while no reader still uses one: the file then grows without
        bound. A ``RESTART`` checkpoint run by the writer itself between two
        groups has no writer to race in this process (other aggregators on the
        file wait on its lock) and waits up to ``wait`` seconds for readers to
        leave (queries and dashboards hold short read transactions); when a
        reader stays longer it gives up and the next group tries again.
        After it the next commit writes the WAL from its start again, and
        ``journal_size_limit`` (set to ``limit`` here) cuts the file back to
        ``limit``: the file is reused, not truncated to nothing and grown
        again, because rewriting pages the kernel still caches costs the
        writer less CPU than appending new ones (the kernel allocates and
        zeroes those; docs/HOST.md, Performance). The file stays at most
        ``limit`` plus one group, as with a truncating checkpoint.
        Returns SQLite's (busy, WAL frames, frames checkpointed), or None when
        nothing was done.
        """
        if self.readonly:
            return None
        try:
            size = os.path.getsize(self.path + "-wal")
        except OSError:
            return None
        if size <= limit:
            return None
        with self._lock:
            self.db.execute("PRAGMA journal_size_limit = %d" % limit)
            self.db.execute("PRAGMA busy_timeout = %d" % int(wait * 1000))
            try:
                row = self.db.execute("PRAGMA wal_checkpoint(RESTART)").fetchone()
            except sqlite3.OperationalError as exc:
                if not _locked(exc):
                    raise
                row = (1, -1, -1)
            finally:
                self.db.execute("PRAGMA busy_timeout = %d" % int(self.timeout * 1000))
        self.checkpoints[0 if row[0] else 1] += 1
        return (int(row[0]), int(row[1]), int(row[2]))

    def _cursor(self) -> sqlite3.Cursor:
        return self.db.cursor()

    def _begin(self, cur: sqlite3.Cursor) -> None:
        cur.execute("BEGIN IMMEDIATE")

    def _retryable(self, exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.OperationalError) and _locked(exc)

    _optimistic = True  # SQLStore._group without savepoints first

    def _changes(self) -> int:
        return self.db.total_changes

    def close(self) -> None:
        if self._ckpt is not None:
            self._ckpt[0].set()
            self._ckpt[1].join(30)
            self._ckpt = None
        if self.written_tail is not None:
            self.written_tail.close()
            self.written_tail = None
        with self._lock:
            fd = self._wal_fd
            if fd is not None:
                self.sync_committed()  # nothing committed stays without its fsync
            self.db.close()
            if fd is not None:
                self._wal_fd = None
                os.close(fd)

    def __enter__(self) -> "Store":
        return self

    def _release_columns(self, cur: Any) -> Optional[set[str]]:
        cols = {r[1] for r in cur.execute("PRAGMA table_info(releases)").fetchall()}
        return cols or None  # no table yet (read-only open of an empty file): nothing to adapt

    def _key_leads_with_epoch(self) -> bool:
        """True for a file whose release key is TIME_KEY (created by this version); older files keep
        DEVICE_KEY, which every statement here also serves (queries by device are then faster)."""
        r = self.db.execute("SELECT name FROM pragma_index_info('sqlite_autoindex_releases_1') "
                            "WHERE seqno = 0").fetchone()
        return r is not None and r[0] == "elo"

    def _init_schema(self, cur: sqlite3.Cursor) -> None:
        for stmt in schema(TIME_KEY).split(";"):  # a no-op for tables that exist: their key stays
            if stmt.strip():
                cur.execute(stmt)
        dcols = {r[1] for r in cur.execute("PRAGMA table_info(devices)").fetchall()}
        for name, decl in _DEVICE_FIGURES:  # old rows keep NULL: read from their releases (_stored_top)
            if name not in dcols:
                cur.execute("ALTER TABLE devices ADD COLUMN %s %s" % (name, decl))
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
        if cur.execute("SELECT value FROM meta WHERE key = 'rollups'").fetchone() is None:
            self._rebuild_rollups(cur)  # a database from before roll-ups (or a new one: nothing to sum)
            cur.execute("INSERT INTO meta (key, value) VALUES ('rollups', '1')")

    # -- per-device figures in ``devices`` (the release key does not lead with the device) --------
    def _stored_top(self, cur: Any, dev: str) -> int:
        r = self._x(cur, "SELECT max_seq FROM devices WHERE device = ?", (dev,)).fetchone()
        if r is None and self.time_major:
            return -1  # a device row is written with the device's first stored release
        if r is None or r[0] is None:  # a row from before the column: the releases tell (device-first key)
            return super()._stored_top(cur, dev)
        return int(r[0])

    def _stored_shape(self, cur: Any, dev: str) -> Optional[tuple[str, int, int]]:
        r = self._x(cur, "SELECT shape FROM devices WHERE device = ?", (dev,)).fetchone()
        if r is None and self.time_major:
            return None
        if r is None or r[0] is None:
            return super()._stored_shape(cur, dev)
        mode, L, win_s = str(r[0]).split(" ")
        return mode, int(L), int(win_s)

    def _add_device(self, cur: Any, rel: Release, mine: tuple[Any, ...], now: float) -> None:
        self._x(cur, "INSERT INTO devices (device, salt, hv, kind, d, w, ep_s, first_received, max_seq, shape) "
                     "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (device) DO NOTHING",
                (rel.dev,) + mine + (now, rel.seq, "%s %d %d" % (rel.mode, rel.L, rel.win_s)))

    def _note_stored(self, cur: Any, items: Sequence[Pending]) -> None:
        """Raise each device's ``max_seq`` to its highest seq stored in this group (one row per device;
        a row from before the column keeps NULL)."""
        tops: dict[str, int] = {}
        for p in items:
            if p.status == "stored" and p.rel is not None and p.rel.seq > tops.get(p.rel.dev, -1):
                tops[p.rel.dev] = p.rel.seq
        if tops:
            cur.executemany("UPDATE devices SET max_seq = ? WHERE device = ? AND max_seq < ?",
                            [(seq, dev, seq) for dev, seq in sorted(tops.items())])

    def iter_counters(self, devices: Optional[Iterable[str]] = None, window: Optional[int] = None,
                      since: Optional[float] = None, until: Optional[float] = None,
                      win_s: Optional[int] = None) -> Iterator[np.ndarray]:
        """As SQLStore.iter_counters. With the epoch-first key the device order is a sort: the sort takes
        the keys and row ids alone and the payloads are read by row id a chunk at a time (a sort of the
        rows themselves would carry every payload of the selection through SQLite's sorter)."""
        if not self.time_major:
            yield from super().iter_counters(devices, window, since, until, win_s)
            return
        where, args = self._release_where(devices, window, since, until, win_s)
        ids = [r[0] for r in self._q("SELECT rowid FROM releases%s ORDER BY %s" % (where, _ORDER), args)]
        for i in range(0, len(ids), 64):
            chunk = ids[i:i + 64]
            rows = {r[0]: r[1:] for r in self._q("SELECT rowid, %s, payload FROM releases WHERE rowid IN (%s)"
                                                 % (self._cols, ",".join("?" * len(chunk))), chunk)}
            for rid in chunk:
                yield _row_to_release(rows[rid], True).counters()

    def _meta(self, key: str) -> Optional[str]:
        try:
            r = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):  # a read-only open of a file no aggregator has written yet
                return None
            raise
        return r[0] if r else None
