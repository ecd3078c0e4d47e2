"""Event sources: small plug-in modules with one interface.

A source turns something the board observes (pulses on a pin, BLE
advertisements, lines on a UART, ...) into *events* for the noisy sketch.
The config file picks one with ``"source": {"type": NAME, ...}``; NAME is
``gpio``, ``ble`` or ``uart`` (modules in this package) or the name of any
module on the board's ``sys.path`` that follows the interface below.

Interface of a source module::

    def check(cfg):
        # Validate the "source" section (a dict) WITHOUT touching hardware.
        # Return the normalised settings; raise ConfigError(key, msg) with
        # key = "source.<field>" for anything wrong.

    class Source:
        def __init__(self, cfg, log):   # cfg = what check() returned; log(msg)
        def start(self, sink):          # claim the hardware, arm IRQs; may
                                        # call sink.prepare() for fixed items
        def poll(self, sink, budget):   # hand over at most ~budget pending
                                        # events; return how many were handed
        def stop(self):                 # release the hardware
        dropped                         # bool: set True when an event was lost
                                        # (full buffer); the app logs and clears it

The ``sink`` (the running app) offers::

    sink.add(item, weight=1)        # one event; item is str, bytes or int
    sink.prepare(item) -> handle    # hash a fixed item once (at start)
    sink.add_prepared(handle, n)    # n events of weight 1 of that item;
                                    # allocates nothing

Rules every source follows (docs/ARCHITECTURE.md pan-privacy, gc discipline):

* IRQ handlers never allocate: events wait in buffers preallocated in
  ``__init__`` (hard IRQs cannot allocate at all, soft ones must not make
  garbage per event). A full buffer drops the event and sets ``dropped``;
  the app logs that on the console. Nobody keeps a *count* of dropped (or
  counted) events: an exact count in memory is what pan-privacy forbids.
* Raw events live only in that buffer, until the next ``poll``; a source
  keeps no per-item tables, counts or history, so an intruder reading the
  board's memory learns at most the few events of the current buffer.
* ``poll`` is called from the main loop every few milliseconds and returns
  quickly; the watchdog is fed between polls.
* Event items must be encoded the way the rest of the fleet encodes them
  (text items as ``str``), or the sketches will not merge meaningfully.
Imports pansketch.firmware.clock only; pansketch.firmware.config imports ConfigError from here.
"""


class ConfigError(ValueError):
    """A bad config value; ``key`` is its dotted path in the file (pansketch.firmware.config re-exports it)."""

    def __init__(self, key, msg):
        super().__init__("%s: %s" % (key, msg))
        self.key = key


BUILTIN = ("gpio", "ble", "uart", "pulse")


def module_for(name):
    if name in BUILTIN:
        modname = "pansketch.firmware.sources." + name
    else:
        modname = name
    try:
        mod = __import__(modname, None, None, ("check", "Source"))
    except ImportError as exc:
        raise ConfigError("source.type", "cannot import source module %r (%s); built-in types are %s"
                          % (modname, exc, ", ".join(BUILTIN)))
    if not hasattr(mod, "check") or not hasattr(mod, "Source"):
        raise ConfigError("source.type", "module %r does not define check() and Source" % modname)
    return mod


def check(src):
    """Validate the "source" section: (type name, normalised settings)."""
    name = src.get("type")
    if not isinstance(name, str) or not name:
        raise ConfigError("source.type", "is required (one of %s, or a plug-in module name)" % ", ".join(BUILTIN))
    return name, module_for(name).check(src)


def load(name, cfg, log):
    """Instantiate the configured source (touches hardware)."""
    return module_for(name).Source(cfg, log)


# -- helpers for check() implementations ----------------------------------
def unknown(d, keys, prefix):
    for k in d:
        if k not in keys:
            raise ConfigError(prefix + k, "unknown key (allowed: %s)" % ", ".join(keys))


def get_int(d, key, path, default, lo, hi):
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(path, "must be an integer, got %r" % (v,))
    if v < lo or v > hi:
        raise ConfigError(path, "must be between %d and %d, got %d" % (lo, hi, v))
    return v


def get_choice(d, key, path, default, choices):
    v = d.get(key, default)
    if v not in choices:
        raise ConfigError(path, "must be one of %s, got %r" % (", ".join([repr(c) for c in choices]), v))
    return v
