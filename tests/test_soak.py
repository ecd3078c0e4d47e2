"""The soak benchmark's short version (host_tools/bench/soak.py): one minute of steady ingest from
100 simulated devices at 200 releases/s (real paho clients, persistent sessions) through a real mosquitto into a real
aggregator, with a broker kill -9 and an aggregator kill -9 in the middle. Nothing may be lost
or stored twice, every release must be acknowledged, and the WAL stays under 256 MB.
"""

from __future__ import annotations

import shutil

import pytest

from host_tools.bench import soak


@pytest.mark.skipif(shutil.which("mosquitto") is None and not shutil.os.path.exists("/usr/sbin/mosquitto"),
                    reason="mosquitto not installed")
def test_soak_short_with_broker_and_aggregator_kills(tmp_path):
    res = soak.run(devices=100, rate=200.0, duration=60.0, workers=2, kills=["broker", "aggregator"],
                   tmp=str(tmp_path), ack_timeout=3.0, drain=90.0, log=lambda *_a: None)
    assert [e["event"] for e in res["events"]] == ["broker kill -9", "aggregator kill -9"]
    assert res["released"] >= 100 * 60  # about rate x duration (12,000), whatever the machine's load
    assert res["lost"] == 0 and res["stored_twice"] == 0, res
    assert res["stored"] == res["released"] == res["rollup_releases"] and res["unacked_at_end"] == 0
    assert res["wal_peak_mb"] < 256 and res["series"], res
    assert res["group_commit"] is not None and res["group_commit"]["releases_per_commit"] >= 1
    assert res["ack_latency_s"]["n"] == res["released"]
