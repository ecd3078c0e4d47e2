"""Two aggregators on one PostgreSQL server lose nothing, wait on no lock and retry nothing.

The short version of ``python -m pansketch.host_tools.bench.host --pg-scaleout``
(pansketch.host_tools.bench.pgscale, deploy/OPERATIONS.md section 6): real mosquitto,
two ``pansketch aggregate`` processes on a shared subscription, publisher processes, a
throwaway PostgreSQL server with fsync on; the database knows the devices (a running
fleet). A store whose groups contended on a shared row (a counter in ``meta``, one
roll-up row per window for every writer) shows up as lock-wait samples; one whose
transactions deadlock as retries.
"""

from __future__ import annotations

import os

import pytest

from pansketch.host_tools.store import pgserver

try:
    import psycopg  # noqa: F401

    _PSYCOPG = True
except ImportError:  # pragma: no cover
    _PSYCOPG = False

if os.environ.get("CI") and (pgserver.binaries() is None or not _PSYCOPG):
    raise RuntimeError("CI must run the PostgreSQL tests: " + (pgserver.MISSING if _PSYCOPG else "psycopg missing"))
pytestmark = [pytest.mark.skipif(pgserver.binaries() is None, reason=pgserver.MISSING),
              pytest.mark.skipif(not _PSYCOPG, reason="psycopg 3 is not installed (pip install 'psycopg[binary]')")]


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
