"""The aggregator's MQTT transport, in a process of its own (``python -m host_tools.ingest.mqttproc``).

Why a process: receiving a 16 kB QoS 1 publish costs paho about as much
CPU as validating it (MQTT v5 properties, packet parsing), and in the
aggregator's process that work would compete with the writer for the GIL.
Here the paho client (network thread, reconnects, manual acks) runs in a
helper process; the aggregator (group commit, every acknowledgement,
host_tools.ingest.aggregator) is the parent. They talk over one socket pair
(host_tools/ingest/child.py):

child -> parent
    a batch frame (:func:`host_tools.ingest.child.send_batch`: no pickling
    of message bytes) of what arrived since the last batch, meta
    ``[(topic, size, mid, qos), ...]``; ``("connected",)``, ``("refused", reason)``,
    ``("subscribed", None | refusal)``, ``("disconnected", reason)``,
    ``("connect_failed",)``: connection events, logged by the parent.
parent -> child
    ``("ack", [(mid, qos), ...], [(topic, payload), ...])``: PUBACK these
    messages (their outcome is committed), then publish these host
    acknowledgements at QoS 1, in that order; ``("stop",)``: disconnect
    and exit 0.

The child acknowledges nothing on its own, so every PUBACK still follows
a commit. It ignores SIGINT/SIGTERM (the parent drains, then sends
``stop``); when the parent's end closes (the parent died) it exits 1
without acknowledging, and the broker redelivers. The parent sees the
child's end close and stops the aggregator (:class:`MQTTProcess`).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, NamedTuple, Optional

from host_tools.ingest import child

log = logging.getLogger("pansketch.aggregator")


class Msg(NamedTuple):
    """One received message, as the aggregator needs it (paho's MQTTMessage does not cross processes)."""

    topic: str
    payload: bytes
    mid: int
    qos: int


@dataclass(frozen=True)
class Settings:
    """What the child needs to connect: broker ([broker] of host.toml) and session."""

    broker: Any  # hostconfig.BrokerConfig
    client_id: str
    subscriptions: tuple[tuple[str, int], ...]  # (topic filter, QoS)
    persistent: bool  # clean_start off, session expiry below
    session_expiry_s: int
    receive_maximum: int  # unacknowledged QoS 1 messages the broker may send us (MQTT v5 Receive Maximum)
    verbose: bool = False  # -v: paho's packet log on stderr


def _client(s: Settings) -> Any:
    import paho.mqtt.client as mqtt

    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=s.client_id, protocol=mqtt.MQTTv5,
                    manual_ack=True)
    b = s.broker
    if b.tls:
        c.tls_set(ca_certs=b.tls_ca, certfile=b.tls_cert, keyfile=b.tls_key)
    if b.username is not None:
        c.username_pw_set(b.username, b.password)
    c.reconnect_delay_set(min_delay=max(1, int(b.reconnect_min_s)), max_delay=max(1, int(b.reconnect_max_s)))
    return c


def serve(conn: Connection, s: Settings) -> int:
    """The child: run the MQTT client until the parent says stop (0) or goes away (1)."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties
    from paho.mqtt.subscribeoptions import SubscribeOptions

    client = _client(s)
    send_lock = threading.Lock()  # the network thread and the batcher both send
    inbox: list[tuple[str, bytes, int, int]] = []
    more = threading.Condition()
    closing = threading.Event()

    def send(event: tuple[Any, ...], payloads: Optional[list[bytes]] = None) -> None:
        """An event (pickled), or with ``payloads`` a batch frame whose meta is ``event``."""
        try:
            with send_lock:
                if payloads is None:
                    conn.send(event)
                else:
                    child.send_batch(conn, list(event), payloads)
        except OSError:  # the parent is gone: the command loop sees EOF and exits
            closing.set()

    def on_connect(c: Any, _u: Any, _flags: Any, rc: Any, _props: Any) -> None:
        if rc.is_failure:
            send(("refused", str(rc)))
            return
        send(("connected",))
        c.subscribe([(t, SubscribeOptions(qos=q)) for t, q in s.subscriptions])

    def on_subscribe(_c: Any, _u: Any, _mid: Any, rcs: Any, _props: Any) -> None:
        bad = [r for r in rcs if r.is_failure]
        send(("subscribed", str(bad[0]) if bad else None))

    def on_message(_c: Any, _u: Any, m: Any) -> None:
        # the network thread only queues; the batcher pickles and sends
        with more:
            inbox.append((m.topic, m.payload, m.mid, m.qos))
            if len(inbox) == 1:
                more.notify()

    cpu = {"forward": 0.0, "acks": 0.0}  # stage timers (thread CPU time); the MQTT client is the rest
    forwarded = [0]

    def batcher() -> None:
        while not closing.is_set():
            with more:
                while not inbox and not closing.is_set():
                    more.wait(0.5)
                batch = inbox[:]
                inbox.clear()
            if batch:
                t0 = time.thread_time()
                send(tuple((t, len(p), mid, q) for t, p, mid, q in batch), [m[1] for m in batch])
                forwarded[0] += len(batch)
                cpu["forward"] += time.thread_time() - t0

    client.on_connect = on_connect
    client.on_subscribe = on_subscribe
    client.on_message = on_message
    client.on_disconnect = lambda _c, _u, _f, rc, _p: send(("disconnected", str(rc)))
    client.on_connect_fail = lambda _c, _u: send(("connect_failed",))
    if s.verbose:
        client.enable_logger(logging.getLogger("pansketch.aggregator.mqtt"))
    props = Properties(PacketTypes.CONNECT)
    props.ReceiveMaximum = s.receive_maximum
    if s.persistent:
        props.SessionExpiryInterval = s.session_expiry_s
    client.connect_async(s.broker.host, s.broker.port, keepalive=s.broker.keepalive, clean_start=not s.persistent,
                         properties=props)
    cpu0 = time.process_time()
    threading.Thread(target=batcher, name="pansketch-mqtt-batcher", daemon=True).start()
    client.loop_start()
    rc = 1
    try:
        while True:
            try:
                cmd = conn.recv()
            except (EOFError, OSError):
                log.error("MQTT process: the aggregator process went away; disconnecting without acknowledging")
                break
            if cmd[0] == "ack":
                t0 = time.thread_time()
                for mid, qos in cmd[1]:
                    client.ack(mid, qos)
                for topic, payload in cmd[2]:
                    client.publish(topic, payload, qos=1)
                cpu["acks"] += time.thread_time() - t0
            elif cmd[0] == "stop":
                rc = 0
                break
    finally:
        closing.set()
        with more:
            more.notify()
        client.disconnect()  # queued after the PUBACKs and publishes above, so they go out first
        client.loop_stop()
        cpu["mqtt_client"] = max(0.0, time.process_time() - cpu0 - cpu["forward"] - cpu["acks"])
        child.log_stage_cpu("MQTT", cpu, forwarded[0])
    return rc


class MQTTProcess:
    """The parent's handle on the transport child: start it, acknowledge through it, stop it.

    ``on_messages`` gets each batch of :class:`Msg` and ``on_event`` each
    connection event (docstring above), both on a receiver thread;
    ``on_event(("exited", returncode))`` when the child's end closes
    without :meth:`close` having been called.
    """

    def __init__(self, settings: Settings, on_messages: Callable[[list[Msg]], None],
                 on_event: Callable[[tuple[Any, ...]], None]) -> None:
        self.settings = settings
        self.on_messages = on_messages
        self.on_event = on_event
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.conn: Optional[Connection] = None
        self._send_lock = threading.Lock()
        self._closing = False
        self._lost_logged = False
        self._reader: Optional[threading.Thread] = None
        self.cpu_s = 0.0  # CPU time of the reader thread spent receiving message batches (stage timer)

    def start(self) -> None:
        self.proc, self.conn = child.spawn("host_tools.ingest.mqttproc", self.settings)
        self._reader = threading.Thread(target=self._read_loop, name="pansketch-mqtt-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    def acknowledge(self, acks: list[tuple[int, int]], publishes: list[tuple[str, bytes]]) -> None:
        """PUBACK ``(mid, qos)`` pairs, then publish ``(topic, payload)`` at QoS 1 (after a commit)."""
        if acks or publishes:
            self._send(("ack", acks, publishes))

    def ack(self, mid: int, qos: int) -> None:
        """paho's ``Client.ack``, for host_tools.ingest.devstatus."""
        self.acknowledge([(mid, qos)], [])

    def close(self, timeout: float = 10.0) -> Optional[int]:
        """Tell the child to disconnect (after what was sent before) and wait; its exit code."""
        self._closing = True
        if self.proc is None:
            return None
        self._send(("stop",))
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.error("MQTT process %d did not stop within %.0f s; killing it", self.proc.pid, timeout)
            self.proc.kill()
            rc = self.proc.wait()
        if self._reader is not None:
            self._reader.join(5)
        if self.conn is not None:
            self.conn.close()
        return rc

    def _send(self, obj: Any) -> None:
        assert self.conn is not None
        try:
            with self._send_lock:
                self.conn.send(obj)
        except OSError as exc:  # the child is gone; the reader reports it, the broker redelivers
            if not self._lost_logged:
                self._lost_logged = True
                log.warning("cannot reach the MQTT process: %s", exc)

    def _read_loop(self) -> None:
        assert self.conn is not None and self.proc is not None
        rbuf: Optional[bytearray] = None
        while True:
            try:
                t0 = time.thread_time()
                fr = child.recv_frame(self.conn, rbuf)
            except (EOFError, OSError, ValueError):
                break
            rbuf = fr.buf
            try:
                if fr.batch:
                    # bytes from here on (the store keeps them): the one copy out of the received frame,
                    # whose buffer is reused for the next batch
                    msgs = [Msg(m[0], v.tobytes(), m[2], m[3]) for m, v in zip(fr.obj, fr.payloads)]
                    del fr
                    self.cpu_s += time.thread_time() - t0
                    self.on_messages(msgs)
                else:
                    self.on_event(fr.obj)
            except Exception:  # a bug in one handler must not stop every later message
                log.exception("handling a message from the MQTT process failed")
        if not self._closing:
            try:
                rc: Optional[int] = self.proc.wait(5)
            except subprocess.TimeoutExpired:
                rc = None
            self.on_event(("exited", rc))


def main(argv: Optional[list[str]] = None) -> int:
    """Child entry point: ``python -m host_tools.ingest.mqttproc FD`` (FD: our end of the socket pair)."""
    try:
        conn, settings = child.attach(argv)
    except (EOFError, OSError):
        return 1
    assert isinstance(settings, Settings)
    child.log_to_stderr(logging.DEBUG if settings.verbose else logging.WARNING)
    return serve(conn, settings)


if __name__ == "__main__":
    from host_tools.ingest.mqttproc import main as _main  # the module proper, whose Settings the parent pickled

    sys.exit(_main())
