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
assembled in a preallocated line buffer. The line is handed to the sink as
a view of that buffer (``sink.add_view``): for kinds cs and cms the core
hashes it where it lies, so no object holding the line is made (other
kinds get a ``str``/``bytes`` item, freed and then scrubbed with the heap
at the end of the step, firmware/app.py). Text lines are checked to be
UTF-8 by the rule MicroPython's ``decode`` applies (:func:`_utf8`), only
when a byte >= 0x80 arrived.

Pan-privacy (docs/ARCHITECTURE.md): as soon as a line has been handed to the sketch
(or skipped), the used part of the line buffer is zeroed, and the chunk
buffer is zeroed after each read has been split into lines, both in place
(no allocation). Only the bytes of a line still being received stay in
RAM here; the port's UART driver keeps its own receive ring buffer
(``rxbuf`` bytes), which no MicroPython call clears (docs/PRIVACY.md,
"Memory residue on boards").
"""

from pansketch.firmware.sources import ConfigError
from pansketch.firmware.sources import get_choice, get_int, unknown

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
        self.high = False  # the line has a byte >= 0x80 (checked to be UTF-8 before counting)
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
                    self.high = False
                elif self.skip:
                    pass
                elif self.len < cap:
                    line[self.len] = c
                    self.len += 1
                    if c > 127:
                        self.high = True
                else:
                    self.skip = True
                    _wipe(line, self.len)
                    self.len = 0
                    self.high = False
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
        if self.as_text and self.high and not _utf8(line, L):
            self.dropped = True
            return False
        sink.add_view(self.as_text, self.mv[0:L], weight)
        return True


def _wipe(buf, n):
    """Zero buf[0:n] in place (allocation-free: no slice, no bytes object)."""
    for i in range(n):
        buf[i] = 0


def _utf8(buf, n):
    """buf[0:n] is UTF-8 by MicroPython's rule (py/unicode.c utf8_check, what ``decode``
    raises UnicodeError on): allocation-free, so the line is never copied to be checked."""
    need = 0
    for i in range(n):
        c = buf[i]
        if need:
            if c & 0xC0 != 0x80:
                return False
            need -= 1
        elif c >= 0xC0:
            if c >= 0xF8:
                return False
            need = (0xE5 >> ((c >> 3) & 6)) & 3
        elif c >= 0x80:
            return False
    return need == 0


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
