"""BLE advertisement addresses (ESP32, Pico W with BLE firmware): one event
per address seen in one scan burst.

Config::

    "source": {"type": "ble", "every_s": 60, "scan_ms": 3000,
               "interval_us": 30000, "window_us": 30000, "active": false,
               "slots": 32, "random": true}

Every ``every_s`` seconds the board scans for ``scan_ms``. Each distinct
address heard during one burst is one event whose item is the text
``"AA:BB:CC:DD:EE:FF"`` (upper-case hex, the BlueZ/bleak spelling, so Pi
agents that count the same phones merge with the board). ``random: false``
ignores random (non-public) addresses. Phones repeat their advertisement
many times a second; de-duplicating within a burst bounds one phone's
contribution to one event per burst, i.e. per ``every_s`` seconds, which
is the unit the privacy budget protects here.

The scan-result IRQ copies the six address bytes into a preallocated slot
table (``slots`` entries, compared byte by byte for the de-duplication), so
it allocates nothing; the table is handed to the sketch and wiped when the
burst ends. Addresses beyond ``slots`` in one burst are dropped (the
console says so). Each address is spelled into one preallocated text buffer
and handed to the sketch as a view of it (``sink.add_view``: no ``str`` per
address), which is zeroed after the burst. No address survives a burst in
our memory (the BLE stack's own buffers: docs/PRIVACY.md, "Memory residue
on boards").
"""

from pansketch.firmware import clock
from pansketch.firmware.sources import get_int, unknown

KEYS = ("type", "every_s", "scan_ms", "interval_us", "window_us", "active", "slots", "random")
_IRQ_SCAN_RESULT = 5
_IRQ_SCAN_DONE = 6
_HEX = b"0123456789ABCDEF"


def check(cfg):
    unknown(cfg, KEYS, "source.")
    from pansketch.firmware.sources import ConfigError

    out = {
        "every_s": get_int(cfg, "every_s", "source.every_s", 60, 1, 86400),
        "scan_ms": get_int(cfg, "scan_ms", "source.scan_ms", 3000, 100, 600000),
        "interval_us": get_int(cfg, "interval_us", "source.interval_us", 30000, 2500, 10240000),
        "window_us": get_int(cfg, "window_us", "source.window_us", 30000, 2500, 10240000),
        "slots": get_int(cfg, "slots", "source.slots", 32, 1, 1024),
    }
    if out["window_us"] > out["interval_us"]:
        raise ConfigError("source.window_us", "must not exceed source.interval_us")
    if out["scan_ms"] > out["every_s"] * 1000:
        raise ConfigError("source.scan_ms", "must not exceed every_s * 1000")
    for k, dflt in (("active", False), ("random", True)):
        v = cfg.get(k, dflt)
        if v is not True and v is not False:
            raise ConfigError("source." + k, "must be true or false")
        out[k] = v
    return out


class Source:
    def __init__(self, cfg, log):
        self.cfg = cfg
        self.log = log
        self.dropped = False
        self.slots = cfg["slots"]
        self.table = bytearray(6 * self.slots)
        self.n = 0
        self.scanning = False
        self.next_ms = 0
        self.random = cfg["random"]
        self.text = bytearray(17)  # "AA:BB:CC:DD:EE:FF"
        self.tview = memoryview(self.text)  # handed to sink.add_view: no str per address
        for i in range(2, 17, 3):
            self.text[i] = 58
        self.ble = None
        self._handler = self.irq

    def start(self, sink):
        import bluetooth

        self.ble = bluetooth.BLE()
        self.ble.active(True)
        self.ble.irq(self._handler)
        self.next_ms = clock.ticks_ms()

    def stop(self):
        if self.ble is not None:
            try:
                self.ble.gap_scan(None)
            except Exception:
                pass
            self.ble.irq(None)
            self.ble.active(False)

    def irq(self, event, data):
        if event == _IRQ_SCAN_RESULT:
            addr_type, addr, adv_type, rssi, adv_data = data
            if addr_type and not self.random:
                return
            t = self.table
            n = self.n
            for s in range(n):
                o = 6 * s
                if (t[o] == addr[0] and t[o + 1] == addr[1] and t[o + 2] == addr[2]
                        and t[o + 3] == addr[3] and t[o + 4] == addr[4] and t[o + 5] == addr[5]):
                    return
            if n >= self.slots:
                self.dropped = True
                return
            o = 6 * n
            for k in range(6):
                t[o + k] = addr[k]
            self.n = n + 1
        elif event == _IRQ_SCAN_DONE:
            self.scanning = False

    def poll(self, sink, budget):
        if self.scanning:
            return 0
        got = 0
        n = self.n
        if n:
            t = self.table
            txt = self.text
            for s in range(n):
                o = 6 * s
                for k in range(6):
                    b = t[o + k]
                    txt[3 * k] = _HEX[b >> 4]
                    txt[3 * k + 1] = _HEX[b & 15]
                    t[o + k] = 0
                sink.add_view(True, self.tview, 1)
                got += 1
            self.n = 0
            for i in range(17):
                if i % 3 != 2:
                    txt[i] = 48  # no address stays in memory
        now = clock.ticks_ms()
        if clock.ticks_diff(now, self.next_ms) >= 0:
            self.next_ms = clock.ticks_add(now, self.cfg["every_s"] * 1000)
            self.scanning = True
            c = self.cfg
            self.ble.gap_scan(c["scan_ms"], c["interval_us"], c["window_us"], c["active"])
        return got
