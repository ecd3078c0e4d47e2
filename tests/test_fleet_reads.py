"""Fleet-scale read paths answer exactly as the straightforward ones they replace.

`series`, `status` and the fleet page now read aggregates (per-device extents and window lengths in
SQL, the roll-ups that overlap a bucket, the ledger indexed by device) instead of every release per
bucket or per device. Each is compared here with the plain computation from the full list of
releases, on a real store (window and keep mode, nz > 2, a tree-mode device in a second store),
with and without roll-ups, and with a device excluded.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest

from pansketch.host_tools.ingest.aggregator import Aggregator
from pansketch.host_tools.query import core as query
from pansketch.host_tools.query import fleetview, series as series_mod, status as status_mod
from pansketch.host_tools.store import exclusions, ledger as ledger_mod
from pansketch.host_tools.store.sqlite import Store
from tests.support.host_rollups import _fill
from tests.support.host import SALT, T0, encoded, host_cfg, params, record, topic, zipf_stream

ITEMS = ["item-%d" % i for i in range(6)]


def _build(tmp: Any, tree: bool) -> str:
    cfg = host_cfg(tmp)
    agg = Aggregator(cfg)
    _fill(agg, tmp)
    # a second keep-mode device whose release of epochs [5, 8) crosses the first hour boundary
    pk = params("keep2", d=5, w=128, mode="keep", window_s=3600, epoch_s=600)
    e0, seq = T0 // 600, 0
    for lo, hi in [(k, k + 1) for k in range(5)] + [(5, 8)] + [(k, k + 1) for k in range(8, 24)]:
        assert agg.handle(topic("keep2"), encoded(pk, seq=seq, elo=e0 + lo, ehi=e0 + hi, fill=lo % 5 - 1)).stored
        seq += 1
    if tree:  # tree nodes overlap and are never rolled up: every fleet query takes the raw path
        p = params("tree1", d=5, w=128, mode="tree", levels=3, epoch_s=900)  # horizon 3600 s
        wins = [zipf_stream(300, 300, 1.2, 90 + k) for k in range(3)]
        for raw in record(p, str(tmp / "tree1"), wins):
            agg.handle(topic("tree1"), raw)
    agg.close()
    return str(cfg.aggregator.db)


@pytest.fixture(scope="module", params=["window-keep", "with-tree"])
def db(request: Any, tmp_path_factory: Any) -> str:
    return _build(tmp_path_factory.mktemp(request.param), request.param == "with-tree")


def _stores(db: str) -> list[Store]:
    """The store as is, read without its roll-ups, and with device r1 excluded."""
    a = Store(db, readonly=True)
    b = Store(db, readonly=True)
    b.has_rollups = False
    c = Store(db)
    exclusions.set_excluded(c, "r1", True, "test")
    c.close()
    out = [a, b, Store(db, readonly=True)]
    c = Store(db)
    exclusions.set_excluded(c, "r1", False)
    c.close()
    return out


def _reference(st: Store, step: Optional[int], running: bool, since: Optional[int] = None,
               until: Optional[int] = None) -> series_mod.Series:
    """The series as it was computed before: extents and lengths from every release, one freq per bucket
    and one per running total."""
    devs = query.pick_devices(st, query.POINT_KINDS)
    rels = st.releases(devices=devs)
    natural = 1
    for x in {r.ep_s if r.mode == "tree" else r.win_s for r in rels}:
        natural = natural * x // __import__("math").gcd(natural, x)
    step = natural if step is None else step
    inside = st.releases(devices=devs, since=since, until=until)
    k0 = min(r.t0 for r in inside) // step
    k1 = (max(r.t1 for r in inside) + step - 1) // step
    if since is not None:
        k0 = max(k0, -(-since // step))
    if until is not None:
        k1 = min(k1, until // step)
    bks = [(k * step, (k + 1) * step) for k in range(k0, k1)]
    span: dict[str, tuple[int, int]] = {}
    for r in st.releases(devices=devs, since=bks[0][0], until=bks[-1][1]):
        a, b = span.get(r.device, (r.t0, r.t1))
        span[r.device] = (min(a, r.t0), max(b, r.t1))
    lines = [series_mod.Line(x, None) for x in ITEMS]
    for t0, t1 in bks:
        expected = [d for d in sorted(span) if span[d][0] <= t0 and span[d][1] >= t1]
        run = series_mod.bucket_answers(st, ITEMS, SALT, bks[0][0], t1, devs, 0.95) if running else None
        for i, (ln, p) in enumerate(zip(lines, series_mod.bucket_answers(st, ITEMS, SALT, t0, t1, devs, 0.95))):
            got = set(p.answer.devices) if p.answer is not None else set()
            p.missing_devices = [d for d in expected if d not in got]
            if run is not None:
                p.running = run[i].answer
            ln.points.append(p)
    return series_mod.Series(ITEMS, step, 0.95, devs, False, lines, 0)


def _reference_series(st: Store, step: Optional[int], running: bool) -> dict[str, Any]:
    return _reference(st, step, running).to_dict()


@pytest.mark.parametrize("step,running", [(None, False), (3600, True), (7200, False)])
def test_series_equals_one_freq_per_bucket_over_all_releases(db: str, step: Optional[int], running: bool) -> None:
    for st in _stores(db):
        got = series_mod.series(st, ITEMS, salt=SALT, step=step, running=running).to_dict()
        assert got == _reference_series(st, step, running)
        st.close()


# (step, since, until, whether the running totals are the buckets' prefix sums): keep2's long release lies
# inside a 2 h bucket, straddles the start of a series from the first hour boundary (counted as partial)
# and crosses a 1 h bucket boundary of the whole series (each running total is then its own range query)
RUNNING_CASES = [(7200, None, None, True), (3600, T0 + 3600, T0 + 10800, True), (3600, None, None, False)]


@pytest.mark.parametrize("step,since,until,prefix", RUNNING_CASES)
def test_running_totals_equal_one_range_query_each(db: str, step: int, since: Optional[int], until: Optional[int],
                                                   prefix: bool) -> None:
    for st in _stores(db):
        got = series_mod.series(st, ITEMS, salt=SALT, step=step, since=since, until=until, running=True)
        want = _reference(st, step, True, since, until)
        assert got.to_dict() == want.to_dict()
        # the whole answers, also what to_dict leaves out of a running total (devices, partial count)
        assert [[p.running for p in ln.points] for ln in got.lines] == [[p.running for p in ln.points]
                                                                        for ln in want.lines]
        partial = any(p.running is not None and p.running.partial_excluded for ln in want.lines for p in ln.points)
        assert partial == (since is not None or not prefix)  # a crossing release is partial to some range
        bks, _ = series_mod.buckets(st, step, since, until, query.pick_devices(st, query.POINT_KINDS))
        fast = series_mod._incremental(st, ITEMS, SALT, bks, query.pick_devices(st, query.POINT_KINDS), 0.95, True)
        assert (fast is not None) == (prefix and not st.has_tree())
        st.close()


def test_long_releases_equal_the_release_list(db: str) -> None:
    st = Store(db, readonly=True)
    for a, b in [(T0, T0 + 4 * 3600), (T0 + 3600, T0 + 10800), (T0 + 4000, T0 + 4700)]:
        want = sorted(((r.device, r.t0, r.t1) for r in st.releases() if r.ehi - r.elo > 1 and r.mode != "tree"
                       and r.t0 < b and r.t1 > a), key=lambda x: (x[1], x[0]))
        assert st.long_releases(a, b) == want
        assert st.long_releases(a, b, ["keep2"]) == [x for x in want if x[0] == "keep2"]
    assert [x[0] for x in st.long_releases(T0, T0 + 4 * 3600)] == ["keep2", "keep1"]
    st.close()


def test_store_aggregates_equal_the_release_list(db: str) -> None:
    st = Store(db, readonly=True)
    rels = st.releases()
    assert st.release_lengths() == {r.ep_s if r.mode == "tree" else r.win_s for r in rels}
    for since, until in [(None, None), (T0 + 1800, None), (None, T0 + 7200), (T0 + 600, T0 + 3 * 3600)]:
        want: dict[str, tuple[int, int]] = {}
        for r in st.releases(since=since, until=until):
            a, b = want.get(r.device, (r.t0, r.t1))
            want[r.device] = (min(a, r.t0), max(b, r.t1))
        assert st.release_extents(since=since, until=until) == want
        lo = -float("inf") if since is None else since
        hi = float("inf") if until is None else until
        assert st.rollups(since=since, until=until) == [i for i in st.rollups() if i.t0 < hi and i.t1 > lo]
    assert st.has_tree() == any(r.mode == "tree" for r in rels)
    st.close()


def test_ledger_per_device_lookup_equals_a_full_scan(db: str) -> None:
    st = Store(db, readonly=True)
    led = ledger_mod.build(st.releases())
    for dev in sorted({e.device for e in led.windows}) + ["no-such-device"]:
        g = ledger_mod.Guarantee(delta=led.delta)
        for e in led.windows:
            if e.device == dev:
                g.update(e.guarantee)
        assert led.device(dev) == g
    st.close()


def test_status_and_fleet_page_from_the_kept_summaries_equal_every_release(db: str, monkeypatch: Any) -> None:
    """status and the fleet page read the kept summaries (pansketch.host_tools.store.summary): the same
    JSON, byte for byte, as from every release and its ledger."""
    import json

    for st in _stores(db):
        rep, led = status_mod.report_with_ledger(st, now=T0 + 10 ** 6)
        full, fled = status_mod.report_full(st, now=T0 + 10 ** 6)
        assert json.dumps(rep) == json.dumps(full)
        assert fled.windows == ledger_mod.build(st.releases()).windows
        assert [(ws, wn, n, g.as_dict()) for ws, wn, n, g in led.fleet_windows()] == \
            [(ws, wn, n, g.as_dict()) for ws, wn, n, g in fled.fleet_windows()]
        page = fleetview.fleet(st, now=T0 + 10 ** 6)
        assert [d["device"] for d in page["devices"]] == [d["device"] for d in rep["devices"]]
        with monkeypatch.context() as m:
            m.setattr(status_mod, "report_with_ledger", status_mod.report_full)
            want = fleetview.fleet(st, now=T0 + 10 ** 6)
        assert json.dumps(page) == json.dumps(want)
        st.close()


def test_devices_with_releases_equal_the_release_list(db: str, tmp_path: Any) -> None:
    """The devices table lists exactly the devices holding releases, also after a purge of some or all
    of a device's releases (the pages and the excluded-device paths read it instead of every release)."""
    import shutil

    copy = str(tmp_path / "purge.db")
    shutil.copy(db, copy)
    st = Store(copy)
    assert st.devices_with_releases() == [r[0] for r in st.device_activity()]
    exclusions.purge(st, "r2", since=T0 + 2 * 3600)  # some of its releases
    assert st.devices_with_releases() == [r[0] for r in st.device_activity()]
    exclusions.purge(st, "r3")  # all of them
    assert "r3" not in st.devices_with_releases()
    assert st.devices_with_releases() == [r[0] for r in st.device_activity()]
    st.close()


def test_status_json_pages_its_devices(db: str, tmp_path: Any) -> None:
    """``status --json --limit/--offset``: a slice of the device list in device order, the fleet figures of
    every device, and how many there are; without them the report is the whole one, unchanged."""
    import json
    import subprocess
    import sys

    conf = tmp_path / "h.toml"
    conf.write_text('[fleet]\nsalt = "%s"\n[aggregator]\ndb = "%s"\n' % (SALT, db))

    def run(*extra: str) -> Any:
        out = subprocess.run([sys.executable, "-m", "pansketch.host_tools.cli", "status", "--config", str(conf),
                              *extra], capture_output=True, text=True)
        return out.returncode, out.stdout, out.stderr

    code, full, _ = run("--json")
    assert code == 0
    whole = json.loads(full)
    assert "devices_page" not in whole
    names = [d["device"] for d in whole["devices"]]
    assert len(names) >= 4
    code, part, _ = run("--json", "--limit", "2", "--offset", "1")
    got = json.loads(part)
    assert [d["device"] for d in got["devices"]] == names[1:3]
    assert got["devices"] == whole["devices"][1:3]
    assert got["devices_page"] == {"offset": 1, "limit": 2, "total": len(names)}
    assert got["delivery"] == whole["delivery"] and got["fleet"]["guarantee"] == whole["fleet"]["guarantee"]
    code, _out, err = run("--limit", "2")
    assert code == 2 and "--json or --csv" in err
    code, _out, err = run("--json", "--offset", "-1")
    assert code == 2


@pytest.mark.parametrize("since,until,limit", [(None, None, 10**6), (None, None, 2), (T0 + 3600, None, 10**6),
                                               (None, T0 + 10800, 10**6)])
def test_series_reads_the_extents_once_when_its_buckets_hold_every_release(db: str, since: Optional[int],
                                                                           until: Optional[int], limit: int,
                                                                           monkeypatch: Any) -> None:
    """The extents inside the buckets are those of the whole selection when no range or bucket limit cuts
    it: read once then; each point's missing devices are those of the extents inside the buckets."""
    for st in _stores(db):
        calls: list[Any] = []
        real = st.release_extents

        def counting(*a: Any, **k: Any) -> Any:
            calls.append(a)
            return real(*a, **k)

        monkeypatch.setattr(st, "release_extents", counting)
        got = series_mod.series(st, ITEMS, salt=SALT, step=3600, since=since, until=until, limit=limit, running=True)
        # at most the old count: the scan is skipped where the roll-ups show every bucket holds every device
        # (tests/test_fleet_reads.py::test_series_of_a_full_fleet_reads_no_release_rows)
        assert len(calls) <= (1 if since is None and until is None and limit > 2 else 2)
        devs = query.pick_devices(st, query.POINT_KINDS)
        bks, cut = series_mod.buckets(st, 3600, since, until, devs, limit)
        assert bool(cut) == (limit == 2)
        span = real(devs, bks[0][0], bks[-1][1])
        for ln in got.lines:
            for p, (t0, t1) in zip(ln.points, bks):
                have = set(p.answer.devices) if p.answer is not None else set()
                assert p.missing_devices == [d for d in sorted(span) if span[d][0] <= t0 and span[d][1] >= t1
                                             and d not in have]
        if since is None and until is None and limit > 2:
            assert got.to_dict() == _reference_series(st, 3600, True)
        st.close()


def test_read_only_opens_map_the_file(db: str) -> None:
    """Readers map the file (the scans of every release row then copy no pages); the writer does not.
    The answers above are read through such opens."""
    from pansketch.host_tools.store import sqlite as sqlite_store

    r, w = Store(db, readonly=True), Store(db)
    try:
        assert r.db.execute("PRAGMA mmap_size").fetchone()[0] == sqlite_store.READ_MMAP_BYTES
        assert w.db.execute("PRAGMA mmap_size").fetchone()[0] == 0
        assert r.release_extents() == w.release_extents()
    finally:
        r.close()
        w.close()


def test_running_merge_of_buckets_of_the_same_devices(db: str, monkeypatch: Any) -> None:
    """The running totals' merges of buckets of the same devices (no set union) equal one range query each."""
    seen: set[bool] = set()
    real = series_mod._add

    def add(x: Any, y: Any) -> Any:
        seen.add(x.devices == y.devices)
        return real(x, y)

    monkeypatch.setattr(series_mod, "_add", add)
    tree = False
    for st in _stores(db):
        got = series_mod.series(st, ITEMS, salt=SALT, step=7200, running=True).to_dict()
        assert got == _reference_series(st, 7200, True)
        tree = st.has_tree()
        st.close()
    # (the store with tree nodes has no prefix sums: each running total is its own range query)
    assert seen == (set() if tree else {True})
