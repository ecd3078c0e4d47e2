"""A small MQTT 3.1.1 broker inside the VM, behind the fake sockets.

Parses what the client writes (CONNECT, PUBLISH QoS 0/1, SUBSCRIBE,
PUBACK, PINGREQ, DISCONNECT), answers per fakehw.broker, stands in for the
host (``broker["host_ack"]``: after a release arrives it publishes the
host's acknowledgement ``{"dev":…,"ok":[seq]}`` to the device's ack topic,
docs/FORMAT.md section 7, if the device subscribed to it), and prints every delivered message
as ``@pub <topic> <retain> <hex payload>`` (and a fired last will as
``@will ...``) so the host test can decode what reached the broker.
"""
import fakehw

delivered = []
retained = {}


def _emit(kind, topic, retain, payload):
    if retain:
        retained[topic] = bytes(payload)
    delivered.append((kind, topic, retain, bytes(payload), fakehw.ms))
    print("@%s %s %d %s" % (kind, topic, 1 if retain else 0, fakehw.hexstr(payload)))


class Conn:
    def __init__(self, sock):
        self.buf = bytearray()
        self.rx = bytearray()
        self.dead = False
        self.clean = False
        self.will = None
        self.client_id = None
        self.user = None
        self.password = None
        self.connected = False
        self.subs = []
        self.out_pid = 0

    def drop(self):
        if self.dead:
            return
        self.dead = True
        if self.connected and not self.clean and self.will is not None:
            _emit("will", self.will[0], self.will[2], self.will[1])

    def feed(self, data):
        self.buf.extend(data)
        while True:
            b = self.buf
            if len(b) < 2:
                return
            rl = 0
            sh = 0
            i = 1
            while True:
                if i >= len(b):
                    return
                x = b[i]
                rl |= (x & 0x7F) << sh
                i += 1
                if not x & 0x80:
                    break
                sh += 7
            if len(b) < i + rl:
                return
            pkt = bytes(b[:i + rl])
            self.buf = b[i + rl:]
            self._packet(pkt[0], pkt[i:])

    def _host_ack(self, topic, payload):
        """What the aggregator does once the release is stored: ack its seq."""
        ack = topic[:-len("release")] + "ack"
        if ack not in self.subs:
            return
        i = bytes(payload).find(b"\x63seq")
        h = payload[i + 4]
        if h < 0x18:
            seq = h
        else:
            n = {0x18: 1, 0x19: 2, 0x1A: 4}[h]
            seq = 0
            for b in payload[i + 5:i + 5 + n]:
                seq = seq << 8 | b
        dev = topic.split("/")[-2]
        msg = ('{"dev":"%s","ok":[%d]}' % (dev, seq)).encode()
        self.out_pid = self.out_pid % 65535 + 1
        tb = ack.encode()
        body = bytes([len(tb) >> 8, len(tb) & 0xFF]) + tb + bytes([self.out_pid >> 8, self.out_pid & 0xFF]) + msg
        self.rx.extend(bytes([0x32, len(body)]) + body)  # acks are short: one length byte

    def _str(self, body, o):
        n = body[o] << 8 | body[o + 1]
        return body[o + 2:o + 2 + n], o + 2 + n

    def _packet(self, h, body):
        t = h >> 4
        if fakehw.broker["silent"]:
            return
        if t == 1:  # CONNECT
            proto, o = self._str(body, 0)
            flags = body[o + 1]
            o += 4
            cid, o = self._str(body, o)
            self.client_id = cid.decode()
            if flags & 0x04:
                wt, o = self._str(body, o)
                wm, o = self._str(body, o)
                self.will = (wt.decode(), wm, bool(flags & 0x20))
            if flags & 0x80:
                u, o = self._str(body, o)
                self.user = u.decode()
            if flags & 0x40:
                p, o = self._str(body, o)
                self.password = p.decode()
            rc = fakehw.broker["connack"]
            self.rx.extend(bytes([0x20, 2, 0, rc]))
            if rc == 0:
                self.connected = True
                fakehw.stats["connects"] += 1
            else:
                self.dead = True
        elif t == 3:  # PUBLISH
            qos = (h >> 1) & 3
            retain = h & 1
            topic, o = self._str(body, 0)
            pid = None
            if qos:
                pid = body[o] << 8 | body[o + 1]
                o += 2
            _emit("pub", topic.decode(), retain, body[o:])
            fakehw.stats["pubs"] += 1
            if qos == 1:
                if fakehw.broker["drop_puback"] > 0:
                    fakehw.broker["drop_puback"] -= 1
                else:
                    self.rx.extend(bytes([0x40, 2, pid >> 8, pid & 0xFF]))
            tp = topic.decode()
            if tp.endswith("/release") and fakehw.broker.get("host_ack", True):
                self._host_ack(tp, body[o:])
        elif t == 8:  # SUBSCRIBE
            pid = body[0] << 8 | body[1]
            topic, o = self._str(body, 2)
            self.subs.append(topic.decode())
            self.rx.extend(bytes([0x90, 3, pid >> 8, pid & 0xFF, body[o] & 1]))
        elif t == 4:  # PUBACK of a message we sent
            pass
        elif t == 12:  # PINGREQ
            self.rx.extend(b"\xd0\x00")
        elif t == 14:  # DISCONNECT
            self.clean = True
            self.dead = True
