"""A small MQTT 3.1.1 broker inside the VM, behind the fake sockets.

Parses what the client writes (CONNECT, PUBLISH QoS 0/1, PINGREQ,
DISCONNECT), answers per fakehw.broker, and prints every delivered message
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
        elif t == 12:  # PINGREQ
            self.rx.extend(b"\xd0\x00")
        elif t == 14:  # DISCONNECT
            self.clean = True
            self.dead = True
