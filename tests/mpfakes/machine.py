"""Fake ``machine``: WDT, Pin (with IRQs a test can fire), UART (with bytes a
test can feed), RTC, reset, IRQ masking."""
import fakehw

pins = {}
uarts = {}
_rtc = [None]


def reset():
    raise fakehw.Reset("machine.reset()")


def soft_reset():
    raise fakehw.Reset("machine.soft_reset()")


def unique_id():
    return b"\x24\x0a\xc4\x11\x22\x33"


def freq(*a):
    return 240000000


def disable_irq():
    return 1


def enable_irq(state):
    pass


class WDT:
    def __init__(self, id=0, timeout=5000):
        if timeout > 60000:
            raise ValueError("timeout too long")
        fakehw.wdt["armed"] = True
        fakehw.wdt["timeout"] = timeout
        fakehw.wdt["last"] = fakehw.ms

    def feed(self):
        fakehw.wdt["last"] = fakehw.ms
        fakehw.wdt["feeds"] += 1


class Pin:
    IN = 1
    OUT = 3
    PULL_UP = 1
    PULL_DOWN = 2
    IRQ_RISING = 1
    IRQ_FALLING = 2

    def __init__(self, id, mode=-1, pull=-1):
        self.id = id
        self.mode = mode
        self.pull = pull
        self.handler = None
        self.trigger = 0
        self.hard = False
        pins[id] = self

    def irq(self, handler=None, trigger=3, hard=False):
        self.handler = handler
        self.trigger = trigger
        self.hard = hard

    def value(self, v=None):
        return getattr(self, "_v", 0)

    def fire(self, n=1, value=None):
        """Test hook: n edges arrive (the handler runs like an IRQ); ``value`` sets the level first."""
        if value is not None:
            self._v = value
        for _ in range(n):
            if self.handler is not None:
                self.handler(self)


class UART:
    def __init__(self, id, baudrate=9600, tx=None, rx=None, rxbuf=256, **kw):
        self.id = id
        self.baudrate = baudrate
        self.rxbuf = rxbuf
        self.buf = bytearray()
        uarts[id] = self

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
        if fakehw.uart_read_ms:
            fakehw.advance(fakehw.uart_read_ms)
        return n

    def deinit(self):
        pass


class RTC:
    def datetime(self, t=None):
        if t is None:
            return _rtc[0]
        _rtc[0] = t
