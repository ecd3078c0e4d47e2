"""``pansketch serve`` on a demo store, checked in headless Chromium and over plain HTTP.

The store comes from the real ``pansketch demo`` (real mosquitto) plus a
device ``pi-gap`` whose release seq 2 never arrived (tests/support/dash.py).
The browser tests assert what a person sees: the fleet page lists every
device and flags pi-gap (row, alert, ledger cell "missing"), and the item
page draws its lines with interval bands (the chart reports what it drew,
and the screenshot has the band colour). The HTTP tests cover the JSON
API, the read-only contract (every method but GET/HEAD is 405), inputs
that look like SQL or HTML, static path traversal and the token.
"""

from __future__ import annotations

import ast
import base64
import json
import os
import re
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import pytest

from tests.support.broker import needs_mosquitto
from tests.support.dash import GAP_DEVICE, REPO, Server, chromium, demo_store, env, needs_chromium, pansketch
from tests.support.dashboard import _band_pixels, _request, _wsgi, get, get_json

pytestmark = needs_mosquitto
DEMO_DEVICES = ["demo-pi-1", "demo-pi-2", "demo-pi-3"]


@pytest.fixture(scope="module")
def conf(tmp_path_factory: Any) -> str:
    return demo_store(str(tmp_path_factory.mktemp("dash") / "demo"))


@pytest.fixture(scope="module")
def server(conf: str) -> Any:
    s = Server(conf, "--candidates", os.path.join(os.path.dirname(conf), "candidates.txt"))
    try:
        yield s
    finally:
        s.stop()


def q(**kw: Any) -> str:
    return urllib.parse.urlencode(kw, doseq=True)


def row(html: str, table_id: str, device: str) -> str:
    """The <tr> of ``device`` inside table ``table_id``."""
    m = re.search(r'<table[^>]*id="%s".*?</table>' % table_id, html, re.S)
    assert m, "no table %s" % table_id
    r = re.search(r'<tr[^>]*data-device="%s"[^>]*>.*?</tr>' % re.escape(device), m.group(0), re.S)
    assert r, "no row for %s in %s" % (device, table_id)
    return r.group(0)


# -- in the browser ---------------------------------------------------------------
@needs_chromium
def test_fleet_page_lists_devices_and_flags_the_missing_release(server: Any, tmp_path: Any) -> None:
    dom = chromium(server.url + "/", dump_dom=True)
    for dev in DEMO_DEVICES:
        r = row(dom, "devices", dev)
        assert 'data-flagged="0"' in r and "ok" in r
        assert "missing" not in row(dom, "ledger", dev)
    gap = row(dom, "devices", GAP_DEVICE)
    assert 'data-flagged="1"' in gap and 'class="flagged"' in gap
    assert "1 release(s) missing" in gap
    assert re.search(r'<li class="flag" data-device="%s">' % GAP_DEVICE, dom)  # the "needs attention" list
    assert row(dom, "ledger", GAP_DEVICE).count('class="bad missing"') == 1
    assert re.search(r"<code>cbor</code></td><td class=\"n\">1<", dom) and "<code>topic</code>" in dom
    chromium(server.url + "/", screenshot=str(tmp_path / "dashboard-fleet.png"), size="1400,1150")


@needs_chromium
def test_item_page_draws_series_with_interval_bands(server: Any, tmp_path: Any) -> None:
    url = server.url + "/item?" + q(item=["host-00001.example", "host-00004.example", "never-seen.example"])
    dom = chromium(url, dump_dom=True)
    m = re.search(r'<div id="chart"[^>]*>', dom)
    assert m, dom[:2000]
    tag = m.group(0)
    attrs = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', tag))
    assert int(attrs["drawn"]) >= 1, tag  # uPlot ran and drew
    assert attrs["bands"] == "3" and attrs["lines"] == "3" and attrs["points"] == "4", tag
    assert attrs["partial"] == "1", tag  # pi-gap's missing window is shaded: the fleet total lacks its events
    assert "<canvas" in dom
    # windows whose interval includes 0 are marked: never for the top item, (almost) always for an unseen one
    rows = re.findall(r'<tr class="([^"]*)" data-includes-zero="(\d)">\s*<td><span class="swatch" '
                      r'data-color="[^"]+"[^>]*></span>([^<]+)</td>', dom)
    assert len(rows) == 12
    assert all(z == "0" for _c, z, label in rows if label == "host-00001.example")
    assert sum(z == "1" for _c, z, label in rows if label == "never-seen.example") >= 1
    png = str(tmp_path / "dashboard-item.png")
    chromium(url, screenshot=png, size="1400,1050")
    # the first line's band: #1f77b4 at alpha 0.18 over white
    assert _band_pixels(png, (215, 231, 242)) > 500  # the bands (calibrated, narrow: ~1600 pixels; none without)


@needs_chromium
def test_topk_page_screenshot(server: Any, tmp_path: Any) -> None:
    png = str(tmp_path / "dashboard-topk.png")
    chromium(server.url + "/topk?k=12", screenshot=png, size="1400,1000")
    assert os.path.getsize(png) > 10_000


# -- over HTTP ----------------------------------------------------------------------
def test_item_page_per_device_marks_the_missing_window(server: Any) -> None:
    code, html, _h = get(server.url + "/item?" + q(item="host-00001.example", per_device=1))
    assert code == 200
    assert html.count('data-includes-zero="') == 4 * 4  # 4 devices x 4 windows
    gap_rows = re.findall(r'<tr class="nodata[^"]*"[^>]*>.*?</tr>', html, re.S)
    assert len(gap_rows) == 1 and GAP_DEVICE in gap_rows[0] and "no releases match" in gap_rows[0]
    assert "missing release of %s" % GAP_DEVICE in gap_rows[0]
    assert "2026-01-01T02:00:00Z" in gap_rows[0]


def test_json_api_every_estimate_carries_interval_and_confidence(server: Any) -> None:
    s = get_json(server.url + "/api/series?" + q(item=["host-00001.example", "host-00002.example"],
                                                  confidence="0.9"))
    assert s["confidence"] == 0.9 and len(s["lines"]) == 2
    for ln in s["lines"]:
        assert [p["releases"] for p in ln["points"]] == [4, 4, 3, 4]  # pi-gap's window 3 is missing
        assert [p["missing_devices"] for p in ln["points"]] == [[], [], [GAP_DEVICE], []]
        for p in ln["points"]:
            assert p["lo"] <= p["estimate"] <= p["hi"] and p["confidence"] == 0.9 and p["includes_zero"] is False
    t = get_json(server.url + "/api/topk?k=5")
    assert [a["item"] for a in t["answers"]][:2] == ["host-00001.example", "host-00002.example"]
    assert all(a["lo"] <= a["estimate"] <= a["hi"] and a["confidence"] == 0.95 for a in t["answers"])
    f = get_json(server.url + "/api/freq?" + q(item="host-00003.example", device="demo-pi-2"))
    (a,) = f["answers"]
    assert a["devices"] == ["demo-pi-2"] and a["releases"] == 4 and a["lo"] <= a["estimate"] <= a["hi"]
    st = get_json(server.url + "/api/status")
    assert st["flagged"] == [GAP_DEVICE]
    assert {r["code"]: r["count"] for r in st["rejections_by_code"]} == {"cbor": 1, "topic": 1}


def test_cli_plots_series_and_topk(conf: str, tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    png, svg = str(tmp_path / "series.png"), str(tmp_path / "topk.svg")
    r = subprocess.run(pansketch("query", "--config", conf, "series", "host-00001.example", "never-seen.example",
                                 "--plot", png), capture_output=True, text=True, env=env(), cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(" *\n") >= 2  # never-seen: intervals that include 0 are starred
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    cands = os.path.join(os.path.dirname(conf), "candidates.txt")
    r = subprocess.run(pansketch("query", "--config", conf, "topk", "-k", "8", "--candidates", cands, "--plot", svg),
                       capture_output=True, text=True, env=env(), cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    with open(svg) as f:
        assert "<svg" in f.read(2000)
    r = subprocess.run(pansketch("query", "--config", conf, "series", "x", "--plot", str(tmp_path / "a.gif")),
                       capture_output=True, text=True, env=env(), cwd=REPO, timeout=60)
    assert r.returncode == 2 and ".png" in r.stderr


def test_only_get_and_head_are_served(server: Any) -> None:
    paths = ["/", "/item?item=a", "/topk", "/api/status", "/api/series?item=a", "/metrics", "/static/app.css",
             "/healthz", "/nope"]
    for path in paths:
        for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "PROPFIND"):
            code, headers, _b = _request(server.url, method, path)
            assert code == 405, (method, path, code)
            assert headers["Allow"] == "GET, HEAD"
    code, headers, body = _request(server.url, "HEAD", "/")
    assert code == 200 and body == b"" and int(headers["Content-Length"]) > 1000
    code, headers, _b = _request(server.url, "GET", "/")
    assert "script-src 'self'" in headers["Content-Security-Policy"] and headers["X-Content-Type-Options"] == "nosniff"


def _snapshot(conf: str) -> Any:
    from pansketch.host_tools import hostconfig
    from pansketch.host_tools.store.sqlite import Store

    with Store(hostconfig.load(conf).aggregator.db, readonly=True) as st:
        return st.snapshot(), st.db.execute("SELECT name FROM sqlite_master ORDER BY name").fetchall()


SQLISH = ["x'); DROP TABLE releases;--", "\" OR 1=1 --", "host-00001.example' --", "%", "_", "*",
          "1; DELETE FROM devices", "Robert'); DROP TABLE devices;--"]


def test_sql_like_inputs_are_plain_values(server: Any, conf: str) -> None:
    from pansketch.host_tools import hostconfig
    from pansketch.host_tools.query import core as query
    from pansketch.host_tools.store.sqlite import Store

    before = _snapshot(conf)
    s = get_json(server.url + "/api/series?" + q(item=SQLISH[:6]))
    assert [ln["item"] for ln in s["lines"]] == SQLISH[:6]  # items come back as given: hashed, not looked up
    f = get_json(server.url + "/api/freq?" + q(item=SQLISH))
    cfg = hostconfig.load(conf)
    with Store(cfg.aggregator.db, readonly=True) as st:
        direct = query.freq(st, SQLISH, salt=cfg.fleet.salt)
    assert [(a["item"], a["estimate"], a["lo"], a["hi"]) for a in f["answers"]] == \
        [(a.item, a.estimate, a.lo, a.hi) for a in direct]
    code, html, _h = get(server.url + "/item?" + q(item=SQLISH[:6]))
    assert code == 200 and html.count('data-includes-zero="') == 6 * 4
    # a device filter that would match everything if it were pasted into SQL matches nothing
    code, body, _h = get(server.url + "/api/freq?" + q(item="a", device="demo-pi-1' OR '1'='1"))
    assert code == 404 and "no releases match" in json.loads(body)["error"]
    code, body, _h = get(server.url + "/api/freq?" + q(item="a", device="demo-pi-1"))
    assert code == 200 and json.loads(body)["answers"][0]["devices"] == ["demo-pi-1"]
    for path in ("/api/freq?" + q(item="a", window="1 OR 1=1"), "/api/freq?" + q(item="a", since="0; DROP TABLE x"),
                 "/api/freq?" + q(item="a", confidence="1) OR (1"), "/api/topk?" + q(k="5 UNION SELECT 1")):
        code, body, _h = get(server.url + path)
        assert code == 400, (path, code, body)
    code, _b, _h = get(server.url + "/topk?" + q(device="x' OR 1=1 --", k=3))
    assert code == 404
    assert _snapshot(conf) == before


def test_markup_in_inputs_is_escaped(server: Any) -> None:
    evil = "<script>alert(1)</script>"
    code, html, _h = get(server.url + "/item?" + q(item=evil))
    assert code == 200
    assert evil not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    # the chart's JSON data block cannot close its <script> element
    block = re.search(r'<script type="application/json" id="series-data">(.*?)</script>', html, re.S)
    assert block and "<" not in block.group(1) and json.loads(block.group(1))["lines"][0]["label"] == evil
    code, html, _h = get(server.url + "/topk?" + q(candidates="a\n" + evil, k=2))
    assert code == 200 and evil not in html


def test_static_files_stay_inside_static(server: Any) -> None:
    assert get(server.url + "/static/vendor/uplot/uPlot.iife.min.js")[0] == 200
    for path in ("/static/../app.py", "/static/%2e%2e/app.py", "/static/..%2fapp.py", "/static//etc/passwd",
                 "/static/vendor/../../app.py"):
        code, _h, body = _request(server.url, "GET", path)
        assert code == 404, (path, code)
        assert b"Dashboard" not in body


def test_token_protects_every_path(conf: str) -> None:
    s = Server(conf, "--token", "s3cret-token-of-24-chars")
    try:
        for path in ("/", "/api/status", "/metrics", "/static/app.css"):
            assert get(s.url + path)[0] == 401
            assert get(s.url + path, {"Authorization": "Bearer wrong"})[0] == 401
            assert get(s.url + path, {"Authorization": "Bearer s3cret-token-of-24-chars"})[0] == 200
        basic = base64.b64encode(b"operator:s3cret-token-of-24-chars").decode()
        code, _b, h = get(s.url + "/", {"Authorization": "Basic " + basic})
        assert code == 200
        code, _b, h = get(s.url + "/")
        assert code == 401 and h["WWW-Authenticate"].startswith("Basic")
        assert _request(s.url, "POST", "/", {"Authorization": "Bearer s3cret-token-of-24-chars"})[0] == 405
    finally:
        s.stop()


def test_public_bind_needs_a_token(conf: str) -> None:
    r = subprocess.run(pansketch("serve", "--config", conf, "--bind", "0.0.0.0", "--port", "0"),
                       capture_output=True, text=True, env=env(), cwd=REPO, timeout=30)
    assert r.returncode == 2 and "refusing to bind 0.0.0.0" in r.stderr


WEB_MODULES = ["host_tools/web/app.py", "host_tools/web/kinds.py", "host_tools/web/serve.py", "host_tools/query/series.py", "host_tools/query/fleetview.py",
               "host_tools/metrics.py", "host_tools/query/plot.py"]


def test_web_layer_writes_no_sql() -> None:
    """Requests reach SQL only through the store's parameterised methods: the web layer has no SQL of its own."""
    sql = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE|DROP|PRAGMA)\b\s", re.I)
    for path in WEB_MODULES:
        tree = ast.parse(open(os.path.join(REPO, path), encoding="utf-8").read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                assert node.func.attr not in ("execute", "executemany", "executescript", "_q"), \
                    "%s:%d calls %s" % (path, node.lineno, node.func.attr)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and sql.search(node.value) \
                    and "FROM" in node.value.upper():
                raise AssertionError("%s:%d has SQL text: %r" % (path, node.lineno, node.value[:80]))


def test_demo_serve_prints_the_url_and_keeps_serving(tmp_path: Any) -> None:
    import signal
    import threading

    from tests.support.dash import DEMO_ARGS

    p = subprocess.Popen(pansketch("demo", *DEMO_ARGS, "--serve", "--port", "0"), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env(), cwd=REPO)
    watchdog = threading.Timer(120, p.kill)
    watchdog.start()
    try:
        assert p.stdout is not None
        lines = []
        while not lines or "dashboard:" not in lines[-1]:
            line = p.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        url = re.search(r"(http://127\.0\.0\.1:\d+/)", lines[-1]).group(1)
        code, html, _h = get(url)
        assert code == 200 and "demo-pi-3" in html
        code, html, _h = get(url + "topk?k=3")  # the demo hands its item universe to the top-k page
        assert code == 200 and "host-00001.example" in html
        p.send_signal(signal.SIGTERM)
        assert p.wait(20) == 0
    finally:
        watchdog.cancel()
        if p.poll() is None:
            p.kill()
        p.stdout.close()  # type: ignore[union-attr]


def test_pages_before_the_first_release(tmp_path: Any) -> None:
    pytest.importorskip("waitress")
    from pansketch.host_tools.store.sqlite import Store
    from pansketch.host_tools.web.app import Dashboard
    from tests.support.host import host_cfg

    cfg = host_cfg(tmp_path)
    app = Dashboard(cfg)
    status, _h, body = _wsgi(app, "/")
    assert status.startswith("200") and "No data yet" in body
    assert _wsgi(app, "/api/status")[0].startswith("503")
    status, _h, body = _wsgi(app, "/metrics")
    assert status.startswith("200") and "pansketch_store_up 0.0" in body
    Store(cfg.aggregator.db).close()  # what the aggregator creates at start
    status, _h, body = _wsgi(app, "/")
    assert status.startswith("200") and "no device has released anything yet" in body
    status, _h, body = _wsgi(app, "/item", "item=a")  # a page that says so, not "404: not found"
    assert status.startswith("200") and "No data yet" in body and "no releases of kind &#39;cs&#39; or &#39;cms&#39;" in body.replace("'", "&#39;")
    assert _wsgi(app, "/topk", "candidates=a")[0].startswith("404")
    assert _wsgi(app, "/item")[0].startswith("200")
    assert _wsgi(app, "/api/status")[0].startswith("200")
