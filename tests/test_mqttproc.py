"""The aggregator's helper process (MQTT and validation: host_tools/ingest/mqttproc.py) against a real
mosquitto.

Checks: if the helper dies other than while validating a message (that
case is tests/test_hostile.py's: the helper is restarted), the aggregator
stops with exit code 1 and says how, and what it had committed stays
stored; if the aggregator process is killed, its helper does not linger
(it disconnects); SIGTERM to the whole process group (systemd, Ctrl-C) is
a clean exit 0 that stores what was received; acknowledgements of what a
dead helper received are not sent through its successor.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from typing import Any, Optional

import pytest

from tests.support.broker import needs_mosquitto, start_mosquitto
from tests.support.aggregator_mqtt import REPO, AggThread, _toml, counts, publish_all, wait_for
from tests.support.host import T0, encoded, host_cfg, params, topic

pytestmark = needs_mosquitto


def helpers(parent: int, module: str = "pansketch.host_tools.ingest.mqttproc") -> list[int]:
    """Pids of the ``python -m <module>`` processes whose parent is ``parent``."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open("/proc/%s/cmdline" % d, "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and module.encode() in cmd.split(b"\0"):
            out.append(int(d))
    return out


def gone(pid: int) -> bool:
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except OSError:
        return True


@pytest.mark.parametrize("module,name", [("pansketch.host_tools.ingest.mqttproc", "MQTT process")])
def test_dead_helper_stops_the_aggregator(tmp_path, caplog, module, name):
    b = start_mosquitto(tmp_path)
    try:
        cfg = host_cfg(tmp_path, broker={"port": b.port, "host": "127.0.0.1"})
        a = AggThread(cfg)
        p = params("child", w=32)
        publish_all(b.port, [(topic("child"), encoded(p, seq=0, fill=3))])
        wait_for(lambda: counts(cfg.aggregator.db)[0] == 1)
        (pid,) = helpers(os.getpid(), module)
        with caplog.at_level(logging.ERROR, logger="pansketch.aggregator"):
            os.kill(pid, signal.SIGKILL)
            a.t.join(20)
            assert not a.t.is_alive()
        assert a.rc == [1]
        assert "%s (pid %d) exited unexpectedly (killed by SIGKILL)" % (name, pid) in caplog.text
        assert counts(cfg.aggregator.db)[0] == 1
        assert not helpers(os.getpid(), "pansketch.host_tools.ingest.mqttproc") and not helpers(os.getpid(), "pansketch.host_tools.ingest.validproc")

    finally:
        b.stop()


def _start_cli(conf: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "pansketch.host_tools.cli", "aggregate", "--config", conf], cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    assert proc.stderr is not None
    while True:
        line = proc.stderr.readline()
        assert line, "aggregator exited"
        if "subscribed to" in line:
            return proc


def _helpers_of(pid: int) -> list[int]:
    def both() -> list[int]:
        return helpers(pid) + helpers(pid, "pansketch.host_tools.ingest.validproc")

    wait_for(lambda: len(both()) == 1, 10)  # the MQTT process validates too: no validation process
    return both()


def test_killed_aggregator_takes_its_helpers_along(tmp_path):
    b = start_mosquitto(tmp_path)
    proc: Optional[subprocess.Popen[str]] = None
    try:
        proc = _start_cli(_toml(tmp_path / "host.toml", b.port))
        kids = _helpers_of(proc.pid)
        proc.kill()
        proc.wait(10)
        wait_for(lambda: all(gone(k) for k in kids), 10)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        b.stop()


def test_sigterm_to_the_group_is_a_clean_exit(tmp_path):
    b = start_mosquitto(tmp_path)
    proc: Optional[subprocess.Popen[str]] = None
    try:
        proc = _start_cli(_toml(tmp_path / "host.toml", b.port))
        kids = _helpers_of(proc.pid)
        p = params("grp", w=32)
        publish_all(b.port, [(topic("grp"), encoded(p, seq=k, elo=T0 // 3600 + k, fill=2)) for k in range(20)])
        db = str(tmp_path / "agg.db")
        wait_for(lambda: os.path.exists(db) and counts(db)[0] >= 1)
        os.killpg(proc.pid, signal.SIGTERM)  # systemd's KillMode=control-group, Ctrl-C: both processes
        _out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert all(gone(k) for k in kids)
        assert "aggregator stopped: " in err
        stored, _rej, _dup = counts(db)
        assert stored == 20, err
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        b.stop()


def test_acks_of_a_dead_childs_messages_are_dropped():
    """Msg.mid carries the child's generation: after a restart, acknowledging a message the dead child
    received must not PUBACK the successor's message that has the same packet id (not stored yet)."""
    import socket
    from multiprocessing.connection import Connection

    from pansketch.host_tools.ingest.mqttparent import MQTTProcess
    from pansketch.host_tools.ingest.mqttshared import GEN_SHIFT

    a, b = socket.socketpair()
    mp = MQTTProcess(None, lambda _m: None, lambda _e: None)  # type: ignore[arg-type]
    mp.conn, theirs = Connection(a.detach()), Connection(b.detach())
    mp.gen = 2
    mp.acknowledge([(1 << GEN_SHIFT | 7, 1), (2 << GEN_SHIFT | 8, 1), (2 << GEN_SHIFT | 7, 1)], [("t/ack", b"x")])
    assert theirs.recv() == ("ack", [(8, 1), (7, 1)], [("t/ack", b"x")])
    mp.acknowledge([(1 << GEN_SHIFT | 9, 1)], [])  # nothing left to send
    assert not theirs.poll(0.2)


@pytest.mark.parametrize("code", ["timeout", "internal"])
def test_poison_refusal_names_dev_and_seq(tmp_path, code):
    """A message refused as poison (it killed the MQTT process twice) is refused with the dev and seq its
    bytes name, as every refusal is where they are readable (the rejection row; pansketch status counts
    that seq as refused, not as lost)."""
    import dataclasses
    import hashlib

    from pansketch.host_tools.ingest import mqttproc, mqttshared, validproc

    p = params("pi-poison")
    payload = encoded(p, seq=41)
    t = topic("pi-poison")
    key = mqttshared.message_key(t, hashlib.sha256(payload).digest())
    watch = tmp_path / "watch"
    watch.write_bytes(bytes(mqttshared.WATCH_SIZE))
    s = mqttshared.Settings(None, "c", (), False, 0, 1, validation=validproc.Settings(None, 1 << 20, cpu_s=5),
                            watch=str(watch), poison=((key, mqttshared.POISON_DEATHS, code),))
    v = mqttproc._Judge(s)(t, payload)
    assert v[:2] == ("rejected", code) and v[3:] == ("pi-poison", 41), v
    # killed once more while reading dev/seq for the refusal: refused without reading anything
    s = dataclasses.replace(s, poison=((key, mqttshared.POISON_DEATHS + 1, code),))
    v = mqttproc._Judge(s)(t, payload)
    assert v[:2] == ("rejected", code) and v[3:] == (None, None), v


def test_acks_from_before_a_reconnect_are_not_sent_on_the_new_connection(tmp_path):
    """One MQTT process, a clean session: its connection is taken over and it reconnects. A message received
    before (packet id 1) and acknowledged after the reconnect must not PUBACK the new session's packet id 1,
    another message that is not stored yet (with Receive Maximum 1 the broker would then send the next)."""
    import threading
    import time

    import paho.mqtt.client as mqtt

    from pansketch.host_tools.hostconfig import BrokerConfig
    from pansketch.host_tools.ingest.mqttparent import MQTTProcess
    from pansketch.host_tools.ingest.mqttshared import Msg, Settings

    b = start_mosquitto(tmp_path)
    got: list[Msg] = []
    events: list[tuple] = []
    cond = threading.Condition()

    def on_messages(ms: list[Msg]) -> None:
        with cond:
            got.extend(ms)
            cond.notify_all()

    def on_event(ev: tuple) -> None:
        with cond:
            events.append(ev)
            cond.notify_all()

    def until(pred, t: float = 15.0) -> None:
        with cond:
            assert cond.wait_for(pred, t), (got, events)

    s = Settings(BrokerConfig(host="127.0.0.1", port=b.port, reconnect_min_s=1, reconnect_max_s=1), "rc-agg",
                 (("rc/#", 1),), False, 0, 1)
    mp = MQTTProcess(s, on_messages, on_event)
    mp.start()
    try:
        until(lambda: ("subscribed", None) in events)
        publish_all(b.port, [("rc/a", b"A")], client_id="rc-pub1")
        until(lambda: len(got) == 1)
        kick = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="rc-agg", protocol=mqtt.MQTTv5)
        kick.connect("127.0.0.1", b.port)  # takes the session over: the MQTT process is disconnected
        kick.loop_start()
        time.sleep(0.5)
        kick.disconnect()
        kick.loop_stop()
        until(lambda: events.count(("subscribed", None)) == 2)
        publish_all(b.port, [("rc/b", b"B")], client_id="rc-pub2")
        until(lambda: len(got) == 2)
        assert got[0].mid & 0xFFFF == got[1].mid & 0xFFFF == 1  # the same packet id in both sessions
        mp.acknowledge([(got[0].mid, 1)], [])  # A stored: its ack is from the old connection
        publish_all(b.port, [("rc/c", b"C")], client_id="rc-pub3")
        time.sleep(2.0)
        with cond:
            assert len(got) == 2, "B was PUBACKed by A's acknowledgement before it was stored: %r" % got
        mp.acknowledge([(got[1].mid, 1)], [])  # B stored: now the broker may send C
        until(lambda: len(got) == 3)
        assert got[2].payload == b"C"
    finally:
        mp.close()
        b.stop()


def test_backstop_never_kills_the_successor_of_a_process_that_died_validating(tmp_path):
    """The wall-clock backstop times the message the watch file shows. A restarted MQTT process that is
    validating its own first message (counter 1 again) must get its own time, not inherit the dead
    process's: killing it would make the aggregator stop (not validating any more when its death is seen)."""
    import mmap
    import time

    from pansketch.host_tools.ingest import mqttparent, mqttshared, validproc

    s = mqttshared.Settings(None, "c", (), False, 0, 1, validation=validproc.Settings(None, 1 << 20, cpu_s=0.01))
    mp = mqttparent.MQTTProcess(s, lambda _m: None, lambda _e: None)
    path = tmp_path / "watch"
    path.write_bytes(bytes(mqttshared.WATCH_SIZE))
    with open(path, "r+b") as f:
        mp._mm = mmap.mmap(f.fileno(), mqttshared.WATCH_SIZE)
    old = subprocess.Popen(["sleep", "60"])
    new = subprocess.Popen(["sleep", "60"])
    try:
        mp.proc = old
        mqttshared._WATCH.pack_into(mp._mm, 0, 1, 1, b"k" * 32, 0, 10)  # validating its message 1
        import threading

        threading.Thread(target=mp._backstop, daemon=True).start()
        time.sleep(9.0)  # the limit is 10 s + 4 budgets
        old.kill()
        old.wait()
        with mp._send_lock:  # what _spawn does: the new process, validating its own message 1
            mp.proc = new
        time.sleep(3.0)
        assert new.poll() is None, "the backstop killed the new process after %.1f s of its message" % 3.0
    finally:
        mp._closing = True
        for p in (old, new):
            if p.poll() is None:
                p.kill()
            p.wait()


def test_inbox_drops_qos0_past_its_backlog_but_never_qos1():
    """QoS 0 arrivals are bounded by nothing upstream: a flood of them used to grow the MQTT process's
    inbox while validation fell behind. Past the backlog a QoS 0 arrival is dropped and counted (the
    batcher reports the count once); a QoS 1 one is never dropped (below its own bound it is kept
    at once; at the bound the network thread waits: next test)."""
    import threading

    from pansketch.host_tools.ingest.mqttproc import Inbox

    box = Inbox(qos0_max=3)
    assert all(box.add(("t", b"x", i, 0)) for i in range(3))
    assert not box.add(("t", b"x", 3, 0)) and not box.add(("t", b"x", 4, 0))
    assert box.add(("t", b"x", 5, 1))  # QoS 1 past the QoS 0 backlog: kept
    batch, dropped = box.take(threading.Event())
    assert [m[2] for m in batch] == [0, 1, 2, 5] and dropped == 2
    assert box.add(("t", b"x", 6, 0))  # room again
    batch, dropped = box.take(threading.Event())
    assert [m[2] for m in batch] == [6] and dropped == 0
    closing = threading.Event()
    closing.set()
    assert box.take(closing) == ([], 0)  # closing: no wait


def test_inbox_holds_qos1_at_its_bound_until_taken_and_takes_at_most_a_batch():
    """At ``qos1_max`` waiting messages add() of a QoS 1 message waits (never drops it) until take()
    makes room, then keeps it after the others; take() returns at most ``limit``, oldest first;
    closing releases a waiting add() (the process is stopping)."""
    import threading
    import time

    from pansketch.host_tools.ingest.mqttproc import Inbox

    box = Inbox(qos1_max=4)
    for i in range(4):
        assert box.add(("t", b"x", i, 1))
    done = threading.Event()
    t = threading.Thread(target=lambda: (box.add(("t", b"x", 4, 1)), done.set()), daemon=True)
    t.start()
    assert not done.wait(0.3)  # held at the bound
    batch, _d = box.take(threading.Event(), limit=3)
    assert [m[2] for m in batch] == [0, 1, 2]
    assert done.wait(5)  # room: the held message went in, after the one still waiting
    batch, _d = box.take(threading.Event())
    assert [m[2] for m in batch] == [3, 4] and box.waits == 1 and box.peak == 4
    for i in range(4):
        box.add(("t", b"x", 10 + i, 1))
    closing = threading.Event()
    box.closing = closing
    done.clear()
    t = threading.Thread(target=lambda: (box.add(("t", b"x", 20, 1)), done.set()), daemon=True)
    t.start()
    time.sleep(0.2)
    closing.set()
    box.wake()
    assert done.wait(5)


def test_gatherer_forwards_a_full_batch_at_once_and_a_partial_one_after_its_wait():
    """The network thread's batches (Gatherer): nothing waits, nothing to do; a partial batch is held until
    ``wait_s`` after its first message (tick says how long is left), then forwarded whole, in order;
    ``max_n`` messages are forwarded at the next tick without waiting; flush forwards what is left."""
    from pansketch.host_tools.ingest.mqttproc import Gatherer

    now = [100.0]
    out: list[list[Any]] = []
    g = Gatherer(out.append, max_n=4, wait_s=0.005, clock=lambda: now[0])
    assert g.tick() is None and out == []
    g.add(("t", b"a", 1, 1))
    now[0] += 0.002
    g.add(("t", b"b", 2, 1))
    assert g.tick() == pytest.approx(0.003) and out == []  # the wait runs from the first message
    now[0] += 0.003
    assert g.tick() is None and [[m[2] for m in b] for b in out] == [[1, 2]]
    for i in range(5):
        g.add(("t", b"x", 10 + i, 0))
    assert g.tick() is None  # 5 >= max_n: forwarded without waiting (all of them: one read's worth)
    assert [m[2] for m in out[-1]] == [10, 11, 12, 13, 14]
    g.add(("t", b"c", 20, 1))
    g.flush()
    assert [m[2] for m in out[-1]] == [20] and g.tick() is None and len(out) == 3
