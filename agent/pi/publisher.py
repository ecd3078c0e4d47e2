"""Publisher: drain the outbox to the upstream broker, in order, over MQTT.

CPython only (paho-mqtt 2.x, threads): **not** part of the MicroPython
device core; boards use umqtt in firmware/.

Protocol (docs/ARCHITECTURE.md "Safety rules"):

* paho-mqtt 2.x (``CallbackAPIVersion.VERSION2``), MQTT v5, client id =
  device id, optional TLS (CA / client certificate) and username/password;
* releases go to ``<prefix>/<device>/release`` with QoS 1, not retained,
  one at a time in sequence order, each waiting for the broker's PUBACK.
  The file is deleted only when the **host** acknowledges it on
  ``<prefix>/<device>/ack`` (docs/FORMAT.md section 7, agent/acks.py):
  "delivered" means stored, not accepted by a broker. A release without a
  host ack is sent again after ``ack_timeout`` (doubling, plus a random
  extra of up to a quarter, agent/acks.py Resend) and on every reconnect; the
  ack subscription lives in a persistent session (clean start off), so acks
  sent while the device was offline still arrive. A broker that refuses a
  release (MQTT v5 reason code, e.g. "Not authorized" from an ACL) leaves
  it in the outbox and is retried with backoff, so a misconfiguration
  loses nothing;
* the bytes sent are the outbox file's bytes, never re-encoded, so a retry
  after a reconnect or a restart is byte-for-byte the same release (no
  noise is re-drawn; the host stores it idempotently);
* a release whose PUBACK does not come within ``puback_timeout`` is given up
  (it stays in the outbox and is sent again later, under a new message
  id). Its message id is remembered as *abandoned*: a late PUBACK for it is
  discarded, never stored, and any ack recorded before a publish is never
  taken as the ack of that publish. Otherwise, once paho's ids wrap
  (65535 -> 1), a new release reusing the id would find the stale ack and
  be deleted from the outbox although the broker never got it;
* reconnects use paho's capped exponential backoff
  (``reconnect_delay_set(reconnect_min_s, reconnect_max_s)``); a message in
  flight when the connection drops is re-sent by paho after reconnecting;
* ``<prefix>/<device>/status`` carries a retained JSON status, and the last
  will (retained) is ``{"state":"offline"}``. The status holds only
  data-independent facts: sequence numbers, outbox length, parameters.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any, Callable, Optional

import paho.mqtt.client as mqtt
from paho.mqtt.properties import Properties
from paho.mqtt.packettypes import PacketTypes

from pansketch import agent
from pansketch.agent import acks
from pansketch.agent.pi.config import AgentConfig, BrokerConfig
from pansketch.agent.storage import Outbox

OFFLINE = b'{"state":"offline"}'
AGENT_VERSION = agent.__version__


def tcp_no_delay(client: Any, userdata: Any, sock: Any) -> None:
    """TCP_NODELAY on the broker connection: MQTT packets are small and each waits for an answer
    (PUBACK), so Nagle's algorithm only adds a delayed-ACK round (40 ms on Linux) to some of them."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError):
        pass  # not a TCP socket (a websocket wrapper, a test double)


class Publisher:
    """Background thread that delivers ``outbox`` releases to the broker."""

    def __init__(
        self,
        broker: BrokerConfig,
        device: str,
        outbox: Outbox,
        log: Callable[[str], None],
        status_info: Optional[dict[str, Any]] = None,
        clock: Callable[[], float] = time.time,
        ack_timeout: float = 60.0,
        protocol: int = 5,
        next_seq: Optional[Callable[[], int]] = None,
        puback_timeout: float = 30.0,
        session_expiry_s: int = 7 * 86400,
    ) -> None:
        self.broker = broker
        self.device = device
        self.outbox = outbox
        self.log = log
        self.status_info = dict(status_info or {})
        self.clock = clock
        self.ack_timeout = ack_timeout  # host ack: re-send after this long
        self.puback_timeout = puback_timeout  # broker PUBACK
        self.session_expiry_s = session_expiry_s
        self.next_seq = next_seq
        self.resend = acks.Resend(int(ack_timeout * 1000), acks.system_rand())  # jittered re-sends
        self.protocol = protocol  # 5 (default) or 4 = MQTT 3.1.1 (brokers without v5, e.g. the demo's amqtt)
        self.release_topic = "%s/%s/release" % (broker.topic_prefix, device)
        self.status_topic = "%s/%s/status" % (broker.topic_prefix, device)
        self.ack_topic = "%s/%s/ack" % (broker.topic_prefix, device)
        self._status_dirty = True
        self._status_sent = -1e9
        self._cond = threading.Condition()
        self._acks: dict[int, tuple[int, Any]] = {}  # mid -> (arrival serial, reason code)
        self._ack_serial = 0  # counts PUBACKs received, to tell stale acks from fresh ones
        self._abandoned: set[int] = set()  # mids given up on; their late PUBACKs are discarded
        self._connected = False
        self._generation = 0  # bumps on each successful connection
        self._wake = threading.Event()
        self._acked = threading.Event()  # set by every host ack (wait_delivered re-reads the outbox)
        self._subscribed = threading.Event()  # the broker granted this connection's ack subscription
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.last_acked: Optional[int] = None
        self.last_error: Optional[str] = None
        self._fail_logged = -1e9
        self.client = self._make_client()

    @classmethod
    def from_config(cls, cfg: AgentConfig, outbox: Outbox, log: Callable[[str], None],
                    clock: Callable[[], float] = time.time) -> "Publisher":
        p = cfg.params
        info = {
            "mode": p.mode, "kind": p.kind, "d": p.d, "w": p.w, "win_s": p.window_s, "ep_s": p.epoch_s,
            "mech": p.mechanism, "budget": "%d/%d" % p.budget,
        }
        return cls(cfg.broker, p.device, outbox, log, info, clock, ack_timeout=cfg.broker.ack_timeout_s,
                   protocol=4 if getattr(cfg.broker, "mqtt_version", "5") == "3.1.1" else 5)

    # -- paho plumbing ---------------------------------------------------
    def _make_client(self) -> mqtt.Client:
        b = self.broker
        proto = mqtt.MQTTv5 if self.protocol == 5 else mqtt.MQTTv311
        if self.protocol == 5:
            c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=self.device, protocol=proto)
        else:  # MQTT 3.1.1: the persistent session is chosen at construction
            c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=self.device, protocol=proto,
                            clean_session=False)
        if b.username is not None:
            c.username_pw_set(b.username, b.password)
        if b.tls is not None:
            c.tls_set(ca_certs=b.tls.ca, certfile=b.tls.cert, keyfile=b.tls.key)
        c.will_set(self.status_topic, OFFLINE, qos=1, retain=True)
        c.reconnect_delay_set(max(1, int(round(b.reconnect_min_s))), max(1, int(round(b.reconnect_max_s))))
        c.on_connect = self._on_connect
        c.on_disconnect = self._on_disconnect
        c.on_publish = self._on_publish
        c.on_message = self._on_message
        c.on_subscribe = self._on_subscribe
        c.on_connect_fail = self._on_connect_fail
        c.on_socket_open = tcp_no_delay
        return c

    def _on_connect_fail(self, client: Any, userdata: Any) -> None:
        self.last_error = "cannot connect to %s:%d" % (self.broker.host, self.broker.port)
        now = time.monotonic()
        if now - self._fail_logged >= 60:
            self._fail_logged = now
            self.log("cannot connect to broker %s:%d; retrying with backoff (up to %g s apart)"
                     % (self.broker.host, self.broker.port, self.broker.reconnect_max_s))

    def _on_connect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any = None) -> None:
        if rc.is_failure:
            self.last_error = "broker refused the connection: %s" % rc
            self.log("broker %s:%d refused the connection: %s (retrying with backoff)"
                     % (self.broker.host, self.broker.port, rc))
            return
        with self._cond:
            self._connected = True
            self._generation += 1
            self._cond.notify_all()
        self.last_error = None
        self._fail_logged = -1e9
        # every connection: (re)subscribe the host's acks (the session keeps
        # the subscription too; subscribing again is harmless)
        self._subscribed.clear()
        client.subscribe(self.ack_topic, qos=1)
        self.log("connected to %s:%d" % (self.broker.host, self.broker.port))
        self._wake.set()

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        """A host acknowledgement (paho's network thread)."""
        if msg.topic != self.ack_topic:
            return
        try:
            ok, bad = acks.parse(msg.payload, self.device)
        except acks.AckError as exc:
            self.log("ignoring a malformed host ack: %s" % exc)
            return
        # the facts first, then the outbox: ``feed`` exits as soon as the outbox is empty, and its
        # final status must already carry this ack (acks.apply's top is max(ok))
        top = max(ok) if ok else None
        with self._cond:
            if top is not None and (self.last_acked is None or top > self.last_acked):
                self.last_acked = top
            self._status_dirty = True
        acks.apply(self.outbox, ok, bad, self.log)
        with self._cond:
            self._status_dirty = True  # pending and rejected changed too
        self._wake.set()
        self._acked.set()

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, codes: Any, props: Any = None) -> None:
        if codes and all(not getattr(c, "is_failure", False) for c in codes):
            self._subscribed.set()

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any = None) -> None:
        with self._cond:
            was = self._connected
            self._connected = False
            self._cond.notify_all()
        if was and not self._stop.is_set():
            self.last_error = "disconnected: %s" % rc
            self.log("disconnected from broker (%s); reconnecting with backoff" % rc)

    def _on_publish(self, client: Any, userdata: Any, mid: int, rc: Any, props: Any = None) -> None:
        with self._cond:
            if mid in self._abandoned:
                self._abandoned.discard(mid)  # late PUBACK of a message given up on
                return
            self._ack_serial += 1
            self._acks[mid] = (self._ack_serial, rc)
            self._cond.notify_all()

    def _abandon(self, mid: int) -> None:
        """Give up waiting for ``mid``: forget any ack and discard a late one."""
        with self._cond:
            if self._acks.pop(mid, None) is None:
                self._abandoned.add(mid)

    def _publish(self, topic: str, payload: bytes, retain: bool, props: Any) -> tuple[Optional[int], str]:
        """paho publish QoS 1; (mid, "") or (None, reason) when paho did not queue it."""
        with self._cond:
            mark = self._ack_serial
        info = self.client.publish(topic, payload, qos=1, retain=retain, properties=props)
        if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
            # e.g. MQTT_ERR_QUEUE_SIZE: paho refuses a mid still in its queue
            return None, "client did not queue the message: %s" % mqtt.error_string(info.rc)
        mid = info.mid
        with self._cond:
            # paho queued ``mid``, so an earlier message with this id is no longer in
            # its queue: any ack recorded for it before this publish is stale, and
            # an abandoned mark for it is obsolete.
            got = self._acks.get(mid)
            if got is not None and got[0] <= mark:
                del self._acks[mid]
            self._abandoned.discard(mid)
        return mid, ""

    @property
    def connected(self) -> bool:
        return self._connected

    def wait_subscribed(self, timeout: float) -> bool:
        """Until the broker has granted this connection's subscription to the host's acks (False after
        ``timeout`` s): from then on an ack the host sends reaches this device."""
        return self._subscribed.wait(timeout)

    # -- lifecycle -------------------------------------------------------
    def start(self) -> None:
        b = self.broker
        if self.protocol == 5:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = self.session_expiry_s
            self.client.connect_async(b.host, b.port, keepalive=b.keepalive, clean_start=False, properties=props)
        else:
            self.client.connect_async(b.host, b.port, keepalive=b.keepalive)
        self.client.loop_start()
        self._thread = threading.Thread(target=self._main, name="publisher", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """A new release is in the outbox."""
        self._wake.set()

    def stop(self, timeout: float = 5.0) -> None:
        """Report the last facts if they changed, say offline (retained), disconnect,
        stop the threads. The outbox stays."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._connected:
            # the drain thread may have stopped before reporting the last acknowledgements
            # (feed stops as soon as the outbox is empty): the final facts first, then offline.
            # Always, not only when marked dirty: the paho thread may still be between deleting
            # the last acknowledged file and marking the status dirty.
            for doc in [self.status(), OFFLINE]:
                try:
                    mid, _ = self._publish(self.status_topic, doc, True, None)
                    if mid is not None and self._wait_mid(mid, min(timeout, 2.0), ignore_stop=True) is None:
                        self._abandon(mid)
                except Exception:
                    pass
        try:
            self.client.disconnect()
        except Exception:
            pass
        self.client.loop_stop()

    def wait_delivered(self, timeout: Optional[float], stop: Optional[threading.Event] = None) -> bool:
        """Block until the outbox is empty (the host stored every release), or timeout / ``stop``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._wake.set()
        while True:
            self._acked.clear()  # before the listing: an ack after it wakes the wait below at once
            if not self.outbox.pending():
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            if stop is not None and stop.is_set():
                return False
            self._acked.wait(0.05)  # woken by the ack that empties the outbox (feed exits right after)

    # -- drain loop ------------------------------------------------------
    def _wait_mid(self, mid: int, timeout: float, ignore_stop: bool = False) -> Any:
        """The PUBACK reason code for ``mid``; None on timeout or stop."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while mid not in self._acks:
                if not ignore_stop and self._stop.is_set():
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, 0.25))
            return self._acks.pop(mid)[1]

    def _wait_connected(self) -> Optional[int]:
        with self._cond:
            while not self._connected and not self._stop.is_set():
                self._cond.wait(0.25)
            return self._generation if self._connected else None

    def _send(self, topic: str, payload: bytes, retain: bool = False) -> tuple[bool, str]:
        """Publish QoS 1 and wait for PUBACK across reconnects. (ok, reason)."""
        props = None
        if not retain and self.protocol == 5:
            props = Properties(PacketTypes.PUBLISH)
            props.PayloadFormatIndicator = 0
            props.ContentType = "application/cbor"
        mid, why = self._publish(topic, payload, retain, props)
        if mid is None:
            return False, why
        # paho keeps QoS 1 messages queued over a disconnect and re-sends them
        # after reconnecting, so we keep waiting on the same mid.
        start = time.monotonic()
        while not self._stop.is_set():
            rc = self._wait_mid(mid, min(1.0, self.puback_timeout))
            if rc is not None:
                if getattr(rc, "is_failure", False):
                    return False, str(rc)
                return True, "ok"
            if self._connected and time.monotonic() - start > self.puback_timeout:
                self._abandon(mid)
                return False, "no PUBACK within %g s" % self.puback_timeout
        self._abandon(mid)
        return False, "stopping"

    def status(self, state: str = "online") -> bytes:
        """Retained status (docs/FORMAT.md section 3): sequence numbers and
        outbox facts only, never event counts."""
        pend = self.outbox.pending()
        doc = {
            "state": state,
            "dev": self.device,
            "ts": int(self.clock()),
            "acked_seq": self.last_acked,
            "pending": len(pend),
            "oldest_pending": pend[0] if pend else None,
            "rejected": self.outbox.rejected(),
            "version": AGENT_VERSION,
        }
        if self.next_seq is not None:
            doc["next_seq"] = self.next_seq()
        doc.update(self.status_info)
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    STATUS_EVERY_S = 60.0

    def _send_status(self) -> bool:
        """Publish the retained status; True once the broker has it.

        The dirty mark is cleared *before* the facts are read: an acknowledgement
        arriving while this status is in flight marks it dirty again, so the newer
        facts are sent next (clearing it after the PUBACK lost them, and ``feed``
        could exit with the last ``acked_seq`` never reported)."""
        with self._cond:
            self._status_dirty = False
        ok, _ = self._send(self.status_topic, self.status(), retain=True)
        if ok:
            self._status_sent = time.monotonic()
        else:
            with self._cond:
                self._status_dirty = True
        return ok

    def _main(self) -> None:
        backoff = self.broker.reconnect_min_s
        status_gen = -1
        while not self._stop.is_set():
            gen = self._wait_connected()
            if gen is None:
                break
            if gen != status_gen:
                self.resend.reset()  # every reconnect: re-send all unacknowledged releases
                if self._send_status():
                    status_gen = gen
            refused = False
            pend = self.outbox.pending()
            self.resend.forget_except(pend)
            for seq in pend:
                if self._stop.is_set() or not self._connected:
                    break
                now_ms = int(time.monotonic() * 1000)
                if not self.resend.due(seq, now_ms):
                    continue
                try:
                    data = self.outbox.read(seq)
                except OSError as exc:
                    if not self.outbox.has(seq):
                        continue  # acknowledged meanwhile
                    self.log("cannot read release %d from the outbox: %s" % (seq, exc))
                    refused = True
                    break
                ok, why = self._send(self.release_topic, data)
                if ok:
                    self.resend.mark(seq, int(time.monotonic() * 1000))
                    backoff = self.broker.reconnect_min_s
                    continue
                if why != "stopping":
                    self.last_error = "release %d not accepted: %s" % (seq, why)
                    self.log("broker did not accept release %d (%s); it stays in the outbox, retry in %.0f s"
                             % (seq, why, backoff))
                    refused = True
                break
            if refused:
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.broker.reconnect_max_s)
                continue
            pend = self.outbox.pending()
            since = time.monotonic() - self._status_sent
            if self._connected and ((self._status_dirty and not pend) or
                                    (pend and since >= self.STATUS_EVERY_S)):
                self._send_status()
            wait = 5.0
            nd = self.resend.next_due(pend, int(time.monotonic() * 1000))
            if nd is not None:
                wait = min(wait, max(0.05, nd / 1000.0))
            self._wake.wait(wait)
            self._wake.clear()
