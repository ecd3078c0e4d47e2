"""Prometheus metrics: scraped from ``pansketch aggregate --metrics-port`` during ingest through a real
mosquitto, and from ``pansketch serve``; the example Grafana dashboard and alert rules in deploy/ use
only metrics that exist.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from typing import Any

import pytest

from pansketch.host_tools import localnet

from tests.support.broker import free_port, needs_mosquitto, start_mosquitto
from tests.support.dash import REPO, Server, env, pansketch
from tests.support.host import SALT, params, record, topic
from tests.support.metrics import scrape, val


def wait_metric(url: str, name: str, want: float, timeout: float = 20, **labels: str) -> dict[Any, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if val(m, name, **labels) == want:
            return m
        if time.monotonic() > deadline:
            raise AssertionError("%s%s = %s, want %s" % (name, labels, val(m, name, **labels), want))
        time.sleep(0.1)


@needs_mosquitto
def test_counters_move_during_ingest(tmp_path: Any) -> None:
    pytest.importorskip("prometheus_client")
    broker = start_mosquitto(tmp_path)
    conf = tmp_path / "host.toml"
    conf.write_text('[broker]\nhost = "127.0.0.1"\nport = %d\nclient_id = "agg-metrics"\n\n[aggregator]\n'
                    'db = "host.db"\n\n[fleet]\nsalt = "%s"\n' % (broker.port, SALT))
    rels = {d: record(params(d), str(tmp_path / d), [["x", "y"]] * 3) for d in ("dev-a", "dev-b")}
    port = free_port()
    log = open(tmp_path / "agg.log", "w+")
    agg = subprocess.Popen(pansketch("aggregate", "--config", str(conf), "--metrics-port", str(port)),
                           stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=REPO)
    url = "http://127.0.0.1:%d/metrics" % port
    try:
        deadline = time.monotonic() + 20
        while "subscribed to" not in (tmp_path / "agg.log").read_text():  # the SUBACK is in
            assert agg.poll() is None and time.monotonic() < deadline, (tmp_path / "agg.log").read_text()
            time.sleep(0.05)
        m0 = scrape(url)
        assert val(m0, "pansketch_aggregator_messages_total", outcome="stored") == 0
        assert val(m0, "pansketch_store_up") == 1 and val(m0, "pansketch_store_releases_total") == 0

        localnet.publish(broker.port, [(topic("dev-a"), rels["dev-a"][0]), (topic("dev-a"), rels["dev-a"][1]),
                                       (topic("dev-b"), rels["dev-b"][0])], "metrics-pub", timeout=10)
        m1 = wait_metric(url, "pansketch_aggregator_messages_total", 3, outcome="stored")
        assert val(m1, "pansketch_store_releases_total") == 3
        assert val(m1, "pansketch_device_releases_total", device="dev-a") == 2
        seen_b = val(m1, "pansketch_device_last_seen_timestamp_seconds", device="dev-b")
        assert time.time() - 60 < seen_b <= time.time()
        assert val(m1, "pansketch_aggregator_ingest_lag_seconds_count") == 3
        assert val(m1, "pansketch_store_size_bytes") > 0

        time.sleep(0.05)
        localnet.publish(broker.port, [(topic("dev-a"), rels["dev-a"][2]), (topic("dev-b"), rels["dev-b"][1]),
                                       (topic("dev-b"), rels["dev-b"][2]), (topic("dev-a"), rels["dev-a"][0]),
                                       (topic("dev-c"), b"\xa1\x00 not cbor"), (topic("dev-a"), rels["dev-b"][2])],
                         "metrics-pub", timeout=10)
        m2 = wait_metric(url, "pansketch_aggregator_messages_total", 2, outcome="rejected")
        m2 = wait_metric(url, "pansketch_aggregator_messages_total", 6, outcome="stored")
        assert val(m2, "pansketch_aggregator_messages_total", outcome="duplicate") == 1
        assert val(m2, "pansketch_aggregator_rejections_total", code="cbor") == 1
        assert val(m2, "pansketch_aggregator_rejections_total", code="topic") == 1
        assert val(m2, "pansketch_store_releases_total") == 6
        assert val(m2, "pansketch_store_duplicates_total") == 1
        assert val(m2, "pansketch_store_rejections_total", code="cbor") == 1
        assert val(m2, "pansketch_device_last_seen_timestamp_seconds", device="dev-b") > seen_b
        assert val(m2, "pansketch_aggregator_ingest_lag_seconds_count") == 7  # stored + duplicate
        assert val(m2, "pansketch_device_missing_releases", device="dev-a") == 0
        assert val(m2, "pansketch_store_size_bytes") >= val(m1, "pansketch_store_size_bytes")
        assert val(m2, "pansketch_aggregator_last_message_timestamp_seconds") >= seen_b

        # serve exposes the same store metrics
        srv = Server(str(conf))
        try:
            ms = scrape(srv.url + "/metrics")
        finally:
            srv.stop()
        for name, labels in (("pansketch_store_releases_total", {}), ("pansketch_store_duplicates_total", {}),
                             ("pansketch_store_rejections_total", {"code": "topic"}),
                             ("pansketch_device_releases_total", {"device": "dev-b"})):
            assert val(ms, name, **labels) == val(m2, name, **labels), name
        assert not any(k[0].startswith("pansketch_aggregator_") for k in ms)
    finally:
        agg.terminate()
        agg.wait(20)
        log.close()
        broker.stop()
    assert agg.returncode == 0


def exported_names(tmp_path: Any) -> set[str]:
    """Every metric name the exporters can emit (families without samples included)."""
    from pansketch.host_tools import metrics
    from pansketch.host_tools.ingest.aggregator import Aggregator
    from tests.support.host import host_cfg

    cfg = host_cfg(tmp_path)
    agg = Aggregator(cfg)
    for payload in record(params("dev-a"), str(tmp_path / "a"), [["x"]] * 2):
        agg.handle(topic("dev-a"), payload)
    agg.handle(topic("dev-a"), b"junk")
    agg.close()
    m = metrics.AggregatorMetrics(cfg.aggregator.db)
    metrics.activate(m)
    try:
        metrics.record(agg, "stored", None, 0)
        text = m.exposition().decode()
    finally:
        metrics.deactivate(m)
    names = set(re.findall(r"^# TYPE (\w+) ", text, re.M))
    names |= {n + s for n in names for s in ("_total", "_bucket", "_sum", "_count", "_created")}
    return names | set(metrics.CONDITIONAL_METRICS)


def test_grafana_dashboard_and_alert_rules_use_exported_metrics(tmp_path: Any) -> None:
    pytest.importorskip("prometheus_client")
    yaml = pytest.importorskip("yaml")
    names = exported_names(tmp_path)
    with open(os.path.join(REPO, "deploy/grafana/pansketch-dashboard.json")) as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 8
    with open(os.path.join(REPO, "deploy/prometheus/pansketch-alerts.yml")) as f:
        rules = yaml.safe_load(f)
    alerts = [r for g in rules["groups"] for r in g["rules"]]
    assert len(alerts) >= 6 and all({"alert", "expr", "labels", "annotations"} <= set(r) for r in alerts)
    used = set()
    for e in exprs + [r["expr"] for r in alerts]:
        used |= set(re.findall(r"\bpansketch_\w+", e))
    assert used and used <= names, sorted(used - names)
    with open(os.path.join(REPO, "deploy/prometheus/prometheus.yml")) as f:
        prom = yaml.safe_load(f)
    assert prom["rule_files"] and {j["job_name"] for j in prom["scrape_configs"]} >= {"pansketch-aggregator",
                                                                                      "pansketch-serve"}


def test_grafana_rejection_panels_show_zero_before_the_first_rejection() -> None:
    """A counter with labels has no series until its first increment, so a panel over
    it alone says "No data" on a healthy fleet; each rejection panel falls back to 0."""
    with open(os.path.join(REPO, "deploy/grafana/pansketch-dashboard.json")) as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])
             if "pansketch_store_rejections_total" in t["expr"]]
    assert len(exprs) >= 2
    for e in exprs:
        assert re.search(r"\bor (label_replace\()?vector\(0\)", e), e
