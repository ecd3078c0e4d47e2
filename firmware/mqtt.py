"""Publishing releases with micropython-lib's ``umqtt.simple``: QoS 1, in
order, with timeouts everywhere, TLS where the port has it.

Topics are the Pi agent's (agent/pi/publisher.py): releases go to
``<prefix>/<device>/release`` (QoS 1, not retained), a retained JSON status
to ``<prefix>/<device>/status``, and the last will on the status topic is
``{"state":"offline"}`` (retained).

End to end (docs/FORMAT.md section 7, agent/acks.py, the same code as the
Pi agent): a release leaves the outbox only when the **host** acknowledges
it on ``<prefix>/<device>/ack``, not on the broker's PUBACK. The board
subscribes to that topic with QoS 1 in a persistent session (clean session
off), reads acknowledgements without blocking between main-loop steps
(:meth:`Client.poll`) and while it waits for a PUBACK, and re-sends every
unacknowledged release after ``mqtt.ack_timeout_s`` and after reconnecting.

Why ``umqtt.simple`` and not ``umqtt.robust``: robust's ``publish`` and
``reconnect`` loop forever until the broker answers, which would stop the
main loop -- no counting, no watchdog feeding -- for as long as the broker
is down. Reconnection with capped exponential backoff is done here instead,
one non-blocking attempt per main-loop step.

Traps in ``umqtt.simple`` and how they are avoided:

* *A QoS 1 publish can wait forever for its PUBACK*: umqtt's ``wait_msg``
  calls ``sock.setblocking(True)``, which removes any socket timeout, and
  ``publish`` loops on it until the PUBACK arrives. :class:`Client`
  replaces ``wait_msg`` with a version that keeps the timeout, and every
  socket umqtt creates gets ``timeout_s`` (through :class:`_SocketModule`,
  which stands in for the socket module inside umqtt.simple), so
  connecting, the TLS handshake, writing and waiting for PUBACK all end
  after at most ``timeout_s`` per operation. The PUBACK wait also has an
  overall deadline. A timeout means "not delivered": the connection is
  dropped, the release stays in the outbox and is sent again, byte for
  byte, after the backoff (the host stores duplicates idempotently).
* *Publishing a release must not need a second copy in RAM*: the release
  file is streamed from flash to the socket through a preallocated
  512-byte buffer (:meth:`Client.publish_file`), feeding the watchdog
  between chunks. Heap per sketch cell stays at 8 bytes (state + release
  buffer of the Recorder).
* *Packet ids*: umqtt never wraps ``pid``; it is wrapped here before 65535.

TLS uses the port's ``ssl.SSLContext`` (needs umqtt.simple >= 1.4, which
takes an SSLContext as ``ssl=``). On ESP32 mbedTLS takes ~20 KB *outside*
the Python heap per connection; on the Pico W its buffers come from the
Python heap; ESP8266's axTLS cannot verify certificates (see
docs/FIRMWARE.md and firmware/memory.py).
"""

import json

from pansketch.agent import acks
from pansketch.firmware import clock

try:
    from umqtt import simple
except ImportError:  # reported by the app as a clear start-up error
    simple = None

OFFLINE = b'{"state":"offline"}'
PUBACK_DEADLINE_FACTOR = 2  # overall PUBACK wait = factor * timeout_s

_CONNACK = {
    1: "unacceptable protocol version",
    2: "client id rejected",
    3: "server unavailable",
    4: "bad user name or password",
    5: "not authorized",
}


class _SocketModule:
    """Replaces ``socket`` inside umqtt.simple: every socket gets a timeout."""

    def __init__(self, mod, timeout_s):
        self.mod = mod
        self.timeout_s = timeout_s

    def socket(self, *args):
        s = self.mod.socket(*args)
        s.settimeout(self.timeout_s)
        self.last = s  # the TCP socket (under TLS too): Client.poll sets its timeout
        return s

    def getaddrinfo(self, *args):
        return self.mod.getaddrinfo(*args)


def _install_timeouts(timeout_s):
    cur = simple.socket
    if isinstance(cur, _SocketModule):
        cur.timeout_s = timeout_s
    else:
        simple.socket = _SocketModule(cur, timeout_s)


class _TLS:
    """Passed as umqtt's ``ssl=``: wraps with our SSLContext and SNI name."""

    def __init__(self, ctx, server_hostname):
        self.ctx = ctx
        self.server_hostname = server_hostname

    def wrap_socket(self, sock, server_hostname=None):
        try:
            return self.ctx.wrap_socket(sock, server_hostname=self.server_hostname)
        except ValueError:  # what MicroPython's tls raises when the certificate does not verify
            raise OSError(-0x2700, "broker certificate not verified with mqtt.tls.ca")


def _file(path):
    f = open(path, "rb")
    b = f.read()
    f.close()
    return b


def describe(exc):
    """A short human reason for a failed MQTT operation."""
    if simple is not None and isinstance(exc, simple.MQTTException):
        rc = exc.args[0] if exc.args else None
        return "broker refused the connection: %s (CONNACK %r)" % (_CONNACK.get(rc, "code %r" % (rc,)), rc)
    if isinstance(exc, OSError):
        code = exc.args[0] if exc.args else None
        if code in (110, 116, 11):  # ETIMEDOUT (rp2/ESP32 numbering), EAGAIN
            return "timed out"
        if isinstance(code, int) and code <= -0x1000:  # Mbed TLS: OSError(code, text)
            return "TLS error -0x%04x %s" % (-code, exc.args[-1])
        return "network error %r" % (code,)
    if isinstance(exc, MemoryError):
        return "out of memory"
    return "%s %s" % (type(exc).__name__, exc)


if simple is not None:

    class Client(simple.MQTTClient):
        """umqtt.simple's client with bounded waits and streamed file publishing."""

        deadline_ms = 6000
        feed = None  # called between chunks / waits (watchdog)
        timeout_s = 3
        raw = None  # the TCP socket under self.sock
        max_in = 1024  # bytes: an incoming PUBLISH (a host ack) larger than this is skipped

        def _pid(self):
            if self.pid >= 65535:
                self.pid = 0
            self.pid += 1
            return self.pid

        def wait_msg(self):
            """One packet header from the broker; keeps the socket timeout.

            Returns the packet type byte, or None for a PINGRESP. A PUBLISH
            (a host ack on our one subscription) is handed to the callback,
            PUBACKed if QoS 1, and its type byte returned.
            """
            res = self.sock.read(1)
            if res is None:
                raise OSError(110)  # ETIMEDOUT
            return self._dispatch(res)

        def _dispatch(self, res):
            if res == b"":
                raise OSError(-1)  # connection closed by the broker
            if res == b"\xd0":  # PINGRESP
                self.sock.read(1)
                return None
            op = res[0]
            if op & 0xF0 == 0x30:
                self._incoming(op)
            return op

        def _read(self, n):
            b = self.sock.read(n)
            if b is None or len(b) != n:
                raise OSError(110)
            return b

        def _incoming(self, op):
            sz = 0
            sh = 0
            while True:
                b = self._read(1)[0]
                sz |= (b & 0x7F) << sh
                if not b & 0x80:
                    break
                sh += 7
            t = self._read(2)
            tlen = t[0] << 8 | t[1]
            topic = self._read(tlen)
            sz -= tlen + 2
            pid = 0
            if op & 6:
                p = self._read(2)
                pid = p[0] << 8 | p[1]
                sz -= 2
            if sz > self.max_in:
                while sz > 0:  # skip it (not an ack of ours), keep the stream in sync
                    sz -= len(self._read(min(sz, 64)))
                msg = None
            else:
                msg = self._read(sz) if sz else b""
            if op & 6 == 2:
                self.sock.write(b"\x40\x02" + bytes([pid >> 8, pid & 0xFF]))
            if msg is not None and self.cb is not None:
                self.cb(topic, msg)

        def poll(self, most=8):
            """Handle packets already waiting (host acks) without blocking.

            The timeout is switched on the TCP socket (``raw``): MicroPython's
            SSL socket has no ``settimeout``, and its timeout must be restored.
            """
            raw = self.raw
            for _ in range(most):
                raw.settimeout(0)
                try:
                    res = self.sock.read(1)
                except OSError as exc:
                    if exc.args and exc.args[0] in (11, 110, 116):  # EAGAIN / ETIMEDOUT: nothing yet
                        res = None
                    else:
                        raise
                finally:
                    raw.settimeout(self.timeout_s)
                if res is None:
                    return
                self._dispatch(res)

        def publish(self, topic, msg, retain=False, qos=0):
            if self.pid >= 65535:
                self.pid = 0
            return simple.MQTTClient.publish(self, topic, msg, retain, qos)

        def await_puback(self, pid):
            deadline = clock.ticks_add(clock.ticks_ms(), self.deadline_ms)
            while True:
                op = self.wait_msg()
                if op == 0x40:
                    sz = self.sock.read(1)
                    got = self.sock.read(2)
                    if sz != b"\x02" or got is None or len(got) != 2:
                        raise OSError(-3)
                    if (got[0] << 8 | got[1]) == pid:
                        return
                if self.feed is not None:
                    self.feed()
                if clock.ticks_diff(deadline, clock.ticks_ms()) <= 0:
                    raise OSError(110)

        def publish_file(self, topic, path, size, buf):
            """QoS 1 PUBLISH of a file's bytes, streamed through ``buf``; waits for PUBACK."""
            sock = self.sock
            hdr = bytearray(6)
            hdr[0] = 0x32  # PUBLISH, QoS 1, not retained
            sz = 2 + len(topic) + 2 + size
            i = 1
            while sz > 0x7F:
                hdr[i] = (sz & 0x7F) | 0x80
                sz >>= 7
                i += 1
            hdr[i] = sz
            sock.write(hdr, i + 1)
            self._send_str(topic)
            pid = self._pid()
            hdr[0] = pid >> 8
            hdr[1] = pid & 0xFF
            sock.write(hdr, 2)
            f = open(path, "rb")
            try:
                left = size
                while left > 0:
                    n = f.readinto(buf)
                    if not n:
                        raise OSError(5)  # EIO: file shorter than its stat size
                    if n > left:
                        n = left
                    sock.write(buf, n)
                    left -= n
                    if self.feed is not None:
                        self.feed()
            finally:
                f.close()
            self.await_puback(pid)


class Link:
    """The broker session of the board: connect/backoff, status, outbox drain."""

    def __init__(self, cfg, log, feed=None):
        self.cfg = cfg
        self.log = log
        self.feed = feed
        prefix = cfg.topic_prefix
        self.release_topic = ("%s/%s/release" % (prefix, cfg.device)).encode()
        self.status_topic = ("%s/%s/status" % (prefix, cfg.device)).encode()
        self.ack_topic = ("%s/%s/ack" % (prefix, cfg.device)).encode()
        self.resend = acks.Resend(cfg.ack_timeout_s * 1000, acks.system_rand())  # jittered re-sends
        self.outbox = None  # set by service(): where host acks apply
        self.client = None
        self.buf = bytearray(512)
        self.min_delay_ms = 1000
        self.delay_ms = self.min_delay_ms
        self.next_ms = 0
        self.status_dirty = True
        self.last_acked = None
        self.last_io_ms = 0
        self.tls = None
        self.connects = 0
        self.failures = 0
        self.published = 0

    @property
    def up(self):
        return self.client is not None

    # -- connection --------------------------------------------------------
    def _tls_wrapper(self):
        """The TLS context, built once: ``SSLContext(PROTOCOL_TLS_CLIENT)``, ``CERT_REQUIRED`` with the
        CA file's bytes (DER, or PEM) as ``cadata``, and the client certificate if configured."""
        if self.tls is None:
            import ssl

            c = self.cfg
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.verify_mode = ssl.CERT_REQUIRED if c.tls_verify else ssl.CERT_NONE
            if c.tls_verify:
                ctx.load_verify_locations(cadata=_file(c.tls_ca))
            if c.tls_cert is not None:
                ctx.load_cert_chain(_file(c.tls_cert), _file(c.tls_key))
            self.tls = _TLS(ctx, c.tls_server_hostname)
        return self.tls

    def connect(self):
        c = self.cfg
        if simple is None:
            raise ImportError("umqtt.simple is not installed (deploy/flash.sh runs: mpremote mip install umqtt.simple)")
        _install_timeouts(c.mqtt_timeout_s)
        ssl = self._tls_wrapper() if c.tls else None
        cl = Client(c.device, c.mqtt_host, port=c.mqtt_port, user=c.mqtt_user, password=c.mqtt_password,
                    keepalive=c.keepalive_s, ssl=ssl)
        cl.deadline_ms = PUBACK_DEADLINE_FACTOR * c.mqtt_timeout_s * 1000
        cl.timeout_s = c.mqtt_timeout_s
        cl.feed = self.feed
        cl.set_last_will(self.status_topic, OFFLINE, retain=True, qos=1)
        cl.set_callback(self._on_msg)
        try:
            try:
                # umqtt.simple (1.8.0, what mip installs) calls sock.settimeout(timeout) in connect():
                # without the argument it sets None (blocking, no timeout), and a lost CONNACK,
                # SUBACK or PUBACK would hang the board until the watchdog resets it.
                # clean_session=False: the broker keeps acks sent while we are away
                cl.connect(clean_session=False, timeout=c.mqtt_timeout_s)
            except TypeError:  # older umqtt.simple: no timeout argument; the socket keeps ours
                _close(cl)
                cl.connect(clean_session=False)
            cl.raw = simple.socket.last
            cl.subscribe(self.ack_topic, qos=1)
        except BaseException:
            _close(cl)
            raise
        self.client = cl
        self.connects += 1
        self.resend.reset()  # every reconnect: re-send what the host has not acknowledged

    def _on_msg(self, topic, msg):
        if topic != self.ack_topic or self.outbox is None:
            return
        try:
            ok, bad = acks.parse(msg, self.cfg.device)
        except acks.AckError as exc:
            self.log("mqtt: ignoring a malformed host ack: %s" % exc)
            return
        top = acks.apply(self.outbox, ok, bad, self.log)
        if top is not None and (self.last_acked is None or top > self.last_acked):
            self.last_acked = top
        self.status_dirty = True

    def drop(self, reason=None, now_ms=0):
        """Close the session (no DISCONNECT: the broker publishes the last will)."""
        cl = self.client
        self.client = None
        if cl is not None:
            _close(cl)
        if reason is not None:
            self.failures += 1
            self.next_ms = now_ms + self.delay_ms
            self.log("mqtt: %s; retrying in %d s" % (reason, self.delay_ms // 1000))
            self.delay_ms = min(self.delay_ms * 2, self.cfg.mqtt_retry_max_s * 1000)

    # -- work --------------------------------------------------------------
    def service(self, app, now_ms):
        """One bounded unit of broker work; returns True if more is waiting."""
        if self.client is None:
            if now_ms < self.next_ms:
                return False
            try:
                self.connect()
            except Exception as exc:
                self.drop("cannot connect to %s:%d: %s" % (self.cfg.mqtt_host, self.cfg.mqtt_port, describe(exc)),
                          now_ms)
                return False
            self.log("mqtt: connected to %s:%d%s" % (self.cfg.mqtt_host, self.cfg.mqtt_port,
                                                      " (TLS)" if self.cfg.tls else ""))
            self.status_dirty = True
            self.last_io_ms = now_ms
            app.outbox_hint = True
            fresh = True
        else:
            fresh = False
        step = "ack"
        try:
            outbox = app.rec.outbox
            self.outbox = outbox
            self.client.poll()  # host acks that arrived since the last step
            pend = outbox.pending() if app.outbox_hint else None
            if not pend:
                app.outbox_hint = False
            step = "status"
            if self.status_dirty and (fresh or not pend):  # "online" first, then after draining
                self.client.publish(self.status_topic, app.status_json(), retain=True, qos=1)
                self.status_dirty = False
                self.last_io_ms = now_ms
            step = "release"
            if pend:
                self.resend.forget_except(pend)
                for seq in pend:
                    if not self.resend.due(seq, now_ms):
                        continue
                    path = outbox.path(seq)
                    import os

                    size = os.stat(path)[6]
                    self.client.publish_file(self.release_topic, path, size, self.buf)
                    self.resend.mark(seq, now_ms)  # deleted only when the host acknowledges it
                    self.published += 1
                    self.delay_ms = self.min_delay_ms
                    self.last_io_ms = now_ms
                    return True
            step = "ping"
            ka = self.cfg.keepalive_s * 1000
            if ka and now_ms - self.last_io_ms >= ka // 2:
                self.client.ping()
                if self.client.wait_msg() is not None:  # must be the PINGRESP
                    raise OSError(-4)
                self.last_io_ms = now_ms
        except Exception as exc:
            self.drop("%s not delivered: %s" % (step, describe(exc)), now_ms)
            return False
        return self.status_dirty


def _close(cl):
    try:
        if cl.sock is not None:
            cl.sock.close()
    except Exception:
        pass


def status_json(fields):
    """Compact JSON object with sorted keys (as the Pi agent's json.dumps(sort_keys=True))."""
    items = sorted(fields)
    out = []
    for k, v in items:
        out.append('"%s":%s' % (k, json.dumps(v)))
    return ("{" + ",".join(out) + "}").encode()
