"""The PostgreSQL store against a real server (initdb + pg_ctl into a temp dir).

Checks: idempotency, conflicts and device parameters enforced by the
database (also across concurrent aggregator processes delivering the same
releases); roll-up answers equal raw answers; read-only readers; several
aggregators sharing an MQTT v5 subscription and one database through a
real mosquitto; clear errors for a bad DSN and a server that goes away,
with everything committed kept. Skipped with the reason when PostgreSQL's
server binaries are not installed (``.ci/run`` installs Debian's
``postgresql``); under CI a missing server is a failure.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any, Iterator

import numpy as np
import pytest

from pansketch.host_tools import hostconfig
from pansketch.host_tools.store import pgserver
from pansketch.host_tools.query import core as query
from pansketch.host_tools.ingest.aggregator import Aggregator
from pansketch.host_tools.ingest.decode import Rejected, decode
from pansketch.host_tools.store.errors import StoreError
from pansketch.host_tools.store.rows import Pending
from pansketch.host_tools.store.backend import open_store
from tests.support.host import SALT, T0, encoded, fleet_releases, params, record, topic, zipf_stream
from tests.support import pg as pgsupport

pytestmark = pgsupport.marks()

_N = iter(range(10**6))


@pytest.fixture(scope="module")
def server() -> Iterator[pgserver.PgServer]:
    srv = pgserver.PgServer.start()
    yield srv
    srv.stop()


@pytest.fixture
def dsn(server: pgserver.PgServer) -> str:
    return server.create_database("t%d" % next(_N))


def _cfg(dsn: str, **extra: Any) -> hostconfig.HostConfig:
    raw: dict[str, Any] = {"fleet": {"salt": SALT}, "aggregator": {"db": dsn}}
    for k, v in extra.items():
        raw.setdefault(k, {}).update(v)
    return hostconfig.from_dict(raw)


def test_config_keeps_the_url_and_refuses_other_schemes(tmp_path):
    p = tmp_path / "h.toml"
    p.write_text('[aggregator]\ndb = "postgresql://agg@db.example:5432/pansketch"\n[fleet]\nsalt = "fleet-salt-1"\n')
    assert hostconfig.load(str(p)).aggregator.db == "postgresql://agg@db.example:5432/pansketch"
    p.write_text('[aggregator]\ndb = "mysql://agg@db/x"\n[fleet]\nsalt = "fleet-salt-1"\n')
    with pytest.raises(hostconfig.ConfigError, match="unsupported database URL scheme 'mysql'"):
        hostconfig.load(str(p))


def test_idempotency_conflicts_and_devices_enforced_by_the_database(dsn):
    st = open_store(dsn)
    p = params("pg-a", w=16)
    e = T0 // 3600
    assert st.insert(decode(encoded(p, fill=1))) == "stored"
    assert st.insert(decode(encoded(p, fill=1))) == "duplicate"
    with pytest.raises(Rejected, match="conflict"):
        st.insert(decode(encoded(p, fill=2)))
    with pytest.raises(Rejected, match="changed parameters"):
        st.insert(decode(encoded(params("pg-a", w=32), seq=1, elo=e + 1)))
    st.reject("cbor", "broken", b"\x00\x01", topic="pansketch/pg-a/release", device="pg-a")
    assert st.snapshot()[:3] == (1, 1, 1)
    assert [r[0] for r in st.devices()] == ["pg-a"]
    st.close()
    # the database refuses a second row with the key, whoever writes it
    import psycopg

    with psycopg.connect(dsn) as c:
        with pytest.raises(psycopg.errors.UniqueViolation):
            c.execute("INSERT INTO releases SELECT * FROM releases")


def test_group_commit_savepoints(dsn):
    agg = Aggregator(_cfg(dsn))
    p = params("pg-g", w=16)
    e = T0 // 3600
    assert agg.handle(topic("pg-g"), encoded(p, seq=0, elo=e, fill=1)).stored
    msgs = [(topic("pg-g"), encoded(p, seq=1, elo=e + 1, fill=2)),
            (topic("pg-g"), encoded(p, seq=9, elo=e, fill=5)),  # conflict
            (topic("pg-g"), b"\xa1\x61v\x02"),  # invalid
            (topic("pg-g"), encoded(p, seq=2, elo=e + 2, fill=4))]
    outs = agg.handle_many(msgs)
    assert [o.status for o in outs] == ["stored", "rejected", "rejected", "stored"]
    assert outs[1].code == "conflict" and "stored seq 0, this seq 9" in (outs[1].reason or "")
    m, _ = query.select_merged(agg.store, salt=SALT)
    assert m.releases == 3 and int(m.counters[0, 0]) == 7
    # a database error on one release rolls back that release alone (its subtransaction)
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE FUNCTION boom() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                  "IF NEW.device = 'boom' THEN RAISE EXCEPTION 'boom refused'; END IF; RETURN NEW; END $$")
        c.execute("CREATE TRIGGER boom BEFORE INSERT ON releases FOR EACH ROW EXECUTE FUNCTION boom()")
    items = [agg.validate(topic("pg-g"), encoded(p, seq=3, elo=e + 3, fill=8)),
             agg.validate(topic("boom"), encoded(params("boom", w=16), seq=0, elo=e, fill=3)),
             agg.validate(topic("pg-g"), encoded(params("pg-g", w=32), seq=4, elo=e + 4)),  # device parameters
             agg.validate(topic("pg-g"), encoded(p, seq=0, elo=e, fill=1))]  # duplicate
    agg.store.commit_group(items)
    assert [x.status for x in items] == ["stored", "error", "rejected", "duplicate"]
    assert "boom refused" in str(items[1].error)
    assert items[2].rej is not None and "w 16 -> 32" in items[2].rej.reason
    st = open_store(dsn, readonly=True)
    assert [d[0] for d in st.devices()] == ["pg-g"]  # boom's device row was rolled back with it
    m, _ = query.select_merged(st, salt=SALT)
    assert m.releases == 4 and int(m.counters[0, 0]) == 15
    st.close()
    agg.close()


def test_rollup_answers_equal_raw_answers(dsn, tmp_path):
    agg = Aggregator(_cfg(dsn))
    for dv in range(3):
        p = params("pg-r%d" % dv, d=5, w=64)
        wins = [zipf_stream(300, 200, 1.2, 10 * dv + k) for k in range(3)]
        for raw in record(p, str(tmp_path / p.device), wins, persists=dv % 2):
            assert agg.handle(topic(p.device), raw).stored
    pk = params("pg-k", d=5, w=64, mode="keep", window_s=3600, epoch_s=600)
    for k in range(14):
        assert agg.handle(topic("pg-k"), encoded(pk, seq=k, elo=T0 // 600 + k, fill=k, nz=2 + k % 2)).stored
    agg.close()
    st = open_store(dsn, readonly=True)
    assert st.has_rollups
    items = ["item-%d" % i for i in range(30)]
    for sel in ({}, {"window": T0 // 3600 + 1}, {"since": T0 + 1200, "until": T0 + 2 * 3600 + 600},
                {"device": "pg-r1"}):
        a, sa = query.select_merged(st, salt=SALT, use_rollups=True, **sel)
        b, sb = query.select_merged(st, salt=SALT, use_rollups=False, **sel)
        assert np.array_equal(a.counters, b.counters) and a.noise == b.noise and sa.partial == sb.partial
        assert (a.releases, a.devices, a.t0, a.t1, a.windows) == (b.releases, b.devices, b.t0, b.t1, b.windows)
        fa = [x.to_dict() for x in query.freq(st, items, salt=SALT, use_rollups=True, **sel)]
        fb = [x.to_dict() for x in query.freq(st, items, salt=SALT, use_rollups=False, **sel)]
        assert fa == fb
    with pytest.raises(Exception, match="read-only"):
        st.commit_group([Pending(b"", None, 0.0, rel=decode(encoded(params("pg-x", w=16))))])
    st.close()


def _writer(dsn: str, payloads: list[tuple[str, bytes]], out: "mp.Queue[list[str]]") -> None:
    a = Aggregator(_cfg(dsn))
    res = []
    for i in range(0, len(payloads), 7):  # groups of 7, like the writer thread
        res += [o.status for o in a.handle_many(payloads[i:i + 7])]
    a.close()
    out.put(res)


def test_concurrent_aggregator_processes_store_each_release_once(dsn):
    pl = fleet_releases("pc0", 6, 10, w=32, fill=lambda dv, k: dv * 100 + k)
    ctx = mp.get_context("fork")
    q: "mp.Queue[list[str]]" = ctx.Queue()
    orders = [pl, list(reversed(pl)), pl[30:] + pl[:30], pl[::2] + pl[1::2]]
    procs = [ctx.Process(target=_writer, args=(dsn, o, q)) for o in orders]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    statuses = [s for r in results for s in r]
    assert statuses.count("stored") == len(pl)
    assert statuses.count("duplicate") == 3 * len(pl)
    st = open_store(dsn, readonly=True)
    assert st.snapshot()[:3] == (len(pl), 0, 3 * len(pl))
    m, _ = query.select_merged(st, salt=SALT)
    raw, _ = query.select_merged(st, salt=SALT, use_rollups=False)
    assert m.releases == len(pl) and np.array_equal(m.counters, raw.counters)  # roll-ups summed each once
    st.close()


def _group_writer(dsn: str, payloads: list[tuple[str, bytes]], start: Any, out: "mp.Queue[list[str]]") -> None:
    agg = Aggregator(_cfg(dsn))
    start.wait()
    out.put([o.status for o in agg.handle_many(payloads)])
    agg.close()


def test_concurrent_groups_with_the_same_new_devices_do_not_deadlock(dsn):
    """Two aggregators whose groups hold the same new devices in opposite orders: each group's releases
    go to the database in key order, so one waits for the other instead of deadlocking (a deadlock
    cost both deadlock_timeout, 1 s, and a retry of the group; pg_stat_database counts them).

    Made deterministic with a third session that holds the row of the middle device until both groups
    wait for it: in arrival order each group would then hold one half and wait for the other's."""
    import psycopg

    n = 40
    pl = [(topic("dl%03d" % dv), encoded(params("dl%03d" % dv, w=16), seq=0, fill=dv)) for dv in range(n)]
    pl2 = [(topic("dl%03d" % dv), encoded(params("dl%03d" % dv, w=16), seq=1, elo=T0 // 3600 + 1, fill=dv))
           for dv in range(n)]
    open_store(dsn).close()
    blocker = psycopg.connect(dsn)
    blocker.execute("INSERT INTO devices (device, salt, hv, kind, d, w, ep_s, first_received) "
                    "VALUES ('dl%03d', 'x', 1, 'cs', 4, 16, 3600, 0)" % (n // 2))
    ctx = mp.get_context("fork")
    q: "mp.Queue[list[str]]" = ctx.Queue()
    start = ctx.Event()
    procs = [ctx.Process(target=_group_writer, args=(dsn, o, start, q)) for o in (pl, list(reversed(pl2)))]
    for p in procs:
        p.start()
    start.set()
    with psycopg.connect(dsn, autocommit=True) as c:
        deadline = time.monotonic() + 60
        while c.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                        "AND wait_event_type = 'Lock'").fetchone()[0] < 2:
            assert time.monotonic() < deadline, "the two groups did not both wait"
            time.sleep(0.02)
    blocker.rollback()
    blocker.close()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert sorted(s for r in results for s in r) == ["stored"] * (2 * n)
    time.sleep(1.0)  # the writers' sessions flushed their statistics when they ended
    with psycopg.connect(dsn, autocommit=True) as c:
        assert c.execute("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
                         ).fetchone()[0] == 0


def test_an_aggregator_starting_beside_a_running_one_takes_no_table_locks(dsn):
    """Opening a database this code has set up runs no DDL: with a group of another aggregator in
    progress (its row locks and ROW EXCLUSIVE table locks held), a new aggregator's store opens at once
    and stores (before, its ALTER TABLE waited for that group and stalled every later one)."""
    import threading

    import psycopg

    open_store(dsn).close()
    group = psycopg.connect(dsn)  # a group in progress: ROW EXCLUSIVE on the tables a group writes
    for t in ("releases", "devices", "rollups", "rollup_devices", "rollup_noise", "duplicates"):
        group.execute("LOCK TABLE %s IN ROW EXCLUSIVE MODE" % t)
    opened: list[Any] = []
    th = threading.Thread(target=lambda: opened.append(open_store(dsn)), daemon=True)
    th.start()
    th.join(10)
    try:
        assert opened, "the new aggregator waited for the running group's locks"
        p = params("pg-late", w=16)
        assert opened[0].insert(decode(encoded(p, fill=1))) == "stored"
    finally:
        group.rollback()
        group.close()
        th.join(30)
        for st in opened:
            st.close()


def test_rollups_rebuilt_when_their_meta_row_is_deleted(dsn):
    """deploy/OPERATIONS.md "Backups": deleting meta 'rollups' and opening the store for writing rebuilds the
    roll-ups from the releases (also with the set-up recorded, when opening runs no other DDL)."""
    import psycopg

    st = open_store(dsn)
    for dv in range(3):
        p = params("rb%d" % dv, w=16)
        assert st.insert(decode(encoded(p, fill=dv + 1))) == "stored"
    st.close()
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("DELETE FROM rollup_devices")
        c.execute("DELETE FROM rollup_noise")
        c.execute("DELETE FROM rollups")
        c.execute("DELETE FROM meta WHERE key = 'rollups'")
    open_store(dsn).close()
    with open_store(dsn, readonly=True) as ro:
        assert sum(r.releases for r in ro.rollups()) == 3
        m, _ = query.select_merged(ro, salt=SALT)
        raw, _ = query.select_merged(ro, salt=SALT, use_rollups=False)
        assert m.releases == 3 and np.array_equal(m.counters, raw.counters)


def test_rollup_sums_are_stored_compressed(dsn):
    """The roll-up sums (rewritten by every group that adds to a window) go to TOAST lz4-compressed, and
    read back as written (PgStore._init_schema; a server without lz4 keeps them uncompressed)."""
    import psycopg

    st = open_store(dsn)
    p = params("cz0", w=1024)
    assert st.insert(decode(encoded(p, fill=3))) == "stored"
    assert st.insert(decode(encoded(p, seq=1, elo=T0 // p.epoch_s + 1, fill=5))) == "stored"
    st.close()
    with psycopg.connect(dsn, autocommit=True) as c:
        how = c.execute("SELECT attcompression, attstorage FROM pg_attribute WHERE attrelid = 'rollups'::regclass "
                        "AND attname = 'sums'").fetchone()
        lz4 = c.execute("SELECT count(*) FROM pg_settings WHERE name = 'default_toast_compression' "
                        "AND 'lz4' = ANY(enumvals)").fetchone()[0]
        sizes = c.execute("SELECT pg_column_size(sums), octet_length(sums) FROM rollups").fetchall()
    assert how == (("l", "x") if lz4 else ("", "e"))
    if lz4:
        assert all(stored < raw for stored, raw in sizes)
    with open_store(dsn, readonly=True) as ro:
        m, _ = query.select_merged(ro, salt=SALT)
        raw, _ = query.select_merged(ro, salt=SALT, use_rollups=False)
        assert m.releases == 2 and np.array_equal(m.counters, raw.counters)


def test_bad_dsn_and_server_down_say_what_is_wrong(server, dsn):
    with pytest.raises(StoreError, match=r"cannot connect to PostgreSQL at postgresql://postgres@127.0.0.1:1/x"):
        open_store("postgresql://postgres:secret@127.0.0.1:1/x", timeout=2)
    try:
        open_store("postgresql://postgres:secret@127.0.0.1:1/x", timeout=2)
    except StoreError as exc:
        assert "secret" not in str(exc)
    with pytest.raises(StoreError, match="no pansketch tables"):
        open_store(server.create_database("empty%d" % next(_N)), readonly=True)
    # the server goes away under a running store: the group fails with the server's error, what is committed
    # stays, and the store reconnects when the server is back
    st = open_store(dsn)
    p = params("pg-d", w=16)
    assert st.insert(decode(encoded(p, seq=0, fill=1))) == "stored"
    server.stop(remove=False)
    try:
        with pytest.raises(Exception) as ei:
            st.insert(decode(encoded(p, seq=1, elo=T0 // 3600 + 1, fill=2)))
        assert "server" in str(ei.value).lower() or "connect" in str(ei.value).lower()
    finally:
        server.restart()
    pgserver.wait_ready(server.port)
    for _ in range(50):
        try:
            assert st.insert(decode(encoded(p, seq=1, elo=T0 // 3600 + 1, fill=2))) == "stored"
            break
        except Exception:
            time.sleep(0.1)
    assert st.release_count() == 2
    st.close()


def test_aggregators_share_the_subscription_and_one_database(dsn, tmp_path):
    import json

    import paho.mqtt.client as mqtt

    from tests.support.broker import mosquitto_path, start_mosquitto
    from tests.support.aggregator_mqtt import AggThread, publish_all, wait_for

    if mosquitto_path() is None:
        pytest.skip("mosquitto is not installed (.ci/run installs it)")
    b = start_mosquitto(tmp_path)
    cfg = _cfg(dsn, broker={"port": b.port, "host": "127.0.0.1"}, aggregator={"shared_group": "aggs"})
    acks: list[dict[str, Any]] = []
    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="ack-watch", protocol=mqtt.MQTTv5)
    sub.on_message = lambda _c, _u, m: acks.append(json.loads(m.payload))
    sub.connect("127.0.0.1", b.port)
    sub.subscribe("pansketch/+/ack", qos=1)
    sub.loop_start()
    aggs = [AggThread(cfg) for _ in range(3)]
    try:
        msgs = fleet_releases("ps", 10, 12, w=32)
        publish_all(b.port, msgs)
        publish_all(b.port, msgs[:20], client_id="again")  # re-sends: duplicates, acknowledged again
        st = open_store(dsn, readonly=True)
        wait_for(lambda: st.release_count() == len(msgs) and st.duplicate_count() == 20)
        wait_for(lambda: sum(len(a.get("ok", [])) for a in acks) == len(msgs) + 20)
        assert st.snapshot()[:3] == (len(msgs), 0, 20)
        m, _ = query.select_merged(st, salt=SALT)
        assert m.releases == len(msgs) and len(m.devices) == 10
        st.close()
    finally:
        rcs = [a.close() for a in aggs]
        sub.disconnect()
        sub.loop_stop()
        b.stop()
    assert rcs == [0, 0, 0]
    assert sum(1 for a in aggs if a.counts["stored"] > 0) >= 2  # the load was split
    assert sum(a.counts["stored"] for a in aggs) == len(msgs)


def test_device_status_and_rejected_seqs_on_postgresql(dsn):
    import json as _json

    from pansketch.host_tools.ingest import devstatus

    st = open_store(dsn)
    t = "pansketch/pi-1/status"
    assert devstatus.record(st, t, _json.dumps({"dev": "pi-1", "ts": T0, "next_seq": 5, "oldest_pending": 3}).encode())
    assert not devstatus.record(st, t, _json.dumps({"dev": "pi-1", "ts": T0 - 60, "next_seq": 2}).encode())
    assert devstatus.record(st, t, b'{"state":"offline"}')
    d = st.device_statuses()["pi-1"]
    assert (d.state, d.next_seq, d.oldest_pending, d.ts) == ("offline", 5, 3, T0)
    p = params("pi-1", w=16)
    assert st.insert(decode(encoded(p, fill=1))) == "stored"
    agg = Aggregator(_cfg(dsn), store=st)
    out = agg.handle(topic("pi-1"), encoded(p, seq=4, fill=9))  # same key, other bytes
    assert out.code == "conflict"
    assert st.rejected_seqs() == {"pi-1": {4: "conflict"}}
    st.close()


def test_format_v2_columns_and_old_database_migration(dsn, tmp_path):
    """Format v2 (kinds dcs/dbits): v, lvl, b, map stored through pansketch_put and read back; a
    database from before those columns gains them (defaults for its rows) when an aggregator opens it."""
    import psycopg

    from pansketch.host_tools.store.sqlite import Store
    from tests.support import dcs_host as dcs
    st = open_store(dsn)
    assert st.insert(decode(encoded(params("pg-v1", w=16), fill=1))) == "stored"
    st.close()
    with psycopg.connect(dsn, autocommit=True) as c:  # as written by pansketch before format v2
        c.execute("ALTER TABLE releases DROP COLUMN v, DROP COLUMN lvl, DROP COLUMN b, DROP COLUMN map_num, "
                  "DROP COLUMN map_den, DROP COLUMN map_off")
    st = open_store(dsn)
    old = st.releases()
    assert [(r.v, r.lvl, r.b, r.map) for r in old] == [(1, 0, 0, None)]
    lite = Store(str(tmp_path / "same.db"))
    for dv in range(2):
        p = dcs.params("pg-dcs-%d" % dv)
        for k in range(2):
            raw = dcs.payload(p, [1, 2, 3, 50 + dv], seq=k, epoch=dcs.T0 // 3600 + k)
            assert st.insert(decode(raw, dcs.topic(p.device))) == "stored"
            assert lite.insert(decode(raw, dcs.topic(p.device))) == "stored"
    got = [r for r in st.releases() if r.kind == "dcs"]
    assert [(r.v, r.lvl, r.b, r.map) for r in got] == [(2, 0, 8, (1, 1, 0))] * 4
    assert st.rollups() and all(i.kind != "dcs" for i in st.rollups()) and st.has_unrolled()
    st.close()
    with open_store(dsn, readonly=True) as ro:
        a, _ = query.select_merged(ro, salt=dcs.SALT, device=["pg-dcs-0", "pg-dcs-1"])
    b, _ = query.select_merged(lite, salt=dcs.SALT)
    lite.close()
    assert a.kind == b.kind == "dcs" and a.releases == b.releases == 4
    assert np.array_equal(a.counters, b.counters) and a.noise == b.noise


def test_concurrent_writers_add_to_roll_up_rows_of_their_own(dsn):
    """Two aggregators write to one database at once: each adds to its own roll-up row of a window
    (no hot row that every group locks until its commit), and queries sum both rows exactly."""
    a, b = Aggregator(_cfg(dsn)), Aggregator(_cfg(dsn))
    assert {a.store._rollup_shard, b.store._rollup_shard} == {0, 1}
    for dv in range(4):
        p = params("sh%d" % dv, w=32)
        agg = a if dv % 2 else b
        for k in range(3):
            assert agg.handle(topic(p.device), encoded(p, seq=k, elo=T0 // 3600 + k, fill=dv * 10 + k)).stored
    a.close()
    b.close()
    st = open_store(dsn, readonly=True)
    infos = st.rollups()
    assert len(infos) == 6 and sorted({(i.win, i.releases) for i in infos}) == [(T0 // 3600 + k, 2) for k in range(3)]
    for sel in ({}, {"window": T0 // 3600 + 1}):
        m, _ = query.select_merged(st, salt=SALT, **sel)
        raw, _ = query.select_merged(st, salt=SALT, use_rollups=False, **sel)
        assert np.array_equal(m.counters, raw.counters) and m.noise == raw.noise
        assert (m.releases, m.devices) == (raw.releases, raw.devices)
    st.close()
    c = Aggregator(_cfg(dsn))  # the slots were freed with the sessions: a restart takes slot 0 again
    assert c.store._rollup_shard == 0
    c.close()


def test_a_device_keeps_one_tree_shape_on_postgresql(dsn, tmp_path):
    """pansketch_put's shape check (one stored row of the device decides) refuses a switch either way,
    also after many releases of the device."""
    from tests.support.tree_query import E0 as TE0
    from tests.support.tree_query import record_epochs, tparams

    agg = Aggregator(_cfg(dsn))
    for raw in record_epochs(tparams("sw"), str(tmp_path / "a"), [["x"]] * 2, seed="a"):
        assert agg.handle(topic("sw"), raw).stored
    other = record_epochs(tparams("sw", levels=6), str(tmp_path / "b"), [["x"]] * 2, seed="b", start=TE0 + 64)
    out = agg.handle(topic("sw"), other[0])
    assert out.status == "rejected" and out.code == "device" and "tree shape" in (out.reason or "")
    pw = params("win", w=128)  # window mode, the same kind, d, w as the tree parameters
    for k in range(30):
        assert agg.handle(topic("win"), encoded(pw, seq=k, elo=TE0 + k)).stored
    tree = record_epochs(tparams("win"), str(tmp_path / "c"), [["x"]] * 2, seed="c", start=TE0 + 128)
    out = agg.handle(topic("win"), tree[0])
    assert out.status == "rejected" and out.code == "device" and "tree shape" in (out.reason or ""), out
    agg.close()


def _group_outcomes(dsn: str, tmp_path: Any, per_release: bool, monkeypatch: Any) -> tuple[Any, ...]:
    """One prepared database, then one group mixing every outcome; returns the statuses, the reasons and what
    the database holds. ``per_release``: without the set-based statement (every release through pansketch_put)."""
    import psycopg

    from pansketch.host_tools.store import pg
    from tests.support.tree_query import E0 as TE0
    from tests.support.tree_query import record_epochs, tparams

    if per_release:
        monkeypatch.setattr(pg, "_set_rows", lambda todo: ([], list(todo)))
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("ALTER DATABASE %s SET track_functions = 'pl'" % dsn.rsplit("/", 1)[1])
    agg = Aggregator(_cfg(dsn))
    e = T0 // 3600
    pa, pb = params("ga", w=16), params("gb", w=16)
    pw = params("gt", w=128)  # window releases, then one tree node of the same kind, d, w
    tree = record_epochs(tparams("gt"), str(tmp_path / ("t%d" % per_release)), [["x"]] * 2, seed="t", start=TE0 + 64)
    mixed = record_epochs(tparams("gm"), str(tmp_path / ("m%d" % per_release)), [["x"]] * 2, seed="m", start=TE0 + 64)
    first = [(pa, 0, e, 1), (pb, 0, e, 1)] + [(pw, k, TE0 + k, 0) for k in range(3)]
    items = [agg.validate(topic(p.device), encoded(p, seq=s, elo=el, fill=f)) for p, s, el, f in first]
    agg.store.commit_group(items)
    assert [x.status for x in items] == ["stored"] * 5
    group = [(topic("ga"), encoded(pa, seq=0, elo=e, fill=1)),  # 0 duplicate of a stored release
             (topic("ga"), encoded(pa, seq=5, elo=e, fill=9)),  # 1 conflict with stored seq 0
             (topic("ga"), encoded(pa, seq=1, elo=e + 1, fill=2)),  # 2 stored
             (topic("ga"), encoded(pa, seq=1, elo=e + 1, fill=2)),  # 3 its re-send in the same group: duplicate
             (topic("gb"), encoded(pb, seq=7, elo=e + 1, fill=4)),  # 4 stored (first of its key in arrival order)
             (topic("gb"), encoded(pb, seq=1, elo=e + 1, fill=3)),  # 5 same key, other bytes: conflict
             (topic("gc"), encoded(params("gc", w=16), seq=0, elo=e)),  # 6 new device: stored
             (topic("gc"), encoded(params("gc", w=32), seq=1, elo=e + 1)),  # 7 its parameters changed: device
             (topic("gb"), encoded(params("gb", w=32), seq=2, elo=e + 2)),  # 8 device (a known device)
             (topic("ga"), encoded(params("ga", w=32), seq=6, elo=e)),  # 9 key stored, other bytes: conflict first
             (topic("gt"), tree[0]),  # 10 tree node of a device of window releases: device (shape)
             (topic("gm"), encoded(params("gm", w=128), seq=0, elo=TE0)),  # 11 new device, window then tree:
             (topic("gm"), mixed[0]),  # 12 ... the first in key order decides: device (shape)
             (topic("gn"), encoded(params("gn", w=16), seq=0, elo=e, fill=5))]  # 13 stored
    items = [agg.validate(t, raw) for t, raw in group]
    agg.store.commit_group(items)
    agg.close()
    statuses = [x.status if x.rej is None else "%s:%s" % (x.status, x.rej.code) for x in items]
    reasons = [x.rej.reason if x.rej is not None else None for x in items]
    with psycopg.connect(dsn, autocommit=True) as c:
        rows = c.execute("SELECT device, elo, ehi, part, seq, sha256 FROM releases ORDER BY 1, 2, 3, 4").fetchall()
        devs = c.execute("SELECT device, salt, hv, kind, d, w, ep_s FROM devices ORDER BY 1").fetchall()
        dups = c.execute("SELECT device, elo, ehi, part FROM duplicates ORDER BY 1, 2, 3, 4").fetchall()
        deadline = time.monotonic() + 30
        while True:  # the aggregator's session reported its function calls when it ended
            calls = dict(c.execute("SELECT funcname, calls FROM pg_stat_user_functions").fetchall())
            if calls or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    return statuses, reasons, rows, devs, dups, calls


def test_set_based_group_put_classifies_as_release_by_release(server, tmp_path, monkeypatch):
    """A group goes to PostgreSQL in one set-based statement (pansketch_put_many), only the releases
    that did not insert classified one by one: stored, duplicate, conflict, device parameters and tree
    shape come out exactly as storing the group release by release (pansketch_put, in key order), in
    the statuses, the reasons and the rows; a re-send in the same group, and a device mixing shapes,
    go release by release after the statement."""
    set_based = _group_outcomes(server.create_database("t%d" % next(_N)), tmp_path, False, monkeypatch)
    monkeypatch.undo()
    by_release = _group_outcomes(server.create_database("t%d" % next(_N)), tmp_path, True, monkeypatch)
    assert set_based[0] == ["duplicate", "rejected:conflict", "stored", "duplicate", "stored", "rejected:conflict",
                            "stored", "rejected:device", "rejected:device", "rejected:conflict", "rejected:device",
                            "stored", "rejected:device", "stored"]
    assert "stored seq 0, this seq 5" in set_based[1][1] and "stored seq 7, this seq 1" in set_based[1][5]
    assert "stored seq 0, this seq 6" in set_based[1][9] and "w 16 -> 32" in set_based[1][7]
    assert "tree shape" in set_based[1][10] and "tree shape" in set_based[1][12]
    assert set_based[:5] == by_release[:5]
    # one set-based statement per group; the later copies of a key in the group (1, 9 after 0; 3; 5) and
    # the device mixing shapes (11, 12) went alone
    assert set_based[5].get("pansketch_put_many") == 2 and set_based[5].get("pansketch_put") == 6, set_based[5]
    assert "pansketch_put_many" not in by_release[5] and by_release[5].get("pansketch_put") == 5 + 14


def _racer(dsn: str, payloads: list[tuple[str, bytes]], start: Any, out: "mp.Queue[Any]") -> None:
    agg = Aggregator(_cfg(dsn))
    items = [agg.validate(t, raw) for t, raw in payloads]
    start.wait()
    agg.store.commit_group(items)
    out.put([(x.rel.key if x.rel else None, x.rel.sha256 if x.rel else None, x.status,
              x.rej.code if x.rej else None) for x in items])
    agg.close()


def test_concurrent_set_based_groups_classify_each_key_once(dsn):
    """Two aggregators store groups with the same keys at the same moment, half of them with the same
    bytes and half with other bytes (noise re-drawn): each key is stored once, and every other copy
    is a duplicate exactly when its bytes are the stored ones, else a conflict (a key the other
    aggregator inserted while this statement ran is classified against the committed row)."""
    import psycopg

    e = T0 // 3600
    for rnd in range(3):
        mine = [(topic("cr%d" % dv), encoded(params("cr%d" % dv, w=16), seq=rnd * 8 + k, elo=e + rnd * 8 + k,
                                             fill=dv * 10 + k)) for dv in range(8) for k in range(8)]
        theirs = [(t, raw if i % 2 else encoded(params("cr%d" % (i // 8), w=16), seq=rnd * 8 + i % 8,
                                                 elo=e + rnd * 8 + i % 8, fill=1000 + i))
                  for i, (t, raw) in enumerate(mine)]
        ctx = mp.get_context("fork")
        q: "mp.Queue[Any]" = ctx.Queue()
        start = ctx.Event()
        procs = [ctx.Process(target=_racer, args=(dsn, o, start, q)) for o in (mine, list(reversed(theirs)))]
        for p in procs:
            p.start()
        time.sleep(0.5)
        start.set()
        results = [q.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        with psycopg.connect(dsn, autocommit=True) as c:
            stored = {(r[0], r[1], r[2], r[3]): r[4] for r in c.execute(
                "SELECT device, elo, ehi, part, sha256 FROM releases WHERE elo >= %s", (e + rnd * 8,))}
        assert len(stored) == len(mine)
        seen: dict[Any, int] = {}
        for key, sha, status, code in (x for r in results for x in r):
            assert key is not None and key in stored
            if status == "stored":
                assert stored[key] == sha
                seen[key] = seen.get(key, 0) + 1
            elif stored[key] == sha:
                assert status == "duplicate", (key, status, code)
            else:
                assert (status, code) == ("rejected", "conflict"), (key, status, code)
        assert set(seen) == set(stored) and set(seen.values()) == {1}


def test_compressed_payloads_answer_as_raw_ones_on_postgresql(server, monkeypatch):
    """As tests/test_store_compress.py on SQLite: encoded, raw and mixed stores of releases of every kind
    give identical payloads, merges, roll-ups and answers, also after a purge."""
    from pansketch.host_tools.store import payloadcodec
    from pansketch.host_tools.store.exclusions import purge
    from tests.support.compressed import DEVICES, _events, answers, fill
    from tests.support.dashboard_kinds import _releases

    sent = {dev: _releases(dict(cfg, device=dev), [_events(cfg["kind"], k) for k in range(2)])
            for dev, cfg in DEVICES.items()}
    stores = {name: open_store(server.create_database("c%d" % next(_N))) for name in ("encoded", "raw", "mixed")}
    try:
        for name, pick in (("encoded", lambda i: True), ("raw", lambda i: False), ("mixed", lambda i: i % 2 == 1)):
            fill(stores[name], sent, monkeypatch, pick)
        blobs = [bytes(b) for d, b in stores["encoded"]._q("SELECT device, payload FROM releases") if d != "k-dbits"]
        assert blobs and all(b[:2] == payloadcodec.MAGIC for b in blobs)
        base = answers(stores["raw"])
        assert answers(stores["encoded"]) == base and answers(stores["mixed"]) == base
        for st in stores.values():
            assert purge(st, "k-cms").releases == 2
        base = answers(stores["raw"])
        assert answers(stores["encoded"]) == base and answers(stores["mixed"]) == base
    finally:
        for st in stores.values():
            st.close()
