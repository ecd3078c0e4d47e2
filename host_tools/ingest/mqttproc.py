"""The aggregator's MQTT transport and validation, in a process of its own (``python -m host_tools.ingest.mqttproc``).

Why a process: receiving a 16 kB QoS 1 publish costs paho about as much
CPU as validating it (MQTT v5 properties, packet parsing), and in the
aggregator's process that work would compete with the writer for the GIL.
Here the paho client (network thread, reconnects, manual acks) runs in a
helper process, which also validates each release before forwarding it
(:class:`_Judge`: host_tools.ingest.validproc.verdict under a per-message
CPU budget), so a message's bytes cross one socket, once, and the
aggregator receives verdicts with them. Releases (publishes without
properties) are validated and forwarded by the network thread that read
them, a batch at a time (:class:`Gatherer`); anything paho decodes itself
goes through the :class:`Inbox` to a batcher thread; the aggregator (group commit,
every acknowledgement, host_tools.ingest.pipeline) is the parent. They
talk over one socket pair (host_tools/ingest/child.py):

child -> parent
    a batch frame (:func:`host_tools.ingest.child.send_batch`: no pickling
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
(:class:`MQTTProcess`); otherwise it stops the aggregator.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import mmap
import os
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, NamedTuple, Optional

from host_tools.ingest import child

log = logging.getLogger("pansketch.aggregator")


class Msg(NamedTuple):
    """One received message, as the aggregator needs it (paho's MQTTMessage does not cross processes).

    ``verdict``: the validation verdict (host_tools.ingest.validproc.verdict) when the transport
    validated the message already (the MQTT process does, for releases); None otherwise."""

    topic: str
    payload: bytes
    mid: int
    qos: int
    verdict: Any = None


@dataclass(frozen=True)
class Settings:
    """What the child needs to connect: broker ([broker] of host.toml) and session; and how to validate."""

    broker: Any  # hostconfig.BrokerConfig
    client_id: str
    subscriptions: tuple[tuple[str, int], ...]  # (topic filter, QoS)
    persistent: bool  # clean_start off, session expiry below
    session_expiry_s: int
    receive_maximum: int  # unacknowledged QoS 1 messages the broker may send us (MQTT v5 Receive Maximum)
    verbose: bool = False  # -v: paho's packet log on stderr
    validation: Any = None  # validproc.Settings: validate releases here (None: forward them unvalidated)
    watch: Optional[str] = None  # the file where the child records the message it is validating (set by MQTTProcess)
    poison: tuple[tuple[bytes, int, str], ...] = ()  # (message key, deaths, code) of messages that killed a child


GEN_SHIFT = 32  # Msg.mid = child generation << GEN_SHIFT | connection << EPOCH_SHIFT | MQTT packet id (acks of a dead child's messages, or from before a reconnect, are dropped)
EPOCH_SHIFT = 16  # below GEN_SHIFT: Msg.mid's bits 16..31 are the child's connection (MQTT packet ids are 16 bits)
EPOCH_MASK = (1 << (GEN_SHIFT - EPOCH_SHIFT)) - 1
PID_MASK = (1 << EPOCH_SHIFT) - 1
POISON_DEATHS = 2  # a message that killed the child this many times is refused without validating it again
POISON_MAX = 1024  # messages remembered as poison (each cost a CPU budget and a restart; bounded anyway)
_WATCH = struct.Struct("=QB32sHI")  # counter, validating (0/1), message key, topic length, payload size
_WATCH_TOPIC = 64  # the topic's bytes (at most 1024) from this offset
WATCH_SIZE = _WATCH_TOPIC + 1024


def message_key(topic: str, digest: bytes) -> bytes:
    """What identifies a message again when it is redelivered or re-sent: SHA-256 of the topic and of
    the payload's SHA-256 (which the release needs anyway)."""
    return hashlib.sha256(topic.encode("utf-8", "replace") + b"\0" + digest).digest()


class Watched(NamedTuple):
    """What the watch file says: the message the child was validating (``validating``) or last validated."""

    counter: int
    validating: bool
    key: bytes
    topic: str
    size: int


def read_watch(mm: Any) -> Watched:
    counter, st, key, tl, size = _WATCH.unpack_from(mm, 0)
    topic = bytes(mm[_WATCH_TOPIC:_WATCH_TOPIC + min(tl, 1024)]).decode("utf-8", "replace")
    return Watched(counter, st == 1, key, topic, size)


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
        from host_tools.ingest import devstatus, validproc

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
            return None  # a device status: the parent records it (host_tools.ingest.devstatus)
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
    import paho.mqtt.client as mqtt

    from agent.publisher import tcp_no_delay

    from host_tools.ingest import pahofast

    # fewer system calls and no per-packet properties object per release, where paho has the internals for it
    cls = pahofast.BufferedClient if pahofast.supported() else mqtt.Client
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

    from host_tools.ingest import pahofast  # paho is imported in the child only

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


class MQTTProcess:
    """The parent's handle on the transport child: start it, acknowledge through it, stop it.

    ``on_messages`` gets each batch of :class:`Msg` and ``on_event`` each
    connection event (docstring above), both on a receiver thread;
    ``on_event(("exited", returncode))`` when the child's end closes
    without :meth:`close` having been called, except when it died while
    validating a message (:class:`_Judge`): then that message is remembered
    (``poison``), the child restarted, and ``on_event(("restarted", why))``.
    Five such deaths in a row that are not CPU timeouts are an exit. A
    child that validates one message for longer than a wall-clock backstop
    (10 s + 4 budgets) without the CPU timer firing is killed (a timeout).

    ``Msg.mid`` carries the child's generation: after a restart, the
    acknowledgements of what the dead child received are dropped (with a
    clean session its packet ids mean other messages now; the broker
    redelivers, or the devices re-send, what was not acknowledged, and
    storing is idempotent). It also carries the child's connection to the
    broker (bits 16..31, :func:`serve`): the child drops acknowledgements of
    what it received before it reconnected, for the same reason.
    """

    MAX_RESTARTS = 5  # deaths in a row while validating that were not CPU timeouts

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
        self.gen = 0  # children started so far (Msg.mid's high bits)
        self.restarts = 0  # child restarts after a death while validating
        self.timeouts = 0  # messages refused with code 'timeout' (after their second death)
        self._deaths = 0  # deaths while validating in a row that were not CPU timeouts
        self.poison: dict[bytes, tuple[int, str]] = {}  # message key -> (deaths, code)
        self._watch_path: Optional[str] = None
        self._mm: Any = None
        self._backstop_killed = False

    def start(self) -> None:
        if self.settings.validation is not None:
            fd, self._watch_path = tempfile.mkstemp(prefix="pansketch-mqtt-watch-",
                                                    dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            os.ftruncate(fd, WATCH_SIZE)
            self._mm = mmap.mmap(fd, WATCH_SIZE)
            os.close(fd)
        self._spawn()
        self._reader = threading.Thread(target=self._read_loop, name="pansketch-mqtt-reader", daemon=True)
        self._reader.start()
        if self._mm is not None:
            threading.Thread(target=self._backstop, name="pansketch-mqtt-backstop", daemon=True).start()

    def _spawn(self) -> bool:
        """Start a child (False, and none started, once :meth:`close` was called after the first).

        All under the lock acknowledgements are sent under: the old end is closed here, so no
        acknowledgement is being written to it (its descriptor number may be the new socket's), and
        close() either stops the new child or sees that none was started."""
        s = dataclasses.replace(self.settings, watch=self._watch_path,
                                poison=tuple((k, n, c) for k, (n, c) in self.poison.items()))
        with self._send_lock:
            if self._closing and self.proc is not None:
                return False
            if self.conn is not None:
                try:
                    self.conn.close()
                except OSError:
                    pass
            if self._mm is not None:
                self._mm[:WATCH_SIZE] = bytes(WATCH_SIZE)
            proc, conn = child.spawn("host_tools.ingest.mqttproc", s)
            self.gen += 1
            self.proc, self.conn = proc, conn
            self._backstop_killed = False
        return True

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    def acknowledge(self, acks: list[tuple[int, int]], publishes: list[tuple[str, bytes]]) -> None:
        """PUBACK ``(mid, qos)`` pairs, then publish ``(topic, payload)`` at QoS 1 (after a commit).

        Acknowledgements of messages a dead child received are dropped (see the class docstring)."""
        with self._send_lock:
            g = self.gen
            mask = (1 << GEN_SHIFT) - 1
            acks = [(mid & mask, q) for mid, q in acks if mid >> GEN_SHIFT == g]
            if acks or publishes:
                self._send_locked(("ack", acks, publishes))

    def ack(self, mid: int, qos: int) -> None:
        """paho's ``Client.ack``, for host_tools.ingest.devstatus."""
        self.acknowledge([(mid, qos)], [])

    def close(self, timeout: float = 10.0) -> Optional[int]:
        """Tell the child to disconnect (after what was sent before) and wait; its exit code."""
        self._closing = True
        if self.proc is None:
            return None
        with self._send_lock:
            self._send_locked(("stop",))
            proc = self.proc
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.error("MQTT process %d did not stop within %.0f s; killing it", proc.pid, timeout)
            proc.kill()
            rc = proc.wait()
        if self._reader is not None:
            self._reader.join(5)
        if self.conn is not None:
            self.conn.close()
        if self._watch_path is not None:
            try:
                os.unlink(self._watch_path)
            except OSError:
                pass
        return rc

    def _send_locked(self, obj: Any) -> None:
        assert self.conn is not None
        try:
            self.conn.send(obj)
        except OSError as exc:  # the child is gone; the reader reports it, the broker redelivers
            if not self._lost_logged:
                self._lost_logged = True
                log.warning("cannot reach the MQTT process: %s", exc)

    def _backstop(self) -> None:
        """Kill a child that has been validating one message for longer than the wall-clock backstop."""
        assert self._mm is not None
        limit = 10.0 + 4.0 * float(self.settings.validation.cpu_s)
        last, since = -1, time.monotonic()
        last_proc: Any = None
        while not self._closing:
            time.sleep(0.25)
            proc = self.proc  # before the watch: a restart clears the watch, then replaces the process
            w = read_watch(self._mm)
            now = time.monotonic()
            if not w.validating or w.counter != last or proc is not last_proc:
                last, since, last_proc = w.counter if w.validating else -1, now, proc
                continue
            if now - since > limit and proc is not None:
                with self._send_lock:  # the lock _spawn replaces the process under: never a successor
                    p: subprocess.Popen[bytes] = proc
                    if p is not self.proc or p.poll() is not None:
                        continue
                    log.error("MQTT process %d has been validating one message for %.0f s; killing it",
                              p.pid, now - since)
                    self._backstop_killed = True
                    p.kill()
                last, since = -1, now

    def _read_loop(self) -> None:
        rbuf: Optional[bytearray] = None
        while True:
            assert self.conn is not None and self.proc is not None
            conn, gen = self.conn, self.gen << GEN_SHIFT
            try:
                t0 = time.thread_time()
                fr = child.recv_frame(conn, rbuf)
            except (EOFError, OSError, ValueError):
                if self._closing or not self._died_validating():
                    break
                rbuf = None
                continue
            rbuf = fr.buf
            try:
                if fr.batch:
                    # bytes from here on (the store keeps them): the one copy out of the received frame,
                    # whose buffer is reused for the next batch
                    msgs = [Msg(m[0], v.tobytes(), gen | m[2], m[3], m[4]) for m, v in zip(fr.obj, fr.payloads)]
                    del fr
                    self.cpu_s += time.thread_time() - t0
                    self.on_messages(msgs)
                else:
                    self.on_event(fr.obj)
            except Exception:  # a bug in one handler must not stop every later message
                log.exception("handling a message from the MQTT process failed")
        if not self._closing:
            assert self.proc is not None
            try:
                rc: Optional[int] = self.proc.wait(5)
            except subprocess.TimeoutExpired:
                rc = None
            self.on_event(("exited", rc))

    def _died_validating(self) -> bool:
        """The child's end closed: if it died while validating a message, remember the message and start
        a new child (True); otherwise False (the aggregator stops)."""
        assert self.proc is not None
        try:
            rc = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            return False
        if self._mm is None or self._closing:
            return False
        w = read_watch(self._mm)
        if not w.validating:
            return False
        timeout = rc == -signal.SIGPROF or self._backstop_killed
        if not timeout:
            self._deaths += 1
            if self._deaths >= self.MAX_RESTARTS:
                return False
        else:
            self._deaths = 0
        code = "timeout" if timeout else "internal"
        n = self.poison.pop(w.key, (0, code))[0] + 1
        if len(self.poison) >= POISON_MAX:
            self.poison.pop(next(iter(self.poison)))
        self.poison[w.key] = (n, code)
        if n >= POISON_DEATHS and timeout:
            self.timeouts += 1
        what = ("took more than %g s of CPU" % self.settings.validation.cpu_s if timeout
                else "crashed it (%s)" % child.exit_status(rc))
        log.warning("validating a message on %s (%d bytes) in the MQTT process %d %s; restarting it (%s)",
                    w.topic[:200], w.size, self.proc.pid, what,
                    "refused as %s when it comes again" % code if n >= POISON_DEATHS
                    else "validated once more when it comes again")
        if not self._spawn():  # stopping meanwhile
            return False
        self.restarts += 1
        self.on_event(("restarted", what))
        return True


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
