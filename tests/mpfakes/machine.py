"""Fake ``machine`` for both test VMs: Pin (with IRQs a test can fire), RTC, IRQ
masking; the watchdog, the UART and reset are the hardware's, ``fakehw``:
simulated in the WebAssembly VM (tests/mpfakes/fakehw.py), files and the real
clock on the Unix-port board (tests/mpunix/fakes/fakehw.py)."""
import fakehw

pins = {}
uarts = {}
_rtc = [None]


reset = fakehw.reset
soft_reset = fakehw.reset
WDT = fakehw.WDT
UART = fakehw.UART  # registers itself in ``uarts``


def unique_id():
    return fakehw.UNIQUE_ID


def freq(*a):
    return 240000000


def disable_irq():
    return 1


def enable_irq(state):
    pass


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


class RTC:
    def datetime(self, t=None):
        if t is None:
            return _rtc[0]
        _rtc[0] = t
