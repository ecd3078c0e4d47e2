"""A new user's first hour: the demo shows every kind, mixed-kind stores just work,
an empty or foreign database is one line, and bad input to any subcommand is one line and an exit code.

The demo store is the real ``pansketch demo --dir D`` (real mosquitto, the real device core of every
kind and the real aggregator); every check runs the real ``pansketch`` command in a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from typing import Any

import pytest

from tests.support.broker import needs_mosquitto
from tests.support.dash import REPO, env

DEMO = ["--agents", "2", "--windows", "3", "--events", "2000", "--w", "256", "--items", "500"]
KIND_DEVICES = {"cs": "demo-pi-1..2", "cms": "demo-cms-1", "tree": "demo-tree-1", "dcs": "demo-temp-1", "dbits": "demo-door-1",
                "strhh": "demo-words-1"}


def pansketch(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pansketch.host_tools.cli", *args], capture_output=True, text=True,
                          env=env(), cwd=REPO, timeout=120, input=stdin)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: Any) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("first-hour") / "demo")
    r = pansketch("demo", *DEMO, "--dir", root)
    assert r.returncode == 0, r.stdout + r.stderr
    return {"conf": os.path.join(root, "host.toml"), "dir": root, "out": r.stdout, "err": r.stderr}


def q(demo: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return pansketch("query", "--config", demo["conf"], *args)


def jlines(r: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert r.returncode == 0, r.stderr
    return [json.loads(x) for x in r.stdout.splitlines() if x.strip()]


# -- item 3: a demo with every kind ----------------------------------------------------------------
@needs_mosquitto
def test_demo_prints_one_short_line_per_kind(demo: dict[str, str]) -> None:
    for kind, dev in KIND_DEVICES.items():
        m = re.search(r"^  %s +%s .*$" % (kind, re.escape(dev)), demo["out"], re.M)
        assert m, demo["out"]
        assert len(m.group(0)) <= 130, m.group(0)
        assert re.search(r"true (median )?[0-9.]+$|inside their intervals$", m.group(0)), m.group(0)
    assert "CPU per message" not in demo["out"] + demo["err"]  # the helpers' benchmark lines stay out of the demo


@needs_mosquitto
def test_every_query_of_the_issue_answers_on_the_demo_store(demo: dict[str, str]) -> None:
    for args in (["quantile", "--q", "0.5"], ["cdf"], ["heavy", "-k", "5"], ["distinct"],
                 ["series", "host-00001.example"], ["freq", "host-00001.example"],
                 ["topk", "-k", "3", "--candidates", os.path.join(demo["dir"], "candidates.txt")]):
        r = q(demo, *args)
        assert r.returncode == 0, (args, r.stderr)
        assert r.stdout.strip() and not r.stderr.strip(), (args, r.stdout, r.stderr)


# -- item 4: mixed-kind stores ---------------------------------------------------------------------
@needs_mosquitto
def test_each_query_picks_the_devices_of_its_kind(demo: dict[str, str]) -> None:
    cs = ["demo-pi-1", "demo-pi-2", "demo-tree-1"]  # the tree-mode device is cs with the same d, w
    assert jlines(q(demo, "freq", "host-00001.example", "--json"))[0]["devices"] == cs
    assert {tuple(r["devices"]) for r in jlines(q(demo, "series", "host-00001.example", "--json"))} == {tuple(cs)}
    assert jlines(q(demo, "quantile", "--q", "0.5", "--json"))[0]["devices"] == ["demo-temp-1"]
    # heavy answers kinds strhh and dcs; one device each: the tie goes to strhh (strings), and
    # naming the dcs device answers from its readings
    assert jlines(q(demo, "heavy", "-k", "2", "--json"))[0]["devices"] == ["demo-words-1"]
    assert jlines(q(demo, "heavy", "-k", "2", "--device", "demo-temp-1", "--json"))[0]["devices"] == ["demo-temp-1"]
    assert jlines(q(demo, "distinct", "--json"))[0]["devices"] == ["demo-door-1"]
    # naming a device of the other point kind still answers from it alone
    a = jlines(q(demo, "freq", "host-00001.example", "--device", "demo-cms-1", "--json"))[0]
    assert a["devices"] == ["demo-cms-1"] and a["kind"] == "cms"
    # a device of the wrong kind for the query: one line saying which kind it is
    r = q(demo, "quantile", "--q", "0.5", "--device", "demo-door-1")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "dbits" in r.stderr, r.stderr


def test_a_store_without_the_kind_says_what_it_holds(tmp_path: Any) -> None:
    """quantile on a cs-only store: which kinds it holds and what they answer (not a merge error)."""
    from tests.support.dashboard_kinds import _cs_device, _store, _write_conf

    conf = _write_conf(str(tmp_path))
    _store(conf, {"cs-1": _cs_device()})
    r = pansketch("query", "--config", conf, "quantile", "--q", "0.5")
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "no releases of kind 'dcs' in this store; it holds kind cs (1 device: answers freq, topk, series)" in r.stderr


# -- item 2: an empty or foreign database ------------------------------------------------------------
@pytest.mark.parametrize("what", ["empty", "foreign-sqlite", "junk"])
def test_empty_or_foreign_database_is_one_line_and_exit_1(tmp_path: Any, what: str) -> None:
    db = tmp_path / "fleet.db"
    if what == "empty":
        db.write_bytes(b"")  # touch fleet.db
    elif what == "foreign-sqlite":
        con = sqlite3.connect(str(db))
        con.execute("CREATE TABLE photos (id INTEGER)")
        con.commit()
        con.close()
    else:
        db.write_bytes(b"not a database at all " * 64)
    before = db.read_bytes()
    conf = tmp_path / "host.toml"
    conf.write_text('[aggregator]\ndb = "fleet.db"\n[fleet]\nsalt = "first-hour-salt"\n')
    for args in (["status"], ["status", "--json"], ["query", "freq", "x"], ["query", "series", "x"],
                 ["query", "quantile", "--q", "0.5"], ["query", "cdf"], ["query", "heavy", "-k", "3"],
                 ["query", "distinct"]):
        r = pansketch(*args, "--config", str(conf))
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
        assert str(db) in r.stderr and "not a pansketch database" in r.stderr, r.stderr
    assert db.read_bytes() == before, "a read-only command changed the file"


# -- item 10 of the issue: bad input to every subcommand ---------------------------------------------
def _one_line(r: subprocess.CompletedProcess[str], code: int, what: Any) -> str:
    err = r.stderr.strip()
    assert r.returncode == code, (what, r.returncode, r.stdout[-500:], err)
    assert "Traceback" not in err and "[Errno" not in err, (what, err)
    assert len(err.splitlines()) == 1, (what, err)
    return err


def test_every_subcommand_on_bad_input_is_one_line_and_its_exit_code(tmp_path: Any) -> None:
    """Usage and config errors exit 2 (docs/HOST.md), runtime errors 1; one line on stderr, no traceback."""
    from tests.support.dashboard_kinds import _cs_device, _store, _write_conf

    conf = _write_conf(str(tmp_path))
    _store(conf, {"cs-1": _cs_device()})
    c = ["--config", conf]
    cases: list[tuple[list[str], int, str]] = [
        (["bogus"], 2, "invalid choice"),
        (["aggregate"], 2, "--config"),
        (["aggregate", "--config", str(tmp_path / "none.toml")], 2, "cannot read"),
        (["status", "--config", str(tmp_path / "none.toml")], 2, "cannot read"),
        (["status", *c, "--windows", "many"], 2, "--windows"),
        (["status", *c, "--late-grace", "-1"], 2, "--late-grace"),
        (["query", *c, "freq"], 2, "ITEM"),
        (["query", *c, "freq", "x", "--csv", "--json"], 2, "not both"),
        (["query", *c, "freq", "x", "--confidence", "2"], 2, "--confidence"),
        (["query", *c, "freq", "x", "--window", "5", "--since", "0"], 2, "not both"),
        (["query", *c, "freq", "x", "--since", "2026-01-02", "--until", "2026-01-01"], 2, "not after"),
        (["query", *c, "freq", "x", "--since", "soon"], 2, "not a time"),
        (["query", *c, "freq", "x", "--device", "nope"], 1, "devices with releases: cs-1"),
        (["query", *c, "freq", "x", "--plot", str(tmp_path / "no" / "such" / "dir.png")], 2, "does not exist"),
        (["query", *c, "freq", "x", "--plot", "x.gif"], 2, "must end in"),
        (["query", *c, "topk", "-k", "0", "--candidates", "-"], 2, "at least 1"),
        (["query", *c, "topk", "-k", "x", "--candidates", "-"], 2, "not an integer"),
        (["query", *c, "topk", "-k", "3", "--candidates", str(tmp_path / "missing.txt")], 1,
         "No such file or directory"),
        (["query", *c, "series", "x", "--step", "0"], 2, "must be positive"),
        (["query", *c, "series", "x", "--step", "soon"], 2, "not a step"),
        (["query", *c, "series", "x", "--step", "30m"], 1, "use a multiple of 3600 s"),
        (["query", *c, "series", "x", "--since", "2026-01-02", "--until", "2026-01-01"], 2, "not after"),
        (["query", *c, "series", "x", "--window", "3"], 2, "--since/--until"),
        (["query", *c, "quantile", "--q", "2"], 2, "[0, 1]"),
        (["query", *c, "quantile", "--q", "0.5"], 1, "no releases of kind 'dcs'"),
        (["query", *c, "cdf", "--points", "1"], 2, "at least 2"),
        (["query", *c, "heavy", "-k", "0"], 2, "at least 1"),
        (["query", *c, "distinct", "--window", "x"], 2, "--window"),
        (["query", *c, "distinct"], 1, "no releases of kind 'dbits'"),
        (["serve", *c, "--port", "-1"], 2, "--port"),
        (["serve", *c, "--bind", "0.0.0.0"], 2, "token"),
        (["demo", "--agents", "0"], 2, "at least 1"),
        (["demo", "--windows", "x"], 2, "not an integer"),
        (["repro", "bogus"], 2, "invalid choice"),
        (["audit"], 2, "--config"),
        (["audit", "--config", str(tmp_path / "none.toml")], 2, "cannot read"),
    ]
    for args, code, needle in cases:
        err = _one_line(pansketch(*args), code, args)
        assert needle in err, (args, err)


def test_agent_subcommands_on_bad_input(tmp_path: Any) -> None:
    agent = [sys.executable, "-m", "pansketch.agent.pi.daemon"]
    for args, code, needle in ((["bogus"], 2, "invalid choice"), (["check"], 2, "--config"),
                               (["feed", "--config", str(tmp_path / "none.toml")], 2, "config error"),
                               (["check", "--config", str(tmp_path / "none.toml")], 2, "config error"),
                               (["run", "--config", "x.toml", "--timeout", "soon"], 2, "--timeout")):
        r = subprocess.run(agent + args, capture_output=True, text=True, env=env(), cwd=REPO, timeout=60)
        assert needle in _one_line(r, code, args)


@needs_mosquitto
def test_hints_on_the_demo_store(demo: dict[str, str]) -> None:
    err = _one_line(q(demo, "series", "host-00001.example", "--step", "30m"), 1, "step")
    assert "3600 s" in err
    err = _one_line(q(demo, "freq", "x", "--device", "demo-pi-9"), 1, "device")
    assert "demo-pi-1, demo-pi-2" in err and "demo-temp-1" in err
    err = _one_line(q(demo, "series", "x", "--device", "demo-temp-1"), 1, "kind")
    assert "demo-temp-1 (dcs)" in err and "quantile" in err


def test_k_has_help_text() -> None:
    for sub in ("topk", "heavy"):
        r = pansketch("query", sub, "--help")
        assert r.returncode == 0 and re.search(r"-k K +\S", r.stdout), r.stdout


# -- CSV wherever --json exists -------------------------------------------------------------------------
def _dotted(obj: dict[str, Any], prefix: str = "") -> list[str]:
    out: list[str] = []
    for k, v in obj.items():
        out += _dotted(v, prefix + k + ".") if isinstance(v, dict) else [prefix + k]
    return out


@needs_mosquitto
def test_csv_has_a_header_and_the_fields_of_the_json(demo: dict[str, str]) -> None:
    import csv
    import io

    cands = os.path.join(demo["dir"], "candidates.txt")
    for args in (["freq", "host-00001.example", "never-seen.example"], ["topk", "-k", "3", "--candidates", cands],
                 ["series", "host-00001.example"], ["quantile", "--q", "0.5", "0.9"], ["cdf", "--points", "5"],
                 ["heavy", "-k", "3"], ["distinct"], ["freq", "host-00001.example", "--device", "demo-cms-1"]):
        js = jlines(q(demo, *args, "--json"))
        r = q(demo, *args, "--csv")
        assert r.returncode == 0, (args, r.stderr)
        rows = list(csv.DictReader(io.StringIO(r.stdout)))
        assert len(rows) == len(js) >= 1, (args, r.stdout)
        header = r.stdout.splitlines()[0].split(",")
        for j, row in zip(js, rows):
            assert set(_dotted(j)) <= set(header), (args, set(_dotted(j)) - set(header))
            for k, v in j.items():
                if isinstance(v, dict):
                    continue
                if k in ("estimate", "lo", "hi", "releases", "rank", "value") and v is not None:
                    assert float(row[k]) == float(v), (args, k, row[k], v)  # noise is fixed once stored
                if k == "devices":
                    assert row[k].split(";") == v
    st = pansketch("status", "--config", demo["conf"], "--csv")
    rows = list(csv.DictReader(io.StringIO(st.stdout)))
    devs = json.loads(pansketch("status", "--config", demo["conf"], "--json").stdout)["devices"]
    assert [r["device"] for r in rows] == [d["device"] for d in devs] and "guarantee_text" in rows[0]
    assert [r["releases"] for r in rows] == [str(d["releases"]) for d in devs]
    err = _one_line(pansketch("status", "--config", demo["conf"], "--csv", "--json"), 2, "both")
    assert "not both" in err


# -- a browser walks every page: demo store (every kind), empty store, empty file --------------------------
PAGES = ["/", "/item?item=host-00001.example", "/topk", "/quantiles", "/heavy", "/distinct"]


def _table_rows(dom: str, table_id: str) -> int:
    m = re.search(r'<table[^>]*id="%s".*?</table>' % table_id, dom, re.S)
    assert m, "no table %s" % table_id
    return len(re.findall(r"<tbody>.*?</tbody>", m.group(0), re.S)[0].split("<tr")) - 1


def _drawn(dom: str, chart_id: str) -> int:
    m = re.search(r'<div id="%s"[^>]*data-drawn="(\d+)"' % chart_id, dom)
    assert m, chart_id
    return int(m.group(1))


@needs_mosquitto
def test_every_dashboard_page_shows_data_after_the_demo(demo: dict[str, str]) -> None:
    from tests.support.dash import Server, chromium

    s = Server(demo["conf"], "--candidates", os.path.join(demo["dir"], "candidates.txt"))
    try:
        dom = {path: chromium(s.url + path, dump_dom=True) for path in PAGES}
        bad = chromium(s.url + "/item?item=x&device=demo-temp-1", dump_dom=True)
    finally:
        s.stop()
    for path, d in dom.items():
        assert "missing-kind" not in d and "No data yet" not in d and "internal error" not in d, path
    fleet = dom["/"]
    for dev, page in (("demo-pi-1", "/topk"), ("demo-cms-1", "/topk"), ("demo-tree-1", "/topk"),
                      ("demo-temp-1", "/quantiles"), ("demo-door-1", "/distinct")):
        assert re.search(r'<a href="%s\?device=%s"' % (page, dev), fleet), (dev, page)
    assert _drawn(dom["/item?item=host-00001.example"], "chart") >= 1
    assert _table_rows(dom["/item?item=host-00001.example"], "points") == 3  # 3 windows, the cs fleet
    assert "nodata" not in dom["/item?item=host-00001.example"]
    topk = dom["/topk"]
    assert _table_rows(topk, "topk") >= 5
    offered = re.findall(r'<option value="([^"]+)"', topk.split('id="topk"')[0])
    assert "demo-pi-1" in offered and "demo-cms-1" in offered
    assert "demo-temp-1" not in offered and "demo-door-1" not in offered  # not kinds top-k can rank
    assert _table_rows(dom["/quantiles"], "quantiles") >= 2 and _drawn(dom["/quantiles"], "cdf-chart") >= 1
    assert _table_rows(dom["/heavy"], "heavy") >= 1
    assert 'id="distinct-total"' in dom["/distinct"] and _drawn(dom["/distinct"], "chart") >= 1
    # the item page for a device of another kind: the reason, not an empty chart
    assert 'id="chart"' not in bad and "demo-temp-1 (dcs)" in bad and "quantile" in bad


@pytest.mark.parametrize("store", ["aggregated-but-empty", "empty-file"])
def test_every_dashboard_page_on_an_empty_store_says_so(tmp_path: Any, store: str) -> None:
    from tests.support.dash import Server, chromium

    conf = tmp_path / "host.toml"
    conf.write_text('[aggregator]\ndb = "e.db"\n[fleet]\nsalt = "first-hour-salt"\n')
    if store == "empty-file":
        (tmp_path / "e.db").write_bytes(b"")
    else:
        from pansketch.host_tools import hostconfig
        from pansketch.host_tools.ingest.aggregator import Aggregator

        Aggregator(hostconfig.load(str(conf))).close()
    s = Server(str(conf))
    try:
        for path in PAGES:
            d = chromium(s.url + path, dump_dom=True)
            assert "404" not in d.split("</h1>")[0] and "internal error" not in d, (path, d[:3000])
            said = ("No data yet" in d or "missing-kind" in d or "A sketch cannot list" in d
                    or "lost / pending" in d)
            assert said, (path, d[:3000])
            if store == "empty-file":
                assert "not a pansketch database" in d, path
    finally:
        s.stop()


def test_plot_without_matplotlib_says_what_to_install_like_the_readme(tmp_path: Any) -> None:
    """`make demo` installs no matplotlib: --plot says so before querying, and docs/USAGE.md (the commands'
    reference the README points to) agrees."""
    from pansketch.host_tools.query.plot import MISSING
    from tests.support.dashboard_kinds import _cs_device, _store, _write_conf

    conf = _write_conf(str(tmp_path))
    _store(conf, {"cs-1": _cs_device()})
    code = ("import sys; sys.modules['matplotlib'] = None; from pansketch.host_tools.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "query", "--config", conf, "series", "item-1", "--plot",
                        str(tmp_path / "a.png")], capture_output=True, text=True, env=env(), cwd=REPO, timeout=60)
    assert _one_line(r, 2, "plot") == "pansketch query: " + MISSING
    assert not (tmp_path / "a.png").exists() and not r.stdout
    readme = open(os.path.join(REPO, "docs", "USAGE.md"), encoding="utf-8").read()
    assert "`--plot` needs matplotlib, which `make demo` does not install: `pip install 'pansketch[repro]'`" in readme
    assert "pip install 'pansketch[repro]'" in MISSING and "make demo" in MISSING


# -- one delta convention for every eps figure -------------------------------------------------------------
def test_status_dashboard_and_audit_give_one_eps_at_one_delta(tmp_path: Any) -> None:
    """Audit said 'claim 4.728 (δ = 1e-05)', status 'eps = 5.76 at delta = 1e-06' for one config."""
    from pansketch.agent.params import Params
    from pansketch.host_tools import hostconfig
    from pansketch.host_tools.audit import engine, stats
    from tests.support.dashboard_kinds import _cs_device, _store, _write_conf

    conf = _write_conf(str(tmp_path))
    _store(conf, {"cs-1": _cs_device()})  # dgauss rho = 1/2 (the Params default)
    p = Params({"device": "cs-1", "salt": "dash-kinds-salt", "kind": "cs", "d": 4, "w": 64, "window_s": 3600})
    assert hostconfig.load(conf).query.delta == engine.DEFAULT_DELTA == 1e-6
    claim = engine.claim_of(p)
    rep = json.loads(pansketch("status", "--config", conf, "--json").stdout)
    g = rep["devices"][0]["guarantee"]
    assert g["rho"] == "1/2" and g["delta"] == claim.delta == 1e-6
    assert g["eps_at_delta"] == pytest.approx(claim.eps, abs=1e-6) == pytest.approx(5.2215, abs=1e-3)
    # the calibration: the delta this eps reaches is the configured one (not looser, and tight)
    assert stats.zcdp_delta(0.5, g["eps_at_delta"]) <= 1e-6 < stats.zcdp_delta(0.5, g["eps_at_delta"] - 0.01)
    text = pansketch("status", "--config", conf).stdout
    assert "eps=%.3f at delta=1e-06" % claim.eps in text and "5.76" not in text
    # configurable, in one place for the host: [query] delta moves status (and the dashboard) with it
    with open(conf, "a") as f:
        f.write('[query]\ndelta = "1e-5"\n')
    g5 = json.loads(pansketch("status", "--config", conf, "--json").stdout)["devices"][0]["guarantee"]
    assert g5["delta"] == 1e-5 and g5["eps_at_delta"] == pytest.approx(engine.claim_of(p, 1e-5).eps, abs=1e-6)
    assert g5["eps_at_delta"] == pytest.approx(4.728, abs=1e-3)


# -- smaller items -------------------------------------------------------------------------------------------
@needs_mosquitto
def test_cdf_labels_say_below_and_above_and_flag_estimates_outside_their_interval(demo: dict[str, str]) -> None:
    # readings outside the domain land in its end values (the default grid follows the data instead)
    out = q(demo, "cdf", "--at", "-50", "0", "21", "500").stdout
    rows = [ln for ln in out.splitlines() if not ln.startswith("#") and re.match(r"^ +\d+ ", ln)]
    assert re.search(r"^ +0 +< -39\.9 ", rows[0]) and re.search(r"^ +4095 +>= 369\.5 ", rows[-1]), out
    assert "[-," not in out and ", -)" not in out and "00000000" not in out
    flagged = [ln for ln in rows if ln.endswith("  !")]
    for ln in rows:  # a row is flagged exactly when its CDF estimate is outside its interval
        cdf, lo, hi = (float(x) for x in re.findall(r"(-?\d+\.\d{4})", ln)[-3:])
        assert (ln in flagged) == (not min(lo, hi) <= cdf <= max(lo, hi)) or "!" in ln, ln
    if flagged:
        assert "# ! = %d noisy estimate(s) outside their own interval" % len(flagged) in out


def test_demo_without_a_terminal_does_not_claim_a_running_dashboard() -> None:
    r = pansketch("demo", "--agents", "1", "--windows", "1", "--events", "200", "--w", "64", "--items", "50",
                  "--cs-only", "--port", "0")
    if "no MQTT broker available" in r.stderr:
        pytest.skip(r.stderr)
    assert r.returncode == 0, r.stderr
    assert "keeps it running" not in r.stdout and "dashboard: not running" in r.stdout


def test_check_has_no_tree_line_for_dcs_and_dbits_and_describes_dbits(tmp_path: Any) -> None:
    from tests.support.e2e import agent_env

    for kind, body, want in (("dbits", 'kind = "dbits"\nd = 16\nw = 256\n[privacy]\nmechanism = "dlap"\n'
                                         'budget = "1"\n', "dbits: 16 levels of 256 bits"),
                             ("dcs", 'kind = "dcs"\nb = 12\nd = 4\nw = 256\nmap = [10, 1, -40]\n',
                              "dcs b=12 (13 levels) d=4 w=256")):
        cfg = tmp_path / ("%s.toml" % kind)
        cfg.write_text('[device]\nid = "x1"\nsalt = "saltsalt1"\n[storage]\ndir = "st"\n[sketch]\n' + body)
        r = subprocess.run([sys.executable, "-m", "pansketch.agent.pi.daemon", "check", "--config", str(cfg), "--offline"],
                           capture_output=True, text=True, cwd=REPO, env=agent_env(), timeout=60)
        assert r.returncode == 0, r.stderr
        assert want in r.stdout and "range noise" not in r.stdout and "tree mode" not in r.stdout, r.stdout
        assert "(16 counters)" not in r.stdout


@needs_mosquitto
def test_dashboard_details_caption_chart_x_and_fleet_columns(demo: dict[str, str]) -> None:
    import html as htmlmod
    import urllib.request

    from pansketch.host_tools.demo import T0
    from tests.support.dash import Server

    s = Server(demo["conf"])
    try:
        def get(path: str) -> str:
            with urllib.request.urlopen(s.url + path, timeout=30) as r:
                return r.read().decode("utf-8")

        page = get("/item?item=host-00001.example&per_device=1")
        note = re.search(r'<p class="note">Estimated count per.*?</p>', page, re.S)
        assert note and "one line per device" in note.group(0) and "whole fleet" not in note.group(0), note
        data = json.loads(htmlmod.unescape(re.search(r'<script type="application/json" id="series-data">(.*?)'
                                                     r'</script>', page, re.S).group(1)))
        assert data["x"] == [T0, T0 + 3600, T0 + 7200]  # bucket starts, like the table's FROM column
        assert "2026-01-01T00:00:00Z" in page or "2026-01-01 00:00" in page
        fleet = get("/")
        heads = re.findall(r"<th[^>]*>([^<]+)</th>", re.search(r'<table id="devices".*?</thead>', fleet,
                                                               re.S).group(0))
        assert heads[:2] == ["device", "status"], heads  # the status is never scrolled out of view
        assert 'class="wrap">guarantee per event' in fleet
    finally:
        s.stop()


@needs_mosquitto
def test_freq_plot_subtitle_is_not_clipped(demo: dict[str, str], tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    import numpy as np
    from PIL import Image

    png = str(tmp_path / "f.png")
    r = q(demo, "freq", "host-00001.example", "x", "--plot", png)
    assert r.returncode == 0, r.stderr
    px = np.asarray(Image.open(png).convert("L"), dtype=np.int16)
    top = px[: px.shape[0] // 4]  # the title block
    assert (top[:, -4:] > 240).all(), "title text reaches the right edge: clipped"
