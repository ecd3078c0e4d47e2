"""status and the fleet page from the kept summaries equal the read of every release, on both back ends.

A store is built through the real write path (commit_group, as the aggregator calls it) with missing
windows and seqs, duplicate deliveries, a conflicting re-send (rejected), a reused seq (a device
reset), late releases, a seq-jump quarantine, a device known only by its refusals, device statuses, two
mechanisms (eps and rho), a keep-mode device whose release spans several epochs, nz > 2, then an
exclusion, a partial and a full purge and a retention prune. After every step the status JSON (at the
default grace and two others) and the fleet page JSON from the summaries
(pansketch.host_tools.store.summary) are compared byte for byte with status.report_full, the
computation from every release; at the end the kept summaries equal those rebuilt from the releases.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from typing import Any, Callable, Iterator

import pytest

from pansketch.host_tools.ingest.decode import decode
from pansketch.host_tools.query import fleetview, status as status_mod
from pansketch.host_tools.store import exclusions, summary
from pansketch.host_tools.store.records import Rejected
from pansketch.host_tools.store.rows import Pending
from pansketch.host_tools.store.sqlite import Store
from tests.support import pg as pgsupport
from tests.support.host import T0, encoded, params, topic

NOW = T0 + 40 * 3600
H = T0 // 3600  # window (and epoch) id of T0 for hourly devices


def _put(st: Any, p: Any, seq: int, elo: int, late: float = 5.0, fill: int = 1, nz: int = 2,
         ehi: Any = None) -> str:
    raw = encoded(p, seq=seq, elo=elo, fill=fill, nz=nz, ehi=ehi)
    rel = decode(raw)
    item = Pending(raw, topic(p.device), rel.t1 + late, rel=rel, device=p.device)
    st.commit_group([item])
    return item.status


def _same(st: Any, monkeypatch: Any) -> None:
    for grace in (None, 60.0, 20000.0):
        got = status_mod.report_with_ledger(st, now=NOW, late_grace_s=grace)[0]
        want = status_mod.report_full(st, now=NOW, late_grace_s=grace)[0]
        assert json.dumps(got) == json.dumps(want), grace
    for grace in (None, 60.0):  # entries off the listed page (statuskept.LITE_KEYS) hold the whole entries' values
        lite = status_mod.report_with_ledger(st, now=NOW, late_grace_s=grace, page=(0, 0))[0]["devices"]
        whole = status_mod.report(st, now=NOW, late_grace_s=grace)["devices"]
        assert [d["device"] for d in lite] == [d["device"] for d in whole]
        for li, wh in zip(lite, whole):
            assert json.dumps(li, sort_keys=True) == json.dumps({k: wh[k] for k in li}, sort_keys=True), li["device"]
    page = fleetview.fleet(st, now=NOW)
    paged = fleetview.fleet(st, now=NOW, offset=1, limit=2)
    with monkeypatch.context() as m:
        m.setattr(status_mod, "report_with_ledger", status_mod.report_full)
        assert json.dumps(page) == json.dumps(fleetview.fleet(st, now=NOW))
        assert json.dumps(paged) == json.dumps(fleetview.fleet(st, now=NOW, offset=1, limit=2))
    assert paged["devices"] == page["devices"][1:3]
    assert paged["flagged"] == page["flagged"] and paged["devices_page"]["total"] == len(page["devices"])


def _scenario(st: Any, monkeypatch: Any) -> dict[str, Any]:
    """The steps above; returns the last report (the test checks it shows what the steps did)."""
    pa = params("a", kind="cs", d=2, w=16, mechanism="dlap", budget="1/2")
    for k in range(10):
        if k != 4:  # window 4 and seq 4 missing
            assert _put(st, pa, k, H + k, late=20000.0 if k == 7 else 5.0, nz=3 if k == 2 else 2) == "stored"
    assert _put(st, pa, 2, H + 2, nz=3) == "duplicate"  # the same bytes again
    assert _put(st, pa, 3, H + 3, fill=9) == "rejected"  # same key, other bytes: a conflict, logged with its seq
    _same(st, monkeypatch)
    pb = params("b", kind="cms", d=2, w=16)  # dgauss: rho
    for k in range(6):
        assert _put(st, pb, k, H + k) == "stored"
    for k, q in ((6, 2), (7, 3)):  # a device reset: seqs 2 and 3 again
        assert _put(st, pb, q, H + k) == "stored"
    assert _put(st, pb, 10 ** 6, H + 8) == "quarantined"  # a seq jump
    pk = params("k", kind="cms", d=2, w=16, mode="keep", window_s=3600, epoch_s=600)
    e0 = T0 // 600
    seq = 0
    for lo, hi in [(0, 1), (1, 2), (2, 5), (7, 8), (12, 13)]:
        assert _put(st, pk, seq, e0 + lo, ehi=e0 + hi, late=400.0 if lo == 7 else 1.0) == "stored"
        seq += 1
    pc = params("c", kind="cs", d=2, w=16, mechanism="dlap", budget="1")
    for k in range(3):
        assert _put(st, pc, k, H + 20 + k) == "stored"
    pe, pf = params("e", kind="cms", d=2, w=16), params("f", kind="cms", d=2, w=16)
    for k in (0, 1, 3):  # e: seq 2 lost, 4 and 5 pending by its status below; f: a status claiming too much
        assert _put(st, pe, k, H + k) == "stored"
        assert _put(st, pf, k, H + k) == "stored"
    st.put_status("e", {"state": "online", "next_seq": 6, "oldest_pending": 4, "pending": 2, "ts": 1}, T0)
    st.put_status("f", {"state": "online", "next_seq": 10 ** 9, "ts": 1}, T0)
    raw = encoded(params("q"), seq=3)  # refused by validation (as the aggregator passes it on): its seq is known
    st.commit_group([Pending(raw, topic("q"), T0, rel=decode(raw), rej=Rejected("window", "too old"), device="q")])
    st.put_status("a", {"state": "online", "next_seq": 12, "oldest_pending": 11, "pending": 1, "ts": 1}, T0)
    st.put_status("b", {"state": "online", "next_seq": 9, "ts": 1}, T0)
    _same(st, monkeypatch)
    assert exclusions.set_excluded(st, "b", True, "test")
    _same(st, monkeypatch)
    exclusions.purge(st, "a", since=(H + 8) * 3600)  # seqs 8, 9
    _same(st, monkeypatch)
    exclusions.purge(st, "c")  # all of it
    _same(st, monkeypatch)
    assert st.prune(before=NOW + 10 ** 6) > 0  # payloads of every device but the excluded one
    assert _put(st, pa, 10, H + 10) == "stored"  # and on after them
    _same(st, monkeypatch)
    assert exclusions.set_excluded(st, "b", False)
    _same(st, monkeypatch)
    return status_mod.report(st, now=NOW)


def _kept_equals_rebuilt(st: Any) -> None:
    for s in summary.read_devices(st).values():  # the document's object form (field names) reads the same
        assert summary.DeviceSummary.load(json.dumps({k: getattr(s, k) for k in s.__slots__})).doc() == s.doc()
    docs = {d: s.doc() for d, s in summary.read_devices(st).items()}
    wins = sorted(summary.read_windows(summary.read_devices(st)))
    st._exec_tx(lambda cur: summary.rebuild(st, cur))
    assert {d: s.doc() for d, s in summary.read_devices(st).items()} == docs
    assert sorted(summary.read_windows(summary.read_devices(st))) == wins


def _check_report(rep: dict[str, Any]) -> None:
    by = {d["device"]: d for d in rep["devices"]}
    assert sorted(by) == ["a", "b", "e", "f", "k", "q"]  # c purged; q known by its refusal alone
    assert by["e"]["lost_seqs"] == [2] and by["e"]["pending_seqs"] == [4, 5] and by["f"]["status_ignored"]
    a, b, k = by["a"], by["b"], by["k"]
    assert a["stored_count"] == 8 and a["seq"] == [0, 10] and a["rejected_count"] == 0  # 3 is stored
    assert a["lost_seqs"] == [4, 8, 9] and a["pending_seqs"] == [11]  # 8, 9 purged; 11 from oldest_pending on
    assert a["late_seqs"] == [7] and a["missing_epoch_count"] == 3 and a["noise_draws_max"] == 3
    assert by["q"]["releases"] == 0 and by["q"]["rejected_seqs"] == [3]
    assert b["seq_reused"] == [2, 3] and b["quarantined_seqs"] == [10 ** 6] and b["releases"] == 8
    assert k["missing_epochs"][0]["epochs"] == 2 and k["late_count"] == 0  # 400 s < max(600, 300)
    assert "rho" in b["guarantee"] and "eps" in a["guarantee"]
    assert rep["releases"] == 8 + 8 + 5 + 3 + 3


def test_kept_summaries_sqlite(tmp_path: Any, monkeypatch: Any) -> None:
    st = Store(str(tmp_path / "s.db"))
    rep = _scenario(st, monkeypatch)
    _kept_equals_rebuilt(st)
    st.close()
    _check_report(rep)


def test_writer_shards_merge_to_one_writers_summary(tmp_path: Any, monkeypatch: Any) -> None:
    """Aggregators sharing a PostgreSQL store each keep their own document of a device (no row lock between
    them); merged on read, the documents equal one writer's, and status equals the full read throughout.
    Three writers' shards in turn, one commit each, on SQLite (summary._shard is the only difference)."""
    st = Store(str(tmp_path / "s.db"))
    turn = [0]
    monkeypatch.setattr(summary, "_shard", lambda store: turn[0] % 3)
    commit = st.commit_group

    def commit_in_turn(items: Any, *a: Any, **k: Any) -> Any:
        turn[0] += 1
        return commit(items, *a, **k)

    monkeypatch.setattr(st, "commit_group", commit_in_turn)
    rep = _scenario(st, monkeypatch)
    per_dev = dict(st._q("SELECT device, COUNT(*) FROM device_summaries GROUP BY device"))
    assert per_dev == {"a": 2, "b": 3, "e": 3, "f": 3, "k": 3}  # a: one document since its purge, then one more commit
    _kept_equals_rebuilt(st)
    st.close()
    _check_report(rep)


FORMAT_1_TABLES = """CREATE TABLE device_summary (device TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE window_summary (win_s INTEGER NOT NULL, win INTEGER NOT NULL, shard INTEGER NOT NULL, doc TEXT NOT NULL,
                             PRIMARY KEY (win_s, win, shard));"""
FORMAT_1 = "DROP TABLE device_summaries;\n" + FORMAT_1_TABLES + "\nUPDATE meta SET value = '1' WHERE key = 'summaries';"


@pytest.mark.parametrize("old", ["none", "format 1"])
def test_old_store_falls_back_then_gets_its_summaries(tmp_path: Any, monkeypatch: Any, caplog: Any, old: str) -> None:
    """A store written before the summaries, or with their first form (one document per device and a
    window table): read-only, status reads every release (and says so); the first open for writing builds
    them (the old tables dropped), and the answers stay the same."""
    db = str(tmp_path / "old.db")
    st = Store(db)
    _scenario(st, monkeypatch)
    want = json.dumps(status_mod.report(st, now=NOW))
    st.close()
    con = sqlite3.connect(db)
    con.executescript(FORMAT_1 if old == "format 1" else
                      "DROP TABLE device_summaries; DELETE FROM meta WHERE key = 'summaries';")
    con.close()
    ro = Store(db, readonly=True)
    with caplog.at_level(logging.WARNING, logger="pansketch.status"):
        assert json.dumps(status_mod.report(ro, now=NOW)) == want
    assert "keeps no per-device summaries" in caplog.text
    ro.close()
    Store(db).close()
    ro = Store(db, readonly=True)
    assert summary.present(ro)
    assert json.dumps(status_mod.report(ro, now=NOW)) == want
    tables = {r[0] for r in ro._q("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "device_summaries" in tables and not tables & {"device_summary", "window_summary"}
    ro.close()
    # an aggregator of format 1 opens it again (its tables back, releases stored there only): readers fall
    # back to every release, and the next writer of this version builds the summaries again
    con = sqlite3.connect(db)
    con.executescript(FORMAT_1_TABLES)
    con.close()
    ro = Store(db, readonly=True)
    assert not summary.present(ro)
    ro.close()
    Store(db).close()
    ro = Store(db, readonly=True)
    assert summary.present(ro) and json.dumps(status_mod.report(ro, now=NOW)) == want
    ro.close()


@pytest.fixture(scope="module")
def pg_server() -> Iterator[Any]:
    yield from pgsupport.server()


@pytest.fixture
def pg_store(pg_server: Any) -> Iterator[Callable[[], Any]]:
    from pansketch.host_tools.store.pg import PgStore

    dsn = pg_server.create_database("kept")
    st = PgStore(dsn)
    yield lambda: st
    st.close()


def test_kept_summaries_postgresql(pg_store: Callable[[], Any], monkeypatch: Any) -> None:
    st = pg_store()
    rep = _scenario(st, monkeypatch)
    _kept_equals_rebuilt(st)
    _check_report(rep)


def test_format_1_store_upgraded_on_postgresql(pg_server: Any, monkeypatch: Any) -> None:
    """A PostgreSQL store with the summaries' first form: the next writer's setup (a new version's) drops
    the old tables and builds the per-shard documents; status stays the same and reads them."""
    from pansketch.host_tools.store.pg import PgStore

    dsn = pg_server.create_database("kept_v1")
    st = PgStore(dsn)
    _scenario(st, monkeypatch)
    want = json.dumps(status_mod.report(st, now=NOW))
    ddl = FORMAT_1.replace("INTEGER", "BIGINT") + "\nUPDATE meta SET value = 'an older version' WHERE key = 'pg_setup';"
    st._exec_tx(lambda cur: [cur.execute(x) for x in ddl.split(";") if x.strip()])
    assert not summary.present(st)
    st.close()
    st = PgStore(dsn)
    assert summary.present(st)
    assert json.dumps(status_mod.report(st, now=NOW)) == want
    tables = {r[0] for r in st._q("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")}
    assert "device_summaries" in tables and not tables & {"device_summary", "window_summary"}
    st.close()
