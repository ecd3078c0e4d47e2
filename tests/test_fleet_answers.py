"""Fleet-wide answers read one row per window: they equal the answers merged from the raw releases.

A fleet-wide `freq` or `series` knows from the per-roll-up device counts (kept by triggers on
``rollup_devices``) that a window holds every device, and then takes the store's device list instead of
N rows per window; a series takes its window lengths and time extent from the roll-ups instead of
aggregating every release row. Each is compared here with the same answer merged from the raw
releases (a store read without its roll-ups), on a fleet where every window holds every device and on
one where a device misses a window (its bucket then lists it as missing), and the counts the triggers
keep are checked against the rows they count after ingest, purge and the upgrade of an older file.
"""

from __future__ import annotations

import array
from typing import Any, Optional

import pytest

from pansketch.agent import release
from pansketch.agent.params import Params
from pansketch.host_tools import hostconfig
from pansketch.host_tools.ingest.aggregator import Aggregator
from pansketch.host_tools.query import core as query
from pansketch.host_tools.query import series as series_mod
from pansketch.host_tools.store import exclusions
from pansketch.host_tools.store.sqlite import Store

SALT = "fleet-answers-salt"
T0 = 1_700_000_000 // 3600 * 3600
ITEMS = ["item-%d" % i for i in range(4)]


def _fleet(db: str, devices: int, windows: int, skip: Optional[tuple[int, int]] = None) -> None:
    """``devices`` cms devices releasing one window each hour for ``windows`` hours (device, window ``skip``
    left out), through the aggregator's write path."""
    agg = Aggregator(hostconfig.from_dict({"fleet": {"salt": SALT}, "aggregator": {"db": db}}))
    for i in range(devices):
        dev = "dev%02d" % i
        p = Params({"device": dev, "salt": SALT, "kind": "cms", "d": 2, "w": 16, "window_s": 3600})
        for k in range(windows):
            if (i, k) == skip:
                continue
            ctr = array.array("i", [(i * 7 + k * 3 + c) % 11 - 2 for c in range(32)])
            raw = release.encode(p, k, T0 // 3600 + k, T0 // 3600 + k + 1, 0, ctr, 2 + (i % 2))
            assert agg.handle("pansketch/%s/release" % dev, raw).stored
    agg.close()


def _counts_equal_rows(db: str) -> None:
    st = Store(db, readonly=True)
    kept = dict(st._q("SELECT rollup, devices FROM rollup_device_counts WHERE devices > 0"))
    rows = dict(st._q("SELECT rollup, COUNT(*) FROM rollup_devices GROUP BY rollup"))
    st.close()
    assert kept == rows and rows


def _no_row_scans(st: Store, monkeypatch: Any) -> None:
    """Fail on the reads that grow with N x W: every release row, every device of every window."""
    def refuse(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("read every release row or every roll-up's device rows")

    for name in ("release_extents", "release_lengths", "rollup_devices"):
        monkeypatch.setattr(st, name, refuse)


@pytest.fixture(scope="module")
def full(tmp_path_factory: Any) -> str:
    db = str(tmp_path_factory.mktemp("full") / "f.db")
    _fleet(db, 5, 6)
    return db


@pytest.fixture(scope="module")
def gap(tmp_path_factory: Any) -> str:
    db = str(tmp_path_factory.mktemp("gap") / "g.db")
    _fleet(db, 5, 6, skip=(2, 3))  # dev02 released before and after window 3, not in it
    return db


def _raw(db: str) -> Store:
    st = Store(db, readonly=True)
    st.has_rollups = False  # every answer merged from the releases themselves
    return st


@pytest.mark.parametrize("running", [True, False])
def test_series_of_a_full_fleet_reads_no_release_rows(full: str, running: bool, monkeypatch: Any) -> None:
    fast, raw = Store(full, readonly=True), _raw(full)
    _no_row_scans(fast, monkeypatch)
    got = series_mod.series(fast, ITEMS, salt=SALT, step=3600, running=running)
    want = series_mod.series(raw, ITEMS, salt=SALT, step=3600, running=running)
    assert got.to_dict() == want.to_dict()
    assert len(got.lines[0].points) == 6 and all(p.missing_devices == [] for p in got.lines[0].points)
    assert got.lines[0].points[0].answer is not None and len(got.lines[0].points[0].answer.devices) == 5
    fast.close()
    raw.close()


def test_freq_of_a_full_fleet_reads_no_device_rows(full: str, monkeypatch: Any) -> None:
    fast, raw = Store(full, readonly=True), _raw(full)
    _no_row_scans(fast, monkeypatch)
    for sel in ({}, {"since": T0 + 3600}, {"window": T0 // 3600 + 2}):
        got = [a.to_dict() for a in query.freq(fast, ITEMS, salt=SALT, **sel)]  # type: ignore[arg-type]
        assert got == [a.to_dict() for a in query.freq(raw, ITEMS, salt=SALT, **sel)]  # type: ignore[arg-type]
        assert got[0]["devices"] == ["dev%02d" % i for i in range(5)]
    fast.close()
    raw.close()


@pytest.mark.parametrize("step,running", [(3600, True), (7200, False), (3600, False)])
def test_series_with_a_missing_device_lists_it(gap: str, step: int, running: bool) -> None:
    fast, raw = Store(gap, readonly=True), _raw(gap)
    got = series_mod.series(fast, ITEMS, salt=SALT, step=step, running=running)
    assert got.to_dict() == series_mod.series(raw, ITEMS, salt=SALT, step=step, running=running).to_dict()
    missing = [p.missing_devices for p in got.lines[0].points]
    assert missing == ([[], [], [], ["dev02"], [], []] if step == 3600 else [[], [], []])
    # the 2 h bucket of windows 2 and 3 has dev02 (window 2): a union, not the full count of one roll-up
    fast.close()
    raw.close()


def test_freq_with_an_excluded_device_equals_the_raw_merge(full: str, tmp_path: Any) -> None:
    st = Store(full, readonly=True)
    st.query_exclude = ("dev01",)  # type: ignore[attr-defined]
    raw = _raw(full)
    raw.query_exclude = ("dev01",)  # type: ignore[attr-defined]
    got = [a.to_dict() for a in query.freq(st, ITEMS, salt=SALT)]
    assert got == [a.to_dict() for a in query.freq(raw, ITEMS, salt=SALT)]
    assert "dev01" not in got[0]["devices"] and len(got[0]["devices"]) == 4
    st.close()
    raw.close()


def test_device_counts_follow_ingest_purge_and_upgrade(tmp_path: Any) -> None:
    db = str(tmp_path / "c.db")
    _fleet(db, 4, 3, skip=(1, 0))
    _counts_equal_rows(db)
    st = Store(db, readonly=True)
    counts = st.rollup_device_counts([i.id for i in st.rollups()])
    assert counts is not None and [counts[i.id] for i in st.rollups()] == [3, 4, 4]  # dev01 missed window 0
    st.close()
    st = Store(db)
    exclusions.purge(st, "dev03", since=T0 + 3600)  # its windows 1 and 2 taken out of their roll-ups
    st.close()
    _counts_equal_rows(db)
    st = Store(db, readonly=True)
    counts = st.rollup_device_counts([i.id for i in st.rollups()])
    assert counts is not None and [counts[i.id] for i in st.rollups()] == [3, 3, 3]
    st.close()
    # a file from before the counts: read-only opens fall back to the rows, the next writer counts them
    st = Store(db)
    st.db.executescript("DROP TRIGGER rollup_devices_counted; DROP TRIGGER rollup_devices_uncounted; "
                        "DROP TABLE rollup_device_counts;")
    st.close()
    ro = Store(db, readonly=True)
    assert ro.rollup_device_counts([1]) is None
    want = [a.to_dict() for a in query.freq(ro, ITEMS, salt=SALT)]
    ro.close()
    Store(db).close()
    _counts_equal_rows(db)
    ro = Store(db, readonly=True)
    assert [a.to_dict() for a in query.freq(ro, ITEMS, salt=SALT)] == want
    ro.close()


def _cli_json(db: str, tmp_path: Any, capsys: Any, *args: str) -> list[dict[str, Any]]:
    import json

    from pansketch.host_tools import cli

    conf = tmp_path / "host.toml"
    conf.write_text('[fleet]\nsalt = "%s"\n[aggregator]\ndb = "%s"\n' % (SALT, db))
    capsys.readouterr()
    assert cli.main(["query", "--config", str(conf), *args, "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


@pytest.mark.parametrize("kind", ["freq", "series", "topk"])
def test_json_answers_page_their_devices(full: str, tmp_path: Any, capsys: Any, kind: str) -> None:
    """--json lists a page of each answer's devices and their number; --all-devices every one, in the
    format without devices_page (the objects otherwise the same)."""
    args = {"freq": ["freq", *ITEMS[:2]], "series": ["series", ITEMS[0], "--step", "1h"],
            "topk": ["topk", "-k", "2", "--candidates", str(tmp_path / "cands")]}[kind]
    (tmp_path / "cands").write_text("\n".join(ITEMS) + "\n")
    every = ["dev%02d" % i for i in range(5)]
    whole = _cli_json(full, tmp_path, capsys, *args, "--all-devices")
    default = _cli_json(full, tmp_path, capsys, *args)
    part = _cli_json(full, tmp_path, capsys, *args, "--devices-limit", "2", "--devices-offset", "1")
    assert len(whole) == len(default) == len(part) == (6 if kind == "series" else 2)
    for w, d, p in zip(whole, default, part):
        assert "devices_page" not in w and w["devices"] == every
        assert d["devices"] == every and d["devices_page"] == {"offset": 0, "limit": 20, "total": 5}
        assert p["devices"] == every[1:3] and p["devices_page"] == {"offset": 1, "limit": 2, "total": 5}
        for x in (d, p):
            assert {k: v for k, v in x.items() if k not in ("devices", "devices_page")} == \
                {k: v for k, v in w.items() if k != "devices"}


def test_api_answers_page_their_devices(full: str, tmp_path: Any) -> None:
    import json

    from pansketch.host_tools.web.app import Dashboard

    app = Dashboard(hostconfig.from_dict({"fleet": {"salt": SALT}, "aggregator": {"db": full}}))

    def get(path: str, qs: str) -> Any:
        env = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "QUERY_STRING": qs, "wsgi.url_scheme": "http",
               "SERVER_NAME": "localhost", "SERVER_PORT": "80"}
        st: list[str] = []
        body = b"".join(app(env, lambda s, h, *a: st.append(s)))
        assert st[0].startswith("200"), (path, st, body[:200])
        return json.loads(body)

    a = get("/api/freq", "item=item-1&devices_limit=3&devices_offset=3")["answers"][0]
    assert a["devices"] == ["dev03", "dev04"] and a["devices_page"] == {"offset": 3, "limit": 3, "total": 5}
    a = get("/api/freq", "item=item-1&all_devices=1")["answers"][0]
    assert a["devices"] == ["dev%02d" % i for i in range(5)] and "devices_page" not in a
    pt = get("/api/series", "item=item-1&devices_limit=1")["lines"][0]["points"][0]
    assert pt["devices"] == ["dev00"] and pt["devices_page"]["total"] == 5


def test_rollup_view_reads_as_the_store(gap: str) -> None:
    """Every roll-up read a bucket makes gives what the store gives, for ranges inside the view's."""
    import numpy as np

    from pansketch.host_tools.query.rollupview import RollupView

    st = Store(gap, readonly=True)
    view = RollupView(st, T0 + 3600, T0 + 5 * 3600)
    for lo in range(1, 5):
        for hi in range(lo + 1, 6):
            for since, until in ((T0 + lo * 3600, T0 + hi * 3600), (T0 + lo * 3600 - 1800, T0 + hi * 3600 - 1)):
                if since < T0 + 3600:
                    continue
                want = st.rollups(since=since, until=until)
                assert view.rollups(since=since, until=until) == want and want
                ids = [i.id for i in want]
                assert view.rollup_noise(ids) == st.rollup_noise(ids)
                assert view.rollup_device_counts(ids) == st.rollup_device_counts(ids)
                assert sum(view.rollup_sums(ids)).tolist() == np.sum(list(st.rollup_sums(ids)), axis=0).tolist()
    assert view.all_devices() == st.all_devices() and view.device_count() == st.device_count() == 5
    st.close()


# -- PostgreSQL: roll-up rows per writer shard, each device of a window counted on one of them ------------

from typing import Iterator  # noqa: E402

from pansketch.host_tools.store import pgserver  # noqa: E402
from pansketch.host_tools.store.pg import PgStore  # noqa: E402
from tests.support import pg as pgsupport  # noqa: E402

_PG_N = iter(range(10 ** 6))


@pytest.fixture(scope="module")
def pg() -> Iterator[pgserver.PgServer]:
    yield from pgsupport.server()


def _pg_fleet(dsn: str, devices: int, windows: int, skip: Optional[tuple[int, int]] = None, aggs: int = 2,
              threads: bool = False) -> None:
    """``devices`` keep-mode devices, two 30 min epochs per hourly window, epoch j of device i stored by
    aggregator (i + j) % ``aggs`` (each its own writer shard): every device of a window is in two shard
    rows of its roll-up. ``threads``: the aggregators store at once (the same devices and windows)."""
    import threading

    conf = hostconfig.from_dict({"fleet": {"salt": SALT}, "aggregator": {"db": dsn}})
    writers = [Aggregator(conf) for _ in range(aggs)]

    def raw(i: int, k: int, j: int) -> bytes:
        p = Params({"device": "dev%02d" % i, "salt": SALT, "kind": "cms", "d": 2, "w": 16, "mode": "keep",
                    "epoch_s": 1800, "window_s": 3600})
        ctr = array.array("i", [(i * 7 + k * 3 + j + c) % 11 - 2 for c in range(32)])
        e = T0 // 1800 + 2 * k + j
        return release.encode(p, 2 * k + j, e, e + 1, 0, ctr, 2 + (i % 2))

    def run(a: int) -> None:
        for k in range(windows):
            for i in range(devices):
                for j in range(2):
                    if (i, k) != skip and (i + j) % aggs == a:
                        assert writers[a].handle("pansketch/dev%02d/release" % i, raw(i, k, j)).stored

    if threads:
        ts = [threading.Thread(target=run, args=(a,)) for a in range(aggs)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    else:
        for a in range(aggs):
            run(a)
    for w in writers:
        w.close()


def _pg_counts_equal_rows(dsn: str, shards: int = 2) -> None:
    """Each roll-up's count rows sum to its distinct devices (over its writer shards' rows)."""
    st = PgStore(dsn, readonly=True)
    key = "r.win_s, r.win, r.kind, r.d, r.w, r.hv, r.salt"
    kept = dict(st._q("SELECT %s, sum(c.devices) FROM rollups r JOIN rollup_device_counts c ON c.rollup = r.id "
                      "GROUP BY %s HAVING sum(c.devices) > 0" % (key.replace(", ", " || ':' || "), key)))
    rows = dict(st._q("SELECT %s, count(DISTINCT x.device) FROM rollups r JOIN rollup_devices x ON x.rollup = r.id "
                      "GROUP BY %s" % (key.replace(", ", " || ':' || "), key)))
    held = st._q("SELECT count(DISTINCT shard) FROM rollups")[0][0]
    st.close()
    assert {k: int(v) for k, v in kept.items()} == rows and rows
    assert held == shards


def _pg_same_device_at_once(dsn: str) -> None:
    """One device added to two shard rows of one window by two open transactions, the second started
    before the first commits: counted once (the second waits for the first's advisory lock)."""
    import threading

    import psycopg

    a, b = psycopg.connect(dsn, autocommit=True), psycopg.connect(dsn, autocommit=True)
    ids = a.execute("SELECT r.id FROM rollups r WHERE r.win = %s ORDER BY r.shard", (T0 // 3600,)).fetchall()
    assert len(ids) == 2
    before = a.execute("SELECT sum(devices) FROM rollup_device_counts WHERE rollup = ANY(%s)",
                       ([i for (i,) in ids],)).fetchone()[0]
    a.execute("BEGIN")
    a.execute("INSERT INTO rollup_devices (rollup, device) VALUES (%s, 'devZZ')", ids[0])
    t = threading.Thread(target=lambda: b.execute("INSERT INTO rollup_devices (rollup, device) VALUES (%s, 'devZZ')",
                                                  ids[1]))
    t.start()
    t.join(0.5)  # b inserts its row, then its trigger waits for a's lock on (window, devZZ)
    a.execute("COMMIT")
    t.join()
    after = a.execute("SELECT sum(devices) FROM rollup_device_counts WHERE rollup = ANY(%s)",
                      ([i for (i,) in ids],)).fetchone()[0]
    assert after == before + 1
    a.execute("DELETE FROM rollup_devices WHERE device = 'devZZ'")
    assert a.execute("SELECT sum(devices) FROM rollup_device_counts WHERE rollup = ANY(%s)",
                     ([i for (i,) in ids],)).fetchone()[0] == before
    a.close()
    b.close()


def _pg_bulk_rows(dsn: str) -> None:
    """Statements past the per-row locks (1,100 devices: the count table's lock instead) and one putting
    the same devices into both shard rows of a window at once (those roll-ups recounted): counts still
    equal to the rows, and again once the rows are gone."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as c:
        ids = [i for (i,) in c.execute("SELECT id FROM rollups WHERE win = %s ORDER BY shard", (T0 // 3600 + 1,))]
        c.execute("INSERT INTO rollup_devices (rollup, device) SELECT %s, 'bulk' || g FROM generate_series(1, 1100) g",
                  (ids[0],))
        _pg_counts_equal_rows(dsn)
        c.execute("INSERT INTO rollup_devices (rollup, device) SELECT i, 'both' || g "
                  "FROM generate_series(1, 30) g, unnest(%s::bigint[]) i", (ids,))
        _pg_counts_equal_rows(dsn)
        c.execute("DELETE FROM rollup_devices WHERE device LIKE 'bulk%' OR device LIKE 'both%'")
    _pg_counts_equal_rows(dsn)


def _pg_raw(dsn: str) -> PgStore:
    st = PgStore(dsn, readonly=True)
    st.has_rollups = False
    return st


@pytest.fixture(scope="module")
def pg_full(pg: pgserver.PgServer) -> str:
    dsn = pg.create_database("fleetfull")
    _pg_fleet(dsn, 5, 4)
    return dsn


def test_pg_fleet_answers_read_no_device_rows(pg_full: str, monkeypatch: Any) -> None:
    _pg_counts_equal_rows(pg_full)
    fast, raw = PgStore(pg_full, readonly=True), _pg_raw(pg_full)
    _no_row_scans(fast, monkeypatch)  # type: ignore[arg-type]
    for sel in ({}, {"since": T0 + 3600}, {"window": T0 // 3600 + 2}):
        got = [a.to_dict() for a in query.freq(fast, ITEMS, salt=SALT, **sel)]  # type: ignore[arg-type]
        assert got == [a.to_dict() for a in query.freq(raw, ITEMS, salt=SALT, **sel)]  # type: ignore[arg-type]
        assert got[0]["devices"] == ["dev%02d" % i for i in range(5)]
    for running in (True, False):
        s = series_mod.series(fast, ITEMS, salt=SALT, step=3600, running=running)
        assert s.to_dict() == series_mod.series(raw, ITEMS, salt=SALT, step=3600, running=running).to_dict()
        assert len(s.lines[0].points) == 4 and all(p.missing_devices == [] for p in s.lines[0].points)
    fast.close()
    raw.close()


def test_pg_series_with_a_missing_device_lists_it(pg: pgserver.PgServer) -> None:
    dsn = pg.create_database("fleetgap%d" % next(_PG_N))
    _pg_fleet(dsn, 4, 4, skip=(2, 1))
    _pg_counts_equal_rows(dsn)
    fast, raw = PgStore(dsn, readonly=True), _pg_raw(dsn)
    got = series_mod.series(fast, ITEMS, salt=SALT, step=3600, running=False)
    assert got.to_dict() == series_mod.series(raw, ITEMS, salt=SALT, step=3600, running=False).to_dict()
    assert [p.missing_devices for p in got.lines[0].points] == [[], ["dev02"], [], []]
    fast.close()
    raw.close()


def test_pg_device_counts_follow_concurrent_writers_purge_and_upgrade(pg: pgserver.PgServer) -> None:
    """Two aggregators storing the same devices' windows at once count each device once; a purge and
    the first open of a database from before the counts leave them equal to the rows."""
    dsn = pg.create_database("fleetcnt%d" % next(_PG_N))
    _pg_fleet(dsn, 6, 3, threads=True)
    _pg_counts_equal_rows(dsn)
    _pg_same_device_at_once(dsn)
    _pg_counts_equal_rows(dsn)
    _pg_bulk_rows(dsn)
    st = PgStore(dsn)
    exclusions.purge(st, "dev03", since=T0 + 3600)  # its windows 1 and 2 taken out of both shards' rows
    st.close()
    _pg_counts_equal_rows(dsn)
    fast, raw = PgStore(dsn, readonly=True), _pg_raw(dsn)
    want = [a.to_dict() for a in query.freq(raw, ITEMS, salt=SALT, since=T0 + 3600)]
    assert [a.to_dict() for a in query.freq(fast, ITEMS, salt=SALT, since=T0 + 3600)] == want
    assert "dev03" not in want[0]["devices"] and len(want[0]["devices"]) == 5
    fast.close()
    raw.close()
    st = PgStore(dsn)
    with st.conn.transaction():
        st.conn.execute("DROP TABLE rollup_device_counts")
        st.conn.execute("DROP TRIGGER rollup_devices_counted ON rollup_devices")
        st.conn.execute("DROP TRIGGER rollup_devices_uncounted ON rollup_devices")
        st.conn.execute("DELETE FROM meta WHERE key = 'pg_setup'")
    st.close()
    ro = PgStore(dsn, readonly=True)
    assert ro.rollup_device_counts([1]) is None
    ro.close()
    PgStore(dsn).close()  # a writer's open counts them
    _pg_counts_equal_rows(dsn)
    st = PgStore(dsn)
    st.conn.execute("DELETE FROM meta WHERE key IN ('rollups', 'pg_setup')")  # OPERATIONS.md's roll-up rebuild
    st.close()
    PgStore(dsn).close()
    _pg_counts_equal_rows(dsn, shards=1)  # (rebuilt by one writer: its shard)


def test_pg_purge_waits_for_a_group_without_a_deadlock(pg: pgserver.PgServer) -> None:
    """A purge takes the device counts' lock before any roll-up row, as a writer's group does before its
    rows (PgStore._lock_counts): a group holding a window's roll-up row while a purge of that window
    starts finishes first, then the purge, no transaction aborted. (Taken at the purge's first deletion,
    the lock made the purge wait for the group's row while the group's device row waited for the lock.)"""
    import threading

    dsn = pg.create_database("fleetlock%d" % next(_PG_N))
    _pg_fleet(dsn, 6, 3)
    w = PgStore(dsn)
    cur = w.conn.cursor()
    w._begin(cur)
    w._lock_counts(cur, exclusive=False)  # what a group does first (PgStore._apply_rollups)
    p = PgStore(dsn)
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(exclusions.purge(p, "dev03", since=T0 + 3600)))  # windows 1, 2
    t.start()
    t.join(1.0)
    assert t.is_alive()  # waiting for the group
    for k in (1, 2):  # then the group's rows of the purged windows, in key order, and a device row
        cur.execute("SELECT id FROM rollups WHERE win = %s AND shard = %s FOR UPDATE", (T0 // 3600 + k, w._rollup_shard))
        rid = cur.fetchone()[0]
    cur.execute("INSERT INTO rollup_devices (rollup, device) VALUES (%s, 'devZZ')", (rid,))
    cur.execute("COMMIT")
    t.join(30)
    assert out and out[0].releases == 4 and not p.__dict__.get("_tx_retries")  # no deadlock, nothing retried
    p.close()
    w.close()
    _pg_counts_equal_rows(dsn)
