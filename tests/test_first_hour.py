"""A new user's first hour (issue 24): the demo shows every kind, mixed-kind stores just work,
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

from tests.broker import needs_mosquitto
from tests.dash_support import REPO, env

DEMO = ["--agents", "2", "--windows", "3", "--events", "2000", "--w", "256", "--items", "500"]
KIND_DEVICES = {"cms": "demo-cms-1", "tree": "demo-tree-1", "dcs": "demo-temp-1", "dbits": "demo-door-1"}


def pansketch(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "host_tools.cli", *args], capture_output=True, text=True,
                          env=env(), cwd=REPO, timeout=120, input=stdin)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: Any) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("first-hour") / "demo")
    r = pansketch("demo", *DEMO, "--dir", root)
    assert r.returncode == 0, r.stdout + r.stderr
    return {"conf": os.path.join(root, "host.toml"), "dir": root, "out": r.stdout}


def q(demo: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return pansketch("query", "--config", demo["conf"], *args)


def jlines(r: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert r.returncode == 0, r.stderr
    return [json.loads(x) for x in r.stdout.splitlines() if x.strip()]


# -- item 3: a demo with every kind ----------------------------------------------------------------
@needs_mosquitto
def test_demo_prints_one_short_line_per_kind(demo: dict[str, str]) -> None:
    for kind, dev in KIND_DEVICES.items():
        m = re.search(r"^  %s +%s .*$" % (kind, dev), demo["out"], re.M)
        assert m, demo["out"]
        assert len(m.group(0)) <= 130, m.group(0)
        assert re.search(r"true (median )?[0-9.]+$", m.group(0)), m.group(0)


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
    assert jlines(q(demo, "heavy", "-k", "2", "--json"))[0]["devices"] == ["demo-temp-1"]
    assert jlines(q(demo, "distinct", "--json"))[0]["devices"] == ["demo-door-1"]
    # naming a device of the other point kind still answers from it alone
    a = jlines(q(demo, "freq", "host-00001.example", "--device", "demo-cms-1", "--json"))[0]
    assert a["devices"] == ["demo-cms-1"] and a["kind"] == "cms"
    # a device of the wrong kind for the query: one line saying which kind it is
    r = q(demo, "quantile", "--q", "0.5", "--device", "demo-door-1")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "dbits" in r.stderr, r.stderr


def test_a_store_without_the_kind_says_what_it_holds(tmp_path: Any) -> None:
    """quantile on a cs-only store: which kinds it holds and what they answer (not a merge error)."""
    from tests.test_dashboard_kinds import _cs_device, _store, _write_conf

    conf = _write_conf(str(tmp_path))
    _store(conf, {"cs-1": _cs_device()})
    r = pansketch("query", "--config", conf, "quantile", "--q", "0.5")
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "no releases of kind dcs in this store; it holds cs (1 device: freq, topk, series)" in r.stderr


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
