"""Per-window roll-ups and group commit: answers equal with and without roll-ups.

The fleet: real releases from pansketch.agent.recorder (window mode hourly, keep mode
with 10-minute epochs, releases with nz > 2 from persists, a second merge
group), stored through the Aggregator. Every selection is answered twice,
from roll-ups and from the raw releases, and the merged sketch (counters,
noise terms, devices, windows, extent) and the answers must be identical:
the roll-ups carry exactly the noise bookkeeping the intervals need.
"""

from __future__ import annotations

import sqlite3
from typing import Any

import numpy as np
import pytest

from pansketch.host_tools.query import core as query
from pansketch.host_tools.ingest.acks import group_acks
from pansketch.host_tools.ingest.aggregator import Aggregator, Outcome
from pansketch.host_tools.ingest.decode import decode
from pansketch.host_tools.store.rows import Pending
from pansketch.host_tools.store.sqlite import Store
from pansketch.host_tools.store.backend import open_store
from tests.support.host import SALT, T0, encoded, host_cfg, params, topic
from tests.support.host_rollups import _fill


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: Any) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("rollups")
    cfg = host_cfg(tmp)
    agg = Aggregator(cfg)
    _fill(agg, tmp)
    agg.close()
    return {"db": cfg.aggregator.db, "tmp": tmp}


def _same(st: Any, **sel: Any) -> None:
    a, sa = query.select_merged(st, salt=SALT, use_rollups=True, **sel)
    b, sb = query.select_merged(st, salt=SALT, use_rollups=False, **sel)
    assert np.array_equal(a.counters, b.counters) and a.counters.dtype == b.counters.dtype
    assert (a.kind, a.d, a.w, a.hv, a.salt) == (b.kind, b.d, b.w, b.hv, b.salt)
    assert a.noise == b.noise and a.noise_var == b.noise_var  # the merged-noise rule is unchanged
    assert (a.releases, a.devices, a.t0, a.t1, a.windows) == (b.releases, b.devices, b.t0, b.t1, b.windows)
    assert sa.partial == sb.partial
    items = ["item-%d" % i for i in range(40)]
    fa = [x.to_dict() for x in query.freq(st, items, salt=SALT, use_rollups=True, **sel)]
    fb = [x.to_dict() for x in query.freq(st, items, salt=SALT, use_rollups=False, **sel)]
    assert fa == fb
    ta = [x.to_dict() for x in query.topk(st, items, 5, salt=SALT, use_rollups=True, **sel)]
    tb = [x.to_dict() for x in query.topk(st, items, 5, salt=SALT, use_rollups=False, **sel)]
    assert ta == tb


SELECTIONS = [
    {},
    {"window": T0 // 3600},
    {"window": T0 // 3600 + 2},
    {"since": T0, "until": T0 + 4 * 3600},
    {"since": T0 + 3600, "until": T0 + 3 * 3600},
    {"since": T0 + 1200, "until": T0 + 2 * 3600 + 600},  # boundaries inside windows: keep epochs split
    {"since": T0 + 1800},
    {"since": T0 + 3 * 3600, "until": T0 + 3 * 3600 + 1800},  # inside the window of the spanning release
    {"since": T0 + 3 * 3600 + 600},
    {"until": T0 + 5400},
]


@pytest.mark.parametrize("sel", SELECTIONS)
def test_rollup_answers_equal_raw_answers(fleet, sel):
    st = Store(fleet["db"], readonly=True)
    assert st.has_rollups
    _same(st, **sel)
    st.close()


def test_rollups_hold_every_window_and_group(fleet):
    st = Store(fleet["db"], readonly=True)
    infos = st.rollups()
    assert {(i.win_s, i.win) for i in infos} == {(3600, T0 // 3600 + k) for k in range(4)}
    assert sum(i.releases for i in infos) == st.release_count()
    one = st.rollups(window=T0 // 3600)
    assert st.rollup_devices([i.id for i in one]) == {"r0", "r1", "r2", "r3", "keep1"}
    st.close()


def test_device_queries_use_raw_releases(fleet):
    st = Store(fleet["db"], readonly=True)
    m, _ = query.select_merged(st, device="r1", salt=SALT)
    assert m.devices == ["r1"] and m.releases == 4
    rels = st.releases(devices=["r1"], with_payload=True)
    assert np.array_equal(m.counters, sum(r.counters().astype(np.int64) for r in rels))
    st.close()


def test_several_groups_fall_back_to_the_raw_error(tmp_path):
    a = Aggregator(host_cfg(tmp_path))
    assert a.handle(topic("small"), encoded(params("small", w=64), fill=1)).stored
    assert a.handle(topic("big"), encoded(params("big", w=128), fill=1)).stored
    with pytest.raises(query.QueryError, match="different sketch parameters"):
        query.select_merged(a.store, salt=SALT)
    m, _ = query.select_merged(a.store, salt=SALT, device="big")
    assert m.w == 128
    a.close()


def test_old_database_gets_rollups_rebuilt(fleet, tmp_path):
    import shutil

    db = str(tmp_path / "old.db")
    shutil.copy(fleet["db"], db)
    for ext in ("-wal", "-shm"):
        try:
            shutil.copy(fleet["db"] + ext, db + ext)
        except FileNotFoundError:
            pass
    con = sqlite3.connect(db)
    con.execute("DROP TABLE rollups")
    con.execute("DROP TABLE rollup_noise")
    con.execute("DROP TABLE rollup_devices")
    con.execute("DELETE FROM meta WHERE key = 'rollups'")
    con.commit()
    con.close()
    ro = Store(db, readonly=True)
    assert not ro.has_rollups  # read-only readers merge raw releases and change nothing
    raw, _ = query.select_merged(ro, salt=SALT)
    ro.close()
    Store(db).close()  # an aggregator's open rebuilds them
    st = Store(db, readonly=True)
    assert st.has_rollups
    m, _ = query.select_merged(st, salt=SALT)
    assert np.array_equal(m.counters, raw.counters) and m.noise == raw.noise and m.devices == raw.devices
    _same(st, since=T0 + 1200, until=T0 + 2 * 3600 + 600)
    st.close()


def test_group_commit_rolls_back_one_bad_release_alone(tmp_path):
    db = str(tmp_path / "g.db")
    a = Aggregator(host_cfg(tmp_path, aggregator={"db": db}))
    p = params("g", w=16)
    e = T0 // 3600
    assert a.handle(topic("g"), encoded(p, seq=0, elo=e, fill=1)).stored
    # a database error on one row only: a trigger refuses device 'boom'
    a.store.db.execute("CREATE TRIGGER boom BEFORE INSERT ON releases WHEN NEW.device = 'boom' "
                       "BEGIN SELECT RAISE(ABORT, 'boom refused'); END")
    msgs = [
        (topic("g"), encoded(p, seq=1, elo=e + 1, fill=2)),  # stored
        (topic("g"), encoded(p, seq=9, elo=e, fill=5)),  # conflict: same key, other bytes
        (topic("boom"), encoded(params("boom", w=16), seq=0, elo=e, fill=3)),  # database error
        (topic("g"), b"\xa1\x61v\x02"),  # invalid
        (topic("g"), encoded(p, seq=0, elo=e, fill=1)),  # duplicate
        (topic("g"), encoded(p, seq=2, elo=e + 2, fill=4)),  # stored
    ]
    items = [a.validate(t, pl) for t, pl in msgs]
    a.store.commit_group(items)
    assert [x.status for x in items] == ["stored", "rejected", "error", "rejected", "duplicate", "stored"]
    assert items[1].rej is not None and items[1].rej.code == "conflict"
    assert "boom refused" in str(items[2].error)
    st = Store(db, readonly=True)
    assert st.release_count() == 3 and st.rejection_count() == 2 and st.duplicate_count() == 1
    assert [d[0] for d in st.devices()] == ["g"]  # the failed message's device row was rolled back too
    m, _ = query.select_merged(st, salt=SALT)
    assert m.releases == 3 and int(m.counters[0, 0]) == 1 + 2 + 4  # roll-ups count the stored ones only
    _same(st)
    st.close()
    a.close()


def test_group_acks_one_message_per_device():
    outs = [
        ("pansketch/a/release", Outcome("stored", device="a", seq=1)),
        ("pansketch/b/release", Outcome("duplicate", device="b", seq=7)),
        ("pansketch/a/release", Outcome("rejected", "x", "conflict", "a", None, 2)),
        ("pansketch/a/release", Outcome("stored", device="a", seq=3)),
        ("pansketch/a/release", Outcome("rejected", "bug", "internal", "a", None, 4)),  # not acknowledged
    ]
    assert group_acks(outs) == [("pansketch/a/ack", b'{"dev":"a","ok":[1,3],"bad":[[2,"conflict"]]}'),
                                ("pansketch/b/ack", b'{"dev":"b","ok":[7]}')]


def test_open_store_picks_the_backend(tmp_path):
    st = open_store(str(tmp_path / "x.db"))
    assert isinstance(st, Store)
    st.close()
    rel = decode(encoded(params(w=16)))
    st = open_store(str(tmp_path / "x.db"))
    p = Pending(rel.payload, None, 0.0, rel=rel)
    st.commit_group([p])
    assert p.status == "stored"
    st.close()


def test_fleet_exercises_keep_epochs_and_straddling(fleet):
    st = Store(fleet["db"], readonly=True)
    keep = st.releases(devices=["keep1"])
    assert len(keep) == 21 and len({r.win for r in keep}) == 4  # several epoch releases per window
    assert max(r.t1 for r in keep) == T0 + 4 * 3600  # the last one spans into the next window
    assert max(r.nz for r in st.releases()) > 2
    _m, sel = query.select_merged(st, salt=SALT, since=T0 + 1500, until=T0 + 2 * 3600 + 600)
    assert sel.partial > 0
    st.close()


def test_queries_read_one_snapshot_while_an_aggregator_commits(tmp_path):
    a = Aggregator(host_cfg(tmp_path))
    p = params("snap", w=16)
    assert a.handle(topic("snap"), encoded(p, seq=0, fill=1)).stored
    st = Store(a.store.path, readonly=True)
    with st.read_tx():
        before = (st.release_count(), [i.releases for i in st.rollups()])
        assert a.handle(topic("snap"), encoded(p, seq=1, elo=T0 // 3600 + 1, fill=2)).stored  # committed meanwhile
        assert (st.release_count(), [i.releases for i in st.rollups()]) == before
    assert st.release_count() == 2
    m, _ = query.select_merged(st, salt=SALT)
    assert m.releases == 2 and int(m.counters[0, 0]) == 3
    st.close()
    a.close()


def _v2(p: Any, seq: int, elo: int, fill: int) -> bytes:
    """A cs/cms release in format v2 (``lvl`` 0: not tree mode), as a v2 device would send it."""
    import array

    from pansketch.agent import cbor, release

    m = release.release_map(p, seq, elo, elo + 1, 0, array.array("i", [fill] * (p.d * p.w)))
    m["v"], m["lvl"] = 2, 0
    m["ctr"] = bytes(m["ctr"])
    return cbor.dumps(m)


def test_v2_window_releases_use_rollups_and_dcs_uses_raw(tmp_path, monkeypatch):
    from tests.support import dcs_host as dcs
    calls: list[int] = []
    real = query._from_rollups

    def spy(store: Any, sel: Any) -> Any:
        calls.append(1)
        return real(store, sel)

    monkeypatch.setattr(query, "_from_rollups", spy)
    db = str(tmp_path / "v2.db")
    with Store(db) as st:
        for dv in range(3):
            p = params("v2-%d" % dv, d=5, w=128)
            for k in range(3):
                rel = decode(_v2(p, k, T0 // 3600 + k, dv + k), topic(p.device))
                assert (rel.v, rel.lvl, rel.mode) == (2, 0, "window")
                assert st.insert(rel) == "stored"
        assert len(st.rollups()) == 3 and sum(i.releases for i in st.rollups()) == 9
        assert not st.has_unrolled()
    with open_store(db, readonly=True) as st:
        for sel in ({}, {"window": T0 // 3600 + 1}, {"since": T0 + 1800, "until": T0 + 3 * 3600}):
            calls.clear()
            _same(st, **sel)
            assert calls, "v2 window releases must be answered from the roll-ups"
    # a dcs fleet: no roll-ups; answers come from the raw releases (and equal with use_rollups either way)
    db2 = str(tmp_path / "dcs.db")
    with Store(db2) as st:
        for dv in range(2):
            p = dcs.params("d-%d" % dv)
            for k in range(2):
                assert st.insert(decode(dcs.payload(p, [1, 2, 3, 40 + dv], seq=k, epoch=dcs.T0 // 3600 + k),
                                        dcs.topic(p.device))) == "stored"
        assert st.rollups() == [] and st.has_unrolled()
    with open_store(db2, readonly=True) as st:
        calls.clear()
        a, _ = query.select_merged(st, salt=dcs.SALT)
        b, _ = query.select_merged(st, salt=dcs.SALT, use_rollups=False)
        assert not calls and a.kind == "dcs" and a.releases == 4
        assert np.array_equal(a.counters, b.counters)
    # cms/cs and dcs in one store: the roll-ups alone would answer from the cs part; the raw path reports the mix
    with Store(db) as st:
        p = dcs.params("d-x", salt=SALT)
        assert st.insert(decode(dcs.payload(p, [5], epoch=T0 // 3600), dcs.topic("d-x"))) == "stored"
        assert st.has_unrolled()
    with open_store(db, readonly=True) as st:
        calls.clear()
        with pytest.raises(query.QueryError):
            query.select_merged(st, salt=SALT)
        assert not calls
