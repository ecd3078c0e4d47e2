"""paho's MQTT client with fewer system calls per message (the aggregator's MQTT process).

paho reads each packet with at least three ``recv`` calls (the command
byte, each byte of the remaining length, then the body) and goes back to
``select()`` between packets; each PUBACK is a packet of its own (a wake-up
write and a ``send``). At 16 KB releases paho was more than half of the MQTT
process's CPU (bench-results/host.json, ``mqtt_client``: 104 of 190 µs per
release before this module). This client:

* reads the socket up to :data:`READ_SIZE` bytes at a time into a buffer
  and takes each packet that is whole in it in one step: paho's reader
  takes a read per byte of the fixed header and builds a dictionary per
  packet (a release and its host acknowledgement's PUBACK, three releases
  to a read as in the 1,000-device soak: 8.4 -> 4.1 µs, old and new
  interleaved in one process). A packet
  cut by the end of a read, or one paho is part-way through, is read by
  paho's reader, which takes its small reads from the same buffer. One
  ``loop_read`` goes on through the packets already in the buffer but never
  reads the socket again for them, so it stays bounded, and what is left in
  the kernel still wakes ``select()``;
* queues a batch of PUBACKs as one write (:func:`ack_many`), and a batch of
  QoS 1 publishes (the host acknowledgements) as one write too
  (:func:`publish_many`), each still in paho's table of messages awaiting a
  PUBACK (re-sent after a reconnect as paho's own); paho queues a wake-up
  write and a ``send`` per publish, and with 1,000 devices every release has
  a host acknowledgement of its own (38 of the MQTT process's 100 µs per
  release in the 1,000-device soak). What the broker's Receive Maximum
  holds back (20 for the shipped mosquitto: most of a group) follows the
  PUBACKs: paho sends one message per PUBACK, this client sends what the
  PUBACKs of one read made room for as one write (``_send_queued``);
* takes the broker's PUBACK of success without properties (mosquitto's
  for a delivered QoS 1 publish; its "no matching subscribers", 0x10, and
  anything with properties go to paho's) without paho's decoder, which
  builds a ``Properties`` and a ``ReasonCode`` object per packet;
* calls :attr:`BufferedClient.on_tick` after each read and before each
  wait in ``select()``, and cuts the wait to what it asks for: the MQTT
  process gathers releases there and validates and forwards them a batch
  at a time, in the network thread (pansketch.host_tools.ingest.mqttproc.Gatherer);
* hands a PUBLISH without MQTT v5 properties (every release: devices set
  none, and this client asks the broker for no topic aliases or
  subscription identifiers) straight to :attr:`BufferedClient.on_fast`,
  without paho's ``Properties`` object (a quarter of paho's CPU per 16 KB
  message: it builds its table of property names for every packet) or
  ``MQTTMessage``. A PUBLISH with properties, QoS 2, or bytes that do not
  add up goes to paho's own handler, which decodes or refuses it as
  before.

Everything else (keepalive, reconnects, TLS, partial packets and the
reader's limits) is paho's. These rely on paho internals (``_sock_recv``,
``loop_read``, ``_packet_read``, ``_packet_handle``, ``_loop_rc_handle``,
``_loop``, ``_packet_queue``, ``_manual_ack``, ``_in_packet``,
``_last_bytes_received``, ``_handle_publish``, ``_handle_pubackcomp``,
``_do_on_publish``, ``_out_messages``, ``_inflight_messages``,
``_mid_generate``). Their names being there does not mean they still mean
what this module reads them as, so :func:`check` runs this module's paths
once against the installed paho, on a socket pair, and the MQTT process
uses paho's plain client, with a warning saying why, when anything differs
(pyproject pins the paho versions this was tested with).
tests/test_pahofast.py runs it against a real mosquitto, over TCP and TLS,
and feeds it packets cut at every byte through a socket pair.
"""

from __future__ import annotations

import functools
import struct
import threading
from typing import Any, Callable, Iterable, Optional

import paho.mqtt.client as mqtt
from paho.mqtt.exception import MalformedPacket
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

READ_SIZE = 256 * 1024
PUBLISH = 0x30
PUBACK = 0x40
PUBLISH_QOS1 = 0x32  # PUBLISH, QoS 1, no DUP, no retain
_PUBACK = struct.Struct("!BBH")  # fixed header, remaining length 2, packet id (v5: reason 0 omitted)
# what paho's decoder gives for a PUBACK of success without properties; handed to on_publish only when no
# on_publish is set (the MQTT process sets none), so no callback can change the shared objects
_PUBACK_OK = ReasonCode(PacketTypes.PUBACK, "Success")
_NO_PROPS = Properties(PacketTypes.PUBACK)


def supported() -> bool:
    """This paho's internals behave as this client reads them (:func:`check`)."""
    return check() is None


class BufferedClient(mqtt.Client):
    """``mqtt.Client`` whose packet reader takes its reads from a buffer (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rbuf = b""
        self._rpos = 0
        self._rsock: Any = None  # the socket the buffer was read from: a new connection starts empty
        self._no_refill = False
        self._refill = False  # PUBACKs freed room in flight: _send_queued after this read
        self._got = False  # a packet was taken from the buffer in this read (loop_read stamps the time)
        # PUBLISH without properties goes to on_fast(topic, payload, mid, qos) instead of on_message and the
        # message_callback_add filters (the MQTT process uses neither); None: paho's path for every PUBLISH
        self.on_fast: Optional[Callable[[str, bytes, int, int], Any]] = None
        # called by the network thread after each read and before each wait in select(); returns the seconds
        # until it wants to be called again (the wait is cut to that), or None (the MQTT process's Gatherer)
        self.on_tick: Optional[Callable[[], Optional[float]]] = None

    def buffered(self) -> int:
        """Bytes read from the socket that the packet reader has not taken yet."""
        return len(self._rbuf) - self._rpos if self._rsock is self._sock else 0

    def _sock_recv(self, bufsize: int) -> bytes:
        buf = self._rbuf
        pos = self._rpos
        if self._rsock is not self._sock or pos >= len(buf):
            if self._no_refill:
                raise BlockingIOError()  # paho: "again later", with its partial packet kept
            buf = super()._sock_recv(READ_SIZE)  # raises as paho's (BlockingIOError, OSError, ...)
            self._rsock = self._sock
            self._rbuf = buf
            pos = 0
            if not buf:
                return buf  # the connection closed
        out = buf[pos:pos + bufsize]
        self._rpos = pos + len(out)
        return out

    def loop_read(self, max_packets: int = 1) -> Any:
        """paho's ``loop_read`` (its bound on packets, each read of the socket at most :data:`READ_SIZE`
        bytes), then the packets left whole in the buffer without reading the socket again; a packet cut
        by the end of a read is kept by paho's reader for the next read."""
        if self._sock is None:
            return mqtt.MQTT_ERR_NO_CONN
        self._got = False
        try:
            # as paho's: up to one packet per message in flight, reading the socket whenever the buffer is
            # empty, until it has nothing more (MQTT_ERR_AGAIN); what arrived meanwhile needs no select()
            for _ in range(max(1, len(self._out_messages) + len(self._in_messages))):
                if self._sock is None:
                    return mqtt.MQTT_ERR_NO_CONN
                rc = self._packet_read()
                if rc != mqtt.MQTT_ERR_SUCCESS:
                    break
            if rc == mqtt.MQTT_ERR_SUCCESS:
                self._no_refill = True
                try:
                    while self._sock is not None and self.buffered() > 0:
                        rc = self._packet_read()
                        if rc != mqtt.MQTT_ERR_SUCCESS:
                            break
                finally:
                    self._no_refill = False
        finally:
            if self._got:  # paho stamps each packet it reads; once per read here (the keepalive reads it)
                with self._msgtime_mutex:
                    self._last_bytes_received = mqtt.time_func()
            if self._refill:
                self._refill = False
                self._send_queued()
            if self.on_tick is not None:
                self.on_tick()
        if rc > 0:
            return self._loop_rc_handle(rc)
        return mqtt.MQTT_ERR_SUCCESS  # MQTT_ERR_AGAIN included, as paho's

    def _packet_read(self) -> Any:
        """One packet, taken whole from the buffer when it is there (no per-byte reads, no per-packet
        dictionary); a packet that is not whole in the buffer, or one paho is part-way through, is read by
        paho's ``_packet_read`` from the buffer as before."""
        if self._in_packet["command"] != 0:
            return super()._packet_read()
        buf = self._rbuf
        pos = self._rpos
        if self._rsock is not self._sock or pos >= len(buf):
            if self._no_refill:
                return mqtt.MQTT_ERR_AGAIN
            try:
                buf = mqtt.Client._sock_recv(self, READ_SIZE)
            except BlockingIOError:
                return mqtt.MQTT_ERR_AGAIN
            except OSError as err:  # TimeoutError and ConnectionError included
                self._easy_log(mqtt.MQTT_LOG_ERR, "failed to receive on socket: %s", err)
                return mqtt.MQTT_ERR_CONN_LOST
            if not buf:
                return mqtt.MQTT_ERR_CONN_LOST
            self._rsock = self._sock
            self._rbuf = buf
            pos = self._rpos = 0
        n = len(buf)
        # the fixed header: command byte, remaining length (1-4 bytes, 7 bits each, low first)
        i = pos + 1
        rl = 0
        shift = 0
        while True:
            if i >= n or shift > 21:  # incomplete here, or a fifth length byte (paho refuses it)
                return super()._packet_read()
            b = buf[i]
            i += 1
            rl |= (b & 127) << shift
            shift += 7
            if not b & 128:
                break
        end = i + rl
        if end > n:
            return super()._packet_read()  # paho keeps what is here and reads the rest later
        cmd = buf[pos]
        kind = cmd & 0xF0
        self._rpos = end
        self._got = True
        if self._protocol == mqtt.MQTTv5:
            if kind == PUBLISH and self.on_fast is not None:
                rc = self._fast_publish(cmd, buf, i, end)
                if rc is not None:
                    return rc
            elif kind == PUBACK and rl == 2 and self.on_publish is None:
                # v5 PUBACK of success without properties: packet id only (reason 0 and no properties left out)
                self._puback_ok(buf[i] << 8 | buf[i + 1])
                return mqtt.MQTT_ERR_SUCCESS
        # everything else: paho's handler, with the packet as paho's reader leaves it
        self._in_packet = {"command": cmd, "have_remaining": 1, "remaining_count": list(buf[pos + 1:i]),
                           "remaining_mult": 1 << shift, "remaining_length": rl, "packet": bytearray(buf[i:end]),
                           "to_process": 0, "pos": 0}
        try:
            rc = self._packet_handle()
        except MalformedPacket as exc:
            self._easy_log(mqtt.MQTT_LOG_DEBUG, "Received malformed packet: %s", exc)
            rc = mqtt.MQTT_ERR_PROTOCOL
        self._in_packet = {"command": 0, "have_remaining": 0, "remaining_count": [], "remaining_mult": 1,
                           "remaining_length": 0, "packet": bytearray(b""), "to_process": 0, "pos": 0}
        return rc

    def _loop(self, timeout: float = 1.0) -> Any:
        """paho's network loop step (select, read, write, keepalive) with :attr:`on_tick` before it."""
        tick = self.on_tick
        if tick is not None:
            due = tick()
            if due is not None:
                timeout = min(timeout, max(0.0, due))
        return super()._loop(timeout)

    def _handle_publish(self) -> Any:
        pkt = self._in_packet["packet"]
        if self.on_fast is not None and self._protocol == mqtt.MQTTv5:
            rc = self._fast_publish(self._in_packet["command"], pkt, 0, len(pkt))
            if rc is not None:
                return rc
        return super()._handle_publish()

    def _fast_publish(self, cmd: int, pkt: Any, start: int, end: int) -> Any:
        """The PUBLISH in ``pkt[start:end]`` (its variable header and payload) to :attr:`on_fast`; None,
        having done nothing, for one that is paho's to decode (QoS 2, properties, a topic that is not
        UTF-8, bytes that do not add up)."""
        qos = (cmd >> 1) & 3
        if qos == 2 or end - start < 2:
            return None
        tl = pkt[start] << 8 | pkt[start + 1]
        pos = start + 2 + tl
        mid = 0
        if qos:
            if pos + 2 > end:
                return None
            mid = pkt[pos] << 8 | pkt[pos + 1]
            pos += 2
        # property length 0 (one byte 0x00): anything else is paho's to decode
        if pos >= end or pkt[pos] != 0:
            return None
        try:
            topic = str(pkt[start + 2:start + 2 + tl], "utf-8")
        except UnicodeDecodeError:
            return None
        payload = bytes(pkt[pos + 1:end])  # bytes, as paho's own decoder gives
        with self._in_callback_mutex:
            self.on_fast(topic, payload, mid, qos)  # type: ignore[misc]
        if qos == 1 and not self._manual_ack:
            return self._send_puback(mid)
        return mqtt.MQTT_ERR_SUCCESS

    def _handle_pubackcomp(self, cmd: Any) -> Any:
        pkt = self._in_packet["packet"]
        n = len(pkt)
        # v5 PUBACK: packet id, then reason 0 (success) and property length 0, each left out when 0
        if (cmd != "PUBACK" or self._protocol != mqtt.MQTTv5 or self.on_publish is not None or n < 2 or n > 4
                or (n > 2 and pkt[2] != 0) or (n > 3 and pkt[3] != 0)):
            return super()._handle_pubackcomp(cmd)
        self._puback_ok(pkt[0] << 8 | pkt[1])
        return mqtt.MQTT_ERR_SUCCESS

    def _puback_ok(self, mid: int) -> None:
        """paho's ``_do_on_publish`` for a PUBACK of success, without a callback, the refill left to
        :meth:`_send_queued` (once per read)."""
        with self._out_message_mutex:
            m = self._out_messages.pop(mid, None)
            if m is not None:
                m.info._set_as_published()
                if m.qos > 0:
                    self._inflight_messages -= 1
                    self._refill = True

    def _send_queued(self) -> None:
        """What paho's ``_update_inflight`` does after each PUBACK, once for all the PUBACKs of a read:
        messages queued for room in flight go out in order, as one write (paho: a wake-up write and a
        ``send`` each; the broker's Receive Maximum, 20 for the shipped mosquitto, holds back most of a
        group's host acknowledgements, which then left one PUBACK at a time)."""
        with self._out_message_mutex:
            limit = self._max_inflight_messages
            if limit <= 0 or self._sock is None:
                return
            parts: list[bytes] = []
            for m in self._out_messages.values():
                if self._inflight_messages >= limit:
                    break
                if m.qos == 0 or m.state != mqtt.mqtt_ms_queued:
                    continue
                if m.qos != 1 or m.retain or m.dup or m.properties is not None:
                    break  # not one of ours: paho sends it and the rest, in order, after what is gathered
                m.state = mqtt.mqtt_ms_wait_for_puback
                self._inflight_messages += 1
                tb = m._topic
                fixed = bytearray((PUBLISH_QOS1,))
                self._pack_remaining_length(fixed, 2 + len(tb) + 2 + 1 + len(m.payload))
                parts += (bytes(fixed), struct.pack("!H", len(tb)), tb, struct.pack("!HB", m.mid, 0), bytes(m.payload))
            if parts:
                self._packet_queue(PUBLISH_QOS1, b"".join(parts), 0, 1)
            self._update_inflight()  # anything left that fits (none when the loop ran to the limit)


# one condition for every host acknowledgement's info: paho makes a threading.Condition (and its RLock) per
# message, a third of publish_many's CPU; nobody waits on these, and a waiter still would be woken
_ACK_CONDITION = threading.Condition()


class _AckInfo(mqtt.MQTTMessageInfo):
    """paho's ``MQTTMessageInfo`` for a host acknowledgement, sharing :data:`_ACK_CONDITION`."""

    __slots__ = ()

    def __init__(self, mid: int) -> None:
        self.mid = mid
        self._published = False
        self._condition = _ACK_CONDITION
        self.rc = mqtt.MQTT_ERR_SUCCESS
        self._iterpos = 0

    def _set_as_published(self) -> None:
        with self._condition:
            self._published = True
            self._condition.notify_all()  # shared: the waiter for this one may not be the first in line


class _AckMessage(mqtt.MQTTMessage):
    """A QoS 1 publish entered by :func:`publish_many`: paho's ``MQTTMessage`` as ``publish`` leaves
    it (waiting for its PUBACK), built in one step."""

    __slots__ = ()

    def __init__(self, mid: int, topic: bytes, payload: bytes, timestamp: float) -> None:
        self.timestamp = timestamp
        self.state = mqtt.mqtt_ms_wait_for_puback
        self.dup = False
        self.mid = mid
        self._topic = topic
        self.payload = payload
        self.qos = 1
        self.retain = False
        self.info = _AckInfo(mid)
        self.properties = None


def publish_many(client: Any, msgs: list[tuple[str, bytes]]) -> None:
    """``client.publish(topic, payload, qos=1)`` for each, in order: on a connected :class:`BufferedClient`
    (MQTT v5) the packets within paho's in-flight limit go out as one queued write.

    Each is entered in paho's ``_out_messages`` as :meth:`paho.mqtt.client.Client.publish` enters it
    (an ``MQTTMessage`` waiting for its PUBACK, counted in flight; :class:`_AckMessage`, whose info shares
    one condition), so its PUBACK, a reconnect's re-send and the in-flight limit work as for paho's own. What does not fit under the limit, or anything while there is
    no connection, takes ``client.publish``, which queues it the same way paho always does."""
    if not isinstance(client, BufferedClient) or client._protocol != mqtt.MQTTv5:
        for topic, payload in msgs:
            client.publish(topic, payload, qos=1)
        return
    # everything that can fail is checked before any entry is made: an entry whose packet is never queued
    # would hold its place in flight until a reconnect
    encoded: list[tuple[bytes, bytes, bytes]] = []
    for topic, payload in msgs:
        tb = topic.encode("utf-8")
        client._raise_for_invalid_topic(tb)  # a ValueError, as from paho's publish
        if not isinstance(payload, (bytes, bytearray)):
            raise TypeError("payload must be bytes, not %s" % type(payload).__name__)
        fixed = bytearray((PUBLISH_QOS1,))
        client._pack_remaining_length(fixed, 2 + len(tb) + 2 + 1 + len(payload))  # ValueError past 256 MB
        encoded.append((tb, bytes(payload), bytes(fixed)))
    parts: list[bytes] = []
    done = 0
    with client._out_message_mutex:
        out = client._out_messages
        if client._sock is not None:
            limit = client._max_inflight_messages
            now = mqtt.time_func()
            for tb, body, head in encoded:
                if ((limit > 0 and client._inflight_messages >= limit)
                        or (client._max_queued_messages > 0 and len(out) >= client._max_queued_messages)):
                    break
                mid = client._mid_generate()
                if mid in out:  # all 65,535 ids awaiting a PUBACK: the rest go to paho's publish, which refuses them
                    break
                out[mid] = _AckMessage(mid, tb, body, now)
                client._inflight_messages += 1
                parts += (head, struct.pack("!H", len(tb)), tb, struct.pack("!HB", mid, 0), body)
                done += 1
            if parts:
                client._packet_queue(PUBLISH_QOS1, b"".join(parts), 0, 1)
    for topic, payload in msgs[done:]:
        client.publish(topic, payload, qos=1)


def ack_many(client: Any, mids: Iterable[int]) -> None:
    """PUBACK each QoS 1 packet id in ``mids``: one queued write for all of them on a
    :class:`BufferedClient` (manual-ack mode), ``client.ack`` each on any other client."""
    if not isinstance(client, BufferedClient) or not client._manual_ack:
        for mid in mids:
            client.ack(mid, 1)
        return
    blob = b"".join([_PUBACK.pack(PUBACK, 2, mid) for mid in mids])
    if blob:
        client._packet_queue(PUBACK, blob, 0, 0)


CLIENT_NAMES = ("_sock_recv", "loop_read", "_packet_read", "_packet_queue", "_handle_publish", "_handle_on_message",
                "_handle_pubackcomp", "_do_on_publish", "_update_inflight", "_mid_generate", "_pack_remaining_length",
                "_raise_for_invalid_topic", "is_connected", "_loop", "_packet_handle", "_loop_rc_handle", "_easy_log")
MODULE_NAMES = ("time_func", "mqtt_ms_wait_for_puback", "mqtt_ms_queued", "MQTTMessage", "MQTTMessageInfo")


def _packet(cmd: int, body: bytes) -> bytes:
    """An MQTT packet, encoded here from the specification (not by paho: the check compares with paho)."""
    head = bytearray((cmd,))
    n = len(body)
    while True:
        n, digit = n >> 7, n & 127
        head.append(digit | (128 if n else 0))
        if not n:
            return bytes(head) + body


def _publish(topic: str, mid: int, payload: bytes, props: bytes = b"\0") -> bytes:
    tb = topic.encode()
    return len(tb).to_bytes(2, "big") + tb + (mid.to_bytes(2, "big") if mid else b"") + props + payload


@functools.lru_cache(maxsize=1)
def check() -> Optional[str]:
    """None when the installed paho behaves as this module reads it; else what differs (one line).

    The private names being there is not enough: a paho whose ``_in_packet``, ``_out_messages``,
    in-flight count or write queue changed meaning would have this client misread packets or lose
    acknowledgements. So this runs the module's own paths once, on a socket pair (no broker, a few
    milliseconds per process): the broker's side writes publishes with and without properties (one
    cut across two reads, inside its remaining length) and PUBACKs in both forms, which must reach
    the right handler whole and in order and clear the messages they acknowledge; then
    :func:`publish_many` and :func:`ack_many` must put exactly the MQTT bytes on the wire, and the
    broker's PUBACK must clear the publish.
    """
    missing = [n for n in CLIENT_NAMES if not hasattr(mqtt.Client, n)] + [n for n in MODULE_NAMES if not hasattr(mqtt, n)]
    if missing:
        return "paho has no %s" % ", ".join(missing)
    import socket

    got: list[tuple[Any, ...]] = []
    try:
        mine, broker = socket.socketpair()
    except OSError as exc:
        return "no socket pair to check it on: %s" % exc
    try:
        mine.setblocking(False)
        broker.settimeout(1.0)
        c = BufferedClient(mqtt.CallbackAPIVersion.VERSION2, client_id="pahofast-check", protocol=mqtt.MQTTv5,
                           manual_ack=True)
        c._sock = mine
        c.on_fast = lambda t, p, mid, q: got.append(("fast", t, p, mid, q))
        c.on_message = lambda _c, _u, m: got.append(("paho", m.topic, m.payload, m.mid, m.qos))
        for mid in (7, 8):  # two publishes of ours awaiting the broker's PUBACK, entered as paho's publish does
            m = mqtt.MQTTMessage(mid, b"t/out")
            m.qos = 1
            m.state = mqtt.mqtt_ms_wait_for_puback
            c._out_messages[mid] = m
            c._inflight_messages += 1
        cut = _packet(0x32, _publish("t/c", 3, b"x" * 200))  # a two-byte remaining length, cut after its first
        reads = (_packet(0x32, _publish("t/a", 1, b"one")) + _packet(0x40, (7).to_bytes(2, "big"))
                 + _packet(0x32, _publish("t/p", 2, b"props", b"\x05\x02\x00\x00\x00\x05"))  # message expiry 5
                 + _packet(0x40, (8).to_bytes(2, "big") + b"\0\0") + cut[:2], cut[2:])
        for data in reads:
            broker.sendall(data)
            rc = c.loop_read()
            if rc != mqtt.MQTT_ERR_SUCCESS:
                return "reading the broker's packets returned %s" % rc
        want = [("fast", "t/a", b"one", 1, 1), ("paho", "t/p", b"props", 2, 1), ("fast", "t/c", b"x" * 200, 3, 1)]
        if got != want:
            return "the broker's packets were read as %r" % ([g[:2] + (len(g[2]),) + g[3:] for g in got],)
        if c._out_messages or c._inflight_messages != 0:
            return "the broker's PUBACKs left %d message(s), %d in flight" % (len(c._out_messages),
                                                                               c._inflight_messages)
        if c.buffered() or c._in_packet["command"] != 0:
            return "bytes of the broker's packets were left unread"
        c._max_inflight_messages = 20
        publish_many(c, [("t/ack", b"ok")])
        if len(c._out_messages) != 1 or c._inflight_messages != 1:
            return "publish_many entered %d message(s), %d in flight" % (len(c._out_messages), c._inflight_messages)
        mid = next(iter(c._out_messages))
        ack_many(c, [5])
        expect = _packet(0x32, _publish("t/ack", mid, b"ok")) + _packet(0x40, (5).to_bytes(2, "big"))
        wrote = b""
        while len(wrote) < len(expect):
            try:
                data = broker.recv(4096)
            except socket.timeout:
                break
            if not data:
                break
            wrote += data
        if wrote != expect:
            return "a publish and a PUBACK went out as %r, not %r" % (wrote[:48], expect)
        broker.sendall(_packet(0x40, mid.to_bytes(2, "big")))
        rc = c.loop_read()
        if rc != mqtt.MQTT_ERR_SUCCESS or c._out_messages or c._inflight_messages != 0:
            return "the broker's PUBACK did not clear the publish (%s)" % rc
    except Exception as exc:  # whatever a changed paho raises here: it is not the paho this was written for
        return "%s: %s" % (type(exc).__name__, exc)
    finally:
        broker.close()
        mine.close()
    return None
