"""Two aggregators on one PostgreSQL server lose nothing, wait on no lock and retry nothing.

The short version of ``python -m pansketch.host_tools.bench.pgscale``
(pansketch.host_tools.bench.pgscale, deploy/OPERATIONS.md section 6): real mosquitto,
two ``pansketch aggregate`` processes on a shared subscription, publisher processes, a
throwaway PostgreSQL server with fsync on; the database knows the devices (a running
fleet). A store whose groups contended on a shared row (a counter in ``meta``, one
roll-up row per window for every writer) shows up as lock-wait samples; one whose
transactions deadlock as retries.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from pansketch.host_tools.store import pgserver
from tests.support import pg as pgsupport

pytestmark = pgsupport.marks()
psycopg = pytest.importorskip("psycopg")


@pytest.fixture(scope="module")
def server():
    srv = pgserver.PgServer.start(fsync=True)
    yield srv
    srv.stop()


def test_two_aggregators_store_everything_without_lock_waits_or_retries(server, tmp_path):
    from pansketch.host_tools.bench import host, pgscale
    from pansketch.host_tools.localnet import mosquitto_path

    if mosquitto_path() is None:
        pytest.skip("mosquitto is not installed (.ci/run installs it)")
    msgs = host.make_releases(40, 30, d=4, w=256)  # 1,200 releases, 40 per window over 30 windows
    dsn = server.create_database("scaleout")
    already = host._warm(dsn, msgs)
    with open(os.path.join(server.data, "postmaster.pid")) as f:
        pg_pid = int(f.readline())
    res = pgscale.one_run(msgs, 2, dsn, pg_pid, str(tmp_path), "t", workers=2, sample_s=0.005, already=already)
    assert (res["sent"], res["stored"], res["lost"]) == (1200, 1200, 0)
    exits = res["aggregator_exit"]
    assert sum(e["stored"] for e in exits) == 1200 and all(e["stored"] > 0 for e in exits)  # the load was split
    assert sum(e["duplicates"] for e in exits) == 0
    assert res["retries_missing"] == 0  # both logged their retry counts at exit ...
    assert res["retries_total"] == 0 and res["retry_warnings"] == 0, res["retries"]  # ... and there were none
    srv = res["server"]
    assert srv["polls"] >= 5 and srv["session_samples"] > 0  # the watch saw the sessions at work
    assert srv["lock_wait_samples"] == 0 and srv["locks_not_granted_samples"] == 0, (
        srv["wait_events"], srv["locks_not_granted"])
    assert srv["deadlocks"] == 0
    cpu = res["cpu_us_per_release"]
    assert cpu["postgres"] > 0 and cpu["aggregator 0"] > 0 and cpu["aggregator 1"] > 0


def test_paced_publishers_offer_the_asked_rate_and_nothing_queues(server, tmp_path):
    """``--pace-per-aggregator``: 600 releases at 300/s in all take about 2 s to publish (flat out they
    take a fraction of that), the run reports the rate offered and stored, and at a rate this machine
    keeps up with nothing queues."""
    from pansketch.host_tools.bench import host, pgscale
    from pansketch.host_tools.localnet import mosquitto_path

    if mosquitto_path() is None:
        pytest.skip("mosquitto is not installed (.ci/run installs it)")
    msgs = host.make_releases(40, 15, d=4, w=256)  # 600 releases
    dsn = server.create_database("scaleout_paced")
    already = host._warm(dsn, msgs)
    with open(os.path.join(server.data, "postmaster.pid")) as f:
        pg_pid = int(f.readline())
    res = pgscale.one_run(msgs, 2, dsn, pg_pid, str(tmp_path), "p", workers=2, sample_s=0.02, already=already,
                          pace=300.0)
    assert (res["sent"], res["stored"], res["lost"]) == (600, 600, 0)
    assert res["pace_asked"] == 300.0
    assert 1.9 <= res["publishing_seconds"] < 6, res["publishing_seconds"]  # paced: 600 / 300 s, not flat out
    assert 200 <= res["offered_per_second"] <= 320 and res["stored_per_second"] <= res["offered_per_second"] * 1.05
    assert res["stored_over_offered"] > 0.8 and res["last_stored_after_last_sent_s"] < 5
    assert res["retries_total"] == 0 and res["server"]["lock_wait_samples"] == 0
    with pytest.raises(ValueError, match="positive rate"):
        pgscale.one_run(msgs, 1, dsn, pg_pid, str(tmp_path), "q", workers=1, sample_s=0.02, pace=0.0)


def test_the_store_counts_the_transactions_it_runs_again(server):
    """A group that met a lock it may not wait for (55P03, lock_timeout) is rolled back and run again,
    and counted by its SQLSTATE: what the aggregator logs at exit and the benchmark adds up."""
    import threading
    import time

    from pansketch.host_tools.bench import host
    from pansketch.host_tools.ingest.decode import decode
    from pansketch.host_tools.store.pg import PgStore
    from pansketch.host_tools.store.rows import Pending

    dsn = server.create_database("retries")
    st = PgStore(dsn)
    assert st.retry_counts() == {}
    st.conn.execute("SET lock_timeout = '20ms'")
    rels = [decode(p, t) for t, p in host.make_releases(3, 2, d=4, w=64)]
    holder = psycopg.connect(dsn)
    holder.execute("LOCK TABLE releases IN EXCLUSIVE MODE")  # held until the rollback below
    threading.Timer(0.4, holder.rollback).start()
    t = time.monotonic()
    st.commit_group([Pending(r.payload, "pansketch/%s/release" % r.dev, time.time(), rel=r, device=r.dev)
                     for r in rels])
    assert time.monotonic() - t >= 0.35  # it did wait for the lock to go
    assert st.release_count() == 6
    retries = st.retry_counts()
    assert set(retries) == {"55P03"} and retries["55P03"] >= 2
    holder.close()
    st.close()


def test_writers_storing_one_window_do_not_wait_for_each_other(server):
    """Two writers' groups in the same window: the second commits while the first's transaction is still
    open after its flag-generation bump (each counts in its own shard row; one row per window that every
    group updated made each group wait for the other writers' commits). The window's generation still
    moves with every group, so flags kept for it are computed again."""
    import threading
    import time

    from pansketch.host_tools.bench import host
    from pansketch.host_tools.ingest.decode import decode
    from pansketch.host_tools.query import influence
    from pansketch.host_tools.store.pg import PgStore
    from pansketch.host_tools.store.rows import Pending

    rels = [decode(p, t) for t, p in host.make_releases(6, 1, d=4, w=64)]  # six devices, one window
    assert len({(r.win_s, r.win) for r in rels}) == 1
    win = (rels[0].win_s, rels[0].win)

    def pend(rs: list[Any]) -> list[Pending]:
        return [Pending(r.payload, "pansketch/%s/release" % r.dev, time.time(), rel=r, device=r.dev) for r in rs]

    dsn = server.create_database("onewindow")
    a, b = PgStore(dsn), PgStore(dsn)

    def gen() -> int:
        return {(int(r[0]), int(r[1])): int(r[2]) for r in a._q(a.flag_windows_sql())}[win]

    a.commit_group(pend(rels[:2]))
    b.commit_group(pend(rels[2:3]))
    g0 = gen()
    influence.refresh(a)
    assert influence._windows(a, 10)[1][win][:2] == (g0, g0)  # flags kept at this generation
    cur = a.conn.cursor()
    cur.execute("BEGIN")  # a's group in flight: its bump done, its commit not yet
    a._bump_flag_windows(cur, {win})
    done = threading.Event()
    t = threading.Thread(target=lambda: (b.commit_group(pend(rels[3:5])), done.set()))
    t.start()
    try:
        assert done.wait(10), "b's group waited for a's transaction"
    finally:
        cur.execute("COMMIT")
        t.join(30)
    assert a.release_count() == 5 and b.retry_counts() == {}
    assert gen() == g0 + 2  # both changes count
    state = influence._windows(a, 10)[1][win]
    assert state[0] != state[1]  # the kept flags are out of date: the scanner computes them again
    assert influence.refresh(a) == 1
    a.close()
    b.close()


def test_seq_jump_checked_against_what_other_writers_stored(server):
    """The seq-jump check reads every new device's highest stored seq in one statement per group
    (PgStore._prefetch_tops): a writer that never saw the device still holds it to what another writer
    stored, and a new device to 0."""
    import array
    import dataclasses
    import time

    from pansketch.agent import release
    from pansketch.agent.params import Params
    from pansketch.host_tools.bench import host
    from pansketch.host_tools.ingest.decode import decode
    from pansketch.host_tools.store.pg import PgStore
    from pansketch.host_tools.store.rows import Pending

    def rel(dev: str, seq: int, win: int) -> Any:
        p = Params({"device": dev, "salt": host.SALT, "kind": "cs", "d": 2, "w": 16})
        raw = release.encode(p, seq, host.EPOCH0 + win, host.EPOCH0 + win + 1, 0, array.array("i", [1] * 32))
        return decode(raw, "pansketch/%s/release" % dev)

    def put(st: PgStore, rs: list[Any]) -> list[str]:
        ps = [Pending(r.payload, "pansketch/%s/release" % r.dev, time.time(), rel=r, device=r.dev) for r in rs]
        st.commit_group(ps)
        return [p.status for p in ps]

    dsn = server.create_database("seqjump")
    a, b = PgStore(dsn), PgStore(dsn)
    for st in (a, b):
        st.limits = dataclasses.replace(st.limits, max_seq_jump=10)
    assert put(a, [rel("d1", 50, 0)]) == ["quarantined"]  # a new device: 50 > 0 + 10
    assert put(a, [rel("d1", 5, 0), rel("d1", 14, 1)]) == ["stored", "stored"]
    # b never saw d1: 14 stored by a, so 24 passes and 25 does not; d2 is new to both
    assert put(b, [rel("d1", 25, 2), rel("d1", 24, 3), rel("d2", 11, 0), rel("d2", 3, 1)]) == [
        "quarantined", "stored", "quarantined", "stored"]
    a.close()
    b.close()
