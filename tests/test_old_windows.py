"""Releases for windows long past (a clock at 1970 or 2000, a forgery) are quarantined, not stored as "late".

The real aggregator core and store (SQLite): a device's releases for windows in 1970, 2000 and ten
years ago are held back with code ``past`` and shown by ``status`` as quarantined (no missing epochs
reaching back to 1970); one from last year is stored (late); ``max_past_s = 0`` lifts the bound.
"""

from __future__ import annotations

import io
import time

from pansketch.host_tools.ingest.aggregator import Aggregator
from pansketch.host_tools.query import status
from tests.support.host import encoded, host_cfg, params, topic

NOW = (int(time.time()) // 3600) * 3600
YEAR_H = 365 * 24


def _windows():
    return {"1970": 5, "2000": 946684800 // 3600, "ten years ago": NOW // 3600 - 10 * YEAR_H,
            "last year": NOW // 3600 - YEAR_H, "an hour ago": NOW // 3600 - 2}


def test_old_windows_are_quarantined_and_shown(tmp_path):
    a = Aggregator(host_cfg(tmp_path))
    p = params("pi-old")
    got = {}
    for seq, (name, elo) in enumerate(sorted(_windows().items(), key=lambda kv: kv[1])):
        got[name] = a.handle(topic("pi-old"), encoded(p, seq=seq, elo=elo), received=NOW)
    assert {k: o.status for k, o in got.items()} == {"1970": "quarantined", "2000": "quarantined",
                                                     "ten years ago": "quarantined", "last year": "stored",
                                                     "an hour ago": "stored"}, got
    assert all(o.code == "past" for k, o in got.items() if o.status == "quarantined")
    rep = status.report(a.store, now=NOW)
    d = rep["devices"][0]
    assert d["quarantined_count"] == 3 and set(d["quarantined_codes"].values()) == {"past"}
    assert d["missing_epoch_count"] == YEAR_H - 3  # between last year's and the recent one, not from 1970
    out = io.StringIO()
    status.print_report(rep, NOW, out)
    assert "QUARANTINED" in out.getvalue() and "(past)" in out.getvalue()
    a.close()


def test_the_bound_follows_the_config(tmp_path):
    a = Aggregator(host_cfg(tmp_path, aggregator={"max_past_s": 0}))
    assert a.handle(topic("pi-old"), encoded(params("pi-old"), seq=0, elo=5), received=NOW).status == "stored"
    a.close()
    (tmp_path / "b").mkdir()
    b = Aggregator(host_cfg(tmp_path / "b", aggregator={"max_past_s": 86400}))
    o = b.handle(topic("pi-x"), encoded(params("pi-x"), seq=0, elo=NOW // 3600 - 48), received=NOW)
    assert o.status == "quarantined" and "max_past_s" in o.reason
    b.close()
