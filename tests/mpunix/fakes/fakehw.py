"""The hardware behind the fake board modules on the Unix-port board (tests/support/unixvm.py).

``machine``, ``network``, ``ntptime`` and ``bluetooth`` here are links to
tests/mpfakes, the fakes the WebAssembly VM's tests use too; this module is
what they call, over files in /hw (a test writes them) and the port's real
clock (tests/mpfakes/fakehw.py is the WebAssembly VM's simulated one):

* UART ``id``: the bytes appended to /hw/uart<id> after the UART was created
  (like a serial line: what arrived while the board was off is gone); reads
  never block.
* WiFi: the host's loopback; the station joins at once unless /hw/wifi_down
  exists (then it cannot find the AP, and an up link drops). Sockets are the
  port's own.
* NTP: the host's clock plus the seconds in /hw/clock_offset if it exists (a
  test moves "UTC" without touching the host); /hw/ntp_down makes it time out.
* The watchdog prints ``@wdt armed <ms>`` and, at a feed that comes too late,
  ``@wdt starved <ms> ms`` (a board would have reset); ``machine.reset`` prints
  ``@machine reset`` and ends the process (exit code 3): the test's "board"
  has no reset circuit.
* BLE scans end at once, having heard nothing.
"""
import os
import sys
import time

UNIQUE_ID = b"\x02\x00\x00\x00\x00\x01"
HOSTNAME = "unix-board"
IFCONFIG = ("127.0.0.1", "255.0.0.0", "127.0.0.1", "127.0.0.1")
_target = [None]  # the SSID the station joins


def _exists(p):
    try:
        os.stat(p)
        return True
    except OSError:
        return False


def reset():
    print("@machine reset")
    sys.exit(3)


class WDT:
    def __init__(self, id=0, timeout=5000):
        self.timeout = timeout
        self.last = time.ticks_ms()
        print("@wdt armed %d" % timeout)

    def feed(self):
        now = time.ticks_ms()
        late = time.ticks_diff(now, self.last)
        if late > self.timeout:
            print("@wdt starved %d ms" % late)
        self.last = now


class UART:
    def __init__(self, id, baudrate=9600, tx=None, rx=None, rxbuf=256, **kw):
        self.path = "/hw/uart%d" % id
        try:
            self.pos = os.stat(self.path)[6]
        except OSError:
            f = open(self.path, "wb")
            f.close()
            self.pos = 0
        self.f = open(self.path, "rb")

    def any(self):
        return os.stat(self.path)[6] - self.pos

    def readinto(self, buf, nbytes=None):
        n = len(buf) if nbytes is None else nbytes
        left = self.any()
        if left <= 0:
            return None
        if n > left:
            n = left
        self.f.seek(self.pos)
        got = self.f.readinto(memoryview(buf)[0:n])
        if not got:
            return None
        self.pos += got
        return got

    def deinit(self):
        self.f.close()


def radio_on():
    pass


def wifi_join(ssid, key):
    _target[0] = ssid


def wifi_leave():
    _target[0] = None


def wifi_connected():
    return _target[0] is not None and not _exists("/hw/wifi_down")


def wifi_status():
    if wifi_connected():
        return "got_ip"
    return "no_ap" if _exists("/hw/wifi_down") else "idle"


def ntp_time():
    if _exists("/hw/ntp_down"):
        raise OSError(110)  # ETIMEDOUT
    off = 0
    if _exists("/hw/clock_offset"):
        f = open("/hw/clock_offset")
        off = int(f.read().strip() or "0")
        f.close()
    return int(time.time()) + off


def ble_scan(ble, duration_ms, interval_us, window_us, active):
    ble._done()
