"""Privacy ledger and ``pansketch status``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from fractions import Fraction

import pytest
from pansketch.host_tools.audit.stats import zcdp_to_dp as zcdp_to_approx_dp  # the one conversion (ledger)
from pansketch.host_tools.store import ledger
from pansketch.host_tools.query import status
from pansketch.host_tools.ingest.aggregator import Aggregator
from tests.support.host import SALT, T0, encoded, host_cfg, params, topic

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
W0 = T0 // 3600


def fill(tmp_path):
    a = Aggregator(host_cfg(tmp_path))
    # keep mode, 6 epochs of 10 min per hour, rho = 1/2: all 12 epochs of two windows, but epoch 8 missing
    pk = params("keep", mode="keep", window_s=3600, epoch_s=600, w=16, budget="1/2")
    e0 = T0 // 600
    seq = 0
    for k in range(12):
        if k == 8:
            seq += 1  # the release of epoch 8 never arrived (seq 8 missing too)
            continue
        assert a.handle(topic("keep"), encoded(pk, seq=seq, elo=e0 + k)).stored
        seq += 1
    # window mode, dlap eps = 1 in window 0, eps = 2 in window 1 (reconfigured), window 3 after a gap
    for k, eps in ((0, "1"), (1, "2"), (3, "1")):
        pw = params("win", w=16, mechanism="dlap", budget=eps)
        assert a.handle(topic("win"), encoded(pw, seq=k, elo=W0 + k)).stored
    # an early flush: two parts of one epoch, and a device reset reusing seq 0
    pf = params("flush", w=16, budget="1/8")
    assert a.handle(topic("flush"), encoded(pf, seq=0, elo=W0, part=0)).stored
    assert a.handle(topic("flush"), encoded(pf, seq=1, elo=W0, part=1)).stored
    assert a.handle(topic("flush"), encoded(pf, seq=0, elo=W0 + 5)).stored
    return a


def test_ledger_per_window_is_per_release_not_summed(tmp_path):
    a = fill(tmp_path)
    led = ledger.build(a.store.releases(), delta=1e-6)
    by = {(e.device, e.win): e for e in led.windows}
    k0 = by[("keep", W0)]
    assert k0.releases == 6 and k0.guarantee.rho == Fraction(1, 2) and k0.guarantee.eps is None
    assert math.isclose(k0.guarantee.eps_delta, zcdp_to_approx_dp(0.5, 1e-6))
    k1 = by[("keep", W0 + 1)]
    assert k1.releases == 5 and k1.missing == [(T0 // 600 + 8, T0 // 600 + 9)]
    assert by[("win", W0)].guarantee.eps == 1 and by[("win", W0 + 1)].guarantee.eps == 2
    assert by[("flush", W0)].releases == 2 and by[("flush", W0)].guarantee.rho == Fraction(1, 8)
    assert led.device("win").eps == 2 and led.device("keep").rho == Fraction(1, 2)
    fleet = {(ws, wn): (n, g) for ws, wn, n, g in led.fleet_windows()}
    n, g = fleet[(3600, W0)]
    assert n == 3 and g.eps == 1 and g.rho == Fraction(1, 2)
    assert math.isclose(g.eps_delta, max(1.0, zcdp_to_approx_dp(0.5, 1e-6)))
    assert led.fleet().eps == 2
    a.close()


def test_status_report_gaps_and_reuse(tmp_path):
    a = fill(tmp_path)
    rep = status.report(a.store, delta=1e-6, now=T0 + 10 * 3600)
    devs = {d["device"]: d for d in rep["devices"]}
    assert set(devs) == {"keep", "win", "flush"}
    k = devs["keep"]
    assert k["releases"] == 11 and k["missing_seqs"] == [8] and k["missing_epoch_count"] == 1
    assert k["missing_epochs"][0]["from"] == status.iso(T0 + 8 * 600)
    w = devs["win"]
    assert w["missing_epoch_count"] == 1 and w["missing_seqs"] == [2] and w["windows"] == 3
    assert w["guarantee"]["eps"] == "2"
    f = devs["flush"]
    assert f["seq_reused"] == [0] and f["missing_epoch_count"] == 4
    assert rep["releases"] == 11 + 3 + 3 and rep["fleet"]["guarantee"]["eps"] == "2"
    a.handle(topic("win"), b"garbage")
    rep = status.report(a.store, delta=1e-6)
    assert rep["rejections"] == 1 and rep["recent_rejections"][0]["code"] == "cbor"
    import io

    out = io.StringIO()
    status.print_report(rep, T0, out)
    text = out.getvalue()
    assert "keep" in text and "no device status yet (lost or still on the device): 8" in text and "used twice" in text
    assert "recent rejections" in text
    a.close()


@pytest.mark.slow
def test_status_cli(tmp_path):
    a = fill(tmp_path)
    a.close()
    conf = tmp_path / "host.toml"
    conf.write_text('[aggregator]\ndb = "host.db"\n[fleet]\nsalt = "%s"\n[query]\ndelta = "1e-9"\n' % SALT)
    env = dict(os.environ, PYTHONPATH=REPO)
    r = subprocess.run([sys.executable, "-m", "pansketch.host_tools.cli", "status", "--config", str(conf), "--json"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["fleet"]["guarantee"]["delta"] == 1e-9
    r = subprocess.run([sys.executable, "-m", "pansketch.host_tools.cli", "status", "--config", str(conf)],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert r.returncode == 0 and "DEVICE" in r.stdout and "privacy ledger" in r.stdout
    conf.write_text('[aggregator]\ndb = "missing.db"\n[fleet]\nsalt = "%s"\n' % SALT)
    r = subprocess.run([sys.executable, "-m", "pansketch.host_tools.cli", "status", "--config", str(conf)],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert r.returncode == 1 and "no database" in r.stderr


def test_guarantee_does_not_depend_on_nz_and_status_shows_draws(tmp_path):
    """Extra internal draws only add noise: same guarantee; status reports the mean/max nz."""
    a = Aggregator(host_cfg(tmp_path))
    p2 = params("two", w=16, mechanism="dlap", budget="1")
    p9 = params("many", w=16, mechanism="dlap", budget="1")
    assert a.handle(topic("two"), encoded(p2, nz=2)).stored
    assert a.handle(topic("many"), encoded(p9, nz=9)).stored
    assert a.handle(topic("many"), encoded(p9, seq=1, elo=W0 + 1, nz=4)).stored
    led = ledger.build(a.store.releases(), delta=1e-6)
    assert led.device("two").eps == led.device("many").eps == 1
    rep = status.report(a.store, delta=1e-6, now=T0)
    devs = {d["device"]: d for d in rep["devices"]}
    assert (devs["two"]["noise_draws_mean"], devs["two"]["noise_draws_max"]) == (2, 2)
    assert (devs["many"]["noise_draws_mean"], devs["many"]["noise_draws_max"]) == (6.5, 9)
    assert devs["many"]["guarantee"] == devs["two"]["guarantee"]
    import io

    out = io.StringIO()
    status.print_report(rep, T0, out)
    assert "noise draws 6.5 (max 9)" in out.getvalue()
    a.close()
