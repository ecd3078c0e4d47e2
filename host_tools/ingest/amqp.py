"""The aggregator's AMQP 0-9-1 transport for a RabbitMQ cluster (``[broker] kind = "rabbitmq"``).

Devices stay on MQTT 3.1.1 and connect to any node of the cluster (the
RabbitMQ MQTT plugin maps ``pansketch/<dev>/release`` to the routing key
``pansketch.<dev>.release`` on ``amq.topic``). RabbitMQ 3.x speaks no MQTT 5,
so there are no shared subscriptions; instead every aggregator consumes one
durable **quorum** queue (``[broker] queue``, replicated on every node by Raft)
bound to ``amq.topic`` with the release and status keys, over AMQP (pika).
Several aggregators consuming the same queue split the messages; a message
is delivered to one consumer at a time and comes back to the queue when that
consumer's connection dies unacknowledged (so a killed aggregator's share goes
to the others at once, unlike a mosquitto shared group).

:class:`AMQPTransport` has the interface of pansketch.host_tools.ingest.mqttparent.MQTTProcess
so the aggregator's validate -> store -> ack pipeline (pansketch.host_tools.ingest.pipeline)
runs unchanged:

* ``on_messages(list[Msg])`` for what arrived (``Msg.topic`` back in MQTT form),
  ``on_event(("connected",) | ("subscribed", None) | ("disconnected", why) |
  ("connect_failed",) | ("exited", why))``;
* ``acknowledge(acks, publishes)``: after the commit, ``basic.ack`` those
  deliveries, then publish each host acknowledgement to ``amq.topic`` with the
  routing key of ``<prefix>/<dev>/ack`` (persistent, ``mandatory``, publisher
  confirms; :class:`AckPublisher`, on a connection of its own). A device's MQTT session is a queue on some node; if none is
  reachable the broker returns the ack (``mandatory``) and it is published
  again later (up to :data:`ACK_RETRIES` times). Without ``mandatory`` such an
  ack would be dropped silently. A device whose ack is lost for good re-sends
  the release and gets a duplicate's ack; nothing is lost either way.

The queue is declared and bound on every connect (idempotent), but devices
may publish before any aggregator ever ran: releases published to
``amq.topic`` while no queue is bound are confirmed to the device and
dropped. So deploy/rabbitmq/setup.sh declares it first
(``python -m pansketch.host_tools.ingest.amqp --declare --config host.toml``).

The pika client runs in a thread of the aggregator's process (pika's
blocking connection is not thread-safe: only that thread touches it; the
writer hands it acknowledgements through a queue). A delivery tag is only
valid on its channel, so ``Msg.mid`` carries the connection generation: an
ack for a delivery of a connection that died is dropped (the broker has
already requeued the message; the store is idempotent).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import random
import ssl
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from pansketch.host_tools.ingest.mqttshared import Msg

log = logging.getLogger("pansketch.aggregator")

GEN_SHIFT = 40  # Msg.mid = generation << GEN_SHIFT | delivery tag
ACK_RETRIES = 6  # a returned host ack is published again 1, 2, 4, ... s later
QUEUE_ARGS = {"x-queue-type": "quorum"}


def mqtt_to_amqp(topic: str) -> str:
    """What the RabbitMQ MQTT plugin does to a topic (filter): '/' -> '.', '+' -> '*' (rabbit_mqtt_util)."""
    return topic.replace("/", ".").replace("+", "*")


def amqp_to_mqtt(key: str) -> str:
    return key.replace("*", "+").replace(".", "/")


def _close_quietly(conn: Any) -> None:
    """Close a pika connection on the way out of a session; a connection that is already broken
    may raise anything here, and the reason it ended has been logged already."""
    try:
        if conn.is_open:
            conn.close()
    except Exception:
        pass


@dataclass(frozen=True)
class Settings:
    broker: Any  # hostconfig.BrokerConfig (kind = "rabbitmq")
    topic: str  # the release filter, MQTT form ("pansketch/+/release")
    prefetch: int  # unacknowledged deliveries per consumer
    client_name: str = "pansketch-aggregator"

    @property
    def bindings(self) -> tuple[str, str]:
        base = self.topic.rsplit("/", 1)[0]
        return mqtt_to_amqp(self.topic), mqtt_to_amqp(base + "/status")


def _parameters(b: Any, name: str) -> list[Any]:
    import pika  # type: ignore[import-untyped]

    creds = pika.PlainCredentials(b.username or "guest", b.password or "guest")
    ctx = None
    if b.tls:
        ctx = ssl.create_default_context(cafile=b.tls_ca)
        if b.tls_cert:
            ctx.load_cert_chain(b.tls_cert, b.tls_key)
    out = []
    for host, port in b.amqp_nodes:
        out.append(pika.ConnectionParameters(
            host=host, port=port, virtual_host=b.vhost, credentials=creds, heartbeat=max(5, b.keepalive // 2),
            blocked_connection_timeout=300, connection_attempts=1, socket_timeout=10,
            ssl_options=pika.SSLOptions(ctx, host) if ctx is not None else None,
            client_properties={"connection_name": name}))
    return out


def declare(channel: Any, s: Settings) -> None:
    """The durable quorum queue and its bindings to amq.topic (idempotent)."""
    q = s.broker.queue
    channel.queue_declare(q, durable=True, arguments=dict(QUEUE_ARGS))
    for key in s.bindings:
        channel.queue_bind(q, "amq.topic", routing_key=key)


class AMQPTransport:
    """Consume the release queue in a thread; the interface of MQTTProcess (module docstring)."""

    def __init__(self, settings: Settings, on_messages: Callable[[list[Msg]], None],
                 on_event: Callable[[tuple[Any, ...]], None]) -> None:
        self.s = settings
        self.on_messages = on_messages
        self.on_event = on_event
        self._req: "queue.Queue[tuple[list[tuple[int, int]], list[tuple[str, bytes]]]]" = queue.Queue()
        self._stop = threading.Event()
        self._gen = 0
        self._thread = threading.Thread(target=self._main, name="pansketch-amqp", daemon=True)
        self.acks = AckPublisher(settings, self._stop, on_event)

    @property
    def pid(self) -> Optional[int]:
        return os.getpid()

    def start(self) -> None:
        self.acks.thread.start()
        self._thread.start()

    def acknowledge(self, acks: list[tuple[int, int]], publishes: list[tuple[str, bytes]]) -> None:
        self._req.put((list(acks), list(publishes)))

    def ack(self, mid: int, qos: int) -> None:
        self.acknowledge([(mid, qos)], [])

    def close(self, timeout: float = 10.0) -> Optional[int]:
        deadline = time.monotonic() + timeout
        while (not self._req.empty() or not self.acks.idle()) and self._thread.is_alive() \
                and time.monotonic() < deadline:
            time.sleep(0.02)  # acks already decided: send them before disconnecting
        self._stop.set()
        self._thread.join(max(0.1, deadline - time.monotonic()))
        self.acks.thread.join(max(0.1, deadline - time.monotonic()))
        return 0

    # -- the pika thread ------------------------------------------------------
    def _main(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # pragma: no cover (a bug here must stop the aggregator, not hang it)
            log.exception("AMQP transport failed: %s", exc)
            self.on_event(("exited", 1))  # the aggregator stops (exit 1); nothing unacknowledged is lost

    def _loop(self) -> None:
        import pika.exceptions  # type: ignore[import-untyped]

        b = self.s.broker
        params = _parameters(b, self.s.client_name)
        start = random.randrange(len(params))
        delay = max(0.2, b.reconnect_min_s)
        while not self._stop.is_set():
            order = params[start:] + params[:start]
            start = (start + 1) % len(params)
            try:
                conn = pika.BlockingConnection(order)
            except (pika.exceptions.AMQPError, OSError) as exc:  # OSError: e.g. TLS verification
                if isinstance(exc, pika.exceptions.ProbableAuthenticationError):
                    self.on_event(("refused", "authentication failed"))
                elif isinstance(exc, OSError):
                    log.warning("cannot connect to %s: %s", b.amqp_nodes, exc)
                self.on_event(("connect_failed",))
                self._stop.wait(delay)
                delay = min(b.reconnect_max_s, delay * 2)
                continue
            delay = max(0.2, b.reconnect_min_s)
            self._gen += 1
            why = "closed"
            try:
                self._session(conn)
            except (pika.exceptions.AMQPError, OSError) as exc:
                why = "%s: %s" % (type(exc).__name__, exc)
            finally:
                _close_quietly(conn)
            if not self._stop.is_set():
                self.on_event(("disconnected", why))
                self._stop.wait(0.2)

    def _session(self, conn: Any) -> None:
        gen = self._gen
        ch = conn.channel()
        declare(ch, self.s)
        ch.basic_qos(prefetch_count=self.s.prefetch)
        batch: list[Msg] = []

        def on_message(_ch: Any, method: Any, _props: Any, body: bytes) -> None:
            batch.append(Msg(amqp_to_mqtt(method.routing_key), body, gen << GEN_SHIFT | method.delivery_tag, 1))

        self.on_event(("connected",))
        ch.basic_consume(self.s.broker.queue, on_message, auto_ack=False)
        self.on_event(("subscribed", None))
        while not self._stop.is_set():
            conn.process_data_events(time_limit=0.02)
            if batch:
                got = batch[:]
                del batch[:]
                self.on_messages(got)
            self._flush(ch, gen)

    def _flush(self, ch: Any, gen: int) -> None:
        while True:
            try:
                acks, publishes = self._req.get_nowait()
            except queue.Empty:
                break
            for mid, _qos in acks:
                if mid >> GEN_SHIFT == gen:  # else: its connection died, the broker requeued it
                    ch.basic_ack(mid & ((1 << GEN_SHIFT) - 1))
            if publishes:
                self.acks.put(publishes)


class AckPublisher:
    """Publishes host acks in a thread of its own, on its own connection, with confirms and ``mandatory``.

    Why a second connection: a confirmed publish waits a round trip through
    the device's (mirrored) session queue; done in the consuming thread it
    would stall the deliveries behind it. Acks that queue up here while a
    publish waits are merged per device (one message with all their ``ok``
    and ``bad`` entries, docs/FORMAT.md section 7), so a backlog is at most
    one message per device. A returned (unroutable) or nacked ack, or one
    in flight when the connection died, is published again 1, 2, 4, ... s
    later, at most :data:`ACK_RETRIES` times.
    """

    def __init__(self, settings: Settings, stop: threading.Event,
                 on_event: Callable[[tuple[Any, ...]], None]) -> None:
        self.s = settings
        self.stop = stop
        self.on_event = on_event
        self.q: "queue.Queue[list[tuple[str, bytes]]]" = queue.Queue()
        self.fresh: dict[str, dict[str, Any]] = {}  # routing key -> merged ack document
        self.retry: list[tuple[float, int, str, bytes]] = []  # (when, tries, routing key, body)
        self.returned = 0
        self.published = 0
        self.busy = False
        self.thread = threading.Thread(target=self._main, name="pansketch-amqp-acks", daemon=True)

    def put(self, publishes: list[tuple[str, bytes]]) -> None:
        self.q.put(publishes)

    def idle(self) -> bool:
        return self.q.empty() and not self.fresh and not self.busy and not any(r[1] == 0 for r in self.retry)

    def _main(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # pragma: no cover (a bug here must stop the aggregator, not the acks)
            log.exception("AMQP ack publisher failed: %s", exc)
            self.on_event(("exited", 1))

    def _loop(self) -> None:
        import pika.exceptions  # type: ignore[import-untyped]

        params = _parameters(self.s.broker, self.s.client_name + "-acks")
        start = random.randrange(len(params))
        while not self.stop.is_set():
            order = params[start:] + params[:start]
            start = (start + 1) % len(params)
            try:
                conn = pika.BlockingConnection(order)
            except (pika.exceptions.AMQPError, OSError):
                self.stop.wait(1.0)
                continue
            try:
                pub = conn.channel()
                pub.confirm_delivery()
                while not self.stop.is_set():
                    self._take()
                    self._publish(pub)
                    conn.process_data_events(time_limit=0.02 if self.idle() else 0)
            except (pika.exceptions.AMQPError, OSError) as exc:
                log.warning("host ack connection lost (%s: %s); reconnecting", type(exc).__name__, exc)
            finally:
                _close_quietly(conn)

    def _take(self) -> None:
        while True:
            try:
                publishes = self.q.get_nowait()
            except queue.Empty:
                return
            for topic, body in publishes:
                key = mqtt_to_amqp(topic)
                doc = json.loads(body)
                have = self.fresh.get(key)
                if have is None:
                    self.fresh[key] = doc
                else:
                    for k in ("ok", "bad"):
                        if k in doc:
                            have.setdefault(k, []).extend(doc[k])

    def _publish(self, pub: Any) -> None:
        import pika  # type: ignore[import-untyped]
        import pika.exceptions  # type: ignore[import-untyped]

        now = time.monotonic()
        todo = [(0, k, json.dumps(d, separators=(",", ":")).encode()) for k, d in self.fresh.items()]
        self.fresh = {}
        todo += [(t, k, b) for when, t, k, b in self.retry if when <= now]
        self.retry = [r for r in self.retry if r[0] > now]
        props = pika.BasicProperties(delivery_mode=2, content_type="application/json")
        self.busy = True
        try:
            for i, (tries, key, body) in enumerate(todo):
                try:
                    pub.basic_publish("amq.topic", key, body, props, mandatory=True)
                    self.published += 1
                except (pika.exceptions.UnroutableError, pika.exceptions.NackError):
                    self.returned += 1
                    self._again(now, tries, key, body)
                except BaseException:  # connection lost: this one and the rest again later
                    for t, k, b in todo[i:]:
                        self._again(now, t, k, b)
                    raise
        finally:
            self.busy = False

    def _again(self, now: float, tries: int, key: str, body: bytes) -> None:
        if tries + 1 < ACK_RETRIES:
            self.retry.append((now + 2.0 ** tries, tries + 1, key, body))
        else:
            log.warning("host ack on %s undeliverable after %d tries (the device will re-send)", key, ACK_RETRIES)


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m pansketch.host_tools.ingest.amqp --declare --config host.toml``: declare and bind the release queue."""
    from pansketch.host_tools import hostconfig

    p = argparse.ArgumentParser(prog="python -m pansketch.host_tools.ingest.amqp", description=main.__doc__)
    p.add_argument("--config", required=True)
    p.add_argument("--declare", action="store_true", required=True)
    a = p.parse_args(argv)
    cfg = hostconfig.load_for_command(a.config)
    if cfg is None:
        return 2
    if cfg.broker.kind != "rabbitmq":
        print("pansketch: broker.kind is %r, not 'rabbitmq'" % cfg.broker.kind, file=sys.stderr)
        return 2
    import pika  # type: ignore[import-untyped]
    import pika.exceptions  # type: ignore[import-untyped]

    s = Settings(cfg.broker, cfg.aggregator.topic, 1, "pansketch-declare")
    try:
        conn = pika.BlockingConnection(_parameters(cfg.broker, s.client_name))
    except (pika.exceptions.AMQPError, OSError) as exc:
        print("pansketch: cannot connect to %s: %s" % (", ".join("%s:%d" % n for n in cfg.broker.amqp_nodes),
                                                        exc or type(exc).__name__), file=sys.stderr)
        return 1
    try:
        declare(conn.channel(), s)
    finally:
        conn.close()
    print("queue %s (quorum) bound to amq.topic with %s" % (cfg.broker.queue, " and ".join(s.bindings)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
