"""The aggregator against a real mosquitto with real paho publishers.

Checks: releases published at QoS 1 are stored; duplicates and bad messages
do not disturb anything; two aggregators on a shared subscription split the
load and store each release once; releases published while the aggregator
is down arrive after it comes back (persistent session), also across a
broker restart; ``--until-idle`` and the CLI's exit codes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import paho.mqtt.client as mqtt

from pansketch.host_tools.query import core as query
from pansketch.host_tools.store.sqlite import Store
from tests.support.broker import needs_mosquitto, start_mosquitto
from tests.support.host import (SALT, T0, encoded, fleet_releases, host_cfg, params, record, topic,
                                     zipf_stream)
from tests.support.aggregator_mqtt import AggThread, REPO, _toml, counts, publish_all, wait_for

pytestmark = needs_mosquitto


def test_store_reject_dedupe_and_query(tmp_path):
    b = start_mosquitto(tmp_path)
    cfg = host_cfg(tmp_path, broker={"port": b.port, "host": "127.0.0.1"}, aggregator={"max_bytes": 20000})
    a = AggThread(cfg)
    try:
        truth: dict[str, int] = {}
        msgs = []
        for dv in range(3):
            p = params("agent-%d" % dv, w=256, d=5)
            windows = [zipf_stream(3000, 500, 1.2, 7 * dv + k) for k in range(2)]
            for ev in windows:
                for x in ev:
                    truth[x] = truth.get(x, 0) + 1
            msgs += [(topic(p.device), raw) for raw in record(p, str(tmp_path / p.device), windows)]
        good = list(msgs)
        bad = [
            (topic("agent-0"), b"\xa3not cbor"),  # malformed
            (topic("agent-0"), encoded(params("agent-0", w=256, d=5), seq=99, elo=T0 // 3600 + 50)[:-3]),
            (topic("agent-9"), msgs[0][1]),  # another device's release on this topic
            (topic("agent-0"), encoded(params("agent-0", w=4096, d=5))),  # oversized (80 KB)
        ]
        publish_all(b.port, good + bad + good[:3], "pub1")  # good[:3] again = duplicate deliveries
        wait_for(lambda: sum(counts(cfg.aggregator.db)) == len(good) + len(bad) + 3)
        assert counts(cfg.aggregator.db) == (len(good), len(bad), 3)
        st = Store(cfg.aggregator.db, readonly=True)
        codes = sorted(r[4] for r in st.rejections())
        assert codes == ["cbor", "cbor", "size", "topic"]
        items = sorted(truth, key=lambda x: -truth[x])[:20]
        ans = query.freq(st, items, salt=SALT)
        inside = sum(a.lo <= truth[a.item] <= a.hi for a in ans)
        assert inside >= 17  # 95% intervals on 20 items (P[< 17] < 2% under independence)
        assert ans[0].releases == len(good) and ans[0].devices == ["agent-0", "agent-1", "agent-2"]
        st.close()
    finally:
        assert a.close() == 0
        b.stop()


def test_shared_subscription_splits_load_and_stores_once(tmp_path):
    b = start_mosquitto(tmp_path)
    base = dict(broker={"port": b.port, "host": "127.0.0.1"}, aggregator={"shared_group": "aggs"})
    cfg = host_cfg(tmp_path, **base)
    a1 = AggThread(cfg)
    a2 = AggThread(cfg)
    try:
        msgs = fleet_releases("s", 8, 10, w=32)
        publish_all(b.port, msgs)
        wait_for(lambda: counts(cfg.aggregator.db)[0] == len(msgs))
        time.sleep(0.3)
        assert counts(cfg.aggregator.db) == (len(msgs), 0, 0)
    finally:
        s1, s2 = a1.close(), a2.close()
        b.stop()
    assert s1 == s2 == 0
    # both members of the group received a share, and no message was handled twice
    assert a1.counts["stored"] > 0 and a2.counts["stored"] > 0
    assert a1.counts["stored"] + a2.counts["stored"] == len(msgs)
    assert a1.counts["duplicate"] + a2.counts["duplicate"] == 0


def test_a_group_member_that_is_gone_gets_no_share(tmp_path):
    """A shared-group member starts clean (session expiry 0), so once it is gone the broker gives the
    others every release; a lone aggregator keeps its day-long session (the test below)."""
    assert host_cfg(tmp_path).aggregator.session_expiry_s == 86400
    assert host_cfg(tmp_path, aggregator={"shared_group": "g"}).aggregator.session_expiry_s == 0
    assert host_cfg(tmp_path, aggregator={"shared_group": "g", "session_expiry_s": 30}).aggregator.session_expiry_s == 30
    b = start_mosquitto(tmp_path, persistent=True)
    cfgs = [host_cfg(tmp_path, broker={"port": b.port, "host": "127.0.0.1", "client_id": "agg-%d" % i},
                     aggregator={"shared_group": "aggs"}) for i in (1, 2)]
    a1, a2 = AggThread(cfgs[0]), AggThread(cfgs[1])
    try:
        assert a1.close() == 0  # gone (a kill -9 closes the connection the same way)
        msgs = fleet_releases("g", 4, 6, w=32)
        publish_all(b.port, msgs)
        # with a persistent session for agg-1, mosquitto would queue every other message there
        wait_for(lambda: counts(cfgs[1].aggregator.db)[0] == len(msgs), 10)
    finally:
        a2.close()
        b.stop()
    assert a2.counts["stored"] == len(msgs)


def test_releases_published_while_aggregator_down_survive_broker_restart(tmp_path):
    b = start_mosquitto(tmp_path, persistent=True)
    cfg = host_cfg(tmp_path, broker={"port": b.port, "host": "127.0.0.1"})
    a = AggThread(cfg)  # creates the persistent session and its subscription
    p = params("offline", w=32)
    first = [(topic("offline"), encoded(p, seq=k, elo=T0 // 3600 + k, fill=k)) for k in range(5)]
    publish_all(b.port, first)
    wait_for(lambda: counts(cfg.aggregator.db)[0] == 5)
    assert a.close() == 0
    later = [(topic("offline"), encoded(p, seq=k, elo=T0 // 3600 + k, fill=k)) for k in range(5, 12)]
    publish_all(b.port, later)  # queued by the broker for the offline session
    b.restart()  # saved to disk and reloaded
    a = AggThread(cfg)
    try:
        wait_for(lambda: counts(cfg.aggregator.db)[0] == 12)
        st = Store(cfg.aggregator.db, readonly=True)
        assert [r.seq for r in st.releases()] == list(range(12))
        st.close()
    finally:
        a.close()
        b.stop()


def test_aggregator_reconnects_after_broker_restart(tmp_path):
    b = start_mosquitto(tmp_path, persistent=True)
    cfg = host_cfg(tmp_path, broker={"port": b.port, "host": "127.0.0.1", "reconnect_min_s": 1, "reconnect_max_s": 2})
    a = AggThread(cfg)
    try:
        p = params("rc", w=32)
        publish_all(b.port, [(topic("rc"), encoded(p, seq=0, fill=1))])
        wait_for(lambda: counts(cfg.aggregator.db)[0] == 1)
        b.restart()
        publish_all(b.port, [(topic("rc"), encoded(p, seq=1, elo=T0 // 3600 + 1, fill=2))])
        wait_for(lambda: counts(cfg.aggregator.db)[0] == 2, timeout=30)
    finally:
        assert a.close() == 0
        b.stop()


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.run([sys.executable, "-m", "pansketch.host_tools.cli", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=timeout)


def test_cli_until_idle_and_exit_codes(tmp_path):
    b = start_mosquitto(tmp_path)
    conf = _toml(tmp_path / "host.toml", b.port)
    p = params("cli", w=32)
    # publish while the CLI aggregator runs: a background publisher after it has subscribed
    proc_env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.Popen([sys.executable, "-m", "pansketch.host_tools.cli", "aggregate", "--config", conf, "--until-idle", "5"],
                            cwd=REPO, env=proc_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        head = []
        while True:  # publish only once it has subscribed (start-up takes a while on a loaded machine)
            line = proc.stderr.readline()
            assert line, "aggregator exited: %s" % "".join(head)
            head.append(line)
            if "subscribed to" in line:
                break
        publish_all(b.port, [(topic("cli"), encoded(p, seq=0, fill=5)), (topic("cli"), b"junk")])
        out, err = proc.communicate(timeout=30)
        err = "".join(head) + err
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "rejected message on pansketch/cli/release" in err and "1 stored" in err
    assert counts(str(tmp_path / "agg.db")) == (1, 1, 0)
    b.stop()
    # no broker: exits 1 with a message after the idle time
    r = _cli("aggregate", "--config", conf, "--until-idle", "1")
    assert r.returncode == 1 and "could not connect" in r.stderr
    # config error: exit 2, one line naming the key
    bad = _toml(tmp_path / "bad.toml", b.port, "kind = \"bloom\"")
    for cmd in (["aggregate", "--config", bad], ["status", "--config", bad], ["query", "--config", bad, "freq", "x"]):
        r = _cli(*cmd)
        assert r.returncode == 2, (cmd, r.stderr)
        assert r.stderr.strip().count("\n") == 0 and "fleet.kind" in r.stderr


def test_acks_follow_the_group_commit(tmp_path):
    """A burst is stored in group commits; every host ack names releases already committed (checked
    from another connection when the ack arrives), one ack message per device per group, and bad
    releases in a group are refused alone."""
    import json

    b = start_mosquitto(tmp_path)
    cfg = host_cfg(tmp_path, broker={"port": b.port, "host": "127.0.0.1"})
    seen: list[tuple[str, list[int], list[Any], bool]] = []

    def on_ack(_c: Any, _u: Any, m: Any) -> None:
        doc = json.loads(m.payload)
        st = Store(cfg.aggregator.db, readonly=True)
        try:
            have = {r.seq for r in st.releases(devices=[doc["dev"]])}
        finally:
            st.close()
        seen.append((doc["dev"], doc.get("ok", []), doc.get("bad", []), set(doc.get("ok", [])) <= have))

    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="ack-watch", protocol=mqtt.MQTTv5)
    sub.on_message = on_ack
    sub.connect("127.0.0.1", b.port)
    sub.subscribe("pansketch/+/ack", qos=1)
    sub.loop_start()
    a = AggThread(cfg)
    try:
        msgs = fleet_releases("g", 6, 40, w=64)
        bad = params("g0", w=64)
        msgs.insert(100, (topic("g0"), encoded(bad, seq=99, elo=T0 // 3600, fill=77)))  # conflict with seq 0
        publish_all(b.port, msgs)
        wait_for(lambda: sum(len(s[1]) for s in seen) == 240 and any(s[2] for s in seen))
    finally:
        rc = a.close()
        sub.disconnect()
        sub.loop_stop()
        b.stop()
    assert rc == 0
    assert all(ok for _d, _o, _b, ok in seen)  # nothing acknowledged before its commit
    assert sorted(s for d, o, _b, _k in seen for s in o if d == "g3") == list(range(40))
    assert [x for _d, _o, bads, _k in seen for x in bads] == [[99, "conflict"]]
    assert any(len(o) > 1 for _d, o, _b, _k in seen)  # groups: several releases of a device in one ack


def test_host_acks_beyond_the_broker_s_receive_maximum_all_arrive(tmp_path, caplog):
    """A broker that takes 4 QoS 1 messages in flight from the aggregator (CONNACK Receive Maximum 4) and
    groups of acknowledgements for 60 devices: 4 go out at once, the rest follow the broker's PUBACKs,
    and every device gets each of its releases acknowledged exactly once."""
    import json
    import logging

    caplog.set_level(logging.INFO, logger="pansketch.aggregator")
    b = start_mosquitto(tmp_path, conf_extra="max_inflight_messages 4\n")
    cfg = host_cfg(tmp_path, broker={"port": b.port, "host": "127.0.0.1"})
    acked: list[tuple[str, int]] = []
    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="ack-watch-rm", protocol=mqtt.MQTTv5)
    sub.on_message = lambda _c, _u, m: acked.extend((json.loads(m.payload)["dev"], q)
                                                    for q in json.loads(m.payload).get("ok", []))
    sub.connect("127.0.0.1", b.port)
    sub.subscribe("pansketch/+/ack", qos=1)
    sub.loop_start()
    a = AggThread(cfg)
    try:
        msgs = fleet_releases("rm", 60, 2, w=64)
        publish_all(b.port, msgs)
        wait_for(lambda: len(acked) >= 120)
        time.sleep(0.5)  # nothing more comes
    finally:
        rc = a.close()
        sub.disconnect()
        sub.loop_stop()
        b.stop()
    assert rc == 0
    assert sorted(acked) == sorted(("rm%d" % i, q) for i in range(60) for q in range(2))
    # mosquitto does not hold a client to it for QoS 1, so the log says whether the aggregator kept to it
    assert "(host acknowledgements in flight: up to 4)" in caplog.text


def test_stored_lines_written_at_once_are_the_lines_logging_writes():
    """loglines.info_lines: to the plain stderr handler of ``pansketch aggregate`` the per-release INFO
    lines go in one write, byte for byte what logging writes (timestamp apart); with a filter on the
    handler (or any other setup) each line is a record through logging, so the filter still applies."""
    import io
    import logging
    import re

    from pansketch.host_tools.ingest.loglines import LINE_FORMAT, info_lines

    lg = logging.getLogger("pansketch-test-lines.aggregator")
    parent = logging.getLogger("pansketch-test-lines")
    buf = io.StringIO()
    h = logging.StreamHandler(buf)
    h.setFormatter(logging.Formatter(LINE_FORMAT))
    parent.addHandler(h)
    parent.setLevel(logging.INFO)
    parent.propagate = False
    try:
        lines = ["stored dev-a seq 1: window x (3600 s), 10 bytes", "stored dev-b seq 2: window y (3600 s), 20 bytes"]
        info_lines(lg, lines)
        fast = buf.getvalue()
        buf.truncate(0)
        buf.seek(0)
        for line in lines:
            lg.info("%s", line)
        ref = buf.getvalue()
        stamp = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", re.M)
        assert fast.count("\n") == 2 and stamp.sub("", fast) == stamp.sub("", ref)
        assert stamp.sub("", fast).splitlines()[0] == "pansketch-test-lines.aggregator INFO " + lines[0]
        buf.truncate(0)
        buf.seek(0)
        h.addFilter(lambda r: "dev-b" not in r.getMessage())  # not a plain handler any more
        info_lines(lg, lines)
        assert "dev-a" in buf.getvalue() and "dev-b" not in buf.getvalue()
    finally:
        parent.removeHandler(h)
