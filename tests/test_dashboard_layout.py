"""The dashboard on a phone (420 px) and a desktop (1400 px), in headless Chromium, on a demo store with
every kind: no page scrolls sideways, the nav and the charts fit at 420 px, the Devices table needs no
horizontal scrollbar at 1400 px (screenshots of both widths are kept with PANSKETCH_SCREENSHOTS=DIR).
And what the pages say: strhh devices link to their heavy-hitter page, which talks about strings; the
CLI and the dashboard pick the same kind for heavy hitters; every page says why top-k and freq can
differ; the ledger's columns name their window length.

The page's layout is measured by the page itself: the test serves each dashboard page through a small
proxy on another port that adds one script, which writes the measurements into the DOM that
``chromium --dump-dom`` prints.
"""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.support.dash import REPO, Server, chromium, env, needs_chromium, pansketch

pytestmark = needs_chromium

DEMO = ["--agents", "2", "--windows", "3", "--events", "2000", "--w", "256", "--items", "500"]
PAGES = ("/", "/item?item=host-00001.example&item=host-00002.example", "/topk", "/heavy", "/heavy?kind=dcs",
         "/quantiles", "/distinct")

MEASURE = """<script>
window.addEventListener("load", function () { setTimeout(function () {
  var vw = document.documentElement.clientWidth, out = {vw: vw, page: document.documentElement.scrollWidth, over: []};
  function scrolls(e) {  // inside a box that scrolls sideways on its own (wide tables): not the page's overflow
    for (var a = e.parentElement; a && a !== document.body; a = a.parentElement) {
      var o = getComputedStyle(a).overflowX;
      if (o === "auto" || o === "scroll" || o === "hidden") return true;
    }
    return false;
  }
  document.querySelectorAll("body *").forEach(function (e) {
    var r = e.getBoundingClientRect();
    if (r.width && r.right > vw + 1 && !scrolls(e) && out.over.length < 8)
      out.over.push(e.tagName + "." + e.className + "#" + e.id + " '" + (e.textContent || "").trim().slice(0, 24) + "' right " + Math.round(r.right));
  });
  var t = document.querySelector("#devices");
  if (t) { var box = t.closest(".scroll"); out.devices = [box.scrollWidth, box.clientWidth]; }
  var doc = window.parent !== window ? window.parent.document : document;  // the 420 px frame reports to its page
  var pre = doc.createElement("pre"); pre.id = "measure"; pre.style.display = "none";
  pre.textContent = JSON.stringify(out); doc.body.appendChild(pre);
}, 300); });
</script>"""

# Headless Chromium's window is at least 500 px wide: a phone's 420 px viewport is an iframe of that width
# (same origin: the proxy serves both), whose media queries and layout are those of a 420 px screen.
FRAME = """<!doctype html><html><head><meta charset="utf-8"><style>body{margin:0}iframe{border:0;display:block}</style>
</head><body><iframe src="%s" width="%d" height="1100"></iframe></body></html>"""


@pytest.fixture(scope="module")
def conf(tmp_path_factory: Any) -> str:
    root = str(tmp_path_factory.mktemp("layout") / "demo")
    r = subprocess.run(pansketch("demo", *DEMO, "--dir", root), capture_output=True, text=True, env=env(), cwd=REPO,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return os.path.join(root, "host.toml")


@pytest.fixture(scope="module")
def server(conf: str) -> Any:
    s = Server(conf, "--candidates", os.path.join(os.path.dirname(conf), "candidates.txt"))
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def proxy(server: Any) -> Any:
    """The dashboard's pages with MEASURE added before </body>; everything else passed through."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            m = re.match(r"/__frame/(\d+)(/.*)", self.path)
            if m:
                body = (FRAME % (html.escape(m.group(2)), int(m.group(1)))).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            try:
                with urllib.request.urlopen(server.url + self.path, timeout=30) as r:
                    body, ctype, code = r.read(), r.headers.get("Content-Type", ""), r.status
            except urllib.error.HTTPError as e:
                body, ctype, code = e.read(), e.headers.get("Content-Type", ""), e.code
            if ctype.startswith("text/html"):
                body = body.replace(b"</body>", MEASURE.encode() + b"</body>")
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield "http://127.0.0.1:%d" % httpd.server_address[1]
    httpd.shutdown()


def framed(proxy: str, page: str, width: int) -> tuple[str, str]:
    """(url, window size) showing ``page`` at ``width`` px: directly from 500 px up, else in a frame."""
    if width >= 500:
        return proxy + page, "%d,1100" % width
    return "%s/__frame/%d%s" % (proxy, width, page), "500,1100"


def measure(proxy: str, page: str, width: int) -> dict[str, Any]:
    url, size = framed(proxy, page, width)
    dom = chromium(url, dump_dom=True, size=size, budget_ms=4000)
    m = re.search(r'<pre id="measure"[^>]*>(.*?)</pre>', dom, re.S)
    assert m, "the page did not finish loading: %s" % dom[-1500:]
    return json.loads(html.unescape(m.group(1)))


@pytest.mark.parametrize("width", (420, 1400))
@pytest.mark.parametrize("page", PAGES)
def test_no_sideways_scroll_and_everything_fits(proxy: str, page: str, width: int) -> None:
    m = measure(proxy, page, width)
    assert width - 20 <= m["vw"] <= width, m  # the viewport is the width asked for (a scrollbar at most less)
    assert m["page"] <= m["vw"], "%s at %d px scrolls sideways: page %d px wide" % (page, width, m["page"])
    assert not m["over"], "%s at %d px: cut off at the right: %s" % (page, width, m["over"])
    if width == 1400 and "devices" in m:
        assert m["devices"][0] <= m["devices"][1], "Devices table needs a scrollbar at 1400 px: %s" % m["devices"]


@pytest.mark.parametrize("width", (420, 1400))
def test_screenshots_at_both_widths(proxy: str, tmp_path: Any, width: int) -> None:
    for name, page in (("fleet", "/"), ("item", PAGES[1]), ("heavy-strings", "/heavy?kind=strhh")):
        shot = str(tmp_path / ("dashboard-%s-%d.png" % (name, width)))
        url, size = framed(proxy, page, width)
        chromium(url, screenshot=shot, size=size, budget_ms=4000)
        with open(shot, "rb") as f:
            head = f.read(24)
        assert head[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(head[16:20], "big") == max(width, 500)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def test_strhh_device_links_to_its_strings(server: Any) -> None:
    fleet = get(server.url + "/")
    link = re.search(r'<a href="([^"]+)"[^>]*>demo-words-1</a>', fleet)
    assert link and html.unescape(link.group(1)) == "/heavy?kind=strhh&device=demo-words-1", link
    page = get(server.url + html.unescape(link.group(1)))
    assert "Heavy-hitter strings" in page and "devices (kind strhh)" in page and "devices (kind dcs)" not in page
    header = re.search(r'<table id="heavy".*?<thead>(.*?)</thead>', page, re.S).group(1)
    assert "<th>string</th>" in header and "value" not in header  # each string once


def test_cli_and_dashboard_pick_the_same_kind_for_heavy(server: Any, conf: str) -> None:
    r = subprocess.run(pansketch("query", "--config", conf, "heavy", "-k", "3", "--json"), capture_output=True,
                       text=True, env=env(), cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    cli = {json.loads(line).get("kind") for line in r.stdout.splitlines() if line.strip()}
    api = {a.get("kind") for a in json.loads(get(server.url + "/api/heavy?k=3"))["answers"]}
    assert cli == api and len(cli) == 1, (cli, api)
    page = get(server.url + "/heavy")
    assert ("Heavy-hitter strings" in page) == (cli == {"strhh"})


@pytest.mark.parametrize("page", PAGES)
def test_every_page_says_why_topk_and_freq_differ(server: Any, page: str) -> None:
    text = get(server.url + page)
    assert 'id="topk-vs-freq"' in text and "least squares" in text


def test_ledger_columns_name_their_window_length(server: Any) -> None:
    fleet = get(server.url + "/")
    ledger = re.search(r'<table id="ledger".*?<thead>(.*?)</thead>', fleet, re.S).group(1)
    heads = re.findall(r"<th title=\"window [^\"]*\">(.*?)</th>", ledger, re.S)
    assert heads and all(re.search(r'class="winlen">\d+ (h|min|d|s)<', h) for h in heads), heads
    starts = [re.sub(r"<.*", "", h, flags=re.S) for h in heads]
    lengths = [re.search(r'winlen">([^<]+)<', h).group(1) for h in heads]
    assert len(set(zip(starts, lengths))) == len(heads) or len(set(lengths)) == 1, "two columns read the same"
