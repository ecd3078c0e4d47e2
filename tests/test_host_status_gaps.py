"""Gap detection: every seq of a device is stored, rejected, pending or lost (docs/FORMAT.md section 3).

SQLite only: releases go through the real Aggregator.handle, device status messages through
pansketch.host_tools.ingest.devstatus (what the aggregator calls for ``<prefix>/+/status``).
"""

from __future__ import annotations

import io
import json
import os
import sqlite3
import subprocess
import sys
from types import SimpleNamespace

import pytest
from pansketch.host_tools import hostconfig
from pansketch.host_tools.ingest import devstatus
from pansketch.host_tools.query import status
from pansketch.host_tools.ingest.aggregator import Aggregator
from pansketch.host_tools.store.rows import DeviceStatus
from pansketch.host_tools.store.sqlite import Store
from tests.support.host import SALT, T0, encoded, host_cfg, params, topic
from tests.support.host_status_gaps import E0, REPO, status_msg


def st(next_seq, oldest_pending=None, pending=0):
    return DeviceStatus("x", 0.0, 1, next_seq, oldest_pending, pending, None, 0, {}, "online", 0.0)


# -- classification ------------------------------------------------------------
def test_loss_at_seq_0_is_visible_without_a_status():
    c = status.classify([1, 2, 3], {}, None)
    assert c["basis"] == "no device status yet" and c["checked"] == [0, 4]
    assert (c["unknown_seqs"], c["unknown_count"], c["lost_count"], c["pending_count"]) == ([0], 1, None, None)
    assert status.classify([], {}, None)["checked"] == [0, 0]


def test_status_splits_lost_from_pending():
    # released 0..9; the device still holds 6.. (oldest_pending); 0 and 4 were never stored
    c = status.classify([1, 2, 3, 5, 7], {}, st(10, 6, 4))
    assert c["checked"] == [0, 10]
    assert (c["lost_seqs"], c["pending_seqs"], c["stored_count"]) == ([0, 4], [6, 8, 9], 5)
    # empty outbox: everything below next_seq is either stored or lost
    c = status.classify([0, 1, 3], {}, st(4))
    assert (c["lost_seqs"], c["pending_count"]) == ([2], 0)


def test_rejected_seqs_are_neither_lost_nor_pending():
    c = status.classify([0, 2], {1: "conflict", 5: "noise", 2: "internal"}, st(7, 4))
    assert c["rejected_seqs"] == [1, 5] and c["rejected_codes"] == {"1": "conflict", "5": "noise"}
    assert (c["lost_seqs"], c["pending_seqs"]) == ([3], [4, 6])  # 2 was stored later: stored wins


def test_stale_status_never_calls_later_releases_lost():
    # the status is older than the stored releases: seqs released after it are pending, not lost
    c = status.classify([0, 1, 2, 3, 8], {}, st(3))
    assert c["checked"] == [0, 9] and c["lost_count"] == 0 and c["pending_seqs"] == [4, 5, 6, 7]


def test_huge_next_seq_is_counted_not_enumerated():
    c = status.classify([0, 5], {}, st(10 ** 15, 10 ** 15 - 3), max_jump=None)  # unbounded: counted, not listed
    assert c["lost_count"] == 10 ** 15 - 3 - 2 and len(c["lost_seqs"]) == status.LIST_LIMIT
    assert c["lost_seqs"][:5] == [1, 2, 3, 4, 6] and c["pending_count"] == 3


def test_seq_ranges_text():
    assert status.seq_ranges([0, 1, 2, 4, 6, 7, 7]) == "0-2, 4, 6-7"
    assert status.seq_ranges(list(range(100)), limit=3) == "0-2"


# -- device status messages ------------------------------------------------------
def test_status_messages_are_validated_and_kept_newest(tmp_path):
    s = Store(str(tmp_path / "s.db"))
    assert devstatus.status_filter(host_cfg(tmp_path)) == "pansketch/+/status"
    assert devstatus.record(s, *status_msg("pi-1", ts=T0, next_seq=5, oldest_pending=3, pending=2))
    assert not devstatus.record(s, *status_msg("pi-1", ts=T0, next_seq=5, oldest_pending=3, pending=2))  # same
    assert not devstatus.record(s, *status_msg("pi-1", ts=T0 - 60, next_seq=2))  # older: ignored
    # the last will keeps the numbers and changes the state
    assert devstatus.record(s, "pansketch/pi-1/status", b'{"state":"offline"}')
    d = s.device_statuses()["pi-1"]
    assert (d.state, d.next_seq, d.oldest_pending, d.pending, d.ts) == ("offline", 5, 3, 2, T0)
    assert devstatus.record(s, *status_msg("pi-1", ts=T0 + 60, next_seq=6))
    d = s.device_statuses()["pi-1"]
    assert (d.state, d.next_seq, d.oldest_pending) == ("online", 6, None)
    bad = [("pansketch/pi-1/status", b"\xff"), ("pansketch/pi-1/status", b"[1]"),
           status_msg("pi-1", dev="pi-2"), status_msg("pi-1", next_seq=-1), status_msg("pi-1", next_seq=True),
           status_msg("pi-1", next_seq=3, oldest_pending=3), ("pansketch/pi-1/status", b" " * 5000),
           ("pansketch/pi-1/release", b"{}"), ("pansketch/bad id/status", b"{}")]
    for t, pl in bad:
        assert not devstatus.record(s, t, pl), (t, pl)
    assert set(s.device_statuses()) == {"pi-1"} and s.device_statuses()["pi-1"].next_seq == 6
    s.close()


def test_handle_message_records_and_acks_only_status_topics(tmp_path):
    s = Store(str(tmp_path / "s.db"))
    acked = []
    client = SimpleNamespace(ack=lambda mid, qos: acked.append(mid))
    t, pl = status_msg("pi-1", next_seq=1)
    assert devstatus.handle_message(s, client, SimpleNamespace(topic=t, payload=pl, mid=7, qos=1))
    assert devstatus.handle_message(s, client, SimpleNamespace(topic=t, payload=b"junk", mid=8, qos=1))
    assert not devstatus.handle_message(s, client, SimpleNamespace(topic="pansketch/pi-1/release", payload=b"",
                                                                   mid=9, qos=1))
    assert acked == [7, 8] and s.device_statuses()["pi-1"].next_seq == 1
    s.close()


# -- the report ----------------------------------------------------------------
def _fleet(tmp_path):
    """pi-1 released 0..7: 0 and 3 never arrived, 6 and 7 are still on it, 4 was refused (conflict), 5 came
    two hours after its window; pi-2 only published a status (no release: not a fleet member); pi-3 has no
    status."""
    a = Aggregator(host_cfg(tmp_path))
    p1, p3 = params("pi-1"), params("pi-3")
    end = lambda k: (E0 + k + 1) * 3600  # noqa: E731  (end of window E0+k)
    for k in (1, 2):
        assert a.handle(topic("pi-1"), encoded(p1, seq=k, elo=E0 + k), received=end(k) + 5).stored
    assert a.handle(topic("pi-1"), encoded(p1, seq=5, elo=E0 + 5), received=end(5) + 7200).stored
    assert a.handle(topic("pi-1"), encoded(p1, seq=4, elo=E0 + 2, fill=3), received=end(4)).status == "rejected"
    devstatus.record(a.store, *status_msg("pi-1", next_seq=8, oldest_pending=6, pending=2, rejected=1),
                     received=end(7))
    devstatus.record(a.store, *status_msg("pi-2", next_seq=3, oldest_pending=0, pending=3), received=end(3))
    for k in (1, 3):
        assert a.handle(topic("pi-3"), encoded(p3, seq=k, elo=E0 + k), received=end(k)).stored
    return a


def test_report_lists_lost_pending_rejected_late_and_backlog(tmp_path):
    a = _fleet(tmp_path)
    rep = status.report(a.store, now=(E0 + 10) * 3600)
    devs = {d["device"]: d for d in rep["devices"]}
    d1 = devs["pi-1"]
    assert (d1["lost_seqs"], d1["pending_seqs"], d1["rejected_seqs"], d1["late_seqs"]) == ([0, 3], [6, 7], [4], [5])
    assert d1["rejected_codes"] == {"4": "conflict"} and d1["backlog"] == 2 and d1["checked"] == [0, 8]
    assert d1["missing_seqs"] == [0, 3, 4, 6, 7] and d1["missing_seq_count"] == 5
    assert d1["status"]["next_seq"] == 8 and d1["late_max_s"] == 7200
    assert "pi-2" not in devs  # its status claims a backlog of 3: not counted without a release
    d3 = devs["pi-3"]
    assert d3["status"] is None and (d3["unknown_seqs"], d3["lost_count"], d3["pending_count"]) == ([0, 2], None, None)
    assert rep["delivery"] == {"lost": 2, "pending": 2, "rejected": 1, "late": 1, "unknown": 2, "backlog": 2, "quarantined": 0, "statuses_ignored": 0,
                               "devices_without_status": 1}
    # a longer grace: nothing late
    assert status.report(a.store, late_grace_s=7300)["delivery"]["late"] == 0
    out = io.StringIO()
    status.print_report(rep, (E0 + 10) * 3600, out)
    text = out.getvalue()
    assert "delivery: 2 lost, 2 pending, 1 rejected, 1 late, 2 unknown (no device status yet)" in text
    assert "pi-1: LOST (not stored, no longer on the device): seq 0, 3" in text
    assert "pi-1: pending (still on the device, re-sent until stored): seq 6-7" in text
    assert "pi-1: rejected by the host: seq 4 (conflict)" in text
    assert "pi-1: late (received more than the grace after their epochs ended, up to 2h): seq 5" in text
    assert "pi-3: sequence numbers not received, no device status yet (lost or still on the device): 0, 2" in text
    assert "pi-2" not in text
    a.close()


@pytest.mark.slow
def test_status_cli_json_and_grace(tmp_path):
    _fleet(tmp_path).close()
    conf = tmp_path / "host.toml"
    conf.write_text('[aggregator]\ndb = "host.db"\n[fleet]\nsalt = "%s"\n[status]\nlate_grace_s = 10000\n' % SALT)
    env = dict(os.environ, PYTHONPATH=REPO)
    run = lambda *a: subprocess.run([sys.executable, "-m", "pansketch.host_tools.cli", "status", "--config", str(conf), *a],  # noqa: E731
                                    capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    r = run("--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["delivery"]["lost"] == 2 and rep["delivery"]["late"] == 0  # grace from the config
    r = run("--json", "--late-grace", "60")
    assert json.loads(r.stdout)["delivery"]["late"] == 1
    r = run()
    assert r.returncode == 0 and "LOST" in r.stdout and "BACKLOG" in r.stdout
    assert run("--late-grace", "-1").returncode == 2
    assert hostconfig.from_dict({"fleet": {"salt": SALT}}).status.late_grace_s is None


def test_old_database_rejections_get_their_seq_on_write_open(tmp_path):
    # old databases kept whole payloads (now a bounded prefix): keep enough to reach 'seq' after 'ctr'
    a = Aggregator(host_cfg(tmp_path, aggregator={"reject_keep_bytes": 65536}))
    p = params("pi-1")
    assert a.handle(topic("pi-1"), encoded(p, seq=0)).stored
    assert a.handle(topic("pi-1"), encoded(p, seq=1, fill=2)).status == "rejected"  # conflict
    a.handle(topic("pi-1"), b"garbage")
    a.close()
    db = str(tmp_path / "host.db")
    con = sqlite3.connect(db)
    con.execute("ALTER TABLE rejections DROP COLUMN seq")
    con.execute("DROP TABLE device_status")
    con.commit()
    con.close()
    ro = Store(db, readonly=True)  # unmigrated, read-only: no seqs attributed, no status table, no error
    assert ro.rejected_seqs() == {} and ro.device_statuses() == {}
    assert status.report(ro)["devices"][0]["checked"] == [0, 1]  # seq 1 unseen: the refusal is unattributed
    ro.close()
    s = Store(db)
    assert s.rejected_seqs() == {"pi-1": {1: "conflict"}}
    s.close()
