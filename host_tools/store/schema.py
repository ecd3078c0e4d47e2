"""The store's tables, their columns, and the in-place upgrades of older databases.

Both backends create these tables (PostgreSQL in its own types:
pansketch.host_tools.store.pg); the SQL of :class:`pansketch.host_tools.store.sql.SQLStore`
reads and writes them.

Tables (schema version 1)::

    releases        one row per release, PRIMARY KEY (elo, device, ehi, part)
                    in a SQLite file created by this version (TIME_KEY),
                    (device, elo, ehi, part) in older files and on PostgreSQL
                    (DEVICE_KEY); every map field, the payload bytes
                    (compressed: pansketch.host_tools.store.payloadcodec; raw in
                    rows written before; empty once retention pruned them:
                    SQLStore.prune), their SHA-256, the topic and the time received
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
                    count, exactly the terms pansketch.host_tools.query.merge adds up
    rollup_devices  per roll-up the devices that contributed
    flag_windows    per (window length, window id) that holds releases: gen,
                    bumped by every change of its releases (store, purge,
                    retention's prune), and done, the gen its stored flags
                    were computed at, with the setting they were computed
                    with (contribution limits, excluded devices); the write
                    path keeps gen, pansketch.host_tools.query.influence the rest
                    (PostgreSQL: each writer counts its changes in its own row of
                    ``flag_window_shards``, added to gen: pansketch.host_tools.store.pg)
    flags           the flagged devices of each window at ``done``, in the
                    order of pansketch.host_tools.query.influence.window_flags
                    (doc: the Flag's fields as JSON)
    device_summaries per device and writer shard the figures of its releases that
                    status, the fleet page and the privacy ledger's fleet windows
                    read (one JSON document, kept by the write path and a purge,
                    shards merged on read: pansketch.host_tools.store.summary)

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
rejections. ``flag_windows`` and ``flags`` are created by a writer's open
of an older file, ``flag_windows`` filled with every window its releases
hold (meta ``flag_windows``), their flags to compute; a read-only open of
such a file computes flags from the releases, as before.
"""

from __future__ import annotations

from typing import Any, Optional

from pansketch.host_tools import cborscan
from pansketch.host_tools.store import payloadcodec
from pansketch.host_tools.store.records import Release

SCHEMA_VERSION = 1

# The release key's column order. PostgreSQL keeps the device first. A new SQLite file puts the epoch first
# (``Store``): a group commit from many devices then adds its keys to a few neighbouring index pages, where
# device-first scattered them over one 16 KiB page per device, each written whole to the WAL and again by
# the checkpoint (docs/PERFORMANCE-HISTORY.md). Both orders are one UNIQUE key to ``ON CONFLICT``.
DEVICE_KEY = "device, elo, ehi, part"
TIME_KEY = "elo, device, ehi, part"

# releases_tree: has_tree() asks on every fleet-wide query whether any tree-mode release exists (they are
# never rolled up); without this index that was a scan of every row. Partial, so it holds tree rows only
# and costs window/keep ingest nothing. releases_long: the releases spanning several epochs (a device that
# could not release at an epoch's end), the only ones that can straddle a series bucket (Reader.long_releases);
# partial for the same reason.
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
CREATE INDEX IF NOT EXISTS releases_tree ON releases (mode) WHERE mode = 'tree';
CREATE INDEX IF NOT EXISTS releases_long ON releases (t0) WHERE ehi - elo > 1;
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
CREATE TABLE IF NOT EXISTS flag_windows (
    win_s INTEGER NOT NULL, win INTEGER NOT NULL, gen INTEGER NOT NULL, done INTEGER NOT NULL,
    setting TEXT NOT NULL, PRIMARY KEY (win_s, win)
);
CREATE TABLE IF NOT EXISTS flags (
    win_s INTEGER NOT NULL, win INTEGER NOT NULL, pos INTEGER NOT NULL, device TEXT NOT NULL, doc TEXT NOT NULL,
    PRIMARY KEY (win_s, win, pos)
);
CREATE TABLE IF NOT EXISTS device_summaries (
    device TEXT NOT NULL, shard INTEGER NOT NULL, doc TEXT NOT NULL, PRIMARY KEY (device, shard)
) WITHOUT ROWID;
"""


def schema(key: str) -> str:
    """The DDL with the release key's column order ``key`` (DEVICE_KEY or TIME_KEY)."""
    return _SCHEMA_TMPL % {"key": key}


_SCHEMA = schema(DEVICE_KEY)  # PostgreSQL's (pansketch.host_tools.store.pg)

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


def _select_cols(have: Optional[set[str]]) -> str:
    """The release columns to select from a table with columns ``have`` (None: all; old files: "2 AS nz", ...)."""
    old = {name: dflt for name, _, dflt in _ADDED}
    return ", ".join(c if have is None or c not in old or c in have else "%s AS %s" % (old[c], c) for c in _COLS)


def insert_values(rel: Release, topic: Optional[str], received: float, min_bytes: Optional[int]) -> tuple[Any, ...]:
    """``rel``'s values for :data:`_INSERT_COLS` (both backends); the payload in its stored encoding
    (pansketch.host_tools.store.payloadcodec: compressed, decoded back byte for byte on read) if it has
    at least ``min_bytes`` of counters (SQLBase.compress_min_bytes), else as sent."""
    r, c = rel.shape
    return (rel.dev, rel.elo, rel.ehi, rel.part, rel.seq, rel.win, rel.win_s, rel.ep_s, rel.t0, rel.t1, rel.mode,
            rel.kind, rel.d, rel.w, rel.hv, rel.salt, rel.clip, rel.mech, rel.budget[0], rel.budget[1], rel.nint[0],
            rel.nint[1], rel.nout[0], rel.nout[1], rel.nz, rel.L, rel.sha256,
            payloadcodec.encode(rel.payload, rel.ctr_off, r * c) if min_bytes is not None and 4 * r * c >= min_bytes
            else rel.payload, rel.ctr_off, topic,
            received, rel.v, rel.lvl, rel.b) + (tuple(rel.map) if rel.map is not None else (None, None, None))


def rejected_seq(payload: Optional[bytes], device: Optional[str]) -> Optional[int]:
    """The seq of a refused release, when its (well-formed prefix of) bytes name ``device`` (else None).

    Read with the bounded byte-level reader (pansketch.host_tools.cborscan), never a
    CBOR object decoder: this runs in the aggregator's process (migrations).
    """
    if payload is None or device is None:
        return None
    dev, seq = cborscan.peek(bytes(payload))
    return seq if dev == device else None
