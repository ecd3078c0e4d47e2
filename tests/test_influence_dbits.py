"""Detection within the bound for kind dbits (pansketch.host_tools.query.dbitsflag): false flags on honest
fleets, crafted releases under the bound flagged.

Fleets are the real device core (pansketch.agent.recorders.make: the dbits recorder; deterministic byte
source) stored through the aggregator's validate-and-store path, with ``pansketch demo``'s dbits
parameters (d = 12 levels of w = 256 bits, discrete Laplace, eps = 1). The false-flag rate is measured on

* a demo-like fleet: 6 devices, 150 to 600 distinct badges per device and window (the demo's cycle,
  each device at its own phase), 12 windows;
* a heterogeneous fleet: 10 devices, one of them 20x busier (10,000 distinct items per window against
  500), 8 windows;

and must stay at or under 1 % of the honest device-windows (0 in these runs).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from pansketch.host_tools import hostconfig
from pansketch.host_tools.ingest.aggregator import Aggregator
from pansketch.host_tools.ingest.decode import decode
from pansketch.host_tools.query import dbitsflag, influence
from pansketch.host_tools.store import bounds
from pansketch.host_tools.store.backend import open_store
from tests.support.host import SALT, T0, topic
from tests.support.metrics import scan_twice
from tests.support.dbitsfleet import _params, _device, _crafted  # noqa: F401

DEMO = (150, 300, 450, 600)  # pansketch.host_tools.demo.DBITS_DISTINCT


def _store(tmp: Any, fleet: dict[str, list[bytes]], name: str) -> str:
    db = str(tmp / ("%s.db" % name))
    agg = Aggregator(hostconfig.from_dict({"fleet": {"salt": SALT}, "aggregator": {"db": db}}))
    try:
        for dev, rels in fleet.items():
            for raw in rels:
                assert agg.handle(topic(dev), raw, received=T0 + 86400).stored, dev
    finally:
        agg.close()
    return db


def _flags(db: str) -> tuple[list[Any], int, list[int]]:
    with open_store(db, readonly=True) as st:
        return influence.recent_flags(st), len(st.releases()), sorted({r.win for r in st.releases()})


def test_false_flags_on_a_demo_like_fleet(tmp_path):
    fleet = {"door-%d" % i: _device("door-%d" % i, str(tmp_path), [DEMO[(i + k) % 4] for k in range(12)])
             for i in range(6)}
    flags, n, _w = _flags(_store(tmp_path, fleet, "demo"))
    print("dbits demo-like fleet: %d flag(s) in %d honest device-windows" % (len(flags), n))
    assert n == 72
    assert len(flags) <= 0.01 * n, [f.to_dict() for f in flags]


def test_false_flags_on_a_heterogeneous_fleet_with_a_busy_device(tmp_path):
    fleet = {"het-%d" % i: _device("het-%d" % i, str(tmp_path), [10_000 if i == 0 else 500] * 8) for i in range(10)}
    flags, n, _w = _flags(_store(tmp_path, fleet, "het"))
    print("dbits heterogeneous fleet (one device 20x): %d flag(s) in %d honest device-windows" % (len(flags), n))
    assert n == 80
    assert len(flags) <= 0.01 * n, [f.to_dict() for f in flags]


def test_crafted_releases_under_the_bound_are_flagged(tmp_path):
    """Window 0: the deepest three levels raised to 190 of 256 one-bits (every bucket touched) over an
    honest release of 300 distinct items -- a shape no distinct count gives; window 1: 100,000 really
    recorded distinct items (the contribution limit) against a fleet of 300 each; window 2: honest.
    Each forgery passes the bound (it is stored); each is flagged for that device and window, the
    honest devices and mal's honest window are not."""
    fleet = {"door-%d" % i: _device("door-%d" % i, str(tmp_path), [300] * 3) for i in range(5)}
    base = _device("mal-1", str(tmp_path), [300, 100_000, 300])

    def deep(c: np.ndarray) -> np.ndarray:
        c[9:] = 190
        return c

    fleet["mal-1"] = [_crafted(base[0], deep), base[1], base[2]]
    for raw in fleet["mal-1"]:
        assert bounds.check(decode(raw), bounds.DEFAULT_MAX_EVENTS) is None  # inside the bound
    flags, _n, wins = _flags(_store(tmp_path, fleet, "crafted"))
    got = {(f.device, f.win): f for f in flags}
    assert ("mal-1", wins[0]) in got and ("mal-1", wins[1]) in got, [f.to_dict() for f in flags]
    assert "no number of distinct items explains" in got[("mal-1", wins[0])].reason
    assert "the others' median" in got[("mal-1", wins[1])].reason
    assert ("mal-1", wins[2]) not in got
    assert not [f for f in flags if f.device != "mal-1"], [f.to_dict() for f in flags]


def test_the_limit_test_flags_an_estimate_no_device_at_the_limit_gives():
    """A release whose levels are all at 190 of 256 (every bucket of every level touched: passes the bound,
    a consistent shape for a huge count) is flagged as over the limit even without a fleet to compare."""
    raw = _device("solo", "/tmp/pansketch-dbflag-solo-%d" % os.getpid(), [300])[0]
    rel = decode(_crafted(raw, lambda c: c * 0 + 190))
    assert bounds.check(rel, bounds.DEFAULT_MAX_EVENTS) is None

    class R:  # the stored release's fields dbitsflag reads
        device, d, w, mech, nout, budget = "solo", rel.d, rel.w, rel.mech, rel.nout, rel.budget

        @staticmethod
        def counters() -> np.ndarray:
            return rel.counters()

    fl = dbitsflag.compare({"solo": [R()]}, bounds.DEFAULT_MAX_EVENTS)
    assert len(fl) == 1 and "more than a device with the 100000" in fl[0].reason, [f.to_dict() for f in fl]
    assert dbitsflag.chi2_bound(10, 1e-6) > 10  # and the shape test's threshold is beyond the mean


@pytest.mark.parametrize("k", [1, 9, 12])
def test_chi2_bound_is_a_bound(k):
    scipy_stats = pytest.importorskip("scipy.stats")
    for a in (1e-3, 1e-6, 1e-9):
        x = dbitsflag.chi2_bound(k, a)
        assert scipy_stats.chi2.sf(x, k) <= a
        assert scipy_stats.chi2.sf(x, k) > a / 1000  # and not absurdly loose


def test_dbits_flags_on_the_dashboard_metrics_and_log(tmp_path):
    """The fleet page and the distinct page name the flagged dbits device, /metrics counts its flagged
    window, the aggregator's scanner logs it once (the same places as the other kinds' flags)."""
    from tests.support.dash import Server
    from tests.support.dashboard import get

    fleet = {"door-%d" % i: _device("door-%d" % i, str(tmp_path), [300]) for i in range(4)}
    fleet["mal-1"] = _device("mal-1", str(tmp_path), [100_000])
    db = _store(tmp_path, fleet, "wired")
    conf = str(tmp_path / "host.toml")
    with open(conf, "w") as f:
        f.write('[fleet]\nsalt = "%s"\n[aggregator]\ndb = "%s"\nmax_clock_skew_s = 1e9\n' % (SALT, db))
    lines, _sc = scan_twice(db, "test.dbitsflag")
    assert [x for x in lines if "FLAGGED" in x] and all(x.startswith("device mal-1 FLAGGED") for x in lines
                                                        if "FLAGGED" in x) and len(lines) == 1, lines
    srv = Server(conf)
    try:
        code, page, _h = get(srv.url + "/")
        assert code == 200 and "mal-1" in page and "out of line with the fleet in 1 recent window" in page
        code, page, _h = get(srv.url + "/distinct")
        assert code == 200 and ("the others&#39; median" in page or "the others' median" in page), page[-3000:]
        code, text, _h = get(srv.url + "/metrics")
        assert 'pansketch_device_flagged_windows{device="mal-1"} 1.0' in text, text[-2000:]
        assert not [x for x in text.splitlines() if x.startswith("pansketch_device_flagged_windows{")
                    and "mal-1" not in x]
    finally:
        srv.stop()
