"""Flags kept in the store (schema ``flag_windows`` / ``flags``; pansketch.host_tools.query.influence.refresh):
computed once per change of a window, read by status, metrics and the dashboard, and identical to the flags
computed from the payloads; an older store upgraded in place; SQLite and PostgreSQL.

A small cs fleet (3 honest devices and mal-1 planting an item inside the bound) and a dbits fleet
(3 honest devices and mal-1.dbits with a crafted shape), 3 windows, stored through the aggregator.
"""

from __future__ import annotations

import sqlite3
from typing import Any, Iterator

import numpy as np
import pytest

from pansketch.host_tools import hostconfig
from pansketch.host_tools.ingest.aggregator import Aggregator
from pansketch.host_tools.query import influence
from pansketch.host_tools.store import exclusions
from pansketch.host_tools.store.backend import open_store
from tests.support.host import SALT, T0, topic
from tests.support.csfleet import _device, _forged, _zipf
from tests.support.dbitsfleet import _crafted
from tests.support.dbitsfleet import _device as _dbits_device
from tests.support import pg as pgsupport

@pytest.fixture(scope="module")
def fleet(tmp_path_factory: Any) -> dict[str, list[bytes]]:
    root = str(tmp_path_factory.mktemp("flagstore"))
    out = {"h-%d" % i: _device("h-%d" % i, root, [_zipf(5000, 1.1, 50 * i + k) for k in range(3)], w=512)
           for i in range(3)}
    base = _device("mal-1", root, [_zipf(5000, 1.1, 999 + k) for k in range(3)], w=512)
    out["mal-1"] = [_forged(base[0], lambda c: c + np.where(np.arange(512) == 11, 3000, 0))] + base[1:]
    for i in range(3):
        out["d-%d" % i] = _dbits_device("d-%d" % i, root, [300] * 3)
    db = _dbits_device("mal-1.dbits", root, [300] * 3)

    def deep(c: np.ndarray) -> np.ndarray:
        c[9:] = 190
        return c

    out["mal-1.dbits"] = [db[0], _crafted(db[1], deep), db[2]]
    return out


def _fill(db: str, rels: dict[str, list[bytes]], skip_last: bool = False) -> None:
    agg = Aggregator(hostconfig.from_dict({"fleet": {"salt": SALT}, "aggregator": {"db": db}}))
    try:
        for dev, rs in rels.items():
            for raw in rs[:-1] if skip_last and dev == "h-0" else rs:
                assert agg.handle(topic(dev), raw, received=T0 + 86400).stored
    finally:
        agg.close()


def _docs(flags: list[Any]) -> list[str]:
    return [influence._flag_doc(f) for f in flags]


def _check(db: str, fleet: dict[str, list[bytes]], monkeypatch: Any) -> None:
    _fill(db, fleet, skip_last=True)
    with open_store(db, readonly=True) as st:
        live = _docs(influence.recent_flags(st))
    assert any('"mal-1"' in d for d in live) and any('"mal-1.dbits"' in d for d in live), live
    with open_store(db) as st:
        assert influence.refresh(st) == 3  # every window, once
        assert influence.refresh(st) == 0  # nothing changed
    calls: list[tuple[int, int]] = []
    real = influence.window_flags

    def counting(store: Any, ws: int, w: int, *a: Any, **k: Any) -> Any:
        calls.append((ws, w))
        return real(store, ws, w, *a, **k)

    monkeypatch.setattr(influence, "window_flags", counting)
    with open_store(db, readonly=True) as st:
        assert _docs(influence.recent_flags(st)) == live  # read from the store, identical
        wins = sorted({(r.win_s, r.win) for r in st.releases()})
    assert calls == []  # no payload read
    # a late release: its window alone is computed from the payloads until the next refresh
    agg = Aggregator(hostconfig.from_dict({"fleet": {"salt": SALT}, "aggregator": {"db": db}}))
    try:
        assert agg.handle(topic("h-0"), fleet["h-0"][-1], received=T0 + 86400).stored
    finally:
        agg.close()
    with open_store(db, readonly=True) as st:
        after = _docs(influence.recent_flags(st))
    assert calls == [wins[-1]], calls
    calls.clear()
    with open_store(db) as st:
        assert influence.refresh(st) == 1
        assert _docs(influence.recent_flags(st)) == after
        assert calls == [wins[-1]]  # the refresh's own computation, then the read from the store
        calls.clear()
        # an exclusion changes the setting: live until the next refresh, and the same as computed
        exclusions.set_excluded(st, "mal-1", True, "test")
        assert "mal-1" not in {f.device for f in influence.recent_flags(st)}
        assert len(calls) == 3
        assert influence.refresh(st) == 3
        exclusions.set_excluded(st, "mal-1", False)
        assert influence.refresh(st) == 3
        calls.clear()
        assert _docs(influence.recent_flags(st)) == after and calls == []
        # a purge: its windows change (and an emptied window is no window)
        exclusions.purge(st, "mal-1.dbits")
        got = _docs(influence.recent_flags(st))
        assert not any('"mal-1.dbits"' in d for d in got) and len(calls) == 3
        assert influence.refresh(st) == 3
        calls.clear()
        assert _docs(influence.recent_flags(st)) == got and calls == []


def test_kept_flags_are_the_computed_ones_sqlite(fleet, tmp_path, monkeypatch):
    _check(str(tmp_path / "f.db"), fleet, monkeypatch)


@pytest.fixture(scope="module")
def pg() -> Iterator[Any]:
    yield from pgsupport.server()


def test_kept_flags_are_the_computed_ones_postgresql(fleet, pg, monkeypatch):
    _check(pg.create_database("flagstore"), fleet, monkeypatch)


def test_an_older_store_is_upgraded_in_place(fleet, tmp_path):
    db = str(tmp_path / "old.db")
    _fill(db, fleet)
    with open_store(db, readonly=True) as st:
        want = _docs(influence.recent_flags(st))
    con = sqlite3.connect(db)  # as written before flags were kept
    con.executescript("DROP TABLE flags; DROP TABLE flag_windows; DELETE FROM meta WHERE key = 'flag_windows';")
    con.close()
    with open_store(db, readonly=True) as st:  # read-only: computed from the payloads, as before
        assert not influence.has_stored(st)
        assert _docs(influence.recent_flags(st)) == want
    with open_store(db) as st:  # a writer's open: the windows filled in, flags to compute
        assert influence.has_stored(st)
        assert influence.refresh(st, cpu_budget_s=0.0) == 1  # within a budget: the newest window first
        fresh = st._q("SELECT win FROM flag_windows WHERE done = gen")
        assert [int(w) for (w,) in fresh] == [max(int(w) for (w,) in st._q("SELECT win FROM flag_windows"))]
        assert influence.refresh(st) == 2
    with open_store(db, readonly=True) as st:
        assert _docs(influence.recent_flags(st)) == want


def test_status_reads_the_kept_flags(fleet, tmp_path, monkeypatch):
    import contextlib
    import io
    import json

    from pansketch.host_tools import cli

    db = str(tmp_path / "s.db")
    _fill(db, fleet)
    conf = str(tmp_path / "h.toml")
    with open(conf, "w") as f:
        f.write('[fleet]\nsalt = "%s"\n[aggregator]\ndb = "%s"\n' % (SALT, db))

    def status() -> Any:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert cli.main(["status", "--config", conf, "--json"]) == 0
        rep = json.loads(buf.getvalue())
        return rep["flags"], rep["flag_count"], [(d["device"], d["flagged_windows"]) for d in rep["devices"]]

    before = status()
    from pansketch.host_tools import metrics

    sc = metrics.FlagScanner(db, __import__("logging").getLogger("test.flagstore"), windows=3,
                             max_events=hostconfig.from_dict({"fleet": {"salt": SALT}}).fleet.max_events)
    sc.scan()  # the aggregator's scanner keeps them
    monkeypatch.setattr(influence, "window_flags", lambda *a, **k: pytest.fail("payloads read"))
    assert status() == before
    assert before[1] >= 2


def test_compare_is_bounded_when_most_devices_are_out_of_line():
    """200 devices of random counters (every one out of line): all flagged, in at most
    GREEDY_STEPS + BATCH_PASSES + 1 comparisons of the fleet plus one per device set aside (one at a
    time it was ~200 comparisons of the fleet)."""
    from pansketch.host_tools.query.merge import NoiseTerm

    rng = np.random.default_rng(3)
    terms = [NoiseTerm("dgauss", 2, 1, 2)]
    devs = {"d-%03d" % i: (rng.integers(-60, 60, (4, 256)).astype(np.int64), terms) for i in range(200)}
    sizes: list[int] = []
    real = influence._judge

    def judge(devices: Any, *a: Any, **k: Any) -> Any:
        if k.get("only") is None:
            sizes.append(len(devices))
        return real(devices, *a, **k)

    influence._judge = judge  # type: ignore[assignment]
    try:
        flags = influence.compare(devs, 4)
    finally:
        influence._judge = real  # type: ignore[assignment]
    assert len(flags) == 200
    assert len(sizes) <= influence.GREEDY_STEPS + influence.BATCH_PASSES + 1, sizes


def test_query_note_reads_the_kept_flags(fleet, tmp_path, monkeypatch, capsys):
    """The query CLI's flagged-devices note reads the flags the scanner kept with [fleet]'s limits (a
    limit other than the default: the note must ask with the same setting), and says the same."""
    from pansketch.host_tools import cli, metrics

    db = str(tmp_path / "q.db")
    _fill(db, fleet)
    conf = str(tmp_path / "h.toml")
    with open(conf, "w") as f:
        f.write('[fleet]\nsalt = "%s"\nmax_events_per_window = 40000\n[aggregator]\ndb = "%s"\n' % (SALT, db))

    def note() -> str:
        assert cli.main(["query", "--config", conf, "freq", "item-1", "--device", "h-0"]) == 0
        return [ln for ln in capsys.readouterr().err.splitlines() if "flagged device-window" in ln][0]

    before = note()
    assert "mal-1" in before
    limits = hostconfig.load(conf).fleet.max_events
    metrics.FlagScanner(db, __import__("logging").getLogger("test.flagstore"), windows=3, max_events=limits).scan()
    monkeypatch.setattr(influence, "window_flags", lambda *a, **k: pytest.fail("payloads read"))
    assert note() == before
