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
