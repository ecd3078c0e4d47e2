"""The real pansketch-agent against a real mosquitto: delivery, order, retries, status, last will."""

from __future__ import annotations

import array
import json
import os
import signal
import time
from typing import IO

import cbor2
import paho.mqtt.client as mqtt

from tests.support.e2e import (Capture, agent_toml, free_port, needs_mosquitto, run_agent, spawn_agent,
                                    start_host, start_mosquitto, status_docs, stop_process)
from tests.support.agent_publisher import FROZEN, T0, estimate, outbox


pytestmark = needs_mosquitto


def test_broker_down_then_up_delivers_everything_in_order_byte_for_byte(tmp_path):
    port = free_port()
    state = str(tmp_path / "state")
    cfg = agent_toml(str(tmp_path / "a.toml"), "pi-1", port, state)
    # "each once" below: no re-send after a host ack that a loaded machine delays past the usual 2 s
    with open(cfg) as f:
        text = f.read()
    with open(cfg, "w") as f:
        f.write(text.replace("ack_timeout_s = 2", "ack_timeout_s = 10"))
    # no broker yet: feed counts and commits, cannot deliver, exits 1, keeps the releases
    r = run_agent("feed", cfg, "--timeout", "1", *FROZEN, input=b"a\nb\n")
    assert r.returncode == 1, r.stderr
    assert b"1 of 1 release(s) not stored by the host" in r.stderr and b"stay in" in r.stderr
    r = run_agent("feed", cfg, "--timeout", "1", *FROZEN, input=b"c\n" * 500)
    assert r.returncode == 1
    snap = outbox(state)
    assert sorted(snap) == [0, 1]
    broker = start_mosquitto(tmp_path, port=port)
    try:
        cap = Capture(port, ["pansketch/+/release", "pansketch/+/status"])
        host = start_host(tmp_path, port)
        r = run_agent("feed", cfg, "--timeout", "20", *FROZEN, input=b"")
        assert r.returncode == 0, r.stderr
        assert b"all releases stored by the host (next seq 3)" in r.stderr
        assert outbox(state) == {}, "releases the host acknowledged leave the outbox"
        assert cap.wait(lambda m: len([x for x in m if x[0].endswith("/release")]) >= 3)
        got = cap.on("/release")
        assert got[:2] == [snap[0], snap[1]], "retries are byte-for-byte the committed releases (no noise re-drawn)"
        seqs = [cbor2.loads(p)["seq"] for p in got]
        assert seqs == [0, 1, 2], "in sequence order, each once"
        assert [cbor2.loads(p)["part"] for p in got] == [0, 1, 2]  # same epoch, released at each end of input
        # data-independent size: 2 events, 500 events and 0 events give the same number of bytes
        assert len({len(p) for p in got}) == 1
        assert cap.wait(lambda m: any(json.loads(p).get("acked_seq") == 2 for t, p, _ in m if t.endswith("/status")))
        st = [d for d in status_docs(cap) if d.get("acked_seq") == 2][-1]
        assert st["state"] == "online" and st["dev"] == "pi-1" and st["pending"] == 0
        assert st["next_seq"] == 3 and st["oldest_pending"] is None and st["rejected"] == 0
        assert set(st) >= {"state", "dev", "ts", "acked_seq", "pending"}
        assert not any(k in st for k in ("events", "count", "n")), "status carries no event counts"
        cap.close()
        assert host.stop() == 0
    finally:
        broker.stop()


def _pipe_drained(w: "IO[bytes]", timeout: float) -> bool:
    """True once nothing written to the pipe ``w`` is left unread (FIONREAD on its write end)."""
    import fcntl
    import termios

    end = time.monotonic() + timeout
    n = array.array("i", [1])
    while time.monotonic() < end:
        fcntl.ioctl(w.fileno(), termios.FIONREAD, n, True)
        if n[0] == 0:
            return True
        time.sleep(0.02)
    return False


def test_sigterm_keeps_noisy_state_and_last_will_on_kill(tmp_path):
    broker = start_mosquitto(tmp_path)
    try:
        state = str(tmp_path / "state")
        cfg = agent_toml(str(tmp_path / "a.toml"), "pi-2", broker.port, state)
        host = start_host(tmp_path, broker.port)
        cap = Capture(broker.port, ["pansketch/pi-2/status", "pansketch/pi-2/release"])
        p = spawn_agent("run", cfg, "--insecure-seed", "s1", *FROZEN, log=str(tmp_path / "agent.log"))
        assert cap.wait(lambda m: any(json.loads(x[1])["state"] == "online" for x in m))
        p.stdin.write(b"x\n" * 50 + b"y\n")
        p.stdin.flush()
        # read (the pipe is empty) and then counted (a loaded machine needs more than a fraction of a second)
        assert _pipe_drained(p.stdin, 20), "the agent did not read its input"
        time.sleep(1.0)
        assert stop_process(p, signal.SIGTERM) == 0
        assert outbox(state) == {}, "the window is still open: nothing is released on SIGTERM"
        assert os.path.exists(os.path.join(state, "state.bin"))
        assert cap.wait(lambda m: json.loads(m[-1][1]) == {"state": "offline"})
        # restart in the same epoch: the persisted noisy state continues
        r = run_agent("feed", cfg, "--timeout", "20", "--insecure-seed", "s2", *FROZEN, input=b"x\n" * 30)
        assert r.returncode == 0, r.stderr
        assert b"resumed state seq 0" in r.stderr
        assert cap.wait(lambda m: any(t.endswith("/release") for t, _, _ in m))
        rel = cap.on("/release")
        assert len(rel) == 1
        # sd of one cell: internal + output discrete Gaussian, sigma^2 = 4 each -> sd ~2.8
        assert abs(estimate(rel[0], "x") - 80) <= 12
        # a killed agent (no clean disconnect) gets its retained last will
        p = spawn_agent("run", cfg, *FROZEN)
        n = len(cap.msgs)
        assert cap.wait(lambda m: any(json.loads(x[1]).get("state") == "online" for x in m[n:] if x[0].endswith("/status")))
        p.kill()
        p.wait()
        assert cap.wait(lambda m: m[-1][1] == b'{"state":"offline"}')
        cap.close()
        late = Capture(broker.port, ["pansketch/pi-2/status"], client_id="late")
        assert late.wait(lambda m: len(m) >= 1)
        assert late.msgs[0] == ("pansketch/pi-2/status", b'{"state":"offline"}', True)
        late.close()
        assert host.stop() == 0
    finally:
        broker.stop()


def test_local_mqtt_source_forwards_only_noisy_releases(tmp_path):
    """Beside a Tasmota-style device: raw JSON readings in, one noisy release out."""
    broker = start_mosquitto(tmp_path)
    try:
        state = str(tmp_path / "state")
        src = '\n'.join(['type = "mqtt"', 'host = "127.0.0.1"', "port = %d" % broker.port,
                         'topic = "tele/+/SENSOR"', 'field = "payload.BLE.mac"', 'weight_field = "payload.BLE.n"'])
        cfg = agent_toml(str(tmp_path / "a.toml"), "pi-3", broker.port, state, window_s=60, source=src)
        cap = Capture(broker.port, ["pansketch/#"])
        # simulated clock: 55 s before a window end, 10x speed -> the window closes after ~5.5 s real
        # (the 40 readings below take 0.2 s, or more than 2 s on a loaded machine)
        log = str(tmp_path / "agent.log")
        p = spawn_agent("run", cfg, "--insecure-seed", "s3", "--clock-start", str(T0 + 3600 - 55), "--clock-speed", "10",
                        log=log)
        deadline = time.monotonic() + 10
        while b"source subscribed" not in open(log, "rb").read():
            assert time.monotonic() < deadline, open(log).read()
            time.sleep(0.05)
        raw = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="tasmota")
        raw.connect("127.0.0.1", broker.port)
        raw.loop_start()
        for i in range(40):
            raw.publish("tele/ble-1/SENSOR", json.dumps({"BLE": {"mac": "aa:bb:cc", "n": 1}}), qos=1).wait_for_publish(5)
        raw.publish("tele/ble-1/LWT", "Online").wait_for_publish(5)  # no field: ignored
        raw.disconnect()
        raw.loop_stop()
        assert cap.wait(lambda m: any(t.endswith("/release") for t, _, _ in m), timeout=20)
        assert stop_process(p) == 0
        rel = cap.on("/release")[0]
        m = cbor2.loads(rel)
        assert m["dev"] == "pi-3" and m["elo"] == (T0 + 3600 - 55) // 60
        assert abs(estimate(rel, "aa:bb:cc") - 40) <= 12
        # only releases and status leave on pansketch/#: the raw readings are not forwarded
        assert {t for t, _, _ in cap.msgs} <= {"pansketch/pi-3/release", "pansketch/pi-3/status"}
        cap.close()
    finally:
        broker.stop()
