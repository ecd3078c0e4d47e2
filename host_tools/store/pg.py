"""PostgreSQL backend of the release store (``[aggregator] db = "postgresql://..."``, psycopg 3).

The same tables and SQL as the SQLite store (host_tools/store/schema.py, host_tools/store/sql.py), with
PostgreSQL types (BIGINT, BYTEA, DOUBLE PRECISION, BIGSERIAL). Any number
of aggregators, on any number of hosts, may write to one database; the
database, not a process, enforces:

* idempotency and conflict detection: the release key (device, elo, ehi,
  part) is the primary key; an insert is ``ON CONFLICT DO NOTHING``, and a
  key another aggregator holds is then classified against the committed
  row (same SHA-256: duplicate; different: conflict, the first is kept).
  A concurrent insert of the same key waits for the other transaction;
* per-device parameters: ``devices`` primary key, first writer wins;
* roll-ups: the row of a (window, group, shard) is created with ``ON
  CONFLICT DO NOTHING`` and updated under ``SELECT ... FOR UPDATE``, in key
  order, in the same transaction as the releases it sums. ``shard`` is the
  writer's slot, a session advisory lock (0, 1, ...: as many as
  aggregators write at once): with one row per window for all writers,
  every group of every aggregator locked the same hot row until its commit
  (fsync included), so aggregators took turns and two were slower than one.
  Queries add up all rows of a window (pansketch.host_tools.query.core);
* lock order: a group's releases go in key order (device, elo, ehi, part),
  so writers that meet on the same new devices or re-sent keys wait for
  each other instead of deadlocking; a deadlock or serialisation failure
  (SQLSTATE 40P01, 40001) that still happens rolls the group back and
  retries it.

A group's releases go to the server in one set-based statement
(``pansketch_put_many``: the new devices' rows, then one ``INSERT ...
SELECT FROM unnest(...) ON CONFLICT DO NOTHING`` of every release that
passes the device and shape checks), in one subtransaction for the whole
group; only the releases that did not insert are classified one by one.
A re-sent key in the same group and a device mixing shapes in it go
release by release after it (``pansketch_put``), and so does the whole
group when the statement fails (a database error on one release: each
then in its own subtransaction, and only that one is refused). One
subtransaction per release (a savepoint each) made every group of more
than 64 releases overflow the session's subtransaction cache, and cost
the server a function call, three probes and a savepoint per release.

Each group commit is one transaction (``synchronous_commit`` as the server
is configured: on by default, so a commit is durable before the
aggregator acknowledges). A broken connection is re-opened on the next
transaction; the writer retries a failed group with backoff for as long as
the server stays away, acknowledging nothing meanwhile (what is committed
stays; host_tools/ingest/pipeline.py).
Readers (``query``, ``status``) use a read-only session.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Iterable, Iterator, Optional, Sequence

import json

from pansketch.host_tools.store.records import Rejected
from pansketch.host_tools.store.errors import StoreError
from pansketch.host_tools.store.rows import Pending
from pansketch.host_tools.store import payloadcodec, summary
from pansketch.host_tools.store.schema import _ADDED, _COLS, _SCHEMA, SCHEMA_VERSION, insert_values
from pansketch.host_tools.store.sql import SQLStore
from pansketch.host_tools.store.write import _Acc

_SERIALS = itertools.count()
_FLAG_SHARDS_DDL = ("CREATE TABLE IF NOT EXISTS flag_window_shards (win_s BIGINT NOT NULL, win BIGINT NOT NULL, "
                    "shard INTEGER NOT NULL, n BIGINT NOT NULL, PRIMARY KEY (win_s, win, shard))")
_SHARD_LOCK = 7243311  # advisory lock class of the writers' roll-up shards
_SHARDS = 64
_FLAG_WINDOW_LOCK = 7243312  # advisory lock class of a flag_windows row being created (PgStore.commit_group)


def _pg_types(s: str) -> str:
    return (s.replace("INTEGER PRIMARY KEY AUTOINCREMENT", "BIGSERIAL PRIMARY KEY").replace(") WITHOUT ROWID", ")")
            .replace("INTEGER", "BIGINT").replace("BLOB", "BYTEA").replace("REAL", "DOUBLE PRECISION"))


def pg_schema() -> list[str]:
    """The SQLite DDL of pansketch.host_tools.store.schema in PostgreSQL types, one statement each; then the release
    columns added since (``_ADDED``: nz, and format v2's v, lvl, b, map) for databases created before."""
    s = _pg_types(_SCHEMA)
    return ([x.strip() for x in s.split(";") if x.strip()]
            + ["ALTER TABLE releases ADD COLUMN IF NOT EXISTS %s %s" % (name, _pg_types(decl))
               for name, decl, _ in _ADDED])


def redact(dsn: str) -> str:
    """The DSN without its password (for messages)."""
    try:
        from psycopg.conninfo import conninfo_to_dict

        d = conninfo_to_dict(dsn)
    except Exception:
        return dsn.split("@")[-1] if "@" in dsn else dsn
    return "postgresql://%s@%s:%s/%s" % (d.get("user", ""), d.get("host", "localhost"), d.get("port", 5432),
                                         d.get("dbname", ""))


_PUT_ARGS = ("device text", "elo bigint", "ehi bigint", "part bigint", "seq bigint", "win bigint", "win_s bigint",
             "ep_s bigint", "t0 bigint", "t1 bigint", "mode text", "kind text", "d bigint", "w bigint", "hv bigint",
             "salt text", "clip bigint", "mech text", "budget_num bigint", "budget_den bigint", "nint_num bigint",
             "nint_den bigint", "nout_num bigint", "nout_den bigint", "nz bigint", "L bigint", "sha256 text",
             "payload bytea", "ctr_off bigint", "topic text", "received double precision", "v bigint",
             "lvl bigint", "b bigint", "map_num bigint", "map_den bigint", "map_off bigint")

# One release in one round trip: the same checks as SQLStore._insert, in a PL/pgSQL block whose EXCEPTION
# clause makes it a subtransaction (a savepoint per release: an error rolls back this release alone).
# Returns 'stored' | 'duplicate' | 'conflict:<stored seq>' | 'device:<stored parameters as JSON>' |
# 'error:<sqlstate>:<message>'; deadlocks and serialisation failures propagate (the group is retried).
_PUT_FN = """
CREATE OR REPLACE FUNCTION pansketch_put(%(args)s) RETURNS text LANGUAGE plpgsql AS $f$
DECLARE r record; dv record; n bigint;
BEGIN
  BEGIN
    SELECT x.sha256, x.seq INTO r FROM releases x
     WHERE x.device = a_device AND x.elo = a_elo AND x.ehi = a_ehi AND x.part = a_part;
    IF NOT FOUND THEN
      INSERT INTO devices (device, salt, hv, kind, d, w, ep_s, first_received)
      VALUES (a_device, a_salt, a_hv, a_kind, a_d, a_w, a_ep_s, a_received) ON CONFLICT (device) DO NOTHING;
      SELECT x.salt, x.hv, x.kind, x.d, x.w, x.ep_s INTO dv FROM devices x WHERE x.device = a_device;
      IF (dv.salt, dv.hv, dv.kind, dv.d, dv.w, dv.ep_s) IS DISTINCT FROM (a_salt, a_hv, a_kind, a_d, a_w, a_ep_s) THEN
        RETURN 'device:' || json_build_array(dv.salt, dv.hv, dv.kind, dv.d, dv.w, dv.ep_s)::text;
      END IF;
      -- any one stored release of the device: they all have one shape (this check keeps it so), and a
      -- PK-prefix probe stays O(log n) where a scan of the device's releases grew with its history
      SELECT x.mode, x.L, x.win_s INTO dv FROM releases x WHERE x.device = a_device LIMIT 1;
      IF FOUND AND ((dv.mode = 'tree') <> (a_mode = 'tree')
                    OR (a_mode = 'tree' AND (dv.L <> a_L OR dv.win_s <> a_win_s))) THEN
        -- tree nodes of one shape, or no tree node at all (SQLStore._check_shape)
        RETURN 'shape:' || json_build_array(dv.mode, dv.L, dv.win_s)::text;
      END IF;
      INSERT INTO releases (%(cols)s) VALUES (%(vals)s) ON CONFLICT (device, elo, ehi, part) DO NOTHING;
      GET DIAGNOSTICS n = ROW_COUNT;
      IF n = 1 THEN
        RETURN 'stored';
      END IF;
      SELECT x.sha256, x.seq INTO r FROM releases x  -- another aggregator committed the key meanwhile
       WHERE x.device = a_device AND x.elo = a_elo AND x.ehi = a_ehi AND x.part = a_part;
    END IF;
    IF r.sha256 = a_sha256 THEN
      INSERT INTO duplicates (device, elo, ehi, part, received) VALUES (a_device, a_elo, a_ehi, a_part, a_received);
      RETURN 'duplicate';
    END IF;
    RETURN 'conflict:' || r.seq;
  EXCEPTION WHEN OTHERS THEN
    IF SQLSTATE IN ('40P01', '40001', '55P03') THEN
      RAISE;
    END IF;
    RETURN 'error:' || SQLSTATE || ':' || SQLERRM;
  END;
END
$f$
""" % {"args": ", ".join("a_" + a for a in _PUT_ARGS),
       "cols": ", ".join(a.split()[0] for a in _PUT_ARGS),
       "vals": ", ".join("a_" + a.split()[0] for a in _PUT_ARGS)}


# A whole group in one round trip and one subtransaction (the EXCEPTION block): the new devices' rows, then
# every release that passes the device and shape checks in one INSERT ... SELECT FROM unnest(...) ON CONFLICT
# DO NOTHING. Only the releases that did not insert are classified one by one, in pansketch_put's order (key
# stored: duplicate or conflict; else device parameters; else shape). Returns one result per release, as
# pansketch_put's, or NULL when the statement failed (a database error on some release: the caller puts the
# group release by release, each in its own subtransaction); deadlocks and serialisation failures propagate.
# work_mem: unnest(...) of a group's columns is materialised (a function scan), about 4 MB for 256 releases of
# 16.6 KB; with the default 4 MB it went to a temporary file and back (IO:BufFileWrite).
# The caller passes releases in key order with distinct keys and, per device, one shape (PgStore._group): the
# checks read the rows stored before the statement, so releases of one group must not depend on each other.
_PUT_MANY_FN = """
CREATE OR REPLACE FUNCTION pansketch_put_many(%(args)s) RETURNS text[] LANGUAGE plpgsql
SET work_mem = '64MB' AS $f$
DECLARE res text[]; ok boolean[]; miss bigint[]; j bigint; r record; dv record;
BEGIN
  BEGIN
    -- a new device's parameters are those of its first release (key order), as release by release
    INSERT INTO devices (device, salt, hv, kind, d, w, ep_s, first_received)
    SELECT DISTINCT ON (t.device) t.device, t.salt, t.hv, t.kind, t.d, t.w, t.ep_s, t.received
      FROM unnest(a_device, a_salt, a_hv, a_kind, a_d, a_w, a_ep_s, a_received) WITH ORDINALITY
           AS t(device, salt, hv, kind, d, w, ep_s, received, i)
     ORDER BY t.device, t.i
    ON CONFLICT (device) DO NOTHING;
    -- which releases pass the device and shape checks (a mask by position: the insert below then reads the
    -- arrays in their order, key order, with no sort of the wide rows: ORDER BY over a group's payloads
    -- spilled them to a temporary file)
    SELECT array_agg(coalesce((x.salt, x.hv, x.kind, x.d, x.w, x.ep_s)
                                IS NOT DISTINCT FROM (t.salt, t.hv, t.kind, t.d, t.w, t.ep_s), false)
                     AND (sh.mode IS NULL OR coalesce((sh.mode = 'tree') = (t.mode = 'tree')
                                                      AND (t.mode <> 'tree' OR (sh.L = t.L AND sh.win_s = t.win_s)),
                                                      false))
                     ORDER BY t.i) INTO ok
      FROM unnest(a_device, a_mode, a_L, a_win_s, a_salt, a_hv, a_kind, a_d, a_w, a_ep_s) WITH ORDINALITY
           AS t(device, mode, L, win_s, salt, hv, kind, d, w, ep_s, i)
      LEFT JOIN devices x ON x.device = t.device
      LEFT JOIN LATERAL (SELECT y.mode, y.L, y.win_s FROM releases y WHERE y.device = t.device LIMIT 1) sh ON true;
    WITH ins AS (INSERT INTO releases (%(cols)s)
                 SELECT %(cols)s FROM unnest(%(arrays)s) WITH ORDINALITY AS u(%(cols)s, i) WHERE ok[u.i]
                 ON CONFLICT (device, elo, ehi, part) DO NOTHING RETURNING device, elo, ehi, part)
    SELECT coalesce(array_agg(t.i ORDER BY t.i), '{}') INTO miss
      FROM unnest(a_device, a_elo, a_ehi, a_part) WITH ORDINALITY AS t(device, elo, ehi, part, i)
     WHERE NOT EXISTS (SELECT 1 FROM ins WHERE (ins.device, ins.elo, ins.ehi, ins.part) = (t.device, t.elo, t.ehi, t.part));
    res := array_fill('stored'::text, ARRAY[cardinality(a_device)]);
    FOREACH j IN ARRAY miss LOOP  -- (each statement reads what committed meanwhile: another aggregator's key)
      SELECT x.sha256, x.seq INTO r FROM releases x
       WHERE x.device = a_device[j] AND x.elo = a_elo[j] AND x.ehi = a_ehi[j] AND x.part = a_part[j];
      IF FOUND THEN
        IF r.sha256 = a_sha256[j] THEN
          INSERT INTO duplicates (device, elo, ehi, part, received)
          VALUES (a_device[j], a_elo[j], a_ehi[j], a_part[j], a_received[j]);
          res[j] := 'duplicate';
        ELSE
          res[j] := 'conflict:' || r.seq;
        END IF;
        CONTINUE;
      END IF;
      SELECT x.salt, x.hv, x.kind, x.d, x.w, x.ep_s INTO dv FROM devices x WHERE x.device = a_device[j];
      IF (dv.salt, dv.hv, dv.kind, dv.d, dv.w, dv.ep_s) IS DISTINCT FROM
         (a_salt[j], a_hv[j], a_kind[j], a_d[j], a_w[j], a_ep_s[j]) THEN
        res[j] := 'device:' || json_build_array(dv.salt, dv.hv, dv.kind, dv.d, dv.w, dv.ep_s)::text;
        CONTINUE;
      END IF;
      SELECT x.mode, x.L, x.win_s INTO dv FROM releases x WHERE x.device = a_device[j] LIMIT 1;
      IF FOUND AND ((dv.mode = 'tree') <> (a_mode[j] = 'tree')
                    OR (a_mode[j] = 'tree' AND (dv.L <> a_L[j] OR dv.win_s <> a_win_s[j]))) THEN
        res[j] := 'shape:' || json_build_array(dv.mode, dv.L, dv.win_s)::text;
        CONTINUE;
      END IF;
      res[j] := 'error:XX000:release key neither inserted nor found';
    END LOOP;
    RETURN res;
  EXCEPTION WHEN OTHERS THEN
    IF SQLSTATE IN ('40P01', '40001', '55P03') THEN
      RAISE;
    END IF;
    RETURN NULL;
  END;
END
$f$
""" % {"args": ", ".join("a_%s %s[]" % tuple(a.split(" ", 1)) for a in _PUT_ARGS),
       "cols": ", ".join(a.split()[0] for a in _PUT_ARGS),
       "arrays": ", ".join("a_" + a.split()[0] for a in _PUT_ARGS)}
_PUT_MANY_CALL = "SELECT pansketch_put_many(%s)" % ", ".join("%%b::%s[]" % a.split(" ", 1)[1] for a in _PUT_ARGS)

# The devices per roll-up (SQLStore's rollup_device_counts: a fleet-wide answer knows from one row per
# window that the window holds every device; pansketch.host_tools.query.core._rollup_devices). A roll-up
# is one row per writer shard here, and a device whose releases of a window reached two aggregators is in
# two of them; its count goes to the row that took it first, so a roll-up's rows sum to its distinct
# devices. Each writer adds to the count row of its own shard's roll-up row only (no row another
# aggregator writes: no hot row); two writers adding one device to one window at once take its advisory
# lock (per roll-up key and device, in one order), so the second sees the first's committed row and
# does not count it again; a transaction past 1024 rows (a rebuild, a bulk copy; a group has at
# most 256) locks the count table instead (EXCLUSIVE: readers go on), as one lock per row would fill
# the server's lock table. A deletion (purge, a rebuild; rare, never the write path) recounts the keys it
# touched from their rows, onto each key's lowest id (a purge holds the count table EXCLUSIVE from its
# start, PgStore._lock_counts, and a group takes it ROW EXCLUSIVE before its rows: no writer adds to
# them meanwhile, and the two lock in one order). Statement triggers: the write path inserts a group's device rows in one
# statement, so the trigger runs once per group.
_ROLLUP_KEY = "win_s, win, kind, d, w, hv, salt"
_COUNT_FN_TEXT = ("""
CREATE OR REPLACE FUNCTION pansketch_count_devices() RETURNS trigger LANGUAGE plpgsql AS $f$
DECLARE so_far bigint;
BEGIN
  -- the rows this transaction counted so far (a rebuild inserts a window at a time, in one transaction)
  so_far := (SELECT count(*) FROM pansketch_new)
       + coalesce(nullif(current_setting('pansketch.counted_rows', true), ''), '0')::bigint;
  PERFORM set_config('pansketch.counted_rows', so_far::text, true);
  IF EXISTS (SELECT 1 FROM rollups r WHERE r.id IN (SELECT DISTINCT x.rollup FROM pansketch_new x)
              GROUP BY r.win_s, r.win, r.kind, r.d, r.w, r.hv, r.salt HAVING count(*) > 1) THEN
    -- one device may be in two of this statement's rows of one roll-up (not the write path: a writer adds
    -- to its own shard's rows only): those roll-ups recounted from their rows
    PERFORM pansketch_recount_devices(ARRAY(SELECT DISTINCT rollup FROM pansketch_new));
    RETURN NULL;
  END IF;
  IF so_far > %(many)d THEN  -- (a rebuild, a bulk copy: not one lock per row)
    LOCK TABLE rollup_device_counts IN EXCLUSIVE MODE;
  ELSE  -- (before the check: a bulk statement's table lock then waits for this transaction, or it for that)
    LOCK TABLE rollup_device_counts IN ROW EXCLUSIVE MODE;
    PERFORM pg_advisory_xact_lock(h) FROM (
      SELECT DISTINCT hashtextextended(concat_ws(':', r.win_s, r.win, r.kind, r.d, r.w, r.hv, r.salt, x.device),
                                       %(cls)d) AS h
        FROM pansketch_new x JOIN rollups r ON r.id = x.rollup ORDER BY 1) l;
  END IF;
  -- each roll-up row's other shard rows found once (not per device row), then a key probe per device
  -- and other row
  WITH sib AS MATERIALIZED (
    SELECT r.id, array_agg(s.id) AS ids FROM rollups r JOIN rollups s
        ON (s.win_s, s.win, s.kind, s.d, s.w, s.hv, s.salt) = (r.win_s, r.win, r.kind, r.d, r.w, r.hv, r.salt)
       AND s.id <> r.id
     WHERE r.id IN (SELECT DISTINCT x.rollup FROM pansketch_new x) GROUP BY r.id)
  INSERT INTO rollup_device_counts (rollup, devices)
  SELECT n.rollup, count(*) FROM pansketch_new n LEFT JOIN sib ON sib.id = n.rollup
   WHERE sib.ids IS NULL
      OR NOT EXISTS (SELECT 1 FROM rollup_devices x WHERE x.rollup = ANY(sib.ids) AND x.device = n.device)
   GROUP BY n.rollup ORDER BY n.rollup
  ON CONFLICT (rollup) DO UPDATE SET devices = rollup_device_counts.devices + excluded.devices;
  RETURN NULL;
END
$f$""", """
CREATE OR REPLACE FUNCTION pansketch_recount_devices(ids bigint[]) RETURNS void LANGUAGE plpgsql AS $f$
BEGIN  -- the roll-ups with a row among ``ids``: their counts from their rows, on each one's lowest id
  LOCK TABLE rollup_device_counts IN EXCLUSIVE MODE;  -- (rare: purge, rebuild)
  WITH t AS (SELECT s.id, min(s.id) OVER (PARTITION BY s.win_s, s.win, s.kind, s.d, s.w, s.hv, s.salt) AS first
               FROM (SELECT DISTINCT r.win_s, r.win, r.kind, r.d, r.w, r.hv, r.salt
                       FROM rollups r WHERE r.id = ANY(ids)) k
               JOIN rollups s ON (s.win_s, s.win, s.kind, s.d, s.w, s.hv, s.salt)
                                 = (k.win_s, k.win, k.kind, k.d, k.w, k.hv, k.salt)),
       gone AS (DELETE FROM rollup_device_counts c
                 WHERE (c.rollup IN (SELECT id FROM t WHERE id <> first) OR c.rollup = ANY(ids))
                   AND c.rollup NOT IN (SELECT first FROM t))
  INSERT INTO rollup_device_counts (rollup, devices)
  SELECT t.first, count(DISTINCT x.device) FROM t LEFT JOIN rollup_devices x ON x.rollup = t.id
   GROUP BY t.first
  ON CONFLICT (rollup) DO UPDATE SET devices = excluded.devices;
END
$f$""", """
CREATE OR REPLACE FUNCTION pansketch_uncount_devices() RETURNS trigger LANGUAGE plpgsql AS $f$
BEGIN
  PERFORM pansketch_recount_devices(ARRAY(SELECT DISTINCT rollup FROM pansketch_old));
  RETURN NULL;
END
$f$""")
_COUNT_FNS = tuple(f % {"cls": 7243313, "many": 1024} for f in _COUNT_FN_TEXT)
_COUNT_TRIGGERS = (
    "CREATE TRIGGER rollup_devices_counted AFTER INSERT ON rollup_devices REFERENCING NEW TABLE AS pansketch_new "
    "FOR EACH STATEMENT EXECUTE FUNCTION pansketch_count_devices()",
    "CREATE TRIGGER rollup_devices_uncounted AFTER DELETE ON rollup_devices REFERENCING OLD TABLE AS pansketch_old "
    "FOR EACH STATEMENT EXECUTE FUNCTION pansketch_uncount_devices()",
)

# Binary one-dimensional arrays of pansketch_put_many's columns, built in one pass per column: psycopg's list
# dumper walks every element in Python (about 70 us per release of a group's 37 columns, more than the
# server spends storing it). (element type oid, array type oid, struct code of a fixed-size element or None)
_ARRAY_TYPES = {"bigint": (20, 1016, "q"), "double precision": (701, 1022, "d"), "text": (25, 1009, None),
                "bytea": (17, 1001, None)}
_COL_TYPES = [_ARRAY_TYPES[a.split(" ", 1)[1]] for a in _PUT_ARGS]


class _PgArray:
    """A binary PostgreSQL array, ready to send (``oid``: its array type)."""

    __slots__ = ("oid", "data")

    def __init__(self, oid: int, data: bytes) -> None:
        self.oid, self.data = oid, data


def _pg_array(values: Sequence[Any], elem: int, oid: int, fixed: Optional[str]) -> _PgArray:
    """``values`` (None: NULL) as a binary array (the wire format of array_send)."""
    import struct

    import numpy as np

    nulls = any(v is None for v in values)
    head = struct.pack(">iiiii", 1, int(nulls), elem, len(values), 1)
    if fixed is not None and not nulls:  # (length 8, value) pairs, big-endian, in one numpy pass
        a = np.empty(len(values), dtype=[("n", ">i4"), ("v", ">" + ("i8" if fixed == "q" else "f8"))])
        a["n"] = 8
        a["v"] = values
        return _PgArray(oid, head + a.tobytes())
    parts = [head]
    texts: dict[Any, bytes] = {}  # a group repeats a few strings (device, kind, salt, ...): each encoded once
    for v in values:
        if v is None:
            parts.append(b"\xff\xff\xff\xff")
        elif fixed is not None:
            parts.append(struct.pack(">i" + fixed, 8, v))
        elif isinstance(v, str):
            b = texts.get(v)
            if b is None:
                e = v.encode()
                b = texts[v] = struct.pack(">i", len(e)) + e
            parts.append(b)
        else:
            parts += [struct.pack(">i", len(v)), v]
    return _PgArray(oid, b"".join(parts))


def _put_many_params(rows: Sequence[Pending], min_bytes: Optional[int]) -> list[_PgArray]:
    cols = zip(*[_put_args(p, min_bytes) for p in rows])
    return [_pg_array(c, elem, oid, fixed) for c, (elem, oid, fixed) in zip(cols, _COL_TYPES)]


def _register_arrays(conn: Any) -> None:
    from psycopg.adapt import Dumper
    from psycopg.pq import Format

    class ArrayDumper(Dumper):
        format = Format.BINARY

        def dump(self, obj: Any) -> bytes:
            return obj.data  # type: ignore[no-any-return]

        def get_key(self, obj: Any, format: Any) -> Any:
            return (_PgArray, obj.oid)

        def upgrade(self, obj: Any, format: Any) -> "Dumper":
            d = ArrayDumper(_PgArray)
            d.oid = obj.oid
            return d

    conn.adapters.register_dumper(_PgArray, ArrayDumper)


def _setup_id() -> str:
    """Names this code's PostgreSQL set-up (tables, columns, storage, indexes, functions): a database
    whose meta 'pg_setup' holds it is opened without any DDL."""
    import hashlib
    import inspect

    try:
        code = inspect.getsource(PgStore._init_schema)
    except (OSError, TypeError):  # no source (a frozen install): the DDL text alone
        code = ""
    text = "\n".join(pg_schema() + list(_COUNT_FNS) + list(_COUNT_TRIGGERS)) + _PUT_FN + _PUT_MANY_FN + code
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class PgStore(SQLStore):
    """The release store in the PostgreSQL database ``dsn``."""

    _for_update = " FOR UPDATE"
    # [store] compress unset: every payload over payloadcodec.MIN_BYTES (the smaller rows save the server more
    # CPU than the encode costs the aggregator, docs/HOST.md "Stored encoding")
    compress_default_bytes = payloadcodec.MIN_BYTES
    _read_begin = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"

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
        _register_arrays(self.conn)
        if self.readonly:
            self.conn.execute("SET default_transaction_read_only = on")
        else:
            self._rollup_shard = self._take_shard()

    def _take_shard(self) -> int:
        """The first free writer slot (a session advisory lock, released with the connection)."""
        for slot in range(_SHARDS):
            if self.conn.execute("SELECT pg_try_advisory_lock(%s, %s)", (_SHARD_LOCK, slot)).fetchone()[0]:
                return slot
        return _SHARDS - 1  # more writers than slots: they share the last one (correct, only slower)

    def _cursor(self) -> Any:
        if self.conn is None or self.conn.closed or self.conn.broken:
            self._connect()  # the server came back: a new session
        return self.conn.cursor()

    def _sql(self, s: str) -> str:
        return s.replace("?", "%s")

    def _begin(self, cur: Any) -> None:
        # whatever the server's default: the device counts' trigger relies on each statement seeing
        # what other writers committed before it (a snapshot older than that would count twice)
        cur.execute("BEGIN ISOLATION LEVEL READ COMMITTED")

    def _lock_counts(self, cur: Any, exclusive: bool) -> None:
        """The device counts' table lock, taken before any roll-up row is locked (one order on every path:
        a writer's group ROW EXCLUSIVE, a purge EXCLUSIVE). A purge that took it only at its first
        deletion, with the next window's rows still to lock, waited for a writer holding such a row that
        waited for this lock: a deadlock."""
        if not self._counts_table:  # (a setup's first roll-up rebuild comes before the table)
            cur.execute("SELECT to_regclass('rollup_device_counts') IS NOT NULL")
            self._counts_table = bool(cur.fetchone()[0])
            if not self._counts_table:
                return
        cur.execute("LOCK TABLE rollup_device_counts IN %s MODE" % ("EXCLUSIVE" if exclusive else "ROW EXCLUSIVE"))

    _counts_table = False  # rollup_device_counts seen to exist (it is never dropped)

    def _retryable(self, exc: BaseException) -> bool:
        return getattr(exc, "sqlstate", None) in ("40P01", "40001", "55P03")

    def close(self) -> None:
        with self._lock:
            if self.conn is not None:
                self.conn.close()

    def _init_schema(self, cur: Any) -> None:
        cur.execute("SELECT pg_advisory_xact_lock(7243310)")  # aggregators starting together create it once
        # A database this code has set up already needs no DDL: ALTER TABLE, CREATE INDEX IF NOT EXISTS and
        # CREATE OR REPLACE FUNCTION lock the tables (ACCESS EXCLUSIVE, SHARE) to the end of this
        # transaction, so an aggregator starting beside running ones stalled their groups and could
        # deadlock with them (it held rollups while waiting for releases, a running group the reverse).
        cur.execute("SELECT to_regclass('meta') IS NOT NULL")
        if cur.fetchone()[0]:
            # (and the roll-ups are there: OPERATIONS.md rebuilds them by deleting meta 'rollups')
            cur.execute("SELECT value FROM meta WHERE key = 'pg_setup' AND EXISTS "
                        "(SELECT 1 FROM meta WHERE key = 'rollups') AND EXISTS (SELECT 1 FROM meta WHERE key = 'summaries')")
            row = cur.fetchone()
            if row is not None and row[0] == _SETUP_ID:
                # ... and its release columns are all there (a catalog read, no table lock)
                cur.execute("SELECT count(*) FROM pg_attribute WHERE attrelid = 'releases'::regclass "
                            "AND NOT attisdropped AND attname = ANY(%s)", ([name for name, _d, _x in _ADDED],))
                if cur.fetchone()[0] == len(_ADDED):
                    return
        for stmt in pg_schema():
            cur.execute(stmt)
        # releases are written once and rarely read; counters hardly compress: no pglz on every insert
        cur.execute("ALTER TABLE releases ALTER COLUMN payload SET STORAGE EXTERNAL")
        # a roll-up's sums (int64, mostly sign bytes) are rewritten by every group that adds to its window:
        # lz4 halves them (32 KB -> 16 KB at d=4 w=1024), and with them the TOAST rows and WAL each group
        # writes per window: 83 -> 77 us of server CPU per release in groups of 100 (pglz: 460 us). A
        # server built without lz4 keeps them uncompressed
        cur.execute("ALTER TABLE rollups ALTER COLUMN sums SET STORAGE EXTENDED")
        cur.execute("DO $$ BEGIN ALTER TABLE rollups ALTER COLUMN sums SET COMPRESSION lz4; "
                    "EXCEPTION WHEN OTHERS THEN ALTER TABLE rollups ALTER COLUMN sums SET STORAGE EXTERNAL; END $$")
        # roll-up rows per writer shard (module docstring): the key gains the shard
        cur.execute("ALTER TABLE rollups ADD COLUMN IF NOT EXISTS shard INTEGER NOT NULL DEFAULT 0")
        cur.execute("CREATE UNIQUE INDEX IF NOT EXISTS rollups_shard_key ON rollups "
                    "(win_s, win, kind, d, w, hv, salt, shard)")
        cur.execute("SELECT conname FROM pg_constraint WHERE conrelid = 'rollups'::regclass AND contype = 'u' "
                    "AND cardinality(conkey) = 7")
        for (name,) in cur.fetchall():
            cur.execute('ALTER TABLE rollups DROP CONSTRAINT "%s"' % name.replace('"', '""'))
        cur.execute("CREATE SEQUENCE IF NOT EXISTS pansketch_changes")  # the change counter (SQLBase._bump_after)
        cur.execute(_FLAG_SHARDS_DDL)  # each writer's count of changes per window (PgStore._bump_flag_windows)
        cur.execute(_PUT_FN)
        cur.execute(_PUT_MANY_FN)
        cur.execute("INSERT INTO meta (key, value) VALUES ('schema_version', %s) ON CONFLICT (key) DO NOTHING",
                    (str(SCHEMA_VERSION),))
        cur.execute("SELECT value FROM meta WHERE key = 'rollups'")
        if cur.fetchone() is None:
            self._rebuild_rollups(cur)
            cur.execute("INSERT INTO meta (key, value) VALUES ('rollups', '1')")
        self._init_flag_windows(cur)
        self._init_device_counts(cur)
        summary.init(self, cur)
        cur.execute("INSERT INTO meta (key, value) VALUES ('pg_setup', %s) ON CONFLICT (key) DO UPDATE "
                    "SET value = excluded.value", (_SETUP_ID,))

    def _init_device_counts(self, cur: Any) -> None:
        """``rollup_device_counts`` and its triggers (the comment at ``_COUNT_FNS``), counted from
        ``rollup_devices`` once (a store from before them, or a new one): each key's distinct devices on
        its lowest roll-up id. The triggers are created first: they lock ``rollup_devices`` (SHARE ROW
        EXCLUSIVE) to the commit, so no writer adds a row between the count and the triggers."""
        for fn in _COUNT_FNS:
            cur.execute(fn)
        cur.execute("SELECT to_regclass('rollup_device_counts') IS NOT NULL")
        if cur.fetchone()[0]:
            return
        cur.execute("CREATE TABLE rollup_device_counts (rollup BIGINT PRIMARY KEY, devices BIGINT NOT NULL)")
        for stmt in _COUNT_TRIGGERS:
            cur.execute(stmt)
        cur.execute("INSERT INTO rollup_device_counts (rollup, devices) "
                    "SELECT min(r.id), count(DISTINCT x.device) FROM rollups r JOIN rollup_devices x ON x.rollup = r.id "
                    "GROUP BY " + ", ".join("r." + c for c in _ROLLUP_KEY.split(", ")))

    _counts_kept: Optional[bool] = None

    def rollup_device_counts(self, ids: Sequence[int]) -> Optional[dict[int, int]]:
        """Roll-up row id -> the devices counted on it (a roll-up's rows sum to its distinct devices:
        ``_COUNT_FNS``); None for a database no writer of this version has set up (then the rows)."""
        if self._counts_kept is None:
            r = self._q("SELECT to_regclass('rollup_device_counts') IS NOT NULL")
            self._counts_kept = bool(r and r[0][0])
        if not self._counts_kept:
            return None
        return {int(r): int(n) for r, n in self._by_ids("SELECT rollup, devices FROM rollup_device_counts "
                                                        "WHERE rollup IN (%s)", ids)}

    # One pipeline over the whole group (psycopg's pipeline mode): a statement whose results the group
    # does not read (the roll-up updates, their noise and device rows, the flag shards, the summaries'
    # saves) goes out with the next one that is read, instead of each batch waiting for its own round
    # trip. A group's fixed cost (a dozen round trips, each a wake-up of the aggregator and of its
    # session) is what grows per release as more aggregators split a stream into smaller groups.
    _pipelined = True

    def _group(self, cur: Any, items: Sequence[Pending], log_rejections: bool,
               seen: dict[str, tuple[Any, ...]]) -> None:
        if not self._pipelined:
            return self._group_body(cur, items, log_rejections, seen)
        with self.conn.pipeline():
            self.__dict__["_in_pipeline"] = True
            try:
                self._group_body(cur, items, log_rejections, seen)
            finally:
                self.__dict__.pop("_in_pipeline", None)

    def _reader(self, cur: Any) -> Any:
        """A cursor for a statement whose rows are read: in the group's pipeline a fresh one (a cursor that
        ran an ``executemany`` there hands a later fetch that batch's results, not its own statement's)."""
        return self.conn.cursor() if self.__dict__.get("_in_pipeline") else cur

    def _x(self, cur: Any, sql: str, args: Sequence[Any] = ()) -> Any:
        c = self._reader(cur)
        c.execute(self._sql(sql), tuple(args))
        return c

    def _group_body(self, cur: Any, items: Sequence[Pending], log_rejections: bool,
                    seen: dict[str, tuple[Any, ...]]) -> None:
        """The group in a few round trips: its releases in one set-based pansketch_put_many (the rest, and
        all of them when that fails, through pansketch_put, pipelined), then the rejections, then the
        roll-ups."""
        seen.clear()
        logged = [0, 0]
        totals: dict[str, list[Any]] = {}
        todo = []
        self._prefetch_tops(cur, items)
        for p in items:
            p.status, p.error = ("" if p.rel is not None and p.rej is None else "rejected"), None
            if p.status == "" and p.rel is not None and not self._quarantined(cur, p, logged):
                todo.append(p)
        # key order: concurrent writers take release keys and new devices' rows in one order, so two
        # aggregators storing overlapping groups (a fleet's first releases, re-sends) wait for each other
        # instead of deadlocking (each deadlock stalled both for deadlock_timeout, 1 s, and the loser's
        # group was rolled back and stored again: two aggregators ran slower than one)
        todo.sort(key=_key_order)
        together, alone = _set_rows(todo)
        try:
            params = _put_many_params(together, self.compress_min_bytes()) if together else None
        except (OverflowError, ValueError, TypeError):  # a value no array column holds: release by release,
            params, together, alone = None, [], todo   # where the server refuses that release alone
        if params is not None:
            rc = self._reader(cur)
            rc.execute(_PUT_MANY_CALL, params)
            results = rc.fetchone()[0]
            if results is None:  # a database error on some release: each in its own subtransaction
                together, alone = [], todo
            elif len(results) != len(together):
                raise StoreError("pansketch_put_many returned %d results for %d releases"
                                 % (len(results), len(together)))
            else:
                for p, res in zip(together, results):
                    _apply_result(p, res)
        if alone:
            cur = self._reader(cur)
            cur.executemany("SELECT pansketch_put(%s)" % ", ".join(["%s"] * len(_PUT_ARGS)),
                            [_put_args(p, self.compress_min_bytes()) for p in alone], returning=True)
            results = []
            while True:
                results.append(cur.fetchone()[0])
                if not cur.nextset():
                    break
            if len(results) != len(alone):
                raise StoreError("pansketch_put returned %d results for %d releases" % (len(results), len(alone)))
            for p, res in zip(alone, results):
                _apply_result(p, res)
        rej = [p for p in items if p.status == "rejected" and p.rej is not None]
        if log_rejections and rej:
            for p in rej:
                self._log_rejection(cur, p)
                self._total(totals, p)
            logged[0] += len(rej)
        self._close_group(cur, todo, logged, totals)

    def _prefetch_tops(self, cur: Any, items: Sequence[Pending]) -> None:
        """The highest stored seq (the seq-jump check, SQLStore._seq_jump) of every device of the group this
        writer has not seen yet, in one statement: one probe per device and round trip each cost every
        aggregator a round trip per device of the fleet (again after each restart), so that each added
        aggregator added its own."""
        cache = self.__dict__.setdefault("_maxseq", {})
        devs = sorted({p.rel.dev for p in items if p.rel is not None and p.quarantine is None} - set(cache))
        if devs:
            cur = self._reader(cur)
            cur.execute("SELECT t.d, (SELECT max(x.seq) FROM releases x WHERE x.device = t.d) "
                        "FROM unnest(%s::text[]) AS t(d)", (devs,))
            for dev, top in cur.fetchall():
                cache[dev] = -1 if top is None else int(top)

    def _apply_rollups(self, cur: Any, accs: dict[tuple[Any, ...], _Acc]) -> None:
        """SQLStore._apply_rollups in two pipelined round trips instead of three per roll-up row: the
        rows (this writer's shard) created if missing, locked and read, all at once (binary: no hex
        text for the sums); then every update and the noise and device rows. While a group's
        transaction waited for each of those round trips, its session sat idle in the transaction."""
        if not accs:
            return
        import numpy as np

        keys = sorted(accs)
        shard = self._rollup_shard if self._rollup_shard is not None else 0
        self._lock_counts(cur, exclusive=False)
        cols = "win_s, win, kind, d, w, hv, salt, shard"
        cur.executemany("INSERT INTO rollups (%s, releases, t0, t1, sums) VALUES (%s, 0, %%s, %%s, %%s) "
                        "ON CONFLICT (%s) DO NOTHING" % (cols, ", ".join(["%s"] * 8), cols),
                        [k + (shard, accs[k].t0, accs[k].t1, np.zeros(k[3] * k[4], dtype="<i8").tobytes())
                         for k in keys])
        with self.conn.cursor(binary=True) as bcur:
            bcur.executemany("SELECT id, releases, t0, t1, sums FROM rollups WHERE win_s = %s AND win = %s "
                             "AND kind = %s AND d = %s AND w = %s AND hv = %s AND salt = %s AND shard = %s "
                             "FOR UPDATE", [k + (shard,) for k in keys], returning=True)
            rows = []
            while True:
                rows.append(bcur.fetchone())
                if not bcur.nextset():
                    break
        if len(rows) != len(keys) or any(r is None for r in rows):
            raise StoreError("roll-up rows missing after their insert (%d of %d)" % (len(rows), len(keys)))
        ups, noise, devs = [], [], []
        for k, (rid, n, t0, t1, blob) in zip(keys, rows):
            acc = accs[k]
            sums = np.frombuffer(blob, dtype="<i8").reshape(k[3], k[4]) + acc.sums
            ups.append((int(n) + acc.releases, min(int(t0), acc.t0), max(int(t1), acc.t1),
                        sums.astype("<i8").tobytes(), rid))
            noise += [(rid, mech, num, den, c) for (mech, num, den), c in sorted(acc.noise.items())]
            devs += [(rid, dev) for dev in sorted(acc.devices)]
        cur.executemany("UPDATE rollups SET releases = %s, t0 = %s, t1 = %s, sums = %s WHERE id = %s", ups)
        if noise:
            cur.executemany("INSERT INTO rollup_noise (rollup, mech, num, den, count) VALUES (%s, %s, %s, %s, %s) "
                            "ON CONFLICT (rollup, mech, num, den) DO UPDATE "
                            "SET count = rollup_noise.count + excluded.count", noise)
        if devs:  # a row per device and window: one statement, not one per row
            cur.execute("INSERT INTO rollup_devices (rollup, device) SELECT * FROM unnest(%b::bigint[], %b::text[]) "
                        "ON CONFLICT (rollup, device) DO NOTHING",
                        [_pg_array([r for r, _d in devs], *_ARRAY_TYPES["bigint"]),
                         _pg_array([d for _r, d in devs], *_ARRAY_TYPES["text"])])

    _bump_in_tx = None
    _bump_after = "SELECT nextval('pansketch_changes')"

    # Flag generations (schema ``flag_windows``; pansketch.host_tools.query.influence). SQLStore bumps one row
    # per window in every group's transaction: all aggregators storing a window's releases updated that row,
    # so each group waited for the other writers' groups to commit (fsync included). Here each writer counts
    # its changes in its own row of ``flag_window_shards`` (its roll-up shard), and a window's generation is
    # flag_windows.gen plus the sum of its shard counts (negative gen: no window, as a purge leaves it). The
    # flag_windows row of a window this writer has not met yet is created before the group's transaction
    # (commit_group), in a statement of its own: two writers creating it at once wait for one short insert,
    # not for a whole group.
    def commit_group(self, items: Sequence[Pending], log_rejections: bool = True, sync: bool = True) -> None:
        known = self.__dict__.setdefault("_flag_wins", set())
        new = {(p.rel.win_s, p.rel.win) for p in items if p.rel is not None} - known
        if new and not self.readonly:
            if len(known) > 4096:  # a bound (old windows are not stored into again): re-created rows cost nothing
                known.clear()
            with self._lock:  # its own transaction (autocommit; not a change of the store's contents: the
                known.update(self._ensure_windows(self._cursor(), new))  # change counter stays)
        self.__dict__["_flag_pending"] = set()
        try:
            super().commit_group(items, log_rejections, sync)
            known.update(self.__dict__["_flag_pending"])  # committed: the rows the group's own insert made
        finally:
            self.__dict__.pop("_flag_pending", None)

    def _ensure_windows(self, cur: Any, wins: Iterable[tuple[int, int]]) -> set[tuple[int, int]]:
        """The flag_windows rows of ``wins``, created where missing; returns the windows whose row exists
        (committed) or is this statement's. A row another writer is creating this instant (its advisory
        lock, taken by every insert of one) is left to it: waiting for its insert would be a lock wait,
        and it would wait for that writer's commit, behind the WAL of every group before it."""
        ws = sorted(wins)
        cur = self._reader(cur)
        cur.execute("WITH t AS (SELECT * FROM unnest(%s::bigint[], %s::bigint[]) AS t(ws, w)), "
                    "have AS (SELECT t.ws, t.w FROM t JOIN flag_windows f ON f.win_s = t.ws AND f.win = t.w), "
                    "mine AS MATERIALIZED (SELECT t.ws, t.w FROM t WHERE NOT EXISTS (SELECT 1 FROM have h "
                    "WHERE h.ws = t.ws AND h.w = t.w) AND pg_try_advisory_xact_lock(%s, hashtext(t.ws || ':' || t.w))), "
                    "ins AS (INSERT INTO flag_windows (win_s, win, gen, done, setting) SELECT ws, w, 1, 0, '' FROM mine "
                    "ON CONFLICT (win_s, win) DO NOTHING) "
                    "SELECT ws, w FROM have UNION ALL SELECT ws, w FROM mine",
                    ([a for a, _b in ws], [b for _a, b in ws], _FLAG_WINDOW_LOCK))
        return {(int(a), int(b)) for a, b in cur.fetchall()}

    def _bump_flag_windows(self, cur: Any, wins: Any) -> None:
        if not wins:
            return
        ws = sorted(wins)
        shard = self._rollup_shard if self._rollup_shard is not None else 0
        # a window whose row this writer has not seen (purge, retention, one another writer was creating at
        # the group's start): its row, then a purged window stored into again is a window again; neither
        # touches a committed row in the common case (the update matches no row)
        unknown = [w for w in ws if w not in self._flag_wins_known()]
        if unknown:
            made = self._ensure_windows(cur, unknown)
            if "_flag_pending" in self.__dict__:
                self.__dict__["_flag_pending"] |= made
        cur.executemany("UPDATE flag_windows SET gen = 1 - gen WHERE win_s = %s AND win = %s AND gen < 0", ws)
        cur.executemany("INSERT INTO flag_window_shards (win_s, win, shard, n) VALUES (%s, %s, %s, 1) "
                        "ON CONFLICT (win_s, win, shard) DO UPDATE SET n = flag_window_shards.n + 1",
                        [w + (shard,) for w in ws])

    def _flag_wins_known(self) -> set[tuple[int, int]]:
        return self.__dict__.get("_flag_wins", set())  # type: ignore[no-any-return]

    def flag_windows_sql(self) -> str:
        """As SQLStore's: a window's generation with its writers' shard counts added."""
        if not self.__dict__.get("_flag_shards"):
            r = self._q("SELECT to_regclass('flag_window_shards') IS NOT NULL")
            if not (r and r[0][0]):  # a database no writer of this version opened yet (a reader's)
                return super().flag_windows_sql()
            self.__dict__["_flag_shards"] = True
        return ("SELECT f.win_s, f.win, CASE WHEN f.gen < 0 THEN f.gen ELSE f.gen + coalesce(s.n, 0) END AS g, "
                "f.done, f.setting FROM flag_windows f LEFT JOIN (SELECT win_s, win, sum(n) AS n FROM "
                "flag_window_shards GROUP BY win_s, win) s ON s.win_s = f.win_s AND s.win = f.win")

    def change_count(self) -> Optional[int]:
        """As Reader.change_count, from the sequence the writers advance after each commit."""
        try:
            r = self._q("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM pansketch_changes")
        except self._db_errors:
            return None
        return int(r[0][0]) if r else None

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
                yield from self._fetched(cur, size)


_SETUP_ID = _setup_id()


def _key_order(p: Pending) -> tuple[Any, ...]:
    rel = p.rel
    assert rel is not None
    return rel.key


def _set_rows(todo: list[Pending]) -> tuple[list[Pending], list[Pending]]:
    """``todo`` (in key order) split into what pansketch_put_many stores in one statement and what goes
    release by release after it. That statement checks every release against the rows stored before it,
    so it takes only releases that do not depend on each other: the first of each key (a re-sent copy in
    the same group goes after it, and is then a duplicate or a conflict), and only devices whose releases
    in the group have one shape (tree or not, L, win_s; a device mixing them goes release by release, in
    key order, so the first stored decides as it always did)."""
    shapes: dict[str, set[tuple[Any, ...]]] = {}
    for p in todo:
        rel = p.rel
        assert rel is not None
        tree = rel.mode == "tree"
        shapes.setdefault(rel.dev, set()).add((tree, rel.L if tree else 0, rel.win_s if tree else 0))
    together: list[Pending] = []
    alone: list[Pending] = []
    last: Any = None
    for p in todo:
        rel = p.rel
        assert rel is not None
        if len(shapes[rel.dev]) > 1 or rel.key == last:
            alone.append(p)
        else:
            together.append(p)
        last = rel.key
    return together, alone


def _put_args(p: Pending, min_bytes: Optional[int]) -> tuple[Any, ...]:
    rel = p.rel
    assert rel is not None
    return insert_values(rel, p.topic, p.received, min_bytes)


def _apply_result(p: Pending, res: str) -> None:
    """pansketch_put's answer -> the Pending's status, with SQLStore._insert's messages."""
    rel = p.rel
    assert rel is not None
    kind, _, rest = res.partition(":")
    if kind in ("stored", "duplicate"):
        p.status = kind
    elif kind == "conflict":
        p.status = "rejected"
        p.rej = Rejected("conflict", "release (dev %s, epochs [%d, %d), part %d) is already stored with different "
                         "bytes (stored seq %s, this seq %d): noise re-drawn or device state reset? "
                         "the stored one is kept" % (rel.dev, rel.elo, rel.ehi, rel.part, rest, rel.seq))
    elif kind == "device":
        dev = json.loads(rest)
        mine = (rel.salt, rel.hv, rel.kind, rel.d, rel.w, rel.ep_s)
        names = ("salt id", "hash version", "kind", "d", "w", "ep_s")
        diffs = ["%s %s -> %s" % (n, a, b) for n, a, b in zip(names, dev, mine) if a != b]
        p.status = "rejected"
        p.rej = Rejected("device", "device %s changed parameters its earlier releases fixed (%s); "
                         "give the reconfigured device a new id" % (rel.dev, ", ".join(diffs)))
    elif kind == "shape":
        mode, L, win_s = json.loads(rest)
        p.status = "rejected"
        p.rej = Rejected("device", "device %s sent %s releases before (L=%d, win_s=%d); this one is %s (L=%d, "
                         "win_s=%d): a device's releases are all nodes of one tree shape or none is, or a range "
                         "query would count events twice; give the reconfigured device a new id"
                         % (rel.dev, mode, L, win_s, rel.mode, rel.L, rel.win_s))
    else:
        p.status = "error"
        p.error = StoreError("storing release %s seq %d failed: %s" % (rel.dev, rel.seq, rest))
