"""Lines from a UART: each line is one event (same line format as the Pi agent).

Config::

    "source": {"type": "uart", "id": 1, "baudrate": 9600, "tx": 17, "rx": 16,
               "max_line": 64, "rxbuf": 512, "items": "str"}

A line is UTF-8 text ending in LF (a CR before it is dropped), optionally
followed by a TAB and an integer weight (the last TAB separates it), exactly
as ``agent/pi/sources.py`` reads lines on the Pi, so boards and Pis counting
the same text produce mergeable sketches. Empty lines are ignored. A line
longer than ``max_line`` bytes, a line that is not valid UTF-8 and a line
with a bad weight are skipped (the console says so, without echoing the
line). ``items: "bytes"`` counts the raw line bytes
instead of text.

Bytes are read with ``readinto`` into a preallocated chunk buffer and
assembled in a preallocated line buffer; the only allocation per event is
the item itself (and its hash, in the core).

Pan-privacy (docs/ARCHITECTURE.md): as soon as a line has been handed to the sketch
(or skipped), the used part of the line buffer is zeroed, and the chunk
buffer is zeroed after each read has been split into lines, both in place
(no allocation). Only the bytes of a line still being received stay in
RAM. The item object itself (a ``str``/``bytes``) is immutable: it becomes
garbage after ``sink.add`` and its heap block is reused, not wiped, so it
may linger until the next allocations overwrite it (a MicroPython limit;
the GPIO source avoids item objects altogether).
"""

from firmware.sources import ConfigError
from firmware.sources import get_choice, get_int, unknown

KEYS = ("type", "id", "baudrate", "tx", "rx", "max_line", "rxbuf", "items")


def check(cfg):
    unknown(cfg, KEYS, "source.")
    out = {
        "id": get_int(cfg, "id", "source.id", 1, 0, 16),
        "baudrate": get_int(cfg, "baudrate", "source.baudrate", 9600, 300, 5000000),
        "max_line": get_int(cfg, "max_line", "source.max_line", 64, 4, 4096),
        "rxbuf": get_int(cfg, "rxbuf", "source.rxbuf", 512, 64, 65536),
        "items": get_choice(cfg, "items", "source.items", "str", ("str", "bytes")),
    }
    for k in ("tx", "rx"):
        v = cfg.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, str))):
            raise ConfigError("source." + k, "must be a pin number or name")
        out[k] = v
    return out


class Source:
    CHUNK = 64

    def __init__(self, cfg, log):
        self.cfg = cfg
        self.log = log
        self.dropped = False
        self.uart = None
        self.chunk = bytearray(self.CHUNK)
        self.line = bytearray(cfg["max_line"])
        self.mv = memoryview(self.line)
        self.len = 0
        self.skip = False  # inside an over-long line: drop until LF
        self.as_text = cfg["items"] == "str"

    def start(self, sink):
        import machine

        kw = {"baudrate": self.cfg["baudrate"], "rxbuf": self.cfg["rxbuf"]}
        if self.cfg["tx"] is not None:
            kw["tx"] = self.cfg["tx"]
        if self.cfg["rx"] is not None:
            kw["rx"] = self.cfg["rx"]
        try:
            self.uart = machine.UART(self.cfg["id"], **kw)
        except TypeError:  # ports without rxbuf=
            del kw["rxbuf"]
            self.uart = machine.UART(self.cfg["id"], **kw)

    def stop(self):
        u = self.uart
        self.uart = None
        if u is not None and hasattr(u, "deinit"):
            u.deinit()

    def poll(self, sink, budget):
        u = self.uart
        got = 0
        buf = self.chunk
        line = self.line
        cap = len(line)
        while got < budget:
            if not u.any():
                break
            n = u.readinto(buf)
            if not n:
                break
            for i in range(n):
                c = buf[i]
                if c == 10:
                    if self.skip:
                        self.skip = False
                        self.dropped = True
                    elif self._emit(sink):
                        got += 1
                    _wipe(line, self.len)  # the raw line is counted: do not keep it
                    self.len = 0
                elif self.skip:
                    pass
                elif self.len < cap:
                    line[self.len] = c
                    self.len += 1
                else:
                    self.skip = True
                    _wipe(line, self.len)
                    self.len = 0
            _wipe(buf, n)
        return got

    def _emit(self, sink):
        L = self.len
        line = self.line
        if L and line[L - 1] == 13:
            L -= 1
        if not L:
            return False
        weight = 1
        tab = -1
        for i in range(L - 1, -1, -1):
            if line[i] == 9:
                tab = i
                break
        if tab >= 0:
            weight = _parse_int(line, tab + 1, L)
            if weight is None:
                self.dropped = True
                return False
            L = tab
        raw = bytes(self.mv[0:L])
        if self.as_text:
            try:
                item = raw.decode("utf-8")
            except UnicodeError:
                self.dropped = True
                return False
        else:
            item = raw
        sink.add(item, weight)
        return True


def _wipe(buf, n):
    """Zero buf[0:n] in place (allocation-free: no slice, no bytes object)."""
    for i in range(n):
        buf[i] = 0


def _parse_int(buf, a, b):
    """Integer in buf[a:b] (spaces around allowed), or None; allocation-free."""
    while a < b and buf[a] == 32:
        a += 1
    while b > a and buf[b - 1] == 32:
        b -= 1
    if a >= b:
        return None
    neg = False
    if buf[a] == 45 or buf[a] == 43:
        neg = buf[a] == 45
        a += 1
        if a >= b:
            return None
    v = 0
    for i in range(a, b):
        c = buf[i] - 48
        if c < 0 or c > 9 or v > 100000000:
            return None
        v = v * 10 + c
    return -v if neg else v
