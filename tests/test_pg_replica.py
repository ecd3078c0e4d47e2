"""A streaming replica of the PostgreSQL store, and failover as deploy/OPERATIONS.md section 6 documents it.

A throwaway primary (``pansketch.host_tools.store.pgserver``, Debian's PostgreSQL
binaries) gets a hot standby by ``pg_basebackup -X stream -R``, with
synchronous replication (``synchronous_standby_names``): a commit returns,
and the aggregator acknowledges, only once the standby has the WAL.

* While an aggregator writes to the primary, ``pansketch query`` and
  ``pansketch status`` (a host.toml whose ``[aggregator] db`` is the
  replica) and the dashboard's JSON API read from the replica; their answers
  converge to the primary's once the writer stops, and the replica refuses
  writes.
* Failover, the documented steps as written: the primary dies mid-ingest
  (``pg_ctl stop -m immediate``), ``pg_ctl promote`` on the standby, the
  aggregator's ``db`` repointed to it: every release the aggregator
  acknowledged before the crash is on the promoted node (nothing stored is
  lost), the release in flight and later ones are stored there, a re-send
  of an acknowledged one is a duplicate, and queries answer as on the
  primary plus the new releases.
"""

from __future__ import annotations

import array
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

import numpy as np
import pytest

from pansketch.agent import release
from pansketch.host_tools import hostconfig
from pansketch.host_tools.ingest.aggregator import Aggregator
from pansketch.host_tools.store import pgserver
from pansketch.host_tools.store.backend import open_store
from tests.support.host import SALT, T0, params, topic
from tests.support import pg as pgsupport

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pgsupport.marks()
psycopg = pytest.importorskip("psycopg")

DEVICES = 6
WINDOWS = 30
ITEMS = ["item-%d" % i for i in range(8)]


def _releases(seed: int = 5) -> list[tuple[str, bytes]]:
    """DEVICES x WINDOWS hourly releases (cs d=4 w=64) with random counters, window by window."""
    rng = np.random.default_rng(seed)
    ps = [params("rep-%d" % k) for k in range(DEVICES)]
    out = []
    for k in range(WINDOWS):
        for p in ps:
            ctr = array.array("i", rng.integers(-40, 400, p.d * p.w).tolist())
            elo = T0 // 3600 + k
            out.append((topic(p.device), release.encode(p, k, elo, elo + 1, 0, ctr)))
    return out


def _conf(path: str, dsn: str) -> str:
    with open(path, "w") as f:
        f.write('[aggregator]\ndb = "%s"\n[fleet]\nsalt = "%s"\n' % (dsn, SALT))
    return path


def _cli(conf: str, *args: str) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "pansketch.host_tools.cli", *args, "--config", conf], capture_output=True,
                       text=True, env=env, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def _freq(conf: str) -> list[dict[str, Any]]:
    """``pansketch query freq --json`` of ITEMS over every release (answer fields only, no timings)."""
    out = _cli(conf, "query", "freq", *ITEMS, "--json")
    return [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]


def _api(cfg: hostconfig.HostConfig, path: str) -> Any:
    """The dashboard's JSON API, called as its WSGI server would."""
    from pansketch.host_tools.web.app import Dashboard

    app = Dashboard(cfg)
    got: dict[str, Any] = {}
    body = b"".join(app({"REQUEST_METHOD": "GET", "PATH_INFO": path.split("?")[0],
                         "QUERY_STRING": path.partition("?")[2], "HTTP_HOST": "127.0.0.1", "wsgi.url_scheme": "http"},
                        lambda status, headers: got.update(status=status)))
    assert got["status"].startswith("200"), (got, body[:300])
    return json.loads(body)


def _keys(dsn: str) -> set[tuple[str, int]]:
    with psycopg.connect(dsn) as c:
        return {(d, int(s)) for d, s in c.execute("SELECT device, seq FROM releases")}


def _replay_caught_up(primary_dsn: str, standby_dsn: str, timeout: float = 30.0) -> None:
    """Step 2 of a planned switchover (OPERATIONS.md): the standby has replayed the primary's WAL."""
    with psycopg.connect(primary_dsn, autocommit=True) as c:
        target = c.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
    deadline = time.monotonic() + timeout
    with psycopg.connect(standby_dsn, autocommit=True) as c:
        while not c.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (target,)).fetchone()[0]:
            assert time.monotonic() < deadline, "the standby did not replay up to %s" % target
            time.sleep(0.05)


@pytest.fixture
def pair() -> Iterator[tuple[pgserver.PgServer, pgserver.PgServer, str, str]]:
    primary = pgserver.PgServer.start()
    standby = None
    try:
        dsn = primary.create_database("fleet")
        open_store(dsn).close()  # the aggregator's schema
        with psycopg.connect(primary.dsn(), autocommit=True) as c:  # OPERATIONS.md: synchronous replication
            # (set before the base backup here, so the standby inherits it, as a re-built one would:
            # the failover's step 3 clears it on the promoted node)
            c.execute("ALTER SYSTEM SET synchronous_standby_names = 'pansketch_standby'")
            c.execute("SELECT pg_reload_conf()")
        standby = primary.standby("pansketch_standby")
        sdsn = "postgresql://postgres@127.0.0.1:%d/fleet" % standby.port
        deadline = time.monotonic() + 30
        with psycopg.connect(primary.dsn(), autocommit=True) as c:
            while c.execute("SELECT count(*) FROM pg_stat_replication WHERE application_name = 'pansketch_standby' "
                            "AND sync_state = 'sync' AND state = 'streaming'").fetchone()[0] != 1:
                assert time.monotonic() < deadline, "the standby is not a streaming synchronous replica"
                time.sleep(0.05)
        yield primary, standby, dsn, sdsn
    finally:
        if standby is not None:
            standby.stop()
        primary.stop()


def test_queries_and_dashboard_read_a_replica_while_an_aggregator_writes(pair, tmp_path):
    primary, standby, dsn, sdsn = pair
    msgs = _releases()
    rconf = _conf(str(tmp_path / "replica.toml"), sdsn)
    pconf = _conf(str(tmp_path / "primary.toml"), dsn)
    rcfg = hostconfig.load(rconf)
    agg = Aggregator(hostconfig.load(pconf))
    done = threading.Event()
    err: list[BaseException] = []

    assert all(o.status == "stored" for o in agg.handle_many(msgs[:DEVICES]))  # the readers find a store

    def write() -> None:
        try:
            for i in range(DEVICES, len(msgs), DEVICES):  # one window of the fleet per group, a little apart
                assert all(o.status == "stored" for o in agg.handle_many(msgs[i:i + DEVICES]))
                time.sleep(0.02)
        except BaseException as exc:  # pragma: no cover - reported below
            err.append(exc)
        finally:
            done.set()

    th = threading.Thread(target=write)
    th.start()
    reads = 0
    try:
        while not done.is_set():  # reading from the replica during ingest: answers, never errors
            ans = _freq(rconf)  # a prefix of the ingest: whole windows of the fleet, never more than written
            assert len(ans) == len(ITEMS) and ans[0]["releases"] % DEVICES == 0
            assert ans[0]["releases"] <= DEVICES * WINDOWS
            assert _api(rcfg, "/api/status")["releases"] <= DEVICES * WINDOWS
            reads += 1
    finally:
        th.join(60)
        agg.close()
    assert not err, err
    assert reads >= 1
    # converged: the replica answers as the primary does (synchronous: at once; poll a little anyway)
    want = _freq(pconf)
    assert [a["releases"] for a in want] == [DEVICES * WINDOWS] * len(ITEMS)
    deadline = time.monotonic() + 30
    while _freq(rconf) != want:
        assert time.monotonic() < deadline, "the replica's answers did not converge to the primary's"
        time.sleep(0.2)
    q = "/api/freq?item=item-1&item=item-2"
    assert _api(rcfg, q) == _api(hostconfig.load(pconf), q)
    st_r, st_p = _api(rcfg, "/api/status"), _api(hostconfig.load(pconf), "/api/status")
    assert st_r["releases"] == st_p["releases"] == DEVICES * WINDOWS
    assert st_r["delivery"] == st_p["delivery"] and st_r["delivery"]["lost"] == 0
    assert "%d device(s), %d release(s)" % (DEVICES, DEVICES * WINDOWS) in _cli(rconf, "status")
    assert _keys(sdsn) == _keys(dsn) and len(_keys(dsn)) == len(msgs)
    with psycopg.connect(sdsn, autocommit=True) as c:  # a hot standby takes no writes
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            c.execute("DELETE FROM releases")


def test_failover_promote_the_standby_and_repoint_the_aggregator_nothing_stored_is_lost(pair, tmp_path):
    primary, standby, dsn, sdsn = pair
    msgs = _releases(seed=9)
    agg = Aggregator(hostconfig.load(_conf(str(tmp_path / "primary.toml"), dsn)))
    acked: list[tuple[str, bytes]] = []
    cut = len(msgs) // 2
    for i in range(0, cut, DEVICES):
        group = msgs[i:i + DEVICES]
        assert all(o.status == "stored" for o in agg.handle_many(group))
        acked += group  # committed, so the aggregator would now acknowledge them
    # the primary dies with the next group in flight
    primary.crash()
    in_flight = msgs[cut:cut + DEVICES]
    with pytest.raises(Exception):
        agg.handle_many(in_flight)
    agg.close()
    # the documented steps (1. the old primary stays down): 2. pg_ctl promote on the standby
    standby.promote()
    with psycopg.connect(sdsn, autocommit=True) as c:
        assert c.execute("SELECT pg_is_in_recovery()").fetchone()[0] is False
        # 3. no synchronous standby to wait for until a new one streams
        c.execute("ALTER SYSTEM RESET synchronous_standby_names")
        c.execute("SELECT pg_reload_conf()")
    # 4. point [aggregator] db at the promoted node and start the aggregator again
    conf = _conf(str(tmp_path / "promoted.toml"), sdsn)
    agg2 = Aggregator(hostconfig.load(conf))
    try:
        # nothing acknowledged was lost: every release committed on the old primary is on the new one
        have = _keys(sdsn)
        want = {(t.split("/")[1], i // DEVICES) for i, (t, _p) in enumerate(acked)}
        assert want <= have, sorted(want - have)[:5]
        # the broker redelivers the unacknowledged group: stored now; a re-send of an acknowledged one: duplicate
        assert [o.status for o in agg2.handle_many(in_flight)] == ["stored"] * DEVICES
        assert [o.status for o in agg2.handle_many(acked[-DEVICES:])] == ["duplicate"] * DEVICES
        for i in range(cut + DEVICES, len(msgs), DEVICES):
            assert all(o.status == "stored" for o in agg2.handle_many(msgs[i:i + DEVICES]))
    finally:
        agg2.close()
    assert len(_keys(sdsn)) == len(msgs)
    # queries on the promoted node: every release counted once (raw merge and roll-ups agree)
    a = _freq(conf)
    raw = [json.loads(ln) for ln in _cli(conf, "query", "freq", *ITEMS, "--json", "--no-rollups").splitlines()
           if ln.startswith("{")]
    assert a == raw and len(a) == len(ITEMS)
    with open_store(sdsn, readonly=True) as st:
        assert st.release_count() == len(msgs)
        assert sum(r.releases for r in st.rollups()) == len(msgs)
