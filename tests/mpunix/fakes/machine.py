"""Fake ``machine`` for the Unix-port board (tests/unixvm.py).

* ``UART(id)``: the bytes appended to /hw/uart<id> after the UART was
  created (like a serial line: what arrived while the board was off is
  gone). ``any``/``readinto`` never block.
* ``WDT``: checks the firmware feeds it in time; a starved watchdog prints
  ``@wdt starved <ms> ms`` (a board would have reset) at the next feed.
* ``reset``/``soft_reset`` end the process (exit code 3), as the test's
  "board" has no reset circuit; ``RTC``, ``Pin``, ``unique_id``, ``freq``,
  ``disable_irq``/``enable_irq``: enough for the firmware.
"""
import os
import sys
import time


def reset():
    print("@machine reset")
    sys.exit(3)


def soft_reset():
    reset()


def unique_id():
    return b"\x02\x00\x00\x00\x00\x01"


def freq(*a):
    return 240000000


def disable_irq():
    return 1


def enable_irq(state):
    pass


def idle():
    time.sleep_ms(1)


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


class Pin:
    IN = 1
    OUT = 3
    PULL_UP = 1
    PULL_DOWN = 2
    IRQ_RISING = 1
    IRQ_FALLING = 2

    def __init__(self, id, mode=-1, pull=-1):
        self.id = id
        self.handler = None

    def irq(self, handler=None, trigger=3, hard=False):
        self.handler = handler

    def value(self, v=None):
        return 0


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


class RTC:
    _dt = None

    def datetime(self, t=None):
        if t is None:
            return RTC._dt
        RTC._dt = t
