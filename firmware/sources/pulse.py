"""Pulse widths as numeric readings: one event per pulse, its width the reading.

For kind ``dcs`` (quantiles of the widths: ultrasonic echo times, PWM duty,
flow-meter periods). Config::

    "source": {"type": "pulse", "pin": 5, "level": "high", "unit": "us",
               "pull": null, "slots": 16}

A pulse is the time the pin spends at ``level`` ("high" or "low"), measured
in ``unit`` ("us" with ``ticks_us``, or "ms") between the two edges; its
width (an int) is the item handed to the core, which maps it to the domain
with the sketch's ``map`` (agent/dcs.py). The IRQ handler (hard where the
port allows) reads the tick counter and the pin and stores at most one
small int: the start tick of the pulse in progress (``t0``, -1 when none)
or a finished width into a preallocated ring of ``slots`` ints; it
allocates nothing. ``poll`` moves the widths out with IRQs disabled, zeroes
the ring, counts them, and zeroes its copy: a width stays in RAM only until
the next main-loop step (events in flight, docs/PRIVACY.md), the start tick
only while the pulse lasts. A full ring drops widths (``dropped``, warned
by the app). Widths wrap with the tick counter (about 18 min in us, 12 days
in ms): longer pulses read short.
"""

import array

from pansketch.firmware import clock
from pansketch.firmware.sources import ConfigError, get_choice, get_int, unknown

KEYS = ("type", "pin", "level", "unit", "pull", "slots")


def check(cfg):
    unknown(cfg, KEYS, "source.")
    pin = cfg.get("pin")
    if isinstance(pin, bool) or not isinstance(pin, (int, str)):
        raise ConfigError("source.pin", "must be a pin number or name")
    return {
        "pin": pin,
        "level": get_choice(cfg, "level", "source.level", "high", ("high", "low")),
        "unit": get_choice(cfg, "unit", "source.unit", "us", ("us", "ms")),
        "pull": get_choice(cfg, "pull", "source.pull", None, (None, "up", "down")),
        "slots": get_int(cfg, "slots", "source.slots", 16, 1, 1024),
    }


class Source:
    def __init__(self, cfg, log):
        import machine

        self.machine = machine
        self.log = log
        self.dropped = False
        Pin = machine.Pin
        pull = None
        if cfg["pull"] == "up":
            pull = Pin.PULL_UP
        elif cfg["pull"] == "down":
            pull = Pin.PULL_DOWN
        self.pin = Pin(cfg["pin"], Pin.IN, pull) if pull is not None else Pin(cfg["pin"], Pin.IN)
        self.level = 1 if cfg["level"] == "high" else 0
        if cfg["unit"] == "ms":
            self.ticks = clock.ticks_ms
        else:
            import time

            self.ticks = time.ticks_us  # MicroPython; wraps like ticks_ms (ticks_diff handles it)
        self.t0 = -1  # start tick of the pulse in progress
        self.ring = array.array("i", bytes(4 * cfg["slots"]))
        self.out = array.array("i", bytes(4 * cfg["slots"]))
        self.n = 0
        self._handler = self.irq

    def irq(self, pin):
        t = self.ticks()
        if pin.value() == self.level:
            self.t0 = t
            return
        t0 = self.t0
        if t0 < 0:
            return
        self.t0 = -1
        if self.n < len(self.ring):
            self.ring[self.n] = clock.ticks_diff(t, t0)
            self.n += 1
        else:
            self.dropped = True

    def start(self, sink):
        Pin = self.machine.Pin
        trig = Pin.IRQ_RISING | Pin.IRQ_FALLING
        try:
            self.pin.irq(handler=self._handler, trigger=trig, hard=True)
        except TypeError:
            self.pin.irq(handler=self._handler, trigger=trig)

    def poll(self, sink, budget):
        m = self.machine
        st = m.disable_irq()
        n = self.n
        for i in range(n):
            self.out[i] = self.ring[i]
            self.ring[i] = 0
        self.n = 0
        m.enable_irq(st)
        for i in range(n):
            sink.add(self.out[i])
            self.out[i] = 0
        return n

    def stop(self):
        self.pin.irq(handler=None)
