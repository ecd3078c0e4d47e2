"""Fake ``ssl``: SSLContext whose sockets pass bytes through unchanged.

Like the real MicroPython SSL socket it has no ``settimeout`` (the timeout
lives on the TCP socket underneath). ``contexts`` records what the
firmware configured, so tests can check verification and SNI.
"""
import os
import fakehw

PROTOCOL_TLS_CLIENT = 0
CERT_NONE = 0
CERT_OPTIONAL = 1
CERT_REQUIRED = 2
contexts = []


class SSLContext:
    def __init__(self, proto):
        self.verify_mode = CERT_NONE
        self.ca = None
        self.cert = None
        self.wrapped = []
        contexts.append(self)

    def load_verify_locations(self, cafile=None, cadata=None):
        if cafile is not None:
            os.stat(cafile)  # OSError if missing, as on a board
            f = open(cafile, "rb")
            cadata = f.read()
            f.close()
        if not isinstance(cadata, (bytes, bytearray)) or not cadata:
            raise ValueError("invalid cert")  # what the tls module raises
        self.ca = cadata

    def load_cert_chain(self, certfile, keyfile):
        for x in (certfile, keyfile):
            if isinstance(x, str):
                os.stat(x)
        self.cert = (certfile, keyfile)

    def wrap_socket(self, sock, server_side=False, do_handshake_on_connect=True, server_hostname=None):
        if fakehw.broker["oom_connect"]:
            raise MemoryError("memory allocation failed (TLS buffers)")
        self.wrapped.append(server_hostname)
        return _TLSSocket(sock)


class _TLSSocket:
    def __init__(self, sock):
        self._s = sock

    def read(self, n):
        return self._s.read(n)

    def write(self, buf, n=None):
        return self._s.write(buf, n)

    def setblocking(self, flag):
        self._s.setblocking(flag)

    def close(self):
        self._s.close()
