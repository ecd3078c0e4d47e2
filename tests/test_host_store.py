"""The SQLite store: WAL, idempotent under concurrent writers, reopenable, read-only readers."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3
import traceback
from typing import Any

import pytest

from pansketch.agent.params import Params
from pansketch.host_tools.ingest.aggregator import Aggregator
from pansketch.host_tools.store.sqlite import PAGE_SIZE, Store
from tests.support.host import T0, encoded, host_cfg, params, topic


def _writer(db: str, payloads: list[tuple[str, bytes]], out: "mp.Queue[tuple[str, Any]]") -> None:
    """Store ``payloads``; report ("ok", statuses) or ("error", traceback): a dying writer says why."""
    try:
        from pansketch.host_tools import hostconfig

        cfg = hostconfig.from_dict({"fleet": {"salt": "host-tests-fleet-salt"}, "aggregator": {"db": db}})
        a = Aggregator(cfg)
        res = [a.handle(t, p).status for t, p in payloads]
        a.close()
        out.put(("ok", res))
    except BaseException:
        out.put(("error", traceback.format_exc()))
        raise


def _payloads(n_dev: int, n_win: int) -> list[tuple[str, bytes]]:
    out = []
    for dv in range(n_dev):
        p = params("d%02d" % dv, w=32)
        for k in range(n_win):
            out.append((topic(p.device), encoded(p, seq=k, elo=T0 // 3600 + k, fill=dv * 100 + k)))
    return out


def _concurrent_writers(tmp_path: Any, writers: int) -> None:
    db = str(tmp_path / "shared.db")
    pl = _payloads(6, 10)
    ctx = mp.get_context("fork")
    q: "mp.Queue[tuple[str, Any]]" = ctx.Queue()
    # the processes deliver the same 60 releases (as after redelivery to several subscribers), all
    # opening the fresh file at once (schema creation and the switch to WAL race too)
    procs = [ctx.Process(target=_writer, args=(db, pl if i % 2 == 0 else list(reversed(pl)), q))
             for i in range(writers)]
    for p in procs:
        p.start()
    results = []
    for _ in procs:
        kind, res = q.get(timeout=120)
        assert kind == "ok", "a writer process failed:\n" + res
        results.append(res)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    statuses = [s for r in results for s in r]
    assert statuses.count("stored") == len(pl)
    assert statuses.count("duplicate") == (writers - 1) * len(pl)
    st = Store(db, readonly=True)
    assert st.release_count() == len(pl)
    assert st.duplicate_count() == (writers - 1) * len(pl)
    assert st.rejection_count() == 0
    assert len(st.devices()) == 6
    st.close()


def test_concurrent_aggregators_store_each_release_once(tmp_path):
    _concurrent_writers(tmp_path, 3)


@pytest.mark.slow
def test_many_concurrent_aggregators_store_each_release_once(tmp_path):
    _concurrent_writers(tmp_path, 8)


def test_wal_and_reopen(tmp_path):
    db = str(tmp_path / "x.db")
    a = Aggregator(host_cfg(tmp_path, aggregator={"db": db}))
    for t, p in _payloads(2, 3):
        assert a.handle(t, p).stored
    a.close()
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    con.close()
    st = Store(db)
    assert st.release_count() == 6
    rels = st.releases(devices=["d01"], with_payload=True)
    assert [r.seq for r in rels] == [0, 1, 2]
    assert int(rels[2].counters()[0, 0]) == 102
    st.close()


def test_new_files_get_16k_pages_and_a_4k_file_keeps_its_own(tmp_path):
    """A new store is created with PAGE_SIZE pages (a 16.6 KB release: one overflow page, not five); a file
    made with SQLite's default 4 KiB pages (every store before) keeps them, and takes and returns releases."""
    new = str(tmp_path / "new.db")
    st = Store(new)
    st.close()
    old = str(tmp_path / "old4k.db")
    con = sqlite3.connect(old)
    con.execute("PRAGMA page_size = 4096")
    con.execute("PRAGMA journal_mode = WAL")
    con.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")  # the file exists, 4 KiB pages
    con.close()
    rollback = str(tmp_path / "rollback4k.db")  # not in WAL mode yet (another tool made it): switched, same pages
    con = sqlite3.connect(rollback)
    con.execute("PRAGMA page_size = 4096")
    con.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    con.commit()
    con.close()
    Store(rollback).close()
    a = Aggregator(host_cfg(tmp_path, aggregator={"db": old}))
    for t, p in _payloads(2, 3):
        assert a.handle(t, p).stored
    a.close()
    sizes = {}
    for db in (new, old, rollback):
        con = sqlite3.connect(db)
        sizes[db] = (con.execute("PRAGMA page_size").fetchone()[0], con.execute("PRAGMA journal_mode").fetchone()[0])
        con.close()
    assert sizes == {new: (PAGE_SIZE, "wal"), old: (4096, "wal"), rollback: (4096, "wal")}
    assert PAGE_SIZE == 16384
    st = Store(old)
    assert st.release_count() == 6
    assert int(st.releases(devices=["d01"], with_payload=True)[2].counters()[0, 0]) == 102
    st.close()


def test_readonly_store_refuses_writes_and_missing_db(tmp_path):
    with pytest.raises(FileNotFoundError):
        Store(str(tmp_path / "nope.db"), readonly=True)
    db = str(tmp_path / "y.db")
    Store(db).close()
    st = Store(db, readonly=True)
    from pansketch.host_tools.ingest.decode import decode

    with pytest.raises(PermissionError):
        st.insert(decode(encoded(params())))
    st.close()


def test_time_and_window_selection(tmp_path):
    a = Aggregator(host_cfg(tmp_path))
    pk = params("k", mode="keep", window_s=3600, epoch_s=600, w=16)
    e0 = T0 // 600
    for k in range(12):  # two windows of 6 epochs
        assert a.handle(topic("k"), encoded(pk, seq=k, elo=e0 + k)).stored
    st = a.store
    assert len(st.releases(window=T0 // 3600)) == 6
    assert len(st.releases(since=T0 + 600, until=T0 + 3600)) == 5
    assert st.count_partial(T0 + 300, T0 + 3600) == 1  # epoch [T0, T0+600) straddles since
    a.close()


def test_nz_is_stored_and_read_back(tmp_path):
    a = Aggregator(host_cfg(tmp_path))
    p = params(w=16)
    for k, nz in enumerate((2, 7, 1000)):
        assert a.handle(topic(p.device), encoded(p, seq=k, elo=T0 // 3600 + k, nz=nz)).stored
    assert [r.nz for r in a.store.releases()] == [2, 7, 1000]
    assert [r.nz for r in a.store.releases(with_payload=True)] == [2, 7, 1000]
    a.close()


def _old_db(tmp_path) -> str:
    """A database as written before releases carried nz (no releases.nz column), with one release."""
    db = str(tmp_path / "old.db")
    a = Aggregator(host_cfg(tmp_path, aggregator={"db": db}))
    assert a.handle(topic("dev-a"), encoded(params(w=16), fill=5)).stored
    a.close()
    con = sqlite3.connect(db)
    con.execute("ALTER TABLE releases DROP COLUMN nz")
    con.commit()
    assert "nz" not in {r[1] for r in con.execute("PRAGMA table_info(releases)")}
    con.close()
    return db


def test_old_database_readonly_reads_nz_2_without_changing_it(tmp_path):
    db = _old_db(tmp_path)
    st = Store(db, readonly=True)
    rels = st.releases(with_payload=True)
    assert [r.nz for r in rels] == [2] and int(rels[0].counters()[0, 0]) == 5
    st.close()
    con = sqlite3.connect(db)
    assert "nz" not in {r[1] for r in con.execute("PRAGMA table_info(releases)")}
    con.close()


def test_old_database_is_migrated_on_write_open(tmp_path):
    db = _old_db(tmp_path)
    a = Aggregator(host_cfg(tmp_path, aggregator={"db": db}))
    assert a.handle(topic("dev-a"), encoded(params(w=16), seq=1, elo=T0 // 3600 + 1, nz=4)).stored
    assert [r.nz for r in a.store.releases()] == [2, 4]
    a.close()
    con = sqlite3.connect(db)
    assert "nz" in {r[1] for r in con.execute("PRAGMA table_info(releases)")}
    con.close()
    st = Store(db)  # reopening a migrated db is a no-op
    assert [r.nz for r in st.releases()] == [2, 4]
    st.close()


def _opener(db: str, barrier: Any, out: "mp.Queue[str]") -> None:
    try:
        barrier.wait(30)
        Store(db).close()
        out.put("ok")
    except BaseException:
        out.put(traceback.format_exc())


@pytest.mark.slow
def test_simultaneous_first_opens_of_a_fresh_file_all_succeed(tmp_path):
    """The cause of the old flake: processes opening a new file at the same instant race to switch it to
    WAL, and SQLite refused the loser at once ("database is locked", no busy wait for a lock upgrade).
    Before the fix about 1 in 20 rounds of 3 openers failed; the store now retries."""
    ctx = mp.get_context("fork")
    for k in range(25):
        db = str(tmp_path / ("fresh-%d.db" % k))
        barrier, q = ctx.Barrier(3), ctx.Queue()
        procs = [ctx.Process(target=_opener, args=(db, barrier, q)) for _ in range(3)]
        for p in procs:
            p.start()
        outs = [q.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
        assert all(o == "ok" for o in outs), [o for o in outs if o != "ok"][0]


def test_group_without_savepoints_unless_one_message_needs_its_own_rollback(tmp_path):
    """A group is put without a savepoint per message; only when one message hits a database error of its
    own is the group rolled back and put again with savepoints, with the same outcome as always."""
    a = Aggregator(host_cfg(tmp_path, aggregator={"db": str(tmp_path / "sp.db")}))
    seen: list[str] = []
    a.store.db.set_trace_callback(seen.append)
    p = params("sp", w=16)
    e = T0 // 3600
    items = [a.validate(topic("sp"), encoded(p, seq=k, elo=e + k, fill=k + 1)) for k in range(3)]
    a.store.commit_group(items)
    assert [x.status for x in items] == ["stored"] * 3
    assert not [s for s in seen if "SAVEPOINT" in s]  # the plain path: no savepoint statements
    a.store.db.execute("CREATE TRIGGER boom BEFORE INSERT ON releases WHEN NEW.device = 'boom' "
                       "BEGIN SELECT RAISE(ABORT, 'boom refused'); END")
    seen.clear()
    items = [a.validate(topic("sp"), encoded(p, seq=3, elo=e + 3, fill=4)),
             a.validate(topic("boom"), encoded(params("boom", w=16), seq=0, elo=e, fill=3)),
             a.validate(topic("sp"), encoded(p, seq=4, elo=e + 4, fill=5))]
    a.store.commit_group(items)
    assert [x.status for x in items] == ["stored", "error", "stored"]
    assert "boom refused" in str(items[1].error)
    assert [s for s in seen if s.startswith("SAVEPOINT")]  # put again, a savepoint per message
    st = Store(str(tmp_path / "sp.db"), readonly=True)
    assert st.release_count() == 5 and [d[0] for d in st.devices()] == ["sp"]  # boom's device row rolled back
    st.close()
    a.close()


def test_a_device_row_rolled_back_with_its_message_is_not_cached_as_stored(tmp_path):
    """A new device's first release hits a database error of its own after its device row was written: the
    savepoint rolls the row back, so the device must not be remembered as known (its next release would be
    stored without a device row: no parameters to check the ones after it against)."""
    a = Aggregator(host_cfg(tmp_path, aggregator={"db": str(tmp_path / "dc.db")}))
    e = T0 // 3600
    a.store.db.execute("CREATE TRIGGER boom BEFORE INSERT ON releases WHEN NEW.device = 'boom' "
                       "BEGIN SELECT RAISE(ABORT, 'boom refused'); END")
    p = params("boom", w=16)
    items = [a.validate(topic("boom"), encoded(p, seq=0, elo=e, fill=3))]
    a.store.commit_group(items)
    assert [x.status for x in items] == ["error"]
    a.store.db.execute("DROP TRIGGER boom")
    items = [a.validate(topic("boom"), encoded(p, seq=1, elo=e + 1, fill=3))]
    a.store.commit_group(items)
    assert [x.status for x in items] == ["stored"]
    st = Store(str(tmp_path / "dc.db"), readonly=True)
    assert st.release_count() == 1 and [d[0] for d in st.devices()] == ["boom"]
    st.close()
    a.close()


# -- the release key's order and the per-device figures (docs/PERFORMANCE-HISTORY.md) ------------------
def _key_columns(db: str) -> list[str]:
    con = sqlite3.connect(db)
    try:
        return [r[0] for r in con.execute("SELECT name FROM pragma_index_info('sqlite_autoindex_releases_1') "
                                          "ORDER BY seqno")]
    finally:
        con.close()


def _device_rows(db: str) -> dict[str, tuple[Any, ...]]:
    con = sqlite3.connect(db)
    try:
        return {r[0]: r[1:] for r in con.execute("SELECT device, max_seq, shape FROM devices")}
    finally:
        con.close()


def test_a_new_file_keys_releases_epoch_first_and_keeps_each_device_s_highest_seq(tmp_path):
    db = str(tmp_path / "tm.db")
    a = Aggregator(host_cfg(tmp_path, aggregator={"db": db}))
    assert a.store.time_major
    e = T0 // 3600
    out = [a.handle(topic(dv), encoded(params(dv, w=16), seq=s, elo=e + s, fill=s + 1))
           for s in (0, 2, 1) for dv in ("tm-b", "tm-a")]  # seq 1 after seq 2: the highest stays 2
    assert all(o.stored for o in out)
    # one group with two releases of one device: the row gets the higher seq
    items = [a.validate(topic("tm-a"), encoded(params("tm-a", w=16), seq=s, elo=e + s)) for s in (4, 3)]
    a.store.commit_group(items)
    assert [p.status for p in items] == ["stored", "stored"]
    a.close()
    assert _key_columns(db) == ["elo", "device", "ehi", "part"]
    assert _device_rows(db) == {"tm-a": (4, "window 1 3600"), "tm-b": (2, "window 1 3600")}


def test_a_reopened_store_checks_seq_jumps_and_shapes_from_the_device_rows(tmp_path):
    """After a restart (empty caches) the first release of each device is checked against its ``devices``
    row: no statement reads the device's releases (with an epoch-first key that is a scan of the whole
    index), and the figures are the stored ones (a highest seq of -1 would quarantine seq 25)."""
    db = str(tmp_path / "re.db")
    cfg = host_cfg(tmp_path, aggregator={"db": db, "max_seq_jump": 10})
    a = Aggregator(cfg)
    e = T0 // 3600
    assert a.handle(topic("re"), encoded(params("re", w=16), seq=20, elo=e)).status == "quarantined"  # 20 > -1 + 10
    for s in range(0, 21, 5):
        assert a.handle(topic("re"), encoded(params("re", w=16), seq=s, elo=e + s)).stored
    a.close()
    b = Aggregator(cfg)
    seen: list[str] = []
    b.store.db.set_trace_callback(seen.append)
    assert b.handle(topic("re"), encoded(params("re", w=16), seq=31, elo=e + 31)).status == "quarantined"
    assert b.handle(topic("re"), encoded(params("re", w=16), seq=25, elo=e + 25)).stored
    # the same device as a tree now: refused by the shape kept in its row
    tp = params("re", w=16)
    tp = Params({"device": "re", "salt": tp.salt, "kind": "cs", "d": 4, "w": 16, "mode": "tree", "levels": 4,
                 "epoch_s": 3600})
    tree = encoded(tp, seq=26, elo=e + 26)
    out = b.handle(topic("re"), tree)
    assert out.status == "rejected" and out.code == "device" and "tree shape" in (out.reason or ""), out
    # (a lookup of one whole key, as for a duplicate, is an index probe in either key order)
    assert not [s for s in seen if "FROM releases WHERE device" in s and "AND elo =" not in s], seen
    b.close()


def test_a_group_that_is_not_stored_leaves_no_highest_seq_behind(tmp_path, monkeypatch):
    """A group whose transaction fails after ``max_seq`` was raised (here: in the bounding of the logs,
    the last step before COMMIT), and a release refused after it passed the seq check, leave the device's
    highest seq where the stored releases put it: in the file, and in the store's cache (a cached seq
    that was never stored would let the next check start from it)."""
    db = str(tmp_path / "ns.db")
    a = Aggregator(host_cfg(tmp_path, aggregator={"db": db, "max_seq_jump": 10}))
    e = T0 // 3600
    for s in range(3):
        assert a.handle(topic("ns"), encoded(params("ns", w=16), seq=s, elo=e + s)).stored

    def broken(*_a: Any) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(a.store, "_bound", broken)
    items = [a.validate(topic("ns"), encoded(params("ns", w=16), seq=9, elo=e + 9))]
    with pytest.raises(sqlite3.OperationalError, match="disk I/O"):
        a.store.commit_group(items)
    monkeypatch.undo()
    assert _device_rows(db)["ns"][0] == 2
    # from 9 (not stored), 14 would be within the jump; from 2 (stored) it is not
    assert a.handle(topic("ns"), encoded(params("ns", w=16), seq=14, elo=e + 14)).status == "quarantined"
    assert a.handle(topic("ns"), encoded(params("ns", w=16), seq=12, elo=e + 12)).stored
    # seq 20 passes the check (20 <= 12 + 10), then is refused: its key is seq 12's, with other counters
    out = a.handle(topic("ns"), encoded(params("ns", w=16), seq=20, elo=e + 12, fill=7))
    assert out.status == "rejected" and out.code == "conflict", out
    assert a.handle(topic("ns"), encoded(params("ns", w=16), seq=23, elo=e + 23)).status == "quarantined"
    a.close()
    assert _device_rows(db)["ns"][0] == 12


def _device_first_db(tmp_path: Any) -> str:
    """A file as written before the key led with the epoch: device-first key, no per-device figures."""
    from pansketch.host_tools.store.schema import DEVICE_KEY, schema

    db = str(tmp_path / "df.db")
    con = sqlite3.connect(db)
    con.execute("PRAGMA page_size = %d" % PAGE_SIZE)
    con.executescript(schema(DEVICE_KEY))
    con.close()
    return db


def test_a_device_first_file_keeps_its_key_and_reads_old_device_rows_from_their_releases(tmp_path):
    db = _device_first_db(tmp_path)
    cfg = host_cfg(tmp_path, aggregator={"db": db, "max_seq_jump": 10})
    a = Aggregator(cfg)
    assert not a.store.time_major
    e = T0 // 3600
    for s in range(0, 21, 5):
        assert a.handle(topic("old"), encoded(params("old", w=16), seq=s, elo=e + s)).stored
    a.close()
    con = sqlite3.connect(db)  # the row as an older pansketch wrote it: the columns added, left NULL
    con.execute("UPDATE devices SET max_seq = NULL, shape = NULL")
    con.commit()
    con.close()
    b = Aggregator(cfg)
    assert b.handle(topic("old"), encoded(params("old", w=16), seq=31, elo=e + 31)).status == "quarantined"
    assert b.handle(topic("old"), encoded(params("old", w=16), seq=25, elo=e + 25)).stored
    b.close()
    assert _key_columns(db) == ["device", "elo", "ehi", "part"]
    assert _device_rows(db) == {"old": (None, None)}  # a NULL figure is never raised from a part of the history


def test_counters_follow_the_release_order_with_an_epoch_first_key(tmp_path):
    """iter_counters reads payloads by row id after sorting the keys: the same order as releases()."""
    a = Aggregator(host_cfg(tmp_path))
    e = T0 // 3600
    for s in range(3):
        for dv in ("o-c", "o-a", "o-b"):
            assert a.handle(topic(dv), encoded(params(dv, w=16), seq=s, elo=e + s, fill=ord(dv[-1]) * 10 + s)).stored
    assert a.store.time_major
    rels = a.store.releases(with_payload=True)
    assert [(r.device, r.elo) for r in rels] == [(dv, e + s) for dv in ("o-a", "o-b", "o-c") for s in range(3)]
    got = [int(c[0, 0]) for c in a.store.iter_counters()]
    assert got == [int(r.counters()[0, 0]) for r in rels] == [ord(r.device[-1]) * 10 + r.elo - e for r in rels]
    got = [int(c[0, 0]) for c in a.store.iter_counters(devices=["o-b"], since=(e + 1) * 3600)]
    assert got == [ord("b") * 10 + 1, ord("b") * 10 + 2]
    a.close()


def _device_query_plan(db: str) -> str:
    con = sqlite3.connect(db)
    try:
        return " ".join(str(r[3]) for r in con.execute(
            "EXPLAIN QUERY PLAN SELECT device, seq FROM releases WHERE device IN (?) ORDER BY device, elo", ("x",)))
    finally:
        con.close()


def test_a_device_s_releases_are_one_index_range_with_either_key(tmp_path):
    """An epoch-first file gains releases_device (also in place, when an aggregator opens a file made
    without it); a device-first file reads a device's releases through its key and gets no second index."""
    db = str(tmp_path / "tm.db")
    a = Aggregator(host_cfg(tmp_path, aggregator={"db": db}))
    assert a.handle(topic("d1"), encoded(params("d1", w=16))).stored
    a.close()
    assert "USING INDEX releases_device" in _device_query_plan(db)
    con = sqlite3.connect(db)
    con.execute("DROP INDEX releases_device")
    con.commit()
    con.close()
    assert "SCAN releases" in _device_query_plan(db)  # the whole key, as before the index
    Aggregator(host_cfg(tmp_path, aggregator={"db": db})).close()  # the in-place upgrade
    assert "USING INDEX releases_device" in _device_query_plan(db)
    old = _device_first_db(tmp_path)
    b = Aggregator(host_cfg(tmp_path, aggregator={"db": old}))
    assert b.handle(topic("d1"), encoded(params("d1", w=16))).stored
    b.close()
    plan = _device_query_plan(old)
    assert "releases_device" not in plan and "USING INDEX sqlite_autoindex_releases_1 (device=?)" in plan
