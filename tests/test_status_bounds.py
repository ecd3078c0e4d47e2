"""A device's status cannot forge fleet-wide loss or backlog: its counters are bounded by what the host has seen.

A retained status claiming ``next_seq`` 10^9 (or a backlog larger than the seqs it says it holds) is set
aside, with the reason shown, and the device's seqs are classified as without a status; a plausible
status from the same device is used as before. Real aggregator core and store (SQLite); the CLI and
the Prometheus gauges read the same report.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from pansketch.host_tools.ingest import devstatus
from pansketch.host_tools.ingest.aggregator import Aggregator
from pansketch.host_tools.query import status
from tests.support.host_status_gaps import E0, REPO, status_msg
from tests.support.host import SALT, encoded, host_cfg, params, topic


def _store(tmp_path, **st):
    a = Aggregator(host_cfg(tmp_path))
    p = params("pi-1")
    for k in range(6):
        assert a.handle(topic("pi-1"), encoded(p, seq=k, elo=E0 + k), received=(E0 + k + 1) * 3600).stored
    assert devstatus.record(a.store, *status_msg("pi-1", **st), received=(E0 + 7) * 3600)
    return a


def test_a_huge_next_seq_is_ignored_not_counted(tmp_path):
    a = _store(tmp_path, next_seq=10 ** 9, oldest_pending=6, pending=10 ** 9 - 6)
    rep = status.report(a.store, now=(E0 + 10) * 3600)
    d = rep["devices"][0]
    assert d["status_ignored"] and "max_seq_jump 100000" in d["status_ignored"]
    assert d["lost_count"] is None and d["pending_count"] is None and d["backlog"] is None
    assert d["checked"] == [0, 6] and d["unknown_count"] == 0
    t = rep["delivery"]
    assert (t["lost"], t["pending"], t["backlog"], t["statuses_ignored"]) == (0, 0, 0, 1), t
    out = io.StringIO()
    status.print_report(rep, (E0 + 10) * 3600, out)
    text = out.getvalue()
    assert "LOST (not stored" not in text and "1 device status(es) IGNORED" in text and "IGNORED (range" in text
    # the Prometheus gauges read the same report: no lost releases for the alert to fire on
    from pansketch.host_tools.metrics import StoreCollector

    fams = {f.name: f for f in StoreCollector(a.store.path).collect()}
    lost = [s for s in fams["pansketch_device_delivery_releases"].samples if s.labels.get("state") == "lost"]
    assert lost and all(s.value == 0 for s in lost), lost
    a.close()


def test_a_backlog_beyond_the_held_seqs_is_ignored(tmp_path):
    a = _store(tmp_path, next_seq=8, oldest_pending=6, pending=10 ** 9)
    d = status.report(a.store, now=(E0 + 10) * 3600)["devices"][0]
    assert "pending 1000000000 exceeds the 2 seq(s)" in d["status_ignored"] and d["backlog"] is None
    a.close()


def test_a_plausible_status_is_still_the_devices_word(tmp_path):
    a = _store(tmp_path, next_seq=8, oldest_pending=6, pending=2)
    rep = status.report(a.store, now=(E0 + 10) * 3600)
    d = rep["devices"][0]
    assert d["status_ignored"] is None and d["pending_seqs"] == [6, 7] and d["backlog"] == 2 and d["lost_count"] == 0
    # the bound follows [aggregator] max_seq_jump
    assert status.report(a.store, now=(E0 + 10) * 3600, max_seq_jump=1)["devices"][0]["status_ignored"]
    a.close()


@pytest.mark.slow
def test_status_cli_uses_the_configured_bound(tmp_path):
    _store(tmp_path, next_seq=10 ** 9, oldest_pending=6, pending=5).close()
    conf = tmp_path / "host.toml"
    env = dict(os.environ, PYTHONPATH=REPO)
    for jump, ignored in ((100000, True), (2 ** 32, False)):
        conf.write_text('[aggregator]\ndb = "host.db"\nmax_seq_jump = %d\n[fleet]\nsalt = "%s"\n' % (jump, SALT))
        r = subprocess.run([sys.executable, "-m", "pansketch.host_tools.cli", "status", "--config", str(conf), "--json"],
                           capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout)
        assert (rep["delivery"]["statuses_ignored"] == 1) is ignored, rep["delivery"]
        assert (rep["delivery"]["pending"] > 10 ** 8) is not ignored
