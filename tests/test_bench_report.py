"""host_tools/bench/report.py regenerates the README's performance table from bench-results/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pansketch.host_tools.bench import report

FEED = {"events": 1000000, "kind": "cs", "agent_s": 0.30, "datasketches_s": 0.27, "ratio": 0.9,
        "agent_cpu_s": 0.42, "datasketches_cpu_s": 0.25, "ratio_cpu": 0.595, "ratios_per_round": [0.9, 0.85],
        "ratios_cpu_per_round": [0.6, 0.59], "rounds": [{"loadavg_1min": 1.5}, {"loadavg_1min": 2.25}]}
CORE = {"cpython": {"cms_per_event_vs_datasketches": 0.123, "cms_per_event_vs_datasketches_per_round": [0.12, 0.123],
                    "datasketches_cms_per_event_eps": 10.0e6}}
ROUND = {"peer": {"releases_per_second": 8000.0, "cpu_us_per_release": {"bare subscriber": 62, "mosquitto": 40}},
         "aggregator_sqlite": {"releases": 2000, "release_bytes": 16554, "releases_per_second": 4800.0,
                               "cpu_us_per_release": {"aggregator": 70, "pansketch.host_tools.ingest.mqttproc": 40,
                                                      "pansketch.host_tools.ingest.validproc": 30, "mosquitto": 50}}}
HOST = {"ingest_mqtt_rounds": [ROUND, json.loads(json.dumps(ROUND).replace("4800.0", "5600.0"))],
        "ingest_mqtt_summary": {"loadavg_1min_per_round": [3.0, 3.5]}}
# the shape benchmarks/firmware_unix.py writes: the minimum free is the TLS run's
FIRMWARE = {"esp32_d": 4, "esp32_w": 1024, "esp32_free_bytes_min": 32240, "esp32_heap_bytes": 110016,
            "frozen": {"bits": 32, "runs": {
                "esp32_plain": {"w": 1024, "d": 4, "tls": False, "shadow": True, "free_at_high_water": 34900, "ok": True},
                "esp32_tls": {"w": 1024, "d": 4, "tls": True, "shadow": True, "free_at_high_water": 32240, "ok": True},
                "esp32_shadow_2048": {"ok": False}}}}
SOAK = {"devices": 1000, "stored": 630000, "lost": 0, "cpu_us_per_release": {
    "aggregator": 66, "pansketch.host_tools.ingest.mqttproc": 77, "mosquitto": 58, "total": 201},
    "group_commit": {"releases_per_commit": 66.7}, "ack_latency_s": {"p50": 0.0603, "p99": 0.109}}
README = "# x\n\nbefore\n\n%s\nold table\n%s\n\nafter\n" % (report.BEGIN, report.END)


def fixture(tmp_path: Path, skip: tuple[str, ...] = ()) -> Path:
    res = tmp_path / "bench-results"
    res.mkdir()
    for name, doc in (("feed.json", FEED), ("core.json", CORE), ("host.json", HOST), ("firmware-unix.json", FIRMWARE),
                      (report.SOAK_FILE, SOAK)):
        if name not in skip:
            (res / name).write_text(json.dumps(doc))
    (tmp_path / "README.md").write_text(README)
    return res


def test_every_row_of_the_issue_table_with_its_peer(tmp_path):
    res = fixture(tmp_path)
    assert report.main(["--results", str(res), "--readme", str(tmp_path / "README.md")]) == 0
    text = (tmp_path / "README.md").read_text()
    assert text.startswith("# x\n\nbefore\n\n" + report.BEGIN) and text.endswith(report.END + "\n\nafter\n")
    assert "old table" not in text
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| path")]
    assert len(rows) == 6
    feed, upd, ingest, cpu, soak, esp = rows
    assert "0.90× wall (rounds 0.90, 0.85)" in feed and "0.59× CPU" in feed and "0.27 s wall" in feed
    assert "0.12× (CPU time; rounds 0.12, 0.12)" in upd and "10.00 M events/s" in upd
    # median of the rounds' ratios 0.6 and 0.7; median rate 5,200/s; the peer's 8,000/s
    assert "0.65× (rounds 0.60, 0.70): 5,200 releases/s" in ingest and "8,000/s" in ingest
    assert "2000 releases of 16.6 KB" in ingest
    # pansketch processes only (mosquitto is not ours): 70 + 40 + 30
    assert cpu.split(" | ")[1].startswith("140 µs (aggregator 70 + ") and "bare subscriber 62 µs" in cpu
    # sustained: pansketch processes only, 66 + 77 (mosquitto's 58 is shown beside, not added)
    assert soak.split(" | ")[1].startswith("143 µs (aggregator 66 + pansketch.host_tools.ingest.mqttproc 77); 630,000 stored, 0 lost")
    assert "66.7 releases per commit; ack p50 60 ms, p99 109 ms" in soak and "mosquitto itself 58 µs" in soak
    assert "w = 1024 at d = 4 with shadow persists and TLS, 32.2 KB free" in esp
    assert "load average during the rounds: 1.5, 2.2, 3.0, 3.5" in text
    assert (res / "table.md").read_text() in text
    # idempotent, and --check agrees
    assert report.main(["--results", str(res), "--readme", str(tmp_path / "README.md"), "--check"]) == 0


def test_missing_figures_say_which_command_makes_them(tmp_path):
    res = fixture(tmp_path, skip=("host.json", "firmware-unix.json", report.SOAK_FILE))
    body = report.table(res)
    assert "not measured (`make bench-soak`, about 17 min)" in body
    assert "not measured (`python -m pansketch.host_tools.bench.host --devices 50 --per-device 40 --rounds 2`)" in body
    assert "not measured (firmware benchmark" in body
    assert "0.90× wall" in body


def test_check_detects_a_stale_table_and_markers_are_required(tmp_path, capsys):
    res = fixture(tmp_path)
    readme = tmp_path / "README.md"
    assert report.main(["--results", str(res), "--readme", str(readme), "--check"]) == 1
    readme.write_text("no markers here\n")
    assert report.main(["--results", str(res), "--readme", str(readme)]) == 2
    assert "no performance table markers" in capsys.readouterr().err
    with pytest.raises(ValueError):
        report.splice("x", "y")
