"""Fake socket module (what the fake umqtt.simple imports as ``socket``).

A socket talks to the in-VM fake broker (fakebroker.py). Reads honour the
socket's timeout: with data missing, a socket with a timeout raises
OSError(ETIMEDOUT), a non-blocking one returns None, and a *blocking* one
raises fakehw.Hang -- on a board that read would wait forever, which is
exactly the PUBACK trap the firmware must avoid.
"""
import fakehw
import fakebroker

AF_INET = 2
SOCK_STREAM = 1
created = []


def getaddrinfo(host, port, *a):
    if not fakehw.wifi_connected():
        raise OSError(-2)  # DNS failure without a link
    return [(AF_INET, SOCK_STREAM, 0, "", (host, port))]


class socket:
    def __init__(self, *a):
        self.timeout = None
        self.conn = None
        self.closed = False
        created.append(self)

    def settimeout(self, t):
        self.timeout = t

    def setblocking(self, flag):
        self.timeout = None if flag else 0

    def connect(self, addr):
        if not fakehw.wifi_connected():
            raise OSError(113)  # EHOSTUNREACH
        if not fakehw.broker["up"]:
            raise OSError(111)  # ECONNREFUSED
        self.conn = fakebroker.Conn(self)

    def write(self, buf, n=None):
        if self.closed or self.conn is None:
            raise OSError(9)  # EBADF
        data = bytes(buf) if n is None else bytes(buf[:n])
        if self.conn.dead:
            raise OSError(104)  # ECONNRESET
        if not fakehw.wifi_connected():
            return len(data)  # goes nowhere; the PUBACK will never come
        ra = fakehw.broker["reset_after"]
        if ra is not None:
            if len(data) > ra:
                fakehw.broker["reset_after"] = None
                self.conn.feed(data[:ra])
                self.conn.drop()
                raise OSError(104)
            fakehw.broker["reset_after"] = ra - len(data)
        self.conn.feed(data)
        return len(data)

    def read(self, n):
        c = self.conn
        if self.closed or c is None:
            raise OSError(9)
        if len(c.rx) >= n and fakehw.wifi_connected():
            out = bytes(c.rx[:n])
            c.rx = c.rx[n:]
            return out
        if c.dead and not c.rx:
            return b""
        if self.timeout is None:
            raise fakehw.Hang("read(%d) on a blocking socket with no data coming" % n)
        if self.timeout == 0:
            return None
        fakehw.advance(int(self.timeout * 1000))  # the time the timeout takes
        raise OSError(110)  # ETIMEDOUT

    def close(self):
        if not self.closed:
            self.closed = True
            if self.conn is not None:
                self.conn.drop()
