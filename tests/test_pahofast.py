"""host_tools/ingest/pahofast.py against a real mosquitto: the buffered reader delivers every message
byte for byte (small ones many to a read, large ones over many reads, over TLS too) without leaving
any in its buffer, through paho's handler or the fast path; a PUBLISH with properties still goes to
paho's; a batch of PUBACKs in one write is what the broker takes as acknowledged; and the MQTT
process's inbox holds the network thread back at its bound without losing a message.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from pansketch.host_tools.ingest import pahofast
from tests.support.broker import make_test_pki, needs_mosquitto, start_mosquitto

pytestmark = needs_mosquitto


def _sub(port: int, cid: str, clean: bool = True, tls: Any = None, auto_ack: bool = False,
         fast: bool = False) -> tuple[pahofast.BufferedClient, list[Any], Any]:
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    got: list[Any] = []
    ready = threading.Event()
    c = pahofast.BufferedClient(mqtt.CallbackAPIVersion.VERSION2, client_id=cid, protocol=mqtt.MQTTv5,
                                manual_ack=True)
    if tls is not None:
        c.tls_set(ca_certs=tls["cafile"])
    def on_message(_c: Any, _u: Any, m: Any) -> None:
        got.append((m.topic, m.payload, m.mid, m.dup))
        if auto_ack:  # else the broker stops at 20 unacknowledged (max_inflight_messages)
            pahofast.ack_many(c, [m.mid])

    def on_fast(topic: str, payload: bytes, mid: int, qos: int) -> None:
        got.append((topic, payload, mid, "fast", qos))
        if auto_ack and qos:
            pahofast.ack_many(c, [mid])

    c.on_message = on_message
    if fast:
        c.on_fast = on_fast
    c.on_subscribe = lambda *_a: ready.set()
    c.on_connect = lambda cl, *_a: cl.subscribe("t/#", qos=1)
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = 0 if clean else 300
    c.connect("localhost" if tls else "127.0.0.1", port, clean_start=clean, properties=props)
    c.loop_start()
    assert ready.wait(10)
    return c, got, ready


def _publish(port: int, msgs: list[tuple[str, bytes]], tls: Any = None) -> None:
    p = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="pub", protocol=mqtt.MQTTv5)
    if tls is not None:
        p.tls_set(ca_certs=tls["cafile"])
    p.connect("localhost" if tls else "127.0.0.1", port)
    p.loop_start()
    infos = [p.publish(t, pl, qos=1) for t, pl in msgs]
    for i in infos:
        i.wait_for_publish(20)
    p.disconnect()
    p.loop_stop()


def _wait(pred: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


@pytest.mark.parametrize("tls,fast", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["tcp", "tls", "tcp-fast", "tls-fast"])
def test_buffered_reader_delivers_every_message_and_leaves_none_buffered(tmp_path, tls, fast):
    """A burst of 300 small messages (many packets to one read, the last ones with nothing after them:
    a reader that left them in its buffer would hold them until the next keepalive, 60 s), then
    messages larger than READ_SIZE (one packet over many reads) and sizes around it; through paho's
    handler, or (``fast``) every one through on_fast (none of them has properties)."""
    pki = make_test_pki(tmp_path / "pki") if tls else None
    b = start_mosquitto(tmp_path, tls=pki)
    port = b.tls_port if tls else b.port
    c, got, _r = _sub(port, "fast-sub", tls=pki, auto_ack=True, fast=fast)
    try:
        small = [("t/s/%d" % i, bytes([i % 256]) * (i % 97 + 1)) for i in range(300)]
        _publish(port, small, pki)
        assert _wait(lambda: len(got) == len(small), 10), len(got)
        big = [("t/b/%d" % i, bytes(range(256)) * (n // 256) + b"x" * (n % 256))
               for i, n in enumerate((pahofast.READ_SIZE - 3, pahofast.READ_SIZE + 5, 3 * pahofast.READ_SIZE + 17, 1))]
        _publish(port, big, pki)
        assert _wait(lambda: len(got) == len(small) + len(big), 20), len(got)
        assert [(g[0], g[1]) for g in got] == small + big  # in order, byte for byte
        assert all((g[3] == "fast") == fast for g in got)
        assert c.buffered() == 0
    finally:
        c.disconnect()
        c.loop_stop()
        b.stop()


def test_ack_many_is_one_write_the_broker_takes_as_acknowledged(tmp_path):
    """Three of five messages acknowledged with ack_many: after a reconnect to the persistent session the
    broker redelivers exactly the other two (dup set); acknowledged with ack_many too, nothing more comes."""
    b = start_mosquitto(tmp_path)
    c, got, _r = _sub(b.port, "acker", clean=False)
    sent: list[Any] = []
    c._packet_queue = (lambda orig: lambda *a: (sent.append(a[1]), orig(*a))[1])(c._packet_queue)  # type: ignore
    try:
        msgs = [("t/a/%d" % i, b"m%d" % i) for i in range(5)]
        _publish(b.port, msgs)
        assert _wait(lambda: len(got) == 5, 10)
        n0 = len(sent)
        pahofast.ack_many(c, [got[i][2] for i in (0, 2, 4)])
        assert len(sent) == n0 + 1 and len(sent[-1]) == 12  # one queued write, three 4-byte PUBACKs
        time.sleep(0.5)  # the loop thread writes it
        c.disconnect()
        c.loop_stop()
        c, got2, _r = _sub(b.port, "acker", clean=False)
        assert _wait(lambda: len(got2) == 2, 10), got2
        assert sorted(t for t, _p, _m, _d in got2) == ["t/a/1", "t/a/3"] and all(d for *_x, d in got2)
        pahofast.ack_many(c, [m for _t, _p, m, _d in got2])
        time.sleep(0.5)
        c.disconnect()
        c.loop_stop()
        c, got3, _r = _sub(b.port, "acker", clean=False)
        time.sleep(1.0)
        assert got3 == []
    finally:
        c.disconnect()
        c.loop_stop()
        b.stop()


def test_fast_path_takes_only_publishes_without_properties(tmp_path):
    """on_fast gets QoS 0 and QoS 1 publishes without MQTT v5 properties (topic, payload, packet id,
    QoS); a publish with properties (here a user property and a content type) goes to paho's handler,
    which decodes them for on_message; an empty payload and a topic of 300 bytes pass the fast path."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    b = start_mosquitto(tmp_path)
    c, got, _r = _sub(b.port, "fast-props", auto_ack=True, fast=True)
    props_seen: list[Any] = []
    orig = c.on_message

    def on_message(cl: Any, u: Any, m: Any) -> None:
        props_seen.append((m.topic, m.properties.UserProperty, m.properties.ContentType))
        orig(cl, u, m)

    c.on_message = on_message
    p = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="pub-props", protocol=mqtt.MQTTv5)
    p.connect("127.0.0.1", b.port)
    p.loop_start()
    try:
        pp = Properties(PacketTypes.PUBLISH)
        pp.UserProperty = ("k", "v")
        pp.ContentType = "application/cbor"
        long_topic = "t/" + "x" * 298
        infos = [p.publish("t/q1", b"one", qos=1), p.publish("t/q0", b"zero", qos=0),
                 p.publish("t/props", b"with", qos=1, properties=pp), p.publish("t/empty", b"", qos=1),
                 p.publish(long_topic, b"long", qos=1)]
        for i in infos:
            i.wait_for_publish(10)
        assert _wait(lambda: len(got) == 5, 10), got
        by = {g[0]: g for g in got}
        assert by["t/q1"][1:2] == (b"one",) and by["t/q1"][3:] == ("fast", 1) and by["t/q1"][2] > 0
        assert by["t/q0"][1] == b"zero" and by["t/q0"][3:] == ("fast", 0)
        assert by["t/empty"][1] == b"" and by["t/empty"][3] == "fast"
        assert by[long_topic][1] == b"long" and by[long_topic][3] == "fast"
        assert by["t/props"][1] == b"with" and len(by["t/props"]) == 4  # paho's on_message, not on_fast
        assert props_seen == [("t/props", [("k", "v")], "application/cbor")]
    finally:
        p.disconnect()
        p.loop_stop()
        c.disconnect()
        c.loop_stop()
        b.stop()


def test_inbox_bound_holds_the_network_thread_and_loses_nothing(tmp_path):
    """The MQTT process's inbox on a real connection: the broker may send more unacknowledged QoS 1
    messages than Receive Maximum (mosquitto 2.0.11 does once PUBACKs come back in groups), so at
    its bound the inbox makes paho's network thread wait inside the callback until the batcher
    takes some. 400 messages through an inbox of 16 with a slow batcher acknowledging in groups
    of 32: every one arrives exactly once, in order, the inbox never held more than 16, and the
    network thread did wait (a test that never reached the bound would prove nothing)."""
    from pansketch.host_tools.ingest.mqttproc import Inbox

    b = start_mosquitto(tmp_path)
    c, _got, _r = _sub(b.port, "bounded", fast=True)
    box = Inbox(qos1_max=16)
    closing = threading.Event()
    box.closing = closing
    c.on_fast = lambda t, p, mid, q: box.add((t, p, mid, q))
    taken: list[Any] = []

    def batcher() -> None:
        while not closing.is_set() and len(taken) < 400:
            batch, _d = box.take(closing, limit=32)
            time.sleep(0.01)  # validation and forwarding take time
            taken.extend(batch)
            pahofast.ack_many(c, [m[2] for m in batch if m[3] == 1])

    t = threading.Thread(target=batcher, daemon=True)
    t.start()
    try:
        msgs = [("t/n/%d" % i, b"%d" % i * 50) for i in range(400)]
        _publish(b.port, msgs)
        assert _wait(lambda: len(taken) == 400, 30), len(taken)
        assert [(m[0], m[1]) for m in taken] == msgs
        assert box.peak <= 16 and box.waits > 0, (box.peak, box.waits)
    finally:
        closing.set()
        box.wake()
        t.join(5)
        c.disconnect()
        c.loop_stop()
        b.stop()


def _publisher(port: int, cid: str, inflight: int) -> pahofast.BufferedClient:
    c = pahofast.BufferedClient(mqtt.CallbackAPIVersion.VERSION2, client_id=cid, protocol=mqtt.MQTTv5,
                                manual_ack=True)
    c.max_inflight_messages_set(inflight)
    ok = threading.Event()
    c.on_connect = lambda *_a: ok.set()
    c.connect("127.0.0.1", port)
    c.loop_start()
    assert ok.wait(10)
    return c


def _count_calls(monkeypatch: Any, cls: Any, name: str) -> list[Any]:
    calls: list[Any] = []
    orig = getattr(cls, name)

    def wrapped(self: Any, *a: Any) -> Any:
        calls.append(a)
        return orig(self, *a)

    monkeypatch.setattr(cls, name, wrapped)
    return calls


def test_publish_many_is_one_write_in_order_and_every_puback_clears_it(tmp_path, monkeypatch):
    """20 host acknowledgements with 8 allowed in flight: the 8 go out as one queued write of 8 PUBLISH
    packets, the other 12 wait in paho's queue and follow the PUBACKs; the subscriber gets all 20, in
    order, byte for byte; the broker's PUBACKs (success, no properties) are taken by the fast path
    (paho's decoder is never called) and leave nothing in flight or queued."""
    b = start_mosquitto(tmp_path)
    s, got, _r = _sub(b.port, "acks-sub", auto_ack=True)
    paho_pubacks = _count_calls(monkeypatch, mqtt.Client, "_handle_pubackcomp")
    c = _publisher(b.port, "host", 8)
    sent: list[Any] = []
    c._packet_queue = (lambda orig: lambda *a: (sent.append(a), orig(*a))[1])(c._packet_queue)  # type: ignore
    try:
        msgs = [("t/dev-%d/ack" % i, b'{"dev":"dev-%d","ok":[%d]}' % (i, i)) for i in range(20)]
        pahofast.publish_many(c, msgs)
        ours = list(c._out_messages.values())[:8]  # publish_many's entries (the 12 others are paho's own)
        # their infos work as paho's: a thread waiting on each wakes once its PUBACK is read
        waiters = [threading.Thread(target=m.info.wait_for_publish, args=(10,)) for m in ours]
        for w in waiters:
            w.start()
        first = sent[0]
        assert first[0] == pahofast.PUBLISH_QOS1 and first[3] == 1
        # 8 packets: fixed header 0x32, remaining length, topic, packet id, property length 0, payload
        assert len(first[1]) == sum(2 + 2 + len(t) + 2 + 1 + len(p) for t, p in msgs[:8])
        assert _wait(lambda: len(got) == 20, 10), got
        assert [(t, p) for t, p, _m, _d in got] == msgs
        assert _wait(lambda: not c._out_messages and c._inflight_messages == 0, 10), c._out_messages
        assert paho_pubacks == []
        for w in waiters:
            w.join(10)
        assert all(m.info.is_published() and m.info.rc == mqtt.MQTT_ERR_SUCCESS for m in ours)
        assert [m.mid for m in ours] == [m.info.mid for m in ours] and len({m.mid for m in ours}) == 8
    finally:
        c.disconnect()
        c.loop_stop()
        s.disconnect()
        s.loop_stop()
        b.stop()


def test_publish_many_entries_are_paho_s_own_for_a_reconnect_and_a_refusing_puback(tmp_path, monkeypatch):
    """Published but not acknowledged when the connection drops: paho re-sends them after the reconnect
    from the entries publish_many made, and the broker's PUBACKs clear them. A PUBACK with a reason code
    (no subscribers: 0x10) goes to paho's decoder and clears its message too. Not connected: paho queues."""
    b = start_mosquitto(tmp_path)
    s, got, _r = _sub(b.port, "acks-sub2", auto_ack=True)
    paho_pubacks = _count_calls(monkeypatch, mqtt.Client, "_handle_pubackcomp")
    c = pahofast.BufferedClient(mqtt.CallbackAPIVersion.VERSION2, client_id="host2", protocol=mqtt.MQTTv5)
    try:
        c.connect("127.0.0.1", b.port)  # no loop yet: the PUBLISHes are written, their PUBACKs never read
        c.loop_read()  # the CONNACK
        msgs = [("t/r/%d" % i, b"r%d" % i) for i in range(3)]
        pahofast.publish_many(c, msgs)
        assert len(c._out_messages) == 3 and c._inflight_messages == 3
        assert _wait(lambda: len(got) == 3, 10)
        c._sock_close()  # the connection drops before any PUBACK is read
        c.reconnect()
        c.loop_start()
        # paho re-sent all three (DUP): the subscriber has each twice, and they are acknowledged at last
        assert _wait(lambda: len(got) == 6, 10), got
        assert sorted(p for _t, p, _m, _d in got) == sorted([p for _t, p in msgs] * 2)
        assert _wait(lambda: not c._out_messages and c._inflight_messages == 0, 10), c._out_messages
        assert paho_pubacks == []
        pahofast.publish_many(c, [("nobody/listens", b"x")])
        assert _wait(lambda: not c._out_messages, 10) and len(paho_pubacks) == 1
        c.disconnect()
        c.loop_stop()
        pahofast.publish_many(c, [("t/later", b"later")])  # not connected: paho's queue, nothing written
        assert [m.state for m in c._out_messages.values()] == [mqtt.mqtt_ms_publish]
    finally:
        c.loop_stop()
        s.disconnect()
        s.loop_stop()
        b.stop()


def _peek(sock: Any, socket: Any) -> int:
    """Bytes waiting in ``sock`` (at most 64), without taking them; 0 while none has arrived."""
    try:
        return len(sock.recv(64, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return 0


def test_pubacks_of_one_read_refill_the_window_as_one_write(tmp_path):
    """40 host acknowledgements with 8 allowed in flight (the broker's Receive Maximum is 20 for the
    shipped mosquitto): 8 go out, 32 wait. The broker's 8 PUBACKs are read in one loop_read, and the 8
    they make room for go out as one queued write (paho sends one per PUBACK, each with a wake-up
    write); every one arrives, in order, and nothing stays in flight."""
    import socket

    b = start_mosquitto(tmp_path)
    s, got, _r = _sub(b.port, "acks-sub5", auto_ack=True)
    c = pahofast.BufferedClient(mqtt.CallbackAPIVersion.VERSION2, client_id="host5", protocol=mqtt.MQTTv5)
    c.max_inflight_messages_set(8)
    sent: list[Any] = []
    c._packet_queue = (lambda orig: lambda *a: (sent.append(a), orig(*a))[1])(c._packet_queue)  # type: ignore
    try:
        c.connect("127.0.0.1", b.port)  # no network thread: this test decides when the socket is read
        c.loop_read()  # the CONNACK
        msgs = [("t/dev-%d/ack" % i, b'{"dev":"dev-%d","ok":[%d]}' % (i, i)) for i in range(40)]
        pahofast.publish_many(c, msgs)
        assert c._inflight_messages == 8 and len(c._out_messages) == 40
        # the 8 PUBACKs (4 bytes each, MQTT v5 success without properties) are all in the socket
        assert _wait(lambda: _peek(c._sock, socket) >= 32, 10)
        del sent[:]
        c.loop_read()
        pubs = [a for a in sent if a[0] == pahofast.PUBLISH_QOS1]
        assert len(pubs) == 1, "one write for the 8 the PUBACKs made room for, not one each"
        assert len(pubs[0][1]) == sum(2 + 2 + len(t) + 2 + 1 + len(p) for t, p in msgs[8:16])
        assert c._inflight_messages == 8 and len(c._out_messages) == 32
        c.loop_start()
        assert _wait(lambda: len(got) == 40, 10), len(got)
        assert [(t, p) for t, p, _m, _d in got] == msgs
        assert _wait(lambda: not c._out_messages and c._inflight_messages == 0, 10), c._out_messages
    finally:
        c.disconnect()
        c.loop_stop()
        s.disconnect()
        s.loop_stop()
        b.stop()


def test_held_back_acknowledgements_survive_a_dropped_connection(tmp_path):
    """The connection drops while 32 of 40 host acknowledgements wait for room in flight and 8 more
    just went out on a refill: nothing is lost. After the reconnect paho re-sends what was in flight,
    the PUBACKs make room for the rest (one write per read), every one reaches the subscriber, and
    nothing stays in flight or queued."""
    import socket

    b = start_mosquitto(tmp_path)
    s, got, _r = _sub(b.port, "acks-sub6", auto_ack=True)
    c = pahofast.BufferedClient(mqtt.CallbackAPIVersion.VERSION2, client_id="host6", protocol=mqtt.MQTTv5)
    c.max_inflight_messages_set(8)
    try:
        c.connect("127.0.0.1", b.port)
        c.loop_read()  # the CONNACK
        msgs = [("t/dev-%d/ack" % i, b"ack-%d" % i) for i in range(40)]
        pahofast.publish_many(c, msgs)
        assert _wait(lambda: _peek(c._sock, socket) >= 32, 10)
        c.loop_read()  # the 8 PUBACKs: the next 8 go out as one write
        assert c._inflight_messages == 8 and len(c._out_messages) == 32
        c._sock_close()  # dropped before their PUBACKs are read
        assert len(c._out_messages) == 32, "what waited or was in flight is still paho's to send"
        c.reconnect()
        c.loop_start()
        assert _wait(lambda: not c._out_messages and c._inflight_messages == 0, 10), len(c._out_messages)
        assert _wait(lambda: {p for _t, p, _m, _d in got} == {p for _t, p in msgs}, 10), len(got)
    finally:
        c.disconnect()
        c.loop_stop()
        s.disconnect()
        s.loop_stop()
        b.stop()


def test_publish_many_refuses_a_bad_message_before_entering_any(tmp_path):
    """A wildcard topic or a payload that is not bytes, after good ones in the same call, on a connected
    client: the error comes before anything is entered or written, so no place in flight is held for a
    packet that never went out, and the next call goes out whole."""
    b = start_mosquitto(tmp_path)
    s, got, _r = _sub(b.port, "acks-sub4", auto_ack=True)
    c = _publisher(b.port, "host4", 20)
    try:
        for bad, exc in ((("t/bad/+/x", b"b"), ValueError), (("t/str", "text"), TypeError)):
            with pytest.raises(exc):
                pahofast.publish_many(c, [("t/ok/1", b"a"), ("t/ok/2", b"a"), bad])  # type: ignore[list-item]
            assert not c._out_messages and c._inflight_messages == 0
        pahofast.publish_many(c, [("t/ok/3", b"c")])
        assert _wait(lambda: len(got) == 1, 10) and got[0][:2] == ("t/ok/3", b"c")
        assert _wait(lambda: not c._out_messages and c._inflight_messages == 0, 10)
    finally:
        c.disconnect()
        c.loop_stop()
        s.disconnect()
        s.loop_stop()
        b.stop()


def test_acks_in_flight_follows_the_broker_s_receive_maximum():
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    from pansketch.host_tools.ingest.mqttproc import ACKS_IN_FLIGHT, acks_in_flight

    def connack(rm: Any) -> Any:
        p = Properties(PacketTypes.CONNACK)
        if rm is not None:
            p.ReceiveMaximum = rm
        return p

    assert acks_in_flight(connack(20)) == 20  # mosquitto's default max_inflight_messages
    assert acks_in_flight(connack(None)) == ACKS_IN_FLIGHT == 256
    assert acks_in_flight(connack(65535)) == ACKS_IN_FLIGHT
    assert acks_in_flight(None) == ACKS_IN_FLIGHT


def test_plain_client_falls_back_to_paho_ack():
    """ack_many on a client that is not a BufferedClient acknowledges through paho, one by one."""
    acked: list[tuple[int, int]] = []

    class Stub:
        def ack(self, mid: int, qos: int) -> None:
            acked.append((mid, qos))

    pahofast.ack_many(Stub(), [3, 9])
    assert acked == [(3, 1), (9, 1)]
    assert pahofast.supported()


def test_on_tick_cuts_the_wait_in_select_so_a_lone_release_is_forwarded_after_the_gather_wait(tmp_path):
    """The MQTT process's Gatherer on a real connection: of 20 releases published back to back, 16 or more
    are forwarded without the gather wait (2 s here), every one once and in order; a lone release is
    forwarded about ``wait_s`` (50 ms) after it arrived: on_tick cuts paho's wait in select() (1 s when
    nothing else comes) to what is left of the gather wait, and a client that ignored it would forward
    it about 1 s late."""
    from pansketch.host_tools.ingest.mqttproc import Gatherer

    b = start_mosquitto(tmp_path)
    c, _got, _r = _sub(b.port, "gather", fast=True)
    batches: list[tuple[float, list[Any]]] = []
    added: list[float] = []
    g = Gatherer(lambda batch: batches.append((time.monotonic(), batch)), max_n=16, wait_s=2.0)

    def on_fast(t: str, p: bytes, mid: int, q: int) -> None:
        added.append(time.monotonic())
        g.add((t, p, mid, q))
        if q:
            pahofast.ack_many(c, [mid])

    c.on_fast = on_fast
    c.on_tick = g.tick
    try:
        msgs = [("t/g/%d" % i, b"r%d" % i) for i in range(20)]
        _publish(b.port, msgs)
        assert _wait(lambda: len(added) == 20, 10)
        assert _wait(lambda: sum(len(x) for _t, x in batches) >= 16, 1.0), batches
        assert _wait(lambda: sum(len(x) for _t, x in batches) == 20, 5), batches
        assert [(m[0], m[1]) for _t, x in batches for m in x] == msgs
        g.wait_s = 0.05
        time.sleep(1.5)  # the connection quiet: paho's select() would wait its whole second
        n = len(batches)
        _publish(b.port, [("t/g/lone", b"lone")])
        assert _wait(lambda: len(batches) == n + 1, 5)
        delay = batches[-1][0] - added[-1]
        assert 0.045 <= delay < 0.5, delay
    finally:
        c.disconnect()
        c.loop_stop()
        b.stop()


def _packet(cmd: int, body: bytes) -> bytes:
    fixed = bytearray((cmd,))
    mqtt.Client._pack_remaining_length(None, fixed, len(body))  # type: ignore[arg-type]
    return bytes(fixed) + body


def _pub_body(topic: str, mid: int, payload: bytes, props: bytes = b"\0") -> bytes:
    tb = topic.encode()
    return len(tb).to_bytes(2, "big") + tb + (mid.to_bytes(2, "big") if mid else b"") + props + payload


def _socket_client() -> tuple[pahofast.BufferedClient, Any, list[Any]]:
    """A BufferedClient on one end of a socket pair (the test writes the broker's bytes at the other),
    with two QoS 1 messages of its own awaiting the broker's PUBACK (ids 7 and 8)."""
    import socket

    got: list[Any] = []
    c = pahofast.BufferedClient(mqtt.CallbackAPIVersion.VERSION2, client_id="split", protocol=mqtt.MQTTv5,
                                manual_ack=True)
    a, b = socket.socketpair()
    a.setblocking(False)
    c._sock = a
    c.on_fast = lambda t, p, mid, q: got.append(("fast", t, p, mid, q))
    c.on_message = lambda _c, _u, m: got.append(("paho", m.topic, m.payload, m.mid, m.qos))
    for mid in (7, 8):
        m = mqtt.MQTTMessage(mid, b"t/out")
        m.qos = 1
        m.state = mqtt.mqtt_ms_wait_for_puback
        c._out_messages[mid] = m
        c._inflight_messages += 1
    return c, b, got


@pytest.mark.parametrize("step", [1, 2, 3, 7, 4096, 1 << 20])
def test_packets_split_anywhere_across_reads_arrive_whole_and_in_order(step):
    """The reader takes a packet whole from the buffer when it is all there and leaves a packet cut
    anywhere (in its remaining length too) to paho's reader: the broker's bytes written ``step`` at a time
    give the same messages, in order, through the same handlers as all at once. The stream: QoS 1 and
    QoS 0 publishes without properties (on_fast), one with a property (paho's on_message), payloads whose
    remaining length takes one, two and three bytes, a PUBACK in its short form (packet id only) and
    in its long form (reason 0, property length 0), and a PINGRESP (paho's handler clears the ping)."""
    big = bytes(range(256)) * 80  # 20,480 bytes: a three-byte remaining length
    stream = b"".join([
        _packet(0x32, _pub_body("t/a", 1, b"one")),
        _packet(0x30, _pub_body("t/b", 0, b"x" * 200)),  # two-byte remaining length
        _packet(0x40, (7).to_bytes(2, "big")),
        _packet(0x32, _pub_body("t/p", 2, b"props", props=b"\x05\x02\x00\x00\x00\x05")),  # message expiry 5
        _packet(0xD0, b""),
        _packet(0x32, _pub_body("t/c", 3, big)),
        _packet(0x40, (8).to_bytes(2, "big") + b"\0\0"),
        _packet(0x32, _pub_body("t/d", 4, b"")),
    ])
    c, b, got = _socket_client()
    c._ping_t = 123.0  # a PINGREQ outstanding
    c._last_bytes_received = 0.0
    try:
        for i in range(0, len(stream), step):
            b.sendall(stream[i:i + step])
            assert c.loop_read() == mqtt.MQTT_ERR_SUCCESS
        assert c.buffered() == 0 and c._in_packet["command"] == 0  # nothing held back
        assert got == [("fast", "t/a", b"one", 1, 1), ("fast", "t/b", b"x" * 200, 0, 0),
                       ("paho", "t/p", b"props", 2, 1), ("fast", "t/c", big, 3, 1), ("fast", "t/d", b"", 4, 1)]
        assert all(type(g[2]) is bytes for g in got)
        assert not c._out_messages and c._inflight_messages == 0  # both PUBACK forms cleared their message
        assert c._ping_t == 0  # the PINGRESP reached paho's handler
        assert c._last_bytes_received > 0  # stamped for the keepalive
    finally:
        b.close()
        if c._sock is not None:
            c._sock.close()


def test_a_fifth_remaining_length_byte_drops_the_connection_as_paho_does():
    """A remaining length with a fifth continuation byte (more than MQTT allows) is a protocol error:
    the connection is dropped, whether the bytes arrive at once or one at a time, and nothing before it
    is lost."""
    for step in (1, 64):
        c, b, got = _socket_client()
        stream = _packet(0x32, _pub_body("t/ok", 1, b"fine")) + b"\x32\xff\xff\xff\xff\x01" + b"\0" * 40
        rc = mqtt.MQTT_ERR_SUCCESS
        try:
            for i in range(0, len(stream), step):
                b.sendall(stream[i:i + step])
                rc = c.loop_read()
                if rc != mqtt.MQTT_ERR_SUCCESS:
                    break
            assert rc == mqtt.MQTT_ERR_PROTOCOL, (step, rc)
            assert c._sock is None  # paho closed it
            assert got == [("fast", "t/ok", b"fine", 1, 1)]
        finally:
            b.close()
