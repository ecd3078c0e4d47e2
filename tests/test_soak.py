"""The soak benchmark's short version (host_tools/bench/soak.py): one minute of steady ingest from
100 simulated devices at 200 releases/s (real paho clients, persistent sessions) through a real mosquitto into a real
aggregator, with a broker kill -9 and an aggregator kill -9 in the middle. Nothing may be lost
or stored twice, every release must be acknowledged, and the WAL stays under 256 MB.
"""

from __future__ import annotations

from pansketch.host_tools.bench import soak
from tests.support.broker import needs_mosquitto


@needs_mosquitto
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
    assert [w["t"] < 60 for w in res["cpu_by_minute"]] == [True], res["cpu_by_minute"]  # one whole minute


def test_cpu_by_minute_splits_a_run_at_whole_minutes():
    """Per-second samples (cumulative CPU per role, releases stored) become CPU per stored release per
    whole minute of releasing: a change at 60 s shows in the second minute only, samples before the
    start are ignored, and a minute reaching into the drain is left out."""
    series = []
    cpu = {"aggregator": 0.0, "mosquitto": 0.0}
    for i in range(-2, 131):
        t = i + 0.2
        if t > 0:
            cpu["aggregator"] += 100 * (50e-6 if t < 60.5 else 80e-6)
            cpu["mosquitto"] += 100 * 30e-6
        series.append({"t": round(t, 1), "stored": max(0, round(100 * t)), "cpu_s": dict(cpu)})
    series.insert(5, {"t": 2.5, "stored": None})  # the database was busy: no count
    got = soak.cpu_by_window(series, 60.0, 120.0)
    assert [w["t"] for w in got] == [0.2, 60.2]
    assert got[0]["cpu_us_per_release"] == {"aggregator": 50.0, "mosquitto": 30.0}
    assert got[1]["cpu_us_per_release"] == {"aggregator": 80.0, "mosquitto": 30.0}
    assert [w["t"] for w in soak.cpu_by_window(series, 60.0, 100.0)] == [0.2]  # the second minute ends in the drain
