"""The dashboard's heavy-hitter page and JSON for kind strhh: the same answer as ``pansketch query heavy``.

Two strhh devices (the real recorder, eps = 1 dlap) over two hourly windows; three planted strings
of 400 events per device-window among 300 rare ones. No browser: the page's rows are read from
its HTML (the dcs page has the headless-Chromium test, tests/test_dashboard_kinds.py)."""

from __future__ import annotations

from tests.support.dash import Server
from tests.support.dashboard import get, get_json
from tests.support.dashboard_kinds import _store, _write_conf, cli, rows

PLANT = ["alpha", "\u00e9t\u00e9", "a-rather-long-identifier"]


def test_heavy_page_and_api_answer_strhh_like_the_cli(tmp_path) -> None:
    conf = _write_conf(str(tmp_path))
    cfg = {"kind": "strhh", "len": 8, "d": 3, "w": 256, "mechanism": "dlap", "budget": "1"}
    win = [p for p in PLANT for _ in range(400)] + ["rare-%d" % i for i in range(300)]
    _store(conf, {"str-1": (cfg, [win, win]), "str-2": (cfg, [win, win])})
    want = cli(conf, "heavy", "-k", "3")
    assert len(want) == 3 and {r["item"] for r in want} == {"alpha", "\u00e9t\u00e9", "a-rath"}
    srv = Server(conf)
    try:
        got = get_json(srv.url + "/api/heavy?k=3")["answers"]
        assert [(r["label"], r["estimate"], r["lo"], r["hi"]) for r in got] == \
            [(r["label"], r["estimate"], r["lo"], r["hi"]) for r in want]
        code, html, _h = get(srv.url + "/heavy?k=3")
        assert code == 200 and "prefixes of the merged <code>strhh</code>" in html
        page = rows(html, "heavy")
        assert [r["value"] for r in page] == [r["label"] for r in want]
    finally:
        srv.stop()


def test_metrics_export_the_heavy_strings(tmp_path) -> None:
    """/metrics of ``pansketch serve`` carries the top strings of the last day of strhh releases:
    the same ranks, labels, estimates and intervals as ``query heavy -k 10`` over that day; a
    second scrape of an unchanged store answers from the cache (same values)."""
    from tests.support.metrics import scrape, val

    conf = _write_conf(str(tmp_path))
    cfg = {"kind": "strhh", "len": 8, "d": 3, "w": 256, "mechanism": "dlap", "budget": "1"}
    win = [p for p in PLANT for _ in range(400)] + ["rare-%d" % i for i in range(300)]
    _store(conf, {"str-1": (cfg, [win, win]), "str-2": (cfg, [win, win])})
    want = cli(conf, "heavy", "-k", "10")
    assert {r["item"] for r in want} == {"alpha", "\u00e9t\u00e9", "a-rath"}
    srv = Server(conf)
    try:
        m = scrape(srv.url + "/metrics")
        assert val(m, "pansketch_strhh_heavy_strings") == len(want)
        until = val(m, "pansketch_strhh_heavy_until_timestamp_seconds")
        assert until == want[0]["range"]["until_unix"]
        for r in want:
            lab = {"rank": str(r["rank"]), "item": r["label"]}
            assert val(m, "pansketch_strhh_heavy_estimate", **lab) == r["estimate"]
            assert val(m, "pansketch_strhh_heavy_lower", **lab) == r["lo"]
            assert val(m, "pansketch_strhh_heavy_upper", **lab) == r["hi"]
        assert not [k for k in m if k[0] == "pansketch_query_metric_errors_total"]
        again = scrape(srv.url + "/metrics")
        assert {k: v for k, v in again.items() if k[0].startswith("pansketch_strhh_heavy")} == \
            {k: v for k, v in m.items() if k[0].startswith("pansketch_strhh_heavy")}
    finally:
        srv.stop()
