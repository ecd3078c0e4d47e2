# Runs inside the MicroPython Unix port instead of /main.py (tests/mpunix/board.py
# with SCRIPT=memrun; tests/test_firmware_unix_frozen.py and
# benchmarks/firmware_unix.py --frozen compile it to .mpy in the board's /hw).
# Where a board's heap goes, stage by stage, in the frozen VM
# (tests/mpunix/build-frozen.sh), with the firmware's real main loop running
# against a real broker. Options in /hw/memrun.json:
#   tls_outside   Mbed TLS allocates with libc, outside the heap (an ESP32);
#                 otherwise from the Python heap (a Pico W)
#   releases      main-loop until this many releases are published and
#                 acknowledged (default 2)
#   limit_ms      give up after this long (default 60000)
#
#   @heap BYTES            the VM's heap (gc.mem_alloc() + gc.mem_free())
#   @tls WHERE             heap | libc (where Mbed TLS allocates)
#   @live_vm BYTES         live heap before any firmware import (this script, the
#                          launcher, the fake board modules)
#   @live_code BYTES       ... after importing what the firmware imports at boot
#   @live_boot BYTES       ... after boot (config, sketch arrays, app objects)
#   @largest_free_boot B   largest block allocatable after boot
#   @sketch KIND D W CELLS SHADOW
#   @live_connected BYTES  ... right after the MQTT session (and TLS) came up
#   @loop STEPS LIVE_HW PERSISTS RELEASES   live heap's high-water over the loop
#   @done 1
import gc
import json
import time

f = open("/hw/memrun.json")
opts = json.loads(f.read())
f.close()
where = "heap"
if opts.get("tls_outside"):
    try:
        import tlsalloc  # tests/mpunix/cmod: only in the frozen 32-bit build

        tlsalloc.outside()
        where = tlsalloc.where()
        del tlsalloc
    except ImportError:  # the 64-bit build: Mbed TLS is on libc anyway
        where = "libc"
del f


def largest():
    """Largest block allocatable right now (bisection on bytearray sizes)."""
    gc.collect()
    lo, hi = 0, gc.mem_free()
    while hi - lo > 32:
        mid = (lo + hi) // 2
        try:
            bytearray(mid)
            lo = mid
        except MemoryError:
            hi = mid
    gc.collect()
    return lo


def out(key, *vals):
    print("@%s %s" % (key, " ".join(str(v) for v in vals)))


import machine  # noqa: E402,F401  (imported before live_vm: a fake here, a C module on a board)
import network  # noqa: E402,F401

gc.collect()
out("heap", gc.mem_alloc() + gc.mem_free())
out("tls", where)
out("live_vm", gc.mem_alloc())
# what boot imports for a cs/cms window or keep sketch with a UART source (ssl comes with the first TLS connect)
from pansketch.firmware import app as fwapp  # noqa: E402
from pansketch.firmware import mqtt, sources, wifi  # noqa: E402,F401
from pansketch.firmware.sources import uart  # noqa: E402,F401
from pansketch.agent import recorder  # noqa: E402,F401

gc.collect()
out("live_code", gc.mem_alloc())
a = fwapp.boot("/pansketch.json")
if not a.running:
    out("idle", a.reason)
    raise SystemExit(2)
gc.collect()
out("live_boot", gc.mem_alloc())
out("largest_free_boot", largest())
p = a.rec.p
out("sketch", p.kind, p.d, p.w, p.d * p.w, 1 if a.rec.sh else 0)
want = opts.get("releases", 2)
limit = opts.get("limit_ms", 60000)
steps = 0
hw = 0
persists = 0
last = a.rec.last_persist
up = False
t0 = time.ticks_ms()
while time.ticks_diff(time.ticks_ms(), t0) < limit:
    ms = a.step()
    steps += 1
    gc.collect()
    u = gc.mem_alloc()
    if u > hw:
        hw = u
    if a.rec.last_persist != last:
        persists += 1
        last = a.rec.last_persist
    if a.link.up and not up:
        up = True
        out("live_connected", u)
    if a.rec.seq >= want and a.link.up and not a.rec.outbox.pending():
        break
    fwapp.sleep(a, ms)
out("loop", steps, hw, persists, a.rec.seq)
out("connected", 1 if a.link.up else 0, 1 if a.cfg.tls else 0)
out("done", 1)
