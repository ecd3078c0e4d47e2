"""GPIO pulse / edge counter: every edge on a pin is one event of its label.

Config::

    "source": {"type": "gpio",
               "pins": [{"pin": 4, "label": "door", "trigger": "rising",
                         "pull": "up", "debounce_ms": 20}]}

``pin`` is the port's pin id (an int, or a name string such as "GP15" on
the Pico), ``label`` the item counted (text, so it merges with the same
label from other devices), ``trigger`` one of rising / falling / both,
``pull`` up / down / null, ``debounce_ms`` ignores edges closer than that
to the previous one (0 = off).

The IRQ handler is a hard IRQ where the port supports it: it only
compares two small ints and increments a counter attribute, which
allocates nothing. ``poll`` takes the pending count with IRQs disabled and
adds it with ``sink.add_prepared`` (the label's hash is computed once at
start), so counting costs no allocation at all, however fast the pulses.
Each edge is one event of weight 1: the sensitivity bound of the sketch
holds per edge.

Debouncing keeps no timestamp of an edge beyond its debounce window: the
handler stores only the deadline ``until`` (end of the window of the last
accepted edge) and ``poll`` resets it to -1 once that deadline has passed,
so after ``debounce_ms`` plus one main-loop step the pin object reads the
same whether or not an edge ever happened (docs/ARCHITECTURE.md pan-privacy: no
event-dependent state outside the noisy sketch, except events still
waiting in the buffer, here the pending count ``n``).
"""

from pansketch.firmware import clock
from pansketch.firmware.sources import ConfigError
from pansketch.firmware.sources import get_choice, get_int, unknown

PIN_KEYS = ("pin", "label", "trigger", "pull", "debounce_ms")
TRIGGERS = ("rising", "falling", "both")


def check(cfg):
    unknown(cfg, ("type", "pins"), "source.")
    pins = cfg.get("pins")
    if not isinstance(pins, list) or not pins:
        raise ConfigError("source.pins", "must be a non-empty list of pin objects")
    out = []
    seen = []
    for i in range(len(pins)):
        p = pins[i]
        pre = "source.pins[%d]." % i
        if not isinstance(p, dict):
            raise ConfigError(pre[:-1], "must be an object")
        unknown(p, PIN_KEYS, pre)
        pin = p.get("pin")
        if isinstance(pin, bool) or not isinstance(pin, (int, str)):
            raise ConfigError(pre + "pin", "must be a pin number or name")
        if pin in seen:
            raise ConfigError(pre + "pin", "pin %r is listed twice" % (pin,))
        seen.append(pin)
        label = p.get("label")
        if not isinstance(label, str) or not label:
            raise ConfigError(pre + "label", "must be a non-empty string (the item counted)")
        out.append({
            "pin": pin,
            "label": label,
            "trigger": get_choice(p, "trigger", pre + "trigger", "rising", TRIGGERS),
            "pull": get_choice(p, "pull", pre + "pull", None, (None, "up", "down")),
            "debounce_ms": get_int(p, "debounce_ms", pre + "debounce_ms", 0, 0, 60000),
        })
    return out


class _Counter:
    """One pin: counts edges from its IRQ handler, allocation-free."""

    def __init__(self, machine, spec):
        Pin = machine.Pin
        pull = None
        if spec["pull"] == "up":
            pull = Pin.PULL_UP
        elif spec["pull"] == "down":
            pull = Pin.PULL_DOWN
        self.pin = Pin(spec["pin"], Pin.IN, pull) if pull is not None else Pin(spec["pin"], Pin.IN)
        t = spec["trigger"]
        self.trigger = Pin.IRQ_RISING if t == "rising" else Pin.IRQ_FALLING if t == "falling" else (
            Pin.IRQ_RISING | Pin.IRQ_FALLING)
        self.label = spec["label"]
        self.debounce = spec["debounce_ms"]
        self.n = 0
        self.until = -1  # end of the current debounce window (ticks_ms), -1 = none
        self.handle = None
        self._handler = self.irq  # bound once: registering allocates, firing does not

    def irq(self, pin):
        if self.debounce:
            t = clock.ticks_ms()
            u = self.until
            if u >= 0 and clock.ticks_diff(u, t) > 0:
                return
            self.until = clock.ticks_add(t, self.debounce)
        self.n += 1

    def expire(self, now):
        """Forget the debounce deadline once it has passed (call with IRQs off)."""
        u = self.until
        if u >= 0 and clock.ticks_diff(u, now) <= 0:
            self.until = -1

    def arm(self):
        try:
            self.pin.irq(handler=self._handler, trigger=self.trigger, hard=True)
        except TypeError:  # ports without hard IRQs
            self.pin.irq(handler=self._handler, trigger=self.trigger)

    def disarm(self):
        self.pin.irq(handler=None)


class Source:
    def __init__(self, cfg, log):
        import machine

        self.machine = machine
        self.log = log
        self.dropped = False
        self.counters = [_Counter(machine, spec) for spec in cfg]

    def start(self, sink):
        for c in self.counters:
            c.handle = sink.prepare(c.label)
            c.arm()

    def poll(self, sink, budget):
        m = self.machine
        total = 0
        now = clock.ticks_ms()
        for c in self.counters:
            st = m.disable_irq()
            n = c.n
            c.n = 0
            c.expire(now)
            m.enable_irq(st)
            if n:
                sink.add_prepared(c.handle, n)
                total += n
        return total

    def stop(self):
        for c in self.counters:
            c.disarm()
