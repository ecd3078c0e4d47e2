"""Dashboard pages for kinds dcs (quantiles / CDF, heavy hitters) and dbits (distinct counts), in headless Chromium.

The store holds real releases from the real device core
(pansketch.agent.recorders.make_recorder, deterministic noise) through the real
aggregator: two ``dcs`` temperature sensors (b = 16, map [10, 1, -40], three
hourly windows; temp-2 is stuck at 21.0 C for 400 readings per window, the
heavy hitter), two ``dbits`` door counters (300, 600, 900 distinct MACs per
window each) and one ``cs`` device (so a fleet-wide merge of all releases is
impossible and the pages must pick the devices of their kind). A second
store holds only the ``cs`` device: every kind page must say so.

Each page is compared with what ``pansketch query ... --json`` prints for
the same releases (the CLI run as a subprocess), and the numbers a person
reads in the browser (median, p95, heavy hitters, distinct counts per
window) must equal it; the truth (known streams) must lie in the intervals.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from typing import Any

import numpy as np
import pytest

from tests.support.dash import Server, chromium, needs_chromium
from tests.support.dashboard import _band_pixels, _request, get, get_json
from tests.support.dashboard_kinds import T0, _cs_device, _store, _write_conf, cli, rows, table

WINDOWS = [T0 // 3600 + k for k in range(3)]
DCS = ["temp-1", "temp-2"]
DBITS = ["door-1", "door-2"]
STUCK = "21.0"
DISTINCT_PER_WINDOW = [300, 600, 900]  # per door device


@pytest.fixture(scope="module")
def kinds(tmp_path_factory: Any) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("kinds"))
    conf = _write_conf(os.path.join(root, "mixed"))
    rng = np.random.default_rng(7)
    readings: dict[tuple[str, int], list[str]] = {}
    devices: dict[str, tuple[dict[str, Any], list[list[str]]]] = {}
    for i, dev in enumerate(DCS):
        wins = []
        for k in range(3):
            ev = ["%.1f" % x for x in rng.normal(20 + 2 * k + i, 3, 3000)]
            if dev == "temp-2":
                ev += [STUCK] * 400
            readings[(dev, k)] = ev
            wins.append(ev)
        devices[dev] = ({"kind": "dcs", "b": 16, "map": [10, 1, -40], "d": 4, "w": 1024, "mechanism": "dgauss",
                         "budget": "1/2"}, wins)
    for i, dev in enumerate(DBITS):
        wins = [["mac-%d-%d" % (i, j % n) for j in range(2500)] for n in DISTINCT_PER_WINDOW]
        devices[dev] = ({"kind": "dbits", "d": 12, "w": 512, "mechanism": "dlap", "budget": "1"}, wins)
    devices["cs-1"] = _cs_device()
    _store(conf, devices)
    cs_conf = _write_conf(os.path.join(root, "cs-only"))
    _store(cs_conf, {"cs-1": _cs_device()})
    s = Server(conf)
    s2 = Server(cs_conf)
    try:
        yield {"conf": conf, "url": s.url, "cs_url": s2.url, "readings": readings}
    finally:
        s.stop()
        s2.stop()


def devs(names: list[str]) -> list[str]:
    return [x for d in names for x in ("--device", d)]


def q(**kw: Any) -> str:
    return urllib.parse.urlencode(kw, doseq=True)


def chart_attrs(dom: str, chart_id: str) -> dict[str, str]:
    m = re.search(r'<div id="%s"[^>]*>' % chart_id, dom)
    assert m, dom[:3000]
    return dict(re.findall(r'data-([a-z-]+)="([^"]*)"', m.group(0)))


def num(x: float) -> str:
    return ("%d" % x) if float(x).is_integer() else ("%.1f" % x)


# -- in the browser --------------------------------------------------------------------
@needs_chromium
def test_quantiles_page_shows_the_clis_median_and_p95(kinds: dict[str, Any], tmp_path: Any) -> None:
    want = cli(kinds["conf"], "quantile", "--q", "0.5", "0.95", *devs(DCS))
    dom = chromium(kinds["url"] + "/quantiles", dump_dom=True)
    got = rows(dom, "quantiles")
    assert [r["q"] for r in got] == ["0.5", "0.95"]  # the default quantiles: median and p95
    for r, w in zip(got, want):
        assert int(r["value"]) == w["value"]
        assert (float(r["rank"]), float(r["rank-lo"]), float(r["rank-hi"])) == (w["rank"], w["rank_lo"], w["rank_hi"])
        cells = r["cells"]
        assert cells[1] == ("median" if w["q"] == 0.5 else "p95")
        assert cells[2] == "[%s, %s)" % ("%.10g" % w["reading"][0], "%.10g" % w["reading"][1])
        assert cells[5] == "[%s, %s]" % (num(w["rank_lo"]), num(w["rank_hi"]))
        assert cells[7] == "[%.4f, %.4f]" % (w["cdf_lo"], w["cdf_hi"])
    # the truth: the fraction of all readings below each answer's upper edge lies in its CDF interval
    allv = np.array([float(x) for ev in kinds["readings"].values() for x in ev])
    for w in want:
        frac = float((allv < w["reading"][1] - 1e-9).mean())
        assert w["cdf_lo"] <= frac <= w["cdf_hi"], (w, frac)
        assert abs(frac - w["q"]) < 0.02
    assert 'id="n">%s<' % num(want[0]["n"]) in dom
    # the chart: uPlot drew the CDF with its band and both quantile markers
    a = chart_attrs(dom, "cdf-chart")
    assert int(a["drawn"]) >= 1 and a["quantiles"] == "2" and int(a["points"]) >= 60, a
    assert "<canvas" in dom
    png = str(tmp_path / "dashboard-quantiles.png")
    chromium(kinds["url"] + "/quantiles", screenshot=png, size="1400,1250")
    # the band: #1f77b4 at alpha 0.18 over white (a few hundred pixels: the calibrated band is narrow;
    # none without it)
    assert _band_pixels(png, (215, 231, 242)) > 300
    assert _band_pixels(png, (214, 39, 40), tol=20) > 150  # the red quantile markers and whiskers


@needs_chromium
def test_quantiles_follow_the_selection(kinds: dict[str, Any]) -> None:
    w = WINDOWS[2]
    want = cli(kinds["conf"], "quantile", "--q", "0.25", "0.75", "0.99", "--device", "temp-1", "--window", str(w))
    url = kinds["url"] + "/quantiles?" + q(q="25% 0.75,0.99", device="temp-1", window=w, points=33)
    dom = chromium(url, dump_dom=True)
    got = rows(dom, "quantiles")
    assert [(float(r["q"]), int(r["value"]), float(r["rank"])) for r in got] == \
        [(x["q"], x["value"], x["rank"]) for x in want]
    assert [r["cells"][1] for r in got] == ["p25", "p75", "p99"]
    assert want[0]["releases"] == 1 and "1 release(s) from 1 device(s) (temp-1)" in dom
    assert chart_attrs(dom, "cdf-chart")["quantiles"] == "3"
    # window 3 of temp-1 is centred at 24 C: its median is far from the whole fleet's
    assert 23.5 <= want[1]["reading"][0] <= 27
    # a given reading range for the curve: its points are the CLI's CDF at those readings
    code, html, _h = get(kinds["url"] + "/quantiles?" + q(**{"from": "18", "to": "26", "points": 9}))
    assert code == 200
    cdf_rows = re.findall(r"<tr><td>([^<]+)</td><td class=\"n\">(\d+)</td>", table(html, "cdf"))
    grid = ["[%d, %d.1)" % (x, x) for x in range(18, 27)]  # 9 evenly spaced points, plus the quantiles inside
    assert cdf_rows[0][0] == grid[0] and cdf_rows[-1][0] == grid[-1] and set(grid) <= {r[0] for r in cdf_rows}
    assert len(cdf_rows) <= 9 + 2, cdf_rows
    at = cli(kinds["conf"], "cdf", "--at", *[r[0][1:].split(",")[0] for r in cdf_rows], *devs(DCS))
    assert [int(v) for _r, v in cdf_rows] == [a["value"] for a in at]
    assert "[%.4f, %.4f]" % (at[4]["cdf_lo"], at[4]["cdf_hi"]) in html


@needs_chromium
def test_heavy_page_finds_the_stuck_reading_like_the_cli(kinds: dict[str, Any], tmp_path: Any) -> None:
    want = cli(kinds["conf"], "heavy", "-k", "5", *devs(DCS))
    dom = chromium(kinds["url"] + "/heavy?k=5", dump_dom=True)
    got = rows(dom, "heavy")
    assert len(got) == 5
    assert [(int(r["rank"]), int(r["value"]), float(r["estimate"])) for r in got] == \
        [(x["rank"], x["value"], x["estimate"]) for x in want]
    assert [r["cells"][4] for r in got] == ["[%s, %s]" % (num(x["lo"]), num(x["hi"])) for x in want]
    assert got[0]["cells"][1] == "[21, 21.1)"  # 1200 stuck readings of 21.0 on temp-2 (+ ~380 natural ones)
    assert want[0]["lo"] <= 1200 + sum(ev.count(STUCK) - (400 if dev == "temp-2" else 0)
                                       for (dev, _k), ev in kinds["readings"].items()) <= want[0]["hi"]
    assert dom.count('<g class="bar') == 5
    chromium(kinds["url"] + "/heavy?k=12", screenshot=str(tmp_path / "dashboard-heavy.png"), size="1400,1000")
    code, html, _h = get(kinds["url"] + "/heavy?k=2")
    assert code == 200 and len(rows(html, "heavy")) == 2


@needs_chromium
def test_distinct_page_shows_the_clis_counts_per_window(kinds: dict[str, Any], tmp_path: Any) -> None:
    (want,) = cli(kinds["conf"], "distinct", *devs(DBITS))
    dom = chromium(kinds["url"] + "/distinct", dump_dom=True)
    card = re.search(r'<div class="card wide" id="distinct-total"([^>]*)>(.*?)</div>\s*</div>', dom, re.S)
    assert card, dom[:3000]
    attrs = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', card.group(1)))
    assert (float(attrs["estimate"]), float(attrs["lo"]), float(attrs["hi"])) == \
        (want["estimate"], want["lo"], want["hi"])
    assert '<span class="estimate">%s</span>' % num(want["estimate"]) in card.group(2)
    truth = 2 * sum(DISTINCT_PER_WINDOW)
    assert want["lo"] <= truth <= want["hi"]
    got = rows(dom, "windows")
    assert [int(r["window"]) for r in got] == WINDOWS
    for r, w, d in zip(got, WINDOWS, DISTINCT_PER_WINDOW):
        (one,) = cli(kinds["conf"], "distinct", "--window", str(w), *devs(DBITS))
        assert float(r["estimate"]) == one["estimate"]
        assert r["cells"][4] == "[%s, %s]" % (num(one["lo"]), num(one["hi"]))
        assert one["lo"] <= 2 * d <= one["hi"], (one, d)
    a = chart_attrs(dom, "chart")  # several windows: the per-window chart with its band
    assert int(a["drawn"]) >= 1 and a["points"] == "3" and a["bands"] == "1", a
    chromium(kinds["url"] + "/distinct", screenshot=str(tmp_path / "dashboard-distinct.png"), size="1400,1100")
    # one window selected: its count, and no chart
    dom1 = chromium(kinds["url"] + "/distinct?" + q(window=WINDOWS[0]), dump_dom=True)
    assert 'id="chart"' not in dom1 and len(rows(dom1, "windows")) == 1


@needs_chromium
def test_pages_for_a_kind_the_store_does_not_hold_say_so(kinds: dict[str, Any]) -> None:
    for path, kind in (("/quantiles", "dcs"), ("/heavy", "dcs"), ("/distinct", "dbits")):
        dom = chromium(kinds["cs_url"] + path, dump_dom=True)
        m = re.search(r'<div class="alerts missing-kind" id="missing-kind">(.*?)</div>', dom, re.S)
        assert m, (path, dom[:3000])
        text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", m.group(1)))
        assert "no releases of kind '%s' in this store" % kind in text and "It holds cs (1 device)" in text, text
        assert "<table" not in dom and "<canvas" not in dom
        for link in ("/quantiles", "/heavy", "/distinct"):  # the navigation shows every page
            assert '<a href="%s"' % link in dom
        code, body, _h = get(kinds["cs_url"] + path)
        assert code == 200
    for api in ("/api/quantiles", "/api/cdf", "/api/heavy?k=3", "/api/distinct"):
        code, body, _h = get(kinds["cs_url"] + api)
        assert code == 404 and "no releases of kind" in json.loads(body)["error"], (api, code, body)


# -- JSON API and inputs ----------------------------------------------------------------------
def test_json_api_returns_what_the_cli_prints(kinds: dict[str, Any]) -> None:
    u, conf = kinds["url"], kinds["conf"]
    got = get_json(u + "/api/quantiles?" + q(q=["0.5", "0.95"]))["answers"]
    assert got == cli(conf, "quantile", "--q", "0.5", "0.95", *devs(DCS))
    got = get_json(u + "/api/cdf?" + q(at="15 20.5 25", device=DCS))["answers"]
    assert got == cli(conf, "cdf", "--at", "15", "20.5", "25", *devs(DCS))
    got = get_json(u + "/api/cdf?points=9")["answers"]
    assert got == cli(conf, "cdf", "--points", "9", *devs(DCS))
    got = get_json(u + "/api/heavy?" + q(k=4, threshold=100, window=WINDOWS[1]))["answers"]
    assert got == cli(conf, "heavy", "-k", "4", "--threshold", "100", "--window", str(WINDOWS[1]), *devs(DCS))
    since, until = "2027-01-15T09:00:00Z", "2027-01-15T11:00:00Z"
    got = get_json(u + "/api/distinct?" + q(since=since, until=until, confidence="0.9"))
    assert got == cli(conf, "distinct", "--since", since, "--until", until, "--confidence", "0.9", *devs(DBITS))[0]
    assert got["releases"] == 4 and got["confidence"] == 0.9
    per = get_json(u + "/api/distinct?per_window=1")
    assert [w["window"] for w in per["windows"]] == WINDOWS
    assert abs(sum(w["estimate"] for w in per["windows"]) - per["estimate"]) < 1


def test_bad_inputs_and_wrong_kinds_are_refused(kinds: dict[str, Any]) -> None:
    u = kinds["url"]
    for path in ("/quantiles?q=1.5", "/quantiles?q=median", "/quantiles?points=1", "/quantiles?from=warm",
                 "/heavy?k=0", "/heavy?k=5%20UNION%20SELECT%201", "/heavy?threshold=nan", "/distinct?windows=x",
                 "/api/quantiles?q=-1", "/api/heavy?k=abc", "/quantiles?window=1%20OR%201=1",
                 "/distinct?window=500000&since=0"):
        code, body, _h = get(u + path)
        assert code == 400, (path, code, body[:300])
    # a device of another kind: the query's own refusal, with the reason
    code, body, _h = get(u + "/api/quantiles?device=door-1")
    assert code == 422 and "kind 'dbits'" in json.loads(body)["error"]
    code, body, _h = get(u + "/distinct?device=temp-1")
    assert code == 422 and "distinct needs kind" in body
    code, body, _h = get(u + "/heavy?" + q(device="temp-1' OR '1'='1"))
    assert code == 404 and "no releases match" in body
    code, html, _h = get(u + "/quantiles?" + q(q="0.5", device="<b>x</b>"))
    assert "<b>x</b>" not in html
    for path in ("/quantiles", "/heavy", "/distinct", "/api/quantiles", "/api/cdf", "/api/heavy", "/api/distinct"):
        assert _request(u, "POST", path)[0] == 405
        code, headers, _b = _request(u, "GET", path)
        assert code == 200, path
        if not path.startswith("/api/"):
            assert "script-src 'self'" in headers["Content-Security-Policy"]


def test_kind_pages_before_the_first_release(tmp_path: Any) -> None:
    pytest.importorskip("waitress")
    from pansketch.host_tools.store.sqlite import Store
    from pansketch.host_tools.web.app import Dashboard
    from tests.support.dashboard import _wsgi
    from tests.support.host import host_cfg

    cfg = host_cfg(tmp_path)
    app = Dashboard(cfg)
    for path in ("/quantiles", "/heavy", "/distinct"):
        status, _h, body = _wsgi(app, path)
        assert status.startswith("200") and "No data yet" in body
        assert _wsgi(app, "/api" + path)[0].startswith("503")
    Store(cfg.aggregator.db).close()
    for path in ("/quantiles", "/heavy", "/distinct"):
        status, _h, body = _wsgi(app, path)
        assert status.startswith("200") and 'id="missing-kind"' in body and "It holds no releases." in body
        status, _h, body = _wsgi(app, "/api" + path)
        assert status.startswith("404") and "no releases of kind" in json.loads(body)["error"]
