"""Strings a device chose reach the operator as text: never as terminal controls, formulas or forged lines.

A device plants strings with ESC, CR and LF in a strhh sketch and in its status message; the real
CLI (``pansketch query heavy``, ``pansketch status``, their ``--json`` and ``--csv``) and the host's
log lines must show them escaped. Status messages are checked on receipt: state from a fixed set,
kind and mode as a release may have them, and a status alone makes no fleet member.
"""

from __future__ import annotations

import array
import csv
import io
import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from pansketch.agent import release
from pansketch.agent.params import Params
from pansketch.host_tools.output import textsafe
from pansketch.host_tools.ingest import devstatus
from pansketch.host_tools.ingest.decode import decode
from pansketch.host_tools.query import status, strheavy
from pansketch.host_tools.store.sqlite import Store
from tests.support.host_status_gaps import status_msg
from tests.support.host import SALT, T0, encoded, params, topic

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
L, D, W = 24, 3, 256
CLEAR = "\x1b[2J\x1b[1;31mPWNED"
OVERWRITE = "ok\rFAKE-LINE"
FORMULA = '=HYPERLINK("http://x")'  # 22 bytes: whole in a len-24 sketch
NEWLINE = "a\nb"
PLANTED = [CLEAR, OVERWRITE, FORMULA, NEWLINE]
# what a terminal must never receive from device data: ESC, CR, and the C1 CSI
RAW = ("\x1b", "\r", "\x9b")


def _cli(conf, *args):
    env = dict(os.environ, PYTHONPATH=REPO)
    r = subprocess.run([sys.executable, "-m", "pansketch.host_tools.cli", *args, "--config", str(conf)],
                       capture_output=True, env=env, cwd=REPO, timeout=120)
    # decoded by hand: text mode's universal newlines would turn a CR the command wrote into LF
    return subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode("utf-8"), r.stderr.decode("utf-8"))


def _conf(tmp_path):
    conf = tmp_path / "host.toml"
    conf.write_text('[aggregator]\ndb = "host.db"\n[fleet]\nsalt = "%s"\n' % SALT)
    return conf


@pytest.fixture(scope="module")
def strhh_db(tmp_path_factory):
    """One strhh device, 4 windows, each string planted 3000 times among 9000 events (noise at eps = 1)."""
    root = tmp_path_factory.mktemp("strhh")
    st = Store(str(root / "host.db"))
    rng = np.random.default_rng(3)
    p = Params({"device": "pi-s", "salt": SALT, "kind": "strhh", "len": L, "d": D, "w": W,
                "mechanism": "dlap", "budget": "1", "persist_noise": "refresh"})
    base = strheavy.exact_counters(PLANTED + ["r%d" % i for i in range(300)], L, D, W, SALT,
                                   [3000] * len(PLANTED) + [10] * 300)
    scale = p.noise.num / p.noise.den
    q = np.exp(-1.0 / scale)
    for win in range(4):
        noise = rng.geometric(1 - q, base.shape) - rng.geometric(1 - q, base.shape)
        ctr = array.array("i", (base + noise).astype(np.int32).ravel().tobytes())
        raw = release.encode(p, win, T0 // 3600 + win, T0 // 3600 + win + 1, win, ctr)
        assert st.insert(decode(raw, "pansketch/pi-s/release")) == "stored"
    st.close()
    return root


@pytest.mark.slow
def test_heavy_strings_are_printed_escaped(strhh_db):
    r = _cli(_conf(strhh_db), "query", "heavy", "-k", "10")
    assert r.returncode == 0, r.stderr
    for c in RAW:
        assert c not in r.stdout, repr(r.stdout)
    assert r.stdout.count("\n") == len(r.stdout.splitlines())  # no line the device wrote itself
    for s in PLANTED:
        assert textsafe.term(s) in r.stdout, (s, r.stdout)
    assert "\\x1b[2J\\x1b[1;31mPWNED" in r.stdout and "ok\\rFAKE-LINE" in r.stdout and "a\\nb" in r.stdout


@pytest.mark.slow
def test_heavy_json_and_csv_keep_the_strings_and_no_controls(strhh_db):
    conf = _conf(strhh_db)
    r = _cli(conf, "query", "heavy", "-k", "10", "--json")
    assert r.returncode == 0, r.stderr
    assert not any(c in r.stdout for c in RAW)
    items = {json.loads(ln)["item"] for ln in r.stdout.splitlines()}
    assert set(PLANTED) <= items  # the JSON is the data: decoded, the exact strings
    r = _cli(conf, "query", "heavy", "-k", "10", "--csv")
    assert r.returncode == 0, r.stderr
    assert not any(c in r.stdout for c in RAW)
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert len(rows) == len(r.stdout.splitlines()) - 1  # one line per row: no cell spans lines
    cells = {row["item"] for row in rows}
    assert "'" + FORMULA in cells  # shown as text by a spreadsheet, not a formula
    assert not any(c.startswith(("=", "+", "@")) for row in rows for c in row.values())
    assert "ok\\rFAKE-LINE" in cells and "a\\nb" in cells


def test_csv_cells_neutralised():
    out = io.StringIO()
    from pansketch.host_tools.query import csvout

    csvout.write([{"a": "=1+2", "b": "+x", "c": "-cmd|' /C calc'!A0", "d": "@SUM(A1)", "e": "\tx", "f": "\rx",
                   "g": "-3.5", "h": -3, "i": "ok\rFAKE", "j": "plain"}], out)
    row = next(csv.DictReader(io.StringIO(out.getvalue())))
    assert row == {"a": "'=1+2", "b": "'+x", "c": "'-cmd|' /C calc'!A0", "d": "'@SUM(A1)", "e": "'\\tx",
                   "f": "'\\rx", "g": "-3.5", "h": "-3", "i": "ok\\rFAKE", "j": "plain"}
    assert "\r" not in out.getvalue()


def test_term_escapes_controls_and_keeps_text():
    assert textsafe.term("caf\u00e9 \u2603 \U0001f600") == "caf\u00e9 \u2603 \U0001f600"
    assert textsafe.term("\x1b]8;;http://x\x07y\x1b]8;;\x07") == "\\x1b]8;;http://x\\x07y\\x1b]8;;\\x07"
    assert textsafe.term("\x9b2J\x7f\u202eevil\u2028") == "\\u009b2J\\u007f\\u202eevil\\u2028"
    assert json.loads(textsafe.json_text({"k": "\x9b\u202e\x1b"})) == {"k": "\x9b\u202e\x1b"}
    assert not any(c in textsafe.json_text({"k": "\x9b\u202e\x1b"}) for c in "\x9b\u202e\x1b")


# -- the status message --------------------------------------------------------
def test_status_fields_from_the_fixed_sets_only(tmp_path):
    s = Store(str(tmp_path / "s.db"))
    for bad in ({"state": "online\n\x1b[2Jfake"}, {"state": "rebooting"}, {"state": 1},
                {"kind": "\x1b]8;;http://evil\x07cs\x1b]8;;\x07"}, {"mode": "window\r"}, {"mode": "hourly"},
                {"kind": "cs\u202e"}, {"clock": "\x1b[2J"}):
        assert not devstatus.record(s, *status_msg("pi-1", next_seq=1, **bad)), bad
    assert s.device_statuses() == {}
    for good in ({"state": "online"}, {"kind": "strhh", "mode": "tree", "next_seq": 2}, {"clock": "synced",
                                                                                        "next_seq": 3}):
        assert devstatus.record(s, *status_msg("pi-1", **dict({"next_seq": 1}, **good))), good
    assert devstatus.record(s, "pansketch/pi-1/status", b'{"state":"offline"}')
    s.close()


def test_a_status_alone_makes_no_fleet_member(tmp_path):
    s = Store(str(tmp_path / "host.db"))
    assert devstatus.record(s, *status_msg("ghost", next_seq=3, oldest_pending=0, pending=3))
    rep = status.report(s, now=T0 + 86400)
    assert rep["devices"] == [] and rep["delivery"]["pending"] == 0 and rep["delivery"]["backlog"] == 0
    # once it releases it is a member, with its status
    assert s.insert(decode(encoded(params("ghost"), seq=0), topic("ghost"))) == "stored"
    rep = status.report(s, now=T0 + 86400)
    assert [d["device"] for d in rep["devices"]] == ["ghost"] and rep["devices"][0]["status"]["next_seq"] == 3
    s.close()


@pytest.mark.slow
def test_status_cli_shows_stored_device_strings_escaped(tmp_path):
    """A store that kept a hostile status (written before the checks, or by a direct write): the text,
    --json and --csv outputs of ``pansketch status`` still show every field escaped."""
    s = Store(str(tmp_path / "host.db"))
    assert s.insert(decode(encoded(params("pi-1"), seq=0), topic("pi-1"))) == "stored"
    evil = "online\n\x1b[2Jpi-9  FAKE ROW\x1b]8;;http://evil\x07"
    s.put_status("pi-1", {"state": evil, "next_seq": 1, "ts": T0}, T0)
    s.close()
    conf = _conf(tmp_path)
    for args in ((), ("--json",), ("--csv",)):
        r = _cli(conf, "status", *args)
        assert r.returncode == 0, r.stderr
        assert not any(c in r.stdout for c in RAW), (args, r.stdout)
        assert "FAKE ROW" in r.stdout and not any(ln.startswith("pi-9") for ln in r.stdout.splitlines())


def test_log_lines_escape_device_strings(tmp_path):
    """The host's log handler (pansketch aggregate/serve) writes a refused status's reason on one line."""
    from pansketch.host_tools.logsetup import setup_logging

    setup_logging()
    buf = io.StringIO()
    handler = logging.getLogger("pansketch").handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    old = handler.setStream(buf)
    try:
        s = Store(str(tmp_path / "s.db"))
        devstatus.record(s, "pansketch/pi-1/status\x1b[2J", b"{}")  # not a status topic: its name is logged
        devstatus.record(s, *status_msg("pi-1", next_seq="\x1b[2J\rFAKE\n2026 pansketch ERROR forged"))
        s.close()
    finally:
        handler.setStream(old)
    text = buf.getvalue()
    assert text.count("\n") == 2 and "\x1b" not in text and "\r" not in text, repr(text)
    assert "\\x1b[2J\\rFAKE\\n2026" in text
