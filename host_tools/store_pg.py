"""PostgreSQL backend of the release store (``[aggregator] db = "postgresql://..."``, psycopg 3).

The same tables and SQL as the SQLite store (host_tools/store.py), with
PostgreSQL types (BIGINT, BYTEA, DOUBLE PRECISION, BIGSERIAL). Any number
of aggregators, on any number of hosts, may write to one database; the
database, not a process, enforces:

* idempotency and conflict detection: the release key (device, elo, ehi,
  part) is the primary key; an insert is ``ON CONFLICT DO NOTHING``, and a
  key another aggregator holds is then classified against the committed
  row (same SHA-256: duplicate; different: conflict, the first is kept).
  A concurrent insert of the same key waits for the other transaction;
* per-device parameters: ``devices`` primary key, first writer wins;
* roll-ups: the row of a (window, group) is created with ``ON CONFLICT DO
  NOTHING`` and updated under ``SELECT ... FOR UPDATE``, in key order, in
  the same transaction as the releases it sums;
* a deadlock or serialisation failure (SQLSTATE 40P01, 40001) rolls the
  group back and retries it.

Each group commit is one transaction (``synchronous_commit`` as the server
is configured: on by default, so a commit is durable before the
aggregator acknowledges). A broken connection is re-opened on the next
transaction; the writer retries a failed group with backoff and stops
without acknowledging if the server stays away (what is committed stays).
Readers (``query``, ``status``) use a read-only session.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Iterable, Iterator, Optional

from host_tools.store import _COLS, _SCHEMA, SCHEMA_VERSION, SQLStore, StoreError

_SERIALS = itertools.count()


def pg_schema() -> list[str]:
    """The SQLite DDL of host_tools.store in PostgreSQL types, one statement each."""
    s = (_SCHEMA.replace("INTEGER PRIMARY KEY AUTOINCREMENT", "BIGSERIAL PRIMARY KEY")
         .replace("INTEGER", "BIGINT").replace("BLOB", "BYTEA").replace("REAL", "DOUBLE PRECISION"))
    return [x.strip() for x in s.split(";") if x.strip()]


def redact(dsn: str) -> str:
    """The DSN without its password (for messages)."""
    try:
        from psycopg.conninfo import conninfo_to_dict

        d = conninfo_to_dict(dsn)
    except Exception:
        return dsn.split("@")[-1] if "@" in dsn else dsn
    return "postgresql://%s@%s:%s/%s" % (d.get("user", ""), d.get("host", "localhost"), d.get("port", 5432),
                                         d.get("dbname", ""))


class PgStore(SQLStore):
    """The release store in the PostgreSQL database ``dsn``."""

    _for_update = " FOR UPDATE"

    def __init__(self, dsn: str, readonly: bool = False, timeout: float = 30.0) -> None:
        try:
            import psycopg
        except ImportError:
            raise StoreError("[aggregator] db is a PostgreSQL URL but psycopg 3 is not installed "
                             "(pip install 'psycopg[binary]')")
        self._psycopg = psycopg
        self._db_errors = (psycopg.Error,)
        self.dsn = dsn
        self.path = redact(dsn)
        self.readonly = readonly
        self.timeout = timeout
        self._lock = threading.RLock()
        self._devcache = {}
        self.conn: Any = None
        self._connect()
        if not readonly:
            self._exec_tx(self._init_schema)
        v = self._meta("schema_version")
        if v is None:
            self.close()
            raise StoreError("no pansketch tables in PostgreSQL database %s (run `pansketch aggregate` first)"
                             % self.path)
        if int(v) != SCHEMA_VERSION:
            self.close()
            raise StoreError("%s has schema version %s; this pansketch reads %d" % (self.path, v, SCHEMA_VERSION))
        self.has_rollups = self._meta("rollups") == "1"
        self._cols = ", ".join(_COLS)

    def _connect(self) -> None:
        psycopg = self._psycopg
        try:
            self.conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=max(1, int(self.timeout)),
                                        application_name="pansketch")
        except psycopg.Error as exc:
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise StoreError("cannot connect to PostgreSQL at %s: %s" % (self.path, msg))
        if self.readonly:
            self.conn.execute("SET default_transaction_read_only = on")

    def _cursor(self) -> Any:
        if self.conn is None or self.conn.closed or self.conn.broken:
            self._connect()  # the server came back: a new session
        return self.conn.cursor()

    def _sql(self, s: str) -> str:
        return s.replace("?", "%s")

    def _begin(self, cur: Any) -> None:
        cur.execute("BEGIN")

    def _retryable(self, exc: BaseException) -> bool:
        return getattr(exc, "sqlstate", None) in ("40P01", "40001", "55P03")

    def close(self) -> None:
        with self._lock:
            if self.conn is not None:
                self.conn.close()

    def _init_schema(self, cur: Any) -> None:
        cur.execute("SELECT pg_advisory_xact_lock(7243310)")  # aggregators starting together create it once
        for stmt in pg_schema():
            cur.execute(stmt)
        cur.execute("INSERT INTO meta (key, value) VALUES ('schema_version', %s) ON CONFLICT (key) DO NOTHING",
                    (str(SCHEMA_VERSION),))
        cur.execute("SELECT value FROM meta WHERE key = 'rollups'")
        if cur.fetchone() is None:
            self._rebuild_rollups(cur)
            cur.execute("INSERT INTO meta (key, value) VALUES ('rollups', '1')")

    def _meta(self, key: str) -> Optional[str]:
        try:
            r = self._q("SELECT value FROM meta WHERE key = ?", (key,))
        except self._psycopg.errors.UndefinedTable:
            return None
        return r[0][0] if r else None

    def _iter(self, sql: str, args: Iterable[Any] = (), size: int = 64) -> Iterator[tuple[Any, ...]]:
        """A server-side cursor: rows arrive ``size`` at a time (memory O(size))."""
        with self._lock:
            self._cursor()  # reconnect if needed
            with self.conn.cursor(name="pansketch_%d" % next(_SERIALS), withhold=True) as cur:
                cur.itersize = size
                cur.execute(self._sql(sql), tuple(args))
                while True:
                    rows = cur.fetchmany(size)
                    if not rows:
                        return
                    yield from rows

    def _q(self, sql: str, args: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            cur = self._cursor()
            cur.execute(self._sql(sql), tuple(args))
            return [tuple(r) for r in cur.fetchall()]
