"""The aggregator's MQTT transport and validation, in a process of its own (``python -m pansketch.host_tools.ingest.mqttproc``).

This module is that process (the child); the aggregator's handle on it is
pansketch.host_tools.ingest.mqttparent.MQTTProcess, and what both sides share (the
message and settings types, the watch file's layout) pansketch.host_tools.ingest.mqttshared.

Why a process: receiving a 16 kB QoS 1 publish costs paho about as much
CPU as validating it (MQTT v5 properties, packet parsing), and in the
aggregator's process that work would compete with the writer for the GIL.
Here the paho client (network thread, reconnects, manual acks) runs in a
helper process, which also validates each release before forwarding it
(:class:`_Judge`: pansketch.host_tools.ingest.validproc.verdict under a per-message
CPU budget), so a message's bytes cross one socket, once, and the
aggregator receives verdicts with them. Releases (publishes without
properties) are validated and forwarded by the network thread that read
them, a batch at a time (:class:`Gatherer`); anything paho decodes itself
goes through the :class:`Inbox` to a batcher thread; the aggregator (group commit,
every acknowledgement, pansketch.host_tools.ingest.pipeline) is the parent. They
talk over one socket pair (host_tools/ingest/child.py):

child -> parent
    a batch frame (:func:`pansketch.host_tools.ingest.child.send_batch`: no pickling
    of message bytes) of what arrived since the last batch, meta
    ``[(topic, size, mid, qos, verdict), ...]`` (``verdict`` None for a
    device status); ``("connected", acks_in_flight)``, ``("refused", reason)``,
    ``("subscribed", None | refusal)``, ``("disconnected", reason)``,
    ``("connect_failed",)``: connection events, logged by the parent; ``("dropped", n, limit)``:
    n QoS 0 messages dropped because ``limit`` were waiting (:class:`Inbox`).
parent -> child
    ``("ack", [(mid, qos), ...], [(topic, payload), ...])``: PUBACK these
    messages (their outcome is committed), then publish these host
    acknowledgements at QoS 1, in that order; ``("stop",)``: disconnect
    and exit 0.

The child acknowledges nothing on its own, so every PUBACK still follows
a commit. It ignores SIGINT/SIGTERM (the parent drains, then sends
``stop``); when the parent's end closes (the parent died) it exits 1
without acknowledging, and the broker redelivers. The parent sees the
child's end close: if the child died while validating a message (the
watch file says so) it remembers the message and starts a new child
(:class:`pansketch.host_tools.ingest.mqttparent.MQTTProcess`); otherwise it stops the aggregator.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional

from pansketch.host_tools.ingest import child
from pansketch.host_tools.ingest.mqttshared import (_WATCH, _WATCH_TOPIC, EPOCH_MASK, EPOCH_SHIFT, PID_MASK, POISON_DEATHS,
                                          WATCH_SIZE, Settings, message_key)

log = logging.getLogger("pansketch.aggregator")


class _Judge:
    """In the child: validate releases before they are forwarded, each under the CPU budget.

    Before each message it writes the message's key, topic and size to the
    watch file (a shared mapping the parent reads if this process dies),
    then arms ``ITIMER_PROF`` (``validate_cpu_s``; the process's CPU time,
    the MQTT client's threads included: the budget is never looser than in
    a helper of its own): a message that takes more kills this process
    with SIGPROF, even inside C code. The parent restarts the child, which
    validates that message once more when the broker redelivers it (or the
    device re-sends it); a message that killed the child twice is refused
    with code ``timeout`` (``internal`` if it crashed it otherwise) without
    being validated again.
    """

    def __init__(self, s: Settings) -> None:
        from pansketch.host_tools.ingest import devstatus, validproc

        self.vs = s.validation
        self.poison = {k: (n, code) for k, n, code in s.poison}
        self.status_device = devstatus.status_device
        self.verdict = validproc.verdict
        self.rejected = validproc.rejected
        self.budget = float(self.vs.cpu_s)
        self.counter = 0
        self.mm: Any = None
        if s.watch is not None:
            with open(s.watch, "r+b") as f:
                self.mm = mmap.mmap(f.fileno(), WATCH_SIZE)

    def __call__(self, topic: str, payload: bytes) -> Any:
        try:
            return self._judge(topic, payload)
        except Exception as exc:  # a bug here must not stop the batcher (nothing would be forwarded)
            log.exception("judging a message on %s failed unexpectedly", str(topic)[:200])
            return self.rejected("internal", "validation failed unexpectedly: %s: %s" % (type(exc).__name__, exc),
                                 None)

    def _judge(self, topic: str, payload: bytes) -> Any:
        if self.status_device(topic) is not None:
            return None  # a device status: the parent records it (pansketch.host_tools.ingest.devstatus)
        vs = self.vs
        sha = None
        key = b"\0" * 32
        if len(payload) <= vs.max_bytes:  # larger: refused for its size, before anything reads it
            h = hashlib.sha256(payload)
            sha = h.hexdigest()
            key = message_key(topic, h.digest())
            bad = self.poison.get(key)
            if bad is not None and bad[0] >= POISON_DEATHS:
                reason = ("validation took more than %g s of CPU (aggregator.validate_cpu_s)" % vs.cpu_s
                          if bad[1] == "timeout" else "validating this message crashed the MQTT process")
                if bad[0] > POISON_DEATHS:  # it killed the process once more while dev/seq were read below
                    return self.rejected(bad[1], reason, None)
                # the refusal names the dev and seq the bytes give, as every refusal does where they are
                # readable (the rejection row; pansketch status counts that seq as refused; a timeout is
                # not acknowledged to the device, acks._ack_entry): read by the bounded reader,
                # watched and under the budget like validation
                return self._watched(topic, payload, key, lambda: self.rejected(bad[1], reason, payload))
        return self._watched(topic, payload, key, lambda: self.verdict(vs, topic, payload, sha))

    def _watched(self, topic: str, payload: bytes, key: bytes, fn: Callable[[], Any]) -> Any:
        """``fn()`` with the message recorded in the watch file and the CPU budget armed."""
        mm = self.mm
        if mm is not None:
            self.counter += 1
            tb = topic.encode("utf-8", "replace")[:1024]
            mm[_WATCH_TOPIC:_WATCH_TOPIC + len(tb)] = tb
            _WATCH.pack_into(mm, 0, self.counter, 1, key, len(tb), len(payload))
        # SIGPROF (default action: terminate) after `budget` s of this process's CPU time
        signal.setitimer(signal.ITIMER_PROF, self.budget)
        try:
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
            if mm is not None:
                mm[8] = 0  # not validating any more


def _client(s: Settings) -> Any:
    import paho.mqtt
    import paho.mqtt.client as mqtt

    from pansketch.agent.pi.publisher import tcp_no_delay

    from pansketch.host_tools.ingest import pahofast

    # fewer system calls and no per-packet properties object per release, where paho's internals are the
    # ones pahofast was written for; else paho's own client, correct but slower, and the log says why
    why = pahofast.check()
    if why is not None:
        log.warning("paho-mqtt %s does not behave as pansketch.host_tools.ingest.pahofast reads it (%s): the MQTT process "
                    "uses paho's plain client (correct, slower; pyproject names the paho versions it was "
                    "tested with)", getattr(paho.mqtt, "__version__", "?"), why)
    cls = pahofast.BufferedClient if why is None else mqtt.Client
    if s.broker.mqtt_version == 5:
        c = cls(mqtt.CallbackAPIVersion.VERSION2, client_id=s.client_id, protocol=mqtt.MQTTv5, manual_ack=True)
    else:
        # MQTT 3.1.1 names the persistent session at construction (clean_session), v5 at connect (clean_start)
        c = cls(mqtt.CallbackAPIVersion.VERSION2, client_id=s.client_id, protocol=mqtt.MQTTv311, manual_ack=True,
                clean_session=not s.persistent)
    b = s.broker
    if b.tls:
        c.tls_set(ca_certs=b.tls_ca, certfile=b.tls_cert, keyfile=b.tls_key)
    if b.username is not None:
        c.username_pw_set(b.username, b.password)
    c.max_inflight_messages_set(ACKS_IN_FLIGHT)  # on_connect lowers it to the broker's Receive Maximum
    c.reconnect_delay_set(min_delay=max(1, int(b.reconnect_min_s)), max_delay=max(1, int(b.reconnect_max_s)))
    # a PUBACK and the device's ack go out back to back: without TCP_NODELAY the second waits for the
    # broker's delayed ACK of the first
    c.on_socket_open = tcp_no_delay
    return c


ACKS_IN_FLIGHT = 256  # host acknowledgements awaiting the broker's PUBACK (one group's; GROUP_MAX)


def acks_in_flight(connack_props: Any) -> int:
    """How many host acknowledgements (QoS 1 publishes) may await the broker's PUBACK at once: a group's
    worth, :data:`ACKS_IN_FLIGHT`, or fewer where the broker's CONNACK sets a Receive Maximum. paho
    ignores the broker's value and keeps its own 20. mosquitto sends its ``max_inflight_messages`` (20 in
    deploy/mosquitto, which also bounds what it sends a device at once), so there a group of 128 still
    goes out 20 at once, the rest as PUBACKs make room (pahofast: one write per read of PUBACKs); a
    broker that allows more gets more."""
    rm = getattr(connack_props, "ReceiveMaximum", None)
    return ACKS_IN_FLIGHT if not isinstance(rm, int) or rm <= 0 else min(ACKS_IN_FLIGHT, rm)


QOS0_BACKLOG = 4096  # messages waiting in the inbox past which a QoS 0 arrival is dropped
QOS1_BACKLOG = 1024  # messages waiting in the inbox past which the network thread waits (QoS 1 and 2)
BATCH_MAX = 256  # messages validated and forwarded as one batch (the aggregator's GROUP_MAX)


class Inbox:
    """What the network thread received through paho's own handler, waiting for the batcher (validation,
    forwarding); with pahofast's client that is only a publish with MQTT v5 properties, or QoS 2 (releases
    have none and take the :class:`Gatherer`, which needs no bound: the network thread validates what it
    read before it reads again).

    Both kinds are bounded. QoS 0: any client may publish at QoS 0 and nothing bounds how fast the
    broker passes it on, so a flood would grow this list while validation falls behind, until the
    process ran out of memory and the aggregator stopped. Past ``qos0_max`` waiting messages a QoS 0
    arrival is dropped and counted: QoS 0 promises no delivery, and a device re-sends a release until
    the host acknowledges it (the agent publishes releases at QoS 1). QoS 1 should be bounded by
    Receive Maximum, but mosquitto 2.0.11 (Debian 12) goes past it once PUBACKs come back in groups
    (measured: 5,232 unacknowledged with Receive Maximum 1,024; docs/HOST.md), and an
    unacknowledged QoS 1 message must not be dropped (the broker sends it again only after a
    reconnect). Past ``qos1_max`` waiting messages the network thread waits in :meth:`add` until
    the batcher takes some: the broker's bytes stay in the kernel and the broker (TCP flow
    control), not here. The batcher never waits for the network thread, so this cannot deadlock
    (it waits only for the aggregator, which commits and acknowledges without this process).
    """

    def __init__(self, qos0_max: int = QOS0_BACKLOG, qos1_max: int = QOS1_BACKLOG) -> None:
        self.items: list[tuple[str, bytes, int, int]] = []
        self.cond = threading.Condition()
        self.qos0_max = qos0_max
        self.qos1_max = qos1_max
        self.dropped = 0  # since the last take()
        self.waits = 0  # times the network thread waited for room
        self.peak = 0
        self.closing: Optional[threading.Event] = None  # set: add() stops waiting

    def add(self, item: tuple[str, bytes, int, int]) -> bool:
        with self.cond:
            if item[3] == 0:
                if len(self.items) >= self.qos0_max:
                    self.dropped += 1
                    return False
            elif len(self.items) >= self.qos1_max:
                self.waits += 1
                while len(self.items) >= self.qos1_max and not (self.closing is not None and self.closing.is_set()):
                    self.cond.wait(0.5)
            self.items.append(item)
            self.peak = max(self.peak, len(self.items))
            self.cond.notify_all()
            return True

    def take(self, closing: threading.Event, limit: int = BATCH_MAX) -> tuple[list[tuple[str, bytes, int, int]], int]:
        """Up to ``limit`` waiting messages, oldest first (blocks until one is, or ``closing``), and the
        drops since last time."""
        with self.cond:
            while not self.items and not closing.is_set():
                self.cond.wait(0.5)
            batch = self.items[:limit]
            del self.items[:limit]
            dropped, self.dropped = self.dropped, 0
            self.cond.notify_all()  # room for a waiting add()
            return batch, dropped

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()


GATHER_MAX = 16  # releases the network thread validates and forwards as one batch (Gatherer) ...
GATHER_WAIT_S = 0.005  # ... or fewer, this long after the first of them arrived


class Gatherer:
    """In the network thread: the releases it read, validated and forwarded as one batch once
    :data:`GATHER_MAX` are waiting or :data:`GATHER_WAIT_S` after the first arrived.

    Why in the network thread: handing each read's messages to the batcher
    thread cost a wake-up and a hand-over of the GIL per read, and under
    sustained load a socket read brings about three releases. Why wait: forwarding
    each read's releases at once made batches of about three, and the
    aggregator's reader, validation and writer threads each wake once per
    batch. Measured in the 1,000-device soak (700 releases/s, two-minute
    runs, two interleaved pairs against the batcher): the MQTT process 86-87
    -> 75-76 µs per stored release, the aggregator 71-74 -> 71 µs; each
    release waits at most 5 ms more. A message held here is not
    acknowledged yet (the parent acknowledges after its commit); if the
    connection drops meanwhile it is forwarded once paho's loop runs again
    (after the reconnect), and the broker redelivers it too: stored once,
    the second a duplicate.

    The network thread validates what one read brought (at most
    pahofast.READ_SIZE bytes) before it reads again: that back-pressures the
    broker through TCP, as the inbox's bound did. It is away from the
    connection for as long as that takes: the byte-level reader keeps a
    message to milliseconds at most (the CPU budget, ``validate_cpu_s``, is
    the guard for what nobody thought of). ``add`` and ``tick`` are called by the
    network thread only (pahofast.BufferedClient.on_fast and on_tick);
    ``flush`` by the serving thread once the network thread has stopped.
    """

    def __init__(self, forward: Callable[[list[tuple[str, bytes, int, int]]], None], max_n: int = GATHER_MAX,
                 wait_s: float = GATHER_WAIT_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.forward = forward
        self.max_n = max_n
        self.wait_s = wait_s
        self.clock = clock
        self.items: list[tuple[str, bytes, int, int]] = []
        self.first = 0.0

    def add(self, item: tuple[str, bytes, int, int]) -> None:
        if not self.items:
            self.first = self.clock()
        self.items.append(item)

    def tick(self) -> Optional[float]:
        """Forward what is due; the seconds until the rest is due (None: nothing waits)."""
        if not self.items:
            return None
        left = self.first + self.wait_s - self.clock()
        if len(self.items) < self.max_n and left > 0:
            return left
        self.flush()
        return None

    def flush(self) -> None:
        batch, self.items = self.items, []
        for i in range(0, len(batch), BATCH_MAX):  # one read can bring many more (small messages)
            self.forward(batch[i:i + BATCH_MAX])


def serve(conn: Connection, s: Settings) -> int:
    """The child: run the MQTT client until the parent says stop (0) or goes away (1)."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties
    from paho.mqtt.subscribeoptions import SubscribeOptions

    from pansketch.host_tools.ingest import pahofast  # paho is imported in the child only

    client = _client(s)
    send_lock = threading.Lock()  # the network thread and the batcher both send
    inbox = Inbox()
    closing = threading.Event()
    inbox.closing = closing
    # the connection a message came on: Msg.mid = ... | epoch << EPOCH_SHIFT | packet id. A packet id names a
    # message only on its connection (after a clean-session reconnect the same id is another message, not
    # stored yet): an ack from before a reconnect is dropped (the message comes again; storing is idempotent).
    # Changed by the network thread on connect and disconnect, under ack_lock, which the ack loop holds
    # from its check to paho's queueing of the PUBACK (a reconnect clears what paho had queued).
    epoch = [0]
    ack_lock = threading.Lock()

    def new_epoch() -> None:
        with ack_lock:
            epoch[0] = (epoch[0] + 1) & EPOCH_MASK

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

    def on_connect(c: Any, _u: Any, _flags: Any, rc: Any, props: Any) -> None:
        new_epoch()
        if rc.is_failure:
            send(("refused", str(rc)))
            return
        # paho's setter refuses a change on a connection. (After a reconnect paho re-sends everything it had
        # in flight at once, whatever the limit: its own behaviour, unchanged here.)
        c._max_inflight_messages = acks_in_flight(props)
        send(("connected", c._max_inflight_messages))
        if s.broker.mqtt_version == 5:
            c.subscribe([(t, SubscribeOptions(qos=q)) for t, q in s.subscriptions])
        else:  # 3.1.1 has no subscription options: a QoS per filter
            c.subscribe(list(s.subscriptions))

    def on_subscribe(_c: Any, _u: Any, _mid: Any, rcs: Any, _props: Any) -> None:
        bad = [r for r in rcs if r.is_failure]
        send(("subscribed", str(bad[0]) if bad else None))

    def on_message(_c: Any, _u: Any, m: Any) -> None:
        # the network thread only queues; the batcher pickles and sends
        inbox.add((m.topic, m.payload, epoch[0] << EPOCH_SHIFT | m.mid, m.qos))

    cpu = {"forward": 0.0, "acks": 0.0, "validate": 0.0}  # stage timers (thread CPU time); the MQTT client is the rest
    forwarded = [0]
    cpu_lock = threading.Lock()
    judge = _Judge(s) if s.validation is not None else None

    def forward(batch: list[tuple[str, bytes, int, int]]) -> None:
        """Validate these messages and send them to the parent as one batch frame."""
        t0 = time.thread_time()
        if judge is not None:
            meta = tuple((t, len(p), mid, q, judge(t, p)) for t, p, mid, q in batch)
        else:
            meta = tuple((t, len(p), mid, q, None) for t, p, mid, q in batch)
        t1 = time.thread_time()
        send(meta, [m[1] for m in batch])
        with cpu_lock:  # the network thread and the batcher both forward
            forwarded[0] += len(batch)
            cpu["validate"] += t1 - t0
            cpu["forward"] += time.thread_time() - t1

    def batcher() -> None:
        while not closing.is_set():
            batch, dropped = inbox.take(closing)
            if dropped:
                send(("dropped", dropped, inbox.qos0_max))
            if batch:
                forward(batch)

    client.on_connect = on_connect
    client.on_subscribe = on_subscribe
    client.on_message = on_message
    gatherer: Optional[Gatherer] = None
    if isinstance(client, pahofast.BufferedClient):
        # a release without MQTT v5 properties comes here straight from the packet (pahofast), and is validated
        # and forwarded by the network thread, a batch at a time (Gatherer); paho's on_message path (a publish
        # with properties) goes through the inbox and the batcher
        gatherer = Gatherer(forward)
        g = gatherer
        client.on_fast = lambda t, p, mid, q: g.add((t, p, epoch[0] << EPOCH_SHIFT | mid, q))
        client.on_tick = gatherer.tick

    def on_disconnect(_c: Any, _u: Any, _f: Any, rc: Any, _p: Any) -> None:
        new_epoch()
        send(("disconnected", str(rc)))

    client.on_disconnect = on_disconnect
    client.on_connect_fail = lambda _c, _u: send(("connect_failed",))
    if s.verbose:
        client.enable_logger(logging.getLogger("pansketch.aggregator.mqtt"))
    if s.broker.mqtt_version == 5:
        props = Properties(PacketTypes.CONNECT)
        props.ReceiveMaximum = s.receive_maximum
        if s.persistent:
            props.SessionExpiryInterval = s.session_expiry_s
        client.connect_async(s.broker.host, s.broker.port, keepalive=s.broker.keepalive, clean_start=not s.persistent,
                             properties=props)
    else:  # 3.1.1: no CONNECT properties (the session was chosen with the client, _client)
        client.connect_async(s.broker.host, s.broker.port, keepalive=s.broker.keepalive)
    cpu0 = time.process_time()
    batch_thread = threading.Thread(target=batcher, name="pansketch-mqtt-batcher", daemon=True)
    batch_thread.start()
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
                with ack_lock:
                    e = epoch[0]
                    ones = []
                    for mid, qos in cmd[1]:
                        if mid >> EPOCH_SHIFT == e:  # else received on an earlier connection: dropped
                            if qos == 1:
                                ones.append(mid & PID_MASK)
                            else:
                                client.ack(mid & PID_MASK, qos)
                    pahofast.ack_many(client, ones)  # one queued write for the group's PUBACKs
                pahofast.publish_many(client, cmd[2])  # one queued write for the group's host acknowledgements
                cpu["acks"] += time.thread_time() - t0
            elif cmd[0] == "stop":
                rc = 0
                break
    finally:
        closing.set()
        inbox.wake()
        # what the batcher took is forwarded before the exit (the parent reads to the end and stores it;
        # its acks cannot go out any more, so the broker redelivers it: a duplicate, never a loss);
        # bounded, for a batcher stuck in a message over the CPU budget
        batch_thread.join(2.0)
        # host acknowledgements beyond the broker's Receive Maximum wait in paho's table for room: up to 2 s
        # for the broker to take them (any left are lost with the connection; their devices re-send after
        # ack_timeout_s and are acknowledged as duplicates)
        deadline = time.monotonic() + 2.0
        while client._out_messages and client.is_connected() and time.monotonic() < deadline:
            time.sleep(0.01)
        client.disconnect()  # queued after the PUBACKs and publishes in flight, so they go out first
        client.loop_stop()
        if gatherer is not None:  # the network thread has stopped: what it gathered is forwarded, as the batcher's
            gatherer.flush()
        cpu["mqtt_client"] = max(0.0, time.process_time() - cpu0 - cpu["forward"] - cpu["acks"] - cpu["validate"])
        child.log_stage_cpu("MQTT", cpu, forwarded[0])
    return rc

def main(argv: Optional[list[str]] = None) -> int:
    """Child entry point: ``python -m pansketch.host_tools.ingest.mqttproc FD`` (FD: our end of the socket pair)."""
    return child.helper_main(serve, Settings, argv, lambda s: logging.DEBUG if s.verbose else logging.WARNING)


if __name__ == "__main__":
    child.run_as_main("pansketch.host_tools.ingest.mqttproc")
