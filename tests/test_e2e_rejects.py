"""Production broker setup (deploy/): TLS, passwords, ACL; bad input rejected, everything else unaffected.

mosquitto runs with deploy/mosquitto/pansketch.conf and deploy/mosquitto/acl
(paths and ports moved into a temp dir), accounts come from
deploy/make-device-credentials.sh, and the agent and aggregator use the
config skeletons that script writes. Then a rogue device sends malformed
CBOR, an unknown version, a wrong shape, a release naming another device,
and tries to publish on another device's topic.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading

import cbor2
import paho.mqtt.client as mqtt

from pansketch.agent import release
from pansketch.agent.params import Params
from pansketch.agent.sketch import new_counters
from pansketch.host_tools.store.sqlite import Store
from tests.support.e2e import (REPO, SALT, AggregatorThread, free_port, needs_mosquitto, run_agent,
                                    start_mosquitto, wait_for)

pytestmark = needs_mosquitto

T0 = 1_700_000_000 - 1_700_000_000 % 3600  # in the past: the host quarantines windows from the future
FROZEN = ("--clock-start", str(T0 + 5), "--clock-speed", "0")


def make_ca(d: str) -> None:
    def ossl(*a: str) -> None:
        subprocess.run(["openssl", *a], cwd=d, check=True, capture_output=True, timeout=60)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    ossl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=pansketch test CA")
    ossl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    with open(os.path.join(d, "san.ext"), "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    ossl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
         "server.crt", "-days", "2", "-extfile", "san.ext")


def creds(etc: str, out: str, tls_port: int, *args: str) -> None:
    r = subprocess.run(["sh", os.path.join(REPO, "deploy", "make-device-credentials.sh"), "-p", etc + "/passwd", "-a",
                        etc + "/acl", "-o", out, "-H", "localhost", "-P", str(tls_port), "-c", etc + "/ca.crt",
                        "-s", SALT, *args], capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()


def edit(path: str, *pairs: tuple[str, str], append: str = "") -> str:
    with open(path) as f:
        text = f.read()
    for old, new in pairs:
        assert old in text, (old, path)
        text = text.replace(old, new)
    with open(path, "w") as f:
        f.write(text + append)
    return path


def rogue_client(port: int, user: str, password: str, ca: str) -> tuple[mqtt.Client, dict]:
    acks: dict = {}
    cond = threading.Condition()
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=user, protocol=mqtt.MQTTv5)
    c.username_pw_set(user, password)
    c.tls_set(ca_certs=ca)

    def on_publish(cl, u, mid, rc, p=None):  # noqa: ANN001
        with cond:
            acks[mid] = rc
            cond.notify_all()

    c.on_publish = on_publish
    c.connect("localhost", port)
    c.loop_start()
    acks["_cond"] = cond
    return c, acks


def publish(c: mqtt.Client, acks: dict, topic: str, payload: bytes):  # noqa: ANN201
    info = c.publish(topic, payload, qos=1)
    cond = acks["_cond"]
    with cond:
        assert cond.wait_for(lambda: info.mid in acks, 10)
        return acks.pop(info.mid)


def test_deploy_config_tls_acl_and_rejections(tmp_path):
    if shutil.which("openssl") is None:
        import pytest

        pytest.skip("openssl is needed to make test certificates")
    etc = str(tmp_path / "etc")
    os.makedirs(etc)
    make_ca(etc)
    shutil.copy(os.path.join(REPO, "deploy", "mosquitto", "acl"), etc + "/acl")
    tls_port, plain_port = free_port(), free_port()
    out = str(tmp_path / "creds")
    for dev in ("pi-1", "pi-2"):
        creds(etc, out, tls_port, dev)
    creds(etc, out, tls_port, "--aggregator", "agg-1")
    acl = open(etc + "/acl").read()
    assert "user agg-1\ntopic deny pansketch/agg-1/#\ntopic read pansketch/+/release" in acl
    # the production config, moved into the temp dir
    conf = open(os.path.join(REPO, "deploy", "mosquitto", "pansketch.conf")).read()
    conf = conf.replace("/etc/mosquitto/pansketch/", etc + "/").replace("/var/lib/mosquitto/", str(tmp_path) + "/")
    conf = conf.replace("listener 8883\n", "listener %d 127.0.0.1\n" % tls_port)
    assert "listener 1883 127.0.0.1\n" in conf
    conf = conf[:conf.index("listener 1883 127.0.0.1\n")]  # the fixture adds the plain loopback listener
    broker = start_mosquitto(tmp_path, port=plain_port, conf_extra=conf)
    ca = etc + "/ca.crt"
    pw = {d: open(os.path.join(out, d, "password")).read().strip() for d in ("pi-1", "pi-2", "agg-1")}

    # aggregator and agent from the script's skeletons (only the data paths changed)
    hcfg = edit(os.path.join(out, "agg-1", "host.toml"), ("/var/lib/pansketch/pansketch.db", str(tmp_path / "fleet.db")),
                append='kind = "cs"\nd = 4\nw = 2048\n')
    agg = AggregatorThread(hcfg)
    st = Store(str(tmp_path / "fleet.db"), readonly=True)
    acfg = edit(os.path.join(out, "pi-1", "agent.toml"), ("/var/lib/pansketch", str(tmp_path / "s1")))
    try:
        r = run_agent("feed", acfg, "--timeout", "30", *FROZEN, input=b"apple\n" * 20)
        assert r.returncode == 0, r.stderr.decode()
        assert wait_for(lambda: st.release_count() == 1, 20)
        before = st.snapshot()

        # a rogue pi-2 (valid credentials, own topic) sends garbage
        c, acks = rogue_client(tls_port, "pi-2", pw["pi-2"], ca)
        p2 = Params({"device": "pi-2", "salt": SALT, "d": 4, "w": 2048})
        good = release.encode(p2, 0, T0 // 3600, T0 // 3600 + 1, 0, new_counters(4 * 2048))
        m = cbor2.loads(good)
        bad = {
            "cbor": b"\xa1\x61v\xff not cbor",
            "version": cbor2.dumps(dict(m, v=99)),
            "shape": cbor2.dumps(dict(m, ctr=m["ctr"][:-4])),
            "topic": cbor2.dumps(dict(m, dev="pi-1")),
        }
        for payload in bad.values():
            rc = publish(c, acks, "pansketch/pi-2/release", payload)
            assert not rc.is_failure  # the broker accepts it: the aggregator must refuse it
        # ... and tries another device's topic: refused by the ACL, never reaches the aggregator
        rc = publish(c, acks, "pansketch/pi-1/release", good)
        assert rc.is_failure and "authori" in str(rc).lower()
        rc = publish(c, acks, "pansketch/pi-1/status", b'{"state":"online"}')
        assert rc.is_failure
        c.disconnect()
        c.loop_stop()

        assert wait_for(lambda: st.rejection_count() == 4, 20)
        rej = st.rejections()
        assert sorted(r[4] for r in rej) == sorted(bad), rej  # code per bad message
        assert all(r[5] for r in rej), "every rejection has a reason"
        assert all(r[2] == "pansketch/pi-2/release" for r in rej)
        after = st.snapshot()
        assert after[0] == before[0] and after[3] == before[3], "nothing stored was touched"

        # the real agent, misconfigured to publish as pi-1 with pi-2's account: refused, nothing lost
        bcfg = edit(os.path.join(out, "pi-2", "agent.toml"), ('id = "pi-2"', 'id = "pi-1"'),
                    ("/var/lib/pansketch", str(tmp_path / "s2")))
        r = run_agent("feed", bcfg, "--timeout", "3", *FROZEN, input=b"pear\n")
        assert r.returncode == 1
        assert b"Not authorized" in r.stderr
        assert len(os.listdir(tmp_path / "s2" / "outbox")) == 1, "the refused release stays in the outbox"

        # everything else unaffected: pi-1 goes on, the aggregator is alive
        r = run_agent("feed", acfg, "--timeout", "30", *FROZEN, input=b"apple\n" * 5)
        assert r.returncode == 0, r.stderr.decode()
        assert wait_for(lambda: st.release_count() == 2, 20)
        assert st.rejection_count() == 4
        assert {x.device for x in st.releases()} == {"pi-1"}
    finally:
        st.close()
        agg.stop()
        broker.stop()
