"""The SQLite backend (:class:`Store`): one database file, WAL, any number of writer processes.

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

import errno
import logging
import os
import sqlite3
import threading
import time
from typing import Any, Iterable, Iterator, Optional, Sequence

import numpy as np

from pansketch.host_tools.store import pagecache, summary
from pansketch.host_tools.store.errors import NotAStoreError
from pansketch.host_tools.store.records import Release
from pansketch.host_tools.store.rows import Pending, _row_to_release
from pansketch.host_tools.store.schema import _ADDED, _DEVICE_FIGURES, _ORDER, SCHEMA_VERSION, TIME_KEY, _select_cols, rejected_seq, schema
from pansketch.host_tools.store.sql import SQLStore

_log = logging.getLogger("pansketch.store")

WAL_KEEP_BYTES = 16 << 20  # SQLite journal_size_limit: a reset WAL file is truncated to this
# Page size of a new database file. A 16.6 KB release (d=4, w=1024) is one 16 KiB overflow page plus
# about 2 KB in its leaf, where 4 KiB pages split it into five: each page is a WAL frame, written with
# two system calls and copied again by the checkpoint, and the kernel's part of that was most of the
# aggregator's CPU (docs/PERFORMANCE-HISTORY.md). A file keeps the page size it was created with.
PAGE_SIZE = 16384

# A read-only open maps up to this much of the file instead of read() calls into SQLite's page cache: a
# scan of every release row of a large store (series' device extents, 1.1 GB at 10^4 devices x 168
# windows) cost about 3.7 s of kernel CPU copying pages, 0.06 s mapped. Read-only only: a writer's I/O
# error stays an error rather than a signal. The store never shrinks its file (no VACUUM), so a mapped
# page does not vanish under a reader; pages touched count in the reader's RSS (shared page cache).
READ_MMAP_BYTES = 1 << 30



def _locked(exc: BaseException) -> bool:
    """SQLITE_BUSY / SQLITE_LOCKED: another connection holds the lock; worth retrying."""
    msg = str(exc).lower()
    return "locked" in msg or "busy" in msg


class Store(SQLStore):
    """The SQLite release database at ``path`` (created if missing unless ``readonly``)."""

    _db_errors = (sqlite3.Error,)
    # [store] compress unset: payloads with at least 24 KiB of counters (cs d=4 w=2048, strhh len=8 d=3 w=256
    # and larger), whose smaller rows (no overflow pages) save SQLite about what the encode costs; smaller
    # ones as sent, where the encode costs 10-30 us more than it saves (docs/HOST.md "Stored encoding")
    compress_default_bytes = 24576

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
            self.db.execute("PRAGMA mmap_size = %d" % READ_MMAP_BYTES)
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
        its end (:mod:`pansketch.host_tools.store.pagecache`).
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
        zeroes those; docs/PERFORMANCE-HISTORY.md). The file stays at most
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
        if cur.execute("SELECT name FROM pragma_index_info('sqlite_autoindex_releases_1') "
                       "WHERE seqno = 0").fetchone() == ("elo",):
            # the key leads with the epoch: a device's releases (query --device, the per-device pages) are
            # one range of this index instead of a scan of the whole key (a file whose key leads with the
            # device has that range already)
            cur.execute("CREATE INDEX IF NOT EXISTS releases_device ON releases (device, elo)")
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
        self._init_flag_windows(cur)
        self._init_device_counts(cur)
        summary.init(self, cur)

    # the devices per roll-up, kept by triggers on rollup_devices (whichever code path inserts or deletes a
    # row: the write path, purge, retention, a rebuild): a fleet-wide answer then knows from one row per
    # window that a window holds every device, instead of reading N rows per window (Reader.rollup_devices)
    _COUNT_TRIGGERS = (
        "CREATE TRIGGER IF NOT EXISTS rollup_devices_counted AFTER INSERT ON rollup_devices BEGIN "
        "INSERT INTO rollup_device_counts (rollup, devices) VALUES (NEW.rollup, 1) "
        "ON CONFLICT (rollup) DO UPDATE SET devices = devices + 1; END",
        "CREATE TRIGGER IF NOT EXISTS rollup_devices_uncounted AFTER DELETE ON rollup_devices BEGIN "
        "UPDATE rollup_device_counts SET devices = devices - 1 WHERE rollup = OLD.rollup; END",
    )

    def _init_device_counts(self, cur: sqlite3.Cursor) -> None:
        """Create ``rollup_device_counts`` and its triggers, counted from ``rollup_devices`` once (a store
        from before them, or a new one); in the transaction that opens the store for writing."""
        if cur.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'rollup_device_counts'").fetchone():
            return
        cur.execute("CREATE TABLE rollup_device_counts (rollup INTEGER PRIMARY KEY, devices INTEGER NOT NULL)")
        cur.execute("INSERT INTO rollup_device_counts (rollup, devices) "
                    "SELECT rollup, COUNT(*) FROM rollup_devices GROUP BY rollup")
        for stmt in self._COUNT_TRIGGERS:
            cur.execute(stmt)

    _counts_kept: Optional[bool] = None

    def rollup_device_counts(self, ids: Sequence[int]) -> Optional[dict[int, int]]:
        """Roll-up id -> devices that contributed (:meth:`_init_device_counts`); None for a file no writer
        of this version has opened yet (read-only opens never create the table)."""
        if self._counts_kept is None:
            self._counts_kept = bool(self._q("SELECT 1 FROM sqlite_master WHERE type = 'table' "
                                             "AND name = 'rollup_device_counts'"))
        if not self._counts_kept:
            return None
        return {int(r): int(n) for r, n in self._by_ids("SELECT rollup, devices FROM rollup_device_counts "
                                                        "WHERE rollup IN (%s)", ids)}

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
