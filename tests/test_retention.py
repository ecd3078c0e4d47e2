"""Retention (docs/HOST.md "Retention"): raw payloads pruned once rolled up; the record of every
(device, seq, payload hash) outlives pruning.

Real releases through the real Aggregator and a SQLite store. Each statement of the retention
rule has its test: only rolled-up releases received before the cut lose their bytes; a late
re-send of a pruned release is a duplicate (and acknowledged as stored), different bytes are a
conflict; roll-ups (and so fleet queries) do not change and are not counted twice; ``status``
accounts for every seq; a query that needs pruned counters says so in one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

from pansketch.host_tools import hostconfig
from pansketch.host_tools.ingest.acks import group_acks
from pansketch.host_tools.ingest.aggregator import Aggregator
from pansketch.host_tools.query import core as query
from pansketch.host_tools.query import status
from pansketch.host_tools.store import payloadcodec
from pansketch.host_tools.store.errors import PrunedError
from pansketch.host_tools.store.sqlite import Store
from tests.support.broker import needs_mosquitto, start_mosquitto
from tests.support.host import SALT, T0, encoded, host_cfg, params, topic

E0 = T0 // 3600
OLD = float(T0 + 86400)  # received times (after the epochs): "old" releases (pruned by a cut at CUT), "new" ones
NEW = OLD + 4000.0
CUT = OLD + 1000.0


def _fill(tmp: Any) -> tuple[Aggregator, dict[tuple[str, int], bytes]]:
    """Two devices, 4 hourly window releases each: seqs 0-2 received OLD, seq 3 received NEW."""
    agg = Aggregator(host_cfg(tmp))
    sent: dict[tuple[str, int], bytes] = {}
    for dev in ("a", "b"):
        p = params(dev)
        for k in range(4):
            raw = encoded(p, seq=k, elo=E0 + k, fill=k + (7 if dev == "b" else 1))
            sent[(dev, k)] = raw
            assert agg.handle(topic(dev), raw, received=OLD if k < 3 else NEW).stored
    return agg, sent


def _payload_sizes(st: Store) -> dict[tuple[str, int], int]:
    """(device, seq) -> bytes of the release as sent (decoded from the stored encoding; 0: pruned)."""
    return {(r[0], int(r[1])): len(payloadcodec.decode(bytes(r[2])))
            for r in st._q("SELECT device, seq, payload FROM releases")}


def test_prune_drops_only_rolled_up_payloads_received_before_the_cut(tmp_path):
    agg, sent = _fill(tmp_path)
    st = agg.store
    sums_before = [s.copy() for s in st.rollup_sums([r.id for r in st.rollups()])]
    assert st.prune(CUT) == 6 and st.pruned_count() == 6
    sizes = _payload_sizes(st)
    assert all(sizes[(d, k)] == 0 for d in "ab" for k in range(3))
    assert all(sizes[(d, 3)] == len(sent[(d, 3)]) for d in "ab")  # received after the cut: kept
    assert st.prune(CUT) == 0  # nothing left before the cut; the watermark skips what is done
    # the record: key, seq, hash, parameters stay
    rows = {(r.device, r.seq): r for r in st.releases()}
    assert len(rows) == 8
    got = {(r[0], int(r[1])): r[2] for r in st._q("SELECT device, seq, sha256 FROM releases")}
    import hashlib

    assert got == {k: hashlib.sha256(v).hexdigest() for k, v in sent.items()}
    # roll-ups untouched
    sums_after = list(st.rollup_sums([r.id for r in st.rollups()]))
    assert all(np.array_equal(a, b) for a, b in zip(sums_before, sums_after))
    agg.close()


def test_unrolled_releases_are_never_pruned(tmp_path):
    """dcs releases (no roll-up sums them) keep their bytes whatever their age."""
    from pansketch.host_tools.ingest.decode import decode
    from tests.support import dcs_host as dcs
    with Store(str(tmp_path / "dcs.db")) as st:
        p = dcs.params("d-0")
        for k in range(3):
            assert st.insert(decode(dcs.payload(p, [1, 2, 3], seq=k, epoch=dcs.T0 // 3600 + k),
                                    dcs.topic(p.device)), received=OLD) == "stored"
        assert st.prune(CUT) == 0 and st.pruned_count() == 0
        assert all(n > 0 for n in _payload_sizes(st).values())


def test_prune_batches_are_bounded_and_resume(tmp_path):
    agg, _sent = _fill(tmp_path)
    assert [agg.store.prune(CUT, limit=4), agg.store.prune(CUT, limit=4), agg.store.prune(CUT, limit=4)] == [4, 2, 0]
    assert agg.store.pruned_count() == 6
    agg.close()


def test_late_resend_of_a_pruned_release_is_a_duplicate_and_acknowledged(tmp_path):
    agg, sent = _fill(tmp_path)
    agg.store.prune(CUT)
    n_roll = sum(r.releases for r in agg.store.rollups())
    sums = [s.copy() for s in agg.store.rollup_sums([r.id for r in agg.store.rollups()])]
    out = agg.handle(topic("a"), sent[("a", 1)])
    assert out.status == "duplicate" and out.seq == 1
    assert json.loads(group_acks([(topic("a"), out)])[0][1]) == {"dev": "a", "ok": [1]}
    # nothing counted twice: the roll-ups are as before, the payload stays pruned
    assert sum(r.releases for r in agg.store.rollups()) == n_roll == 8
    assert all(np.array_equal(a, b) for a, b in zip(sums, agg.store.rollup_sums([r.id for r in agg.store.rollups()])))
    assert _payload_sizes(agg.store)[("a", 1)] == 0 and agg.store.duplicate_count() == 1
    agg.close()


def test_different_bytes_for_a_pruned_release_are_a_conflict(tmp_path):
    agg, sent = _fill(tmp_path)
    agg.store.prune(CUT)
    forged = encoded(params("a"), seq=1, elo=E0 + 1, fill=99)
    assert forged != sent[("a", 1)]
    out = agg.handle(topic("a"), forged)
    assert out.status == "rejected" and out.code == "conflict"
    assert sum(r.releases for r in agg.store.rollups()) == 8
    agg.close()


def test_status_accounts_for_every_seq_after_pruning(tmp_path):
    agg, _sent = _fill(tmp_path)
    for dev in ("a", "b"):  # each device says it released seqs 0..3 and holds none
        agg.store.put_status(dev, {"state": "online", "dev": dev, "ts": T0, "next_seq": 4, "oldest_pending": None,
                                   "pending": 0, "acked_seq": 3, "rejected": 0}, received=NEW)
    before = status.report(agg.store, now=NEW + 10)
    agg.store.prune(CUT)
    after = status.report(agg.store, now=NEW + 10)
    for rep in (before, after):
        assert rep["releases"] == 8
        for d in rep["devices"]:
            assert d["releases"] == 4 and d["seq"] == [0, 3]
            assert d["stored_count"] == 4 and d["unknown_count"] == 0
            assert d["lost_count"] == 0 and d["pending_count"] == 0
    assert after["devices"] == before["devices"] and after["delivery"] == before["delivery"]
    agg.close()


def test_fleet_window_queries_still_answer_and_raw_needs_fail_in_one_line(tmp_path):
    agg, _sent = _fill(tmp_path)
    st = agg.store
    items = ["item-%d" % i for i in range(10)]
    want = [x.to_dict() for x in query.freq(st, items, salt=SALT, window=E0 + 1)]
    whole = [x.to_dict() for x in query.freq(st, items, salt=SALT)]
    st.prune(CUT)
    assert [x.to_dict() for x in query.freq(st, items, salt=SALT, window=E0 + 1)] == want
    assert [x.to_dict() for x in query.freq(st, items, salt=SALT)] == whole
    with pytest.raises(PrunedError, match=r"release a seq 1 .*pruned by retention"):
        query.freq(st, items, salt=SALT, device="a", window=E0 + 1)
    agg.close()


def test_query_cli_reports_a_pruned_selection(tmp_path):
    agg, _sent = _fill(tmp_path)
    agg.store.prune(CUT)
    agg.close()
    conf = tmp_path / "host.toml"
    conf.write_text('[aggregator]\ndb = "%s"\n[fleet]\nsalt = "%s"\n' % (tmp_path / "host.db", SALT))
    r = subprocess.run([sys.executable, "-m", "pansketch.host_tools.cli", "query", "--config", str(conf), "freq", "--device",
                        "a", "item-1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "pruned by retention" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_retain_raw_s_config(tmp_path):
    assert host_cfg(tmp_path).aggregator.retain_raw_s == 0
    assert host_cfg(tmp_path, aggregator={"retain_raw_s": 86400}).aggregator.retain_raw_s == 86400
    with pytest.raises(hostconfig.ConfigError, match="retain_raw_s"):
        host_cfg(tmp_path, aggregator={"retain_raw_s": 5})


def test_prune_cut_never_reaches_a_fresh_release(tmp_path):
    """What the aggregator passes (now - retain_raw_s, at least 60 s ago) leaves a release just stored alone."""
    agg = Aggregator(host_cfg(tmp_path))
    assert agg.handle(topic("a"), encoded(params("a"), seq=0)).stored
    assert agg.store.prune(time.time() - hostconfig.MIN_RETAIN_RAW_S) == 0
    assert agg.store.prune(time.time() + 1) == 1  # (only to show the same release is prunable by age)
    agg.close()


@needs_mosquitto
def test_the_running_aggregator_prunes_between_groups(tmp_path):
    """service.run with retain_raw_s: after a group commit (acknowledged), releases received longer
    ago than retain_raw_s lose their bytes, the ones just stored keep them; a re-send of a pruned
    release over MQTT is acknowledged to the device as stored."""
    from tests.support.aggregator_mqtt import AggThread, publish_all, wait_for

    agg, sent = _fill(tmp_path)  # received at OLD / NEW (long ago): all due for pruning
    agg.close()
    b = start_mosquitto(tmp_path)
    cfg = host_cfg(tmp_path, broker={"port": b.port, "host": "127.0.0.1"}, aggregator={"retain_raw_s": 60})
    acks: list[bytes] = []
    import paho.mqtt.client as mqtt

    dev = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="dev-a", protocol=mqtt.MQTTv5)
    dev.on_message = lambda _c, _u, m: acks.append(m.payload)
    dev.connect("127.0.0.1", b.port)
    dev.subscribe("pansketch/a/ack", qos=1)
    dev.loop_start()
    a = AggThread(cfg)
    try:
        fresh = encoded(params("a"), seq=4, elo=E0 + 4, fill=3)
        publish_all(b.port, [(topic("a"), fresh), (topic("a"), sent[("a", 1)])], "pub-a")
        wait_for(lambda: len(acks) >= 1 and Store(cfg.aggregator.db, readonly=True).pruned_count() == 8)
    finally:
        assert a.close() == 0
        dev.loop_stop()
        dev.disconnect()
        b.stop()  # (the broker outlived the test run before)
    oks = sorted(s for p in acks for s in json.loads(p).get("ok", []))
    assert oks == [1, 4]  # the fresh release and the re-send of the pruned one
    with Store(cfg.aggregator.db, readonly=True) as st:
        sizes = _payload_sizes(st)
        assert sizes[("a", 4)] == len(fresh) and sum(1 for n in sizes.values() if n == 0) == 8
        assert sum(r.releases for r in st.rollups()) == 9 and st.duplicate_count() == 1
