"""`make demo` on a machine without mosquitto: the pure-Python amqtt broker (MQTT 3.1.1 only) with the
production aggregator (validation, store, host acknowledgements) speaking 3.1.1 to it.

Each simulated agent waits for the host's acknowledgements of its releases (what "delivered" means:
stored by the host, not accepted by a broker) and the demo exits 2 when any is missing, so exit 0 and
one "all stored by the host" line per device is the check. `.ci/run` also runs `make demo` itself in a
mount namespace where mosquitto's files are hidden.
"""

from __future__ import annotations

import re
import sqlite3
import subprocess
import time

import pytest

from pansketch.host_tools import hostconfig
from tests.support.e2e import REPO, agent_env, pansketch_cmd

pytest.importorskip("amqtt", reason="the demo extra (pip install 'pansketch[demo]') is not installed")


def test_demo_on_amqtt_stores_and_acknowledges_every_release(tmp_path):
    work = tmp_path / "demo"
    r = subprocess.run(pansketch_cmd("demo", "--broker", "amqtt", "--agents", "2", "--windows", "2", "--events",
                                     "3000", "--w", "512", "--items", "500", "--dir", str(work)),
                       capture_output=True, text=True, env=agent_env(), cwd=REPO, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"amqtt [\d.]+ \(MQTT 3\.1\.1\) listening", r.stdout), r.stdout
    assert "NOT all delivered" not in r.stdout
    for dev in ("demo-pi-1", "demo-pi-2"):
        assert re.search(r"^  %s: .* -> all stored by the host \(its acknowledgements\)$" % dev, r.stdout, re.M), r.stdout
    # 2 cs agents x 2 windows, cms/dcs/dbits/strhh 2 each, the tree device 3 nodes
    assert "stored 15 releases (0 rejected, 0 duplicates)" in r.stdout
    assert 'mqtt_version = "3.1.1"' in (work / "host.toml").read_text()
    # what the aggregator's own store keeps per device: the production schema, not a demo table
    with sqlite3.connect(str(work / "demo.db")) as db:
        devices = {row[0] for row in db.execute("SELECT DISTINCT device FROM releases")}
    assert {"demo-pi-1", "demo-pi-2", "demo-words-1"} <= devices


def _load(tmp_path, text):
    p = tmp_path / "host.toml"
    p.write_text(text + '[fleet]\nsalt = "a-fleet-salt"\n')
    return hostconfig.load(str(p))


def test_mqtt_version_setting(tmp_path):
    assert _load(tmp_path, "[broker]\n").broker.mqtt_version == 5
    assert _load(tmp_path, '[broker]\nmqtt_version = "3.1.1"\n').broker.mqtt_version == 4
    assert _load(tmp_path, "[broker]\nmqtt_version = 5\n").broker.mqtt_version == 5
    with pytest.raises(hostconfig.ConfigError, match="broker.mqtt_version"):
        _load(tmp_path, '[broker]\nmqtt_version = "3.1"\n')
    with pytest.raises(hostconfig.ConfigError, match="aggregator.shared_group"):
        _load(tmp_path, '[broker]\nmqtt_version = "3.1.1"\n[aggregator]\nshared_group = "g"\n')


def test_devices_connect_one_at_a_time_and_each_session_routes(tmp_path):
    """amqtt ends a connection's handler when another client subscribes while it walks its subscriptions
    (the demo then lost an agent's session: publishes taken, none routed). The demo's devices connect
    one at a time (demo._start); every one of nine started at once is then subscribed and gets what is
    published to its ack topic, through the broker's routing (a malformed ack: the device logs it)."""
    import threading

    import paho.mqtt.client as mqtt
    import paho.mqtt.publish as publish

    from pansketch.agent.pi.config import BrokerConfig
    from pansketch.agent.pi.publisher import Publisher
    from pansketch.agent.storage import Outbox
    from pansketch.host_tools import demo

    broker = demo.AmqttBroker(str(tmp_path))
    logs: dict[str, list[str]] = {}
    pubs = []
    host = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="host", protocol=mqtt.MQTTv311)
    try:
        # as in the demo: the host subscribed to the devices' statuses, and retained statuses there (a
        # connect then awaits sending each to the new session, where another's SUBSCRIBE gets in)
        host.connect("127.0.0.1", broker.port)
        host.loop_start()
        host.subscribe("pansketch/+/status", qos=1)
        publish.multiple([("pansketch/old-%d/status" % i, b"{}", 1, True) for i in range(300)],
                         hostname="127.0.0.1", port=broker.port, protocol=4)
        for i in range(9):
            dev = "dev-%d" % i
            logs[dev] = []
            pubs.append(Publisher(BrokerConfig(host="127.0.0.1", port=broker.port, reconnect_min_s=1, reconnect_max_s=2),
                                  dev, Outbox(str(tmp_path / dev)), logs[dev].append, {"mode": "window"}, protocol=broker.protocol))
        threads = [threading.Thread(target=demo._start, args=(p, broker)) for p in pubs]
        for t in threads:  # a few ms apart, as the demo's agents and devices
            t.start()
            time.sleep(0.005)
        for t in threads:
            t.join(60)
        assert all(p.wait_subscribed(0) for p in pubs)
        for p in pubs:
            publish.single(p.ack_topic, b"not an ack", qos=1, hostname="127.0.0.1", port=broker.port,
                           protocol=4)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(any("malformed" in m for m in v) for v in logs.values()):
            time.sleep(0.1)
        assert all(any("malformed" in m for m in v) for v in logs.values()), logs
    finally:
        for p in pubs:
            p.stop()
        host.loop_stop()
        broker.stop()


class _Session:
    """A device session whose releases the broker does or does not route (amqtt's lost session: taken
    publishes, none routed; it cannot be caused on demand)."""

    def __init__(self, routes: bool, calls: list[str]) -> None:
        self.routes, self.calls = routes, calls

    def start(self) -> None:
        self.calls.append("start")

    def wait_subscribed(self, timeout: float) -> bool:
        return True

    def wait_delivered(self, timeout: float) -> bool:
        self.calls.append("wait %g" % timeout)
        return self.routes

    def stop(self) -> None:
        self.calls.append("stop")


@pytest.mark.parametrize("routes_later", [True, False])
def test_a_session_that_delivers_nothing_is_replaced_once(tmp_path, routes_later):
    from pansketch.host_tools import demo

    broker = demo.DemoBroker(str(tmp_path))
    calls: list[str] = []
    assert demo._delivered(_Session(True, calls), lambda: _Session(routes_later, calls), broker)
    assert calls == ["wait 15", "stop"]  # delivered: no second session
    calls.clear()
    assert demo._delivered(_Session(False, calls), lambda: _Session(routes_later, calls), broker) is routes_later
    assert calls == ["wait 15", "stop", "start", "wait 30", "stop"]
