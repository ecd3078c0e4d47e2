"""The store's change counter and the /metrics collector that answers from its last read while it is unchanged.

Every write transaction moves the counter (two writers on one SQLite file count every commit; on
PostgreSQL a sequence advanced after the commit); reads never move it. The collector reads the store
again only when the counter moved (or its time limit passed), and, once a read is costly, does that
in a background thread while the scrape returns the last families.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest

from pansketch.host_tools import metrics
from pansketch.host_tools.ingest.aggregator import Aggregator
from pansketch.host_tools.store import exclusions, pgserver
from pansketch.host_tools.store.backend import open_store
from pansketch.host_tools.store.sqlite import Store
from tests.support.host import params, record, topic


def _moves(st: Any, write: Callable[[], Any]) -> int:
    before = st.change_count() or 0
    write()
    return (st.change_count() or 0) - before


def _fill(db: str, tmp: Any, dev: str, n: int = 2) -> None:
    agg = Aggregator(_cfg_for(db))
    for raw in record(params(dev), str(tmp / dev), [["x", "y"]] * n):
        assert agg.handle(topic(dev), raw).stored
    agg.close()


def _cfg_for(db: str) -> Any:
    from pansketch.host_tools import hostconfig
    from tests.support.host import SALT

    return hostconfig.from_dict({"fleet": {"salt": SALT}, "aggregator": {"db": db}})


def _counter_moves_at_every_write(st: Any, other: Any, tmp: Any) -> None:
    rels = record(params("dev-a"), str(tmp / "dev-a"), [["x"]] * 3)
    from pansketch.host_tools.ingest.decode import decode

    def put(s: Any, raw: bytes) -> None:
        s.insert(decode(raw), topic("dev-a"))

    assert _moves(st, lambda: put(st, rels[0])) == 1
    assert _moves(st, lambda: put(other, rels[1])) == 1  # the other writer's commit counts too
    assert _moves(st, lambda: st.put_status("dev-a", {"state": "offline"})) == 1
    assert _moves(st, lambda: exclusions.set_excluded(st, "dev-a", True, "test")) == 1
    assert _moves(st, lambda: (st.releases(), st.device_activity(), st.rollups())) == 0  # reads do not
    assert _moves(st, lambda: (put(st, rels[2]), put(other, rels[2]))) == 2  # a duplicate is a write too


def test_change_counter_sqlite(tmp_path: Any) -> None:
    db = str(tmp_path / "c.db")
    st, other = Store(db), Store(db)
    try:
        _counter_moves_at_every_write(st, other, tmp_path)
        ro = Store(db, readonly=True)
        assert ro.change_count() == st.change_count()
        ro.close()
    finally:
        st.close()
        other.close()


@pytest.mark.skipif(pgserver.binaries() is None, reason=pgserver.MISSING)
def test_change_counter_postgresql(tmp_path: Any) -> None:
    pytest.importorskip("psycopg")
    srv = pgserver.PgServer.start()
    try:
        dsn = srv.create_database("changes")
        st, other = open_store(dsn), open_store(dsn)
        try:
            _counter_moves_at_every_write(st, other, tmp_path)
        finally:
            st.close()
            other.close()
    finally:
        srv.stop()


def _values(c: metrics.StoreCollector) -> dict[tuple[str, tuple[str, ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in c.collect() for s in f.samples
            if f.name not in ("pansketch_store_scrape_duration_seconds", "pansketch_store_metrics_age_seconds",
                              "pansketch_store_size_bytes")}


def test_collector_reads_the_store_only_when_it_changed(tmp_path: Any, monkeypatch: Any) -> None:
    pytest.importorskip("prometheus_client")
    db = str(tmp_path / "m.db")
    _fill(db, tmp_path, "dev-a")
    c = metrics.StoreCollector(db)
    reads = []
    real = c._collect
    monkeypatch.setattr(c, "_collect", lambda st: reads.append(1) or real(st))
    first = _values(c)
    assert _values(c) == first and len(reads) == 1  # unchanged: the families of the first read
    _fill(db, tmp_path, "dev-b")
    fresh = _values(c)
    assert len(reads) == 2 and fresh[("pansketch_store_releases_total", ())] == 4  # changed: read again
    monkeypatch.setattr(metrics, "STORE_TTL_S", 0.0)
    _values(c)
    assert len(reads) == 3  # the time limit: status ages with the clock


def test_collector_refreshes_a_costly_read_in_the_background(tmp_path: Any, monkeypatch: Any) -> None:
    pytest.importorskip("prometheus_client")
    db = str(tmp_path / "m.db")
    _fill(db, tmp_path, "dev-a")
    c = metrics.StoreCollector(db)
    first = _values(c)
    assert c._cached is not None
    ver, t, _cost, fams = c._cached
    c._cached = (ver, t, 10 * metrics.REFRESH_INLINE_S, fams)  # as if reading the store took long
    _fill(db, tmp_path, "dev-b")
    assert _values(c) == first  # the scrape does not wait for the read
    deadline = time.monotonic() + 20
    while _values(c)[("pansketch_store_releases_total", ())] != 4:
        assert time.monotonic() < deadline, "the background read never landed"
        time.sleep(0.02)
