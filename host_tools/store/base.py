"""What every part of the SQL store shares: the state of an open store, the backend hooks, and the
two ways SQL is run (one write transaction, retried while the database is busy; one read).

The store's SQL is written once, in mixins on :class:`SQLBase` (write, prune,
read), composed into :class:`pansketch.host_tools.store.sql.SQLStore`; a backend
(pansketch.host_tools.store.sqlite, pansketch.host_tools.store.pg) overrides the hooks here.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterable, Iterator, Optional, Sequence

from pansketch.host_tools.store import payloadcodec
from pansketch.host_tools.store.rows import Limits


class SQLBase:
    """Backend-independent store state and SQL execution (SQL written with ``?`` placeholders)."""

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

    # -- backend hooks (the SQLite / PostgreSQL differences: Store here, PgStore in pansketch.host_tools.store.pg) --
    def _cursor(self) -> Any:
        raise NotImplementedError

    def _sql(self, s: str) -> str:
        return s

    def _begin(self, cur: Any) -> None:
        raise NotImplementedError

    def _retryable(self, exc: BaseException) -> bool:
        return False

    def _lock_counts(self, cur: Any, exclusive: bool) -> None:
        """PostgreSQL: the per-roll-up device counts' table lock (PgStore); SQLite's writer holds the file."""

    def background_checkpoints(self, interval: float = 0.25, drop_behind: int = 0) -> None:
        """Backend housekeeping off the commit path (SQLite: WAL checkpoints); default none."""

    # set by defer_sync() (SQLite: the WAL, opened for sync_committed's fsync): commit_group(sync=False)
    # then leaves the fsync to sync_committed()
    _wal_fd: Optional[int] = None
    time_major = False  # the release key leads with the epoch (a new SQLite file: Store)
    # [store] compress: payloads written in the stored encoding (payloadcodec) or as sent; None: the
    # backend's default, those with at least compress_default_bytes of counters (docs/HOST.md "Stored
    # encoding": where the smaller rows save the database about what the encode costs). Reading knows both.
    compress: Optional[bool] = None
    compress_default_bytes: Optional[int] = None

    def compress_min_bytes(self) -> Optional[int]:
        """Payloads with at least this many bytes of counters are written compressed (None: none)."""
        if self.compress is None:
            return self.compress_default_bytes
        return payloadcodec.MIN_BYTES if self.compress else None

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


    # The change counter (Reader.change_count): every write transaction moves it, so a reader tells
    # "nothing changed" with one cheap read. SQLite: a meta row raised inside the transaction (its writers
    # are serialised anyway, so several aggregators count every commit). PostgreSQL (pansketch.host_tools.
    # store.pg): a sequence advanced after the commit instead -- no row lock shared by concurrent
    # aggregators, and a reader that sees the new value also sees what was committed.
    _bump_in_tx: Optional[str] = ("INSERT INTO meta (key, value) VALUES ('changes', '1') ON CONFLICT (key) "
                                  "DO UPDATE SET value = CAST(CAST(meta.value AS INTEGER) + 1 AS TEXT)")
    _bump_after: Optional[str] = None

    # Write transactions this store rolled back and ran again, by cause (SQLite: "busy"; PostgreSQL: the
    # SQLSTATE, 40P01 deadlock, 40001 serialisation failure, 55P03 lock not available). Several writers
    # on one database should leave this empty: the aggregator logs it at exit, and the scale-out mode of
    # the ingest benchmark (pansketch.host_tools.bench.pgscale) reads it there.
    def retry_counts(self) -> dict[str, int]:
        """Write transactions rolled back and run again so far, by cause."""
        return dict(self.__dict__.get("_tx_retries", {}))

    def _note_retry(self, exc: BaseException) -> None:
        why = getattr(exc, "sqlstate", None) or type(exc).__name__
        counts = self.__dict__.setdefault("_tx_retries", {})
        counts[why] = counts.get(why, 0) + 1

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
                        self._note_retry(exc)
                        time.sleep(delay)
                        delay = min(delay * 2, 0.5)
                        continue
                    raise
                try:
                    out = fn(cur, *args)
                    if self._bump_in_tx is not None:
                        cur.execute(self._sql(self._bump_in_tx))
                    cur.execute("COMMIT")
                except BaseException as exc:
                    try:
                        cur.execute("ROLLBACK")
                    except self._db_errors:
                        pass
                    if isinstance(exc, self._db_errors) and self._retryable(exc) and time.monotonic() < deadline:
                        self._note_retry(exc)
                        time.sleep(delay)
                        delay = min(delay * 2, 0.5)
                        continue
                    raise
                if self._bump_after is not None:
                    try:
                        cur.execute(self._bump_after)
                    except self._db_errors:  # a reader then waits for its cache's time limit
                        pass
                if sync and self._wal_fd is not None:
                    self.sync_committed()
                return out

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

    def _release_columns(self, cur: Any) -> Optional[set[str]]:
        """The releases table's columns (None: all of _COLS; PostgreSQL adds missing ones at open)."""
        return None

    def _meta(self, key: str) -> Optional[str]:
        raise NotImplementedError
