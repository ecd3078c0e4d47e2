"""A three-node RabbitMQ cluster as the broker (deploy/rabbitmq, host_tools/ingest/amqp.py).

Real parts only: three rabbitmq-server nodes on loopback ports (tests/support/rabbit.py;
one cluster for the module), the real device CLI (``python -m pansketch.agent.pi.daemon
feed``, MQTT 3.1.1, a user per device) and two real ``pansketch aggregate``
processes (``[broker] kind = "rabbitmq"``) consuming one quorum queue over
AMQP into one SQLite store. Devices reach the cluster through a TCP front
(tests/rabbit.Balancer, what HAProxy/DNS is in deploy/rabbitmq) so a device
whose node dies reconnects to another node and resumes its mirrored session.

1. hostile devices, over TLS: a device cannot publish as another device, forge
   another device's ack, read another device's acks or take over another
   device's session by using its client id; its own publish still works;
2. deploy/rabbitmq/setup.sh grants exactly what the test cluster grants;
3. ingest with two aggregators; mid-ingest ``kill -9`` of the node that leads
   the quorum queue, then ``kill -9`` of one aggregator: every release is
   stored exactly once, no device keeps anything in its outbox, and
   ``pansketch status`` shows 0 lost. With ``PANSKETCH_RABBIT_FAULTS=1`` (the
   fault table in deploy/OPERATIONS.md) one fault per run instead: a
   non-leader node, the queue leader's node, an aggregator
   (``PANSKETCH_RABBIT_DEVICES`` devices, default 4).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.support.rabbit import AGG_PASSWORD, AGG_USER, Balancer, device_password, needs_rabbitmq, start_cluster
from tests.support.e2e_faults import STORED_LINE, Device, Host, Scene
from tests.support.e2e import REPO, SALT, agent_env, wait_for
from tests.support.broker import make_test_pki

pytestmark = needs_rabbitmq

DEVICES = ["dev%d" % i for i in range(int(os.environ.get("PANSKETCH_RABBIT_DEVICES", "4")))]
# CI: one run with both kills; PANSKETCH_RABBIT_FAULTS=1 (the fault table): one fault per run
FAULTS = ["node", "leader", "aggregator"] if os.environ.get("PANSKETCH_RABBIT_FAULTS") else ["leader+aggregator"]
QUEUE = "pansketch.releases"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: Any) -> Any:
    base = tmp_path_factory.mktemp("rabbit")
    pki = make_test_pki(base / "pki")
    c = start_cluster(base / "cluster", devices=DEVICES, tls=pki)
    c.pki = pki
    sys.stderr.write("rabbitmq cluster up in %.1f s\n" % c.started_s)
    try:
        yield c
    finally:
        c.stop()


class RDevice(Device):
    """A pansketch-agent feed process speaking MQTT 3.1.1 as its own broker user."""

    def start(self, clock_start: float) -> None:
        with open(self.config) as f:
            text = f.read()
        if "mqtt_version" not in text:
            text = text.replace("[broker]\n", '[broker]\nmqtt_version = "3.1.1"\nusername = "%s"\npassword = "%s"\n'
                                % (self.name, device_password(self.name)), 1)
            with open(self.config, "w") as f:
                f.write(text)
        Device.start(self, clock_start)


def rabbit_host_config(tmp: Any, cluster: Any, name: str) -> str:
    path = str(tmp / ("%s.toml" % name))
    nodes = ", ".join('"127.0.0.1:%d"' % n.amqp_port for n in cluster.nodes)
    with open(path, "w") as f:
        f.write('[broker]\nkind = "rabbitmq"\namqp_nodes = [%s]\nusername = "%s"\npassword = "%s"\n'
                'client_id = "%s"\nreconnect_min_s = 1\nreconnect_max_s = 2\n'
                '[aggregator]\ndb = "%s"\n[fleet]\nsalt = "%s"\n'
                % (nodes, AGG_USER, AGG_PASSWORD, name, str(tmp / "fleet.db"), SALT))
    return path


class RHost(Host):
    """One ``pansketch aggregate -v`` on the cluster."""

    def __init__(self, tmp: Any, cluster: Any, name: str) -> None:
        Host.__init__(self, tmp, 0, name, config=rabbit_host_config(tmp, cluster, name), ready="storing releases in",
                      ready_s=60)


class RScene(Scene):
    device_class = RDevice

    def __init__(self, tmp: Any, cluster: Any) -> None:  # no mosquitto, no status recorder: the aggregators do it
        self.tmp = tmp
        self.db = str(tmp / "fleet.db")
        self.cluster = cluster
        self.front = Balancer([n.mqtt_port for n in cluster.nodes])
        self.port = self.front.port
        self.devices: list[Device] = []
        self.hosts: list[Any] = []

    def rhost(self, name: str) -> RHost:
        h = RHost(self.tmp, self.cluster, name)
        self.hosts.append(h)
        return h

    def close(self) -> None:
        self.stop_processes()
        self.front.close()


def _mqtt(cluster: Any, dev: str, client_id: str | None = None, clean: bool = False) -> Any:
    """A paho MQTT 3.1.1 client of ``dev`` over TLS (server verified; password, as deploy/rabbitmq)."""
    import paho.mqtt.client as mqtt

    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id or dev, protocol=mqtt.MQTTv311,
                    clean_session=clean)
    c.tls_set(ca_certs=cluster.pki["cafile"])
    c.username_pw_set(dev, device_password(dev))
    return c


def test_hostile_device_over_tls(cluster, tmp_path):
    """dev1 tries to publish as dev0, forge dev0's ack, read dev0's acks and take dev0's session."""
    import paho.mqtt.client as mqtt
    import pika

    node = cluster.running_nodes()[0]
    port = node.mqtts_port
    got: list[tuple[str, bytes]] = []
    events: dict[str, Any] = {}

    # dev0: a persistent session subscribed to its acks
    d0 = _mqtt(cluster, "dev0")
    d0.on_message = lambda c, u, m: got.append((m.topic, m.payload))
    d0.on_connect = lambda c, u, f, rc, p=None: events.setdefault("d0", rc)
    d0.connect("localhost", port)
    d0.loop_start()
    assert wait_for(lambda: "d0" in events, 20)
    assert not events["d0"].is_failure
    r, _mid = d0.subscribe("pansketch/dev0/ack", qos=1)
    assert r == mqtt.MQTT_ERR_SUCCESS
    time.sleep(0.5)

    # an AMQP consumer standing in for the aggregator: what reaches the release queue
    conn = pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", node.amqp_port, credentials=pika.PlainCredentials(AGG_USER, AGG_PASSWORD)))
    ch = conn.channel()
    ch.queue_declare("pansketch.hostile-check", durable=False, exclusive=True)
    for key in ("pansketch.*.release", "pansketch.*.status"):
        ch.queue_bind("pansketch.hostile-check", "amq.topic", routing_key=key)

    def drain() -> list[str]:
        keys = []
        while True:
            m, _p, _b = ch.basic_get("pansketch.hostile-check", auto_ack=True)
            if m is None:
                return keys
            keys.append(m.routing_key)

    def attempt(topic: str, payload: bytes = b"x") -> bool:
        """dev1 publishes once at QoS 1; True if the broker kept the connection (it closes it on a denial)."""
        c = _mqtt(cluster, "dev1", "dev1-hostile")
        ok: list[Any] = []
        c.on_connect = lambda cl, u, f, rc, p=None: ok.append(rc)
        c.connect("localhost", port)
        c.loop_start()
        try:
            assert wait_for(lambda: bool(ok), 20) and not ok[0].is_failure
            info = c.publish(topic, payload, qos=1)
            wait_for(lambda: info.is_published() or not c.is_connected(), 15)
            return info.is_published()
        finally:
            c.disconnect()
            c.loop_stop()

    assert attempt("pansketch/dev1/release")  # its own topic: accepted
    assert not attempt("pansketch/dev0/release")  # as another device: refused
    assert not attempt("pansketch/dev0/ack", b'{"dev":"dev0","ok":[0]}')  # a forged ack: refused
    assert not attempt("pansketch/dev0/status")
    time.sleep(0.5)
    keys = drain()
    assert keys == ["pansketch.dev1.release"], keys
    assert got == [], got  # dev0 received no forged ack

    # dev1 subscribing to dev0's acks: refused (SUBACK failure or the connection closed)
    c = _mqtt(cluster, "dev1", "dev1-snoop")
    sub: list[Any] = []
    c.on_subscribe = lambda cl, u, mid, rcs, p=None: sub.append(rcs)
    c.connect("localhost", port)
    c.loop_start()
    assert wait_for(c.is_connected, 20), "dev1 could not connect"  # (a subscribe before CONNACK is lost)
    c.subscribe("pansketch/dev0/ack", qos=1)
    wait_for(lambda: bool(sub) or not c.is_connected(), 10)
    assert not c.is_connected() or all(getattr(r, "is_failure", r == 128) for r in sub[0]), sub
    c.disconnect()
    c.loop_stop()

    # dev1 connecting with dev0's client id (resuming, then clean) can neither read nor drop dev0's session
    # queue (RabbitMQ 3.10 does not bind the client id to the user: it may disconnect dev0, nothing more)
    stolen: list[bytes] = []
    for clean in (False, True):
        c = _mqtt(cluster, "dev1", "dev0", clean=clean)
        c.on_message = lambda cl, u, m: stolen.append(m.payload)
        c.connect("localhost", port)
        c.loop_start()
        time.sleep(1.5)
        c.disconnect()
        c.loop_stop()
    # a real ack for dev0 from the aggregator user still reaches dev0's session (reconnect dev0 if kicked)
    pub = conn.channel()
    pub.confirm_delivery()
    pub.basic_publish("amq.topic", "pansketch.dev0.ack", b'{"dev":"dev0","ok":[7]}',
                      pika.BasicProperties(delivery_mode=2), mandatory=True)
    if not d0.is_connected():
        d0.reconnect()
    assert wait_for(lambda: any(p == b'{"dev":"dev0","ok":[7]}' for _t, p in got), 20), got
    assert all(t == "pansketch/dev0/ack" for t, _p in got)
    assert stolen == [], stolen
    d0.disconnect()
    d0.loop_stop()
    conn.close()


def test_aggregator_declares_the_queue_over_tls(cluster, tmp_path):
    """``python -m pansketch.host_tools.ingest.amqp --declare`` (deploy/rabbitmq/setup.sh declare) over AMQP with TLS."""
    path = tmp_path / "host.toml"
    nodes = ", ".join('"localhost:%d"' % n.amqps_port for n in cluster.running_nodes())
    path.write_text('[broker]\nkind = "rabbitmq"\namqp_nodes = [%s]\ntls_ca = "%s"\nusername = "%s"\npassword = "%s"\n'
                    '[fleet]\nsalt = "%s"\n' % (nodes, cluster.pki["cafile"], AGG_USER, AGG_PASSWORD, SALT))
    r = subprocess.run([sys.executable, "-m", "pansketch.host_tools.ingest.amqp", "--declare", "--config", str(path)],
                       capture_output=True, text=True, env=agent_env(), cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "queue pansketch.releases (quorum) bound to amq.topic with pansketch.*.release and pansketch.*.status" \
        in r.stdout
    # without the CA the server's certificate is not trusted: a clear failure, exit 1
    path.write_text(path.read_text().replace('tls_ca = "%s"\n' % cluster.pki["cafile"], "tls = true\n"))
    r = subprocess.run([sys.executable, "-m", "pansketch.host_tools.ingest.amqp", "--declare", "--config", str(path)],
                       capture_output=True, text=True, env=agent_env(), cwd=REPO, timeout=120)
    assert r.returncode == 1 and "cannot connect" in r.stderr, (r.returncode, r.stderr)


def test_host_acks_mandatory_retried_and_merged(cluster, tmp_path):
    """An ack no session queue takes is returned (``mandatory``) and published again later; acks waiting
    for the same device go out as one message (pansketch.host_tools.ingest.amqp.AckPublisher)."""
    import threading

    import paho.mqtt.client as mqtt

    from pansketch.host_tools import hostconfig
    from pansketch.host_tools.ingest import amqp

    node = cluster.running_nodes()[0]
    cfg = hostconfig.loads('[broker]\nkind = "rabbitmq"\namqp_nodes = ["127.0.0.1:%d"]\nusername = "%s"\n'
                           'password = "%s"\n[fleet]\nsalt = "%s"\n' % (node.amqp_port, AGG_USER, AGG_PASSWORD, SALT))
    stop = threading.Event()
    events: list[Any] = []
    pub = amqp.AckPublisher(amqp.Settings(cfg.broker, cfg.aggregator.topic, 16, "ack-test"), stop, events.append)
    pub.thread.start()
    try:
        dev = DEVICES[-1]  # no session yet: the ack is unroutable
        pub.put([("pansketch/%s/ack" % dev, b'{"dev":"%s","ok":[1]}' % dev.encode()),
                 ("pansketch/%s/ack" % dev, b'{"dev":"%s","ok":[2],"bad":[[3,"conflict"]]}' % dev.encode())])
        assert wait_for(lambda: pub.returned >= 1, 30)
        assert pub.published == 0
        got: list[bytes] = []
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=dev, protocol=mqtt.MQTTv311, clean_session=False)
        c.username_pw_set(dev, device_password(dev))
        c.on_message = lambda cl, u, m: got.append(m.payload)
        c.connect("127.0.0.1", node.mqtt_port)
        c.loop_start()
        c.subscribe("pansketch/%s/ack" % dev, qos=1)
        assert wait_for(lambda: pub.published >= 1, 30), pub.returned  # the retry found the session
        assert wait_for(lambda: bool(got), 20)
        c.disconnect()
        c.loop_stop()
        assert json.loads(got[0]) == {"dev": dev, "ok": [1, 2], "bad": [[3, "conflict"]]}, got
        assert len(got) == 1 and events == []
    finally:
        stop.set()
        pub.thread.join(10)


def test_setup_script_grants_what_the_test_cluster_grants(tmp_path):
    """deploy/rabbitmq/setup.sh and tests/rabbit.definitions state the same permissions (no cluster needed)."""
    from tests.support.rabbit import definitions

    ctl = tmp_path / "ctl"  # a rabbitmqctl that prints its arguments, tab-separated
    ctl.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\t" "$a"; done; printf "\\n"\n')
    ctl.chmod(0o755)

    def run(*args: str) -> list[list[str]]:
        r = subprocess.run(["sh", os.path.join(REPO, "deploy", "rabbitmq", "setup.sh"), *args], capture_output=True,
                           text=True, timeout=30, env=dict(os.environ, RABBITMQCTL=str(ctl), OUT=str(tmp_path)))
        assert r.returncode == 0, r.stderr
        return [line.rstrip("\t").split("\t") for line in r.stdout.splitlines()]

    want = definitions(["dev0"])
    dev = run("device", "dev0")
    agg = run("aggregator", AGG_USER)
    for cmds, user in ((dev, "dev0"), (agg, AGG_USER)):
        p = next(x for x in want["permissions"] if x["user"] == user)
        t = next(x for x in want["topic_permissions"] if x["user"] == user)
        assert ["set_permissions", "-p", "/", user, p["configure"], p["write"], p["read"]] in cmds, cmds
        assert ["set_topic_permissions", "-p", "/", user, "amq.topic", t["write"], t["read"]] in cmds, cmds
        assert os.path.getsize(tmp_path / user / "password") == 48
    pol = run("policy")[0]
    assert pol[-2] == want["policies"][0]["pattern"] and json.loads(pol[-1]) == want["policies"][0]["definition"]
    r = subprocess.run(["sh", os.path.join(REPO, "deploy", "rabbitmq", "setup.sh"), "device", "a.b"],
                       capture_output=True, text=True, timeout=30, env=dict(os.environ, RABBITMQCTL="echo"))
    assert r.returncode == 2 and "'a.b'" in r.stderr


@pytest.mark.parametrize("fault", FAULTS)
def test_two_aggregators_survive_broker_node_and_aggregator_kills(cluster, tmp_path, fault):
    """Ingest with two aggregators; kill -9 mid-ingest as ``fault`` says; nothing lost, nothing stored twice."""
    for i, n in enumerate(cluster.nodes):  # a node killed by the previous fault comes back first
        if n.proc is not None and n.proc.poll() is not None:
            cluster.restart(i)
            cluster.ensure_mqtt_members()
    s = RScene(tmp_path, cluster)
    try:
        a1 = s.rhost("agg1")  # declares and binds the queue before any device publishes
        s.rhost("agg2")
        devs = [s.device(n) for n in DEVICES]
        t0 = time.monotonic()

        def two_more() -> None:
            at = {d.name: d.next_seq() for d in devs}
            assert wait_for(lambda: all(d.next_seq() >= at[d.name] + 2 for d in devs), 90), \
                [d.text()[-2000:] for d in devs]

        assert wait_for(lambda: all(d.next_seq() >= 2 for d in devs), 60), [d.text()[-2000:] for d in devs]
        at_risk = len(s.unstored(devs))
        what = []
        if fault in ("node", "leader", "leader+aggregator"):
            leader = cluster.queue_leader(QUEUE)
            victim = leader if fault != "node" else next(n for n in cluster.nodes if n is not leader)
            vi = cluster.nodes.index(victim)
            cluster.kill(vi)  # kill -9 (with the device sessions homed there)
            what.append("kill -9 %s node %d" % ("queue-leader" if victim is leader else "non-leader", vi + 1))
            two_more()
            if victim is leader:
                assert cluster.queue_leader(QUEUE) is not leader
            if fault == "leader+aggregator":
                assert any(d.text().count("connected to") >= 2 for d in devs)  # some device was homed there
        if fault in ("aggregator", "leader+aggregator"):
            assert STORED_LINE.search(a1.text())  # it took part
            a1.kill()  # its unacknowledged deliveries go back to the queue, to the other aggregator
            what.append("kill -9 aggregator 1")
            two_more()
        row = s.finish_and_check("rabbitmq: " + ", then ".join(what), at_risk)
        assert row["lost"] == 0 and row["stored_twice"] == 0
        sys.stderr.write("ingest with faults: %s in %.1f s\n" % (row, time.monotonic() - t0))
        for h in s.hosts[1:]:
            assert "Traceback" not in h.text(), h.text()
    finally:
        s.close()


@pytest.mark.parametrize("broker, key", [
    ('kind = "kafka"', "broker.kind"),
    ('kind = "rabbitmq"\namqp_nodes = ["mq1"]', "broker.amqp_nodes"),
    ('kind = "rabbitmq"\namqp_nodes = []', "broker.amqp_nodes"),
    ('kind = "rabbitmq"\nqueue = "amq.releases"', "broker.queue"),
])
def test_broker_kind_config_errors(broker, key):
    """[broker] kind and its AMQP keys: a clear error naming the key (no cluster needed)."""
    from pansketch.host_tools import hostconfig

    with pytest.raises(hostconfig.ConfigError) as e:
        hostconfig.loads('[broker]\n%s\n[fleet]\nsalt = "%s"\n' % (broker, SALT))
    assert e.value.key == key, e.value


def test_broker_kind_defaults_and_agent_mqtt_version(tmp_path):
    from pansketch.agent.pi import config as agent_config
    from pansketch.host_tools import hostconfig

    c = hostconfig.loads('[broker]\nhost = "mq.example.net"\ntls = true\nkind = "rabbitmq"\n[fleet]\nsalt = "%s"\n'
                         % SALT)
    assert (c.broker.kind, c.broker.amqp_nodes, c.broker.queue) == ("rabbitmq", (("mq.example.net", 5671),),
                                                                     "pansketch.releases")
    assert hostconfig.loads('[fleet]\nsalt = "%s"\n' % SALT).broker.kind == "mosquitto"
    from tests.support.e2e import agent_toml

    p = agent_toml(str(tmp_path / "a.toml"), "dev0", 1883, str(tmp_path / "st"), broker_extra='mqtt_version = "3.1.1"')
    assert agent_config.load(p).broker.mqtt_version == "3.1.1"
    p = agent_toml(str(tmp_path / "b.toml"), "dev0", 1883, str(tmp_path / "st"), broker_extra='mqtt_version = "4"')
    with pytest.raises(agent_config.ConfigError) as e:
        agent_config.load(p)
    assert e.value.key == "broker.mqtt_version"
