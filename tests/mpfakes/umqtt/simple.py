"""Fake ``umqtt.simple`` with the public API of micropython-lib's module.

Same constructor, attributes (``sock``, ``pid``, ``ssl``, ``lw_*``) and
methods (``connect``, ``disconnect``, ``ping``, ``publish``,
``set_last_will``, ``wait_msg``, ``check_msg``, ``_send_str``), speaking
real MQTT 3.1.1 bytes to the fake broker through the module-level
``socket`` (the fake ``usocket``), and -- on purpose -- with the library's
behaviour that matters here: ``wait_msg`` switches the socket to blocking
mode, so a QoS 1 ``publish`` whose PUBACK never comes waits forever.
"""
import struct

import usocket as socket


class MQTTException(Exception):
    pass


class MQTTClient:
    def __init__(self, client_id, server, port=0, user=None, password=None, keepalive=0, ssl=None):
        if port == 0:
            port = 8883 if ssl else 1883
        self.client_id = client_id
        self.sock = None
        self.server = server
        self.port = port
        self.ssl = ssl
        self.pid = 0
        self.cb = None
        self.user = user
        self.pswd = password
        self.keepalive = keepalive
        self.lw_topic = None
        self.lw_msg = None
        self.lw_qos = 0
        self.lw_retain = False

    def _send_str(self, s):
        self.sock.write(struct.pack("!H", len(s)))
        self.sock.write(s)

    def set_last_will(self, topic, msg, retain=False, qos=0):
        self.lw_topic = topic
        self.lw_msg = msg
        self.lw_qos = qos
        self.lw_retain = retain

    def connect(self, clean_session=True, timeout=None):
        self.sock = socket.socket()
        self.sock.settimeout(timeout)  # as umqtt.simple 1.8.0: None = blocking without timeout
        addr = socket.getaddrinfo(self.server, self.port)[0][-1]
        self.sock.connect(addr)
        if self.ssl:
            self.sock = self.ssl.wrap_socket(self.sock, server_hostname=self.server)
        flags = clean_session << 1
        cid = self.client_id.encode() if isinstance(self.client_id, str) else self.client_id
        payload = bytearray(struct.pack("!H", len(cid)) + cid)
        if self.lw_topic:
            flags |= 0x4 | (self.lw_qos & 1) << 3 | (self.lw_qos & 2) << 3 | self.lw_retain << 5
            for s in (self.lw_topic, self.lw_msg):
                s = s.encode() if isinstance(s, str) else s
                payload += struct.pack("!H", len(s)) + s
        if self.user:
            flags |= 0xC0
            for s in (self.user, self.pswd or ""):
                s = s.encode() if isinstance(s, str) else s
                payload += struct.pack("!H", len(s)) + s
        var = b"\x00\x04MQTT\x04" + bytes([flags]) + struct.pack("!H", self.keepalive)
        body = var + payload
        self.sock.write(bytes([0x10]) + _varint(len(body)) + body)
        resp = self.sock.read(4)
        assert resp[0] == 0x20 and resp[1] == 0x02
        if resp[3] != 0:
            raise MQTTException(resp[3])
        return resp[2] & 1

    def set_callback(self, f):
        self.cb = f

    def subscribe(self, topic, qos=0):
        assert self.cb is not None, "Subscribe callback is not set"
        self.pid += 1
        pid = self.pid
        t = topic.encode() if isinstance(topic, str) else topic
        body = struct.pack("!H", pid) + struct.pack("!H", len(t)) + t + bytes([qos])
        self.sock.write(bytes([0x82]) + _varint(len(body)) + body)
        while 1:
            op = self.wait_msg()
            if op == 0x90:
                resp = self.sock.read(4)
                assert (resp[1] << 8 | resp[2]) == pid
                if resp[3] == 0x80:
                    raise MQTTException(resp[3])
                return

    def disconnect(self):
        self.sock.write(b"\xe0\0")
        self.sock.close()

    def ping(self):
        self.sock.write(b"\xc0\0")

    def publish(self, topic, msg, retain=False, qos=0):
        pkt = bytearray(b"\x30\0\0\0")
        pkt[0] |= qos << 1 | retain
        sz = 2 + len(topic) + len(msg)
        if qos > 0:
            sz += 2
        i = 1
        while sz > 0x7F:
            pkt[i] = (sz & 0x7F) | 0x80
            sz >>= 7
            i += 1
        pkt[i] = sz
        self.sock.write(pkt, i + 1)
        self._send_str(topic)
        if qos > 0:
            self.pid += 1
            pid = self.pid
            struct.pack_into("!H", pkt, 0, pid)
            self.sock.write(pkt, 2)
        self.sock.write(msg)
        if qos == 1:
            while 1:
                op = self.wait_msg()
                if op == 0x40:
                    sz = self.sock.read(1)
                    assert sz == b"\x02"
                    rcv_pid = self.sock.read(2)
                    rcv_pid = rcv_pid[0] << 8 | rcv_pid[1]
                    if pid == rcv_pid:
                        return

    def wait_msg(self):
        res = self.sock.read(1)
        self.sock.setblocking(True)
        if res is None:
            return None
        if res == b"":
            raise OSError(-1)
        if res == b"\xd0":
            self.sock.read(1)
            return None
        return res[0]

    def check_msg(self):
        self.sock.setblocking(False)
        return self.wait_msg()


def _varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)
