"""Simulated hardware behind the fakes of tests/test_firmware_*.py (WebAssembly VM).

Runs inside the MicroPython VM. The fake modules beside it (``network``,
``machine``, ``ntptime``, ``bluetooth``, ``usocket``, ``ssl``,
``umqtt.simple``) read and write the dicts below, and tests flip them
between main-loop steps: ``wifi["ap"] = False`` is a WiFi drop,
``broker["connack"] = 5`` a broker refusing the device, and so on.
The board modules (machine, network, ntptime, bluetooth) are shared with
the Unix-port board, whose tests/mpunix/fakes/fakehw.py implements the same
interface (the section "what the board modules call") over files and the
real clock.

Time is fake too: ``install()`` points ``pansketch.firmware.clock`` at a millisecond
counter that only moves when the firmware sleeps or a test calls
``advance``. The real UTC time at fake uptime 0 is ``UNIX0``.
"""

PERIOD = 1 << 30
UNIX0 = 1767225600  # 2026-01-01T00:00:00Z
ms = 0
rtc0 = 946684800  # what the RTC says at uptime 0: 2000-01-01 (unset)


class Reset(BaseException):
    """machine.reset() or a watchdog bite: the VM run must stop here."""


class PowerCut(BaseException):
    """Injected power failure (raised from a fake file operation)."""


class Hang(BaseException):
    """A read on a blocking socket with no data coming: a real board would hang."""


wifi = {"ap": True, "ssid": "lab", "password": "secret", "join_ms": 300}
sta = {"target": None, "since": 0, "joined": False}
broker = {
    "up": True,          # accepts TCP connections
    "connack": 0,        # CONNACK return code (5 = not authorized)
    "drop_puback": 0,    # swallow the next N PUBACKs (message still delivered)
    "reset_after": None,  # reset the connection after N more bytes from the client
    "silent": False,     # stop answering at all (degraded link)
    "oom_connect": False,  # raise MemoryError in the TLS wrap (no heap for TLS buffers)
    "host_ack": True,    # the host stores every release and acks it (docs/FORMAT.md section 7)
}
ntp = {"ok": True}
wdt = {"armed": False, "timeout": 0, "last": 0, "feeds": 0}
stats = {"connects": 0, "pubs": 0, "wlan_connects": 0}
# what happened, in order (e.g. "wlan_active"); tests append their own marks too
order = []
uart_read_ms = 0  # fake time one UART readinto takes (models the cost of handling events)


MASK = PERIOD - 1


def ticks_ms():
    return ms & MASK


HALF = PERIOD >> 1


def ticks_diff(a, b):
    # small-int arithmetic only, like the C version: no allocation
    d = a - b
    if d >= HALF:
        d -= PERIOD
    elif d < -HALF:
        d += PERIOD
    return d


def ticks_add(a, d):
    return (a + d) & MASK


timers = []  # [due_ms, fn]: fake hardware events (e.g. a BLE scan ending)


def at(due, fn):
    timers.append([due, fn])


def advance(n):
    """Let ``n`` ms pass (firing due timers); a starved armed watchdog bites (raises Reset)."""
    global ms
    ms += n
    while timers:
        due = [t for t in timers if t[0] <= ms]
        if not due:
            break
        for t in due:
            timers.remove(t)
            t[1]()
    if wdt["armed"] and ms - wdt["last"] > wdt["timeout"]:
        raise Reset("watchdog: not fed for %d ms" % (ms - wdt["last"]))


def sleep_ms(n):
    advance(n)


def unix():
    return UNIX0 + ms // 1000


def rtc_unix():
    return rtc0 + ms // 1000


def set_unix(t):
    """Move the fake 'real' time so that unix() == t now (uptime unchanged)."""
    global UNIX0
    UNIX0 = t - ms // 1000


def wifi_connected():
    if not wifi["ap"]:
        sta["joined"] = False
        return False
    if sta["joined"]:
        return True
    t = sta["target"]
    if t is not None and t == (wifi["ssid"], wifi["password"]) and ms - sta["since"] >= wifi["join_ms"]:
        sta["joined"] = True
    return sta["joined"]


# -- what the board modules call (machine, network, ntptime, bluetooth) ---------
UNIQUE_ID = b"\x24\x0a\xc4\x11\x22\x33"
HOSTNAME = "esp"
IFCONFIG = ("10.0.0.7", "255.255.255.0", "10.0.0.1", "10.0.0.1")
scans = []  # BLE scans started: (ms, duration_ms, interval_us, window_us, active)


def reset():
    raise Reset("machine.reset()")


class WDT:
    def __init__(self, id=0, timeout=5000):
        if timeout > 60000:
            raise ValueError("timeout too long")
        wdt["armed"] = True
        wdt["timeout"] = timeout
        wdt["last"] = ms

    def feed(self):
        wdt["last"] = ms
        wdt["feeds"] += 1


class UART:
    """Never blocks; a test feeds the bytes that arrive (``machine.uarts[id].feed``)."""

    def __init__(self, id, baudrate=9600, tx=None, rx=None, rxbuf=256, **kw):
        import machine

        self.id = id
        self.baudrate = baudrate
        self.rxbuf = rxbuf
        self.buf = bytearray()
        machine.uarts[id] = self

    def feed(self, data):
        """Test hook: bytes arrive on the line."""
        self.buf.extend(data)

    def any(self):
        return len(self.buf)

    def readinto(self, buf, nbytes=None):
        n = len(buf) if nbytes is None else nbytes
        n = min(n, len(self.buf))
        if not n:
            return None
        buf[0:n] = self.buf[0:n]
        self.buf = self.buf[n:]
        if uart_read_ms:
            advance(uart_read_ms)
        return n

    def deinit(self):
        pass


def radio_on():
    order.append("wlan_active")


def wifi_join(ssid, key):
    stats["wlan_connects"] += 1
    sta["target"] = (ssid, key)
    sta["since"] = ms
    sta["joined"] = False


def wifi_leave():
    sta["target"] = None
    sta["joined"] = False


def wifi_status():
    if wifi_connected():
        return "got_ip"
    if not wifi["ap"]:
        return "no_ap"
    t = sta["target"]
    if t is not None and t[1] != wifi["password"]:
        return "wrong_password"
    return "connecting"


def ntp_time():
    if not ntp["ok"] or not wifi_connected():
        raise OSError(110)
    return unix()


def ble_scan(ble, duration_ms, interval_us, window_us, active):
    scans.append((ms, duration_ms, interval_us, window_us, active))
    at(ms + duration_ms, ble._done)


def install():
    """Point the firmware's clock functions at the fake clock."""
    import pansketch.firmware.clock as c

    c.ticks_ms = ticks_ms
    c.ticks_diff = ticks_diff
    c.ticks_add = ticks_add
    c.sleep_ms = sleep_ms
    c.rtc_unix = rtc_unix


def hexstr(b):
    out = []
    for x in b:
        out.append("%02x" % x)
    return "".join(out)
